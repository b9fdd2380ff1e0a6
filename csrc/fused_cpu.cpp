// Fused CPU kernels for the LLaMA model: RMSNorm, rotary embedding, SwiGLU and a chunked
// linear + cross-entropy that never holds the full (tokens x vocab) logits.
//
// Every op is registered in the `amsp_fused` namespace with a CPU kernel only; autograd and fake
// (meta) implementations are registered from Python (models/llama/fused.py), which keeps the
// autograd formulas next to the pure-PyTorch references they are tested against.
//
// Numerics follow the references: low-precision inputs are widened to float (at::opmath_type),
// computed there, and rounded once on output; double stays double so gradcheck is meaningful.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "adamw_update_args.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;

// Rows are widened into a per-thread buffer only when the storage type differs from the math type.
template <typename scalar_t, typename acc_t>
inline const acc_t* widen(const scalar_t* src, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

template <typename acc_t, typename scalar_t>
inline void narrow(const acc_t* src, scalar_t* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

// Rounds a math-type buffer through the storage type in place (mirrors a `.type_as(x)` in the reference).
template <typename scalar_t, typename acc_t>
inline void round_through(acc_t* buf, scalar_t* scratch, int64_t n) {
  if constexpr (!std::is_same_v<scalar_t, acc_t>) {
    at::vec::convert(buf, scratch, n);
    at::vec::convert(scratch, buf, n);
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "amsp_fused: ", name, " must be a CPU tensor");
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = round(x * rstd) * w with rstd = 1/sqrt(mean(x^2) + eps), x (N, D), w (D).
// ---------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_cpu(x_in, "x");
  TORCH_CHECK(x_in.dim() == 2, "amsp_fused::rms_norm_fwd: x must be 2-D (rows, dim)");
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == x_in.size(1), "amsp_fused::rms_norm_fwd: weight must be (dim,)");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "amsp_fused::rms_norm_fwd: x and weight dtypes differ");
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  const int64_t N = x.size(0), D = x.size(1);
  auto y = at::empty_like(x);
  auto acc_type = at::toOpMathType(x.scalar_type());
  auto rstd = at::empty({N}, x.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using Vec = Vectorized<acc_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    acc_t* rp = rstd.mutable_data_ptr<acc_t>();
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xbuf(D), wbuf(D), tmp(D);
      std::vector<scalar_t> scratch(D);
      const acc_t* wf = widen(wp, wbuf.data(), D);
      for (int64_t r = begin; r < end; ++r) {
        const acc_t* xr = widen(xp + r * D, xbuf.data(), D);
        acc_t ss = at::vec::map_reduce_all<acc_t>(
            [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, xr, D);
        acc_t rs = acc_t(1) / std::sqrt(ss / acc_t(D) + acc_t(eps));
        rp[r] = rs;
        at::vec::map([rs](Vec v) { return v * Vec(rs); }, tmp.data(), xr, D);
        round_through<scalar_t>(tmp.data(), scratch.data(), D);
        at::vec::map2([](Vec a, Vec b) { return a * b; }, tmp.data(), tmp.data(), wf, D);
        narrow(tmp.data(), yp + r * D, D);
      }
    });
  });
  return {y, rstd};
}

// dx = rstd * (g - n * mean(g * n)) with n = x * rstd, g = dy * w; dw = sum_rows(dy * round(n)).
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                const at::Tensor& w_in, const at::Tensor& rstd_in) {
  check_cpu(dy_in, "dy");
  auto dy = dy_in.contiguous().to(x_in.scalar_type());
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  auto rstd = rstd_in.contiguous();
  const int64_t N = x.size(0), D = x.size(1);
  auto dx = at::empty_like(x);
  auto acc_type = at::toOpMathType(x.scalar_type());
  // Each block of rows accumulates its own dw partial; blocks are reduced serially at the end so
  // the result does not depend on thread scheduling.
  const int64_t n_blocks = std::max<int64_t>(1, std::min<int64_t>(N, 4 * at::get_num_threads()));
  auto partial = at::zeros({n_blocks, D}, x.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using Vec = Vectorized<acc_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
    const acc_t* rp = rstd.const_data_ptr<acc_t>();
    scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
    acc_t* pp = partial.mutable_data_ptr<acc_t>();
    at::parallel_for(0, n_blocks, 1, [&](int64_t bb, int64_t be) {
      std::vector<acc_t> xbuf(D), wbuf(D), dybuf(D), n(D), g(D), nr(D);
      std::vector<scalar_t> scratch(D);
      const acc_t* wf = widen(wp, wbuf.data(), D);
      for (int64_t blk = bb; blk < be; ++blk) {
        acc_t* dw = pp + blk * D;
        const int64_t r0 = N * blk / n_blocks, r1 = N * (blk + 1) / n_blocks;
        for (int64_t r = r0; r < r1; ++r) {
          const acc_t rs = rp[r];
          const acc_t* xr = widen(xp + r * D, xbuf.data(), D);
          const acc_t* dyr = widen(dyp + r * D, dybuf.data(), D);
          at::vec::map([rs](Vec v) { return v * Vec(rs); }, n.data(), xr, D);
          at::vec::map2([](Vec a, Vec b) { return a * b; }, g.data(), dyr, wf, D);
          acc_t dot = at::vec::map2_reduce_all<acc_t>(
              [](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; }, g.data(), n.data(), D);
          const acc_t mean = dot / acc_t(D);
          at::vec::map2([rs, mean](Vec gv, Vec nv) { return Vec(rs) * (gv - nv * Vec(mean)); },
                        g.data(), g.data(), n.data(), D);
          narrow(g.data(), dxp + r * D, D);
          std::copy(n.begin(), n.end(), nr.begin());
          round_through<scalar_t>(nr.data(), scratch.data(), D);
          at::vec::map3([](Vec acc, Vec d, Vec nv) { return acc + d * nv; }, dw, dw, dyr, nr.data(), D);
        }
      }
    });
  });
  auto dw = partial.sum(0).to(w.scalar_type());
  return {dx, dw};
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding, Meta's interleaved layout: pairs (x[2i], x[2i+1]) rotate by angle s * f_i.
// x (B, S, H, D), cos/sin (S, D/2). The backward is the same rotation by the negative angle.
// ---------------------------------------------------------------------------------------------
at::Tensor rope_rotate(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, bool inverse) {
  check_cpu(x_in, "x");
  TORCH_CHECK(x_in.dim() == 4, "amsp_fused::rope: x must be (batch, seq, heads, head_dim)");
  const int64_t B = x_in.size(0), S = x_in.size(1), H = x_in.size(2), D = x_in.size(3);
  TORCH_CHECK(D % 2 == 0, "amsp_fused::rope: head_dim must be even");
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(0) >= S && cos_in.size(1) == D / 2 && sin_in.sizes() == cos_in.sizes(),
              "amsp_fused::rope: cos/sin must be (seq, head_dim/2)");
  auto x = x_in.contiguous();
  auto acc_type = at::toOpMathType(x.scalar_type());
  auto cs = cos_in.to(acc_type).contiguous();
  auto sn = sin_in.to(acc_type).contiguous();
  auto out = at::empty_like(x);
  const int64_t D2 = D / 2, row = H * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const acc_t* cp = cs.const_data_ptr<acc_t>();
    const acc_t* sp = sn.const_data_ptr<acc_t>();
    const acc_t sign = inverse ? acc_t(-1) : acc_t(1);
    at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xbuf(row), obuf(row), sbuf(D2);
      for (int64_t bs = begin; bs < end; ++bs) {
        const int64_t s = bs % S;
        const acc_t* c = cp + s * D2;
        for (int64_t i = 0; i < D2; ++i) sbuf[i] = sign * sp[s * D2 + i];
        const acc_t* si = sbuf.data();
        const acc_t* xr = widen(xp + bs * row, xbuf.data(), row);
        acc_t* o = obuf.data();
        for (int64_t h = 0; h < H; ++h) {
          const acc_t* xh = xr + h * D;
          acc_t* oh = o + h * D;
          // Stride-2 pair access: g++ -O3 vectorises this with lane shuffles.
          _Pragma("omp simd")
          for (int64_t i = 0; i < D2; ++i) {
            const acc_t x0 = xh[2 * i], x1 = xh[2 * i + 1];
            oh[2 * i] = x0 * c[i] - x1 * si[i];
            oh[2 * i + 1] = x0 * si[i] + x1 * c[i];
          }
        }
        narrow(o, op + bs * row, row);
      }
    });
  });
  return out;
}

at::Tensor rope_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_rotate(x, cos, sin, false);
}

at::Tensor rope_bwd(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_rotate(dy, cos, sin, true);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: y = silu(a) * b, elementwise over same-shaped a and b.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kElemBlock = 4096;

template <typename scalar_t, typename F>
void blocked_elementwise(int64_t n, F fn) {
  const int64_t n_blocks = (n + kElemBlock - 1) / kElemBlock;
  at::parallel_for(0, n_blocks, 1, [&](int64_t bb, int64_t be) {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> bufs(4 * kElemBlock);
    for (int64_t blk = bb; blk < be; ++blk) {
      const int64_t off = blk * kElemBlock, len = std::min(kElemBlock, n - off);
      fn(off, len, bufs.data());
    }
  });
}

at::Tensor swiglu_fwd(const at::Tensor& a_in, const at::Tensor& b_in) {
  check_cpu(a_in, "a");
  TORCH_CHECK(a_in.sizes() == b_in.sizes() && a_in.scalar_type() == b_in.scalar_type(),
              "amsp_fused::swiglu: a and b must have the same shape and dtype");
  auto a = a_in.contiguous();
  auto b = b_in.contiguous();
  auto y = at::empty_like(a);
  const int64_t n = a.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "swiglu_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using Vec = Vectorized<acc_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    blocked_elementwise<scalar_t>(n, [&](int64_t off, int64_t len, acc_t* buf) {
      const acc_t* af = widen(ap + off, buf, len);
      const acc_t* bf = widen(bp + off, buf + kElemBlock, len);
      acc_t* out = buf + 2 * kElemBlock;
      at::vec::map2([](Vec av, Vec bv) { return av / (Vec(1) + av.neg().exp()) * bv; }, out, af, bf, len);
      narrow(out, yp + off, len);
    });
  });
  return y;
}

// da = dy * b * sig(a) * (1 + a * (1 - sig(a))), db = dy * silu(a).
std::tuple<at::Tensor, at::Tensor> swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& a_in, const at::Tensor& b_in) {
  auto a = a_in.contiguous();
  auto b = b_in.contiguous();
  auto dy = dy_in.contiguous().to(a.scalar_type());
  auto da = at::empty_like(a);
  auto db = at::empty_like(b);
  const int64_t n = a.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "swiglu_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using Vec = Vectorized<acc_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    const scalar_t* gp = dy.const_data_ptr<scalar_t>();
    scalar_t* dap = da.mutable_data_ptr<scalar_t>();
    scalar_t* dbp = db.mutable_data_ptr<scalar_t>();
    blocked_elementwise<scalar_t>(n, [&](int64_t off, int64_t len, acc_t* buf) {
      // The widened inputs are read before the outputs overwrite the same scratch slots.
      acc_t* af = buf;
      acc_t* bf = buf + kElemBlock;
      acc_t* gf = buf + 2 * kElemBlock;
      acc_t* dbf = buf + 3 * kElemBlock;
      const acc_t* a_ = widen(ap + off, af, len);
      const acc_t* b_ = widen(bp + off, bf, len);
      const acc_t* g_ = widen(gp + off, gf, len);
      int64_t i = 0;
      const int64_t step = Vec::size();
      for (; i < len; i += step) {
        const int64_t cnt = std::min(step, len - i);
        Vec av = Vec::loadu(a_ + i, cnt), bv = Vec::loadu(b_ + i, cnt), gv = Vec::loadu(g_ + i, cnt);
        Vec sig = Vec(1) / (Vec(1) + av.neg().exp());
        Vec silu = av * sig;
        Vec dbv = gv * silu;
        Vec dav = gv * bv * sig * (Vec(1) + av * (Vec(1) - sig));
        dbv.store(dbf + i, cnt);
        dav.store(gf + i, cnt);  // gf[i..i+cnt) was consumed above
      }
      narrow(static_cast<const acc_t*>(gf), dap + off, len);
      narrow(static_cast<const acc_t*>(dbf), dbp + off, len);
    });
  });
  return {da, db};
}

// ---------------------------------------------------------------------------------------------
// Linear + cross-entropy over chunks of tokens. loss = mean over non-ignored rows of
// logsumexp(h W^T) - (h W^T)[target]. When requested, the gradients for a unit upstream gradient
// are computed in the same pass (one matmul forward, two backward, as eager), so the backward is a
// scale; only a (chunk x vocab) block of logits ever exists.
// ---------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd(
    const at::Tensor& h_in, const at::Tensor& w_in, const at::Tensor& targets_in, int64_t ignore_index,
    int64_t chunk, bool compute_grad) {
  check_cpu(h_in, "h");
  TORCH_CHECK(h_in.dim() == 2 && w_in.dim() == 2 && h_in.size(1) == w_in.size(1),
              "amsp_fused::linear_cross_entropy: h must be (tokens, dim) and weight (vocab, dim)");
  TORCH_CHECK(h_in.scalar_type() == w_in.scalar_type(), "amsp_fused::linear_cross_entropy: h and weight dtypes differ");
  TORCH_CHECK(targets_in.dim() == 1 && targets_in.size(0) == h_in.size(0),
              "amsp_fused::linear_cross_entropy: targets must be (tokens,)");
  TORCH_CHECK(chunk > 0, "amsp_fused::linear_cross_entropy: chunk must be positive");
  auto h = h_in.contiguous();
  auto w = w_in.contiguous();
  auto targets = targets_in.to(at::kLong).contiguous();
  const int64_t N = h.size(0), V = w.size(0);
  const int64_t* tp = targets.const_data_ptr<int64_t>();
  int64_t n_valid = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (tp[i] == ignore_index) continue;
    TORCH_CHECK(tp[i] >= 0 && tp[i] < V, "amsp_fused::linear_cross_entropy: target ", tp[i],
                " out of range [0, ", V, ")");
    ++n_valid;
  }
  auto acc_type = at::toOpMathType(h.scalar_type());
  // Reduced-precision inputs are multiplied in fp32: torch's CPU bf16 GEMM with the vocabulary as
  // the reduction dimension (grad_h = g @ W) ran ~100x slower than fp32 here (BENCHMARKS.md), and
  // fp32 products are at least as accurate as the reference's bf16 logits.
  const bool widen = h.scalar_type() != acc_type;
  auto w_mm = widen ? w.to(acc_type) : w;
  auto grad_h = compute_grad ? at::empty_like(h) : at::empty({0}, h.options());
  auto grad_w_acc = compute_grad ? at::zeros({V, h.size(1)}, h.options().dtype(acc_type)) : at::empty({0}, h.options());
  // 0/0 = nan when every target is ignored, as F.cross_entropy returns.
  const double scale = 1.0 / static_cast<double>(n_valid);
  double loss_sum = 0.0;
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t c1 = std::min(N, c0 + chunk), C = c1 - c0;
    auto hc = widen ? h.narrow(0, c0, C).to(acc_type) : h.narrow(0, c0, C);
    auto logits = at::mm(hc, w_mm.t()).contiguous();  // (C, V) in the math type
    std::vector<double> row_loss(C, 0.0);
    AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "linear_cross_entropy", [&] {
      using acc_t = scalar_t;
      using Vec = Vectorized<acc_t>;
      acc_t* lp = logits.mutable_data_ptr<acc_t>();
      at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          acc_t* x = lp + r * V;
          const int64_t t = tp[c0 + r];
          if (t == ignore_index) {
            if (compute_grad) std::fill(x, x + V, acc_t(0));
            continue;
          }
          const acc_t mx = at::vec::reduce_all<acc_t>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, x, V);
          const acc_t se = at::vec::map_reduce_all<acc_t>(
              [mx](Vec v) { return (v - Vec(mx)).exp(); }, [](Vec a, Vec b) { return a + b; }, x, V);
          const acc_t lse = mx + std::log(se);
          row_loss[r] = static_cast<double>(lse - x[t]);
          if (compute_grad) {
            const acc_t sc = static_cast<acc_t>(scale);
            at::vec::map([lse, sc](Vec v) { return (v - Vec(lse)).exp() * Vec(sc); }, x, x, V);
            x[t] -= sc;
          }
        }
      });
    });
    for (int64_t r = 0; r < C; ++r) loss_sum += row_loss[r];
    if (compute_grad) {
      // logits now hold d loss / d logits for this chunk
      grad_h.narrow(0, c0, C).copy_(at::mm(logits, w_mm));
      grad_w_acc.addmm_(logits.t(), hc);
    }
  }
  auto loss = at::scalar_tensor(loss_sum * scale, h.options().dtype(acc_type));
  auto grad_w = compute_grad ? grad_w_acc.to(w.scalar_type()) : grad_w_acc;
  return {loss, grad_h, grad_w};
}

// A gradient leaving autograd into its fp32 accumulator (amsp/grad_accumulate.py): acc += grad, or
// acc = grad for the step's first micro-batch (no zeroing pass, no read of stale values). On CPU this
// is torch's own copy_/add_; the CUDA version is one vectorized pass (torch's mixed-dtype add_ is not).
void accumulate_grad(const at::Tensor& acc, const at::Tensor& grad, bool overwrite) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.dim() == 1 && acc.is_contiguous(),
              "amsp_fused::accumulate_grad: the accumulator must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(grad.numel() == acc.numel(), "amsp_fused::accumulate_grad: ", grad.numel(),
              " gradient elements for an accumulator of ", acc.numel());
  const auto flat = grad.reshape({-1});
  if (overwrite) {
    acc.copy_(flat);
  } else {
    acc.add_(flat);
  }
}

// A linear layer's weight gradient accumulated into its fp32 buffer by the GEMM itself (amsp/wgrad_fusion.py):
// acc (out x in) = gy^T @ x, plus acc unless overwrite (then acc is never read: it may be uninitialised).
// x (tokens x in) and gy (tokens x out) share a dtype; the products are summed in fp32 whatever it is. On
// CPU the operands are widened to fp32 first (no mixed-dtype GEMM here); the CUDA version
// (csrc/wgrad_gemm_cuda.cu) is one cuBLAS GEMM with fp32 accumulation and output, beta = 0 or 1.
void wgrad_accumulate(const at::Tensor& x, const at::Tensor& gy, const at::Tensor& acc, bool overwrite) {
  TORCH_CHECK(x.dim() == 2 && gy.dim() == 2 && acc.dim() == 2,
              "amsp_fused::wgrad_accumulate: x, gy and acc must be matrices");
  TORCH_CHECK(x.scalar_type() == gy.scalar_type(), "amsp_fused::wgrad_accumulate: x and gy differ in dtype");
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              "amsp_fused::wgrad_accumulate: the accumulator must be a contiguous float32 tensor");
  TORCH_CHECK(gy.size(0) == x.size(0) && acc.size(0) == gy.size(1) && acc.size(1) == x.size(1),
              "amsp_fused::wgrad_accumulate: shapes x ", x.sizes(), ", gy ", gy.sizes(), ", acc ", acc.sizes(),
              " do not give acc = gy^T @ x");
  const auto prod = at::mm(gy.t().to(at::kFloat), x.to(at::kFloat));
  if (overwrite) {
    acc.copy_(prod);
  } else {
    acc.add_(prod);
  }
}

// AdamW on one contiguous fp32 run of a unit's OS shard (amsp/sharded_optim.py kernel "csrc"): torch's fused
// AdamW arithmetic (decoupled decay first, then the moments, eps added to the bias-corrected sqrt of v), the
// gradient divided by grad_scale (the clip) but not written back, and the new weights also stored in `out`'s
// dtype when it has elements (the bf16 compute copy). The CUDA version (csrc/fused_cuda.cu) is one pass with
// 16-byte accesses; this one the same arithmetic in float over ATen's CPU vectors.
void adamw_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& out, const std::optional<at::Tensor>& grad_scale,
                  double lr, double weight_decay, double beta1, double beta2, double eps, double step_size,
                  double bias_correction2_sqrt) {
  amsp_csrc::check_adamw_update_args(param, grad, exp_avg, exp_avg_sq, out, grad_scale);
  const int64_t n = param.numel();
  const float s = grad_scale.has_value() ? grad_scale->item<float>() : 1.f;
  const float lr_f = static_cast<float>(lr), wd = static_cast<float>(weight_decay);
  const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2), ep = static_cast<float>(eps);
  const float ss = static_cast<float>(step_size), bc2 = static_cast<float>(bias_correction2_sqrt);
  float* __restrict__ p = param.mutable_data_ptr<float>();
  const float* __restrict__ g = grad.const_data_ptr<float>();
  float* __restrict__ m = exp_avg.mutable_data_ptr<float>();
  float* __restrict__ v = exp_avg_sq.mutable_data_ptr<float>();
  const float lr_wd = lr_f * wd;
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    // ATen's CPU vectors for the body (a plain loop is not vectorised: std::sqrt may set errno), the same
    // arithmetic element by element for the tail; the weights' cast is a second pass over the chunk just
    // written, still in cache.
    using Vec = at::vec::Vectorized<float>;
    const Vec vs(s), vb1(b1), vb1c(1.f - b1), vb2(b2), vb2c(1.f - b2), vss(ss), vbc2(bc2), vep(ep), vlw(lr_wd);
    int64_t i = begin;
    for (; i + Vec::size() <= end; i += Vec::size()) {
      const Vec gi = Vec::loadu(g + i) / vs;
      const Vec mi = vb1 * Vec::loadu(m + i) + vb1c * gi;
      const Vec vi = vb2 * Vec::loadu(v + i) + vb2c * gi * gi;
      Vec pi = Vec::loadu(p + i);
      pi = pi - vlw * pi;  // decoupled decay before the step, as torch's kernel
      pi = pi - vss * mi / (vi.sqrt() / vbc2 + vep);
      pi.store(p + i);
      mi.store(m + i);
      vi.store(v + i);
    }
    for (; i < end; ++i) {
      const float gi = g[i] / s;
      const float mi = b1 * m[i] + (1.f - b1) * gi;
      const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
      float pi = p[i];
      pi = pi - lr_wd * pi;
      pi = pi - ss * mi / (std::sqrt(vi) / bc2 + ep);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
    }
    if (out.numel() > 0) {
      out.narrow(0, begin, end - begin).copy_(param.narrow(0, begin, end - begin));
    }
  });
}

}  // namespace

TORCH_LIBRARY(amsp_fused, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  m.def("rope_fwd(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_bwd(Tensor dy, Tensor cos, Tensor sin) -> Tensor");
  m.def("swiglu_fwd(Tensor a, Tensor b) -> Tensor");
  m.def("swiglu_bwd(Tensor dy, Tensor a, Tensor b) -> (Tensor, Tensor)");
  m.def("linear_cross_entropy_fwd(Tensor h, Tensor weight, Tensor targets, int ignore_index, int chunk, "
        "bool compute_grad) -> (Tensor, Tensor, Tensor)");
  m.def("accumulate_grad(Tensor(a!) acc, Tensor grad, bool overwrite) -> ()");
  m.def("wgrad_accumulate(Tensor x, Tensor gy, Tensor(a!) acc, bool overwrite) -> ()");
  m.def("adamw_update(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) out, "
        "Tensor? grad_scale, float lr, float weight_decay, float beta1, float beta2, float eps, float step_size, "
        "float bias_correction2_sqrt) -> ()");
}

TORCH_LIBRARY_IMPL(amsp_fused, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("rope_fwd", &rope_fwd);
  m.impl("rope_bwd", &rope_bwd);
  m.impl("swiglu_fwd", &swiglu_fwd);
  m.impl("swiglu_bwd", &swiglu_bwd);
  m.impl("linear_cross_entropy_fwd", &linear_cross_entropy_fwd);
  m.impl("accumulate_grad", &accumulate_grad);
  m.impl("wgrad_accumulate", &wgrad_accumulate);
  m.impl("adamw_update", &adamw_update);
}
