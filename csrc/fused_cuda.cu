// CUDA kernels for the amsp_fused ops (schemas are defined in fused_cpu.cpp; this file only adds
// CUDA implementations, so the CPU extension must be loaded first). Same numerics as the CPU
// kernels: low-precision storage, float math, one rounding on output.
//
// Built only where nvcc and a CUDA build of torch exist (csrc/loader.py); never compiled on the
// project's CPU machines, so it is kept deliberately plain: one block per row for the row-wise
// reductions, grid-stride loops for the elementwise ops, cuBLAS (at::mm) for the matmuls.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>  // the current stream only: CUDAContext.h would pull in cuBLAS/cuSPARSE headers
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include "adamw_update_args.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace {

constexpr int kThreads = 256;

template <typename acc_t>
__device__ acc_t block_sum(acc_t v, acc_t* shared) {
  // Warp shuffle, then one value per warp through shared memory.
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffff, v, off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : acc_t(0);
  if (warp == 0) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffff, v, off);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  v = shared[0];
  __syncthreads();
  return v;
}

template <typename acc_t>
__device__ acc_t block_max(acc_t v, acc_t* shared) {
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_down_sync(0xffffffff, v, off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : -INFINITY;
  if (warp == 0) {
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_down_sync(0xffffffff, v, off));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  v = shared[0];
  __syncthreads();
  return v;
}

// 16-byte accesses: the row and elementwise kernels below load and store 16 bytes at a time (8 bf16/fp16,
// 4 float, 2 double values) where the pointers and sizes allow; the scalar kernels take what is left
// (misaligned views, sizes that are not a multiple of the vector). The first, scalar-only versions ran at
// about a third of an H100's bandwidth on a 1.88B step's activations (profiled, per call: rope 58 us,
// RMSNorm forward 58 us and backward 69 us on 4096 x 4096 bf16, SwiGLU forward 134 us and backward
// 188 us on 4096 x 11008; about 29 ms of a 394 ms step). Per element the math is the scalar kernels'.
template <typename scalar_t>
struct alignas(16) Vec16 {
  static constexpr int N = 16 / sizeof(scalar_t);
  scalar_t v[N];
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// M values of T in one access (the rotary tables' entries for one vector's pairs).
template <typename T, int M>
struct alignas(sizeof(T) * M) Pack {
  T v[M];
};

// ---------------------------------------------------------------- RMSNorm
template <typename scalar_t, typename acc_t>
__global__ void rms_fwd_kernel(const scalar_t* x, const scalar_t* w, scalar_t* y, acc_t* rstd, int64_t D, acc_t eps) {
  __shared__ acc_t shared[32];
  const int64_t r = blockIdx.x;
  const scalar_t* xr = x + r * D;
  acc_t ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const acc_t v = static_cast<acc_t>(xr[i]);
    ss += v * v;
  }
  ss = block_sum(ss, shared);
  const acc_t rs = acc_t(1) / sqrt(ss / acc_t(D) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const acc_t n = static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(xr[i]) * rs));
    y[r * D + i] = static_cast<scalar_t>(n * static_cast<acc_t>(w[i]));
  }
}

template <typename scalar_t, typename acc_t>
__global__ void rms_bwd_dx_kernel(const scalar_t* dy, const scalar_t* x, const scalar_t* w, const acc_t* rstd,
                                  scalar_t* dx, int64_t D) {
  __shared__ acc_t shared[32];
  const int64_t r = blockIdx.x;
  const acc_t rs = rstd[r];
  acc_t dot = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const acc_t g = static_cast<acc_t>(dy[r * D + i]) * static_cast<acc_t>(w[i]);
    dot += g * static_cast<acc_t>(x[r * D + i]) * rs;
  }
  const acc_t mean = block_sum(dot, shared) / acc_t(D);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const acc_t g = static_cast<acc_t>(dy[r * D + i]) * static_cast<acc_t>(w[i]);
    const acc_t n = static_cast<acc_t>(x[r * D + i]) * rs;
    dx[r * D + i] = static_cast<scalar_t>(rs * (g - n * mean));
  }
}

// rms_fwd_kernel with 16-byte accesses: D a multiple of the vector, x, w and y 16-byte aligned.
template <typename scalar_t, typename acc_t>
__global__ void rms_fwd_vec_kernel(const scalar_t* x, const scalar_t* w, scalar_t* y, acc_t* rstd, int64_t D,
                                   acc_t eps) {
  using V = Vec16<scalar_t>;
  __shared__ acc_t shared[32];
  const int64_t r = blockIdx.x;
  const int DV = static_cast<int>(D / V::N);
  const V* xr = reinterpret_cast<const V*>(x + r * D);
  const V* wv = reinterpret_cast<const V*>(w);
  V* yr = reinterpret_cast<V*>(y + r * D);
  acc_t ss = 0;
  for (int j = threadIdx.x; j < DV; j += blockDim.x) {
    const V xv = xr[j];
#pragma unroll
    for (int k = 0; k < V::N; ++k) {
      const acc_t v = static_cast<acc_t>(xv.v[k]);
      ss += v * v;
    }
  }
  ss = block_sum(ss, shared);
  const acc_t rs = acc_t(1) / sqrt(ss / acc_t(D) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  for (int j = threadIdx.x; j < DV; j += blockDim.x) {
    const V xv = xr[j], ww = wv[j];
    V out;
#pragma unroll
    for (int k = 0; k < V::N; ++k) {
      const acc_t n = static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(xv.v[k]) * rs));
      out.v[k] = static_cast<scalar_t>(n * static_cast<acc_t>(ww.v[k]));
    }
    yr[j] = out;
  }
}

// rms_bwd_dx_kernel with 16-byte accesses (same conditions, dy and dx too).
template <typename scalar_t, typename acc_t>
__global__ void rms_bwd_dx_vec_kernel(const scalar_t* dy, const scalar_t* x, const scalar_t* w, const acc_t* rstd,
                                      scalar_t* dx, int64_t D) {
  using V = Vec16<scalar_t>;
  __shared__ acc_t shared[32];
  const int64_t r = blockIdx.x;
  const acc_t rs = rstd[r];
  const int DV = static_cast<int>(D / V::N);
  const V* dyr = reinterpret_cast<const V*>(dy + r * D);
  const V* xr = reinterpret_cast<const V*>(x + r * D);
  const V* wv = reinterpret_cast<const V*>(w);
  V* dxr = reinterpret_cast<V*>(dx + r * D);
  acc_t dot = 0;
  for (int j = threadIdx.x; j < DV; j += blockDim.x) {
    const V gv = dyr[j], xv = xr[j], ww = wv[j];
#pragma unroll
    for (int k = 0; k < V::N; ++k) {
      const acc_t g = static_cast<acc_t>(gv.v[k]) * static_cast<acc_t>(ww.v[k]);
      dot += g * static_cast<acc_t>(xv.v[k]) * rs;
    }
  }
  const acc_t mean = block_sum(dot, shared) / acc_t(D);
  for (int j = threadIdx.x; j < DV; j += blockDim.x) {
    const V gv = dyr[j], xv = xr[j], ww = wv[j];
    V out;
#pragma unroll
    for (int k = 0; k < V::N; ++k) {
      const acc_t g = static_cast<acc_t>(gv.v[k]) * static_cast<acc_t>(ww.v[k]);
      const acc_t n = static_cast<acc_t>(xv.v[k]) * rs;
      out.v[k] = static_cast<scalar_t>(rs * (g - n * mean));
    }
    dxr[j] = out;
  }
}

// partial[c, d] = sum over rows r of chunk c of dy[r, d] * round(x[r, d] * rstd[r]); dw = partial.sum(0).
// A grid of (column blocks x row chunks), each thread one column of one chunk: coalesced and
// deterministic. One thread per column over all rows (the first version) gave 16 blocks on a 132-SM
// H100 for dim 4096 and took 1.2 ms per call, 80 ms of an eager 1.88B step (profiled).
// At least 32 rows a chunk; more where the rows would need over 65535 chunks (the grid's y limit).
int64_t dw_rows_per_chunk(int64_t N) { return std::max<int64_t>(32, (N + 65534) / 65535); }

template <typename scalar_t, typename acc_t>
__global__ void rms_bwd_dw_kernel(const scalar_t* dy, const scalar_t* x, const acc_t* rstd, acc_t* partial,
                                  int64_t N, int64_t D, int64_t rows_per_chunk) {
  const int64_t d = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (d >= D) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  acc_t acc = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const acc_t n = static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(x[r * D + d]) * rstd[r]));
    acc += static_cast<acc_t>(dy[r * D + d]) * n;
  }
  partial[blockIdx.y * D + d] = acc;
}

// rms_bwd_dw_kernel with 16-byte accesses: each thread N adjacent columns of one chunk, the rows in the
// same order, so the partial sums are the scalar kernel's to the bit.
template <typename scalar_t, typename acc_t>
__global__ void rms_bwd_dw_vec_kernel(const scalar_t* dy, const scalar_t* x, const acc_t* rstd, acc_t* partial,
                                      int64_t rows, int64_t D, int64_t rows_per_chunk) {
  using V = Vec16<scalar_t>;
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;  // the vector of columns
  if (j >= D / V::N) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  acc_t acc[V::N];
#pragma unroll
  for (int k = 0; k < V::N; ++k) acc[k] = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const V xv = reinterpret_cast<const V*>(x + r * D)[j];
    const V gv = reinterpret_cast<const V*>(dy + r * D)[j];
    const acc_t rs = rstd[r];
#pragma unroll
    for (int k = 0; k < V::N; ++k) {
      const acc_t n = static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(xv.v[k]) * rs));
      acc[k] += static_cast<acc_t>(gv.v[k]) * n;
    }
  }
#pragma unroll
  for (int k = 0; k < V::N; ++k) partial[blockIdx.y * D + j * V::N + k] = acc[k];
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cuda(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 1 && w_in.size(0) == x_in.size(1) &&
                  x_in.scalar_type() == w_in.scalar_type(),
              "amsp_fused::rms_norm_fwd: x (rows, dim) and weight (dim,) of one dtype");
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  const int64_t N = x.size(0), D = x.size(1);
  auto y = at::empty_like(x);
  auto rstd = at::empty({N}, x.options().dtype(at::toOpMathType(x.scalar_type())));
  if (N == 0) return {y, rstd};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    if (D % Vec16<scalar_t>::N == 0 && aligned16(xp) && aligned16(wp) && aligned16(yp)) {
      rms_fwd_vec_kernel<scalar_t, acc_t><<<N, kThreads, 0, stream>>>(xp, wp, yp, rstd.mutable_data_ptr<acc_t>(), D,
                                                                      static_cast<acc_t>(eps));
    } else {
      rms_fwd_kernel<scalar_t, acc_t><<<N, kThreads, 0, stream>>>(xp, wp, yp, rstd.mutable_data_ptr<acc_t>(), D,
                                                                  static_cast<acc_t>(eps));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                     const at::Tensor& w_in, const at::Tensor& rstd_in) {
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  auto dy = dy_in.contiguous().to(x.scalar_type());
  auto rstd = rstd_in.contiguous();
  const int64_t N = x.size(0), D = x.size(1);
  auto dx = at::empty_like(x);
  const int64_t rows_per_chunk = dw_rows_per_chunk(N);
  const int64_t chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  auto partial = at::empty({chunks, D}, x.options().dtype(rstd.scalar_type()));
  if (N > 0) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const scalar_t* wp = w.const_data_ptr<scalar_t>();
      scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
      constexpr int V = Vec16<scalar_t>::N;
      const bool vec_rows = D % V == 0 && aligned16(dyp) && aligned16(xp);
      if (vec_rows && aligned16(wp) && aligned16(dxp)) {
        rms_bwd_dx_vec_kernel<scalar_t, acc_t><<<N, kThreads, 0, stream>>>(dyp, xp, wp, rstd.const_data_ptr<acc_t>(),
                                                                           dxp, D);
      } else {
        rms_bwd_dx_kernel<scalar_t, acc_t><<<N, kThreads, 0, stream>>>(dyp, xp, wp, rstd.const_data_ptr<acc_t>(), dxp,
                                                                       D);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      acc_t* pp = partial.mutable_data_ptr<acc_t>();
      if (vec_rows) {
        const dim3 grid((D / V + kThreads - 1) / kThreads, chunks);
        rms_bwd_dw_vec_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(dyp, xp, rstd.const_data_ptr<acc_t>(), pp,
                                                                              N, D, rows_per_chunk);
      } else {
        const dim3 grid((D + kThreads - 1) / kThreads, chunks);
        rms_bwd_dw_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(dyp, xp, rstd.const_data_ptr<acc_t>(), pp, N,
                                                                          D, rows_per_chunk);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  auto dw = N > 0 ? partial.sum(0) : at::zeros({D}, partial.options());
  return {dx, dw.to(w.scalar_type())};
}

// ---------------------------------------------------------------- gradient accumulation
// acc (fp32) = grad or acc + grad, four elements per thread and iteration (one 16-byte float4 of the
// accumulator, 8 bytes of a bf16/fp16 gradient). torch's add_ of a bf16 tensor into fp32 takes its
// unvectorised mixed-dtype path: 69 ms of a 446 ms compiled 1.88B step on an H100 (profiled), about
// 3x this pass's bytes at the card's bandwidth.
template <typename scalar_t>
struct alignas(4 * sizeof(scalar_t)) Vec4 {
  scalar_t v[4];
};

template <typename scalar_t>
__global__ void accumulate_vec4_kernel(float* __restrict__ acc, const scalar_t* __restrict__ grad, int64_t n4,
                                       bool overwrite) {
  auto* acc4 = reinterpret_cast<float4*>(acc);
  const auto* grad4 = reinterpret_cast<const Vec4<scalar_t>*>(grad);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    const Vec4<scalar_t> g = grad4[i];
    const float g0 = static_cast<float>(g.v[0]), g1 = static_cast<float>(g.v[1]);
    const float g2 = static_cast<float>(g.v[2]), g3 = static_cast<float>(g.v[3]);
    float4 a;
    if (overwrite) {
      a = make_float4(g0, g1, g2, g3);
    } else {
      a = acc4[i];
      a.x += g0;
      a.y += g1;
      a.z += g2;
      a.w += g3;
    }
    acc4[i] = a;
  }
}

// The elements the vectorised pass does not cover (all of them when a pointer is misaligned).
template <typename scalar_t>
__global__ void accumulate_scalar_kernel(float* acc, const scalar_t* grad, int64_t begin, int64_t n, bool overwrite) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float g = static_cast<float>(grad[i]);
    acc[i] = overwrite ? g : acc[i] + g;
  }
}

int blocks_for(int64_t work) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 4096)));
}

void accumulate_grad_cuda(const at::Tensor& acc, const at::Tensor& grad_in, bool overwrite) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.dim() == 1 && acc.is_contiguous(),
              "amsp_fused::accumulate_grad: the accumulator must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(grad_in.numel() == acc.numel(), "amsp_fused::accumulate_grad: ", grad_in.numel(),
              " gradient elements for an accumulator of ", acc.numel());
  TORCH_CHECK(grad_in.device() == acc.device(), "amsp_fused::accumulate_grad: gradient on ", grad_in.device(),
              ", accumulator on ", acc.device());
  const auto grad = grad_in.contiguous();
  const int64_t n = acc.numel();
  if (n == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "accumulate_grad_cuda", [&] {
    float* a = acc.mutable_data_ptr<float>();
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const bool aligned = reinterpret_cast<uintptr_t>(a) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(g) % (4 * sizeof(scalar_t)) == 0;
    const int64_t n4 = aligned ? n / 4 : 0;
    if (n4 > 0) {
      accumulate_vec4_kernel<scalar_t><<<blocks_for(n4), kThreads, 0, stream>>>(a, g, n4, overwrite);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (n4 * 4 < n) {
      accumulate_scalar_kernel<scalar_t><<<blocks_for(n - n4 * 4), kThreads, 0, stream>>>(a, g, n4 * 4, n,
                                                                                          overwrite);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

// ---------------------------------------------------------------- AdamW on one OS-shard run
// amsp_fused::adamw_update (schema and the CPU version: csrc/fused_cpu.cpp; the caller: amsp/sharded_optim.py):
// torch's fused AdamW arithmetic over fp32 param / grad / moments in one pass, four elements per thread and
// iteration (16-byte accesses), the gradient divided by the clip scale but not written back, and the new
// weights also stored in the compute dtype when `out` is given: 30 bytes a parameter (bf16 out) where
// torch's _fused_adamw_ (which writes the scaled gradient back) and the separate cast moved 38.
struct AdamWArgs {
  float lr, weight_decay, beta1, beta2, eps, step_size, bias_correction2_sqrt;
};

__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v, const AdamWArgs& a) {
  if (a.weight_decay != 0.f) {
    p -= a.lr * a.weight_decay * p;  // decoupled decay, before the moments, as torch's kernel
  }
  m = a.beta1 * m + (1.f - a.beta1) * g;
  v = a.beta2 * v + (1.f - a.beta2) * g * g;
  p -= a.step_size * m / (sqrtf(v) / a.bias_correction2_sqrt + a.eps);
}

template <typename out_t>
__global__ void adamw_vec4_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                                  float* __restrict__ v, out_t* __restrict__ out, const float* __restrict__ scale,
                                  int64_t n4, AdamWArgs a) {
  auto* p4 = reinterpret_cast<float4*>(param);
  const auto* g4 = reinterpret_cast<const float4*>(grad);
  auto* m4 = reinterpret_cast<float4*>(m);
  auto* v4 = reinterpret_cast<float4*>(v);
  auto* o4 = reinterpret_cast<Vec4<out_t>*>(out);
  const float s = scale != nullptr ? *scale : 1.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    float4 p = p4[i], g = g4[i], mm = m4[i], vv = v4[i];
    adamw_element(p.x, g.x / s, mm.x, vv.x, a);
    adamw_element(p.y, g.y / s, mm.y, vv.y, a);
    adamw_element(p.z, g.z / s, mm.z, vv.z, a);
    adamw_element(p.w, g.w / s, mm.w, vv.w, a);
    p4[i] = p;
    m4[i] = mm;
    v4[i] = vv;
    if (out != nullptr) {
      Vec4<out_t> o;
      o.v[0] = static_cast<out_t>(p.x);
      o.v[1] = static_cast<out_t>(p.y);
      o.v[2] = static_cast<out_t>(p.z);
      o.v[3] = static_cast<out_t>(p.w);
      o4[i] = o;
    }
  }
}

// Elements [begin, n): all of them when a pointer is misaligned, else the tail after the vectors.
template <typename out_t>
__global__ void adamw_scalar_kernel(float* param, const float* grad, float* m, float* v, out_t* out,
                                    const float* scale, int64_t begin, int64_t n, AdamWArgs a) {
  const float s = scale != nullptr ? *scale : 1.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float p = param[i], mm = m[i], vv = v[i];
    adamw_element(p, grad[i] / s, mm, vv, a);
    param[i] = p;
    m[i] = mm;
    v[i] = vv;
    if (out != nullptr) {
      out[i] = static_cast<out_t>(p);
    }
  }
}

void adamw_update_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const at::Tensor& out, const std::optional<at::Tensor>& grad_scale,
                       double lr, double weight_decay, double beta1, double beta2, double eps, double step_size,
                       double bias_correction2_sqrt) {
  amsp_csrc::check_adamw_update_args(param, grad, exp_avg, exp_avg_sq, out, grad_scale);
  TORCH_CHECK(param.is_cuda(), "amsp_fused::adamw_update: CUDA tensors expected");
  const int64_t n = param.numel();
  const float* scale = grad_scale.has_value() ? grad_scale->const_data_ptr<float>() : nullptr;
  if (n == 0) return;
  const AdamWArgs a{static_cast<float>(lr), static_cast<float>(weight_decay), static_cast<float>(beta1),
                    static_cast<float>(beta2), static_cast<float>(eps), static_cast<float>(step_size),
                    static_cast<float>(bias_correction2_sqrt)};
  auto stream = c10::cuda::getCurrentCUDAStream();
  const at::ScalarType out_type = out.numel() > 0 ? out.scalar_type() : at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_type, "adamw_update_cuda", [&] {
    float* p = param.mutable_data_ptr<float>();
    const float* g = grad.const_data_ptr<float>();
    float* m = exp_avg.mutable_data_ptr<float>();
    float* v = exp_avg_sq.mutable_data_ptr<float>();
    scalar_t* o = out.numel() > 0 ? out.mutable_data_ptr<scalar_t>() : nullptr;
    const auto a16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
    const bool aligned = a16(p) && a16(g) && a16(m) && a16(v) &&
                         (o == nullptr || reinterpret_cast<uintptr_t>(o) % (4 * sizeof(scalar_t)) == 0);
    const int64_t n4 = aligned ? n / 4 : 0;
    if (n4 > 0) {
      adamw_vec4_kernel<scalar_t><<<blocks_for(n4), kThreads, 0, stream>>>(p, g, m, v, o, scale, n4, a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (n4 * 4 < n) {
      adamw_scalar_kernel<scalar_t><<<blocks_for(n - n4 * 4), kThreads, 0, stream>>>(p, g, m, v, o, scale, n4 * 4,
                                                                                      n, a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

// ---------------------------------------------------------------- rotary embedding
template <typename scalar_t, typename acc_t>
__global__ void rope_kernel(const scalar_t* x, const acc_t* cs, const acc_t* sn, scalar_t* out, int64_t n_pairs,
                            int64_t S, int64_t H, int64_t D2, acc_t sign) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n_pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % D2;
    const int64_t s = (p / (D2 * H)) % S;
    const acc_t c = cs[s * D2 + i], si = sign * sn[s * D2 + i];
    const acc_t x0 = static_cast<acc_t>(x[2 * p]), x1 = static_cast<acc_t>(x[2 * p + 1]);
    out[2 * p] = static_cast<scalar_t>(x0 * c - x1 * si);
    out[2 * p + 1] = static_cast<scalar_t>(x0 * si + x1 * c);
  }
}

// rope_kernel with 16-byte accesses, a block per (batch, position) row of H * D elements: each vector holds
// N/2 whole pairs of one head (D a multiple of N), so one position and one table offset serve all of them,
// read as one access of each table (their rows start at multiples of N/2 entries; the host checks the
// tables' own alignment), and the 64-bit divisions the scalar kernel does per pair are done once per row.
template <typename scalar_t, typename acc_t>
__global__ void rope_vec_kernel(const scalar_t* x, const acc_t* cs, const acc_t* sn, scalar_t* out, int64_t rows,
                                int64_t S, int row_vecs, int D, acc_t sign) {
  using V = Vec16<scalar_t>;
  using P = Pack<acc_t, V::N / 2>;
  const int D2 = D / 2;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t s = row % S;
    const acc_t* c_row = cs + s * D2;
    const acc_t* s_row = sn + s * D2;
    const V* xr = reinterpret_cast<const V*>(x) + row * row_vecs;
    V* orow = reinterpret_cast<V*>(out) + row * row_vecs;
    for (int j = threadIdx.x; j < row_vecs; j += blockDim.x) {
      const int i0 = ((j * V::N) % D) / 2;
      const V xv = xr[j];
      const P cv = *reinterpret_cast<const P*>(c_row + i0), sv = *reinterpret_cast<const P*>(s_row + i0);
      V o;
#pragma unroll
      for (int k = 0; k < V::N / 2; ++k) {
        const acc_t c = cv.v[k], si = sign * sv.v[k];
        const acc_t x0 = static_cast<acc_t>(xv.v[2 * k]), x1 = static_cast<acc_t>(xv.v[2 * k + 1]);
        o.v[2 * k] = static_cast<scalar_t>(x0 * c - x1 * si);
        o.v[2 * k + 1] = static_cast<scalar_t>(x0 * si + x1 * c);
      }
      orow[j] = o;
    }
  }
}

at::Tensor rope_rotate_cuda(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, bool inverse) {
  TORCH_CHECK(x_in.dim() == 4 && x_in.size(3) % 2 == 0, "amsp_fused::rope: x must be (batch, seq, heads, even head_dim)");
  const int64_t S = x_in.size(1), H = x_in.size(2), D2 = x_in.size(3) / 2;
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(0) >= S && cos_in.size(1) == D2 && sin_in.sizes() == cos_in.sizes(),
              "amsp_fused::rope: cos/sin must be (seq, head_dim/2)");
  auto x = x_in.contiguous();
  auto acc_type = at::toOpMathType(x.scalar_type());
  auto cs = cos_in.to(acc_type).contiguous();
  auto sn = sin_in.to(acc_type).contiguous();
  auto out = at::empty_like(x);
  const int64_t n_pairs = x.numel() / 2;
  if (n_pairs == 0) return out;
  const int blocks = static_cast<int>(std::min<int64_t>((n_pairs + kThreads - 1) / kThreads, 65535));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const int64_t D = 2 * D2, rows = x.size(0) * S;
    auto stream = c10::cuda::getCurrentCUDAStream();
    constexpr int N = Vec16<scalar_t>::N;
    const auto table_aligned = [](const void* p) {
      return reinterpret_cast<uintptr_t>(p) % (sizeof(acc_t) * N / 2) == 0;
    };
    if (D % N == 0 && H * D / N <= INT32_MAX && aligned16(xp) && aligned16(op) &&
        table_aligned(cs.const_data_ptr<acc_t>()) && table_aligned(sn.const_data_ptr<acc_t>())) {
      const int row_vecs = static_cast<int>(H * D / N);
      rope_vec_kernel<scalar_t, acc_t><<<static_cast<int>(std::min<int64_t>(rows, 65535)), kThreads, 0, stream>>>(
          xp, cs.const_data_ptr<acc_t>(), sn.const_data_ptr<acc_t>(), op, rows, S, row_vecs, static_cast<int>(D),
          inverse ? acc_t(-1) : acc_t(1));
    } else {
      rope_kernel<scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(
          xp, cs.const_data_ptr<acc_t>(), sn.const_data_ptr<acc_t>(), op, n_pairs, S, H, D2,
          inverse ? acc_t(-1) : acc_t(1));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor rope_fwd_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_rotate_cuda(x, cos, sin, false);
}

at::Tensor rope_bwd_cuda(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_rotate_cuda(dy, cos, sin, true);
}

// ---------------------------------------------------------------- SwiGLU
// Elements [begin, n): all of them where a pointer is misaligned, else the tail after the vectors.
template <typename scalar_t, typename acc_t>
__global__ void swiglu_fwd_kernel(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t begin, int64_t n) {
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const acc_t av = static_cast<acc_t>(a[i]);
    y[i] = static_cast<scalar_t>(av / (acc_t(1) + exp(-av)) * static_cast<acc_t>(b[i]));
  }
}

template <typename scalar_t, typename acc_t>
__global__ void swiglu_bwd_kernel(const scalar_t* dy, const scalar_t* a, const scalar_t* b, scalar_t* da,
                                  scalar_t* db, int64_t begin, int64_t n) {
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const acc_t av = static_cast<acc_t>(a[i]), bv = static_cast<acc_t>(b[i]), g = static_cast<acc_t>(dy[i]);
    const acc_t sig = acc_t(1) / (acc_t(1) + exp(-av));
    db[i] = static_cast<scalar_t>(g * av * sig);
    da[i] = static_cast<scalar_t>(g * bv * sig * (acc_t(1) + av * (acc_t(1) - sig)));
  }
}

// The first nv vectors of a, b (and dy) with 16-byte accesses; the scalar kernels above do the rest.
template <typename scalar_t, typename acc_t>
__global__ void swiglu_fwd_vec_kernel(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t nv) {
  using V = Vec16<scalar_t>;
  const V* av = reinterpret_cast<const V*>(a);
  const V* bv = reinterpret_cast<const V*>(b);
  V* yv = reinterpret_cast<V*>(y);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv; i += int64_t(gridDim.x) * blockDim.x) {
    const V A = av[i], B = bv[i];
    V Y;
#pragma unroll
    for (int k = 0; k < V::N; ++k) {
      const acc_t x = static_cast<acc_t>(A.v[k]);
      Y.v[k] = static_cast<scalar_t>(x / (acc_t(1) + exp(-x)) * static_cast<acc_t>(B.v[k]));
    }
    yv[i] = Y;
  }
}

template <typename scalar_t, typename acc_t>
__global__ void swiglu_bwd_vec_kernel(const scalar_t* dy, const scalar_t* a, const scalar_t* b, scalar_t* da,
                                      scalar_t* db, int64_t nv) {
  using V = Vec16<scalar_t>;
  const V* gv = reinterpret_cast<const V*>(dy);
  const V* av = reinterpret_cast<const V*>(a);
  const V* bv = reinterpret_cast<const V*>(b);
  V* dav = reinterpret_cast<V*>(da);
  V* dbv = reinterpret_cast<V*>(db);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv; i += int64_t(gridDim.x) * blockDim.x) {
    const V G = gv[i], A = av[i], B = bv[i];
    V DA, DB;
#pragma unroll
    for (int k = 0; k < V::N; ++k) {
      const acc_t x = static_cast<acc_t>(A.v[k]), y = static_cast<acc_t>(B.v[k]), g = static_cast<acc_t>(G.v[k]);
      const acc_t sig = acc_t(1) / (acc_t(1) + exp(-x));
      DB.v[k] = static_cast<scalar_t>(g * x * sig);
      DA.v[k] = static_cast<scalar_t>(g * y * sig * (acc_t(1) + x * (acc_t(1) - sig)));
    }
    dav[i] = DA;
    dbv[i] = DB;
  }
}

// Vectors the swiglu kernels may take: all whole vectors when every pointer is 16-byte aligned, else none.
template <typename scalar_t>
int64_t swiglu_vectors(int64_t n, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (!aligned16(p)) return 0;
  }
  return n / Vec16<scalar_t>::N;
}

int elementwise_blocks(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)));
}

at::Tensor swiglu_fwd_cuda(const at::Tensor& a_in, const at::Tensor& b_in) {
  TORCH_CHECK(a_in.sizes() == b_in.sizes() && a_in.scalar_type() == b_in.scalar_type(),
              "amsp_fused::swiglu: a and b must have the same shape and dtype");
  auto a = a_in.contiguous();
  auto b = b_in.contiguous();
  auto y = at::empty_like(a);
  const int64_t n = a.numel();
  if (n == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "swiglu_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t nv = swiglu_vectors<scalar_t>(n, {ap, bp, yp});
    if (nv > 0) {
      swiglu_fwd_vec_kernel<scalar_t, acc_t><<<elementwise_blocks(nv), kThreads, 0, stream>>>(ap, bp, yp, nv);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const int64_t begin = nv * Vec16<scalar_t>::N;
    if (begin < n) {
      swiglu_fwd_kernel<scalar_t, acc_t><<<elementwise_blocks(n - begin), kThreads, 0, stream>>>(ap, bp, yp, begin, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cuda(const at::Tensor& dy_in, const at::Tensor& a_in,
                                                   const at::Tensor& b_in) {
  auto a = a_in.contiguous();
  auto b = b_in.contiguous();
  auto dy = dy_in.contiguous().to(a.scalar_type());
  auto da = at::empty_like(a);
  auto db = at::empty_like(b);
  const int64_t n = a.numel();
  if (n == 0) return {da, db};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "swiglu_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = dy.const_data_ptr<scalar_t>();
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    scalar_t* dap = da.mutable_data_ptr<scalar_t>();
    scalar_t* dbp = db.mutable_data_ptr<scalar_t>();
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t nv = swiglu_vectors<scalar_t>(n, {gp, ap, bp, dap, dbp});
    if (nv > 0) {
      swiglu_bwd_vec_kernel<scalar_t, acc_t><<<elementwise_blocks(nv), kThreads, 0, stream>>>(gp, ap, bp, dap, dbp,
                                                                                             nv);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const int64_t begin = nv * Vec16<scalar_t>::N;
    if (begin < n) {
      swiglu_bwd_kernel<scalar_t, acc_t><<<elementwise_blocks(n - begin), kThreads, 0, stream>>>(gp, ap, bp, dap, dbp,
                                                                                                 begin, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {da, db};
}

// ---------------------------------------------------------------- linear + cross-entropy
// One block per row of a (C, V) logits chunk (already widened to acc_t): loss_row and, when asked,
// the row's gradient (softmax - onehot) * scale written over the logits. `scale` (1 / the number of
// non-ignored targets) is read from device memory: the host never waits for it.
template <typename acc_t>
__global__ void ce_rows_kernel(acc_t* logits, const int64_t* targets, acc_t* row_loss, int64_t V,
                               int64_t ignore_index, const acc_t* scale_ptr, bool compute_grad) {
  __shared__ acc_t shared[32];
  const int64_t r = blockIdx.x;
  acc_t* x = logits + r * V;
  const int64_t t = targets[r];
  if (t == ignore_index) {
    if (threadIdx.x == 0) row_loss[r] = 0;
    if (compute_grad) {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) x[j] = 0;
    }
    return;
  }
  // Checked here rather than on the host, which would wait for the GPU at every call: a device-side
  // assert, as F.cross_entropy's CUDA kernel raises for the same input.
  CUDA_KERNEL_ASSERT_MSG(t >= 0 && t < V, "amsp_fused::linear_cross_entropy: a target is out of range [0, vocab)");
  const acc_t scale = *scale_ptr;
  acc_t mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = max(mx, x[j]);
  mx = block_max(mx, shared);
  acc_t se = 0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) se += exp(x[j] - mx);
  se = block_sum(se, shared);
  const acc_t lse = mx + log(se);
  if (threadIdx.x == 0) row_loss[r] = lse - x[t];
  __syncthreads();  // x[t] is read above before any thread overwrites it below
  if (compute_grad) {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      x[j] = exp(x[j] - lse) * scale - (j == t ? scale : acc_t(0));
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_cuda(
    const at::Tensor& h_in, const at::Tensor& w_in, const at::Tensor& targets_in, int64_t ignore_index,
    int64_t chunk, bool compute_grad) {
  TORCH_CHECK(h_in.dim() == 2 && w_in.dim() == 2 && h_in.size(1) == w_in.size(1) &&
                  h_in.scalar_type() == w_in.scalar_type() && targets_in.dim() == 1 &&
                  targets_in.size(0) == h_in.size(0) && chunk > 0,
              "amsp_fused::linear_cross_entropy: h (tokens, dim), weight (vocab, dim), targets (tokens,), chunk > 0");
  auto h = h_in.contiguous();
  auto w = w_in.contiguous();
  auto targets = targets_in.to(at::kLong).contiguous();
  const int64_t N = h.size(0), V = w.size(0);
  auto acc_type = at::toOpMathType(h.scalar_type());
  auto grad_h = compute_grad ? at::zeros_like(h) : at::empty({0}, h.options());
  // d/dW accumulates in acc_t; the first chunk writes it (no zeroing pass over vocab x dim)
  auto grad_w_acc = compute_grad ? at::empty({V, h.size(1)}, h.options().dtype(acc_type)) : at::empty({0}, h.options());
  if (compute_grad && N == 0) grad_w_acc.zero_();
  auto row_loss = at::zeros({N}, h.options().dtype(acc_type));
  // 1 / (non-ignored targets) stays on the device (a .item() here was a host sync per call). Rounded
  // once from double to acc_t, as static_cast<acc_t>(1.0 / n_valid) was; 1 / 0 = inf when every target
  // is ignored, so the loss is 0 * inf = nan, as F.cross_entropy returns.
  auto scale = targets.ne(ignore_index).sum().to(at::kDouble).reciprocal().to(acc_type);
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t C = std::min(N, c0 + chunk) - c0;
    auto hc = h.narrow(0, c0, C);
    auto logits = at::mm(hc, w.t()).to(acc_type).contiguous();
    AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "linear_cross_entropy_cuda", [&] {
      ce_rows_kernel<scalar_t><<<C, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          logits.mutable_data_ptr<scalar_t>(), targets.const_data_ptr<int64_t>() + c0,
          row_loss.mutable_data_ptr<scalar_t>() + c0, V, ignore_index, scale.const_data_ptr<scalar_t>(), compute_grad);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    if (compute_grad) {
      auto g = logits.to(h.scalar_type());
      grad_h.narrow(0, c0, C).copy_(at::mm(g, w));
      if (h.scalar_type() == acc_type) {
        if (c0 == 0) {
          at::mm_out(grad_w_acc, g.t(), hc);
        } else {
          grad_w_acc.addmm_(g.t(), hc);
        }
      } else {
        // bf16/fp16 chunk products into the fp32 accumulator in one vectorised pass (torch's mixed-dtype
        // add_ is not vectorised)
        accumulate_grad_cuda(grad_w_acc.view({-1}), at::mm(g.t(), hc), /*overwrite=*/c0 == 0);
      }
    }
  }
  auto loss = row_loss.sum() * scale;
  auto grad_w = compute_grad ? grad_w_acc.to(w.scalar_type()) : grad_w_acc;
  return {loss, grad_h, grad_w};
}

}  // namespace

TORCH_LIBRARY_IMPL(amsp_fused, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
  m.impl("rope_fwd", &rope_fwd_cuda);
  m.impl("rope_bwd", &rope_bwd_cuda);
  m.impl("swiglu_fwd", &swiglu_fwd_cuda);
  m.impl("swiglu_bwd", &swiglu_bwd_cuda);
  m.impl("linear_cross_entropy_fwd", &linear_cross_entropy_fwd_cuda);
  m.impl("accumulate_grad", &accumulate_grad_cuda);
  m.impl("adamw_update", &adamw_update_cuda);
}
