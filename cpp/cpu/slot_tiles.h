// Internal: 8-token tiles for Q4_0, Q4_1 and Q8_0 slot rows, the batched decode's matrices (8 rows a step) and the
// legacy types' prompts. Included by kernels_avx512.cpp (MA_GROUP_TILES_VNNI=1: 512-bit registers, vpdpwssd) inside
// its `groups` namespace and by kernels_avx2.cpp (two 256-bit registers of 4 tokens, vpmaddwd + vpaddd), after
// group_tiles.h and token_tiles.h (it uses their helpers); the tiles are in an anonymous namespace and compiled with
// that file's -m flags only.
//
// Why: the ymm token tiles (token_tiles.h) hold one int16 pair of 8 tokens per register, so each vpdpwssd needs its
// own 32-bit weight broadcast (the load ports bind as much as the dot ports) and does 16 multiply-adds; measured
// ~40-50 GMAC/s a core at 8 tokens, against ~180 that vpdpwssd zmm (2 a cycle here) allows. Here a zmm register holds
// 8 tokens x 2 slots, lane 2t + s = token t's pair k of block 2q + s (two blocks side by side, a block pair q), and
// the weight operand is one 64-bit broadcast of (pair k of block 2q, pair k of block 2q + 1) of a row: 32
// multiply-adds per vpdpwssd, one broadcast load per 32. Each lane accumulates one block of one token, so no lanes
// are folded: after the 16 pairs, int32 lane 2t + s is the exact integer dot of token t with block 2q + s, and the
// float epilogue (one cvt + mul + FMA, + one FMA for the min) serves two blocks of 8 tokens at once.
//
// Exactness and identity with the group tiles (so batch rows equal solo decode bit for bit): a block's integer dot is
// exact (Q4_0's offset of 8 is subtracted when a row is decoded: the same integers as the group tiles' activation-sum
// correction); block b goes into the accumulator of class b % 8 (the group tiles' lane kLaneBlock^-1[b % 8]) as
// fma(float(sum), d_w * d_a, acc), then fma(min, s_a, acc) for Q4_1. Slot s of a block pair holds class 2c + s, so
// the class pairs (0,1) (2,3) (4,5) (6,7) are visited one after the other, each over its block pairs c, c + 4, ...
// in order: every class sees its blocks in the group tiles' order. The classes are
// added in the tree of the group tiles' reduce(): ((c0 + c1) + (c4 + c5)) + ((c2 + c3) + (c6 + c7)).
//
// Slot rows (kernels.h): the matrices are repacked once, at load, so that decoding a row is cheap. A row of nb (even)
// blocks becomes its nb fp16 scales, then (Q4_1) its nb fp16 mins, then per block pair q the quant bytes of blocks 2q
// and 2q + 1 with their 16-bit words interleaved (Q8_0: weights 0..15 of both, then 16..31): the same bytes per row as
// the GGUF row. Decoding a block pair is then one zero / sign extension of 32 bytes to words (+ a mask and a shift for
// the nibbles, whose low / high halves are then pairs 0..7 / 8..15 of both blocks, already in broadcast order), and 16
// scales are one vcvtph2ps. Reading the GGUF rows instead, the decode (scales gathered block by block, nibbles
// permuted into place) took ~40% of the kernel's time at 8 tokens. Rows are decoded once per tile of kSlotRows rows
// into an L1 buffer (a block pair of a row as its 16 broadcast qwords, 128 bytes; its scales as floats) and then meet
// every 8-token tile.

namespace {

constexpr int kSlotTokens = 8;  // tokens per tile (2 slots each: 16 int32 lanes)
// Rows per tile. AVX-512: 8 x 2 independent vpdpwssd chains. AVX2 (16 registers): 2 rows x 2 token registers of int32
// sums and of float accumulators, the two activation registers and the weight broadcast.
constexpr int kSlotRows = MA_GROUP_TILES_VNNI ? 8 : 2;

// 8 tokens' activations for one block pair q.
struct alignas(64) SlotActs {
  int32_t q[16][16];  // [k][2t + s]: int16 pair k (elements 2k, 2k + 1) of token t's block 2q + s
  float d[16];        // [2t + s]: scale of token t's block 2q + s (0 for a padding token)
  float s[16];        // [2t + s]: its d * sum(qs)
};

#if MA_GROUP_TILES_VNNI
// 16 x 16 transpose of 32-bit elements: r[i] element j -> r[j] element i.
MA_INLINE void transpose16_epi32(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + j], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + j
    b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i x1 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i y1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
    r[j] = _mm512_shuffle_i32x4(x0, y0, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + j] = _mm512_shuffle_i32x4(x0, y0, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + j] = _mm512_shuffle_i32x4(x1, y1, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_i32x4(x1, y1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// n <= 8 tokens of xq (nb blocks each, nb even) into out[0 .. nb / 2); lanes of missing tokens are zero.
void slot_pack_acts(const block_q16_act* xq, int nb, int n, SlotActs* out) {
  for (int q = 0; q < nb / 2; ++q) {
    SlotActs& o = out[q];
    __m512i r[16];
    for (int t = 0; t < kSlotTokens; ++t)
      for (int s = 0; s < 2; ++s) {
        const block_q16_act* x = t < n ? xq + static_cast<int64_t>(t) * nb + 2 * q + s : nullptr;
        r[2 * t + s] = x ? _mm512_loadu_si512(x->qs) : _mm512_setzero_si512();
        o.d[2 * t + s] = x ? x->d : 0.f;
        o.s[2 * t + s] = x ? x->s : 0.f;
      }
    transpose16_epi32(r);
    for (int k = 0; k < 16; ++k) _mm512_store_si512(o.q[k], r[k]);
  }
}
#else
// n <= 8 tokens of xq (nb blocks each, nb even) into out[0 .. nb / 2); lanes of missing tokens are zero. Per token,
// its two blocks' pairs are interleaved into 16 qwords (unpack), then copied to their rows.
void slot_pack_acts(const block_q16_act* xq, int nb, int n, SlotActs* out) {
  for (int q = 0; q < nb / 2; ++q) {
    SlotActs& o = out[q];
    uint64_t* rows = reinterpret_cast<uint64_t*>(o.q);  // row k: 8 qwords, qword t = (token t's block 2q, 2q + 1)
    for (int t = 0; t < kSlotTokens; ++t) {
      const block_q16_act* x = t < n ? xq + static_cast<int64_t>(t) * nb + 2 * q : nullptr;
      for (int s = 0; s < 2; ++s) {
        o.d[2 * t + s] = x ? x[s].d : 0.f;
        o.s[2 * t + s] = x ? x[s].s : 0.f;
      }
      if (x == nullptr) {
        for (int k = 0; k < 16; ++k) rows[8 * k + t] = 0;
        continue;
      }
      alignas(32) uint64_t qw[16];  // in the order k = 0 1 4 5, 2 3 6 7, 8 9 12 13, 10 11 14 15
      for (int h = 0; h < 2; ++h) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[0].qs + 16 * h));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[1].qs + 16 * h));
        _mm256_store_si256(reinterpret_cast<__m256i*>(qw + 8 * h), _mm256_unpacklo_epi32(a, b));
        _mm256_store_si256(reinterpret_cast<__m256i*>(qw + 8 * h + 4), _mm256_unpackhi_epi32(a, b));
      }
      constexpr int kOrder[16] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};
      for (int j = 0; j < 16; ++j) rows[8 * kOrder[j] + t] = qw[j];
    }
  }
}
#endif

// ---------------------------------------------------------------- slot rows

// Byte offset of the quant bytes in a slot row of nb blocks (the fp16 scales at 0, the mins of Q4_1 after them).
constexpr size_t slot_quant_offset(GgmlType t, int nb) { return static_cast<size_t>(nb) * (has_min(t) ? 4 : 2); }

// One GGUF row of nb (even) blocks -> its slot row (the same number of bytes).
template <GgmlType WT>
void slot_pack_row(const uint8_t* src, int nb, uint8_t* dst) {
  constexpr size_t bs = block_bytes(WT);
  constexpr int words = WT == GgmlType::Q8_0 ? 16 : 8;  // 16-bit words of quants per block
  uint8_t* qs = dst + slot_quant_offset(WT, nb);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = src + static_cast<size_t>(b) * bs;
    std::memcpy(dst + 2 * b, blk, 2);
    if constexpr (has_min(WT)) std::memcpy(dst + 2 * (nb + b), blk + 2, 2);
    uint8_t* pair = qs + static_cast<size_t>(b / 2) * 4 * words;
    for (int j = 0; j < words; ++j)  // word j of the block -> word 2 (j % 8) + b % 2 of 32-byte half j / 8 of its pair
      std::memcpy(pair + 32 * (j / 8) + 4 * (j % 8) + 2 * (b % 2), blk + legacy_qs_offset(WT) + 2 * j, 2);
  }
}

// A decoded tile of R rows: block pair q of row i is w[(q * R + i) * 64 ..] (16 qwords: pair k of block 2q, pair k
// of block 2q + 1; signed weights, offsets removed); row i's block scales are dw[i * ld + b], its mins dm[i * ld + b].
struct SlotRows {
  int16_t* w;
  float* dw;
  float* dm;
  int ld;  // nb rounded up to 16
};

// Software prefetch of the rows this far ahead (the weights stream from L3 / DRAM every step), one line per block pair
// decoded: a burst of a whole tile's lines at once waited on the fill buffers (half the decode's samples). AVX-512
// prefetches into L2 (its 8-row tiles' decoded rows and activations nearly fill L1: matmul-only harness -6% against
// L1); AVX2 into L1 (L2 measured 0-8% slower there).
constexpr size_t kSlotPrefetchBytes = 8192;
#if MA_GROUP_TILES_VNNI
#define MA_SLOT_PREFETCH(p) _mm_prefetch(p, _MM_HINT_T1)
#else
#define MA_SLOT_PREFETCH(p) _mm_prefetch(p, _MM_HINT_T0)
#endif

template <GgmlType WT, int R>
MA_INLINE void slot_decode_row(const uint8_t* row, size_t stride, int nb, const SlotRows& out, int i) {
  const uint8_t* qs = row + slot_quant_offset(WT, nb);
  const char* ahead = reinterpret_cast<const char*>(row + kSlotPrefetchBytes);
  size_t pf = 0;  // bytes of the row ahead prefetched so far
#if MA_GROUP_TILES_VNNI
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const __mmask16 valid = static_cast<__mmask16>(nb - b0 >= 16 ? 0xFFFF : (1u << (nb - b0)) - 1);
    _mm512_store_ps(out.dw + i * out.ld + b0, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, row + 2 * b0)));
    if constexpr (has_min(WT))
      _mm512_store_ps(out.dm + i * out.ld + b0, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, row + 2 * (nb + b0))));
  }
  for (int q = 0; q < nb / 2; ++q, pf += 64) {
    if (pf < stride) MA_SLOT_PREFETCH(ahead + pf);
    int16_t* w = out.w + (static_cast<size_t>(q) * R + i) * 64;
    __m512i lo, hi;  // qwords k = 0..7 and 8..15: (pair k of block 2q, pair k of block 2q + 1)
    if constexpr (WT == GgmlType::Q8_0) {
      lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * q)));
      hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * q + 32)));
    } else {  // byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble)
      const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * q)));
      lo = _mm512_and_si512(z, _mm512_set1_epi16(0x0F));
      hi = _mm512_srli_epi16(z, 4);
      if constexpr (WT == GgmlType::Q4_0) {
        lo = _mm512_sub_epi16(lo, _mm512_set1_epi16(8));
        hi = _mm512_sub_epi16(hi, _mm512_set1_epi16(8));
      }
    }
    _mm512_store_si512(w, lo);
    _mm512_store_si512(w + 32, hi);
  }
#else
  // 8 scales a load: past the last block the load reads the mins or the quants that follow in the same row, and the
  // values converted from them are never used (nb is even: every pair is whole).
  for (int b0 = 0; b0 < nb; b0 += 8) {
    _mm256_store_ps(out.dw + i * out.ld + b0, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * b0))));
    if constexpr (has_min(WT))
      _mm256_store_ps(out.dm + i * out.ld + b0,
                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * (nb + b0)))));
  }
  for (int q = 0; q < nb / 2; ++q, pf += 64) {
    if (pf < stride) MA_SLOT_PREFETCH(ahead + pf);
    int16_t* w = out.w + (static_cast<size_t>(q) * R + i) * 64;
    auto bytes16 = [&](int off) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + off)); };
    auto store = [&](int at, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(w + at), v); };
    if constexpr (WT == GgmlType::Q8_0) {
      for (int j = 0; j < 4; ++j) store(16 * j, _mm256_cvtepi8_epi16(bytes16(64 * q + 16 * j)));
    } else {
      for (int j = 0; j < 2; ++j) {
        const __m256i z = _mm256_cvtepu8_epi16(bytes16(32 * q + 16 * j));
        __m256i lo = _mm256_and_si256(z, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(z, 4);
        if constexpr (WT == GgmlType::Q4_0) {
          lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(8));
          hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(8));
        }
        store(16 * j, lo);
        store(32 + 16 * j, hi);
      }
    }
  }
#endif
  for (; pf < stride; pf += 64) MA_SLOT_PREFETCH(ahead + pf);  // Q8_0: a row has more lines than pairs
}

#if MA_GROUP_TILES_VNNI
MA_INLINE __m512i bcast_pair(const int16_t* p) {
  return _mm512_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
MA_INLINE __m512 bcast_scales(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_load_sd(reinterpret_cast<const double*>(p))));
}

// R decoded rows x 8 tokens (acts: the tile's nb / 2 block pairs); writes y[t * ldy + i] for t < n_valid.
template <GgmlType WT, int R>
void slot_tile(const SlotRows& rows, int nb, const SlotActs* acts, float* y, int64_t ldy, int n_valid) {
  const int np = nb / 2;
  __m512 cls[4][R];
  for (int c = 0; c < 4; ++c) {  // class pair (2c, 2c + 1): block pairs c, c + 4, ...
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int q = c; q < np; q += 4) {
      const SlotActs& a = acts[q];
      const int16_t* wq = rows.w + static_cast<size_t>(q) * R * 64;
      // Two partial sums per row (even and odd pairs): 2R chains of vpdpwssd (latency 4-5, two a cycle).
      __m512i s0[R], s1[R];
      for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 16; k += 2) {
        const __m512i a0 = _mm512_load_si512(a.q[k]), a1 = _mm512_load_si512(a.q[k + 1]);
        for (int i = 0; i < R; ++i) s0[i] = _mm512_dpwssd_epi32(s0[i], bcast_pair(wq + i * 64 + 4 * k), a0);
        for (int i = 0; i < R; ++i) s1[i] = _mm512_dpwssd_epi32(s1[i], bcast_pair(wq + i * 64 + 4 * k + 4), a1);
      }
      const __m512 ad = _mm512_load_ps(a.d);
      for (int i = 0; i < R; ++i) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[i], s1[i]));
        acc[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(bcast_scales(rows.dw + i * rows.ld + 2 * q), ad), acc[i]);
        if constexpr (has_min(WT))
          acc[i] = _mm512_fmadd_ps(bcast_scales(rows.dm + i * rows.ld + 2 * q), _mm512_load_ps(a.s), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) cls[c][i] = acc[i];
  }
  // The group tiles' reduce(): class pair c plus its neighbouring lane is c_{2c} + c_{2c+1} in lane 2t.
  for (int i = 0; i < R; ++i) {
    __m512 p[4];
    for (int c = 0; c < 4; ++c) p[c] = _mm512_add_ps(cls[c][i], _mm512_permute_ps(cls[c][i], _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512 r = _mm512_add_ps(_mm512_add_ps(p[0], p[2]), _mm512_add_ps(p[1], p[3]));
    alignas(64) float out[16];
    _mm512_store_ps(out, r);
    for (int t = 0; t < n_valid; ++t) y[t * ldy + i] = out[2 * t];
  }
}
#else
// R decoded rows x 8 tokens in two registers of 4 tokens (acts: the tile's nb / 2 block pairs); writes
// y[t * ldy + i] for t < n_valid. The same integers and float operations per (row, token) as the AVX-512 tile.
template <GgmlType WT, int R>
void slot_tile(const SlotRows& rows, int nb, const SlotActs* acts, float* y, int64_t ldy, int n_valid) {
  const int np = nb / 2;
  __m256 cls[4][R][2];
  for (int c = 0; c < 4; ++c) {  // class pair (2c, 2c + 1): block pairs c, c + 4, ...
    __m256 acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int q = c; q < np; q += 4) {
      const SlotActs& a = acts[q];
      const int16_t* wq = rows.w + static_cast<size_t>(q) * R * 64;
      __m256i sum[R][2];
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) {
        __m256i a0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.q[k]));
        __m256i a1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.q[k] + 8));
        asm volatile("" : "+x"(a0), "+x"(a1));  // pair k after pair k - 1 (see tok_tile)
        for (int i = 0; i < R; ++i) {
          const __m256i wv = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wq + i * 64 + 4 * k)));
          const __m256i p0 = _mm256_madd_epi16(wv, a0), p1 = _mm256_madd_epi16(wv, a1);
          sum[i][0] = k == 0 ? p0 : _mm256_add_epi32(sum[i][0], p0);
          sum[i][1] = k == 0 ? p1 : _mm256_add_epi32(sum[i][1], p1);
        }
        for (int i = 0; i < R; ++i) asm volatile("" : "+x"(sum[i][0]), "+x"(sum[i][1]));
      }
      for (int i = 0; i < R; ++i) {
        const __m256 ds = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(rows.dw + i * rows.ld + 2 * q)));
        for (int v = 0; v < 2; ++v) {
          acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][v]), _mm256_mul_ps(ds, _mm256_load_ps(a.d + 8 * v)), acc[i][v]);
          if constexpr (has_min(WT))
            acc[i][v] = _mm256_fmadd_ps(
                _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(rows.dm + i * rows.ld + 2 * q))),
                _mm256_load_ps(a.s + 8 * v), acc[i][v]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < 2; ++v) cls[c][i][v] = acc[i][v];
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 2; ++v) {
      __m256 p[4];
      for (int c = 0; c < 4; ++c) p[c] = _mm256_add_ps(cls[c][i][v], _mm256_permute_ps(cls[c][i][v], _MM_SHUFFLE(2, 3, 0, 1)));
      const __m256 r = _mm256_add_ps(_mm256_add_ps(p[0], p[2]), _mm256_add_ps(p[1], p[3]));
      alignas(32) float out[8];
      _mm256_store_ps(out, r);
      for (int t = 4 * v; t < std::min(n_valid, 4 * v + 4); ++t) y[t * ldy + i] = out[2 * (t - 4 * v)];
    }
}
#endif

template <GgmlType WT, int R>
void slot_rows(const WeightView& w, int64_t r, int nb, const SlotRows& dec, const SlotActs* packed, int n, float* Y,
               int64_t ldy) {
  for (int i = 0; i < R; ++i) slot_decode_row<WT, R>(w.row(r + i), w.row_stride(), nb, dec, i);
  for (int tile = 0; tile * kSlotTokens < n; ++tile)
    slot_tile<WT, R>(dec, nb, packed + static_cast<size_t>(tile) * (nb / 2),
                     Y + static_cast<int64_t>(tile) * kSlotTokens * ldy + r, ldy, std::min(kSlotTokens, n - tile * kSlotTokens));
}

template <GgmlType WT>
void slot_matmul(const WeightView& w, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0, int64_t r1) {
  const int nb = static_cast<int>(w.cols / kQuantBlock), np = nb / 2, ld = (nb + 15) / 16 * 16;
  const size_t tile_bytes = static_cast<size_t>(np) * sizeof(SlotActs);
  const int per_block = std::max<int>(2, static_cast<int>(kTokActBudget / tile_bytes)) * kSlotTokens;
  const int tb = std::min(per_block, (n_tok + kSlotTokens - 1) / kSlotTokens * kSlotTokens);
  struct alignas(64) Line {  // 64-byte aligned storage for the decoded rows (aligned zmm stores)
    uint8_t b[64];
  };
  thread_local std::vector<SlotActs> packed;
  thread_local std::vector<Line> wbuf, sbuf;
  if (packed.size() < static_cast<size_t>(tb / kSlotTokens) * np) packed.resize(static_cast<size_t>(tb / kSlotTokens) * np);
  if (wbuf.size() < static_cast<size_t>(kSlotRows) * np * 2) wbuf.resize(static_cast<size_t>(kSlotRows) * np * 2);
  if (sbuf.size() < 2 * static_cast<size_t>(kSlotRows) * ld / 16) sbuf.resize(2 * static_cast<size_t>(kSlotRows) * ld / 16);
  float* scales = reinterpret_cast<float*>(sbuf.data());
  const SlotRows dec = {reinterpret_cast<int16_t*>(wbuf.data()), scales, scales + static_cast<size_t>(kSlotRows) * ld, ld};
  for (int t0 = 0; t0 < n_tok; t0 += tb) {
    const int n = std::min(tb, n_tok - t0);
    for (int tile = 0; tile * kSlotTokens < n; ++tile)
      slot_pack_acts(Xq + static_cast<int64_t>(t0 + tile * kSlotTokens) * nb, nb,
                     std::min(kSlotTokens, n - tile * kSlotTokens), packed.data() + static_cast<size_t>(tile) * np);
    float* y = Y + static_cast<int64_t>(t0) * ldy;
    int64_t r = r0;
    if (nb <= 32 || kSlotRows < 8)
      for (; r + kSlotRows <= r1; r += kSlotRows) slot_rows<WT, kSlotRows>(w, r, nb, dec, packed.data(), n, y, ldy);
    else  // wide rows: 4-row tiles keep the decoded rows and the activations in L1 (576x1536: 67 -> 80 GMAC/s)
      for (; r + 4 <= r1; r += 4) slot_rows<WT, 4>(w, r, nb, dec, packed.data(), n, y, ldy);
    for (; r < r1; ++r) slot_rows<WT, 1>(w, r, nb, dec, packed.data(), n, y, ldy);
  }
}

}  // namespace

// ---------------------------------------------------------------- entry points (kernels.h: slot rows)

void pack_slot_rows(const WeightView& w, uint8_t* out) {
  const int nb = static_cast<int>(w.cols / kQuantBlock);
  const size_t stride = w.row_stride();
  for (int64_t r = 0; r < w.rows; ++r) {
    switch (w.type) {
      case GgmlType::Q4_0: slot_pack_row<GgmlType::Q4_0>(w.row(r), nb, out + r * stride); break;
      case GgmlType::Q4_1: slot_pack_row<GgmlType::Q4_1>(w.row(r), nb, out + r * stride); break;
      default: slot_pack_row<GgmlType::Q8_0>(w.row(r), nb, out + r * stride); break;
    }
  }
}

void matmul_slot_rows(const WeightView& packed, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0,
                      int64_t r1) {
  switch (packed.type) {
    case GgmlType::Q4_0: return slot_matmul<GgmlType::Q4_0>(packed, Xq, n_tok, Y, ldy, r0, r1);
    case GgmlType::Q4_1: return slot_matmul<GgmlType::Q4_1>(packed, Xq, n_tok, Y, ldy, r0, r1);
    default: return slot_matmul<GgmlType::Q8_0>(packed, Xq, n_tok, Y, ldy, r0, r1);
  }
}
