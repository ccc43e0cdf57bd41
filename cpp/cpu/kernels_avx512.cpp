// AVX-512 (F/BW/VL/DQ + VNNI) kernels. Quantized weights take the tiles of the AVX2 kernels with vpdpwssd on ymm
// registers (group_tiles.h below 8 tokens, token_tiles.h from 8 on; int16 activations, exact integer block dots, then
// the scales in float); float weights FMA on float activations in zmm registers here, as does quantize_acts.
//
// Numerics are independent of tiling: every (row, token) output is the same sequence of operations whatever the
// tile, so matmul equals per-token matvec bit for bit. (Until session 35 Q5_0 / Q5_1 had their own 512-bit tiles of
// four blocks, a float step every four blocks of every row and token: their prompts ran at 165-208 GOP/s where the
// token tiles run at 317-345, and the tests hold prompts to decode's numerics; NOTES, "CPU, session 35".)
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

// The fixed reduction tree of a row's 16 partial sums: h[i] = v[i] + v[i+8], q[i] = h[i] + h[i+4],
// p[i] = q[i] + q[i+2], sum = p[0] + p[1].
inline float reduce(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
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

// What TiledMatmul (tiled_matmul.h) needs from a float-only ISA (the quantized types take the group and token tiles
// below): handles() false for every quantized type, so none of the quantized members is instantiated; Act only names
// the type in their signatures.
struct Isa {
  static constexpr bool handles(GgmlType) { return false; }
  using Act = void;
  template <int T>
  static constexpr int f_rows_per_tile() {
    return 4;
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

// Every quantized type: the tiles of the AVX2 kernels with vpdpwssd on ymm registers, the group tiles
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
  if (!is_quantized(w.type)) return TiledMatmul<Isa>::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
  if (groups::tok_matmul_any(w, Xq, n_tok, Y, ldy, r0, r1)) return;
  TiledMatmul<groups::GroupIsa>::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
}

// The backend's other vector loops (vec_ops.h), in this file's ISA: 16-float vectors, one AVX-512 register.
#include "vec_ops.h"
METALATTN_VEC_OPS_ENTRY_POINTS(v16f)

}  // namespace metalattn::cpu::avx512
