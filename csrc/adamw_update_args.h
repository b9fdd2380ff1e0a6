// The argument rules of amsp_fused::adamw_update, shared by its CPU (csrc/fused_cpu.cpp) and CUDA
// (csrc/fused_cuda.cu) versions: contiguous float32 param, grad and moments of one size on one device, an
// optional output of that size (empty: no weights to write), an optional float32 scalar clip scale there.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace amsp_csrc {

inline void check_adamw_update_args(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                    const at::Tensor& exp_avg_sq, const at::Tensor& out,
                                    const std::optional<at::Tensor>& grad_scale) {
  const int64_t n = param.numel();
  for (const at::Tensor* t : {&param, &grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n &&
                t->device() == param.device(),
                "amsp_fused::adamw_update: param, grad and moments must be contiguous float32 tensors of one size "
                "on one device");
  }
  TORCH_CHECK(out.numel() == 0 || (out.numel() == n && out.is_contiguous() && out.device() == param.device()),
              "amsp_fused::adamw_update: out must be empty or a contiguous tensor of the parameter's size");
  TORCH_CHECK(!grad_scale.has_value() || (grad_scale->numel() == 1 && grad_scale->scalar_type() == at::kFloat &&
                                          grad_scale->device() == param.device()),
              "amsp_fused::adamw_update: grad_scale must be a float32 scalar on the parameter's device");
}

}  // namespace amsp_csrc
