// Internal: the blocking every SIMD matmul shares, written once. Rows are walked in chunks that stay
// cache-resident while every token tile passes over them; a chunk is cut into tiles of R rows x T tokens, and the
// rows of each tile are prefetched ahead of the hardware prefetcher. The ISA supplies the tiles themselves.
//
// Include this only from an ISA translation unit, with an Isa struct in that file's anonymous namespace: every
// function here is a member of TiledMatmul<Isa>, so each instantiation has internal linkage and is compiled with
// that file's -m flags only (an inline function shared by two ISA files could be linked into the wrong one).
//
// Isa provides:
//   handles(t)                           constexpr: whether q_tile handles quantized type t (Q4_0, Q4_1, Q8_0,
//                                        Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); the ISA's matmul sends the others elsewhere
//   Act                                  one token's activations for kActGroup consecutive blocks, packed
//   kActGroup                            blocks per Act
//   kTokenTile                           tokens per packed tile; a power of two: quantized tiles of kTokenTile,
//                                        kTokenTile / 2, ..., 1 tokens
//   q_rows_per_tile<T>(), f_rows_per_tile<T>()   R for a tile of T tokens (quantized / float weights)
//   pack_acts(xq, nb, n_tok, out)        n_tok tokens' blocks into Acts
//   q_tile<WT, R, T>(row0, stride, nb, acts, n_groups, y, ldy)
//   kPrefetchInTile                      true: q_tile prefetches the rows ahead itself, so q_rows issues no burst
//   f_tile<WT, R, T>(row0, stride, cols, X, y, ldy)
// An ISA whose handles() is false for every quantized type (AVX-512's float tiles) needs only handles, Act (any type:
// it only appears in the signatures of the quantized members, never instantiated), f_rows_per_tile and f_tile.
#pragma once
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace metalattn::cpu {

template <class Isa>
struct TiledMatmul {
  static constexpr size_t kRowChunkBytes = 1 << 20;  // weights a thread keeps cache-resident while all tokens pass
  // Software prefetch this far ahead of the rows being read: with the hardware prefetcher alone a streaming
  // matvec reached ~10 GB/s on one core of the dev machine, with 8 KiB ahead ~22 GB/s (its plain read stream: ~30).
  static constexpr size_t kPrefetchBytes = 8192;
  // Into L2 in the AVX-512 build, into L1 in the AVX2 one. On a 2-core EPYC (NOTES, "CPU, session 34") L2 took the
  // AVX-512 decode of Qwen2.5-Coder-0.5B from ~41 to ~65 tok/s and Gemma 3 270M's from ~96-107 to ~109-117 (Q5_0 rows
  // 9-12 -> 20-26 GB/s): prefetches into L1 hold the fill buffers the tiles' own loads wait on. The AVX2 build lost
  // 10% on Gemma 3 with it (its Q5_0 rows slower), so it keeps L1.
#if defined(__AVX512F__)
  static constexpr auto kPrefetchHint = _MM_HINT_T1;
#else
  static constexpr auto kPrefetchHint = _MM_HINT_T0;
#endif
  static constexpr int kFloatTokenTile = 4;

  template <int R>
  static void prefetch_rows(const uint8_t* rows, size_t stride) {
    const uint8_t* ahead = rows + kPrefetchBytes;
    for (size_t off = 0; off < R * stride; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + off), kPrefetchHint);
  }

  static int64_t row_chunk(const WeightView& w) {
    return std::max<int64_t>(8, static_cast<int64_t>(kRowChunkBytes / w.row_stride()) / 8 * 8);
  }

  template <GgmlType WT, int T>
  static void q_rows(const WeightView& w, int64_t r0, int64_t r1, const typename Isa::Act* acts, float* Y,
                     int64_t ldy) {
    constexpr int R = Isa::template q_rows_per_tile<T>();
    const int nb = static_cast<int>(w.cols / kQuantBlock), n_groups = (nb + Isa::kActGroup - 1) / Isa::kActGroup;
    const size_t stride = w.row_stride();
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      if constexpr (!Isa::kPrefetchInTile) prefetch_rows<R>(w.row(r), stride);
      Isa::template q_tile<WT, R, T>(w.row(r), stride, nb, acts, n_groups, Y + r, ldy);
    }
    for (; r < r1; ++r) Isa::template q_tile<WT, 1, T>(w.row(r), stride, nb, acts, n_groups, Y + r, ldy);
  }

  // Runs the tile of the largest power of two T <= Max tokens that fits the `left` tokens; returns T.
  template <int Max, class Run>
  static int run_largest_tile(int left, Run&& run) {
    if constexpr (Max > 1) {
      if (left >= Max) {
        run(std::integral_constant<int, Max>{});
        return Max;
      }
      return run_largest_tile<Max / 2>(left, run);
    } else {
      run(std::integral_constant<int, 1>{});
      return 1;
    }
  }

  template <GgmlType WT>
  static void q_matmul(const WeightView& w, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0,
                       int64_t r1) {
    const int nb = static_cast<int>(w.cols / kQuantBlock), n_groups = (nb + Isa::kActGroup - 1) / Isa::kActGroup;
    thread_local std::vector<typename Isa::Act> packed;
    if (packed.size() < static_cast<size_t>(Isa::kTokenTile * n_groups)) packed.resize(Isa::kTokenTile * n_groups);
    const int64_t chunk = row_chunk(w);
    for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
      const int64_t c1 = std::min(r1, c0 + chunk);
      for (int t0 = 0; t0 < n_tok; t0 += Isa::kTokenTile) {
        const int tt = std::min(Isa::kTokenTile, n_tok - t0);
        Isa::pack_acts(Xq + static_cast<int64_t>(t0) * nb, nb, tt, packed.data());
        for (int t = 0; t < tt;) {
          float* y = Y + (t0 + t) * ldy;
          const typename Isa::Act* a = packed.data() + t * n_groups;
          t += run_largest_tile<Isa::kTokenTile>(
              tt - t, [&](auto tile) { q_rows<WT, decltype(tile)::value>(w, c0, c1, a, y, ldy); });
        }
      }
    }
  }

  template <GgmlType WT, int T>
  static void f_rows(const WeightView& w, int64_t r0, int64_t r1, const float* X, float* Y, int64_t ldy) {
    constexpr int R = Isa::template f_rows_per_tile<T>();
    const size_t stride = w.row_stride();
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      prefetch_rows<R>(w.row(r), stride);
      Isa::template f_tile<WT, R, T>(w.row(r), stride, w.cols, X, Y + r, ldy);
    }
    for (; r < r1; ++r) Isa::template f_tile<WT, 1, T>(w.row(r), stride, w.cols, X, Y + r, ldy);
  }

  // Float weights take tiles of kFloatTokenTile tokens, then single tokens.
  template <GgmlType WT>
  static void f_matmul(const WeightView& w, const float* X, int n_tok, float* Y, int64_t ldy, int64_t r0,
                       int64_t r1) {
    const int64_t chunk = row_chunk(w);
    for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
      const int64_t c1 = std::min(r1, c0 + chunk);
      for (int t = 0; t < n_tok;) {
        const float* x = X + t * w.cols;
        float* y = Y + t * ldy;
        if (n_tok - t >= kFloatTokenTile) {
          f_rows<WT, kFloatTokenTile>(w, c0, c1, x, y, ldy);
          t += kFloatTokenTile;
        } else {
          f_rows<WT, 1>(w, c0, c1, x, y, ldy);
          t += 1;
        }
      }
    }
  }

  static void matmul(const WeightView& w, const float* X, const block_q16_act* Xq, int n_tok, float* Y,
                     int64_t ldy, int64_t r0, int64_t r1) {
    switch (w.type) {
#define MA_QUANT_CASE(T)                                                              \
  case GgmlType::T:                                                                   \
    if constexpr (Isa::handles(GgmlType::T)) return q_matmul<GgmlType::T>(w, Xq, n_tok, Y, ldy, r0, r1); \
    break;
      MA_QUANT_CASE(Q4_0)
      MA_QUANT_CASE(Q4_1)
      MA_QUANT_CASE(Q8_0)
      MA_QUANT_CASE(Q5_0)
      MA_QUANT_CASE(Q5_1)
      MA_QUANT_CASE(Q4_K)
      MA_QUANT_CASE(Q5_K)
      MA_QUANT_CASE(Q6_K)
#undef MA_QUANT_CASE
      default: break;
      case GgmlType::F32: return f_matmul<GgmlType::F32>(w, X, n_tok, Y, ldy, r0, r1);
      case GgmlType::F16: return f_matmul<GgmlType::F16>(w, X, n_tok, Y, ldy, r0, r1);
      case GgmlType::BF16: return f_matmul<GgmlType::BF16>(w, X, n_tok, Y, ldy, r0, r1);
    }
    throw EngineError("matmul: unsupported weight type");
  }
};

}  // namespace metalattn::cpu
