// Internal: the group-of-8-blocks tiles for quantized weights (every quant type but Q2_K/Q3_K) and the float
// FMA tiles, on 256-bit registers. Included by kernels_avx2.cpp (AVX2 + FMA + F16C: vpmaddwd + vpaddd) and by
// kernels_avx512.cpp with MA_GROUP_TILES_VNNI=1 (the same tiles with AVX-512VL VNNI vpdpwssd on ymm registers,
// 32 of them: fewer instructions per pair and room for a wider token tile). Include it only inside an ISA
// namespace of one ISA translation unit: everything here sits in an anonymous namespace, so each inclusion is
// compiled with that file's -m flags only (as tiled_matmul.h explains).
//
// Quantized weights meet int16 activations in vpmaddwd (pairs of signed 16-bit products summed into int32 lanes) +
// vpaddd, or vpdpwssd (the same sum, fused): every block's dot product is exact in integers, and only then scaled in
// float. Float weights: FMA on float activations.
//
// Layout. A row is walked in groups of 8 blocks of 32 weights (256 weights: exactly one K-quant super-block; the
// legacy types' last group may be partial), a group as 4 pairs of blocks. In a pair, 128-bit lane X of each of the
// four int16 operands holds 8 weights of block X: its even elements 0, 2 .. 14, its odd elements 1 .. 15, then
// 16, 18 .. 30 and 17 .. 31 (ActGroup). That order lets every weight type build its operands from 16-bit words with
// masks and shifts only (the low and high byte of a word are two neighbouring weights), no byte unpacking; on the dev
// machine's cores these loops are bound by instruction count (about 4 per cycle), so fewer instructions is the whole
// game. After the four vpmaddwd of a pair, int32 lanes 4X..4X+3 hold partial sums of block X only; fold32/fold64
// add a group's four pair vectors into one vector whose lane L is the whole sum of block kLaneBlock[L], and one
// int->float conversion and one FMA apply the 8 blocks' scales (weight scale x activation scale, both prepared in
// that lane order). Mins (Q4_1, Q5_1, Q4_K, Q5_K) cost one more FMA per group with the activation block sums.
//
// Each weight type only has to produce its pairs' operands (load_pair) and the group's scales in lane order
// (group_scales): see "weight types" below, one short section per type. They are tested against the scalar reference
// in tests/cpp/test_cpu_kernels.cpp.
//
// Exactness: int32 lanes never overflow. Per block the 32 products of |q| <= 128 (Q8_0; Q4: 15, Q5: 31, Q6_K: 63)
// with |a| <= 32767 sum to < 2^27; the offsets (Q4_0: -8 * sum(a), Q5_0: -16 * sum(a), Q6_K: -32 * sum per
// 16-weight half) are exact integers too. Every (row, token) output is the same sequence of float operations whatever
// the tile, so matmul equals per-token matvec bit for bit.
//
// No include guard and no #include here: the including file includes <immintrin.h>, <algorithm>, <cstring>,
// <type_traits>, <vector>, kernels_isa.h and tiled_matmul.h first, then opens its namespace and includes this.
// MA_GROUP_TILES_VNNI (0 or 1) must be defined by the includer.

namespace {

// The tile loops must be one function: a group step left out of line keeps the accumulators in memory.
#ifndef MA_INLINE
#define MA_INLINE inline __attribute__((always_inline))
#endif

constexpr int kGroupBlocks = 8;  // 32-weight blocks per group
// Lane L of a group's reduced sums, and of every per-block vector below, belongs to block kLaneBlock[L] of the group
// (the order fold32/fold64 produce).
constexpr int kLaneBlock[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// One token's activations for one group of 8 blocks, laid out as ready 256-bit operands.
struct alignas(32) ActGroup {
  int16_t qs[4][4][16];    // pair p, operand k, [8X + i]: element 16 (k / 2) + 2i + k % 2 of block 2p + X
  float d[8];              // lane L: scale of block kLaneBlock[L] (0 past the last block)
  float s[8];              // lane L: s = d * sum(qs) of block kLaneBlock[L] (multiplies the block's min)
  int32_t neg_sum[8];      // lane L: -sum(qs) of block kLaneBlock[L] (Q4_0 / Q5_0 remove their +8 / +16 with it)
  int32_t neg_half[2][8];  // [h][L]: -sum of elements 16h .. 16h + 15 of block kLaneBlock[L] (Q6_K's +32)
};

alignas(64) const uint8_t kZeroBlock[64] = {};  // stands in for the blocks past the end of a partial group

void group_pack_acts(const block_q16_act* xq, int nb, int n_tok, ActGroup* out) {
  const int ng = (nb + kGroupBlocks - 1) / kGroupBlocks;
  // Words of 8 consecutive elements reordered to [the 4 even | the 4 odd]; two such halves then combine (unpacklo /
  // unpackhi of 64-bit halves) into the 8 even and the 8 odd elements of 16.
  const __m128i deinterleave = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m128i ones = _mm_set1_epi16(1);
  auto hsum = [](__m128i v) {  // the 4 int32 lanes added
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1))));
  };
  for (int t = 0; t < n_tok; ++t) {
    for (int g = 0; g < ng; ++g) {
      ActGroup& a = out[t * ng + g];
      if (kGroupBlocks * (g + 1) > nb) std::memset(&a, 0, sizeof(a));  // a partial group: the missing blocks add 0
      for (int lane = 0; lane < kGroupBlocks; ++lane) {
        const int j = kLaneBlock[lane], blk = kGroupBlocks * g + j;
        if (blk >= nb) continue;
        const block_q16_act& b = xq[static_cast<int64_t>(t) * nb + blk];
        int half[2];
        for (int h = 0; h < 2; ++h) {  // elements 16h .. 16h + 15 -> operands 2h (even) and 2h + 1 (odd)
          const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * h));
          const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * h + 8));
          const __m128i s0 = _mm_shuffle_epi8(x0, deinterleave), s1 = _mm_shuffle_epi8(x1, deinterleave);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.qs[j / 2][2 * h][8 * (j % 2)]), _mm_unpacklo_epi64(s0, s1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.qs[j / 2][2 * h + 1][8 * (j % 2)]), _mm_unpackhi_epi64(s0, s1));
          half[h] = hsum(_mm_add_epi32(_mm_madd_epi16(x0, ones), _mm_madd_epi16(x1, ones)));
        }
        a.d[lane] = b.d;
        a.s[lane] = b.s;
        a.neg_sum[lane] = -(half[0] + half[1]);
        a.neg_half[0][lane] = -half[0];
        a.neg_half[1][lane] = -half[1];
      }
    }
  }
}

// ---------------------------------------------------------------- pieces shared by the weight types

MA_INLINE int load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

MA_INLINE int load_i32(const uint8_t* p) {
  int v;
  std::memcpy(&v, p, 4);
  return v;
}

MA_INLINE __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
MA_INLINE __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
MA_INLINE __m256i words(int v) { return _mm256_set1_epi16(static_cast<short>(v)); }

// 16 bytes from a + off in 128-bit lane 0, from b + off in lane 1.
MA_INLINE __m256i load_lanes(const uint8_t* a, const uint8_t* b, int off) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off)), 1);
}

// Two registers of weights as bytes (each < 128), lane X = block X, weights 0..15 (lo) and 16..31 (hi) -> the four
// operands: a word's low byte is its even weight, its high byte the odd one.
MA_INLINE void split_words(__m256i lo, __m256i hi, __m256i q[4]) {
  q[0] = _mm256_and_si256(lo, words(0x00FF));
  q[1] = _mm256_srli_epi16(lo, 8);
  q[2] = _mm256_and_si256(hi, words(0x00FF));
  q[3] = _mm256_srli_epi16(hi, 8);
}

// Two blocks' 32 weights as bytes, one block per register in weight order (the K-quants' layout) -> the operands.
MA_INLINE void split_blocks(__m256i block0, __m256i block1, __m256i q[4]) {
  split_words(_mm256_permute2x128_si256(block0, block1, 0x20), _mm256_permute2x128_si256(block0, block1, 0x31), q);
}

MA_INLINE __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, bytes(0x0F)); }
MA_INLINE __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), bytes(0x0F)); }

// Per group and row, lane L for block kLaneBlock[L]: weight scale d and min m (weight = d * q + m); Q6_K: d scales
// weights 0..15 of the block, d_hi weights 16..31.
struct GroupScales {
  __m256 d, m, d_hi;
};

// Types whose blocks carry an additive min, applied through the activation block sums s.
constexpr bool has_min(GgmlType t) {
  return t == GgmlType::Q4_1 || t == GgmlType::Q5_1 || t == GgmlType::Q4_K || t == GgmlType::Q5_K;
}
constexpr bool is_legacy(GgmlType t) { return block_elems(t) == kQuantBlock; }

// ---------------------------------------------------------------- weight types
// load_pair<WT, P>(group, q): blocks 2P and 2P + 1 of the group as the four int16 operands (Q4_0 / Q5_0 / Q6_K: their
// stored unsigned codes; the offsets are removed through the activation sums). group_scales<WT>(group): the scales in
// lane order. A legacy group is 8 block pointers (kZeroBlock past the row's end), a K-quant group its super-block.

// ---- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: byte j of qs holds weight j (low nibble) and j + 16 (high nibble); Q5 adds the
// fifth bit of weight j from bit j of qh; Q8_0 stores 32 int8.
constexpr int legacy_qs_offset(GgmlType t) {
  return t == GgmlType::Q4_0 || t == GgmlType::Q8_0 ? 2 : t == GgmlType::Q4_1 ? 4 : t == GgmlType::Q5_0 ? 6 : 8;
}

// Q5_0 / Q5_1: the fifth bits of blocks a (lane 0) and b (lane 1) as 0x10 in the bytes of weights 0..15 (*lo) and
// 16..31 (*hi): byte 8i + k of a lane tests bit k of qh byte i (lo: i = 0, 1; hi: i = 2, 3).
MA_INLINE void q5_fifth_bits(const uint8_t* a, const uint8_t* b, int qh_off, __m256i* lo, __m256i* hi) {
  const __m256i qh = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtsi32_si128(load_i32(a + qh_off))),
                                             _mm_cvtsi32_si128(load_i32(b + qh_off)), 1);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  const __m256i sel_lo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m256i sel_hi = _mm256_add_epi8(sel_lo, bytes(2));
  *lo = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, sel_lo), bit), bit), bytes(0x10));
  *hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, sel_hi), bit), bit), bytes(0x10));
}

template <GgmlType WT>
MA_INLINE void legacy_pair(const uint8_t* a, const uint8_t* b, __m256i q[4]) {
  if constexpr (WT == GgmlType::Q8_0) {
    // Sign-extend the low / high byte of every word.
    const __m256i v0 = load_lanes(a, b, 2), v1 = load_lanes(a, b, 18);  // weights 0..15, 16..31
    q[0] = _mm256_srai_epi16(_mm256_slli_epi16(v0, 8), 8);
    q[1] = _mm256_srai_epi16(v0, 8);
    q[2] = _mm256_srai_epi16(_mm256_slli_epi16(v1, 8), 8);
    q[3] = _mm256_srai_epi16(v1, 8);
  } else if constexpr (WT == GgmlType::Q4_0 || WT == GgmlType::Q4_1) {
    // Word i of a lane is qs bytes 2i, 2i + 1: weights 2i, 2i + 1 in its low nibbles, 2i + 16, 2i + 17 in the high.
    const __m256i v = load_lanes(a, b, legacy_qs_offset(WT));
    q[0] = _mm256_and_si256(v, words(0x000F));
    q[1] = _mm256_and_si256(_mm256_srli_epi16(v, 8), words(0x000F));
    q[2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), words(0x000F));
    q[3] = _mm256_srli_epi16(v, 12);
  } else {
    const __m256i v = load_lanes(a, b, legacy_qs_offset(WT));
    __m256i lo_bits, hi_bits;
    q5_fifth_bits(a, b, WT == GgmlType::Q5_0 ? 2 : 4, &lo_bits, &hi_bits);
    split_words(_mm256_or_si256(low_nibbles(v), lo_bits), _mm256_or_si256(high_nibbles(v), hi_bits), q);
  }
}

// The 8 fp16 values at b[j] + off (one per block of a legacy group) as floats in lane order.
MA_INLINE __m256 gather_halves(const uint8_t* const b[8], int off) {
  __m128i h = _mm_cvtsi32_si128(load_u16(b[kLaneBlock[0]] + off));
  h = _mm_insert_epi16(h, load_u16(b[kLaneBlock[1]] + off), 1);
  h = _mm_insert_epi16(h, load_u16(b[kLaneBlock[2]] + off), 2);
  h = _mm_insert_epi16(h, load_u16(b[kLaneBlock[3]] + off), 3);
  h = _mm_insert_epi16(h, load_u16(b[kLaneBlock[4]] + off), 4);
  h = _mm_insert_epi16(h, load_u16(b[kLaneBlock[5]] + off), 5);
  h = _mm_insert_epi16(h, load_u16(b[kLaneBlock[6]] + off), 6);
  h = _mm_insert_epi16(h, load_u16(b[kLaneBlock[7]] + off), 7);
  return _mm256_cvtph_ps(h);
}

template <GgmlType WT>
MA_INLINE GroupScales legacy_scales(const uint8_t* const b[8]) {
  GroupScales s;
  s.d = gather_halves(b, 0);
  if constexpr (has_min(WT)) s.m = gather_halves(b, 2);
  return s;
}

// ---- Q4_K / Q5_K: pair c of a super-block = sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles) of
// qs[32c .. 32c + 31], in weight order; Q5_K adds bit j of qh[l] as bit 4 of weight l of sub-block j.
template <GgmlType WT, int C>
MA_INLINE void k_pair(const uint8_t* sb, __m256i q[4]) {
  if constexpr (WT == GgmlType::Q4_K) {
    // Bytes 0..15 of the pair hold elements 0..15 of both sub-blocks (low / high nibbles), bytes 16..31 elements
    // 16..31. Broadcast each half to both lanes and shift lane 1 by 4 more bits (dword shifts; every result is masked
    // to the low nibble of its own word): lane 0 then reads sub-block 2c, lane 1 sub-block 2c + 1, no lane crossing.
    const uint8_t* qs = reinterpret_cast<const block_q4_K*>(sb)->qs + 32 * C;
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
    const __m256i even = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), odd = _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12);
    q[0] = _mm256_and_si256(_mm256_srlv_epi32(x, even), words(0x000F));
    q[1] = _mm256_and_si256(_mm256_srlv_epi32(x, odd), words(0x000F));
    q[2] = _mm256_and_si256(_mm256_srlv_epi32(y, even), words(0x000F));
    q[3] = _mm256_and_si256(_mm256_srlv_epi32(y, odd), words(0x000F));
  } else {
    const auto* b5 = reinterpret_cast<const block_q5_K*>(sb);
    const __m256i v = load256(b5->qs + 32 * C), qh = load256(b5->qh);
    // Bit j of every byte moved to bit 4 (16-bit shifts: the masked bit cannot cross into the next byte).
    auto fifth = [&](auto j_const) __attribute__((always_inline)) {
      constexpr int j = decltype(j_const)::value;
      const __m256i b = _mm256_and_si256(qh, bytes(1 << j));
      if constexpr (j < 4) return _mm256_slli_epi16(b, 4 - j);
      else if constexpr (j > 4) return _mm256_srli_epi16(b, j - 4);
      else return b;
    };
    split_blocks(_mm256_or_si256(low_nibbles(v), fifth(std::integral_constant<int, 2 * C>{})),
                 _mm256_or_si256(high_nibbles(v), fifth(std::integral_constant<int, 2 * C + 1>{})), q);
  }
}

// The eight 6-bit scales and mins (packed as quant.h describes) unpacked together: a 16-byte load from scales[0]
// gives dwords u0 = scales[0..3], u1 = [4..7], u2 = [8..11]; sub-blocks 0..3 take the low 6 bits of u0 (scales) and
// u1 (mins), sub-blocks 4..7 the nibbles of u2 with the top 2 bits of u0 / u1 above them.
MA_INLINE GroupScales k_scales(const uint8_t* sb) {
  const auto* h = reinterpret_cast<const block_q4_K*>(sb);  // d, dmin, scales: the same place in Q5_K
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h->scales));
  const __m128i low6 = _mm_and_si128(x, _mm_set1_epi8(0x3f));                          // dw 0: sc 0..3, dw 1: m 0..3
  const __m128i top2 = _mm_and_si128(_mm_srli_epi32(x, 2), _mm_set1_epi8(0x30));     // bits 6-7 of u0, u1 at 4-5
  const __m128i u2 = _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 2, 2, 2));
  const __m128i nib = _mm_and_si128(_mm_srlv_epi32(u2, _mm_setr_epi32(0, 4, 0, 0)), _mm_set1_epi8(0x0f));
  const __m128i sm = _mm_unpacklo_epi32(low6, _mm_or_si128(nib, top2));                // bytes: sc 0..7, m 0..7
  const __m128i ordered = _mm_shuffle_epi8(sm, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(load_i32(sb)));                      // d, dmin
  GroupScales s;
  // The products round as the reference's d * sc and dmin * m do; the min enters negated.
  s.d = _mm256_mul_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ordered)));
  s.m = _mm256_xor_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(ordered, ordered)))),
                      _mm256_set1_ps(-0.f));
  return s;
}

// ---- Q6_K: pair c = blocks f = 2 (c % 2) and f + 1 of half h = c / 2. Block f's low 4 bits are nibble f / 2 of
// ql[64h + 32 (f % 2) + l], its high 2 bits field f of qh[32h + l]; both moved into place by byte-masked shifts.
template <int C>
MA_INLINE void q6k_pair(const block_q6_K* b, __m256i q[4]) {
  constexpr int h = C / 2, upper = C % 2;  // upper: fields 2, 3 (high nibbles, qh bits 4..7)
  const __m256i ql0 = load256(b->ql + 64 * h), ql1 = load256(b->ql + 64 * h + 32), qh = load256(b->qh + 32 * h);
  const __m256i top = bytes(0x30);
  __m256i first, second;
  if constexpr (upper == 0) {
    first = _mm256_or_si256(low_nibbles(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top));
    second = _mm256_or_si256(low_nibbles(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top));
  } else {
    first = _mm256_or_si256(high_nibbles(ql0), _mm256_and_si256(qh, top));
    second = _mm256_or_si256(high_nibbles(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
  }
  split_blocks(first, second, q);
}

// Block j's two 16-weight sub-scales are scales[2j] (weights 0..15) and scales[2j + 1]; in lane order.
MA_INLINE GroupScales q6k_scales(const block_q6_K* b) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
  const __m128i ordered = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15));
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(b->d));
  GroupScales s;
  s.d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ordered)));
  s.d_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(ordered, ordered))));
  return s;
}

// ---------------------------------------------------------------- a group: decode, integer dot, scales

// A row's group: its 8 block pointers (legacy; kZeroBlock past nb) or its super-block (K-quants, in b[0]).
struct GroupRef {
  const uint8_t* b[8];
};

template <GgmlType WT, bool kTail>
MA_INLINE GroupRef group_ref(const uint8_t* row, int g, int nb) {
  GroupRef r;
  if constexpr (is_legacy(WT)) {
    constexpr size_t bs = block_bytes(WT);
    for (int j = 0; j < kGroupBlocks; ++j) {
      const int blk = kGroupBlocks * g + j;
      r.b[j] = !kTail || blk < nb ? row + static_cast<size_t>(blk) * bs : kZeroBlock;
    }
  } else {
    r.b[0] = row + static_cast<size_t>(g) * block_bytes(WT);
  }
  return r;
}

template <GgmlType WT, int P>
MA_INLINE void load_pair(const GroupRef& r, __m256i q[4]) {
  if constexpr (is_legacy(WT)) {
    legacy_pair<WT>(r.b[2 * P], r.b[2 * P + 1], q);
  } else if constexpr (WT == GgmlType::Q6_K) {
    q6k_pair<P>(reinterpret_cast<const block_q6_K*>(r.b[0]), q);
  } else {
    k_pair<WT, P>(r.b[0], q);
  }
}

template <GgmlType WT>
MA_INLINE GroupScales group_scales(const GroupRef& r) {
  if constexpr (is_legacy(WT)) return legacy_scales<WT>(r.b);
  else if constexpr (WT == GgmlType::Q6_K) return q6k_scales(reinterpret_cast<const block_q6_K*>(r.b[0]));
  else return k_scales(r.b[0]);
}

// A pair's integer dot with one token: int32 lanes 4X..4X+3 sum products of block X (Q6_K keeps the 16-weight
// halves apart: operands 0, 1 hold elements 0..15, operands 2, 3 elements 16..31; other types use `first` only).
template <GgmlType WT>
struct PairDot {
  __m256i first, second;
};

template <GgmlType WT>
MA_INLINE PairDot<WT> pair_dot(const __m256i q[4], const int16_t (*a)[16]) {
  auto act = [&](int k) __attribute__((always_inline)) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(a[k]));
  };
  auto madd = [&](int k) __attribute__((always_inline)) { return _mm256_madd_epi16(q[k], act(k)); };
#if MA_GROUP_TILES_VNNI
  // vpdpwssd adds the same int32 pair sums into its accumulator (wrapping, like vpaddd): identical integers.
  if constexpr (WT == GgmlType::Q6_K) {
    return {_mm256_dpwssd_epi32(madd(0), q[1], act(1)), _mm256_dpwssd_epi32(madd(2), q[3], act(3))};
  } else {
    __m256i s = _mm256_dpwssd_epi32(madd(0), q[1], act(1));
    s = _mm256_dpwssd_epi32(s, q[2], act(2));
    return {_mm256_dpwssd_epi32(s, q[3], act(3)), _mm256_setzero_si256()};
  }
#else
  if constexpr (WT == GgmlType::Q6_K) {
    return {_mm256_add_epi32(madd(0), madd(1)), _mm256_add_epi32(madd(2), madd(3))};
  } else {
    return {_mm256_add_epi32(_mm256_add_epi32(madd(0), madd(1)), _mm256_add_epi32(madd(2), madd(3))),
            _mm256_setzero_si256()};
  }
#endif
}

// Folding a group's four pair vectors into one whose lane L is the sum of block kLaneBlock[L], as the pairs arrive:
// pairs (0,1) and (2,3) interleave 32-bit lanes and add ([b0 b2 b0 b2 | b1 b3 b1 b3] partial sums), then the two
// results do the same with 64-bit halves. Integer adds: their order cannot change the result.
MA_INLINE __m256i fold32(__m256i x, __m256i y) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));
}
MA_INLINE __m256i fold64(__m256i x, __m256i y) {
  return _mm256_add_epi32(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y));
}

// The group's contribution to one (row, token) accumulator from its block sums: offsets removed in integers, sums
// converted once and scaled; the same operations for every tile shape.
template <GgmlType WT>
MA_INLINE __m256 group_epilogue(const PairDot<WT>& sums, const GroupScales& s, const ActGroup& a, __m256 acc) {
  const __m256 ad = _mm256_load_ps(a.d);
  if constexpr (WT == GgmlType::Q6_K) {
    // Each 16-weight half has its own scale; its sum is < 16 * 32 * 32767 < 2^24 once the offset is removed, so the
    // conversion is exact.
    const __m256i first = _mm256_add_epi32(
        sums.first, _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(a.neg_half[0])), 5));
    const __m256i second = _mm256_add_epi32(
        sums.second, _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(a.neg_half[1])), 5));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_mul_ps(s.d, ad), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), _mm256_mul_ps(s.d_hi, ad), acc);
  } else {
    __m256i sum = sums.first;
    if constexpr (WT == GgmlType::Q4_0 || WT == GgmlType::Q5_0) {  // stored codes are q + 8 / q + 16
      const __m256i neg = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.neg_sum));
      sum = _mm256_add_epi32(sum, _mm256_slli_epi32(neg, WT == GgmlType::Q4_0 ? 3 : 4));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s.d, ad), acc);
    if constexpr (has_min(WT)) acc = _mm256_fmadd_ps(s.m, _mm256_load_ps(a.s), acc);
    return acc;
  }
}

// Calls f(integral_constant<int, H>) for H = 0, 1.
template <class F>
MA_INLINE void for_halves(F&& f) {
  f(std::integral_constant<int, 0>{});
  f(std::integral_constant<int, 1>{});
}

// One group of R rows x T tokens, in two halves of two pairs: the R rows' pairs are decoded once into registers and
// used by all T tokens; each (row, token) folds its two pair dots at once, and the halves' results together, so
// between the halves only one vector per (row, token) stays live. In a partial group (kTail) the pairs past the
// row's last block are skipped: they would add zeros.
template <GgmlType WT, int R, int T, bool kTail>
MA_INLINE void group_tile(const uint8_t* row0, size_t stride, int g, int nb, const ActGroup* acts, int ngroups,
                          __m256 (&acc)[R][T]) {
  GroupRef r[R];
  GroupScales s[R];
  for (int i = 0; i < R; ++i) {
    r[i] = group_ref<WT, kTail>(row0 + i * stride, g, nb);
    s[i] = group_scales<WT>(r[i]);
  }
  const int pairs = kTail ? (nb - kGroupBlocks * g + 1) / 2 : 4;
  PairDot<WT> first_half[R][T];
  for_halves([&](auto h_const) __attribute__((always_inline)) {
    constexpr int H = decltype(h_const)::value;
    const bool present0 = !kTail || 2 * H < pairs, present1 = !kTail || 2 * H + 1 < pairs;
    __m256i q[R][2][4];
    for (int i = 0; i < R; ++i) {
      if (present0) load_pair<WT, 2 * H>(r[i], q[i][0]);
      if (present1) load_pair<WT, 2 * H + 1>(r[i], q[i][1]);
    }
    for (int t = 0; t < T; ++t) {
      const ActGroup& a = acts[t * ngroups + g];
      for (int i = 0; i < R; ++i) {
        const PairDot<WT> zero = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        const PairDot<WT> p0 = present0 ? pair_dot<WT>(q[i][0], a.qs[2 * H]) : zero;
        const PairDot<WT> p1 = present1 ? pair_dot<WT>(q[i][1], a.qs[2 * H + 1]) : zero;
        PairDot<WT> f = {fold32(p0.first, p1.first), zero.second};
        if constexpr (WT == GgmlType::Q6_K) f.second = fold32(p0.second, p1.second);
        if constexpr (H == 0) {
          first_half[i][t] = f;
        } else {
          PairDot<WT> sums = {fold64(first_half[i][t].first, f.first), zero.second};
          if constexpr (WT == GgmlType::Q6_K) sums.second = fold64(first_half[i][t].second, f.second);
          acc[i][t] = group_epilogue<WT>(sums, s[i], a, acc[i][t]);
        }
      }
    }
  });
}

inline float reduce(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// The weights ahead are prefetched here a group at a time in the AVX2 build, 8 KiB ahead into L1
// (kGroupPrefetchInTile), not as TiledMatmul's burst of a whole row before the tile: the burst's lines waited on the fill
// buffers the tile's own loads need. 2-core EPYC, AVX2 code (NOTES, "CPU, session 34"): decode of Qwen2.5-Coder-0.5B
// +20%, Gemma 3 270M +6%. The VNNI build keeps the burst (into L2, tiled_matmul.h): this form cost its Q8_0 rows a third.
constexpr bool kGroupPrefetchInTile = !MA_GROUP_TILES_VNNI;
constexpr size_t kGroupPrefetchBytes = 8192;  // as TiledMatmul::kPrefetchBytes

// R rows x T tokens of a quantized matrix, accumulators in registers.
template <GgmlType WT, int R, int T>
void group_q_tile(const uint8_t* row0, size_t stride, int nb, const ActGroup* acts, int ngroups, float* y, int64_t ldy) {
  __m256 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  const int full = nb / kGroupBlocks;  // K-quant rows are whole super-blocks: every group is full
  constexpr size_t group_bytes = is_legacy(WT) ? kGroupBlocks * block_bytes(WT) : block_bytes(WT);  // K: a super-block
  for (int g = 0; g < full; ++g) {
    if constexpr (kGroupPrefetchInTile)
      for (int i = 0; i < R; ++i) {
        const char* ahead = reinterpret_cast<const char*>(row0 + i * stride + g * group_bytes + kGroupPrefetchBytes);
        for (size_t off = 0; off < group_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        _mm_prefetch(ahead + group_bytes - 1, _MM_HINT_T0);
      }
    group_tile<WT, R, T, false>(row0, stride, g, nb, acts, ngroups, acc);
  }
  if (full < ngroups) group_tile<WT, R, T, true>(row0, stride, full, nb, acts, ngroups, acc);
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
void group_f_tile(const uint8_t* row0, size_t stride, int64_t cols, const float* X, float* y, int64_t ldy) {
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
struct GroupIsa {
  static constexpr bool handles(GgmlType) { return true; }
  static constexpr bool kPrefetchInTile = kGroupPrefetchInTile;
  using Act = ActGroup;
  static constexpr int kActGroup = kGroupBlocks;
  // With VNNI (AVX-512VL: 32 ymm registers) a tile of 8 tokens keeps its accumulators in registers.
  static constexpr int kTokenTile = MA_GROUP_TILES_VNNI ? 8 : 4;
  template <int T>
  static constexpr int q_rows_per_tile() {
    return 1;
  }
  template <int T>
  static constexpr int f_rows_per_tile() {
    return T >= 2 ? 2 : 4;
  }
  static void pack_acts(const block_q16_act* xq, int nb, int n_tok, Act* out) { group_pack_acts(xq, nb, n_tok, out); }
  template <GgmlType WT, int R, int T>
  static void q_tile(const uint8_t* row0, size_t stride, int nb, const Act* acts, int n_groups, float* y, int64_t ldy) {
    group_q_tile<WT, R, T>(row0, stride, nb, acts, n_groups, y, ldy);
  }
  template <GgmlType WT, int R, int T>
  static void f_tile(const uint8_t* row0, size_t stride, int64_t cols, const float* X, float* y, int64_t ldy) {
    group_f_tile<WT, R, T>(row0, stride, cols, X, y, ldy);
  }
};
}  // namespace
