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

// dw[d] = sum_r dy[r, d] * round(x[r, d] * rstd[r]): one thread per column, deterministic.
template <typename scalar_t, typename acc_t>
__global__ void rms_bwd_dw_kernel(const scalar_t* dy, const scalar_t* x, const acc_t* rstd, acc_t* dw, int64_t N,
                                  int64_t D) {
  const int64_t d = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (d >= D) return;
  acc_t acc = 0;
  for (int64_t r = 0; r < N; ++r) {
    const acc_t n = static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(x[r * D + d]) * rstd[r]));
    acc += static_cast<acc_t>(dy[r * D + d]) * n;
  }
  dw[d] = acc;
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
    rms_fwd_kernel<scalar_t, acc_t><<<N, kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(),
        rstd.mutable_data_ptr<acc_t>(), D, static_cast<acc_t>(eps));
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
  auto dw = at::zeros({D}, x.options().dtype(rstd.scalar_type()));
  if (N > 0) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      rms_bwd_dx_kernel<scalar_t, acc_t><<<N, kThreads, 0, stream>>>(
          dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(),
          rstd.const_data_ptr<acc_t>(), dx.mutable_data_ptr<scalar_t>(), D);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      rms_bwd_dw_kernel<scalar_t, acc_t><<<(D + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
          dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rstd.const_data_ptr<acc_t>(),
          dw.mutable_data_ptr<acc_t>(), N, D);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {dx, dw.to(w.scalar_type())};
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
    rope_kernel<scalar_t, acc_t><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), cs.const_data_ptr<acc_t>(), sn.const_data_ptr<acc_t>(),
        out.mutable_data_ptr<scalar_t>(), n_pairs, S, H, D2, inverse ? acc_t(-1) : acc_t(1));
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
template <typename scalar_t, typename acc_t>
__global__ void swiglu_fwd_kernel(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const acc_t av = static_cast<acc_t>(a[i]);
    y[i] = static_cast<scalar_t>(av / (acc_t(1) + exp(-av)) * static_cast<acc_t>(b[i]));
  }
}

template <typename scalar_t, typename acc_t>
__global__ void swiglu_bwd_kernel(const scalar_t* dy, const scalar_t* a, const scalar_t* b, scalar_t* da,
                                  scalar_t* db, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const acc_t av = static_cast<acc_t>(a[i]), bv = static_cast<acc_t>(b[i]), g = static_cast<acc_t>(dy[i]);
    const acc_t sig = acc_t(1) / (acc_t(1) + exp(-av));
    db[i] = static_cast<scalar_t>(g * av * sig);
    da[i] = static_cast<scalar_t>(g * bv * sig * (acc_t(1) + av * (acc_t(1) - sig)));
  }
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
    swiglu_fwd_kernel<scalar_t, acc_t><<<elementwise_blocks(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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
    swiglu_bwd_kernel<scalar_t, acc_t><<<elementwise_blocks(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy.const_data_ptr<scalar_t>(), a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(),
        da.mutable_data_ptr<scalar_t>(), db.mutable_data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  auto grad_w_acc = compute_grad ? at::zeros({V, h.size(1)}, h.options().dtype(acc_type)) : at::empty({0}, h.options());
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
        grad_w_acc.addmm_(g.t(), hc);
      } else {
        grad_w_acc.add_(at::mm(g.t(), hc));
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
}
