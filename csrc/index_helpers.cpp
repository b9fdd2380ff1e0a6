// Dataset index builders: bit-identical C++ versions of the pure functions in
// data/index_builders.py (the reference and the specification; read its docstring first).
//
// All arithmetic is integer or IEEE double with no FMA contraction (the extension is compiled with
// -ffp-contract=off), so every output equals the numpy reference exactly. Inputs are validated by
// the Python wrapper (data/native_index.py) where the checks are cheap; what needs a pass over the
// data is checked here with the reference's error text.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

// Sorts m uniformly distributed keys whose top `consumed` bits are equal into dst: one more
// counting pass on the next bits (about one key per slot), then an insertion pass that only moves
// keys within their slot. O(m) expected, all in cache.
inline void sort_uniform_keys(const uint64_t* a, uint64_t* dst, int64_t m, int consumed, std::vector<int64_t>& cnt) {
  if (m <= 32 || consumed >= 48) {
    std::copy(a, a + m, dst);
    std::sort(dst, dst + m);
    return;
  }
  int sb = 1;
  while (sb < 16 && (int64_t(1) << (sb + 1)) <= m) ++sb;
  const int64_t slots = int64_t(1) << sb;
  auto slot_of = [consumed, sb](uint64_t x) -> int64_t { return int64_t((x << consumed) >> (64 - sb)); };
  cnt.assign(slots + 1, 0);
  for (int64_t j = 0; j < m; ++j) ++cnt[slot_of(a[j]) + 1];
  for (int64_t s = 0; s < slots; ++s) cnt[s + 1] += cnt[s];
  for (int64_t j = 0; j < m; ++j) dst[cnt[slot_of(a[j])]++] = a[j];
  for (int64_t j = 1; j < m; ++j) {  // keys of different slots are already in order
    const uint64_t v = dst[j];
    if (dst[j - 1] <= v) continue;  // the common case stores nothing, so iterations do not chain
    int64_t k = j;
    do {
      dst[k] = dst[k - 1];
      --k;
    } while (k > 0 && dst[k - 1] > v);
    dst[k] = v;
  }
}

// Stable argsort of key(seed, stream, i) = splitmix64(base ^ i), written into out[0..n).
// Because splitmix64 is a bijection the keys are distinct, so sorting the keys alone defines the
// order (a stable sort has no ties to break) and each index is recovered from its key by the
// inverse. Keys are uniform: one counting pass on the top bits splits them into cache-sized
// buckets, each then sorted on its own, in parallel.
template <typename out_t>
void permutation_into(int64_t n, uint64_t seed, uint64_t stream, out_t* out) {
  if (n == 0) return;
  const uint64_t base = splitmix64(splitmix64(seed) ^ stream);
  int bits = 0;  // about 1024 keys (8 KiB) per bucket, at most 4096 buckets so the cursors stay in cache
  while (bits < 12 && (int64_t(1) << (bits + 1)) * 1024 <= n) ++bits;
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
  std::vector<uint64_t> keys(n);
  at::parallel_for(0, n_blocks, 1, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) {
      int64_t* cursor = counts.data() + b * n_buckets;
      const int64_t i0 = n * b / n_blocks, i1 = n * (b + 1) / n_blocks;
      for (int64_t i = i0; i < i1; ++i) {
        const uint64_t key = splitmix64(base ^ uint64_t(i));
        keys[cursor[bucket_of(key)]++] = key;
      }
    }
  });
  at::parallel_for(0, n_buckets, 16, [&](int64_t kb, int64_t ke) {
    std::vector<uint64_t> sorted;
    std::vector<int64_t> cnt;
    for (int64_t k = kb; k < ke; ++k) {
      const int64_t lo = bucket_start[k], m = bucket_start[k + 1] - lo;
      sorted.resize(m);
      sort_uniform_keys(keys.data() + lo, sorted.data(), m, bits, cnt);
      for (int64_t j = 0; j < m; ++j) out[lo + j] = static_cast<out_t>(splitmix64_inverse(sorted[j]) ^ base);
    }
  });
}

at::Tensor permutation(int64_t n, int64_t seed, int64_t stream) {
  TORCH_CHECK_VALUE(n >= 0, "permutation size must be >= 0, got ", n);
  auto out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  permutation_into<int64_t>(n, uint64_t(seed), uint64_t(stream), out.mutable_data_ptr<int64_t>());
  return out;
}

at::Tensor build_doc_index(int64_t num_docs, int64_t num_epochs, int64_t seed) {
  TORCH_CHECK_VALUE(num_docs < (int64_t(1) << 31), "build_doc_index: ", num_docs,
                    " documents do not fit int32 document ids");
  TORCH_CHECK_VALUE(num_epochs >= 1, "build_doc_index: num_epochs must be >= 1, got ", num_epochs);
  TORCH_CHECK_VALUE(num_docs >= 0, "permutation size must be >= 0, got ", num_docs);
  auto out = at::empty({num_docs * num_epochs}, at::TensorOptions().dtype(at::kInt));
  int32_t* op = out.mutable_data_ptr<int32_t>();
  for (int64_t e = 0; e < num_epochs; ++e) {
    permutation_into<int32_t>(num_docs, uint64_t(seed), uint64_t(e), op + e * num_docs);
  }
  return out;
}

// Row i = (first row of doc_index whose cumulative end exceeds i * seq_len, offset in that document).
template <typename len_t, typename idx_t>
at::Tensor sample_index_impl(const len_t* lp, int64_t n_docs, const idx_t* dp, int64_t n_rows, int64_t seq_len,
                             int64_t num_samples) {
  // ends[r] = tokens in rows 0..r; the only random access is the gather of lengths by doc_index.
  std::vector<int64_t> ends(n_rows);
  int64_t total = 0;
  constexpr int64_t kAhead = 32;  // prefetch distance: the gather is latency-bound without it
  for (int64_t r = 0; r < n_rows; ++r) {
    if (r + kAhead < n_rows) {
      const int64_t ahead = static_cast<int64_t>(dp[r + kAhead]);
      if (ahead >= 0 && ahead < n_docs) __builtin_prefetch(lp + ahead);
    }
    int64_t d = static_cast<int64_t>(dp[r]);
    if (d < 0) d += n_docs;  // numpy's negative indexing
    TORCH_CHECK_INDEX(d >= 0 && d < n_docs, "index ", static_cast<int64_t>(dp[r]),
                      " is out of bounds for axis 0 with size ", n_docs);
    total += static_cast<int64_t>(lp[d]);
    ends[r] = total;
  }
  TORCH_CHECK_VALUE(num_samples * seq_len < total, "build_sample_index: ", num_samples, " samples of ", seq_len,
                    "+1 tokens need more than the ", total, " tokens in doc_index");
  auto out = at::empty({num_samples + 1, 2}, at::TensorOptions().dtype(at::kLong));
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, num_samples + 1, 16384, [&](int64_t begin, int64_t end) {
    // Positions increase with i, so after one binary search the row only walks forward.
    int64_t pos = begin * seq_len;
    int64_t r = std::upper_bound(ends.begin(), ends.end(), pos) - ends.begin();
    for (int64_t i = begin; i < end; ++i, pos += seq_len) {
      while (ends[r] <= pos) ++r;
      op[2 * i] = r;
      op[2 * i + 1] = pos - (r == 0 ? 0 : ends[r - 1]);  // the row's start
    }
  });
  op[0] = op[1] = 0;  // Megatron starts at (0, 0) even when the first document is empty (same tokens)
  return out;
}

at::Tensor build_sample_index(const at::Tensor& doc_lengths_in, const at::Tensor& doc_index_in, int64_t seq_len,
                              int64_t num_samples) {
  TORCH_CHECK_VALUE(seq_len >= 1 && num_samples >= 0, "build_sample_index: seq_len=", seq_len,
                    " must be >= 1 and num_samples=", num_samples, " >= 0");
  // int32 and int64 are read as they are (no widened copies of million-entry tables).
  auto lengths = doc_lengths_in.scalar_type() == at::kInt ? doc_lengths_in.contiguous()
                                                            : doc_lengths_in.to(at::kLong).contiguous();
  auto index = doc_index_in.scalar_type() == at::kInt ? doc_index_in.contiguous()
                                                       : doc_index_in.to(at::kLong).contiguous();
  const int64_t n_docs = lengths.numel(), n_rows = index.numel();
  auto with_index = [&](auto lp) {
    if (index.scalar_type() == at::kInt) {
      return sample_index_impl(lp, n_docs, index.const_data_ptr<int32_t>(), n_rows, seq_len, num_samples);
    }
    return sample_index_impl(lp, n_docs, index.const_data_ptr<int64_t>(), n_rows, seq_len, num_samples);
  };
  if (lengths.scalar_type() == at::kInt) return with_index(lengths.const_data_ptr<int32_t>());
  return with_index(lengths.const_data_ptr<int64_t>());
}

// Greedy blending over normalised weights (normalisation stays in numpy so the sum matches).
std::tuple<at::Tensor, at::Tensor> build_blending_index(const at::Tensor& weights_in, int64_t size) {
  auto weights = weights_in.to(at::kDouble).contiguous();
  const int64_t n = weights.numel();
  TORCH_CHECK_VALUE(n >= 1 && n <= 32767, "build_blending_index: need 1..32767 datasets, got ", n);
  TORCH_CHECK_VALUE(size >= 0, "build_blending_index: size must be >= 0, got ", size);
  const double* w = weights.const_data_ptr<double>();
  auto dataset_index = at::empty({size}, at::TensorOptions().dtype(at::kShort));
  auto dataset_sample_index = at::empty({size}, at::TensorOptions().dtype(at::kLong));
  int16_t* di = dataset_index.mutable_data_ptr<int16_t>();
  int64_t* dsi = dataset_sample_index.mutable_data_ptr<int64_t>();
  std::vector<int64_t> counts(n, 0);
  for (int64_t i = 0; i < size; ++i) {
    const double x = static_cast<double>(std::max<int64_t>(i, 1));
    int64_t best = 0;
    double best_err = w[0] * x - static_cast<double>(counts[0]);
    for (int64_t d = 1; d < n; ++d) {
      const double err = w[d] * x - static_cast<double>(counts[d]);
      if (err > best_err) {
        best = d;
        best_err = err;
      }
    }
    di[i] = static_cast<int16_t>(best);
    dsi[i] = counts[best]++;
  }
  return {dataset_index, dataset_sample_index};
}

}  // namespace

// Defined with their kernels (a catch-all registration): some take no tensor at all, so there is no
// dispatch key to route on, and none of them is differentiable.
TORCH_LIBRARY(amsp_index, m) {
  m.def("permutation(int n, int seed, int stream) -> Tensor", &permutation);
  m.def("build_doc_index(int num_docs, int num_epochs, int seed) -> Tensor", &build_doc_index);
  m.def("build_sample_index(Tensor doc_lengths, Tensor doc_index, int seq_len, int num_samples) -> Tensor",
        &build_sample_index);
  m.def("build_blending_index(Tensor weights, int size) -> (Tensor, Tensor)", &build_blending_index);
}
