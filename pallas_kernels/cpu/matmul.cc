// bfloat16 matrix product on Intel AMX for XLA:CPU, called through the XLA FFI (see matmul.py).
//
// out[M, N] (float32) = A[M, K] (bfloat16) @ W[K, N] (bfloat16), with W pre-packed once into
// AMX B-tile order: blocks[N / 16][K / 32][16][32], where block (nb, kb) row p holds, for each
// of its 16 columns n, the pair (W[32 kb + 2 p, 16 nb + n], W[32 kb + 2 p + 1, 16 nb + n]).
// K and N must be multiples of 32. A is x (float32 or bfloat16) cast to bfloat16, or with
// `norm` RMSNorm(x) * norm computed in float32 and then cast. The result can be added to a
// float32 `residual`, or with `glu` (W = [gate | up], N/2 columns each) be silu(gate) * up.
// These are the ops around each product of a decoder layer: fusing them saves XLA ops of
// 20-60 us each, ~150 per step. Work items are 32-column strips of the output; each item walks
// all rows in blocks of 32 (two A tiles) with four float32 accumulator tiles, so every weight
// tile is loaded once per 32 rows. Requires the process to be granted AMX tile data
// (arch_prctl), done once on first use.

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
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

// x rows -> bfloat16 A rows (the rows past m, up to the padded count, are zeros), optionally
// through an RMSNorm in float32 first: a = bf16(x * (1 / sqrt(mean(x^2) + eps)) * norm).
class PrologueJob : public jaxserve::ParallelJob {
 public:
  PrologueJob(const void* x, bool x_bf16, const float* norm, float eps, int64_t k,
              uint16_t* a)
      : x_(x), x_bf16_(x_bf16), norm_(norm), eps_(eps), k_(k), a_(a) {}

  void run(int64_t row) override {
    float* xf = buf_(k_);
    if (x_bf16_) {
      jaxserve::load_row(static_cast<const uint16_t*>(x_) + row * k_, xf, static_cast<int>(k_));
    } else {
      std::memcpy(xf, static_cast<const float*>(x_) + row * k_, k_ * sizeof(float));
    }
    uint16_t* dst = a_ + row * k_;
    if (norm_ != nullptr) {
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < k_; ++j) ss += xf[j] * xf[j];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(k_) + eps_);
#pragma omp simd
      for (int64_t j = 0; j < k_; ++j) xf[j] = xf[j] * inv * norm_[j];
    }
    jaxserve::store_row_bf16(xf, dst, static_cast<int>(k_));
  }

 private:
  static float* buf_(int64_t k) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < k) buf.resize(k);
    return buf.data();
  }
  const void* x_;
  bool x_bf16_;
  const float* norm_;
  float eps_;
  int64_t k_;
  uint16_t* a_;
};

// Tiles 0-3: float32 accumulators (rows 0-15 / 16-31 x columns 0-15 / 16-31 of a strip);
// 4-5: the two 16-row blocks of A; 6-7: the strip's two weight blocks. All 16 rows x 64 bytes.
// A work item is one 32-column strip of the output: of the product, or with `glu` of
// silu(gate) * up, where the item computes gate strip s and up strip s + N / 64 and combines
// them. Each item walks the rows in blocks of 32 and finishes each block through a small
// buffer (plain copy, + residual, or the GLU).
class MatmulJob : public jaxserve::ParallelJob {
 public:
  MatmulJob(const uint16_t* a, const uint16_t* w, const float* residual, bool glu, float* out,
            int64_t m, int64_t k, int64_t n)
      : a_(a), w_(w), residual_(residual), glu_(glu), out_(out), m_(m), k_(k), n_(n) {}

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

  void run(int64_t strip) override {
    alignas(64) float c0[32 * 32];
    alignas(64) float c1[32 * 32];
    const int64_t out_n = glu_ ? n_ / 2 : n_;
    for (int64_t m0 = 0; m0 < m_; m0 += 32) {
      const int64_t rows = std::min<int64_t>(32, m_ - m0);
      block(strip, m0, rows, c0);
      if (glu_) block(strip + n_ / 64, m0, rows, c1);
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out_ + (m0 + r) * out_n + strip * 32;
        const float* g = c0 + r * 32;
        if (glu_) {
          const float* u = c1 + r * 32;
#pragma omp simd
          for (int j = 0; j < 32; ++j) dst[j] = g[j] / (1.0f + jaxserve::fast_exp(-g[j])) * u[j];
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

  // c[32 x 32] (row stride 32) = rows [m0, m0 + rows) of A @ columns [32 s, 32 s + 32).
  void block(int64_t s, int64_t m0, int64_t rows, float* c) const {
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
  const float* residual_;  // [M, N] or null
  bool glu_;
  float* out_;
  int64_t m_, k_, n_;
};
#endif  // JAXSERVE_HAVE_AMX

ffi::Error AmxMatmulImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::F32> norm,
                         ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> out,
                         float eps, int32_t glu) {
#if JAXSERVE_HAVE_AMX
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 32) {
    return ffi::Error::InvalidArgument("amx_matmul: x must be [M, K], w [N/16, K/32, 16, 32]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0] * 16;
  if (wd[1] * 32 != k || n % 32 != 0 || (glu != 0 && n % 64 != 0)) {
    return ffi::Error::InvalidArgument(
        "amx_matmul: K, N must be multiples of 32 (of 64 with glu) and match w");
  }
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  if (!x_bf16 && x.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("amx_matmul: x must be float32 or bfloat16");
  }
  const bool has_norm = norm.element_count() != 0, has_res = residual.element_count() != 0;
  if ((has_norm && static_cast<int64_t>(norm.element_count()) != k) ||
      (has_res && (glu != 0 || static_cast<int64_t>(residual.element_count()) != m * n))) {
    return ffi::Error::InvalidArgument(
        "amx_matmul: norm must be [K] and residual [M, N] (and not with glu)");
  }
  if (!amx_permitted()) {
    return ffi::Error(ffi::ErrorCode::kUnavailable, "amx_matmul: AMX tile data not permitted");
  }
  // A: bfloat16 rows padded with zeros to whole 32-row blocks; reused, not allocated per call.
  thread_local std::vector<uint16_t> a;
  const int64_t m_pad = (m + 31) / 32 * 32;
  if (static_cast<int64_t>(a.size()) < m_pad * k) a.resize(m_pad * k);
  std::fill(a.begin() + m * k, a.begin() + m_pad * k, 0);
  PrologueJob prologue(x.untyped_data(), x_bf16, has_norm ? norm.typed_data() : nullptr, eps, k,
                       a.data());
  jaxserve::parallel_for(m, prologue);
  MatmulJob job(a.data(), reinterpret_cast<const uint16_t*>(w.typed_data()),
                has_res ? residual.typed_data() : nullptr, glu != 0, out->typed_data(), m, k, n);
  jaxserve::parallel_for(glu != 0 ? n / 64 : n / 32, job);
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "amx_matmul: built without AMX support");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAmxMatmul, AmxMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K] f32 or bf16
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()   // norm [K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // residual [M, N] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, N] ([M, N/2]: glu)
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("glu"));
