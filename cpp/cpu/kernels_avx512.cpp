// AVX-512 (F/BW/VL/DQ + VNNI) kernels. Quantized weights meet int16 activations in vpdpwssd (pairs of signed
// 16-bit products summed into int32 lanes), exact per block: |w| <= 128, |a| <= 32767, 32 products < 2^27.
// Blocks are handled four at a time: 128-bit lane X of every operand holds 8 values of block X, so after the
// four vpdpwssd of a quad, int32 lanes 4X..4X+3 hold partial sums of block X only, and one int->float
// conversion plus one FMA with a [dA x4, dB x4, dC x4, dD x4] scale vector applies the scales of four blocks.
// Q4 / Q5 weights enter as unsigned codes (0..15 / 0..31; Q5's fifth bit set by a byte-masked add); Q4_0's offset
// of 8 (Q5_0's 16) is removed exactly by seeding the integer accumulation with -8 (-16) * sum(a) per block, which
// depends only on the activations (computed when they are packed). These quad tiles serve Q5_0 and Q5_1 (load_quad
// still decodes Q4_0 / Q4_1 / Q8_0, which they served until the 8-row batches); the other quantized types take the
// group tiles of group_tiles.h and the token tiles of token_tiles.h (vpdpwssd on ymm), see matmul at the end.
// Weight quads are decoded once per row and reused by every token of a tile. Float weights: FMA on float
// activations.
//
// Numerics are independent of tiling: every (row, token) output is the same sequence of operations
// (quads of blocks in order, then one fixed reduction tree), so matmul equals per-token matvec bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels_isa.h"
#include "reference.h"
#include "tiled_matmul.h"

// GCC 12's AVX-512 headers seed some intrinsics (casts, cvtepi32_ps, permutexvar) with a self-initialised
// "undefined" vector, which -Wuninitialized reports at every inlined use (GCC bug 105593). Nothing is uninitialised.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace metalattn::cpu::avx512 {
namespace {

// One token's activations for four consecutive blocks, laid out as ready 512-bit operands.
struct alignas(64) ActQuad {
  int16_t qs[4][32];  // qs[k][8X + j] = element 8k + j of block X (0 past the last block)
  float d[16];        // lanes 4X..4X+3: scale of block X
  int32_t bias[16];   // Q4_0 (x2: Q5_0): lane 4X = -8 * sum(qs of block X), other lanes 0
  float s[16];        // Q4_1, Q5_1: lane 4X = s of block X (multiplies the block's min), other lanes 0
};

alignas(64) const uint8_t kZeroBlock[64] = {};  // stands in for the missing blocks of a row's last quad

constexpr size_t block_size(GgmlType t) { return block_bytes(t); }

// The 32-weight types these quad tiles decode (the others take the group / token tiles, see matmul below).
// Q4_0 / Q4_1 / Q8_0 streamed faster through the group tiles with vpdpwssd, and their 8+ token matmuls run the VNNI
// token tiles (benchmarks/NOTES.md, 2026-11-24, batched decode); Q5_0 / Q5_1 decode faster here.
constexpr bool quad_type(GgmlType t) { return t == GgmlType::Q5_0 || t == GgmlType::Q5_1; }

void pack_acts(const block_q16_act* xq, int nb, int n_tok, ActQuad* out) {
  const int nquads = (nb + 3) / 4;
  const __m512i ones = _mm512_set1_epi16(1);
  for (int t = 0; t < n_tok; ++t) {
    const block_q16_act* blocks = xq + static_cast<int64_t>(t) * nb;
    for (int p = 0; p < nquads; ++p) {
      ActQuad& a = out[t * nquads + p];
      if (4 * p + 4 > nb) {
        std::memset(&a, 0, sizeof(a));  // missing blocks of the last quad: all zero, they add nothing
      } else {
        std::memset(a.bias, 0, sizeof(a.bias));
        std::memset(a.s, 0, sizeof(a.s));
      }
      for (int x = 0; x < 4 && 4 * p + x < nb; ++x) {
        const block_q16_act& b = blocks[4 * p + x];
        const __m512i q = _mm512_loadu_si512(b.qs);
        _mm_store_si128(reinterpret_cast<__m128i*>(&a.qs[0][8 * x]), _mm512_extracti32x4_epi32(q, 0));
        _mm_store_si128(reinterpret_cast<__m128i*>(&a.qs[1][8 * x]), _mm512_extracti32x4_epi32(q, 1));
        _mm_store_si128(reinterpret_cast<__m128i*>(&a.qs[2][8 * x]), _mm512_extracti32x4_epi32(q, 2));
        _mm_store_si128(reinterpret_cast<__m128i*>(&a.qs[3][8 * x]), _mm512_extracti32x4_epi32(q, 3));
        _mm_store_ps(&a.d[4 * x], _mm_set1_ps(b.d));
        a.bias[4 * x] = -8 * _mm512_reduce_add_epi32(_mm512_madd_epi16(q, ones));
        a.s[4 * x] = b.s;
      }
    }
  }
}

inline uint64_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint64_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The fp16 values at b[X] + off (a block's scale or min), widened and spread to lanes 4X..4X+3. The four
// halves are gathered with scalar loads (idle integer ports) into one 64-bit move.
inline __m512 spread_halves(const uint8_t* const b[4], int off) {
  const uint64_t h = load_u16(b[0] + off) | load_u16(b[1] + off) << 16 | load_u16(b[2] + off) << 32 |
                     load_u16(b[3] + off) << 48;
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(h)));
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
}

// 16 bytes from b[X] + off in 128-bit lane X.
inline __m512i load_lanes(const uint8_t* const b[4], int off) {
  const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(b[0] + off))),
                                             _mm_loadu_si128((const __m128i*)(b[1] + off)), 1);
  const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(b[2] + off))),
                                             _mm_loadu_si128((const __m128i*)(b[3] + off)), 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Decoded weights of one quad of blocks of one row, in ActQuad's layout.
struct WeightQuad {
  __m512i q[4];  // int16 (Q4: nibble 0..15; Q8_0: as stored)
  __m512 d;      // lanes 4X..4X+3: scale of block X
  __m512 m;      // Q4_1: min of block X (unused otherwise)
};

template <GgmlType WT>
inline WeightQuad load_quad(const uint8_t* const b[4]) {
  WeightQuad w;
  w.d = spread_halves(b, 0);
  if constexpr (WT == GgmlType::Q8_0) {
    // unpack(v, v) puts each byte in both halves of a word; the arithmetic shift sign-extends it, in lane.
    const __m512i v0 = load_lanes(b, 2), v1 = load_lanes(b, 18);  // weights 0..15, 16..31
    w.q[0] = _mm512_srai_epi16(_mm512_unpacklo_epi8(v0, v0), 8);
    w.q[1] = _mm512_srai_epi16(_mm512_unpackhi_epi8(v0, v0), 8);
    w.q[2] = _mm512_srai_epi16(_mm512_unpacklo_epi8(v1, v1), 8);
    w.q[3] = _mm512_srai_epi16(_mm512_unpackhi_epi8(v1, v1), 8);
  } else {
    // Byte j holds weight j (low nibble) and weight j + 16 (high nibble).
    constexpr int qs_off = WT == GgmlType::Q4_0 ? 2 : WT == GgmlType::Q4_1 ? 4 : WT == GgmlType::Q5_0 ? 6 : 8;
    const __m512i v = load_lanes(b, qs_off);
    const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    if constexpr (WT == GgmlType::Q5_0 || WT == GgmlType::Q5_1) {
      // Q5: bit j of block X's qh is the fifth bit of weight j: byte 16X + j of lo (j < 16) or of hi (j >= 16).
      // The four qh words become two 64-bit byte masks; a masked add sets bit 4 of the selected bytes.
      constexpr int qh_off = WT == GgmlType::Q5_0 ? 2 : 4;
      const uint64_t h0 = load_u32(b[0] + qh_off), h1 = load_u32(b[1] + qh_off), h2 = load_u32(b[2] + qh_off),
                     h3 = load_u32(b[3] + qh_off);
      const __mmask64 lo_bits = (h0 & 0xFFFF) | (h1 & 0xFFFF) << 16 | (h2 & 0xFFFF) << 32 | (h3 & 0xFFFF) << 48;
      const __mmask64 hi_bits = h0 >> 16 | (h1 >> 16) << 16 | (h2 >> 16) << 32 | (h3 >> 16) << 48;
      const __m512i bit4 = _mm512_set1_epi8(0x10);
      lo = _mm512_mask_add_epi8(lo, lo_bits, lo, bit4);
      hi = _mm512_mask_add_epi8(hi, hi_bits, hi, bit4);
    }
    w.q[0] = _mm512_unpacklo_epi8(lo, zero);
    w.q[1] = _mm512_unpackhi_epi8(lo, zero);
    w.q[2] = _mm512_unpacklo_epi8(hi, zero);
    w.q[3] = _mm512_unpackhi_epi8(hi, zero);
    if constexpr (WT == GgmlType::Q4_1 || WT == GgmlType::Q5_1) w.m = spread_halves(b, 2);
  }
  return w;
}

// Fixed reduction tree (shared by every tile shape, so results do not depend on tiling):
// h[i] = v[i] + v[i+8], q[i] = h[i] + h[i+4], p[i] = q[i] + q[i+2], sum = p[0] + p[1].
inline float reduce(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// The same tree for 16 vectors at once (each level adds the same pairs as reduce(), so the sums are bit for
// bit the same), 15 shuffle-shuffle-add steps instead of 16 separate reductions. out[k] = sum of v[k].
inline void reduce16(const __m512 v[16], float out[16]) {
  __m512 h[8], q[4], p[2];
  for (int k = 0; k < 8; ++k)  // 256-bit halves of v[2k] | v[2k+1]
    h[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)  // 128-bit lane L of q[k]: q of v[4k + L]
    q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * k], h[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h[2 * k], h[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)  // lane L of p[k]: p[0..1] of v[8k + L], then of v[8k + 4 + L]
    p[k] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * k], q[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(q[2 * k], q[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Element 4L + j: sum of v[L + 4j].
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  for (int L = 0; L < 4; ++L)
    for (int j = 0; j < 4; ++j) out[L + 4 * j] = lanes[4 * L + j];
}

// Writes the R x T sums of a tile: y[t * ldy + i] = sum of acc[i][t].
template <int R, int T>
inline void store_sums(const __m512 (&acc)[R][T], float* y, int64_t ldy) {
  if constexpr (R * T == 16) {
    float sums[16];
    reduce16(&acc[0][0], sums);
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < T; ++t) y[t * ldy + i] = sums[i * T + t];
  } else {
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < T; ++t) y[t * ldy + i] = reduce(acc[i][t]);
  }
}

// R rows x T tokens of a quantized matrix, accumulators in registers.
template <GgmlType WT, int R, int T>
void q_tile(const uint8_t* row0, size_t stride, int nb, const ActQuad* acts, int nquads, float* y, int64_t ldy) {
  constexpr size_t bs = block_size(WT);
  __m512 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int p = 0; p < nquads; ++p) {
    WeightQuad wq[R];
    for (int i = 0; i < R; ++i) {
      const uint8_t* b[4];
      for (int x = 0; x < 4; ++x) b[x] = 4 * p + x < nb ? row0 + i * stride + (4 * p + x) * bs : kZeroBlock;
      wq[i] = load_quad<WT>(b);
    }
    for (int t = 0; t < T; ++t) {
      const ActQuad& a = acts[t * nquads + p];
      const __m512i a0 = _mm512_load_si512(a.qs[0]), a1 = _mm512_load_si512(a.qs[1]);
      const __m512i a2 = _mm512_load_si512(a.qs[2]), a3 = _mm512_load_si512(a.qs[3]);
      // Q4_0 / Q5_0 store q + 8 / q + 16: the sum starts at -8 / -16 times the block's activation sum.
      const __m512i seed = WT == GgmlType::Q4_0   ? _mm512_load_si512(a.bias)
                           : WT == GgmlType::Q5_0 ? _mm512_slli_epi32(_mm512_load_si512(a.bias), 1)
                                                  : _mm512_setzero_si512();
      const __m512 ad = _mm512_load_ps(a.d);
      for (int i = 0; i < R; ++i) {
        __m512i dot = _mm512_dpwssd_epi32(seed, wq[i].q[0], a0);  // exact: see the top of the file
        dot = _mm512_dpwssd_epi32(dot, wq[i].q[1], a1);
        dot = _mm512_dpwssd_epi32(dot, wq[i].q[2], a2);
        dot = _mm512_dpwssd_epi32(dot, wq[i].q[3], a3);
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wq[i].d, ad), acc[i][t]);
        if constexpr (WT == GgmlType::Q4_1 || WT == GgmlType::Q5_1)
          acc[i][t] = _mm512_fmadd_ps(wq[i].m, _mm512_load_ps(a.s), acc[i][t]);
      }
    }
  }
  store_sums<R, T>(acc, y, ldy);
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

// What TiledMatmul (tiled_matmul.h) needs from this ISA.
struct Isa {
  static constexpr bool handles(GgmlType t) { return quad_type(t); }
  static constexpr bool kPrefetchInTile = false;
  using Act = ActQuad;
  static constexpr int kActGroup = 4;
  static constexpr int kTokenTile = 8;
  template <int T>
  static constexpr int q_rows_per_tile() {
    return T >= 4 ? 2 : 4;  // R*T accumulators + R decoded quads (5-6 registers each) fit in 32
  }
  template <int T>
  static constexpr int f_rows_per_tile() {
    return 4;
  }
  static void pack_acts(const block_q16_act* xq, int nb, int n_tok, Act* out) { avx512::pack_acts(xq, nb, n_tok, out); }
  template <GgmlType WT, int R, int T>
  static void q_tile(const uint8_t* row0, size_t stride, int nb, const Act* acts, int n_groups, float* y, int64_t ldy) {
    avx512::q_tile<WT, R, T>(row0, stride, nb, acts, n_groups, y, ldy);
  }
  template <GgmlType WT, int R, int T>
  static void f_tile(const uint8_t* row0, size_t stride, int64_t cols, const float* X, float* y, int64_t ldy) {
    avx512::f_tile<WT, R, T>(row0, stride, cols, X, y, ldy);
  }
};
}  // namespace

void quantize_acts(const float* x, int64_t n, block_q16_act* out) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, abs_mask), _mm512_and_ps(x1, abs_mask)));
    const float d = amax / 32767.f;
    if (d == 0.f) {
      std::memset(out[b].qs, 0, sizeof(out[b].qs));
      out[b].d = 0.f;
      out[b].s = 0.f;
      continue;
    }
    // Division (not multiplication by 1/d) and round-half-even: bit-identical to the scalar path.
    const __m512 vd = _mm512_set1_ps(d);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, vd)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, vd));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs), _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs + 16), _mm512_cvtepi32_epi16(q1));
    out[b].d = d;
    out[b].s = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// Q4_0, Q4_1, Q8_0 and the K-quants: the tiles of the AVX2 kernels with vpdpwssd on ymm registers, the group tiles
// (group_tiles.h) for fewer than 8 tokens and the token tiles (token_tiles.h) for 8 or more, which give the group
// tiles' bits.
namespace groups {
#define MA_GROUP_TILES_VNNI 1
#include "group_tiles.h"
#include "token_tiles.h"
#include "slot_tiles.h"
}  // namespace groups

void pack_slot_rows(const WeightView& w, uint8_t* out) { groups::pack_slot_rows(w, out); }
void matmul_slot_rows(const WeightView& packed, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0,
                      int64_t r1) {
  groups::matmul_slot_rows(packed, Xq, n_tok, Y, ldy, r0, r1);
}

void matmul(const WeightView& w, const float* X, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
            int64_t r0, int64_t r1) {
  if (!is_quantized(w.type) || quad_type(w.type)) return TiledMatmul<Isa>::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
  if (groups::tok_matmul_any(w, Xq, n_tok, Y, ldy, r0, r1)) return;
  TiledMatmul<groups::GroupIsa>::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
}

// The backend's other vector loops (vec_ops.h), in this file's ISA: 16-float vectors, one AVX-512 register.
#include "vec_ops.h"
METALATTN_VEC_OPS_ENTRY_POINTS(v16f)

}  // namespace metalattn::cpu::avx512
