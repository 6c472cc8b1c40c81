// Random sampling for XLA:CPU, called through the XLA FFI (see sample.py): steps 5-7 of
// jaxserve/sampling/sampler.py for each row of processed logits x [R, V].
//
// For row r with temperature T > 0 (rows not `active` output token 0):
//   p_i = exp((x_i - max x) / T);
//   kept: x_i finite, p_i >= min_p (when min_p > 0), x_i >= the k-th largest value (when
//   0 < top_k < V; ties at the k-th value are kept), then with top_p < 1 the shortest prefix in
//   the order (x desc, id asc) of the kept tokens whose mass reaches top_p * (their mass);
//   token: inverse CDF of the kept p_i in id order at u_r * (their mass): the first id whose
//   cumulative mass exceeds it (the last kept token with mass when rounding runs past).
// Masses are summed in double. The k-th largest value comes from a heap of the top k; the top-p
// boundary from a histogram of the kept tokens above a bound on the tail's mass: the bin where
// the cumulative mass crosses the target is sorted and walked, so a row costs a few passes
// over V whatever the width of its nucleus (XLA:CPU's sort of a [32, 49152] batch takes
// ~400 ms, the JAX sampler's bisection 25-30 ms). Rows run in parallel (parallel.h).
//
// Also the raw logprobs of jaxserve/sampling/sampler.py:_raw_logprobs for rows of logits (the
// sampled tokens' at decode, every prompt token's for prompt_logprobs): log_softmax at a given
// token, its rank (#{logits >= its logit}) and the k largest logits (ties: lower id first) with
// their logprobs, in a few passes per row. XLA:CPU took ~150 ms for 512 prompt rows.
//
// The passes over a row have AVX-512 (16 lanes) and AVX2 (8 lanes, JAXSERVE_AVX2 from simd.h)
// forms, chosen at compile time, and a portable loop that also finishes each row's tail.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBins = 4096;   // histogram of the kept values for the top-p boundary
constexpr int kBlock = 256;   // ids per partial sum of the inverse CDF

struct Problem {
  const float* x;
  int64_t v;
  const float *temperature, *top_p, *min_p, *u;
  const int32_t* top_k;
  const bool* active;
  int32_t* tok;
  bool* mask;  // [R, V] or null
};

// The smallest float f with (double) f >= t (-inf stays -inf): x >= f <=> (double) x >= t.
float float_ceil(double t) {
  if (std::isinf(t)) return static_cast<float>(t);
  float f = static_cast<float>(t);
  if (static_cast<double>(f) < t) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

float row_max(const float* x, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= v; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(mv);
#elif JAXSERVE_AVX2
  if (v >= 8) {
    __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= v; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    m = jaxserve::hmax8(mv);
  }
#endif
  for (; i < v; ++i) m = std::max(m, x[i]);
  return m;
}

#if defined(__AVX512F__)
// a0, a1 += the 16 lanes of e, in double.
inline void add_to_double(__m512d& a0, __m512d& a1, __m512 e) {
  a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
  a1 = _mm512_add_pd(
      a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
}
#elif JAXSERVE_AVX2
// a0, a1 += the 8 lanes of e, in double.
inline void add_to_double(__m256d& a0, __m256d& a1, __m256 e) {
  a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
  a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

inline double hsum4d(__m256d a) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// The 8 ids i, i + 1, ..., i + 7.
inline __m256i ids8(int64_t i) {
  return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i)),
                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// p[i] = exp((x[i] - mx) * inv_t) where x[i] >= lo, else 0 (-inf gives 0); returns their sum.
double probabilities(const float* x, int64_t v, float mx, float inv_t, float lo, float* p) {
  double z = 0.0;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 mxv = _mm512_set1_ps(mx), itv = _mm512_set1_ps(inv_t), lov = _mm512_set1_ps(lo);
  __m512d z0 = _mm512_setzero_pd(), z1 = _mm512_setzero_pd();
  for (; i + 16 <= v; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    const __m512 arg = _mm512_mul_ps(_mm512_sub_ps(xv, mxv), itv);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(xv, lov, _CMP_GE_OQ),
                                         jaxserve::exp512(arg));
    _mm512_storeu_ps(p + i, e);
    add_to_double(z0, z1, e);
  }
  z = _mm512_reduce_add_pd(_mm512_add_pd(z0, z1));
#elif JAXSERVE_AVX2
  const __m256 mxv = _mm256_set1_ps(mx), itv = _mm256_set1_ps(inv_t), lov = _mm256_set1_ps(lo);
  __m256d z0 = _mm256_setzero_pd(), z1 = _mm256_setzero_pd();
  for (; i + 8 <= v; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 arg = _mm256_mul_ps(_mm256_sub_ps(xv, mxv), itv);
    const __m256 e = _mm256_and_ps(_mm256_cmp_ps(xv, lov, _CMP_GE_OQ), jaxserve::exp256(arg));
    _mm256_storeu_ps(p + i, e);
    add_to_double(z0, z1, e);
  }
  z = hsum4d(_mm256_add_pd(z0, z1));
#endif
  for (; i < v; ++i) {
    p[i] = x[i] >= lo ? jaxserve::fast_exp((x[i] - mx) * inv_t) : 0.0f;
    z += p[i];
  }
  return z;
}

struct Entry {
  float x;
  int32_t id;
  float p;
};

// Heap order of top_k_heap: a before b when a is the better entry (larger, or equal with the
// lower id), so the heap's root is the worst.
inline bool better(const Entry& a, const Entry& b) {
  return a.x > b.x || (a.x == b.x && a.id < b.id);
}

// The k (1 <= k <= v) largest of x, ties to the lower id, as a heap whose root is the k-th
// (duplicates counted); std::sort_heap(..., better) lists them largest first. Scanning ids in
// order, an equal value never displaces an entry, so only x > root needs a look.
void top_k_heap(const float* x, int64_t v, int64_t k, std::vector<Entry>& heap) {
  heap.clear();
  for (int64_t i = 0; i < k; ++i) heap.push_back({x[i], static_cast<int32_t>(i), 0.0f});
  std::make_heap(heap.begin(), heap.end(), better);
  auto offer = [&](int64_t i) {
    if (x[i] > heap.front().x) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = {x[i], static_cast<int32_t>(i), 0.0f};
      std::push_heap(heap.begin(), heap.end(), better);
    }
  };
  int64_t i = k;
#if defined(__AVX512F__)
  for (; i + 16 <= v; i += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(heap.front().x),
                                     _CMP_GT_OQ);
    for (; m != 0; m &= m - 1) offer(i + __builtin_ctz(m));
  }
#elif JAXSERVE_AVX2
  for (; i + 8 <= v; i += 8) {
    unsigned m = static_cast<unsigned>(_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(heap.front().x), _CMP_GT_OQ)));
    for (; m != 0; m &= m - 1) offer(i + __builtin_ctz(m));
  }
#endif
  for (; i < v; ++i) offer(i);
}

// Scratch of a row's top-p search: the tokens above a threshold, as columns.
struct Candidates {
  std::vector<float> x, p;
  std::vector<int32_t> id, bin;
  std::vector<Entry> sorted;
};

// The top-p boundary: the first token of (x desc, id asc) at which the cumulative mass of p
// reaches `target`, found among the tokens with x >= thr (they hold at least that mass).
// Returns (its x, its id); (-inf, V) when rounding leaves the target unreached (keep all).
std::pair<float, int64_t> top_p_cut(const float* x, const float* p, int64_t v, float mx,
                                    float thr, double target, Candidates& c) {
  c.x.resize(v + 16);
  c.p.resize(v + 16);
  c.id.resize(v + 16);
  c.bin.resize(v + 16);
  int64_t n = 0, i = 0;
  float lo = mx;  // the smallest value listed
#if defined(__AVX512F__)
  // (Compressing into a register and storing all 16 lanes: a compress straight to memory is
  // microcoded and several times slower; the columns have 16 lanes of slack.)
  const __m512 tv = _mm512_set1_ps(thr), zero = _mm512_setzero_ps();
  __m512 lov = _mm512_set1_ps(mx);
  __m512i idv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= v; i += 16, idv = _mm512_add_epi32(idv, _mm512_set1_epi32(16))) {
    const __m512 xv = _mm512_loadu_ps(x + i), pv = _mm512_loadu_ps(p + i);
    const __mmask16 m = _mm512_cmp_ps_mask(xv, tv, _CMP_GE_OQ) &
                        _mm512_cmp_ps_mask(pv, zero, _CMP_GT_OQ);
    if (m == 0) continue;
    _mm512_storeu_ps(c.x.data() + n, _mm512_maskz_compress_ps(m, xv));
    _mm512_storeu_ps(c.p.data() + n, _mm512_maskz_compress_ps(m, pv));
    _mm512_storeu_si512(c.id.data() + n, _mm512_maskz_compress_epi32(m, idv));
    lov = _mm512_mask_min_ps(lov, m, lov, xv);
    n += __builtin_popcount(m);
  }
  lo = _mm512_reduce_min_ps(lov);
#elif JAXSERVE_AVX2
  // No compress in AVX2: most blocks hold no candidate, the others list theirs one by one.
  const __m256 tv = _mm256_set1_ps(thr), zero = _mm256_setzero_ps();
  for (; i + 8 <= v; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i), pv = _mm256_loadu_ps(p + i);
    unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_and_ps(
        _mm256_cmp_ps(xv, tv, _CMP_GE_OQ), _mm256_cmp_ps(pv, zero, _CMP_GT_OQ))));
    for (; m != 0; m &= m - 1) {
      const int64_t q = i + __builtin_ctz(m);
      c.x[n] = x[q];
      c.p[n] = p[q];
      c.id[n++] = static_cast<int32_t>(q);
      lo = std::min(lo, x[q]);
    }
  }
#endif
  for (; i < v; ++i) {
    if (x[i] >= thr && p[i] > 0.0f) {
      c.x[n] = x[i];
      c.p[n] = p[i];
      c.id[n++] = static_cast<int32_t>(i);
      lo = std::min(lo, x[i]);
    }
  }
  // Histogram of their values; the bin where the cumulative mass crosses is sorted and walked.
  // (The bin of a value is monotone in it, so bins follow the order.)
  const float range = mx - lo;
  const float scale = range > 0.0f ? (kBins - 1) / range : 0.0f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 mxv = _mm512_set1_ps(mx), sv = _mm512_set1_ps(scale);
  for (; j + 16 <= n; j += 16) {
    const __m512 dist = _mm512_sub_ps(mxv, _mm512_loadu_ps(c.x.data() + j));
    const __m512i b = _mm512_cvttps_epi32(_mm512_mul_ps(dist, sv));
    _mm512_storeu_si512(c.bin.data() + j, _mm512_min_epi32(b, _mm512_set1_epi32(kBins - 1)));
  }
#elif JAXSERVE_AVX2
  const __m256 mxv = _mm256_set1_ps(mx), sv = _mm256_set1_ps(scale);
  for (; j + 8 <= n; j += 8) {
    const __m256 dist = _mm256_sub_ps(mxv, _mm256_loadu_ps(c.x.data() + j));
    const __m256i b = _mm256_cvttps_epi32(_mm256_mul_ps(dist, sv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.bin.data() + j),
                        _mm256_min_epi32(b, _mm256_set1_epi32(kBins - 1)));
  }
#endif
  for (; j < n; ++j) {
    c.bin[j] = std::min<int32_t>(kBins - 1, static_cast<int32_t>((mx - c.x[j]) * scale));
  }
  double mass[kBins] = {};
  for (j = 0; j < n; ++j) mass[c.bin[j]] += c.p[j];
  double before = 0.0;
  int32_t b = 0;
  while (b < kBins - 1 && before + mass[b] < target) before += mass[b++];
  c.sorted.clear();
  j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    __mmask16 m = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(c.bin.data() + j),
                                          _mm512_set1_epi32(b));
    for (; m != 0; m &= m - 1) {
      const int64_t q = j + __builtin_ctz(m);
      c.sorted.push_back({c.x[q], c.id[q], c.p[q]});
    }
  }
#elif JAXSERVE_AVX2
  for (; j + 8 <= n; j += 8) {
    unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.bin.data() + j)),
        _mm256_set1_epi32(b)))));
    for (; m != 0; m &= m - 1) {
      const int64_t q = j + __builtin_ctz(m);
      c.sorted.push_back({c.x[q], c.id[q], c.p[q]});
    }
  }
#endif
  for (; j < n; ++j) {
    if (c.bin[j] == b) c.sorted.push_back({c.x[j], c.id[j], c.p[j]});
  }
  std::sort(c.sorted.begin(), c.sorted.end(), better);
  for (const Entry& e : c.sorted) {
    before += e.p;
    if (before >= target) return {e.x, e.id};
  }
  return {-std::numeric_limits<float>::infinity(), v};
}

void sample_row(const Problem& pr, int64_t r, std::vector<float>& p, std::vector<Entry>& heap,
                Candidates& cand, std::vector<double>& blocks) {
  const int64_t V = pr.v;
  const float* x = pr.x + r * V;
  bool* mask = pr.mask != nullptr ? pr.mask + r * V : nullptr;
  const float T = pr.temperature[r];
  const float mx = row_max(x, V);
  if (!pr.active[r] || !(T > 0.0f) || !std::isfinite(mx)) {  // nothing to sample from
    pr.tok[r] = 0;
    if (mask != nullptr) std::fill(mask, mask + V, false);
    return;
  }
  // Thresholds on x: min_p (p >= min_p <=> x >= mx + T log min_p) and the k-th largest value.
  double tau = -std::numeric_limits<double>::infinity();
  if (pr.min_p[r] > 0.0f) {
    tau = static_cast<double>(mx) +
          static_cast<double>(T) * std::log(static_cast<double>(pr.min_p[r]));
  }
  const int32_t k = pr.top_k[r];
  if (k > 0 && k < V) {
    top_k_heap(x, V, k, heap);
    tau = std::max(tau, static_cast<double>(heap.front().x));
  }
  const float lo = float_ceil(tau);
  p.resize(V);
  const double z = probabilities(x, V, mx, 1.0f / T, lo, p.data());

  // Top-p: kept are x > cut_x, and x == cut_x with id <= cut_id. The tokens below
  // mx + T (log((1 - top_p) z / V) - 1) weigh at most (1 - top_p) z / e together (each at most
  // (1 - top_p) z / (e V)), so the boundary lies above that value.
  float cut_x = -std::numeric_limits<float>::infinity();
  int64_t cut_id = V;
  const float top_p = pr.top_p[r];
  if (top_p < 1.0f) {
    const double tail = static_cast<double>(mx) +
        static_cast<double>(T) * (std::log((1.0 - top_p) * z / static_cast<double>(V)) - 1.0);
    const float thr = std::max(lo, float_ceil(tail));
    std::tie(cut_x, cut_id) =
        top_p_cut(x, p.data(), V, mx, thr, static_cast<double>(top_p) * z, cand);
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 cx = _mm512_set1_ps(cut_x);
    const __m512i cid = _mm512_set1_epi32(static_cast<int32_t>(cut_id));
    __m512i idv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= V; i += 16, idv = _mm512_add_epi32(idv, _mm512_set1_epi32(16))) {
      const __m512 xv = _mm512_loadu_ps(x + i);
      const __mmask16 keep = _mm512_cmp_ps_mask(xv, cx, _CMP_GT_OQ) |
                             (_mm512_cmp_ps_mask(xv, cx, _CMP_EQ_OQ) &
                              _mm512_cmple_epi32_mask(idv, cid));
      _mm512_storeu_ps(p.data() + i, _mm512_maskz_loadu_ps(keep, p.data() + i));
    }
#elif JAXSERVE_AVX2
    const __m256 cx = _mm256_set1_ps(cut_x);
    const __m256i cid = _mm256_set1_epi32(static_cast<int32_t>(cut_id));
    for (; i + 8 <= V; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      const __m256 id_le = _mm256_castsi256_ps(  // id <= cut_id: not id > cut_id
          _mm256_xor_si256(_mm256_cmpgt_epi32(ids8(i), cid), _mm256_set1_epi32(-1)));
      const __m256 keep = _mm256_or_ps(
          _mm256_cmp_ps(xv, cx, _CMP_GT_OQ),
          _mm256_and_ps(_mm256_cmp_ps(xv, cx, _CMP_EQ_OQ), id_le));
      _mm256_storeu_ps(p.data() + i, _mm256_and_ps(keep, _mm256_loadu_ps(p.data() + i)));
    }
#endif
    for (; i < V; ++i) {
      if (x[i] < cut_x || (x[i] == cut_x && i > cut_id)) p[i] = 0.0f;
    }
  }
  if (mask != nullptr) {
    for (int64_t i = 0; i < V; ++i) {
      mask[i] = x[i] >= lo && std::isfinite(x[i]) &&
                (top_p >= 1.0f || x[i] > cut_x || (x[i] == cut_x && i <= cut_id));
    }
  }

  // Inverse CDF in id order: block sums, then the ids of the chosen block.
  const int64_t nb = (V + kBlock - 1) / kBlock;
  blocks.assign(nb, 0.0);
  double total = 0.0;
  int64_t last_block = 0;
  for (int64_t bl = 0; bl < nb; ++bl) {
    const int64_t i0 = bl * kBlock, i1 = std::min(V, i0 + kBlock);
    int64_t i = i0;
    double s = 0.0;
#if defined(__AVX512F__)
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (; i + 16 <= i1; i += 16) add_to_double(a0, a1, _mm512_loadu_ps(p.data() + i));
    s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#elif JAXSERVE_AVX2
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; i + 8 <= i1; i += 8) add_to_double(a0, a1, _mm256_loadu_ps(p.data() + i));
    s = hsum4d(_mm256_add_pd(a0, a1));
#endif
    for (; i < i1; ++i) s += p[i];
    blocks[bl] = s;
    if (s > 0.0) last_block = bl;
    total += s;
  }
  const double t = static_cast<double>(pr.u[r]) * total;
  double cum = 0.0;
  int64_t bl = 0;
  for (; bl < last_block && cum + blocks[bl] <= t; ++bl) cum += blocks[bl];
  int64_t chosen = -1;
  for (int64_t i = bl * kBlock; i < std::min(V, (bl + 1) * kBlock); ++i) {
    if (p[i] <= 0.0f) continue;
    chosen = i;  // the last token with mass so far: the answer when rounding runs past
    cum += p[i];
    if (cum > t) break;
  }
  pr.tok[r] = static_cast<int32_t>(std::max<int64_t>(chosen, 0));
}

class SampleJob : public jaxserve::ParallelJob {
 public:
  explicit SampleJob(const Problem& p) : p_(p) {}
  void run(int64_t r) override {
    thread_local std::vector<float> p;
    thread_local std::vector<Entry> heap;
    thread_local Candidates cand;
    thread_local std::vector<double> blocks;
    sample_row(p_, r, p, heap, cand, blocks);
  }

 private:
  const Problem& p_;
};

ffi::Error SampleRowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> temperature,
                          ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                          ffi::Buffer<ffi::F32> min_p, ffi::Buffer<ffi::F32> u,
                          ffi::Buffer<ffi::PRED> active, ffi::ResultBuffer<ffi::S32> tok,
                          ffi::ResultBuffer<ffi::PRED> mask) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("sample_rows: x must be [R, V]");
  const int64_t R = xd[0], V = xd[1];
  for (size_t n : {temperature.element_count(), top_k.element_count(), top_p.element_count(),
                   min_p.element_count(), u.element_count(), active.element_count(),
                   tok->element_count()}) {
    if (static_cast<int64_t>(n) != R) {
      return ffi::Error::InvalidArgument("sample_rows: the per-row arrays must be [R]");
    }
  }
  const bool with_mask = mask->element_count() != 0;
  if (with_mask && static_cast<int64_t>(mask->element_count()) != R * V) {
    return ffi::Error::InvalidArgument("sample_rows: mask must be [R, V] or empty");
  }
  Problem p{x.typed_data(), V, temperature.typed_data(), top_p.typed_data(),
            min_p.typed_data(), u.typed_data(), top_k.typed_data(), active.typed_data(),
            tok->typed_data(), with_mask ? mask->typed_data() : nullptr};
  SampleJob job(p);
  jaxserve::parallel_for(R, job);
  return ffi::Error::Success();
}


// log(sum(exp(x - mx))) + mx over a row, the sum in double.
double log_sum_exp(const float* x, int64_t v, float mx) {
  double z = 0.0;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 mxv = _mm512_set1_ps(mx);
  __m512d z0 = _mm512_setzero_pd(), z1 = _mm512_setzero_pd();
  for (; i + 16 <= v; i += 16) {
    add_to_double(z0, z1, jaxserve::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mxv)));
  }
  z = _mm512_reduce_add_pd(_mm512_add_pd(z0, z1));
#elif JAXSERVE_AVX2
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256d z0 = _mm256_setzero_pd(), z1 = _mm256_setzero_pd();
  for (; i + 8 <= v; i += 8) {
    add_to_double(z0, z1, jaxserve::exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mxv)));
  }
  z = hsum4d(_mm256_add_pd(z0, z1));
#endif
  for (; i < v; ++i) z += jaxserve::fast_exp(x[i] - mx);
  return static_cast<double>(mx) + std::log(z);
}

// #{i : x[i] >= t}.
int64_t count_at_least(const float* x, int64_t v, float t) {
  int64_t n = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(t);
  for (; i + 16 <= v; i += 16) {
    n += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), tv, _CMP_GE_OQ));
  }
#elif JAXSERVE_AVX2
  const __m256 tv = _mm256_set1_ps(t);
  for (; i + 8 <= v; i += 8) {
    n += __builtin_popcount(static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_GE_OQ))));
  }
#endif
  for (; i < v; ++i) n += x[i] >= t;
  return n;
}

struct LogprobProblem {
  const float* x;
  const int32_t* tok;
  int64_t v, k;
  float* lp;
  int32_t* ids;
  float* top;
  int32_t* rank;
};

class LogprobJob : public jaxserve::ParallelJob {
 public:
  explicit LogprobJob(const LogprobProblem& p) : p_(p) {}
  void run(int64_t r) override {
    thread_local std::vector<Entry> heap;
    const float* x = p_.x + r * p_.v;
    const int64_t t = std::clamp<int64_t>(p_.tok[r], 0, p_.v - 1);
    const float lse = static_cast<float>(log_sum_exp(x, p_.v, row_max(x, p_.v)));
    p_.lp[r] = x[t] - lse;
    p_.rank[r] = static_cast<int32_t>(count_at_least(x, p_.v, x[t]));
    if (p_.k == 0) return;
    top_k_heap(x, p_.v, p_.k, heap);
    std::sort_heap(heap.begin(), heap.end(), better);  // largest first
    for (int64_t j = 0; j < p_.k; ++j) {
      p_.ids[r * p_.k + j] = heap[j].id;
      p_.top[r * p_.k + j] = heap[j].x - lse;
    }
  }

 private:
  const LogprobProblem& p_;
};

ffi::Error RawLogprobsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> tok,
                           ffi::ResultBuffer<ffi::F32> lp, ffi::ResultBuffer<ffi::S32> ids,
                           ffi::ResultBuffer<ffi::F32> top, ffi::ResultBuffer<ffi::S32> rank) {
  const auto xd = x.dimensions();
  const auto kd = ids->dimensions();
  if (xd.size() != 2 || kd.size() != 2 || kd[0] != xd[0] || kd[1] > xd[1] ||
      top->element_count() != ids->element_count() ||
      static_cast<int64_t>(tok.element_count()) != xd[0] ||
      static_cast<int64_t>(lp->element_count()) != xd[0] ||
      static_cast<int64_t>(rank->element_count()) != xd[0]) {
    return ffi::Error::InvalidArgument(
        "raw_logprobs: x [N, V], tok [N] -> lp [N], ids and top [N, k <= V], rank [N]");
  }
  LogprobProblem p{x.typed_data(), tok.typed_data(), xd[1], kd[1], lp->typed_data(),
                   ids->typed_data(), top->typed_data(), rank->typed_data()};
  LogprobJob job(p);
  jaxserve::parallel_for(xd[0], job);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSampleRows, SampleRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [R, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // min_p [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // u [R] in [0, 1)
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // active [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // token [R]
                                  .Ret<ffi::Buffer<ffi::PRED>>()); // kept [R, V] or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRawLogprobs, RawLogprobsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, V] raw logits
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tok [N]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // logprob of tok [N]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // top ids [N, k]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // their logprobs [N, k]
                                  .Ret<ffi::Buffer<ffi::S32>>()); // rank of tok [N]
