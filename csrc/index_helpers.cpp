// Dataset index builders: bit-identical C++ versions of the pure functions in
// data/index_builders.py (the reference and the specification; read its docstring first).
//
// All arithmetic is integer or IEEE double with no FMA contraction (the extension is compiled with
// -ffp-contract=off), so every output equals the numpy reference exactly. Inputs are validated by
// the Python wrapper (data/native_index.py) where the checks are cheap; what needs a pass over the
// data is checked here with the reference's error text.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMul1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMul2 = 0x94D049BB133111EBULL;

inline uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + kGolden;
  z = (z ^ (z >> 30)) * kMul1;
  z = (z ^ (z >> 27)) * kMul2;
  return z ^ (z >> 31);
}

// splitmix64 is a bijection on uint64; this is its inverse (each xor-shift and odd multiply undone).
inline uint64_t splitmix64_inverse(uint64_t z) {
  z = z ^ (z >> 31) ^ (z >> 62);
  z *= 0x319642B2D24D8EC3ULL;  // inverse of kMul2 modulo 2^64
  z = z ^ (z >> 27) ^ (z >> 54);
  z *= 0x96DE1B173F119089ULL;  // inverse of kMul1 modulo 2^64
  z = z ^ (z >> 30) ^ (z >> 60);
  return z - kGolden;
}

// Sorts the m keys of one bucket (their top `consumed` bits are equal; consumed <= 48) into a, given
// the histograms of the next two bytes below those bits (lo_cnt/hi_cnt[d + 1] = keys with digit d,
// counted by the caller while it hashed the keys): two LSD counting passes, all in L1, then an
// insertion pass for the few keys (a few percent with about 2K uniform keys per bucket) that also
// share those 16 bits. tmp must hold m keys.
inline void sort_bucket_keys(uint64_t* a, uint64_t* tmp, int64_t m, int consumed, uint32_t* lo_cnt,
                             uint32_t* hi_cnt) {
  const int hi_shift = 64 - consumed - 8, lo_shift = 64 - consumed - 16;
  for (int s = 0; s < 256; ++s) {
    lo_cnt[s + 1] += lo_cnt[s];
    hi_cnt[s + 1] += hi_cnt[s];
  }
  for (int64_t j = 0; j < m; ++j) tmp[lo_cnt[(a[j] >> lo_shift) & 255]++] = a[j];
  for (int64_t j = 0; j < m; ++j) a[hi_cnt[(tmp[j] >> hi_shift) & 255]++] = tmp[j];
  for (int64_t j = 1; j < m; ++j) {
    const uint64_t v = a[j];
    if (a[j - 1] <= v) continue;  // the common case stores nothing, so iterations do not chain
    int64_t k = j;
    do {
      a[k] = a[k - 1];
      --k;
    } while (k > 0 && a[k - 1] > v);
    a[k] = v;
  }
}

// Stable argsort of key(seed, stream, i) = splitmix64(base ^ i), written into out[0..n).
// Because splitmix64 is a bijection the keys are distinct, so sorting the keys alone defines the
// order (a stable sort has no ties to break) and each index is recovered from its key by the
// inverse. Keys are uniform: a counting pass on the top bits splits them into L1-sized buckets.
// The scatter writes the *indices* into out (no key scratch array: a fresh multi-megabyte buffer
// costs more in page faults than recomputing the hash, which is about a nanosecond); each bucket
// is then re-hashed into a small local buffer, sorted there and written back as indices.
template <typename out_t>
void permutation_into(int64_t n, uint64_t seed, uint64_t stream, out_t* out) {
  if (n == 0) return;
  const uint64_t base = splitmix64(splitmix64(seed) ^ stream);
  int bits = 0;  // about 2048 keys (16 KiB) per bucket, at most 4096 buckets so the cursors stay in cache
  while (bits < 12 && (int64_t(1) << (bits + 1)) * 2048 <= n) ++bits;
  const int64_t n_buckets = int64_t(1) << bits;
  auto bucket_of = [bits](uint64_t key) -> int64_t { return bits == 0 ? 0 : int64_t(key >> (64 - bits)); };

  // Histogram per contiguous block of indices, then a scatter in block order.
  const int64_t n_blocks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * 4, n / 65536 + 1));
  std::vector<int64_t> counts(n_blocks * n_buckets, 0);
  at::parallel_for(0, n_blocks, 1, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) {
      int64_t* cnt = counts.data() + b * n_buckets;
      const int64_t i0 = n * b / n_blocks, i1 = n * (b + 1) / n_blocks;
      for (int64_t i = i0; i < i1; ++i) ++cnt[bucket_of(splitmix64(base ^ uint64_t(i)))];
    }
  });
  std::vector<int64_t> bucket_start(n_buckets + 1, 0);
  {
    int64_t pos = 0;
    for (int64_t k = 0; k < n_buckets; ++k) {
      bucket_start[k] = pos;
      for (int64_t b = 0; b < n_blocks; ++b) {
        int64_t& c = counts[b * n_buckets + k];
        const int64_t here = c;
        c = pos;  // becomes this block's write cursor for bucket k
        pos += here;
      }
    }
    bucket_start[n_buckets] = pos;
  }
  at::parallel_for(0, n_blocks, 1, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) {
      int64_t* cursor = counts.data() + b * n_buckets;
      const int64_t i0 = n * b / n_blocks, i1 = n * (b + 1) / n_blocks;
      for (int64_t i = i0; i < i1; ++i) out[cursor[bucket_of(splitmix64(base ^ uint64_t(i)))]++] = static_cast<out_t>(i);
    }
  });
  at::parallel_for(0, n_buckets, 16, [&](int64_t kb, int64_t ke) {
    std::vector<uint64_t> keys, tmp;
    const int hi_shift = 64 - bits - 8, lo_shift = 64 - bits - 16;
    for (int64_t k = kb; k < ke; ++k) {
      const int64_t lo = bucket_start[k], m = bucket_start[k + 1] - lo;
      keys.resize(m);
      tmp.resize(m);
      if (m <= 64) {  // small buckets (small n): a comparison sort beats 2 x 256 counters
        for (int64_t j = 0; j < m; ++j) keys[j] = splitmix64(base ^ static_cast<uint64_t>(out[lo + j]));
        std::sort(keys.begin(), keys.begin() + m);
      } else {
        uint32_t lo_cnt[257] = {0}, hi_cnt[257] = {0};
        for (int64_t j = 0; j < m; ++j) {
          const uint64_t key = splitmix64(base ^ static_cast<uint64_t>(out[lo + j]));
          keys[j] = key;
          ++lo_cnt[((key >> lo_shift) & 255) + 1];
          ++hi_cnt[((key >> hi_shift) & 255) + 1];
        }
        sort_bucket_keys(keys.data(), tmp.data(), m, bits, lo_cnt, hi_cnt);
      }
      for (int64_t j = 0; j < m; ++j) out[lo + j] = static_cast<out_t>(splitmix64_inverse(keys[j]) ^ base);
    }
  });
}

// The caller (data/native_index.py) allocates every output with numpy: numpy asks the kernel for
// transparent huge pages on large arrays, which makes first-touch page faults several times
// cheaper than the 4 KiB pages an at::empty gets, and on these builders (a few nanoseconds of work
// per element) faults are a large share of the time.
void check_out(const at::Tensor& out, at::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK_VALUE(out.scalar_type() == dtype && out.is_contiguous() && out.numel() == numel, what,
                    ": output must be a contiguous ", c10::toString(dtype), " tensor of ", numel,
                    " elements, got ", out.scalar_type(), " of ", out.numel());
}

// Writes a permutation of range(out.numel()) into out (contiguous int32 or int64).
void permutation(int64_t seed, int64_t stream, const at::Tensor& out) {
  const int64_t n = out.numel();
  if (out.scalar_type() == at::kInt) {
    TORCH_CHECK_VALUE(n <= (int64_t(1) << 31), "permutation: ", n, " indices do not fit an int32 output");
    check_out(out, at::kInt, n, "permutation");
    permutation_into<int32_t>(n, uint64_t(seed), uint64_t(stream), out.mutable_data_ptr<int32_t>());
  } else {
    check_out(out, at::kLong, n, "permutation");
    permutation_into<int64_t>(n, uint64_t(seed), uint64_t(stream), out.mutable_data_ptr<int64_t>());
  }
}

// Row i = (first row of doc_index whose cumulative end exceeds i * seq_len, offset in that document),
// in one pass over doc_index that stops once the last sample is placed. For every row the slot of
// the next sample is written unconditionally and the slot only advances when the sample's position
// lies inside the row: a row that does not hold it leaves a value that the row which does overwrites
// later (it starts at or before that position, after this one), so the common case has no
// data-dependent branch. Only rows longer than what is left of a sample loop.
// numpy's IndexError text, raised from a function of its own so the hot loop keeps no string code.
[[noreturn]] __attribute__((noinline, cold)) void bad_document_id(int64_t id, int64_t n_docs) {
  TORCH_CHECK_INDEX(false, "index ", id, " is out of bounds for axis 0 with size ", n_docs);
  __builtin_unreachable();
}

template <typename len_t, typename idx_t>
void sample_index_impl(const len_t* __restrict__ lp, const int64_t n_docs, const idx_t* __restrict__ dp,
                       const int64_t n_rows, const int64_t seq_len, const int64_t num_samples,
                       int64_t* __restrict__ op) {
  constexpr int64_t kAhead = 32;  // prefetch distance: the gather of lengths is latency-bound without it
  int64_t total = 0, pos = 0, k = 0, r = 0;
  for (; r < n_rows; ++r) {
    if (r + kAhead < n_rows) {
      const uint64_t ahead = static_cast<uint64_t>(static_cast<int64_t>(dp[r + kAhead]));
      __builtin_prefetch(lp + (ahead < static_cast<uint64_t>(n_docs) ? ahead : 0));
    }
    int64_t d = static_cast<int64_t>(dp[r]);
    d += d < 0 ? n_docs : 0;  // numpy's negative indexing
    if (__builtin_expect(static_cast<uint64_t>(d) >= static_cast<uint64_t>(n_docs), 0)) {
      bad_document_id(static_cast<int64_t>(dp[r]), n_docs);
    }
    const int64_t start = total;
    total += static_cast<int64_t>(lp[d]);
    op[2 * k] = r;
    op[2 * k + 1] = pos - start;
    const bool inside = pos < total;
    k += inside;
    pos += inside ? seq_len : 0;
    if (k > num_samples) break;
    while (pos < total) {  // a row holding more than one sample start
      op[2 * k] = r;
      op[2 * k + 1] = pos - start;
      pos += seq_len;
      if (++k > num_samples) break;
    }
    if (k > num_samples) break;
  }
  if (k <= num_samples) {  // every row was read, so total is the whole of doc_index
    TORCH_CHECK_VALUE(false, "build_sample_index: ", num_samples, " samples of ", seq_len,
                      "+1 tokens need more than the ", total, " tokens in doc_index");
  }
  // The reference gathers every row, so it rejects a bad id anywhere, also past the last sample.
  for (++r; r < n_rows; ++r) {
    const int64_t d = static_cast<int64_t>(dp[r]);
    if (d < -n_docs || d >= n_docs) bad_document_id(d, n_docs);
  }
  op[0] = op[1] = 0;  // Megatron starts at (0, 0) even when the first document is empty (same tokens)
}

void build_sample_index(const at::Tensor& doc_lengths_in, const at::Tensor& doc_index_in, int64_t seq_len,
                        int64_t num_samples, const at::Tensor& out) {
  TORCH_CHECK_VALUE(seq_len >= 1 && num_samples >= 0, "build_sample_index: seq_len=", seq_len,
                    " must be >= 1 and num_samples=", num_samples, " >= 0");
  check_out(out, at::kLong, 2 * (num_samples + 1), "build_sample_index");
  // int32 and int64 are read as they are (no widened copies of million-entry tables).
  auto lengths = doc_lengths_in.scalar_type() == at::kInt ? doc_lengths_in.contiguous()
                                                            : doc_lengths_in.to(at::kLong).contiguous();
  auto index = doc_index_in.scalar_type() == at::kInt ? doc_index_in.contiguous()
                                                       : doc_index_in.to(at::kLong).contiguous();
  const int64_t n_docs = lengths.numel(), n_rows = index.numel();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  auto with_index = [&](auto lp) {
    if (index.scalar_type() == at::kInt) {
      sample_index_impl(lp, n_docs, index.const_data_ptr<int32_t>(), n_rows, seq_len, num_samples, op);
    } else {
      sample_index_impl(lp, n_docs, index.const_data_ptr<int64_t>(), n_rows, seq_len, num_samples, op);
    }
  };
  if (lengths.scalar_type() == at::kInt) {
    with_index(lengths.const_data_ptr<int32_t>());
  } else {
    with_index(lengths.const_data_ptr<int64_t>());
  }
}

// Greedy blending. The argmax and the count update are branch-free selects (which dataset wins is
// data-dependent and would mispredict as a branch). N > 0 makes the dataset count a compile-time
// constant, so the loops unroll and the counts live in registers; N == 0 takes any count. Counts are
// doubles, exact below 2**53, which is also how the reference subtracts them.
template <int N>
void blend(const double* w, int64_t n_any, int64_t size, int16_t* di, int64_t* dsi) {
  const int64_t n = N > 0 ? N : n_any;
  double fixed[N > 0 ? N : 1] = {};
  std::vector<double> dynamic(N > 0 ? 0 : n, 0.0);
  double* c = N > 0 ? fixed : dynamic.data();
  for (int64_t i = 0; i < size; ++i) {
    const double x = static_cast<double>(i > 1 ? i : 1);
    int64_t best = 0;
    double best_err = w[0] * x - c[0];
    for (int64_t d = 1; d < n; ++d) {
      const double err = w[d] * x - c[d];
      const bool better = err > best_err;  // strict: the lowest d wins a tie
      best = better ? d : best;
      best_err = better ? err : best_err;
    }
    double chosen = 0.0;
    for (int64_t d = 0; d < n; ++d) {
      chosen = d == best ? c[d] : chosen;
      c[d] += d == best ? 1.0 : 0.0;
    }
    di[i] = static_cast<int16_t>(best);
    dsi[i] = static_cast<int64_t>(chosen);
  }
}

// Greedy blending over normalised weights (normalisation stays in numpy so the sum matches).
void build_blending_index(const at::Tensor& weights_in, int64_t size, const at::Tensor& dataset_index,
                          const at::Tensor& dataset_sample_index) {
  auto weights = weights_in.to(at::kDouble).contiguous();
  const int64_t n = weights.numel();
  TORCH_CHECK_VALUE(n >= 1 && n <= 32767, "build_blending_index: need 1..32767 datasets, got ", n);
  TORCH_CHECK_VALUE(size >= 0, "build_blending_index: size must be >= 0, got ", size);
  check_out(dataset_index, at::kShort, size, "build_blending_index");
  check_out(dataset_sample_index, at::kLong, size, "build_blending_index");
  const double* w = weights.const_data_ptr<double>();
  int16_t* di = dataset_index.mutable_data_ptr<int16_t>();
  int64_t* dsi = dataset_sample_index.mutable_data_ptr<int64_t>();
  switch (n) {
    case 1: return blend<1>(w, n, size, di, dsi);
    case 2: return blend<2>(w, n, size, di, dsi);
    case 3: return blend<3>(w, n, size, di, dsi);
    case 4: return blend<4>(w, n, size, di, dsi);
    case 5: return blend<5>(w, n, size, di, dsi);
    case 6: return blend<6>(w, n, size, di, dsi);
    case 7: return blend<7>(w, n, size, di, dsi);
    case 8: return blend<8>(w, n, size, di, dsi);
    default: return blend<0>(w, n, size, di, dsi);
  }
}

}  // namespace

// Defined with their kernels (a catch-all registration): some take no input tensor at all, so there
// is no dispatch key to route on, and none of them is differentiable. Each writes into outputs the
// caller allocated (see check_out).
TORCH_LIBRARY(amsp_index, m) {
  m.def("permutation(int seed, int stream, Tensor(a!) out) -> ()", &permutation);
  m.def("build_sample_index(Tensor doc_lengths, Tensor doc_index, int seq_len, int num_samples, "
        "Tensor(a!) out) -> ()", &build_sample_index);
  m.def("build_blending_index(Tensor weights, int size, Tensor(a!) dataset_index, "
        "Tensor(b!) dataset_sample_index) -> ()", &build_blending_index);
}
