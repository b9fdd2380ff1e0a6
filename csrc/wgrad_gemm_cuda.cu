// amsp_fused::wgrad_accumulate on CUDA (schema and CPU version: csrc/fused_cpu.cpp; the caller:
// amsp/wgrad_fusion.py): a linear layer's weight gradient accumulated into its fp32 gradient buffer by one
// cuBLAS GEMM with bf16 (or fp16) operands, fp32 accumulation and an fp32 output read and written in place
// (beta = 1; beta = 0 writes over), which is what Megatron-LM's gradient_accumulation_fusion does. torch
// has no such call: addmm with out_dtype=float32 needs `self` in the operands' dtype and writes it over
// the output before the product, so it cannot add into an fp32 buffer.
//
// A library of its own (csrc/loader.py WGRAD_EXTENSION), because it needs cuBLAS's headers, which a CUDA
// toolkit may lack (torch's pip wheels bring them in site-packages/nvidia/...): if it cannot be built, only
// amsp.fuse_wgrad is lost, not the fused kernels of csrc/fused_cuda.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublas_v2.h>
#include <torch/library.h>

#include <climits>
#include <mutex>
#include <unordered_map>

namespace {

// One cuBLAS handle per device, made here rather than borrowed from torch: ATen's accessor is declared in a
// header that also needs cuSPARSE's, cuSOLVER's and cuDSS's headers, and its signature has changed between
// torch versions. cuBLAS gives a handle its own default workspace. Handles live as long as the process.
cublasHandle_t handle_for(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, cublasHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it != handles.end()) {
    return it->second;
  }
  cublasHandle_t handle = nullptr;
  const cublasStatus_t status = cublasCreate(&handle);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "amsp_fused::wgrad_accumulate: cublasCreate failed: ",
              cublasGetStatusString(status));
  handles.emplace(device, handle);
  return handle;
}

cudaDataType_t operand_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "amsp_fused::wgrad_accumulate: operands of dtype ", t, " are not supported");
  }
}

// acc (out x in, row-major) = gy^T @ x (+ acc). Read column-major, acc is C = x^T gy (in x out, ldc = in);
// x (tokens x in, row-major) is A = x^T as stored (in x tokens, lda = in, no transpose); gy (tokens x out,
// row-major) is stored as gy^T (out x tokens, ldb = out), taken transposed.
void wgrad_accumulate_cuda(const at::Tensor& x, const at::Tensor& gy, const at::Tensor& acc, bool overwrite) {
  TORCH_CHECK(x.is_cuda() && gy.is_cuda() && acc.is_cuda(), "amsp_fused::wgrad_accumulate: CUDA tensors expected");
  TORCH_CHECK(x.dim() == 2 && gy.dim() == 2 && acc.dim() == 2,
              "amsp_fused::wgrad_accumulate: x, gy and acc must be matrices");
  TORCH_CHECK(x.scalar_type() == gy.scalar_type(), "amsp_fused::wgrad_accumulate: x and gy differ in dtype");
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              "amsp_fused::wgrad_accumulate: the accumulator must be a contiguous float32 tensor");
  const int64_t tokens = x.size(0), in = x.size(1), out = gy.size(1);
  TORCH_CHECK(gy.size(0) == tokens && acc.size(0) == out && acc.size(1) == in,
              "amsp_fused::wgrad_accumulate: shapes x ", x.sizes(), ", gy ", gy.sizes(), ", acc ", acc.sizes(),
              " do not give acc = gy^T @ x");
  TORCH_CHECK(tokens <= INT_MAX && in <= INT_MAX && out <= INT_MAX,
              "amsp_fused::wgrad_accumulate: dimensions beyond cuBLAS's 32-bit sizes");
  if (acc.numel() == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(acc.device());
  if (tokens == 0) {  // an empty sum
    if (overwrite) {
      acc.zero_();
    }
    return;
  }
  const auto xc = x.contiguous();
  const auto gc = gy.contiguous();
  const cudaDataType_t t = operand_type(x.scalar_type());
  const float alpha = 1.0f;
  const float beta = overwrite ? 0.0f : 1.0f;
  // The handle torch keeps for this device, bound to the current stream (and its workspace).
  cublasHandle_t handle = handle_for(acc.device().index());
  cublasStatus_t status = cublasSetStream(handle, c10::cuda::getCurrentCUDAStream(acc.device().index()).stream());
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "amsp_fused::wgrad_accumulate: cublasSetStream failed: ",
              cublasGetStatusString(status));
  status = cublasGemmEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(in), static_cast<int>(out), static_cast<int>(tokens), &alpha,
      xc.const_data_ptr(), t, static_cast<int>(in), gc.const_data_ptr(), t, static_cast<int>(out), &beta,
      acc.data_ptr(), CUDA_R_32F, static_cast<int>(in), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "amsp_fused::wgrad_accumulate: cublasGemmEx failed: ",
              cublasGetStatusString(status));
}

}  // namespace

TORCH_LIBRARY_IMPL(amsp_fused, CUDA, m) {
  m.impl("wgrad_accumulate", &wgrad_accumulate_cuda);
}
