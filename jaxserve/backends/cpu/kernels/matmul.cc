// Matrix products on pre-packed weights for XLA:CPU, called through the XLA FFI (see matmul.py).
//
// out[M, N] (float32) = A[M, K] @ W[K, N], W packed once at load time:
// - bfloat16 W, on Intel AMX: AMX B-tile order, blocks[N / 16][K / 32][16][32], where block
//   (nb, kb) row p holds, for each of its 16 columns n, the pair (W[32 kb + 2 p, 16 nb + n],
//   W[32 kb + 2 p + 1, 16 nb + n]). A is cast to bfloat16. Requires the process to be granted
//   AMX tile data (arch_prctl), done once on first use.
// - float32 or bfloat16 W, with AVX-512 FMAs, or AVX2 FMAs where the build has no AVX-512
//   (JAXSERVE_AVX2, simd.h): column strips, strips[N / 32][K][32], the same packing for both.
//   A bfloat16 strip row is widened to float32 as it is loaded (a shift: bfloat16 is the top
//   half of a float32), so the products compute in float32 while reading half the bytes: what
//   CPUs without AMX (and XLA's slow bfloat16 dot there) get for bfloat16 weights.
// K and N must be multiples of 32. A is x (float32 or bfloat16), or with `norm` RMSNorm(x) *
// norm computed in float32. The result can be added to a float32 `residual`, or with `glu`
// (W = [gate | up], N/2 columns each) be silu(gate) * up. These are the ops around each
// product of a decoder layer: fusing them saves XLA ops of 20-60 us each, ~150 per step. Given
// `live`, only the first `live` rows are computed (a padded bucket's padding rows get zeros,
// or the residual's rows).
// Work items are runs of 32-column strips of the output; each strip walks the rows in blocks
// (32 rows on AMX: two A tiles and four accumulator tiles, so a weight tile is loaded once per
// 32 rows; 12 rows with AVX-512: 24 accumulator registers; 32 rows with AVX2, walked in
// chunks of k by sub-blocks of up to 6 rows, each half strip of 16 columns in turn: 12 of
// the 16 ymm registers) and finishes each block through a small buffer (plain copy,
// + residual, or the GLU).

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define JAXSERVE_HAVE_AMX 1
#else
#define JAXSERVE_HAVE_AMX 0
#endif

namespace ffi = xla::ffi;

namespace {

#if JAXSERVE_HAVE_AMX
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif  // JAXSERVE_HAVE_AMX

// x rows [0, m) -> A rows (bfloat16 for AMX, float32 otherwise), optionally through an RMSNorm
// in float32 first: a = x * (1 / sqrt(mean(x^2) + eps)) * norm. An item is kRows rows: one row
// is less work than handing an item over.
class PrologueJob : public jaxserve::ParallelJob {
 public:
  static constexpr int64_t kRows = 16;

  PrologueJob(const void* x, bool x_bf16, const float* norm, float eps, int64_t m, int64_t k,
              uint16_t* a_bf16, float* a_f32)
      : x_(x), x_bf16_(x_bf16), norm_(norm), eps_(eps), m_(m), k_(k), a_bf16_(a_bf16),
        a_f32_(a_f32) {}

  int64_t items() const { return (m_ + kRows - 1) / kRows; }

  void run(int64_t item) override {
    for (int64_t row = item * kRows; row < std::min(m_, (item + 1) * kRows); ++row) convert(row);
  }

 private:
  void convert(int64_t row) {
    float* xf = a_f32_ != nullptr ? a_f32_ + row * k_ : buf_(k_);
    if (x_bf16_) {
      jaxserve::load_row(static_cast<const uint16_t*>(x_) + row * k_, xf, static_cast<int>(k_));
    } else {
      std::memcpy(xf, static_cast<const float*>(x_) + row * k_, k_ * sizeof(float));
    }
    if (norm_ != nullptr) {
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < k_; ++j) ss += xf[j] * xf[j];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(k_) + eps_);
#pragma omp simd
      for (int64_t j = 0; j < k_; ++j) xf[j] = xf[j] * inv * norm_[j];
    }
    if (a_bf16_ != nullptr) jaxserve::store_row_bf16(xf, a_bf16_ + row * k_, static_cast<int>(k_));
  }

  static float* buf_(int64_t k) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < k) buf.resize(k);
    return buf.data();
  }
  const void* x_;
  bool x_bf16_;
  const float* norm_;
  float eps_;
  int64_t m_, k_;
  uint16_t* a_bf16_;
  float* a_f32_;
};

// The strip walk and epilogues shared by both products; block() computes one row block.
class StripJob : public jaxserve::ParallelJob {
 public:
  // Items are runs of consecutive strips (a thread's reads continue): 8 of them, or runs of
  // kMaxRun strips when there are more than 8 such runs (an LM head: 96), so that a helper
  // thread the OS preempts in the middle of an item holds up little of the call.
  static constexpr int64_t kItems = 8;
  static constexpr int64_t kMaxRun = 16;

  StripJob(const float* residual, bool glu, float* out, int64_t m, int64_t k, int64_t n,
           int64_t block_rows)
      : residual_(residual), glu_(glu), out_(out), m_(m), k_(k), n_(n), block_rows_(block_rows) {}

  int64_t items() const { return (strips() + run_length() - 1) / run_length(); }

  void run(int64_t item) override {
    const int64_t per = run_length();
    for (int64_t s = item * per; s < std::min(strips(), (item + 1) * per); ++s) run_strip(s);
  }

 protected:
  // c[rows x 32] (row stride 32) = rows [m0, m0 + rows) of A @ columns [32 s, 32 s + 32).
  virtual void block(int64_t s, int64_t m0, int64_t rows, float* c) const = 0;
  int64_t k_, n_;

 private:
  int64_t strips() const { return glu_ ? n_ / 64 : n_ / 32; }
  int64_t run_length() const {
    return std::min(kMaxRun, std::max<int64_t>(1, (strips() + kItems - 1) / kItems));
  }

  void run_strip(int64_t strip) {
    alignas(64) float c0[32 * 32];
    alignas(64) float c1[32 * 32];
    const int64_t out_n = glu_ ? n_ / 2 : n_;
    for (int64_t m0 = 0; m0 < m_; m0 += block_rows_) {
      const int64_t rows = std::min<int64_t>(block_rows_, m_ - m0);
      block(strip, m0, rows, c0);
      if (glu_) block(strip + n_ / 64, m0, rows, c1);
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out_ + (m0 + r) * out_n + strip * 32;
        const float* g = c0 + r * 32;
        if (glu_) {
          jaxserve::silu_mul(g, c1 + r * 32, dst, 32);
        } else if (residual_ != nullptr) {
          const float* res = residual_ + (m0 + r) * n_ + strip * 32;
#pragma omp simd
          for (int j = 0; j < 32; ++j) dst[j] = res[j] + g[j];
        } else {
          std::memcpy(dst, g, 32 * sizeof(float));
        }
      }
    }
  }

  const float* residual_;  // [M, N] or null
  bool glu_;
  float* out_;
  int64_t m_;
  int64_t block_rows_;
};

#if JAXSERVE_HAVE_AMX
// Tiles 0-3: float32 accumulators (rows 0-15 / 16-31 x columns 0-15 / 16-31 of a strip);
// 4-5: the two 16-row blocks of A; 6-7: the strip's two weight blocks. All 16 rows x 64 bytes.
class AmxJob : public StripJob {
 public:
  AmxJob(const uint16_t* a, const uint16_t* w, const float* residual, bool glu, float* out,
         int64_t m, int64_t k, int64_t n)
      : StripJob(residual, glu, out, m, k, n, 32), a_(a), w_(w) {}

  void begin() override {
    static const TileConfig cfg = [] {
      TileConfig c;
      for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
      }
      return c;
    }();
    // Some GCC versions do not see that ldtilecfg reads its operand and drop the stores
    // filling it; the barrier keeps them.
    asm volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
  }

  void end() override { _tile_release(); }

 private:
  // Tile loads stall on weights coming from L3 or memory; asking for the blocks a few steps
  // ahead keeps them in flight (the weights are read once per call, so nothing else hides it).
  // Past a strip's end, b0's lookahead lands in b1's blocks and b1's in the next strip's.
  inline void prefetch_ahead(const uint16_t* b0, const uint16_t* b1, int64_t kb) const {
    const uint16_t* w_end = w_ + k_ * n_;
    constexpr int64_t kAhead = 4;
    const uint16_t* p0 = b0 + (kb + kAhead) * 512;
    const uint16_t* p1 = b1 + (kb + kAhead) * 512;
    for (int c = 0; c < 512; c += 32) {
      if (p0 + c < w_end) _mm_prefetch(reinterpret_cast<const char*>(p0 + c), _MM_HINT_T0);
      if (p1 + c < w_end) _mm_prefetch(reinterpret_cast<const char*>(p1 + c), _MM_HINT_T0);
    }
  }

  void block(int64_t s, int64_t m0, int64_t rows, float* c) const override {
    const int64_t kb_count = k_ / 32;
    const uint16_t* b0 = w_ + (2 * s) * kb_count * 512;  // a packed block is 16 x 32 values
    const uint16_t* b1 = b0 + kb_count * 512;
    const uint16_t* a = a_ + m0 * k_;  // A has whole 32-row blocks (zero-padded)
    const int64_t lda = k_ * 2;        // bytes
    _tile_zero(0);
    _tile_zero(1);
    if (rows > 16) {
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        prefetch_ahead(b0, b1, kb);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_loadd(4, a + kb * 32, lda);
        _tile_loadd(5, a + 16 * k_ + kb * 32, lda);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(2, c + 16 * 32, 128);
      _tile_stored(3, c + 16 * 32 + 16, 128);
    } else {
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        prefetch_ahead(b0, b1, kb);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_loadd(4, a + kb * 32, lda);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
  }

  const uint16_t* a_;
  const uint16_t* w_;
};
#endif  // JAXSERVE_HAVE_AMX

#if defined(__AVX512F__)
// 16 weights of a strip row as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// c[R x 32] = a[R rows, stride k] @ b[k][32]: 2R accumulator registers, one broadcast of A per
// row and two weight loads per k. W: float (float32) or uint16_t (bfloat16 bits).
template <int R, typename W>
void f32_rows(const float* a, int64_t k, const W* b, float* c) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (kk + 16) * 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + (kk + 16) * 32 + 16), _MM_HINT_T0);
    const __m512 b0 = load16(b + kk * 32), b1 = load16(b + kk * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * k + kk]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * 32, acc[r][0]);
    _mm512_storeu_ps(c + r * 32 + 16, acc[r][1]);
  }
}

template <typename W>
class F32Job : public StripJob {
 public:
  static constexpr int64_t kRows = 12;

  F32Job(const float* a, const W* w, const float* residual, bool glu, float* out, int64_t m,
         int64_t k, int64_t n)
      : StripJob(residual, glu, out, m, k, n, kRows), a_(a), w_(w) {}

 private:
  void block(int64_t s, int64_t m0, int64_t rows, float* c) const override {
    using Fn = void (*)(const float*, int64_t, const W*, float*);
    static constexpr Fn kFns[kRows] = {
        f32_rows<1, W>, f32_rows<2, W>, f32_rows<3, W>,  f32_rows<4, W>,
        f32_rows<5, W>, f32_rows<6, W>, f32_rows<7, W>,  f32_rows<8, W>,
        f32_rows<9, W>, f32_rows<10, W>, f32_rows<11, W>, f32_rows<12, W>};
    kFns[rows - 1](a_ + m0 * k_, k_, w_ + s * k_ * 32, c);
  }

  const float* a_;
  const W* w_;
};
#elif JAXSERVE_AVX2
// AVX2 has 16 ymm registers of 8 floats, too few for the AVX-512 kernel's one pass of 12 rows
// over a strip. Blocks of 3-6 rows take a strip as two halves of 16 columns, one after the
// other: 2R accumulators, two weight loads and a broadcast per k (R = 6: 15 registers, 12
// FMAs per 8 loads; ~110 GFLOP/s on one core with the strip in L2). One or two rows take all
// 32 columns at once (4R accumulators, four weight loads), so that at one row each weight row
// is read once, streaming from memory. Several passes over a strip would each wait on memory
// in turn, so an item walks k in chunks of kChunk rows (8 KB of a float32 strip, L1-sized):
// every row block and half takes the chunk before the next chunk, and the loads are
// prefetched 8 KB ahead, so the next chunk streams in while the later passes compute.
constexpr int64_t kChunk = 64;
constexpr int64_t kAheadBytes = 8192;  // prefetch distance

// Prefetches the strip row kAheadBytes past `row`. A float32 row is two cache lines, into L1;
// a bfloat16 row one line, into L2 (T1): a one-row product from memory took 0.81x the time of
// prefetching 4 KB ahead into L1 (emulated AVX2 class); float32 rows gained nothing from T1.
template <typename W>
inline void prefetch_ahead(const W* row) {
  const char* p = reinterpret_cast<const char*>(row) + kAheadBytes;
  if constexpr (sizeof(W) == sizeof(float)) {
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
  } else {
    _mm_prefetch(p, _MM_HINT_T1);
  }
}

// 8 weights of a strip row as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The accumulators are named variables: with an array of them GCC also stores the array to
// the stack on every k, which ran at a third of the speed.
#define JAXSERVE_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)

// c[R x 16] (row stride 32; + c itself with `accumulate`) = a[R rows, stride lda] @ b[kn][16]
// (row stride 32), R <= 6. W: float (float32) or uint16_t (bfloat16 bits).
template <int R, typename W>
void f32_half_rows_avx2(const float* a, int64_t lda, int64_t kn, const W* b, float* c,
                        bool accumulate) {
  static_assert(R >= 1 && R <= 6);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define JAXSERVE_LOAD(r)                                       \
  if constexpr (R > r) {                                       \
    c##r##0 = _mm256_loadu_ps(c + r * 32);                     \
    c##r##1 = _mm256_loadu_ps(c + r * 32 + 8);                 \
  }
#define JAXSERVE_FMA(r)                                        \
  if constexpr (R > r) {                                       \
    const __m256 av = _mm256_broadcast_ss(a + r * lda + kk);   \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);                \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);                \
  }
#define JAXSERVE_STORE(r)                                      \
  if constexpr (R > r) {                                       \
    _mm256_storeu_ps(c + r * 32, c##r##0);                     \
    _mm256_storeu_ps(c + r * 32 + 8, c##r##1);                 \
  }
  if (accumulate) {
    JAXSERVE_ROWS6(JAXSERVE_LOAD)
  }
  for (int64_t kk = 0; kk < kn; ++kk) {
    prefetch_ahead(b + kk * 32);  // the whole row: the other half's pass finds it cached
    const __m256 b0 = load8(b + kk * 32), b1 = load8(b + kk * 32 + 8);
    JAXSERVE_ROWS6(JAXSERVE_FMA)
  }
  JAXSERVE_ROWS6(JAXSERVE_STORE)
#undef JAXSERVE_LOAD
#undef JAXSERVE_FMA
#undef JAXSERVE_STORE
}

// c[R x 32] (+ c with `accumulate`) = a[R rows, stride lda] @ b[kn][32], R <= 2.
template <int R, typename W>
void f32_full_rows_avx2(const float* a, int64_t lda, int64_t kn, const W* b, float* c,
                        bool accumulate) {
  static_assert(R >= 1 && R <= 2);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00,
         c12 = c00, c13 = c00;
#define JAXSERVE_LOAD(r)                                       \
  if constexpr (R > r) {                                       \
    c##r##0 = _mm256_loadu_ps(c + r * 32);                     \
    c##r##1 = _mm256_loadu_ps(c + r * 32 + 8);                 \
    c##r##2 = _mm256_loadu_ps(c + r * 32 + 16);                \
    c##r##3 = _mm256_loadu_ps(c + r * 32 + 24);                \
  }
#define JAXSERVE_FMA(r)                                        \
  if constexpr (R > r) {                                       \
    const __m256 av = _mm256_broadcast_ss(a + r * lda + kk);   \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);                \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);                \
    c##r##2 = _mm256_fmadd_ps(av, b2, c##r##2);                \
    c##r##3 = _mm256_fmadd_ps(av, b3, c##r##3);                \
  }
#define JAXSERVE_STORE(r)                                      \
  if constexpr (R > r) {                                       \
    _mm256_storeu_ps(c + r * 32, c##r##0);                     \
    _mm256_storeu_ps(c + r * 32 + 8, c##r##1);                 \
    _mm256_storeu_ps(c + r * 32 + 16, c##r##2);                \
    _mm256_storeu_ps(c + r * 32 + 24, c##r##3);                \
  }
  if (accumulate) {
    JAXSERVE_LOAD(0) JAXSERVE_LOAD(1)
  }
  for (int64_t kk = 0; kk < kn; ++kk) {
    prefetch_ahead(b + kk * 32);
    const W* bk = b + kk * 32;
    const __m256 b0 = load8(bk), b1 = load8(bk + 8);
    const __m256 b2 = load8(bk + 16), b3 = load8(bk + 24);
    JAXSERVE_FMA(0) JAXSERVE_FMA(1)
  }
  JAXSERVE_STORE(0) JAXSERVE_STORE(1)
#undef JAXSERVE_LOAD
#undef JAXSERVE_FMA
#undef JAXSERVE_STORE
}
#undef JAXSERVE_ROWS6

template <typename W>
class F32Job : public StripJob {
 public:
  static constexpr int64_t kRows = 32;  // per block(); split into sub-blocks of <= 6 rows

  F32Job(const float* a, const W* w, const float* residual, bool glu, float* out, int64_t m,
         int64_t k, int64_t n)
      : StripJob(residual, glu, out, m, k, n, kRows), a_(a), w_(w) {}

 private:
  void block(int64_t s, int64_t m0, int64_t rows, float* c) const override {
    using Fn = void (*)(const float*, int64_t, int64_t, const W*, float*, bool);
    static constexpr Fn kHalf[6] = {f32_half_rows_avx2<1, W>, f32_half_rows_avx2<2, W>,
                                    f32_half_rows_avx2<3, W>, f32_half_rows_avx2<4, W>,
                                    f32_half_rows_avx2<5, W>, f32_half_rows_avx2<6, W>};
    static constexpr Fn kFull[2] = {f32_full_rows_avx2<1, W>, f32_full_rows_avx2<2, W>};
    const W* b = w_ + s * k_ * 32;
    const int64_t blocks = (rows + 5) / 6;  // balanced: 8 rows are 4 + 4, 32 are 6 6 5 5 5 5
    for (int64_t k0 = 0; k0 < k_; k0 += kChunk) {
      const int64_t kn = std::min(kChunk, k_ - k0);
      for (int64_t i = 0, r0 = 0; r0 < rows; ++i) {
        const int64_t r = (rows - r0 + (blocks - i) - 1) / (blocks - i);
        const float* a = a_ + (m0 + r0) * k_ + k0;
        float* cr = c + r0 * 32;
        if (r <= 2) {
          kFull[r - 1](a, k_, kn, b + k0 * 32, cr, k0 > 0);
        } else {
          kHalf[r - 1](a, k_, kn, b + k0 * 32, cr, k0 > 0);
          kHalf[r - 1](a, k_, kn, b + k0 * 32 + 16, cr + 16, k0 > 0);
        }
        r0 += r;
      }
    }
  }

  const float* a_;
  const W* w_;
};
#endif  // __AVX512F__, JAXSERVE_AVX2

// Rows [live, m) of the output: the residual's rows, or zeros.
void fill_dead_rows(float* out, const float* residual, int64_t live, int64_t m, int64_t out_n) {
  if (residual != nullptr) {
    std::memcpy(out + live * out_n, residual + live * out_n, (m - live) * out_n * sizeof(float));
  } else {
    std::fill(out + live * out_n, out + m * out_n, 0.0f);
  }
}

ffi::Error PackedMatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> norm,
                            ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> live_rows,
                            ffi::ResultBuffer<ffi::F32> out, float eps, int32_t glu) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const bool w_bf16 = w.element_type() == ffi::DataType::BF16;
  const bool amx = w_bf16 && wd.size() == 4;  // AMX tiles; otherwise strips
  if (xd.size() != 2 || !((amx && wd[2] == 16 && wd[3] == 32) ||
                          ((w_bf16 || w.element_type() == ffi::DataType::F32) &&
                           wd.size() == 3 && wd[2] == 32))) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: x must be [M, K], w bf16 tiles [N/16, K/32, 16, 32] or bf16/f32 "
        "strips [N/32, K, 32]");
  }
  const int64_t m = xd[0], k = xd[1], n = amx ? wd[0] * 16 : wd[0] * 32;
  if ((amx ? wd[1] * 32 : wd[1]) != k || k % 32 != 0 || n % 32 != 0 ||
      (glu != 0 && n % 64 != 0)) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: K, N must be multiples of 32 (N of 64 with glu) and match w");
  }
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  if (!x_bf16 && x.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("packed_matmul: x must be float32 or bfloat16");
  }
  const bool has_norm = norm.element_count() != 0, has_res = residual.element_count() != 0;
  if ((has_norm && static_cast<int64_t>(norm.element_count()) != k) ||
      (has_res && (glu != 0 || static_cast<int64_t>(residual.element_count()) != m * n))) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: norm must be [K] and residual [M, N] (and not with glu)");
  }
  const float* res = has_res ? residual.typed_data() : nullptr;
  const float* nrm = has_norm ? norm.typed_data() : nullptr;
  // Only the first `live` rows are computed (the rest are a padded bucket's padding tokens).
  const int64_t live = live_rows.element_count() == 0
                           ? m
                           : std::clamp<int64_t>(live_rows.typed_data()[0], 0, m);
  fill_dead_rows(out->typed_data(), res, live, m, glu != 0 ? n / 2 : n);
  if (amx) {
#if JAXSERVE_HAVE_AMX
    if (!amx_permitted()) {
      return ffi::Error(ffi::ErrorCode::kUnavailable, "packed_matmul: AMX tile data not permitted");
    }
    // A: bfloat16 rows padded with zeros to whole 32-row blocks; reused, not allocated per call.
    thread_local std::vector<uint16_t> a;
    const int64_t m_pad = (live + 31) / 32 * 32;
    if (static_cast<int64_t>(a.size()) < m_pad * k) a.resize(m_pad * k);
    std::fill(a.begin() + live * k, a.begin() + m_pad * k, 0);
    PrologueJob prologue(x.untyped_data(), x_bf16, nrm, eps, live, k, a.data(), nullptr);
    jaxserve::parallel_for(prologue.items(), prologue);
    AmxJob job(a.data(), reinterpret_cast<const uint16_t*>(w.untyped_data()), res, glu != 0,
               out->typed_data(), live, k, n);
    jaxserve::parallel_for(job.items(), job);
    return ffi::Error::Success();
#else
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "packed_matmul: built without AMX");
#endif
  }
#if defined(__AVX512F__) || JAXSERVE_AVX2
  // A float32 x without a norm is A itself; otherwise A is built in a reused buffer.
  const float* a_rows = static_cast<const float*>(x.untyped_data());
  if (x_bf16 || nrm != nullptr) {
    thread_local std::vector<float> a;
    if (static_cast<int64_t>(a.size()) < live * k) a.resize(live * k);
    PrologueJob prologue(x.untyped_data(), x_bf16, nrm, eps, live, k, nullptr, a.data());
    jaxserve::parallel_for(prologue.items(), prologue);
    a_rows = a.data();
  }
  if (w_bf16) {
    F32Job<uint16_t> job(a_rows, static_cast<const uint16_t*>(w.untyped_data()), res, glu != 0,
                         out->typed_data(), live, k, n);
    jaxserve::parallel_for(job.items(), job);
  } else {
    F32Job<float> job(a_rows, static_cast<const float*>(w.untyped_data()), res, glu != 0,
                      out->typed_data(), live, k, n);
    jaxserve::parallel_for(job.items(), job);
  }
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "packed_matmul: built without AVX-512 or AVX2 with FMA");
#endif
}

}  // namespace

// 1 when this library was built with AMX and the process may use it, else 0.
extern "C" int JaxserveAmxAvailable() {
#if JAXSERVE_HAVE_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 when this library's float32 product is the AVX-512 one, else 0.
extern "C" int JaxserveAvx512Available() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// 1 when this library's float32 product is the AVX2 one (built with AVX2 and FMA, without
// AVX-512), else 0.
extern "C" int JaxserveAvx2Available() {
#if JAXSERVE_AVX2
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K] f32 or bf16
                                  .Arg<ffi::AnyBuffer>()         // w, packed (see above)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm [K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [M, N] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows [1] or [0]: all
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N] ([M, N/2]: glu)
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("glu"));
