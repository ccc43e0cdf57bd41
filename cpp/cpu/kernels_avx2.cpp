// AVX2 + FMA + F16C kernels: the group tiles of group_tiles.h (vpmaddwd + vpaddd on int16 activations; float
// weights by FMA) for single tokens and short prompts, the token tiles of token_tiles.h for prompts of 8+ tokens
// (the same integers and float operations, so both give identical bits), and the activation quantizer.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels_isa.h"
#include "reference.h"
#include "tiled_matmul.h"

namespace metalattn::cpu::avx2 {
#define MA_GROUP_TILES_VNNI 0
#include "group_tiles.h"
#include "token_tiles.h"
namespace slots {
#include "slot_tiles.h"
}  // namespace slots

void pack_slot_rows(const WeightView& w, uint8_t* out) { slots::pack_slot_rows(w, out); }
void matmul_slot_rows(const WeightView& packed, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0,
                      int64_t r1) {
  slots::matmul_slot_rows(packed, Xq, n_tok, Y, ldy, r0, r1);
}

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

// ---------------------------------------------------------------- lane rows (kernels.h): Q4_0 single-token matvec
// A row's partial last group of t < 8 blocks is stored compactly after its full groups: 4 chunks of t 32-bit words
// (chunk c, word j: quant bytes 4c .. 4c + 3 of block j), then the t fp16 scales; a masked load and a lane permute
// put block j in lane L with kLaneBlock[L] = j, the missing blocks' lanes zero, so it runs the full groups' code.
// With t = 1, 2 or 4 (SmolLM2's 576 columns leave 2, Gemma's 640 and Qwen's 896 leave 4) the 16t quant bytes are
// instead read as they lie, 8 words a register (word i: chunk i / t of block i % t), against activations packed in
// the same order; the block sums are then gathered from lanes i % t by two or three adds (compact_tail).

namespace {

constexpr size_t kLaneGroupBytes = kGroupBlocks * sizeof(block_q4_0);  // 144: 16 bytes of scales + 4 x 32 of quants

// One token's activations for one full group of lane rows. Chunk c of a group holds quant bytes 4c .. 4c + 3 of each
// block, i.e. (words of a 32-bit lane) weights 4c, 4c + 2 (low nibbles of the low bytes: operand 0), 4c + 1, 4c + 3
// (operand 1), 4c + 16, 4c + 18 (high nibbles: operand 2), 4c + 17, 4c + 19 (operand 3); qs[c][k] holds the matching
// activation pairs, lane L for block kLaneBlock[L].
struct alignas(32) LaneAct {
  int16_t qs[4][4][16];
  float d[8];         // lane L: the activation scale of block kLaneBlock[L]
  int32_t neg8[8];    // lane L: -8 * sum(qs) of block kLaneBlock[L] (Q4_0 stores q + 8)
};

int lane_full_groups(int64_t cols) { return static_cast<int>(cols / kQuantBlock / kGroupBlocks); }
int lane_tail_blocks(int64_t cols) { return static_cast<int>(cols / kQuantBlock % kGroupBlocks); }
constexpr int kBlockLane[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // the lane of block j: kLaneBlock[kBlockLane[j]] == j

// The T scales of a partial group, block j's in lane kBlockLane[j].
template <int T, int J = 0>
MA_INLINE __m128i tail_scales(const uint8_t* p, __m128i h) {
  if constexpr (J == T) {
    return h;
  } else {
    return tail_scales<T, J + 1>(p, _mm_insert_epi16(h, load_u16(p + 2 * J), kBlockLane[J]));
  }
}

constexpr bool compact_tail(int t) { return t == 1 || t == 2 || t == 4; }

// The group's contribution: exactly group_epilogue<Q4_0>'s float operations on the same integer block sums.
// T = 8: a full group (scales, then chunks of 32 bytes); T < 8: a partial group stored compactly (see above).
template <int T>
MA_INLINE void lane_group(const uint8_t* g, const LaneAct& a, __m256& acc) {
  const __m256i m = words(0x000F);
  __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.neg8));
  __m256i s16 = _mm256_setzero_si256(), s256 = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    if constexpr (compact_tail(T)) {
      if (c > 0) break;
      // 16T bytes: one register (T = 2), two (T = 4) or half of one (T = 1, the upper half zero).
      __m256i t = _mm256_setzero_si256();
      for (int r = 0; r < (T == 4 ? 2 : 1); ++r) {
        const __m256i v = T == 1 ? _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(g)), 0)
                                 : load256(g + 32 * r);
        auto act = [&](int k) __attribute__((always_inline)) {
          return _mm256_load_si256(reinterpret_cast<const __m256i*>(a.qs[r][k]));
        };
        const __m256i p01 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, m), act(0)),
                                             _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), m), act(1)));
        const __m256i p23 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m), act(2)),
                                             _mm256_madd_epi16(_mm256_srli_epi16(v, 12), act(3)));
        t = _mm256_add_epi32(t, _mm256_add_epi32(p01, p23));
      }
      // Lane i holds a partial sum of block i % T: fold to lanes 0 .. T - 1, then move block j to kBlockLane[j].
      t = _mm256_add_epi32(t, _mm256_permute2x128_si256(t, t, 0x01));
      if constexpr (T <= 2) t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
      if constexpr (T == 1) t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
      const __m256i present = _mm256_cmpgt_epi32(_mm256_set1_epi32(T), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
      s = _mm256_add_epi32(
          s, _mm256_and_si256(_mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)), present));
      continue;
    }
    __m256i v;
    if constexpr (T == 8) {
      v = load256(g + 16 + 32 * c);
    } else {
      const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(T), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      v = _mm256_permutevar8x32_epi32(_mm256_maskload_epi32(reinterpret_cast<const int*>(g + 4 * T * c), first),
                                      _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    }
    auto act = [&](int k) __attribute__((always_inline)) {
      return _mm256_load_si256(reinterpret_cast<const __m256i*>(a.qs[c][k]));
    };
    // Weights in place: nibble 0 (x1) and 3 (shifted down); nibbles 1 (x16) and 2 (x256) masked only, their sums
    // are exact multiples of 16 / 256 (< 2^30 over a group), divided out once per group.
    s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, m), act(0)),
                                             _mm256_madd_epi16(_mm256_srli_epi16(v, 12), act(3))));
    s16 = _mm256_add_epi32(s16, _mm256_madd_epi16(_mm256_and_si256(v, words(0x00F0)), act(2)));
    s256 = _mm256_add_epi32(s256, _mm256_madd_epi16(_mm256_and_si256(v, words(0x0F00)), act(1)));
  }
  if constexpr (!compact_tail(T)) {
    s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_srai_epi32(s16, 4), _mm256_srai_epi32(s256, 8)));
  }
  __m128i h;
  if constexpr (T == 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  } else {
    h = tail_scales<T>(g + 16 * T, _mm_setzero_si128());
  }
  const __m256 d = _mm256_cvtph_ps(h);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_load_ps(a.d)), acc);
}

}  // namespace

void pack_lane_rows(const WeightView& w, uint8_t* out) {
  const int full = lane_full_groups(w.cols);
  const size_t stride = w.row_stride();
  for (int64_t r = 0; r < w.rows; ++r) {
    const uint8_t* src = w.row(r);
    uint8_t* dst = out + r * stride;
    for (int g = 0; g < full; ++g) {
      uint8_t* o = dst + g * kLaneGroupBytes;
      for (int lane = 0; lane < kGroupBlocks; ++lane) {
        const auto* b = reinterpret_cast<const block_q4_0*>(src) + kGroupBlocks * g + kLaneBlock[lane];
        std::memcpy(o + 2 * lane, &b->d, 2);
        for (int c = 0; c < 4; ++c) std::memcpy(o + 16 + 32 * c + 4 * lane, b->qs + 4 * c, 4);
      }
    }
    const int tail = lane_tail_blocks(w.cols);
    const auto* tb = reinterpret_cast<const block_q4_0*>(src) + kGroupBlocks * full;
    uint8_t* o = dst + full * kLaneGroupBytes;
    for (int j = 0; j < tail; ++j) {
      for (int c = 0; c < 4; ++c) std::memcpy(o + 4 * tail * c + 4 * j, tb[j].qs + 4 * c, 4);
      std::memcpy(o + 16 * tail + 2 * j, &tb[j].d, 2);
    }
  }
}

size_t lane_acts_bytes(int64_t cols) {
  return (lane_full_groups(cols) + (lane_tail_blocks(cols) ? 1 : 0)) * sizeof(LaneAct);
}

void pack_lane_acts(const block_q16_act* xq, int64_t cols, void* out) {
  const int full = lane_full_groups(cols), tail = lane_tail_blocks(cols);
  LaneAct* acts = static_cast<LaneAct*>(out);
  // Words [0, 2, 1, 3, 4, 6, 5, 7] of 8: 32-bit lanes (a0, a2), (a1, a3), (a4, a6), (a5, a7).
  const __m128i pairs = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  const __m128i ones = _mm_set1_epi16(1);
  const int groups = full + (tail ? 1 : 0);
  for (int g = 0; g < groups; ++g) {
    LaneAct& a = acts[g];
    if (g == full) std::memset(&a, 0, sizeof(a));  // the partial group: missing blocks add 0 with scale 0
    if (g == full && compact_tail(tail)) {
      for (int i = 0; i < 4 * tail; ++i) {  // word i: chunk c = i / tail of block j = i % tail
        const int c = i / tail, j = i % tail;
        const int16_t* q = xq[kGroupBlocks * g + j].qs;
        const int lo[4] = {4 * c, 4 * c + 1, 4 * c + 16, 4 * c + 17};
        for (int k = 0; k < 4; ++k) {
          a.qs[i / 8][k][2 * (i % 8)] = q[lo[k]];
          a.qs[i / 8][k][2 * (i % 8) + 1] = q[lo[k] + 2];
        }
      }
    }
    for (int lane = 0; lane < kGroupBlocks; ++lane) {
      if (g == full && kLaneBlock[lane] >= tail) continue;
      const block_q16_act& b = xq[kGroupBlocks * g + kLaneBlock[lane]];
      __m128i sum = _mm_setzero_si128();
      for (int h = 0; h < 4; ++h) {  // elements 8h .. 8h + 7: chunks c0, c0 + 1 of operands k0, k0 + 1
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 8 * h));
        sum = _mm_add_epi32(sum, _mm_madd_epi16(x, ones));
        if (g == full && compact_tail(tail)) continue;  // packed above
        const __m128i p = _mm_shuffle_epi8(x, pairs);
        const int c0 = (h & 1) * 2, k0 = (h >> 1) * 2;
        int32_t dw[4];
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dw), p);
        std::memcpy(&a.qs[c0][k0][2 * lane], &dw[0], 4);
        std::memcpy(&a.qs[c0][k0 + 1][2 * lane], &dw[1], 4);
        std::memcpy(&a.qs[c0 + 1][k0][2 * lane], &dw[2], 4);
        std::memcpy(&a.qs[c0 + 1][k0 + 1][2 * lane], &dw[3], 4);
      }
      sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
      sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1)));
      a.d[lane] = b.d;
      a.neg8[lane] = -8 * _mm_cvtsi128_si32(sum);
    }
  }
}

template <int Tail>
void lane_rows(const WeightView& packed, const LaneAct* acts, float* y, int64_t r0, int64_t r1) {
  const int full = lane_full_groups(packed.cols);
  const size_t stride = packed.row_stride();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = packed.row(r);
    TiledMatmul<GroupIsa>::prefetch_rows<1>(row, stride);
    __m256 acc = _mm256_setzero_ps();
    for (int g = 0; g < full; ++g) lane_group<8>(row + g * kLaneGroupBytes, acts[g], acc);
    if constexpr (Tail > 0) lane_group<Tail>(row + full * kLaneGroupBytes, acts[full], acc);
    y[r] = reduce(acc);
  }
}

void matvec_lane_rows(const WeightView& packed, const void* acts_v, float* y, int64_t r0, int64_t r1) {
  const LaneAct* acts = static_cast<const LaneAct*>(acts_v);
  switch (lane_tail_blocks(packed.cols)) {
    case 0: return lane_rows<0>(packed, acts, y, r0, r1);
    case 1: return lane_rows<1>(packed, acts, y, r0, r1);
    case 2: return lane_rows<2>(packed, acts, y, r0, r1);
    case 3: return lane_rows<3>(packed, acts, y, r0, r1);
    case 4: return lane_rows<4>(packed, acts, y, r0, r1);
    case 5: return lane_rows<5>(packed, acts, y, r0, r1);
    case 6: return lane_rows<6>(packed, acts, y, r0, r1);
    default: return lane_rows<7>(packed, acts, y, r0, r1);
  }
}

// The backend's other vector loops (vec_ops.h), in this file's ISA: 8-float vectors, one AVX2 register.
#include "vec_ops.h"
METALATTN_VEC_OPS_ENTRY_POINTS(v8f)

}  // namespace metalattn::cpu::avx2
