// AVX2 + FMA + F16C kernels. Quantized weights: one 256-bit vpmaddubsw + vpmaddwd per 32-weight block
// (unsigned weight bytes x signed int8 activations), scales applied in float. Float weights: FMA.
// As in the AVX-512 file, every (row, token) output is the same sequence of operations whatever the tile,
// so matmul equals per-token matvec bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels_isa.h"

namespace metalattn::cpu::avx2 {
namespace {

// One token's activations for one block, laid out as ready 256-bit operands.
struct alignas(32) ActBlock {
  int8_t qs[32];
  float d[8];         // activation scale in every lane
  int32_t bias[8];    // Q4_0: -8 * sum(qs) in lane 0 (removes the unsigned nibble offset exactly)
  float s[8];         // Q4_1: d * sum(qs) in lane 0 (multiplies the block's min)
};

constexpr int kTokenTile = 4;
constexpr size_t kRowChunkBytes = 1 << 20;  // weights a thread keeps cache-resident while all tokens pass over them
constexpr size_t kPrefetchBytes = 8192;       // see kernels_avx512.cpp: the hardware prefetcher alone is too timid

template <int R>
inline void prefetch_rows(const uint8_t* rows, size_t stride) {
  const uint8_t* ahead = rows + kPrefetchBytes;
  for (size_t off = 0; off < R * stride; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
}

constexpr size_t block_size(GgmlType t) {
  return t == GgmlType::Q4_0 ? sizeof(block_q4_0) : t == GgmlType::Q4_1 ? sizeof(block_q4_1) : sizeof(block_q8_0);
}

template <GgmlType WT>
void pack_acts(const block_q8_act* xq, int nb, int n_tok, ActBlock* out) {
  for (int64_t i = 0; i < static_cast<int64_t>(n_tok) * nb; ++i) {
    ActBlock& a = out[i];
    std::memset(&a, 0, sizeof(a));
    std::memcpy(a.qs, xq[i].qs, 32);
    int sum = 0;
    for (int j = 0; j < 32; ++j) sum += xq[i].qs[j];
    for (int j = 0; j < 8; ++j) a.d[j] = xq[i].d;
    a.bias[0] = WT == GgmlType::Q4_0 ? -8 * sum : 0;
    a.s[0] = xq[i].s;
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

struct WeightBlock {
  __m256i q;  // Q4: unsigned nibbles in weight order; Q8_0: signed bytes
  __m256 d;
  __m256 m;   // Q4_1 only
};

template <GgmlType WT>
inline WeightBlock load_block(const uint8_t* b) {
  WeightBlock w;
  w.d = _mm256_set1_ps(half_to_float(b));
  if constexpr (WT == GgmlType::Q8_0) {
    w.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (WT == GgmlType::Q4_1 ? 4 : 2)));
    w.q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
    if constexpr (WT == GgmlType::Q4_1) w.m = _mm256_set1_ps(half_to_float(b + 2));
  }
  return w;
}

// Exact int32 dot products of one weight block with one activation block (8 partial sums).
template <GgmlType WT>
inline __m256i block_dot(const __m256i wq, const __m256i aq, const __m256i bias) {
  __m256i prod16;
  if constexpr (WT == GgmlType::Q8_0) {
    // |w| as unsigned times sign-adjusted activations: |pair sum| <= 2*128*127 fits int16 without saturation.
    prod16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq));
  } else {
    prod16 = _mm256_maddubs_epi16(wq, aq);  // nibbles <= 15: pair sums <= 3810, no saturation
  }
  return _mm256_add_epi32(_mm256_madd_epi16(prod16, _mm256_set1_epi16(1)), bias);
}

inline float reduce(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

template <GgmlType WT, int R, int T>
void q_tile(const uint8_t* row0, size_t stride, int nb, const ActBlock* acts, float* y, int64_t ldy) {
  constexpr size_t bs = block_size(WT);
  __m256 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int k = 0; k < nb; ++k) {
    WeightBlock wb[R];
    for (int i = 0; i < R; ++i) wb[i] = load_block<WT>(row0 + i * stride + k * bs);
    for (int t = 0; t < T; ++t) {
      const ActBlock& a = acts[t * nb + k];
      const __m256i aq = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.qs));
      const __m256i bias = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.bias));
      const __m256 ad = _mm256_load_ps(a.d);
      for (int i = 0; i < R; ++i) {
        const __m256i dot = block_dot<WT>(wb[i].q, aq, bias);
        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(wb[i].d, ad), acc[i][t]);
        if constexpr (WT == GgmlType::Q4_1) acc[i][t] = _mm256_fmadd_ps(wb[i].m, _mm256_load_ps(a.s), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) y[t * ldy + i] = reduce(acc[i][t]);
}

template <GgmlType WT, int T>
void q_rows(const WeightView& w, int64_t r0, int64_t r1, const ActBlock* acts, float* Y, int64_t ldy) {
  constexpr int R = T >= 2 ? 2 : 4;  // keeps accumulators and decoded blocks within 16 registers
  const int nb = static_cast<int>(w.cols / kQuantBlock);
  const size_t stride = w.row_stride();
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    prefetch_rows<R>(w.row(r), stride);
    q_tile<WT, R, T>(w.row(r), stride, nb, acts, Y + r, ldy);
  }
  for (; r < r1; ++r) q_tile<WT, 1, T>(w.row(r), stride, nb, acts, Y + r, ldy);
}

template <GgmlType WT>
void q_matmul(const WeightView& w, const block_q8_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0, int64_t r1) {
  const int nb = static_cast<int>(w.cols / kQuantBlock);
  thread_local std::vector<ActBlock> packed;
  if (packed.size() < static_cast<size_t>(kTokenTile * nb)) packed.resize(kTokenTile * nb);
  const int64_t chunk = std::max<int64_t>(8, static_cast<int64_t>(kRowChunkBytes / w.row_stride()) / 8 * 8);
  for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
    const int64_t c1 = std::min(r1, c0 + chunk);
    for (int t0 = 0; t0 < n_tok; t0 += kTokenTile) {
      const int tt = std::min(kTokenTile, n_tok - t0);
      pack_acts<WT>(Xq + static_cast<int64_t>(t0) * nb, nb, tt, packed.data());
      for (int t = 0; t < tt;) {
        float* y = Y + (t0 + t) * ldy;
        const ActBlock* a = packed.data() + t * nb;
        if (tt - t >= 4) {
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

template <GgmlType WT, int T>
void f_rows(const WeightView& w, int64_t r0, int64_t r1, const float* X, float* Y, int64_t ldy) {
  constexpr int R = T >= 2 ? 2 : 4;
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

}  // namespace

void quantize_acts(const float* x, int64_t n, block_q8_act* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    const __m256 m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
    const float d = hmax(_mm256_max_ps(m01, m23)) / 127.f;
    if (d == 0.f) {
      std::memset(out[b].qs, 0, 32);
      out[b].d = 0.f;
      out[b].s = 0.f;
      continue;
    }
    // Division and round-half-even, as the scalar path: identical bytes on every ISA.
    const __m256 vd = _mm256_set1_ps(d);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], vd));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    // The packs interleave 128-bit lanes; restore element order.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    out[b].d = d;
    out[b].s = d * static_cast<float>(hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                                  _mm256_add_epi32(q[2], q[3]))));
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

}  // namespace metalattn::cpu::avx2
