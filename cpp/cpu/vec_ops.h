// The CPU backend's vector loops outside the matvec kernels: exp, the gated activations, the argmax of the logits
// and the attention of a GQA group. Plain loops the compiler vectorises, or GCC vector types, written once and
// compiled once per ISA: this file is included inside namespace avx2 (kernels_avx2.cpp), avx512
// (kernels_avx512.cpp) and scalar (kernels.cpp), each compiled with its own -m flags, and kernels.cpp dispatches
// by the backend's ISA as it does the matvec kernels, so METALATTN_CPU_ISA=avx2 runs AVX2 code everywhere, also on
// an AVX-512 CPU. Every body is always inlined into its ISA's entry point.
// No include guard, and no includes: the including file includes <algorithm>, <cmath>, <cstring>, kernels.h and
// reference.h first (and <immintrin.h> where it compiles with F16C or AVX-512).

// exp(x), branch-free so loops over it vectorise: 2^t = 2^round(t) * 2^f with |f| <= 1/2 and a degree-6 Taylor
// polynomial for 2^f (relative error ~1e-7). Inputs are clamped to [-87, 88], where float exp is normal: t = x log2(e)
// is clamped to [fl(-87 log2 e), fl(88 log2 e)], which gives the same t as clamping x first (rounding is monotonic)
// and NaN passes through as before. Clamping x first (std::min / std::max) let GCC thread the clamp's branches into
// the multiply, which then "could trap" under -ftrapping-math: the AVX2 build of every loop over fast_exp (softmax,
// GLU) stayed scalar, where the AVX-512 one vectorised with masks.
__attribute__((always_inline)) inline float fast_exp(float x) {
  constexpr float kLog2e = 1.44269504f, kLo = -87.f * kLog2e, kHi = 88.f * kLog2e;
  float t = x * kLog2e;
  t = t < kLo ? kLo : t;
  t = kHi < t ? kHi : t;
  const float r = std::nearbyint(t);
  const float f = (t - r) * 0.693147181f;
  const float p =
      1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(r) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

#define METALATTN_BODY __attribute__((always_inline)) inline

// gate[i] = act(gate[i]) * up[i], the input of the down projection: SiLU (Llama, Qwen) or the tanh form of GELU
// (Gemma), tanh(u) written as 1 - 2 / (exp(2u) + 1) so the loop vectorises.
METALATTN_BODY void swiglu_body(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.f + fast_exp(-gate[i])) * up[i];
}

METALATTN_BODY void geglu_body(float* gate, const float* up, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float u = kSqrt2OverPi * g * (1.f + kCubic * g * g);
    const float t = 1.f - 2.f / (fast_exp(2.f * u) + 1.f);
    gate[i] = 0.5f * g * (1.f + t) * up[i];
  }
}

METALATTN_BODY void glu_body(bool gelu, float* g, const float* u, int64_t n) {
  gelu ? geglu_body(g, u, n) : swiglu_body(g, u, n);
}
METALATTN_BODY float exp_shifted_sum(float* x, int n, float shift) {
  float lanes[16] = {0};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      x[i + j] = fast_exp(x[i + j] - shift);
      lanes[j] += x[i + j];
    }
  float s = 0.f;
  for (; i < n; ++i) {
    x[i] = fast_exp(x[i] - shift);
    s += x[i];
  }
  for (int j = 0; j < 16; ++j) s += lanes[j];
  return s;
}

// The largest of x[0 .. n) (n >= 1), in vectors of V then the rest: max is exact, so the order does not change it
// (a scalar chain of maxss ran 4 cycles a position, 17% of the AVX2 prompt attention's samples).
template <class V>
METALATTN_BODY float row_max(const float* x, int n) {
  constexpr int W = sizeof(V) / sizeof(float);
  V m;
  for (int j = 0; j < W; ++j) m[j] = -INFINITY;
  int i = 0;
  for (; i + W <= n; i += W) {
    V v;
    std::memcpy(&v, x + i, sizeof(v));
    m = m < v ? v : m;
  }
  float r = -INFINITY;
  for (; i < n; ++i) r = r < x[i] ? x[i] : r;
  for (int j = 0; j < W; ++j) r = r < m[j] ? m[j] : r;
  return r;
}

// ref::argmax (the first index of the largest non-NaN logit; every logit NaN throws NonFiniteLogits), vectorised in one
// pass: each lane of V keeps its largest value and the first index holding it (a strict compare: NaN never wins, and
// a later equal value does not move the index), then the lanes' winners give the largest and the lowest index among
// equal ones. When no logit passes -inf (every one NaN or -inf) ref finds the first -inf or throws. (Two passes, the
// index found by testing 16 floats for equality at a time, took 0.39 ms for 262,144 logits in the AVX2 build, this
// form 0.03; AVX-512 0.10 -> 0.015.)
template <class V>
METALATTN_BODY ArgmaxResult argmax_body(const float* x, int n) {
  constexpr int W = sizeof(V) / sizeof(float);
  using VI = decltype(V{} > V{});  // the int32 vector of V's comparisons
  V best;
  VI at, lane;
  for (int j = 0; j < W; ++j) {
    best[j] = -INFINITY;
    at[j] = -1;
    lane[j] = j;
  }
  int i = 0;
  for (; i + W <= n; i += W) {
    V v;
    std::memcpy(&v, x + i, sizeof(v));
    const VI gt = v > best;
    best = gt ? v : best;
    at = gt ? lane + i : at;
  }
  float m = -INFINITY;
  int k = -1;
  for (int j = 0; j < W; ++j)
    if (at[j] >= 0 && (best[j] > m || (best[j] == m && at[j] < k))) {
      m = best[j];
      k = at[j];
    }
  for (; i < n; ++i)
    if (x[i] > m) {
      m = x[i];
      k = i;
    }
  if (k < 0) return ref::argmax(x, n);
  return {static_cast<uint32_t>(k), m};
}

// Sampling weights (engine/sampling.cpp): w[i] = exp((x[i] - m) * inv_t), 0 where x[i] is NaN or -inf; returns their
// sum (float lanes over blocks of 1,024 weights, the blocks' sums added in double). Two plain loops: the exp of every
// logit masked by the logit's bits, then the sum. Fused into one loop, or with a select (float compare or not) in
// place of the mask, the AVX2 build kept it scalar (0.57-0.67 ms for 262,144 weights against ~0.1).
METALATTN_BODY float weight_or_zero(float v, float e) {  // NaN and -inf weigh nothing
  uint32_t b, eb;
  std::memcpy(&b, &v, sizeof b);
  std::memcpy(&eb, &e, sizeof eb);
  eb &= 0u - static_cast<uint32_t>(((b & 0x7fffffffu) <= 0x7f800000u) & (b != 0xff800000u));
  std::memcpy(&e, &eb, sizeof e);
  return e;
}
METALATTN_BODY double exp_weights_body(const float* x, int64_t n, float m, float inv_t, float* w) {
  for (int64_t i = 0; i < n; ++i) w[i] = weight_or_zero(x[i], fast_exp((x[i] - m) * inv_t));
  constexpr int64_t kBlock = 1024;
  double s = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t end = n - i0 < kBlock ? n : i0 + kBlock;
    float lanes[16] = {0};
    int64_t i = i0;
    for (; i + 16 <= end; i += 16)
      for (int j = 0; j < 16; ++j) lanes[j] += w[i + j];
    float b = 0.f;
    for (; i < end; ++i) b += w[i];
    for (int j = 0; j < 16; ++j) b += lanes[j];
    s += b;
  }
  return s;
}

// Attention for the G query heads that share one KV head (a GQA group) and T consecutive query tokens (token t
// sees positions [0, n_pos0 + t)), written with GCC vector types (16 floats: one AVX-512 register, two AVX2 ones)
// so the G x T accumulators stay in registers and every K and V load serves all of them.
// K and V are cached as IEEE fp16 (the backend rounds each value once, float_to_fp16_rne, as it appends it; the loads
// here widen them exactly, load_half_v): half the bytes the attention streams at depth. Everything else is float.
// The K cache of a KV head is stored transposed in blocks of 16 positions (k_cap / 16 blocks of head_dim x 16
// halves: 2 KiB for head_dim 64): scores of 16 positions accumulate in one vector per (token, head) over head_dim,
// with no horizontal sums, and 16 positions' keys share one page (a plain transpose put every dim row on its own).
// Scores are written for whole blocks, so each scores row holds k_cap floats. V stays row-major: each 16-value slice
// of a position's row is loaded once and added into every (token, head) output. Positions a token must not see
// (the later tokens of its own tile, whose K/V are already in the cache) get probability 0. k_cap: positions the
// head's K holds, a multiple of 16.
// q: token t, head h at q + t * q_stride + h * head_dim; out likewise with out_stride; scores: G*T rows of scratch
// (stride scores_stride). head_dim must be a multiple of 16 (checked at construction). With a sliding window
// (window > 0) token t sees only the last `window` positions up to its own; `scale` multiplies q.k.
// The vector type V is one register: 16 floats for AVX-512 (and the scalar build, which splits it), 8 for AVX2. A
// wider type than the ISA's registers made GCC keep the accumulators on the stack (the AVX2 build of the 16-float
// version: 354 stack vector moves in the decode kernel, against 80 for AVX-512; 17% slower decode, 37% slower pp512).
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
// The helpers below pass vectors by value; they are always inlined into the per-ISA wrappers, so GCC's note that
// such a signature's ABI differs with and without AVX-512 does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

template <class V>
__attribute__((always_inline)) inline V load_v(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <class V>
__attribute__((always_inline)) inline void store_v(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }

// One vector of the fp16 K/V cache as floats (the conversion is exact, so every ISA reads the same values): AVX-512
// vcvtph2ps of 16 halves, F16C's of 8 (AVX2), else fp16_to_float one value at a time (the scalar build).
template <class V>
__attribute__((always_inline)) inline V load_half_v(const uint16_t* p) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return (V)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
#if defined(__F16C__)
  if constexpr (sizeof(V) == 32) return (V)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  V v;
  for (int j = 0; j < static_cast<int>(sizeof(V) / sizeof(float)); ++j) v[j] = fp16_to_float(p[j]);
  return v;
}

// Scores of T tokens x G heads for the cache positions [from, to): whole 16-position blocks from from's block on
// (also past `to` inside the last block, while the block lies inside k_cap: those scores are never used, and every
// score then comes from the same vector code whatever the tile or split, so a prompt matches token-by-token decode),
// then single positions. Token t, head h's scores at scores + (t * G + h) * scores_stride + position.
template <int G, int T, class V>
METALATTN_BODY void attend_scores(const float* q, int q_stride, const uint16_t* k_t, int k_cap, int from, int to,
                                  int head_dim, float scale, float* scores, int scores_stride) {
  constexpr int W = sizeof(V) / sizeof(float);  // 16, or 8: a 16-position block in two halves
  const int start = from / 16 * 16;
  int full = (to + 15) / 16 * 16;
  if (full > k_cap) full -= 16;
  // A single token on AVX2 takes both halves of a block in one pass over head_dim: each q element loaded once for
  // two vectors of keys (the loop was bound by its loads: three broadcasts and a widening a three FMAs). Every score
  // still sums over j in the same order, so the values do not change.
  constexpr int NH = T == 1 ? 16 / W : 1;  // vectors of a block a pass
  for (int t0 = start; t0 < full; t0 += 16)
    for (int w0 = 0; w0 < 16; w0 += NH * W) {
      V acc[T][G][NH] = {};
      const uint16_t* kb = k_t + static_cast<int64_t>(t0) * head_dim + w0;  // block t0 / 16: head_dim x 16 halves
      for (int j = 0; j < head_dim; ++j) {
        V kr[NH];
        for (int k = 0; k < NH; ++k) kr[k] = load_half_v<V>(kb + 16 * j + k * W);
        for (int t = 0; t < T; ++t)
          for (int h = 0; h < G; ++h) {
            const float qv = q[t * q_stride + h * head_dim + j];
            for (int k = 0; k < NH; ++k) acc[t][h][k] += qv * kr[k];
          }
      }
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < G; ++h)
          for (int k = 0; k < NH; ++k)
            store_v<V>(scores + (t * G + h) * scores_stride + t0 + w0 + k * W, acc[t][h][k] * scale);
    }
  for (int p = std::max(full, start); p < to; ++p)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < G; ++h) {
        float sum = 0.f;
        for (int j = 0; j < head_dim; ++j)
          sum += q[t * q_stride + h * head_dim + j] *
                 fp16_to_float(k_t[static_cast<int64_t>(p / 16) * 16 * head_dim + 16 * j + p % 16]);
        scores[(t * G + h) * scores_stride + p] = sum * scale;
      }
}

// out (token t, head h at out + t * out_stride + h * head_dim) = sum over positions [from, to) of the weights in
// scores (as attend_scores lays them out) times the V rows, NC vectors of columns per pass over the rows: each loaded
// slice of a row is added into every (token, head) output. Each output adds the positions in the same order whatever
// NC, so the values do not depend on it.
template <int G, int T, int NC, class V>
METALATTN_BODY void attend_values_cols(const uint16_t* v, int v_stride, const float* scores, int scores_stride,
                                       int from, int to, int head_dim, float* out, int out_stride) {
  constexpr int W = sizeof(V) / sizeof(float);
  for (int c = 0; c < head_dim; c += NC * W) {
    V acc[T][G][NC] = {};
    for (int p = from; p < to; ++p) {
      const uint16_t* row = v + static_cast<int64_t>(p) * v_stride + c;
      for (int k = 0; k < NC; ++k) {
        const V vr = load_half_v<V>(row + k * W);
        for (int t = 0; t < T; ++t)
          for (int h = 0; h < G; ++h) acc[t][h][k] += scores[(t * G + h) * scores_stride + p] * vr;
      }
    }
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < G; ++h)
        for (int k = 0; k < NC; ++k) store_v<V>(out + t * out_stride + h * head_dim + c + k * W, acc[t][h][k]);
  }
}

// A single token (decode) takes as many column vectors a pass as keep its G x NC accumulators within a budget of
// vector registers (16 of AVX-512's 32, 12 of AVX2's 16): SmolLM2's 64-wide heads (G 3) in one pass over the V rows on
// AVX-512 instead of four, two on AVX2 instead of eight. A prompt tile's T x G accumulators take one vector a pass.
// AVX2's budget was 8 (four passes for G 3): 12 took SmolLM2 at depth 4,000 from 7.5-8.1 to 6.2-6.7 ms a token
// (session 19, NOTES); the score broadcasts and the widening of each fp16 V row are then done half as often.
template <int G, int T, class V>
METALATTN_BODY void attend_values(const uint16_t* v, int v_stride, const float* scores, int scores_stride, int from,
                                  int to, int head_dim, float* out, int out_stride) {
  constexpr int W = sizeof(V) / sizeof(float), kBudget = W == 16 ? 16 : 12;
  constexpr int kNc = T > 1 ? 1 : kBudget / G >= 8 ? 8 : kBudget / G >= 4 ? 4 : kBudget / G >= 2 ? 2 : 1;
  const int cols = head_dim / W;
  if constexpr (kNc >= 8) {
    if (cols % 8 == 0)
      return attend_values_cols<G, T, 8, V>(v, v_stride, scores, scores_stride, from, to, head_dim, out, out_stride);
  }
  if constexpr (kNc >= 4) {
    if (cols % 4 == 0)
      return attend_values_cols<G, T, 4, V>(v, v_stride, scores, scores_stride, from, to, head_dim, out, out_stride);
  }
  if constexpr (kNc >= 2) {
    if (cols % 2 == 0)
      return attend_values_cols<G, T, 2, V>(v, v_stride, scores, scores_stride, from, to, head_dim, out, out_stride);
  }
  attend_values_cols<G, T, 1, V>(v, v_stride, scores, scores_stride, from, to, head_dim, out, out_stride);
}

// Attention of T tokens over one piece of the cache, positions [from, to) (the backend cuts the context into
// pieces of kAttentionPiece positions: attention_fold merges them, the same way on every path). Token t sees
// [lo_t, n_pos0 + t) with lo_t = 0, or with a sliding window (window > 0) the last `window` positions up to its own.
// Per (token t, head h): out (at out + t * out_stride + h * head_dim) gets the unnormalized sum of e^(s - m) V over
// what the token sees of the piece, ml[2 (t G + h)] the largest score m and ml[2 (t G + h) + 1] the sum of e^(s - m)
// (-inf and 0, with out 0, when it sees none of it). Positions a token must not see (the later tokens of its own
// tile, whose K/V are already in the cache) get weight 0. The values of one (token, head) do not depend on T: decode
// (T = 1) and a prompt's tiles compute them alike.
template <int G, int T, class V>
METALATTN_BODY void attend_piece(const float* q, int q_stride, const uint16_t* k_t, int k_cap, const uint16_t* v,
                                 int v_stride, int n_pos0, int window, int from, int to, int head_dim, float scale,
                                 float* scores, int scores_stride, float* out, int out_stride, float* ml) {
  const int lo0 = window > 0 ? std::max(0, n_pos0 - window) : 0;
  const int begin = std::max(from, lo0), end = std::min(to, n_pos0 + T - 1);  // what any token of the tile sees
  const int start = begin / 16 * 16;
  if (begin < end) attend_scores<G, T, V>(q, q_stride, k_t, k_cap, begin, end, head_dim, scale, scores, scores_stride);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < G; ++h) {
      float* sc = scores + (t * G + h) * scores_stride;
      const int n = n_pos0 + t;
      const int a = std::max(begin, window > 0 ? std::max(0, n - window) : 0), b = std::min(end, n);
      float* m = ml + 2 * (t * G + h);
      if (a < b) {
        m[0] = row_max<V>(sc + a, b - a);
        m[1] = exp_shifted_sum(sc + a, b - a, m[0]);
      } else {
        m[0] = -INFINITY;
        m[1] = 0.f;
      }
      for (int p = start; p < std::min(a, end); ++p) sc[p] = 0.f;
      for (int p = std::max(b, start); p < end; ++p) sc[p] = 0.f;
    }
  if (begin < end) {
    attend_values<G, T, V>(v, v_stride, scores, scores_stride, start, end, head_dim, out, out_stride);
  } else {
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < G; ++h) std::fill_n(out + t * out_stride + h * head_dim, head_dim, 0.f);
  }
}

// Address-taken instantiations of attend_piece (compiled with the including file's ISA flags) and the pair the
// backend calls for a GQA group of `group` query heads.
template <int G, int T, class V>
void attend(const float* q, int q_stride, const uint16_t* k_t, int k_cap, const uint16_t* v, int v_stride,
            int n_pos0, int window, int from, int to, int head_dim, float scale, float* scores, int scores_stride,
            float* out, int out_stride, float* ml) {
  attend_piece<G, T, V>(q, q_stride, k_t, k_cap, v, v_stride, n_pos0, window, from, to, head_dim, scale, scores,
                        scores_stride, out, out_stride, ml);
}
template <class V>
AttendFns attend_fns_with(int group) {
  switch (group) {
    case 1: return {attend<1, 1, V>, attend<1, kQueryTile, V>};
    case 2: return {attend<2, 1, V>, attend<2, kQueryTile, V>};
    case 3: return {attend<3, 1, V>, attend<3, kQueryTile, V>};
    case 4: return {attend<4, 1, V>, attend<4, kQueryTile, V>};
    case 5: return {attend<5, 1, V>, attend<5, kQueryTile, V>};
    case 6: return {attend<6, 1, V>, attend<6, kQueryTile, V>};
    case 7: return {attend<7, 1, V>, attend<7, kQueryTile, V>};
    case 8: return {attend<8, 1, V>, attend<8, kQueryTile, V>};
  }
  throw EngineError("cpu backend: 1 to 8 query heads per KV head are supported");
}

// The entry points each ISA's file defines from the bodies above (declared in kernels_isa.h).
#define METALATTN_VEC_OPS_ENTRY_POINTS(VEC)                                                          \
  void glu(bool gelu, float* g, const float* u, int64_t n) { glu_body(gelu, g, u, n); }             \
  ArgmaxResult argmax(const float* x, int n) { return argmax_body<VEC>(x, n); }                     \
  double exp_weights(const float* x, int64_t n, float m, float inv_t, float* w) {                   \
    return exp_weights_body(x, n, m, inv_t, w);                                                     \
  }                                                                                                 \
  AttendFns attend_fns(int group) { return attend_fns_with<VEC>(group); }
