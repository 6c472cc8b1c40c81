// bfloat16 matrix product on Intel AMX for XLA:CPU, called through the XLA FFI (see matmul.py).
//
// out[M, N] (float32) = x[M, K] (bfloat16) @ W[K, N] (bfloat16), with W pre-packed once into
// AMX B-tile order: blocks[N / 16][K / 32][16][32], where block (nb, kb) row p holds, for each
// of its 16 columns n, the pair (W[32 kb + 2 p, 16 nb + n], W[32 kb + 2 p + 1, 16 nb + n]).
// K and N must be multiples of 32. Work items are 32-column strips of the output; each item
// walks all rows in blocks of 32 (two A tiles) with four float32 accumulator tiles, so every
// weight tile is loaded once per 32 rows. A last partial row block reads a zero-padded copy.
// Requires the process to be granted AMX tile data (arch_prctl), done once on first use.

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
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

// Tiles 0-3: float32 accumulators (rows 0-15 / 16-31 x columns 0-15 / 16-31 of the strip);
// 4-5: the two 16-row blocks of x; 6-7: the strip's two weight blocks. All 16 rows x 64 bytes.
class MatmulJob : public jaxserve::ParallelJob {
 public:
  MatmulJob(const uint16_t* x, const uint16_t* x_tail, const uint16_t* w, float* out, int64_t m,
            int64_t k, int64_t n)
      : x_(x), x_tail_(x_tail), w_(w), out_(out), m_(m), k_(k), n_(n) {}

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

  // Tile loads stall on weights coming from L3 or memory; asking for the blocks a few steps
  // ahead keeps them in flight (the weights are read once per call, so nothing else hides it).
  inline void prefetch_ahead(const uint16_t* b0, const uint16_t* b1, int64_t kb) const {
    const uint16_t* w_end = w_ + k_ * n_;
    constexpr int64_t kAhead = 4;
    // Past the strip's end, b0's lookahead lands in b1's blocks and b1's in the next strip's
    // first blocks; past the last strip it is dropped.
    const uint16_t* p0 = b0 + (kb + kAhead) * 512;
    const uint16_t* p1 = b1 + (kb + kAhead) * 512;
    for (int c = 0; c < 512; c += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p0 + c), _MM_HINT_T0);
      if (p1 + c < w_end) _mm_prefetch(reinterpret_cast<const char*>(p1 + c), _MM_HINT_T0);
    }
  }

  void run(int64_t strip) override {
    const int64_t kb_count = k_ / 32;
    const uint16_t* b0 = w_ + (2 * strip) * kb_count * 512;  // a packed block is 16 x 32 values
    const uint16_t* b1 = b0 + kb_count * 512;
    const int64_t lda = k_ * 2;  // bytes
    for (int64_t m0 = 0; m0 < m_; m0 += 32) {
      const int64_t rows = std::min<int64_t>(32, m_ - m0);
      const uint16_t* a = rows == 32 ? x_ + m0 * k_ : x_tail_;
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
      float* c = out_ + m0 * n_ + strip * 32;
      if (rows == 32) {
        _tile_stored(0, c, n_ * 4);
        _tile_stored(1, c + 16, n_ * 4);
        _tile_stored(2, c + 16 * n_, n_ * 4);
        _tile_stored(3, c + 16 * n_ + 16, n_ * 4);
        continue;
      }
      float buf[32 * 32];
      _tile_stored(0, buf, 128);
      _tile_stored(1, buf + 16, 128);
      if (rows > 16) {
        _tile_stored(2, buf + 16 * 32, 128);
        _tile_stored(3, buf + 16 * 32 + 16, 128);
      }
      for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * n_, buf + r * 32, 32 * sizeof(float));
    }
  }

 private:
  const uint16_t* x_;
  const uint16_t* x_tail_;
  const uint16_t* w_;
  float* out_;
  int64_t m_, k_, n_;
};
#endif  // JAXSERVE_HAVE_AMX

ffi::Error AmxMatmulImpl(ffi::Buffer<ffi::BF16> x,
                         ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> out) {
#if JAXSERVE_HAVE_AMX
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 32) {
    return ffi::Error::InvalidArgument("amx_matmul: x must be [M, K], w [N/16, K/32, 16, 32]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0] * 16;
  if (wd[1] * 32 != k || n % 32 != 0) {
    return ffi::Error::InvalidArgument("amx_matmul: K, N must be multiples of 32 and match w");
  }
  if (!amx_permitted()) {
    return ffi::Error(ffi::ErrorCode::kUnavailable, "amx_matmul: AMX tile data not permitted");
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  thread_local std::vector<uint16_t> tail;  // reused: no allocation per call
  if (m % 32 != 0) {  // the last partial block of rows, zero-padded to 32 rows
    const int64_t m0 = m / 32 * 32;
    tail.assign(32 * k, 0);
    std::memcpy(tail.data(), xp + m0 * k, (m - m0) * k * sizeof(uint16_t));
  }
  MatmulJob job(xp, tail.data(), reinterpret_cast<const uint16_t*>(w.typed_data()),
                out->typed_data(), m, k, n);
  jaxserve::parallel_for(n / 32, job);
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
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()); // out [M, N]
