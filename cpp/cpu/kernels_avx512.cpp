// AVX-512 (F/BW/VL/DQ + VNNI) kernels. Quantized weights: one 512-bit vpdpbusd covers a pair of 32-weight
// blocks; the per-block scales are applied in float. vpdpbusd multiplies unsigned by signed bytes, so the
// activations enter shifted to unsigned (a + 128) and the weights signed; the shift's contribution,
// 128 * sum(w) per lane, depends only on the weights, so it is computed once per weight pair and reused for
// every token of a tile (it seeds the accumulation, which keeps the integer dot product exact).
// Float weights: FMA on float activations.
//
// Numerics are independent of tiling: every (row, token) output is the same sequence of operations
// (pairs of blocks in order, then one fixed reduction tree), so matmul equals per-token matvec bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels_isa.h"

// GCC 12's AVX-512 headers seed some intrinsics (casts, cvtepi32_ps, permutexvar) with a self-initialised
// "undefined" vector, which -Wuninitialized reports at every inlined use (GCC bug 105593). Nothing is uninitialised.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace metalattn::cpu::avx512 {
namespace {

// One token's activations for one pair of blocks, laid out as ready 512-bit operands. Int32 lane i of a
// vpdpbusd result sums bytes 4i..4i+3, so lanes 0-7 belong to the first block and lanes 8-15 to the second.
struct alignas(64) ActPair {
  uint8_t qs[64];     // a + 128 of block 2p, then of block 2p+1 (128, i.e. zero, past the last block)
  float d[16];        // activation scale, 8 lanes per block
  float s[16];        // Q4_1: d * sum(qs) in lanes 0 and 8 (multiplies the block's min)
};

constexpr int kTokenTile = 8;
constexpr size_t kRowChunkBytes = 1 << 20;  // weights a thread keeps cache-resident while all tokens pass over them
// Software prefetch this far ahead of the rows being read: with the hardware prefetcher alone a streaming
// matvec reached ~10 GB/s on one core of the dev machine, with 8 KiB ahead ~22 GB/s (its plain read stream: ~30).
constexpr size_t kPrefetchBytes = 8192;

template <int R>
inline void prefetch_rows(const uint8_t* rows, size_t stride) {
  const uint8_t* ahead = rows + kPrefetchBytes;
  for (size_t off = 0; off < R * stride; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
}

alignas(64) const uint8_t kZeroBlock[64] = {};  // stands in for the missing second block of an odd tail pair

constexpr size_t block_size(GgmlType t) {
  return t == GgmlType::Q4_0 ? sizeof(block_q4_0) : t == GgmlType::Q4_1 ? sizeof(block_q4_1) : sizeof(block_q8_0);
}

template <GgmlType WT>
void pack_acts(const block_q8_act* xq, int nb, int n_tok, ActPair* out) {
  const int npairs = (nb + 1) / 2;
  for (int t = 0; t < n_tok; ++t) {
    for (int p = 0; p < npairs; ++p) {
      ActPair& a = out[t * npairs + p];
      std::memset(&a, 0, sizeof(a));
      std::memset(a.qs, 128, sizeof(a.qs));
      for (int h = 0; h < 2; ++h) {
        const int k = 2 * p + h;
        if (k >= nb) break;
        const block_q8_act& b = xq[static_cast<int64_t>(t) * nb + k];
        for (int j = 0; j < 32; ++j) a.qs[32 * h + j] = static_cast<uint8_t>(b.qs[j] + 128);
        for (int j = 0; j < 8; ++j) a.d[8 * h + j] = b.d;
        if (WT == GgmlType::Q4_1) a.s[8 * h] = b.s;
      }
    }
  }
}

// The fp16 scales (and Q4_1 mins) of two blocks, broadcast to the lanes of their block.
inline __m512 spread_pair(__m128 v, int lane0, int lane1) {
  const __m512i idx = _mm512_setr_epi32(lane0, lane0, lane0, lane0, lane0, lane0, lane0, lane0, lane1, lane1, lane1,
                                        lane1, lane1, lane1, lane1, lane1);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Two blocks of nibbles as 64 unsigned bytes in weight order: [lo(b0), hi(b0), lo(b1), hi(b1)].
inline __m512i unpack_nibbles(const uint8_t* q0, const uint8_t* q1) {
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)q0)),
                                               _mm_loadu_si128((const __m128i*)q1), 1);
  const __m512i dup = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(both));
  const __m512i shifted = _mm512_mask_srli_epi16(dup, 0xFF00FF00u, dup, 4);  // high nibbles in 128-bit lanes 1 and 3
  return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
}

// Decoded weights of one pair of blocks of one row.
struct WeightPair {
  __m512i q;     // signed bytes (Q4_0: nibble - 8; Q4_1: nibble; Q8_0: as stored)
  __m512i bias;  // -128 * (sum of the 4 weights of each int32 lane): cancels the +128 of the activations
  __m512 d;      // scale per lane
  __m512 m;      // Q4_1 min per lane (unused otherwise)
};

template <GgmlType WT>
inline WeightPair load_pair(const uint8_t* b0, const uint8_t* b1) {
  WeightPair w;
  if constexpr (WT == GgmlType::Q4_0) {
    w.q = _mm512_sub_epi8(unpack_nibbles(b0 + 2, b1 + 2), _mm512_set1_epi8(8));
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>((load_u32(b0) & 0xFFFFu) | (load_u32(b1) << 16))));
    w.d = spread_pair(d, 0, 1);
  } else if constexpr (WT == GgmlType::Q4_1) {
    w.q = unpack_nibbles(b0 + 4, b1 + 4);
    const __m128 dm = _mm_cvtph_ps(_mm_setr_epi32(static_cast<int>(load_u32(b0)), static_cast<int>(load_u32(b1)), 0, 0));
    w.d = spread_pair(dm, 0, 2);
    w.m = spread_pair(dm, 1, 3);
  } else {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + 2))),
                                         _mm256_loadu_si256((const __m256i*)(b1 + 2)), 1);
    w.q = q;
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>((load_u32(b0) & 0xFFFFu) | (load_u32(b1) << 16))));
    w.d = spread_pair(d, 0, 1);
  }
  const __m512i sum128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), w.q);
  w.bias = _mm512_sub_epi32(_mm512_setzero_si512(), sum128);
  return w;
}

// Fixed reduction tree (shared by every tile shape, so results do not depend on tiling).
inline float reduce(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// R rows x T tokens of a quantized matrix, accumulators in registers.
template <GgmlType WT, int R, int T>
void q_tile(const uint8_t* row0, size_t stride, int nb, const ActPair* acts, int npairs, float* y, int64_t ldy) {
  constexpr size_t bs = block_size(WT);
  __m512 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int p = 0; p < npairs; ++p) {
    WeightPair wp[R];
    for (int i = 0; i < R; ++i) {
      const uint8_t* b0 = row0 + i * stride + (2 * p) * bs;
      wp[i] = load_pair<WT>(b0, 2 * p + 1 < nb ? b0 + bs : kZeroBlock);
    }
    for (int t = 0; t < T; ++t) {
      const ActPair& a = acts[t * npairs + p];
      const __m512i aq = _mm512_load_si512(a.qs);
      const __m512 ad = _mm512_load_ps(a.d);
      for (int i = 0; i < R; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(wp[i].bias, aq, wp[i].q);  // exact signed dot per lane
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wp[i].d, ad), acc[i][t]);
        if constexpr (WT == GgmlType::Q4_1) acc[i][t] = _mm512_fmadd_ps(wp[i].m, _mm512_load_ps(a.s), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) y[t * ldy + i] = reduce(acc[i][t]);
}

template <GgmlType WT, int T>
void q_rows(const WeightView& w, int64_t r0, int64_t r1, const ActPair* acts, float* Y, int64_t ldy) {
  constexpr int R = T >= 4 ? 2 : 4;  // R*T accumulators + R decoded pairs (3-4 registers each) fit in 32
  const int nb = static_cast<int>(w.cols / kQuantBlock), npairs = (nb + 1) / 2;
  const size_t stride = w.row_stride();
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    prefetch_rows<R>(w.row(r), stride);
    q_tile<WT, R, T>(w.row(r), stride, nb, acts, npairs, Y + r, ldy);
  }
  for (; r < r1; ++r) q_tile<WT, 1, T>(w.row(r), stride, nb, acts, npairs, Y + r, ldy);
}

template <GgmlType WT>
void q_matmul(const WeightView& w, const block_q8_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0, int64_t r1) {
  const int nb = static_cast<int>(w.cols / kQuantBlock), npairs = (nb + 1) / 2;
  thread_local std::vector<ActPair> packed;
  if (packed.size() < static_cast<size_t>(kTokenTile * npairs)) packed.resize(kTokenTile * npairs);
  // Large matrices are walked in row chunks so each chunk stays in cache while every token tile passes.
  const int64_t chunk = std::max<int64_t>(8, static_cast<int64_t>(kRowChunkBytes / w.row_stride()) / 8 * 8);
  for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
    const int64_t c1 = std::min(r1, c0 + chunk);
    for (int t0 = 0; t0 < n_tok; t0 += kTokenTile) {
      const int tt = std::min(kTokenTile, n_tok - t0);
      pack_acts<WT>(Xq + static_cast<int64_t>(t0) * nb, nb, tt, packed.data());
      for (int t = 0; t < tt;) {
        float* y = Y + (t0 + t) * ldy;
        const ActPair* a = packed.data() + t * npairs;
        if (tt - t >= 8) {
          q_rows<WT, 8>(w, c0, c1, a, y, ldy);
          t += 8;
        } else if (tt - t >= 4) {
          q_rows<WT, 4>(w, c0, c1, a, y, ldy);
          t += 4;
        } else if (tt - t >= 2) {
          q_rows<WT, 2>(w, c0, c1, a, y, ldy);
          t += 2;
        } else {
          q_rows<WT, 1>(w, c0, c1, a, y, ldy);
          t += 1;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- float weights

template <GgmlType WT>
inline __m512 load_weights16(const uint8_t* row, int64_t c, __mmask16 mask) {
  if constexpr (WT == GgmlType::F32) {
    return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(row) + c);
  } else if constexpr (WT == GgmlType::F16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(row) + c));
  } else {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(row) + c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
}

template <GgmlType WT, int R, int T>
void f_tile(const uint8_t* row0, size_t stride, int64_t cols, const float* X, float* y, int64_t ldy) {
  __m512 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 mask = cols - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - c)) - 1);
    __m512 wv[R];
    for (int i = 0; i < R; ++i) wv[i] = load_weights16<WT>(row0 + i * stride, c, mask);
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, X + t * cols + c);
      for (int i = 0; i < R; ++i) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) y[t * ldy + i] = reduce(acc[i][t]);
}

template <GgmlType WT, int T>
void f_rows(const WeightView& w, int64_t r0, int64_t r1, const float* X, float* Y, int64_t ldy) {
  constexpr int R = 4;
  const size_t stride = w.row_stride();
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    prefetch_rows<R>(w.row(r), stride);
    f_tile<WT, R, T>(w.row(r), stride, w.cols, X, Y + r, ldy);
  }
  for (; r < r1; ++r) f_tile<WT, 1, T>(w.row(r), stride, w.cols, X, Y + r, ldy);
}

template <GgmlType WT>
void f_matmul(const WeightView& w, const float* X, int n_tok, float* Y, int64_t ldy, int64_t r0, int64_t r1) {
  const int64_t chunk = std::max<int64_t>(8, static_cast<int64_t>(kRowChunkBytes / w.row_stride()) / 8 * 8);
  for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
    const int64_t c1 = std::min(r1, c0 + chunk);
    for (int t = 0; t < n_tok;) {
      const float* x = X + t * w.cols;
      float* y = Y + t * ldy;
      if (n_tok - t >= 4) {
        f_rows<WT, 4>(w, c0, c1, x, y, ldy);
        t += 4;
      } else {
        f_rows<WT, 1>(w, c0, c1, x, y, ldy);
        t += 1;
      }
    }
  }
}

}  // namespace

void quantize_acts(const float* x, int64_t n, block_q8_act* out) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, abs_mask), _mm512_and_ps(x1, abs_mask)));
    const float d = amax / 127.f;
    if (d == 0.f) {
      std::memset(out[b].qs, 0, 32);
      out[b].d = 0.f;
      out[b].s = 0.f;
      continue;
    }
    // Division (not multiplication by 1/d) and round-half-even: bit-identical to the scalar path.
    const __m512 vd = _mm512_set1_ps(d);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, vd)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, vd));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].qs), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].qs + 16), _mm512_cvtepi32_epi8(q1));
    out[b].d = d;
    out[b].s = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

void matmul(const WeightView& w, const float* X, const block_q8_act* Xq, int n_tok, float* Y, int64_t ldy,
            int64_t r0, int64_t r1) {
  switch (w.type) {
    case GgmlType::Q4_0: return q_matmul<GgmlType::Q4_0>(w, Xq, n_tok, Y, ldy, r0, r1);
    case GgmlType::Q4_1: return q_matmul<GgmlType::Q4_1>(w, Xq, n_tok, Y, ldy, r0, r1);
    case GgmlType::Q8_0: return q_matmul<GgmlType::Q8_0>(w, Xq, n_tok, Y, ldy, r0, r1);
    case GgmlType::F32: return f_matmul<GgmlType::F32>(w, X, n_tok, Y, ldy, r0, r1);
    case GgmlType::F16: return f_matmul<GgmlType::F16>(w, X, n_tok, Y, ldy, r0, r1);
    case GgmlType::BF16: return f_matmul<GgmlType::BF16>(w, X, n_tok, Y, ldy, r0, r1);
  }
  throw EngineError("matmul: unsupported weight type");
}

}  // namespace metalattn::cpu::avx512
