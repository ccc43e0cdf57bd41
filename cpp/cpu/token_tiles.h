// Internal: many-token tiles (prompts, batches of 8+ rows) for quantized weights, with 8 tokens in the lanes of each
// register. Included after group_tiles.h (it reuses that file's scale decoders and helpers) inside the same ISA
// namespace, by kernels_avx2.cpp (vpmaddwd + vpaddd) and by kernels_avx512.cpp with MA_GROUP_TILES_VNNI=1 (vpdpwssd on
// ymm, which fuses each vpmaddwd + vpaddd with identical int32 results, and 32 registers): everything here is in an
// anonymous namespace and compiled with that file's -m flags only.
//
// Why: the group tiles (group_tiles.h) keep one token's blocks in the lanes, so every (row, token) pays the lane folds
// and an epilogue besides its vpmaddwd + vpaddd: about 13 instructions per 64 multiply-adds on AVX2 (16 ymm registers,
// so their prompt tiles also spill). Here a register holds one int16 pair (elements 2k, 2k + 1 of a block) of 8 tokens;
// the weight pair is broadcast from a row decoded once to int16 (vpbroadcastd from memory is a load-port uop), so a
// block costs 16 vpmaddwd + 15 vpaddd per (row, 8 tokens) plus a 3-4 instruction epilogue: ~9 per 64.
//
// With VNNI a block costs 16 vpdpwssd per (row, 8 tokens) plus the same epilogue, all on the two ports that run it.
//
// Exactness and identity with the group tiles: a block's integer dot is exact (the offsets of Q4_0 / Q5_0 / Q6_K are
// subtracted when a row is decoded, which gives the same integers as the group tiles' activation-sum correction), and
// the float work per (row, token) is the group tiles' own, in their order: block b goes into accumulator b % 8 (the
// group tiles' lane kLaneBlock^-1[b % 8]) as fma(float(sum), d_w * d_a, acc) (Q6_K: two, one per 16-weight half),
// then fma(min, s_a, acc) for the types with a min; the 8 accumulators are added in the tree of the group tiles'
// reduce(). So a prompt's output equals per-token matvec bit for bit (tests/cpp/test_cpu_kernels.cpp checks it).
//
// Blocking: tokens are packed in token blocks whose activations stay in L2 (kTokActBudget); for each token block every
// tile of kTokRows rows is decoded into an L1-sized int16 buffer and then meets all the block's token tiles.

namespace {

// The asm operand constraint for a vector kept in a register: any of the 32 with AVX-512VL, xmm0-15 otherwise.
#if MA_GROUP_TILES_VNNI
#define MA_TOK_REG(v) "+v"(v)
#else
#define MA_TOK_REG(v) "+x"(v)
#endif

constexpr int kTokLanes = 8;                      // tokens per register
constexpr int kTokRows = 4;                       // rows per tile (x 2 token registers: 8 int32 accumulators)
constexpr size_t kTokActBudget = 512 * 1024;      // bytes of packed activations per token block
constexpr int kTokMinTokens = 8;                  // fewer tokens take the group tiles

// One block of 8 tokens' activations.
struct alignas(32) TokActs {
  int32_t q[16][kTokLanes];  // [k][t]: elements 2k, 2k + 1 of token t's block (int16 pair)
  float d[kTokLanes];        // token t's block scale (0 for a padding token)
  float s[kTokLanes];        // token t's d * sum(qs)
};

// 8x8 transpose of 32-bit elements.
MA_INLINE void transpose8_epi32(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
    r[k + 4] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
  }
}

// n <= 8 tokens of xq (nb blocks each) into out[0 .. nb); lanes past n are zero.
void tok_pack_acts(const block_q16_act* xq, int nb, int n, TokActs* out) {
  for (int b = 0; b < nb; ++b) {
    TokActs& o = out[b];
    for (int h = 0; h < 2; ++h) {
      __m256i r[8];
      for (int t = 0; t < kTokLanes; ++t)
        r[t] = t < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[static_cast<int64_t>(t) * nb + b].qs + 16 * h))
                     : _mm256_setzero_si256();
      transpose8_epi32(r);
      for (int k = 0; k < 8; ++k) _mm256_store_si256(reinterpret_cast<__m256i*>(o.q[8 * h + k]), r[k]);
    }
    for (int t = 0; t < kTokLanes; ++t) {
      o.d[t] = t < n ? xq[static_cast<int64_t>(t) * nb + b].d : 0.f;
      o.s[t] = t < n ? xq[static_cast<int64_t>(t) * nb + b].s : 0.f;
    }
  }
}

// ---------------------------------------------------------------- rows decoded to int16

// A decoded row tile: block b of row i is w[(b * R + i) * 32 ..] (signed weights, offsets removed), its scale
// dw[b * R + i] and dx[b * R + i] (the min, with has_min; Q6_K: the scale of weights 16..31).
struct TokRows {
  int16_t* w;
  float* dw;
  float* dx;
};

MA_INLINE void store_words(int16_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

// 16 bytes -> 16 int16 (zero-extended).
MA_INLINE __m256i u8_words(__m128i v) { return _mm256_cvtepu8_epi16(v); }

// Bits 0..15 of `bits` as 16 words of 0x10 (set) or 0 (Q5 fifth bits).
MA_INLINE __m256i bit_words16(int bits) {
  const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        static_cast<short>(0x8000));
  const __m256i v = _mm256_and_si256(_mm256_set1_epi16(static_cast<short>(bits)), sel);
  return _mm256_and_si256(_mm256_cmpeq_epi16(v, sel), _mm256_set1_epi16(0x10));
}

// Per-block scales that group_tiles.h computes in lane order (lane L = block kLaneBlock[L]), back to block order.
MA_INLINE void lanes_to_blocks(__m256 v, float* out, int stride) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int l = 0; l < 8; ++l) out[kLaneBlock[l] * stride] = lanes[l];
}

template <GgmlType WT, int R>
void tok_decode_row(const uint8_t* row, int nb, const TokRows& out, int i) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  if constexpr (is_legacy(WT)) {
    constexpr size_t bs = block_bytes(WT);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* p = row + static_cast<size_t>(b) * bs;
      int16_t* w = out.w + (static_cast<size_t>(b) * R + i) * 32;
      out.dw[b * R + i] = _cvtsh_ss(static_cast<unsigned short>(load_u16(p)));
      if constexpr (has_min(WT)) out.dx[b * R + i] = _cvtsh_ss(static_cast<unsigned short>(load_u16(p + 2)));
      if constexpr (WT == GgmlType::Q8_0) {
        store_words(w, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))));
        store_words(w + 16, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))));
      } else {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + legacy_qs_offset(WT)));
        __m256i lo = u8_words(_mm_and_si128(v, m4)), hi = u8_words(_mm_and_si128(_mm_srli_epi16(v, 4), m4));
        if constexpr (WT == GgmlType::Q5_0 || WT == GgmlType::Q5_1) {
          const int qh = load_i32(p + (WT == GgmlType::Q5_0 ? 2 : 4));
          lo = _mm256_or_si256(lo, bit_words16(qh & 0xFFFF));
          hi = _mm256_or_si256(hi, bit_words16((qh >> 16) & 0xFFFF));
        }
        if constexpr (WT == GgmlType::Q4_0 || WT == GgmlType::Q5_0) {
          const __m256i off = _mm256_set1_epi16(WT == GgmlType::Q4_0 ? 8 : 16);
          lo = _mm256_sub_epi16(lo, off);
          hi = _mm256_sub_epi16(hi, off);
        }
        store_words(w, lo);
        store_words(w + 16, hi);
      }
    }
  } else {
    for (int g = 0; g < nb / kGroupBlocks; ++g) {
      const uint8_t* sb = row + static_cast<size_t>(g) * block_bytes(WT);
      const int b0 = g * kGroupBlocks;
      int16_t* w = out.w + (static_cast<size_t>(b0) * R + i) * 32;
      constexpr size_t wstep = static_cast<size_t>(R) * 32;  // int16 from block b to b + 1 of the same row
      if constexpr (WT == GgmlType::Q6_K) {
        const auto* q = reinterpret_cast<const block_q6_K*>(sb);
        const GroupScales s = q6k_scales(q);
        lanes_to_blocks(s.d, out.dw + b0 * R + i, R);
        lanes_to_blocks(s.d_hi, out.dx + b0 * R + i, R);
        const __m256i m4y = bytes(0x0F), m3 = bytes(3), off = _mm256_set1_epi16(32);
        for (int f = 0; f < 8; ++f) {  // block f = 4h + g6: ql[64h + 32 (g6 & 1) + l], nibble g6 / 2; qh[32h + l] >> 2 g6
          const int h = f / 4, g6 = f % 4;
          const __m256i ql = load256(q->ql + 64 * h + 32 * (g6 & 1)), qh = load256(q->qh + 32 * h);
          const __m256i low = g6 < 2 ? _mm256_and_si256(ql, m4y) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4y);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g6), m3);
          const __m256i v = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));  // bytes < 64: no carry across bytes
          store_words(w + f * wstep, _mm256_sub_epi16(u8_words(_mm256_castsi256_si128(v)), off));
          store_words(w + f * wstep + 16, _mm256_sub_epi16(u8_words(_mm256_extracti128_si256(v, 1)), off));
        }
      } else {
        const GroupScales s = k_scales(sb);
        lanes_to_blocks(s.d, out.dw + b0 * R + i, R);
        lanes_to_blocks(s.m, out.dx + b0 * R + i, R);
        const uint8_t* qs = WT == GgmlType::Q4_K ? reinterpret_cast<const block_q4_K*>(sb)->qs
                                                  : reinterpret_cast<const block_q5_K*>(sb)->qs;
        __m256i qh = _mm256_setzero_si256();
        if constexpr (WT == GgmlType::Q5_K) qh = load256(reinterpret_cast<const block_q5_K*>(sb)->qh);
        for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles of qs[32c ..]) and 2c + 1 (high nibbles)
          const __m256i v = load256(qs + 32 * c);
          __m256i lo = low_nibbles(v), hi = high_nibbles(v);
          if constexpr (WT == GgmlType::Q5_K) {
            const __m256i b_lo = bytes(1 << (2 * c)), b_hi = bytes(1 << (2 * c + 1));
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b_lo), b_lo), bytes(0x10)));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b_hi), b_hi), bytes(0x10)));
          }
          int16_t* w0 = w + (2 * c) * wstep;
          int16_t* w1 = w + (2 * c + 1) * wstep;
          store_words(w0, u8_words(_mm256_castsi256_si128(lo)));
          store_words(w0 + 16, u8_words(_mm256_extracti128_si256(lo, 1)));
          store_words(w1, u8_words(_mm256_castsi256_si128(hi)));
          store_words(w1 + 16, u8_words(_mm256_extracti128_si256(hi, 1)));
        }
      }
    }
  }
}

// ---------------------------------------------------------------- the tile

// R decoded rows x TV token registers (8 TV tokens) over all nb blocks; writes y[t * ldy + i] for t < n_valid.
template <GgmlType WT, int R, int TV>
void tok_tile(const TokRows& rows, int nb, const TokActs* const* acts, float* y, int64_t ldy, int n_valid) {
  constexpr int kChains = MA_GROUP_TILES_VNNI ? (TV == 1 ? 4 : 2) : 1;  // partial sums per (row, token register)
  // Block-class accumulators (b % 8): the group tiles' lanes. With VNNI the blocks of a class are visited in order,
  // one class after the other, so each class's float sequence is the group tiles' own while its accumulators stay in
  // registers (AVX-512 prompts: gate/up -13% at 64 tokens); on AVX2 (16 registers) the blocks go in order and each
  // updates its class in memory, as before (class order measured no faster there). Both give the same bits.
  // On AVX2 the class accumulators live on the stack; they are not zeroed first: a class's first block (b < 8)
  // adds its first product to a zero register instead (the same fma, so the same bits), and only classes with no
  // block at all (nb < 8) are zeroed. Zeroing all 8 x R x TV of them before each tile cost ~9% of the tile's
  // samples (the stores met a store buffer full of the previous tile's y stores).
  constexpr bool kByClass = MA_GROUP_TILES_VNNI;
  __m256 cls[8][R][TV];
  if constexpr (!kByClass)
    for (int c = nb; c < 8; ++c)
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < TV; ++v) cls[c][i][v] = _mm256_setzero_ps();
  for (int c = 0; c < (kByClass ? 8 : 1); ++c) {
  __m256 by_class[R][TV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < TV; ++v) by_class[i][v] = _mm256_setzero_ps();
  auto block = [&](int b, auto first_const) __attribute__((always_inline)) {
    constexpr bool kFirst = !kByClass && decltype(first_const)::value;  // b < 8: the class starts at zero
    __m256 (&acc)[R][TV] = kByClass ? by_class : cls[b & 7];
    const int16_t* wb = rows.w + static_cast<size_t>(b) * R * 32;
    const TokActs* ab[TV];
    for (int v = 0; v < TV; ++v) ab[v] = acts[v] + b;
    // Integer dot over pairs [k0, k1) into sum. Pair k of every row and token register; the first pair of a run
    // starts the sums (no zeroing, no branch). With VNNI each vpdpwssd waits for the previous one into the same
    // accumulator (latency 4-5 cycles, two issued per cycle), so pairs go round kChains partial sums, added at the end
    // (integer adds: the order cannot change the result).
    auto pair = [&](int k, bool first, __m256i (&sum)[R][TV]) __attribute__((always_inline)) {
      __m256i a[TV];
      for (int v = 0; v < TV; ++v) {
        a[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(ab[v]->q[k]));
        // Keeps pair k after pair k - 1 (the empty asm statements stay in order): GCC otherwise hoists all 16
        // pairs' products ahead of their adds and spills them to the stack.
        asm volatile("" : MA_TOK_REG(a[v]));
      }
      for (int i = 0; i < R; ++i) {
        const __m256i wv = _mm256_set1_epi32(load_i32(reinterpret_cast<const uint8_t*>(wb + i * 32 + 2 * k)));
        for (int v = 0; v < TV; ++v) {
#if MA_GROUP_TILES_VNNI
          sum[i][v] = first ? _mm256_madd_epi16(wv, a[v]) : _mm256_dpwssd_epi32(sum[i][v], wv, a[v]);
#else
          const __m256i p = _mm256_madd_epi16(wv, a[v]);
          sum[i][v] = first ? p : _mm256_add_epi32(sum[i][v], p);
#endif
        }
      }
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < TV; ++v) asm volatile("" : MA_TOK_REG(sum[i][v]));
    };
    auto dot = [&](auto k0_const, auto k1_const, __m256i (&sum)[R][TV]) __attribute__((always_inline)) {
      constexpr int k0 = decltype(k0_const)::value, k1 = decltype(k1_const)::value;
      __m256i part[kChains][R][TV];
#pragma GCC unroll 16
      for (int k = k0; k < k1; ++k) pair(k, k < k0 + kChains, part[(k - k0) % kChains]);
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < TV; ++v) {
          sum[i][v] = part[0][i][v];
          for (int ch = 1; ch < kChains; ++ch) sum[i][v] = _mm256_add_epi32(sum[i][v], part[ch][i][v]);
        }
    };
    using K0 = std::integral_constant<int, 0>;
    using K8 = std::integral_constant<int, 8>;
    using K16 = std::integral_constant<int, 16>;
    auto apply = [&](const __m256i (&sum)[R][TV], const float* scale, auto zero_const)
                     __attribute__((always_inline)) {
      for (int i = 0; i < R; ++i) {
        const __m256 ds = _mm256_broadcast_ss(scale + b * R + i);
        for (int v = 0; v < TV; ++v)
          acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][v]), _mm256_mul_ps(ds, _mm256_load_ps(ab[v]->d)),
                                      decltype(zero_const)::value ? _mm256_setzero_ps() : acc[i][v]);
      }
    };
    using First = std::integral_constant<bool, kFirst>;
    using Later = std::false_type;
    __m256i sum[R][TV];
    if constexpr (WT == GgmlType::Q6_K) {
      dot(K0{}, K8{}, sum);
      apply(sum, rows.dw, First{});
      dot(K8{}, K16{}, sum);
      apply(sum, rows.dx, Later{});
    } else {
      dot(K0{}, K16{}, sum);
      apply(sum, rows.dw, First{});
      if constexpr (has_min(WT)) {
        for (int i = 0; i < R; ++i) {
          const __m256 m = _mm256_broadcast_ss(rows.dx + b * R + i);
          for (int v = 0; v < TV; ++v) acc[i][v] = _mm256_fmadd_ps(m, _mm256_load_ps(ab[v]->s), acc[i][v]);
        }
      }
    }
  };
  if constexpr (kByClass) {
    for (int b = c; b < nb; b += 8) block(b, std::false_type{});
  } else {
    const int b8 = std::min(nb, 8);
    for (int b = 0; b < b8; ++b) block(b, std::true_type{});
    for (int b = 8; b < nb; ++b) block(b, std::false_type{});
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < TV; ++v)
      if constexpr (kByClass) cls[c][i][v] = by_class[i][v];
  }
  // The group tiles' reduce(): lanes (0,4) (2,6) (1,5) (3,7) hold classes (0,1) (4,5) (2,3) (6,7).
  for (int v = 0; v < TV; ++v) {
    __m256 r[R];
    for (int i = 0; i < R; ++i) {
      const __m256 q0 = _mm256_add_ps(cls[0][i][v], cls[1][i][v]), q1 = _mm256_add_ps(cls[2][i][v], cls[3][i][v]);
      const __m256 q2 = _mm256_add_ps(cls[4][i][v], cls[5][i][v]), q3 = _mm256_add_ps(cls[6][i][v], cls[7][i][v]);
      r[i] = _mm256_add_ps(_mm256_add_ps(q0, q2), _mm256_add_ps(q1, q3));
    }
    const int n = std::min(kTokLanes, n_valid - kTokLanes * v);
    float* yv = y + static_cast<int64_t>(kTokLanes) * v * ldy;
    if constexpr (R == 4) {
      if (n == kTokLanes) {  // 4 rows x 8 tokens -> each token's 4 consecutive outputs in one store
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 u[4] = {
            _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2))),
            _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2))),
            _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3))),
            _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3)))};
        for (int t = 0; t < 4; ++t) {  // u[t]: token t in the low half, token t + 4 in the high half
          _mm_storeu_ps(yv + t * ldy, _mm256_castps256_ps128(u[t]));
          _mm_storeu_ps(yv + (t + 4) * ldy, _mm256_extractf128_ps(u[t], 1));
        }
        continue;
      }
    }
    for (int i = 0; i < R; ++i) {
      alignas(32) float out[8];
      _mm256_store_ps(out, r[i]);
      for (int t = 0; t < n; ++t) yv[t * ldy + i] = out[t];
    }
  }
}

// ---------------------------------------------------------------- a prompt projection

// Software prefetch this far ahead of the rows being decoded, as TiledMatmul does (tiled_matmul.h): with few tokens
// a row tile's decode waits on its weights otherwise (8-row batches: the weights stream from DRAM every step).
constexpr size_t kTokPrefetchBytes = 8192;

template <GgmlType WT, int R>
void tok_rows(const WeightView& w, int64_t r, int nb, const TokRows& dec, const TokActs* packed, int n, float* Y,
              int64_t ldy) {
  const size_t stride = w.row_stride();
  const uint8_t* ahead = w.row(r) + kTokPrefetchBytes;
  for (size_t off = 0; off < R * stride; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
  for (int i = 0; i < R; ++i) tok_decode_row<WT, R>(w.row(r + i), nb, dec, i);
  const int tiles = (n + kTokLanes - 1) / kTokLanes;
  int tile = 0;
  for (; tile + 2 <= tiles; tile += 2) {
    const TokActs* a[2] = {packed + static_cast<size_t>(tile) * nb, packed + static_cast<size_t>(tile + 1) * nb};
    tok_tile<WT, R, 2>(dec, nb, a, Y + static_cast<int64_t>(tile) * kTokLanes * ldy + r, ldy, n - tile * kTokLanes);
  }
  if (tile < tiles) {
    const TokActs* a[1] = {packed + static_cast<size_t>(tile) * nb};
    tok_tile<WT, R, 1>(dec, nb, a, Y + static_cast<int64_t>(tile) * kTokLanes * ldy + r, ldy, n - tile * kTokLanes);
  }
}

template <GgmlType WT>
void tok_matmul(const WeightView& w, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0, int64_t r1) {
  const int nb = static_cast<int>(w.cols / kQuantBlock);
  const size_t tok_bytes = static_cast<size_t>(nb) * sizeof(TokActs) / kTokLanes;
  const int per_block = std::max<int>(2 * kTokLanes, static_cast<int>(kTokActBudget / tok_bytes) / (2 * kTokLanes) * (2 * kTokLanes));
  const int tb = std::min(per_block, (n_tok + kTokLanes - 1) / kTokLanes * kTokLanes);
  thread_local std::vector<TokActs> packed;
  thread_local std::vector<int16_t> wbuf;
  thread_local std::vector<float> sbuf;
  if (packed.size() < static_cast<size_t>(tb / kTokLanes) * nb) packed.resize(static_cast<size_t>(tb / kTokLanes) * nb);
  if (wbuf.size() < static_cast<size_t>(kTokRows) * nb * 32) wbuf.resize(static_cast<size_t>(kTokRows) * nb * 32);
  if (sbuf.size() < 2 * static_cast<size_t>(kTokRows) * nb) sbuf.resize(2 * static_cast<size_t>(kTokRows) * nb);
  const TokRows dec = {wbuf.data(), sbuf.data(), sbuf.data() + static_cast<size_t>(kTokRows) * nb};
  for (int t0 = 0; t0 < n_tok; t0 += tb) {
    const int n = std::min(tb, n_tok - t0);
    for (int tile = 0; tile * kTokLanes < n; ++tile)
      tok_pack_acts(Xq + static_cast<int64_t>(t0 + tile * kTokLanes) * nb, nb,
                    std::min(kTokLanes, n - tile * kTokLanes), packed.data() + static_cast<size_t>(tile) * nb);
    float* y = Y + static_cast<int64_t>(t0) * ldy;
    int64_t r = r0;
    for (; r + kTokRows <= r1; r += kTokRows) tok_rows<WT, kTokRows>(w, r, nb, dec, packed.data(), n, y, ldy);
    for (; r < r1; ++r) tok_rows<WT, 1>(w, r, nb, dec, packed.data(), n, y, ldy);
  }
}

// The prompt path for a quantized type, or false if the group tiles should take it.
bool tok_matmul_any(const WeightView& w, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0,
                    int64_t r1) {
  if (n_tok < kTokMinTokens) return false;
  switch (w.type) {
#define MA_TOK_CASE(T) \
  case GgmlType::T: tok_matmul<GgmlType::T>(w, Xq, n_tok, Y, ldy, r0, r1); return true;
    MA_TOK_CASE(Q4_0)
    MA_TOK_CASE(Q4_1)
    MA_TOK_CASE(Q8_0)
    MA_TOK_CASE(Q5_0)
    MA_TOK_CASE(Q5_1)
    MA_TOK_CASE(Q4_K)
    MA_TOK_CASE(Q5_K)
    MA_TOK_CASE(Q6_K)
#undef MA_TOK_CASE
    default: return false;
  }
}

}  // namespace
