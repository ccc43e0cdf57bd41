// AVX2 + FMA + F16C kernels: the group tiles of group_tiles.h (vpmaddwd + vpaddd on int16 activations; float
// weights by FMA) for single tokens and short prompts, the token tiles of token_tiles.h for prompts of 8+ tokens
// (the same integers and float operations, so both give identical bits), and the activation quantizer.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels_isa.h"
#include "tiled_matmul.h"

namespace metalattn::cpu::avx2 {
#define MA_GROUP_TILES_VNNI 0
#include "group_tiles.h"
#include "token_tiles.h"

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
  if (tok_matmul_any(w, Xq, n_tok, Y, ldy, r0, r1)) return;  // prompts: tokens in the lanes (token_tiles.h)
  TiledMatmul<GroupIsa>::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
}

}  // namespace metalattn::cpu::avx2
