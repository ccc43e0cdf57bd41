// AVX2 + FMA + F16C kernels. Quantized weights meet int16 activations in vpmaddwd (pairs of signed 16-bit
// products summed into int32 lanes) + vpaddd, exact per block (|w| <= 128, |a| <= 32767, 32 products < 2^27).
// Blocks go two at a time: 128-bit lane X of every operand holds 8 values of block X, so int32 lanes 4X..4X+3
// hold partial sums of block X only and one conversion + one FMA with a [dA x4, dB x4] scale vector applies
// the scales of both. Q4 weights enter as unsigned nibbles; Q4_0's offset of 8 is removed exactly by seeding
// the integer sum with -8 * sum(a) per block (see kernels_avx512.cpp, which this file mirrors at half width).
// Float weights: FMA. Every (row, token) output is the same sequence of operations whatever the tile, so
// matmul equals per-token matvec bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels_isa.h"
#include "tiled_matmul.h"

namespace metalattn::cpu::avx2 {
namespace {

// One token's activations for two consecutive blocks, laid out as ready 256-bit operands.
struct alignas(32) ActPair {
  int16_t qs[4][16];  // qs[k][8X + j] = element 8k + j of block X (0 past the last block)
  float d[8];         // lanes 4X..4X+3: scale of block X
  int32_t bias[8];    // Q4_0: lane 4X = -8 * sum(qs of block X), other lanes 0
  float s[8];         // Q4_1: lane 4X = s of block X (multiplies the block's min), other lanes 0
};

alignas(64) const uint8_t kZeroBlock[64] = {};  // stands in for the missing second block of an odd tail pair

constexpr size_t block_size(GgmlType t) { return block_bytes(t); }

void pack_acts(const block_q16_act* xq, int nb, int n_tok, ActPair* out) {
  const int npairs = (nb + 1) / 2;
  for (int t = 0; t < n_tok; ++t) {
    for (int p = 0; p < npairs; ++p) {
      ActPair& a = out[t * npairs + p];
      std::memset(&a, 0, sizeof(a));
      for (int x = 0; x < 2 && 2 * p + x < nb; ++x) {
        const block_q16_act& b = xq[static_cast<int64_t>(t) * nb + 2 * p + x];
        for (int k = 0; k < 4; ++k) std::memcpy(&a.qs[k][8 * x], &b.qs[8 * k], 8 * sizeof(int16_t));
        int sum = 0;
        for (int j = 0; j < 32; ++j) sum += b.qs[j];
        for (int j = 0; j < 4; ++j) a.d[4 * x + j] = b.d;
        a.bias[4 * x] = -8 * sum;
        a.s[4 * x] = b.s;
      }
    }
  }
}

inline uint32_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The fp16 values at b[X] + off (a block's scale or min), widened and spread to lanes 4X..4X+3.
inline __m256 spread_halves(const uint8_t* const b[2], int off) {
  const uint32_t h = load_u16(b[0] + off) | load_u16(b[1] + off) << 16;
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(h)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// 16 bytes from b[X] + off in 128-bit lane X.
inline __m256i load_lanes(const uint8_t* const b[2], int off) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(b[0] + off))),
                                 _mm_loadu_si128((const __m128i*)(b[1] + off)), 1);
}

// Decoded weights of one pair of 32-weight blocks of one row, in ActPair's layout: what every weight type reduces
// to. A block's value is d * q + m with q an exact integer (int16 lanes), d and m per block.
struct WeightPair {
  __m256i q[4];  // int16 (Q4: nibble 0..15; Q5: 0..31; Q8_0: as stored; Q6_K: (q - 32) * its int8 sub-scale)
  __m256 d;      // lanes 4X..4X+3: scale of block X
  __m256 m;      // types with a min (Q4_1, Q5_1, Q4_K, Q5_K): the min of block X (unused otherwise)
};

// Types whose blocks carry an additive min (d * q + m), applied through the activation block sums.
constexpr bool has_min(GgmlType t) {
  return t == GgmlType::Q4_1 || t == GgmlType::Q5_1 || t == GgmlType::Q4_K || t == GgmlType::Q5_K;
}
// Q4_0 / Q5_0 store q + 8 / q + 16: the offset is removed exactly by seeding the integer sum with
// -offset * sum(a) (ActPair::bias holds -8 * sum(a)).
constexpr int bias_times(GgmlType t) { return t == GgmlType::Q4_0 ? 1 : t == GgmlType::Q5_0 ? 2 : 0; }

// The four int16 operands from 32 bytes `first` (block X = 0) and 32 bytes `second` (block X = 1), each holding
// one block's 32 weights as unsigned bytes: lane X of operand k gets weights 8k..8k+7 of block X.
inline void widen_pair(__m256i first, __m256i second, __m256i q[4]) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i a = _mm256_permute2x128_si256(first, second, 0x20);  // weights 0..15 of each block
  const __m256i b = _mm256_permute2x128_si256(first, second, 0x31);  // weights 16..31
  q[0] = _mm256_unpacklo_epi8(a, zero);
  q[1] = _mm256_unpackhi_epi8(a, zero);
  q[2] = _mm256_unpacklo_epi8(b, zero);
  q[3] = _mm256_unpackhi_epi8(b, zero);
}

// Bit `s` (and with width 2, bit s + 1) of every byte of v, moved to bits 4 (and 5): the high bits of Q5 / Q6_K.
inline __m256i bits_to_high(__m256i v, int s, int mask) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, s), _mm256_set1_epi8(static_cast<char>(mask))), 4);
}

// Q5_0 / Q5_1: the 32 fifth bits of each block (in 128-bit lane X) spread to 0x10 in bytes 0..15 (weights j) and
// bytes 0..15 of the second result (weights j + 16).
inline void q5_high(const uint8_t* const b[2], int qh_off, __m256i* lo_bits, __m256i* hi_bits) {
  uint32_t h0, h1;
  std::memcpy(&h0, b[0] + qh_off, 4);
  std::memcpy(&h1, b[1] + qh_off, 4);
  const __m256i qh = _mm256_setr_epi32(static_cast<int>(h0), 0, 0, 0, static_cast<int>(h1), 0, 0, 0);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  const __m256i ten = _mm256_set1_epi8(0x10);
  const __m256i sel_lo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m256i sel_hi = _mm256_add_epi8(sel_lo, _mm256_set1_epi8(2));
  const __m256i lo = _mm256_and_si256(_mm256_shuffle_epi8(qh, sel_lo), bit);
  const __m256i hi = _mm256_and_si256(_mm256_shuffle_epi8(qh, sel_hi), bit);
  *lo_bits = _mm256_and_si256(_mm256_cmpeq_epi8(lo, bit), ten);
  *hi_bits = _mm256_and_si256(_mm256_cmpeq_epi8(hi, bit), ten);
}

constexpr bool is_q45_k(GgmlType t) { return t == GgmlType::Q4_K || t == GgmlType::Q5_K; }

// A Q4_K / Q5_K super-block's eight sub-block scales d * sc[j] and mins -dmin * m[j] (lane j), decoded once for its
// four pairs: the 6-bit fields unpacked four at a time with 32-bit masks (the layout in quant.h).
struct KScales {
  __m256 d, m;
};

inline KScales k_scales(const uint8_t* super_block) {
  const auto* h = reinterpret_cast<const block_q4_K*>(super_block);  // d, dmin, scales: the same place in Q5_K
  uint32_t u[3];
  std::memcpy(u, h->scales, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(sc_hi), static_cast<int>(sc_lo))));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(m_hi), static_cast<int>(m_lo))));
  // The products round as the reference's d * sc and dmin * m do; the min enters negated.
  return {_mm256_mul_ps(_mm256_set1_ps(fp16_to_float(h->d)), sc),
          _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_float(h->dmin)), m), _mm256_set1_ps(-0.f))};
}

// Pair p of a row: its blocks 2p and 2p + 1 (32 weights each; for the K-quants, sub-blocks of a super-block).
// Legacy rows with an odd block count end in a lone block, paired with zeros. ks: the super-block's scales
// (Q4_K / Q5_K only).
template <GgmlType WT>
inline WeightPair load_pair(const uint8_t* row, int p, int nb, const KScales* ks = nullptr) {
  WeightPair w;
  if constexpr (is_q45_k(WT)) {
    // Pair c of a super-block = sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles) of the same 32 bytes.
    const uint8_t* sb = row + static_cast<size_t>(p / 4) * block_size(WT);
    const int c = p % 4;
    const auto* h = reinterpret_cast<const block_q4_K*>(sb);
    const uint8_t* qs = WT == GgmlType::Q5_K ? reinterpret_cast<const block_q5_K*>(sb)->qs : h->qs;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    if constexpr (WT == GgmlType::Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const block_q5_K*>(sb)->qh));
      lo = _mm256_or_si256(lo, bits_to_high(qh, 2 * c, 1));
      hi = _mm256_or_si256(hi, bits_to_high(qh, 2 * c + 1, 1));
    }
    widen_pair(lo, hi, w.q);
    const __m256i pick = _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1);
    w.d = _mm256_permutevar8x32_ps(ks->d, pick);
    w.m = _mm256_permutevar8x32_ps(ks->m, pick);
  } else if constexpr (WT == GgmlType::Q6_K) {
    // Pair c of a super-block: weights 64c .. 64c + 63 = groups g0 = 2 (c % 2) and g0 + 1 of half c / 2.
    const auto* b6 = reinterpret_cast<const block_q6_K*>(row) + p / 4;
    const int c = p % 4, h = c / 2, g0 = 2 * (c % 2), shift = 4 * (c % 2);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b6->ql + 64 * h));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b6->ql + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b6->qh + 32 * h));
    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, shift), nibble), bits_to_high(qh, 2 * g0, 3));
    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, shift), nibble),
                                       bits_to_high(qh, 2 * g0 + 2, 3));
    widen_pair(q0, q1, w.q);
    // Weights 0..15 of a block use its first 16-weight sub-scale, 16..31 the second; the scale folds into the
    // int16 weight: |(q - 32) * sc| <= 32 * 128 = 4096, so 8 products with |a| <= 32767 stay below 2^31.
    const int8_t* sc = b6->scales + 8 * h + 2 * g0;  // sub-scales g0: sc[0], sc[1]; g0 + 1: sc[2], sc[3]
    const __m256i s_first = _mm256_set_m128i(_mm_set1_epi16(sc[2]), _mm_set1_epi16(sc[0]));
    const __m256i s_second = _mm256_set_m128i(_mm_set1_epi16(sc[3]), _mm_set1_epi16(sc[1]));
    const __m256i off = _mm256_set1_epi16(32);
    for (int k = 0; k < 4; ++k) w.q[k] = _mm256_mullo_epi16(_mm256_sub_epi16(w.q[k], off), k < 2 ? s_first : s_second);
    w.d = _mm256_set1_ps(fp16_to_float(b6->d));
  } else {
    constexpr size_t bs = block_size(WT);
    const uint8_t* b[2] = {row + 2 * p * bs, 2 * p + 1 < nb ? row + (2 * p + 1) * bs : kZeroBlock};
    w.d = spread_halves(b, 0);
    if constexpr (WT == GgmlType::Q8_0) {
      // unpack(v, v) puts each byte in both halves of a word; the arithmetic shift sign-extends it, in lane.
      const __m256i v0 = load_lanes(b, 2), v1 = load_lanes(b, 18);  // weights 0..15, 16..31
      w.q[0] = _mm256_srai_epi16(_mm256_unpacklo_epi8(v0, v0), 8);
      w.q[1] = _mm256_srai_epi16(_mm256_unpackhi_epi8(v0, v0), 8);
      w.q[2] = _mm256_srai_epi16(_mm256_unpacklo_epi8(v1, v1), 8);
      w.q[3] = _mm256_srai_epi16(_mm256_unpackhi_epi8(v1, v1), 8);
    } else {
      // Byte j holds weight j (low nibble) and weight j + 16 (high nibble); Q5 adds the fifth bits.
      constexpr int qs_off = WT == GgmlType::Q4_0 ? 2 : WT == GgmlType::Q4_1 ? 4 : WT == GgmlType::Q5_0 ? 6 : 8;
      const __m256i v = load_lanes(b, qs_off);
      const __m256i nibble = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
      __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      if constexpr (WT == GgmlType::Q5_0 || WT == GgmlType::Q5_1) {
        __m256i lo_bits, hi_bits;
        q5_high(b, WT == GgmlType::Q5_0 ? 2 : 4, &lo_bits, &hi_bits);
        lo = _mm256_or_si256(lo, lo_bits);
        hi = _mm256_or_si256(hi, hi_bits);
      }
      w.q[0] = _mm256_unpacklo_epi8(lo, zero);
      w.q[1] = _mm256_unpackhi_epi8(lo, zero);
      w.q[2] = _mm256_unpacklo_epi8(hi, zero);
      w.q[3] = _mm256_unpackhi_epi8(hi, zero);
      if constexpr (has_min(WT)) w.m = spread_halves(b, 2);
    }
  }
  return w;
}

inline float reduce(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

template <GgmlType WT, int R, int T>
void q_tile(const uint8_t* row0, size_t stride, int nb, const ActPair* acts, int npairs, float* y, int64_t ldy) {
  __m256 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  KScales ks[is_q45_k(WT) ? R : 1] = {};  // set at each super-block's first pair
  for (int p = 0; p < npairs; ++p) {
    if constexpr (is_q45_k(WT))
      if (p % 4 == 0)
        for (int i = 0; i < R; ++i) ks[i] = k_scales(row0 + i * stride + static_cast<size_t>(p / 4) * block_size(WT));
    WeightPair wp[R];
    for (int i = 0; i < R; ++i) wp[i] = load_pair<WT>(row0 + i * stride, p, nb, &ks[is_q45_k(WT) ? i : 0]);
    for (int t = 0; t < T; ++t) {
      const ActPair& a = acts[t * npairs + p];
      const __m256 ad = _mm256_load_ps(a.d);
      for (int i = 0; i < R; ++i) {
        // Exact: see the top of the file. vpmaddwd cannot saturate: no activation is -32768.
        __m256i dot = _mm256_madd_epi16(wp[i].q[0], _mm256_load_si256((const __m256i*)a.qs[0]));
        if constexpr (bias_times(WT) > 0) {
          const __m256i bias = _mm256_load_si256((const __m256i*)a.bias);
          dot = _mm256_add_epi32(dot, bias_times(WT) == 2 ? _mm256_slli_epi32(bias, 1) : bias);
        }
        for (int k = 1; k < 4; ++k)
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(wp[i].q[k], _mm256_load_si256((const __m256i*)a.qs[k])));
        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(wp[i].d, ad), acc[i][t]);
        if constexpr (has_min(WT)) acc[i][t] = _mm256_fmadd_ps(wp[i].m, _mm256_load_ps(a.s), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) y[t * ldy + i] = reduce(acc[i][t]);
}

// ---------------------------------------------------------------- float weights

template <GgmlType WT>
inline __m256 load_weights8(const uint8_t* row, int64_t c) {
  if constexpr (WT == GgmlType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + c);
  } else if constexpr (WT == GgmlType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + c)));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// The last cols % 8 weights, zero-padded (never reads past the row).
template <GgmlType WT>
inline __m256 load_weights_tail(const uint8_t* row, int64_t c, int64_t n) {
  const size_t elem = WT == GgmlType::F32 ? 4 : 2;
  alignas(32) uint8_t buf[32] = {};
  std::memcpy(buf, row + c * elem, n * elem);
  return load_weights8<WT>(buf, 0);
}

inline __m256 load_x_tail(const float* x, int64_t n) {
  alignas(32) float buf[8] = {};
  std::memcpy(buf, x, n * sizeof(float));
  return _mm256_load_ps(buf);
}

template <GgmlType WT, int R, int T>
void f_tile(const uint8_t* row0, size_t stride, int64_t cols, const float* X, float* y, int64_t ldy) {
  __m256 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  const int64_t full = cols / 8 * 8;
  for (int64_t c = 0; c < cols; c += 8) {
    __m256 wv[R];
    for (int i = 0; i < R; ++i)
      wv[i] = c < full ? load_weights8<WT>(row0 + i * stride, c) : load_weights_tail<WT>(row0 + i * stride, c, cols - c);
    for (int t = 0; t < T; ++t) {
      const __m256 xv = c < full ? _mm256_loadu_ps(X + t * cols + c) : load_x_tail(X + t * cols + c, cols - c);
      for (int i = 0; i < R; ++i) acc[i][t] = _mm256_fmadd_ps(wv[i], xv, acc[i][t]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) y[t * ldy + i] = reduce(acc[i][t]);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}


// What TiledMatmul (tiled_matmul.h) needs from this ISA.
struct Isa {
  static constexpr bool kAllQuantTypes = true;
  using Act = ActPair;
  static constexpr int kActGroup = 2;
  static constexpr int kTokenTile = 4;
  template <int T>
  static constexpr int q_rows_per_tile() {
    return T >= 4 ? 1 : 2;  // keeps accumulators and decoded pairs (5-6 registers each) within 16
  }
  template <int T>
  static constexpr int f_rows_per_tile() {
    return T >= 2 ? 2 : 4;
  }
  static void pack_acts(const block_q16_act* xq, int nb, int n_tok, Act* out) { avx2::pack_acts(xq, nb, n_tok, out); }
  template <GgmlType WT, int R, int T>
  static void q_tile(const uint8_t* row0, size_t stride, int nb, const Act* acts, int n_groups, float* y, int64_t ldy) {
    avx2::q_tile<WT, R, T>(row0, stride, nb, acts, n_groups, y, ldy);
  }
  template <GgmlType WT, int R, int T>
  static void f_tile(const uint8_t* row0, size_t stride, int64_t cols, const float* X, float* y, int64_t ldy) {
    avx2::f_tile<WT, R, T>(row0, stride, cols, X, y, ldy);
  }
};
}  // namespace

void quantize_acts(const float* x, int64_t n, block_q16_act* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    const __m256 m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
    const float d = hmax(_mm256_max_ps(m01, m23)) / 32767.f;
    if (d == 0.f) {
      std::memset(out[b].qs, 0, sizeof(out[b].qs));
      out[b].d = 0.f;
      out[b].s = 0.f;
      continue;
    }
    // Division and round-half-even, as the scalar path: identical bytes on every ISA.
    const __m256 vd = _mm256_set1_ps(d);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], vd));
    // packs works within 128-bit lanes ([a0-3 b0-3 | a4-7 b4-7]); the 64-bit permute restores element order.
    for (int h = 0; h < 2; ++h) {
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs + 16 * h), words);
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                                  _mm256_add_epi32(q[2], q[3]))));
  }
}

void matmul(const WeightView& w, const float* X, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
            int64_t r0, int64_t r1) {
  TiledMatmul<Isa>::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
}

}  // namespace metalattn::cpu::avx2
