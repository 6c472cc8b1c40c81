// SIMD building blocks of the CPU kernels: exp, row max, bfloat16 rows, the two products of
// an attention key chunk. Chosen at compile time by the target's macros: AVX-512 (__AVX512F__),
// else AVX2 with FMA (JAXSERVE_AVX2: 8 lanes, 16 ymm registers; the code an AVX2-only CPU
// runs, built here with -march=haswell), else portable loops. All three give the same results
// up to the order of float32 additions.
#ifndef JAXSERVE_PALLAS_KERNELS_CPU_SIMD_H_
#define JAXSERVE_PALLAS_KERNELS_CPU_SIMD_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JAXSERVE_AVX2 1
#else
#define JAXSERVE_AVX2 0
#endif

#if defined(__AVX512F__) || JAXSERVE_AVX2
#include <immintrin.h>
#endif

namespace jaxserve {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for float32, Cephes-style: 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial
// (relative error ~2e-7). Branch-free so that loops over it vectorize. exp(-inf) = 0.
inline float fast_exp(float x) {
  const bool neg_inf = x < -87.0f;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return neg_inf ? 0.0f : p * scale;
}

#if JAXSERVE_AVX2
inline float hmax8(__m256 v) {  // max of the 8 lanes
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {  // sum of the 8 lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes [0, n) set (n in [0, 8]).
inline __m256i lanes8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 exp256(__m256 x) {  // fast_exp on 8 lanes
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif  // JAXSERVE_AVX2

// max of x[lo..hi) (non-empty).
inline float range_max(const float* x, int lo, int hi) {
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(kNegInf);
  for (int j = lo; j < hi; j += 16) {
    const __mmask16 mk = static_cast<__mmask16>((1u << std::min(16, hi - j)) - 1);
    mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, x + j));
  }
  return _mm512_reduce_max_ps(mv);
#else
  int j = lo;
  float mv = kNegInf;
#if JAXSERVE_AVX2
  if (hi - lo >= 8) {
    __m256 v = _mm256_set1_ps(kNegInf);
    for (; j + 8 <= hi; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + j));
    mv = hmax8(v);
  }
#endif
  for (; j < hi; ++j) mv = std::max(mv, x[j]);
  return mv;
#endif
}

#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) {  // fast_exp on 16 lanes
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), p, _mm512_castsi512_ps(e));
}
#endif

// dst[j] = silu(g[j]) * u[j] = g[j] / (1 + exp(-g[j])) * u[j] for j < n (the GLU of an MLP).
// GCC leaves the loop over fast_exp scalar, so AVX-512 builds take 16 lanes at a time (AVX2
// builds 8).
inline void silu_mul(const float* g, const float* u, float* dst, int n) {
  int j = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; j + 16 <= n; j += 16) {
    const __m512 gv = _mm512_loadu_ps(g + j);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(dst + j,
                     _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + j)));
  }
#elif JAXSERVE_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(dst + j,
                     _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
  }
#endif
  for (; j < n; ++j) dst[j] = g[j] / (1.0f + fast_exp(-g[j])) * u[j];
}

// x[j] = exp(x[j] - m) for j in [lo, hi); returns their sum.
inline float exp_sum(float* x, int lo, int hi, float m) {
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int j = lo; j < hi; j += 16) {
    const __mmask16 mk = static_cast<__mmask16>((1u << std::min(16, hi - j)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, x + j), mv));
    _mm512_mask_storeu_ps(x + j, mk, e);
    sum = _mm512_mask_add_ps(sum, mk, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#elif JAXSERVE_AVX2
  // (A masked store for the tail is microcoded on some CPUs: the tail goes through a buffer.)
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  int j = lo;
  for (; j + 8 <= hi; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
    _mm256_storeu_ps(x + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (j < hi) {
    alignas(32) float t[8] = {};
    std::copy(x + j, x + hi, t);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_load_ps(t), mv)),
                                   _mm256_castsi256_ps(lanes8(hi - j)));
    _mm256_store_ps(t, e);
    std::copy(t, t + (hi - j), x + j);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum8(sum);
#else
  float sum = 0.0f;
  for (int j = lo; j < hi; ++j) {
    x[j] = fast_exp(x[j] - m);
    sum += x[j];
  }
  return sum;
#endif
}


inline float widen(float x) { return x; }
inline float widen(uint16_t x) {  // bfloat16 bits -> float
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

#if JAXSERVE_AVX2
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {  // 8 bfloat16 -> 8 floats
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#endif

// dst[i] = src[i] (bfloat16 bits) as float.
inline void load_row(const uint16_t* src, float* dst, int d) {
  int i = 0;
#if JAXSERVE_AVX2
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
#pragma omp simd
  for (int j = i; j < d; ++j) dst[j] = widen(src[j]);
}

// The bfloat16 bits of x, rounded to nearest even as XLA's convert (NaN stays NaN).
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void store_row_bf16(const float* src, uint16_t* dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = to_bf16(src[i]);
}

// x[i] = float32(bfloat16(x[i])).
inline void round_row_bf16(float* x, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) {
    const uint32_t u = static_cast<uint32_t>(to_bf16(x[i])) << 16;
    std::memcpy(&x[i], &u, sizeof(float));
  }
}

// s[i * ld + j] = <q_i, k[j]> for rows i < rows and keys j < n (q: [rows, d]; k[j] points to
// key j's d floats; with AVX-512 or AVX2, k must hold a multiple of 16 pointers, the extra ones
// to zeros).
inline void qk_scores(const float* q, int rows, const float* const* k, int n, int d, float* s,
                      int ld) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    for (int i = 0; i < rows; ++i) {
      const float* qi = q + i * d;
      for (int j0 = 0; j0 < n; j0 += 16) {
        __m512 a[16];
        for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
        for (int c = 0; c < d; c += 16) {
          const __m512 qv = _mm512_loadu_ps(qi + c);
          for (int j = 0; j < 16; ++j) {
            a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j0 + j] + c), a[j]);
          }
        }
        // Transpose-reduce: lane j of r is the sum of a[j]'s 16 lanes.
        __m512 x[8];
        for (int p = 0; p < 8; ++p) {
          x[p] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]),
                               _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]));
        }
        __m512 y[4];
        for (int p = 0; p < 4; ++p) {
          y[p] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        }
        const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
        const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
        const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
        const int m = std::min(16, n - j0);
        _mm512_mask_storeu_ps(s + i * ld + j0, static_cast<__mmask16>((1u << m) - 1), r);
      }
    }
    return;
  }
#elif JAXSERVE_AVX2
  if (d % 8 == 0) {
    for (int i = 0; i < rows; ++i) {
      const float* qi = q + i * d;
      for (int j0 = 0; j0 < n; j0 += 8) {
        // 8 keys at a time (named accumulators, as in pv_rows_avx2).
        const float *k0 = k[j0], *k1 = k[j0 + 1], *k2 = k[j0 + 2], *k3 = k[j0 + 3];
        const float *k4 = k[j0 + 4], *k5 = k[j0 + 5], *k6 = k[j0 + 6], *k7 = k[j0 + 7];
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
               a7 = a0;
        for (int c = 0; c < d; c += 8) {
          const __m256 qv = _mm256_loadu_ps(qi + c);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + c), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + c), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + c), a3);
          a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4 + c), a4);
          a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k5 + c), a5);
          a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k6 + c), a6);
          a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k7 + c), a7);
        }
        // Transpose-reduce: lane j of r is the sum of aj's 8 lanes.
        const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
        const __m256 h45 = _mm256_hadd_ps(a4, a5), h67 = _mm256_hadd_ps(a6, a7);
        const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
        const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                       _mm256_permute2f128_ps(lo, hi, 0x31));
        if (n - j0 >= 8) {
          _mm256_storeu_ps(s + i * ld + j0, r);
        } else {  // (a masked store is microcoded on some CPUs)
          alignas(32) float t[8];
          _mm256_store_ps(t, r);
          std::copy(t, t + (n - j0), s + i * ld + j0);
        }
      }
    }
    return;
  }
#endif
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < n; ++j) {
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int c = 0; c < d; ++c) acc += q[i * d + c] * k[j][c];
      s[i * ld + j] = acc;
    }
  }
}


#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {  // 16 bfloat16 -> 16 floats
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

#if JAXSERVE_AVX2
// Columns [c, c + 16) of pv_accumulate for R <= 6 rows (p, acc: those rows' first). The
// accumulators are named variables (JAXSERVE_ROWS6): with an array of them, GCC also stores
// the array to the stack on every key, which halves the speed.
#define JAXSERVE_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int R, typename T>
inline void pv_rows_avx2(const float* p, int ld, const T* const* v, int n, int c, float* acc,
                         int d) {
  static_assert(R >= 1 && R <= 6);
  __m256 a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51;
#define JAXSERVE_LOAD(r)                                \
  if constexpr (R > r) {                                \
    a##r##0 = _mm256_loadu_ps(acc + r * d + c);         \
    a##r##1 = _mm256_loadu_ps(acc + r * d + c + 8);     \
  }
#define JAXSERVE_FMA(r)                                            \
  if constexpr (R > r) {                                           \
    const __m256 pr = _mm256_broadcast_ss(p + r * ld + j);         \
    a##r##0 = _mm256_fmadd_ps(pr, v0, a##r##0);                    \
    a##r##1 = _mm256_fmadd_ps(pr, v1, a##r##1);                    \
  }
#define JAXSERVE_STORE(r)                               \
  if constexpr (R > r) {                                \
    _mm256_storeu_ps(acc + r * d + c, a##r##0);         \
    _mm256_storeu_ps(acc + r * d + c + 8, a##r##1);     \
  }
  JAXSERVE_ROWS6(JAXSERVE_LOAD)
  for (int j = 0; j < n; ++j) {
    const __m256 v0 = load8(v[j] + c), v1 = load8(v[j] + c + 8);
    JAXSERVE_ROWS6(JAXSERVE_FMA)
  }
  JAXSERVE_ROWS6(JAXSERVE_STORE)
#undef JAXSERVE_LOAD
#undef JAXSERVE_FMA
#undef JAXSERVE_STORE
}
#undef JAXSERVE_ROWS6
#endif

// acc_i += sum_j p[i * ld + j] * v[j] for rows i < rows and keys j < n (v[j]: d values, float32
// or bfloat16 widened as they are loaded).
template <typename T>
inline void pv_accumulate(const float* p, int rows, const T* const* v, int n, int d,
                          float* acc, int ld) {
#if defined(__AVX512F__)
  if (d % 64 == 0) {
    constexpr int kRows = 4;  // 4 rows x 64 columns of accumulators stay in registers
    for (int c = 0; c < d; c += 64) {
      for (int i0 = 0; i0 < rows; i0 += kRows) {
        const int nr = std::min(kRows, rows - i0);
        __m512 a[kRows][4];
        for (int r = 0; r < nr; ++r) {
          for (int x = 0; x < 4; ++x) a[r][x] = _mm512_loadu_ps(acc + (i0 + r) * d + c + 16 * x);
        }
        for (int j = 0; j < n; ++j) {
          const T* vj = v[j] + c;
          const __m512 v0 = load16(vj), v1 = load16(vj + 16);
          const __m512 v2 = load16(vj + 32), v3 = load16(vj + 48);
          for (int r = 0; r < nr; ++r) {
            const __m512 pr = _mm512_set1_ps(p[(i0 + r) * ld + j]);
            a[r][0] = _mm512_fmadd_ps(pr, v0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(pr, v1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(pr, v2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(pr, v3, a[r][3]);
          }
        }
        for (int r = 0; r < nr; ++r) {
          for (int x = 0; x < 4; ++x) _mm512_storeu_ps(acc + (i0 + r) * d + c + 16 * x, a[r][x]);
        }
      }
    }
    return;
  }
#elif JAXSERVE_AVX2
  if (d % 16 == 0) {
    // R rows x 16 columns of accumulators (2R ymm registers; R <= 6 leaves room for the two
    // value vectors and a broadcast within 16).
    for (int c = 0; c < d; c += 16) {
      int i0 = 0;
      for (; i0 + 6 <= rows; i0 += 6) pv_rows_avx2<6>(p + i0 * ld, ld, v, n, c, acc + i0 * d, d);
      switch (rows - i0) {
        case 5: pv_rows_avx2<5>(p + i0 * ld, ld, v, n, c, acc + i0 * d, d); break;
        case 4: pv_rows_avx2<4>(p + i0 * ld, ld, v, n, c, acc + i0 * d, d); break;
        case 3: pv_rows_avx2<3>(p + i0 * ld, ld, v, n, c, acc + i0 * d, d); break;
        case 2: pv_rows_avx2<2>(p + i0 * ld, ld, v, n, c, acc + i0 * d, d); break;
        case 1: pv_rows_avx2<1>(p + i0 * ld, ld, v, n, c, acc + i0 * d, d); break;
        default: break;
      }
    }
    return;
  }
#endif
  for (int i = 0; i < rows; ++i) {
    float* ai = acc + i * d;
    for (int j = 0; j < n; ++j) {
      const float pj = p[i * ld + j];
#pragma omp simd
      for (int c = 0; c < d; ++c) ai[c] += pj * widen(v[j][c]);
    }
  }
}

}  // namespace jaxserve

#endif  // JAXSERVE_PALLAS_KERNELS_CPU_SIMD_H_
