// Ragged paged attention for XLA:CPU, called through the XLA FFI
// (see pallas_kernels/ragged_paged_attention/cpu.py).
//
// Same semantics as reference.py: token t of request r sits at position
// p = kv_lens[r] - (query_start_loc[r + 1] - t) and attends to positions j <= p of its request
// (and j > p - W with a sliding window W), read from the paged cache through the block table.
// Query head h reads KV head h / G (G = Hq / Hkv). Padding tokens output zeros.
// Attention sinks (optional, gpt-oss): a last argument sinks [Hq] float32 (the handlers take
// it as a remaining argument, so a call without it is unchanged); head h's sink is one more
// score with no value, joining the softmax's denominator: each row's online softmax starts from
// (max, sum) = (sinks[h], 1) instead of (-inf, 0).
// JaxserveRaggedPagedAttentionLse: the same, also each row's log-sum-exp of its scaled scores
// ([T, Hq], -inf where it read nothing), and with context_only each query reads only its
// request's positions before this step's first token (multi-head latent attention's split
// prefill, models/layers/mla.py).
//
// Work items are (request, block of up to kQueryBlock consecutive queries), spread over the
// cores (parallel.h). An item takes its KV heads one after another: for each, it holds the G
// query heads of that KV head for each of its tokens as rows, walks the keys its rows can see
// in chunks of kKeyChunk, and keeps an online softmax (running max, sum and float32
// accumulator) per row, so each key and value vector is read once per head pass and used by
// all of its rows. Running a request's heads back to back on one core reads its pages (all
// heads side by side) while they are still cached: per-(request, head) items measured about
// 20 % slower at 32 requests.
//
// Caches: float32, bfloat16, or one-byte quantized pages (float8_e4m3fn, int8; their scales
// are folded into q and the output by the caller, pallas_kernels/kv_quant.py): bfloat16 keys
// and both keys and values of one-byte pages are widened to float32 into buffers as a chunk is
// gathered (e4m3 through a 256-entry table).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A float8_e4m3fn element (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities,
// S.1111.111 is NaN), and its float32 values.
struct Fp8E4M3 {
  uint8_t bits;
};

const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                       : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
      t[b] = (b & 128) ? -v : v;
    }
    return t;
  }();
  return table.data();
}

inline void widen_row(const Fp8E4M3* src, float* dst, int d) {
  const float* t = fp8_table();
  for (int i = 0; i < d; ++i) dst[i] = t[src[i].bits];
}

inline void widen_row(const int8_t* src, float* dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

using jaxserve::exp_sum;
using jaxserve::fast_exp;
using jaxserve::kNegInf;
using jaxserve::load_row;
using jaxserve::pv_accumulate;
using jaxserve::qk_scores;
using jaxserve::range_max;

constexpr int kQueryBlock = 16;  // tokens per work item
constexpr int kKeyChunk = 64;    // keys per online-softmax update

struct Problem {
  const float* q;        // [T, Hq, D]
  const void* k_cache;   // [N, page_size, Hkv, D], float32 or bfloat16
  const void* v_cache;
  const int32_t* block_tables;  // [R, pages_per_row]
  const int32_t* kv_lens;       // [R]
  const int32_t* query_start_loc;  // [R + 1]
  const float* sinks;    // [Hq] attention-sink logits, or nullptr
  float* out;            // [T, Hq, D]
  float* lse;            // [T, Hq] each row's log-sum-exp, or nullptr
  bool context_only;     // read only the keys before the request's first token of the step
  int64_t pages_per_row, page_size, hq, hkv, d, g;
  float sm_scale, soft_cap;  // soft_cap <= 0: none
  int32_t window;            // <= 0: none
};

struct WorkItem {
  int32_t r, h, t0, t1;  // h: the KV head of the current pass
};

template <typename KT>
void run_item(const Problem& p, const WorkItem& w, std::vector<float>& scratch) {
  const int nt = w.t1 - w.t0, G = static_cast<int>(p.g), D = static_cast<int>(p.d);
  const int rows = nt * G;
  const bool convert = !std::is_same_v<KT, float>;  // bfloat16 keys are widened into a buffer
  constexpr bool narrow = sizeof(KT) == 1;  // one-byte pages: values are widened too
  using VT = std::conditional_t<narrow, float, KT>;
  scratch.resize(static_cast<size_t>(rows) * (2 * D + 3 + kKeyChunk) +
                 ((convert ? 1 : 0) + (narrow ? 1 : 0)) * kKeyChunk * D + D);
  float* qrows = scratch.data();             // [rows, D], pre-scaled when there is no soft cap
  float* acc = qrows + rows * D;             // [rows, D]
  float* m = acc + rows * D;                 // [rows] running max
  float* l = m + rows;                       // [rows] running sum
  float* corr = l + rows;                    // [rows] rescale of this chunk
  float* s = corr + rows;                    // [rows, kKeyChunk] scores, then probabilities
  float* zeros = s + rows * kKeyChunk;       // [D] of zeros: padding keys
  float* kbuf = zeros + D;                   // [kKeyChunk, D] widened keys (bfloat16 caches)
  float* vbuf = kbuf + kKeyChunk * D;        // [kKeyChunk, D] widened values (one-byte pages)
  const float* krow[kKeyChunk];              // this chunk's key rows (widened: reused per row)
  const VT* vrow[kKeyChunk];                 // and value rows, from the cache (or widened)
  std::fill(zeros, zeros + D, 0.0f);
  int32_t pos[kQueryBlock];                  // sequence position of each token

  const int32_t q_end = p.query_start_loc[w.r + 1];
  const int32_t kv_len = p.kv_lens[w.r];
  for (int ti = 0; ti < nt; ++ti) pos[ti] = kv_len - (q_end - (w.t0 + ti));
  const bool capped = p.soft_cap > 0.0f;
  const float q_scale = capped ? 1.0f : p.sm_scale;
  for (int ti = 0; ti < nt; ++ti) {
    for (int gi = 0; gi < G; ++gi) {
      const float* src = p.q + ((static_cast<int64_t>(w.t0 + ti) * p.hq) + w.h * G + gi) * D;
      float* dst = qrows + (ti * G + gi) * D;
#pragma omp simd
      for (int i = 0; i < D; ++i) dst[i] = src[i] * q_scale;
    }
  }
  std::fill(acc, acc + rows * D, 0.0f);
  if (p.sinks != nullptr) {  // the sink is one more score, of value zero
    for (int i = 0; i < rows; ++i) m[i] = p.sinks[w.h * G + i % G];
    std::fill(l, l + rows, 1.0f);
  } else {
    std::fill(m, m + rows, kNegInf);
    std::fill(l, l + rows, 0.0f);
  }

  const int32_t lo = p.window > 0 ? std::max(0, pos[0] - p.window + 1) : 0;
  // The keys read end after the block's last token, or (context_only) before the request's
  // first token of this step: its cached context.
  const int32_t hi =
      p.context_only ? kv_len - (q_end - p.query_start_loc[w.r]) : pos[nt - 1] + 1;
  const int32_t* bt = p.block_tables + static_cast<int64_t>(w.r) * p.pages_per_row;
  const KT* kc = static_cast<const KT*>(p.k_cache);
  const KT* vc = static_cast<const KT*>(p.v_cache);
  const int64_t ps = p.page_size, row_stride = p.hkv * D;

  // Ask for a chunk's K/V rows ahead of use: pages are scattered, so the hardware prefetchers
  // cannot see where the next rows are.
  const int64_t row_bytes = static_cast<int64_t>(D) * sizeof(KT);
  auto prefetch_chunk = [&](int32_t c) {
    const int32_t end = std::min<int32_t>(hi, c + kKeyChunk);
    for (int32_t kp = c; kp < end; ++kp) {
      const int64_t off = (bt[kp / ps] * ps + kp % ps) * row_stride + static_cast<int64_t>(w.h) * D;
      const char* kr = reinterpret_cast<const char*>(kc + off);
      const char* vr = reinterpret_cast<const char*>(vc + off);
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(kr + b);
        __builtin_prefetch(vr + b);
      }
    }
  };
  prefetch_chunk(lo);
  for (int32_t c0 = lo; c0 < hi; c0 += kKeyChunk) {
    const int n = std::min<int32_t>(kKeyChunk, hi - c0);
    if (c0 + kKeyChunk < hi) prefetch_chunk(c0 + kKeyChunk);
    for (int j = 0; j < n;) {  // copy the chunk's keys and values, a page run at a time
      const int32_t kp = c0 + j;
      const int64_t page = bt[kp / ps], in_page = kp % ps;
      const int run = static_cast<int>(std::min<int64_t>(ps - in_page, n - j));
      int64_t off = (page * ps + in_page) * row_stride + static_cast<int64_t>(w.h) * D;
      for (int t = 0; t < run; ++t, ++j, off += row_stride) {
        if constexpr (narrow) {
          widen_row(kc + off, kbuf + j * D, D);
          widen_row(vc + off, vbuf + j * D, D);
          krow[j] = kbuf + j * D;
          vrow[j] = vbuf + j * D;
        } else if constexpr (std::is_same_v<KT, float>) {
          vrow[j] = vc + off;
          krow[j] = kc + off;
        } else {
          vrow[j] = vc + off;
          load_row(kc + off, kbuf + j * D, D);
          krow[j] = kbuf + j * D;
        }
      }
    }
    for (int j = n; j < (n + 15) / 16 * 16; ++j) krow[j] = zeros;
    qk_scores(qrows, rows, krow, n, D, s, kKeyChunk);
    for (int i = 0; i < rows; ++i) {
      // The keys this row sees in the chunk: positions first..pi, chunk indices [jlo, jhi).
      const int32_t pi = pos[i / G];
      const int32_t first = p.window > 0 ? pi - p.window + 1 : 0;
      const int jlo = std::clamp(first - c0, 0, n);
      const int jhi = std::clamp(std::min(pi + 1, hi) - c0, 0, n);
      float* si = s + i * kKeyChunk;
      if (jlo >= jhi) {  // nothing visible in this chunk
        corr[i] = 1.0f;
        std::fill(si, si + n, 0.0f);
        continue;
      }
      if (capped) {
        for (int j = jlo; j < jhi; ++j) {
          si[j] = p.soft_cap * std::tanh(si[j] * p.sm_scale / p.soft_cap);
        }
      }
      const float m_new = std::max(m[i], range_max(si, jlo, jhi));
      const float sum = exp_sum(si, jlo, jhi, m_new);
      std::fill(si, si + jlo, 0.0f);
      std::fill(si + jhi, si + n, 0.0f);
      corr[i] = fast_exp(m[i] - m_new);
      l[i] = l[i] * corr[i] + sum;
      m[i] = m_new;
      if (corr[i] != 1.0f) {
        float* ai = acc + i * D;
        const float c = corr[i];
#pragma omp simd
        for (int x = 0; x < D; ++x) ai[x] *= c;
      }
    }
    pv_accumulate(s, rows, vrow, n, D, acc, kKeyChunk);
  }

  for (int ti = 0; ti < nt; ++ti) {
    for (int gi = 0; gi < G; ++gi) {
      const int i = ti * G + gi;
      float* dst = p.out + ((static_cast<int64_t>(w.t0 + ti) * p.hq) + w.h * G + gi) * D;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      const float* ai = acc + i * D;
#pragma omp simd
      for (int x = 0; x < D; ++x) dst[x] = ai[x] * inv;
      if (p.lse != nullptr) {
        p.lse[(static_cast<int64_t>(w.t0 + ti) * p.hq) + w.h * G + gi] =
            l[i] > 0.0f ? m[i] + std::log(l[i]) : kNegInf;
      }
    }
  }
}

class AttentionJob : public jaxserve::ParallelJob {
 public:
  AttentionJob(const Problem& p, ffi::DataType et) : p_(p), et_(et) {}
  std::vector<WorkItem> items;

  void run(int64_t i) override {
    thread_local std::vector<float> scratch;
    WorkItem w = items[i];
    for (w.h = 0; w.h < p_.hkv; ++w.h) {
      switch (et_) {
        case ffi::DataType::BF16: run_item<uint16_t>(p_, w, scratch); break;
        case ffi::DataType::F8E4M3FN: run_item<Fp8E4M3>(p_, w, scratch); break;
        case ffi::DataType::S8: run_item<int8_t>(p_, w, scratch); break;
        default: run_item<float>(p_, w, scratch);
      }
    }
  }

 private:
  const Problem& p_;
  ffi::DataType et_;
};

bool attention_dtype(ffi::DataType et) {
  return et == ffi::DataType::F32 || et == ffi::DataType::BF16 ||
         et == ffi::DataType::F8E4M3FN || et == ffi::DataType::S8;
}

// Attention over caches that already hold this step's K/V (shared by both handlers).
ffi::Error attend(const float* q, ffi::Span<const int64_t> qd, const void* k_cache,
                  const void* v_cache, ffi::Span<const int64_t> kd, ffi::DataType et,
                  ffi::Buffer<ffi::S32>& block_tables, ffi::Buffer<ffi::S32>& kv_lens,
                  ffi::Buffer<ffi::S32>& query_start_loc, ffi::Buffer<ffi::S32>& num_seqs,
                  float* out, float sm_scale, int32_t sliding_window, float soft_cap,
                  const ffi::RemainingArgs& extra, float* lse = nullptr,
                  bool context_only = false) {
  const auto btd = block_tables.dimensions();
  // q [T, Hq, D]; the caches [N, page_size, Hkv * D] (a token's KV heads in one row).
  if (qd.size() != 3 || kd.size() != 3 || btd.size() != 2 || qd[2] <= 0 || kd[2] % qd[2] != 0) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: bad ranks");
  }
  if (!attention_dtype(et)) {
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: caches must be f32, bf16, f8e4m3fn or s8");
  }
  Problem p;
  p.sinks = nullptr;
  if (!extra.empty()) {  // sinks [Hq]
    auto sinks = extra.get<ffi::Buffer<ffi::F32>>(0);
    if (extra.size() != 1 || !sinks.has_value() ||
        sinks->element_count() != static_cast<size_t>(qd[1])) {
      return ffi::Error::InvalidArgument("ragged_paged_attention: sinks must be f32 [Hq]");
    }
    p.sinks = sinks->typed_data();
  }
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.block_tables = block_tables.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.query_start_loc = query_start_loc.typed_data();
  p.out = out;
  p.lse = lse;
  p.context_only = context_only;
  p.pages_per_row = btd[1];
  p.page_size = kd[1];
  p.d = qd[2];
  p.hkv = kd[2] / qd[2];
  p.hq = qd[1];
  p.g = p.hq / p.hkv;
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  AttentionJob job(p, et);

  const int64_t T = qd[0];
  const int64_t R = btd[0];
  const int32_t ns = std::min<int64_t>(num_seqs.typed_data()[0], R);
  const int32_t live = ns > 0 ? p.query_start_loc[ns] : 0;
  // Padding tokens get zeros.
  if (live < T) {
    std::fill(p.out + live * p.hq * p.d, p.out + T * p.hq * p.d, 0.0f);
  }
  if (lse != nullptr) {  // rows that read nothing (padding tokens among them): -inf
    std::fill(lse, lse + T * p.hq, kNegInf);
  }
  for (int32_t r = 0; r < ns; ++r) {
    const int32_t t_begin = p.query_start_loc[r], t_end = p.query_start_loc[r + 1];
    const int32_t keys = context_only ? p.kv_lens[r] - (t_end - t_begin) : p.kv_lens[r];
    if (t_end <= t_begin || keys <= 0) {
      for (int32_t t = t_begin; t < t_end; ++t) {
        std::fill(p.out + t * p.hq * p.d, p.out + (t + 1) * p.hq * p.d, 0.0f);
      }
      continue;
    }
    for (int32_t t0 = t_begin; t0 < t_end; t0 += kQueryBlock) {
      const int32_t t1 = std::min(t_end, t0 + kQueryBlock);
      job.items.push_back({r, 0, t0, t1});  // all KV heads
    }
  }

  jaxserve::parallel_for(static_cast<int64_t>(job.items.size()), job);
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(ffi::Buffer<ffi::F32> q,
                                    ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                    ffi::Buffer<ffi::S32> block_tables,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> query_start_loc,
                                    ffi::Buffer<ffi::S32> num_seqs,
                                    ffi::RemainingArgs extra,
                                    ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                                    int32_t sliding_window, float soft_cap) {
  if (k_cache.element_type() != v_cache.element_type()) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: k and v caches differ in dtype");
  }
  return attend(q.typed_data(), q.dimensions(), k_cache.untyped_data(),
                v_cache.untyped_data(), k_cache.dimensions(),
                k_cache.element_type(), block_tables, kv_lens, query_start_loc, num_seqs,
                out->typed_data(), sm_scale, sliding_window, soft_cap, extra);
}

// The same attention also returning each row's log-sum-exp [T, Hq] (-inf where it read
// nothing); `context_only` != 0: each query reads its request's cached context only.
ffi::Error RaggedPagedAttentionLseImpl(ffi::Buffer<ffi::F32> q,
                                       ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                       ffi::Buffer<ffi::S32> block_tables,
                                       ffi::Buffer<ffi::S32> kv_lens,
                                       ffi::Buffer<ffi::S32> query_start_loc,
                                       ffi::Buffer<ffi::S32> num_seqs,
                                       ffi::RemainingArgs extra,
                                       ffi::ResultBuffer<ffi::F32> out,
                                       ffi::ResultBuffer<ffi::F32> lse, float sm_scale,
                                       int32_t sliding_window, float soft_cap,
                                       int32_t context_only) {
  if (k_cache.element_type() != v_cache.element_type()) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: k and v caches differ in dtype");
  }
  return attend(q.typed_data(), q.dimensions(), k_cache.untyped_data(),
                v_cache.untyped_data(), k_cache.dimensions(),
                k_cache.element_type(), block_tables, kv_lens, query_start_loc, num_seqs,
                out->typed_data(), sm_scale, sliding_window, soft_cap, extra,
                lse->typed_data(), context_only != 0);
}

// Writes this step's K/V rows (k, v: [T, Hkv, D] in the caches' dtype) at `slot_mapping` into
// the caches, which are aliased to the outputs (updated in place), then attends.
ffi::Error WriteKvAndAttendImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer k_cache_in,
                                ffi::AnyBuffer v_cache_in, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> query_start_loc,
                                ffi::Buffer<ffi::S32> num_seqs,
                                ffi::Buffer<ffi::S32> slot_mapping,
                                ffi::RemainingArgs extra,
                                ffi::ResultBuffer<ffi::F32> out,
                                ffi::Result<ffi::AnyBuffer> k_cache,
                                ffi::Result<ffi::AnyBuffer> v_cache, float sm_scale,
                                int32_t sliding_window, float soft_cap) {
  const auto et = k_cache->element_type();
  const auto kd = k_cache->dimensions();
  if (k.element_type() != et || v.element_type() != et || v_cache->element_type() != et ||
      k_cache_in.untyped_data() != k_cache->untyped_data() ||
      v_cache_in.untyped_data() != v_cache->untyped_data() || kd.size() != 3) {
    return ffi::Error::InvalidArgument(
        "write_kv_and_attend: k, v and the (aliased) caches must share one dtype");
  }
  const int64_t row = kd[2] * static_cast<int64_t>(ffi::ByteWidth(et));
  const int64_t slots = kd[0] * kd[1];
  const int64_t T = slot_mapping.dimensions()[0];
  char* kc = static_cast<char*>(k_cache->untyped_data());
  char* vc = static_cast<char*>(v_cache->untyped_data());
  const char* kn = static_cast<const char*>(k.untyped_data());
  const char* vn = static_cast<const char*>(v.untyped_data());
  const int32_t* sm = slot_mapping.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    if (sm[t] < 0 || sm[t] >= slots) {
      return ffi::Error::InvalidArgument("write_kv_and_attend: slot out of range");
    }
    std::memcpy(kc + sm[t] * row, kn + t * row, row);
    std::memcpy(vc + sm[t] * row, vn + t * row, row);
  }
  return attend(q.typed_data(), q.dimensions(), kc, vc, kd, et, block_tables, kv_lens,
                query_start_loc, num_seqs,
                out->typed_data(), sm_scale, sliding_window, soft_cap, extra);
}

// The whole attention block of a decoder layer after the q/k/v product: qkv [T, Hq + 2 Hkv, D]
// (float32: q heads, then k, then v) gets the rotary embedding on q and k (rotate-half layout:
// x1 * cos - x2 * sin, x2 * cos + x1 * sin; cos, sin: [T, D/2]), k and v go into the caches
// at `slot_mapping` in their dtype, and q, rounded to that dtype like the unfused path does,
// attends. Saves the XLA ops that rotate, split and cast (~100 us per layer at 32 tokens).
ffi::Error RopeWriteKvAndAttendImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos,
                                    ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer k_cache_in,
                                    ffi::AnyBuffer v_cache_in, ffi::Buffer<ffi::S32> block_tables,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> query_start_loc,
                                    ffi::Buffer<ffi::S32> num_seqs,
                                    ffi::Buffer<ffi::S32> slot_mapping,
                                    ffi::RemainingArgs extra,
                                    ffi::ResultBuffer<ffi::F32> out,
                                    ffi::Result<ffi::AnyBuffer> k_cache,
                                    ffi::Result<ffi::AnyBuffer> v_cache, float sm_scale,
                                    int32_t sliding_window, float soft_cap) {
  const auto et = k_cache->element_type();
  const auto kd = k_cache->dimensions();
  const auto xd = qkv.dimensions();
  const auto od = out->dimensions();
  if (kd.size() != 3 || xd.size() != 3 || od.size() != 3 || v_cache->element_type() != et ||
      k_cache_in.untyped_data() != k_cache->untyped_data() ||
      v_cache_in.untyped_data() != v_cache->untyped_data()) {
    return ffi::Error::InvalidArgument(
        "rope_write_kv_and_attend: qkv must be [T, H, D] and the caches aliased, of one dtype");
  }
  if (et != ffi::DataType::F32 && et != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("rope_write_kv_and_attend: caches must be f32 or bf16");
  }
  const int64_t T = xd[0], d = xd[2], hkv = d > 0 ? kd[2] / d : 0, hq = od[1], half = d / 2;
  if (d <= 0 || kd[2] != hkv * d || xd[1] != hq + 2 * hkv || xd[2] != d || od[0] != T || od[2] != d || d % 2 != 0 ||
      cos.element_count() != static_cast<size_t>(T * half) ||
      sin.element_count() != static_cast<size_t>(T * half) ||
      slot_mapping.element_count() != static_cast<size_t>(T)) {
    return ffi::Error::InvalidArgument("rope_write_kv_and_attend: inconsistent shapes");
  }
  const bool bf16 = et == ffi::DataType::BF16;
  const int64_t slots = kd[0] * kd[1];
  const int32_t* sm = slot_mapping.typed_data();
  const float* cs = cos.typed_data();
  const float* sn = sin.typed_data();
  const float* x = qkv.typed_data();
  thread_local std::vector<float> q_buf, row;
  q_buf.resize(T * hq * d);
  row.resize(d);
  auto rotate = [&](const float* src, float* dst, int64_t t) {
    const float* c = cs + t * half;
    const float* sv = sn + t * half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      dst[i] = src[i] * c[i] - src[i + half] * sv[i];
      dst[i + half] = src[i + half] * c[i] + src[i] * sv[i];
    }
  };
  // Writes `src` (d floats) as cache row `slot`, head h.
  auto put = [&](void* cache, int64_t slot, int64_t h, const float* src) {
    const int64_t off = (slot * hkv + h) * d;
    if (bf16) {
      jaxserve::store_row_bf16(src, static_cast<uint16_t*>(cache) + off, static_cast<int>(d));
    } else {
      std::memcpy(static_cast<float*>(cache) + off, src, d * sizeof(float));
    }
  };
  void* kc = k_cache->untyped_data();
  void* vc = v_cache->untyped_data();
  for (int64_t t = 0; t < T; ++t) {
    if (sm[t] < 0 || sm[t] >= slots) {
      return ffi::Error::InvalidArgument("rope_write_kv_and_attend: slot out of range");
    }
    const float* xt = x + t * (hq + 2 * hkv) * d;
    for (int64_t h = 0; h < hq; ++h) {
      float* qd = q_buf.data() + (t * hq + h) * d;
      rotate(xt + h * d, qd, t);
      if (bf16) jaxserve::round_row_bf16(qd, static_cast<int>(d));  // q meets the caches' dtype
    }
    for (int64_t h = 0; h < hkv; ++h) {
      rotate(xt + (hq + h) * d, row.data(), t);
      put(kc, sm[t], h, row.data());
      put(vc, sm[t], h, xt + (hq + hkv + h) * d);
    }
  }
  return attend(q_buf.data(), od, kc, vc, kd, et, block_tables, kv_lens, query_start_loc,
                num_seqs, out->typed_data(), sm_scale, sliding_window, soft_cap, extra);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .RemainingArgs()               // sinks [Hq] f32, optional
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKvAndAttend, WriteKvAndAttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k (new rows)
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // k_cache (aliased to ret 1)
                                  .Arg<ffi::AnyBuffer>()         // v_cache (aliased to ret 2)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .RemainingArgs()               // sinks [Hq] f32, optional
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::AnyBuffer>()         // k_cache
                                  .Ret<ffi::AnyBuffer>()         // v_cache
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRopeWriteKvAndAttend, RopeWriteKvAndAttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [T, Hq + 2 Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [T, D/2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [T, D/2]
                                  .Arg<ffi::AnyBuffer>()         // k_cache (aliased to ret 1)
                                  .Arg<ffi::AnyBuffer>()         // v_cache (aliased to ret 2)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .RemainingArgs()               // sinks [Hq] f32, optional
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Ret<ffi::AnyBuffer>()         // k_cache
                                  .Ret<ffi::AnyBuffer>()         // v_cache
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionLse, RaggedPagedAttentionLseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .RemainingArgs()               // sinks [Hq] f32, optional
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [T, Hq]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("context_only"));
