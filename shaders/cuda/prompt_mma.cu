// Few-token prompt projections on tensor cores: Y = W . X for prompts of up to kPromptMmaMaxTokens tokens, read
// straight from the quantized decode weights (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and the wide int8 layout
// of mixed stacks), each launched with programmatic dependent launch.
//
// Why: a 32-token prompt through the long-prompt path cost ~48 us per layer (measured on cuBLAS GEMMs), most of it
// four GEMM launches that the programmatic chain cannot overlap. Here a layer is five of our own kernels (norm+QKV,
// attention, O+residual, norm+gate/up+SiLU, down+residual), each loading its weights into registers before it waits
// for its predecessor.
//
// Geometry: a block of 16 warps owns tpb 16-row tiles of W (one MMA m16 tile each) for all tokens, tpb the fewest that
// keep the grid in one wave (row_tiles_per_block); each warp computes one tile, and KS = 16 / tpb warps of a tile split
// the 32-column weight blocks of K (warp w: tile w % tpb, blocks w / tpb + j * KS; the 16 - tpb * KS warps left over
// only stage X) and sum their partial tiles through shared memory at the end. Every block stages the whole activation
// matrix X (m tokens x K) in shared memory once (in chunks of kMmaChunkCols columns where 32 tokens of it do not fit,
// as at SmolLM2-1.7B's widths). One block fills an SM (X's shared memory), and the kernel is bound by the latency of
// each warp's chain of loads, dequantization and MMAs, not by bytes (ncu: the L2 at 1.7-2.5 TB/s; benchmarks/NOTES.md,
// session 17): more warps a block and weight loads ahead of their MMAs are what made it faster (session 29).
//
// Numerics: the weights enter the MMA exactly (integer quants as fp16, the per-block scale d applied in fp32 after
// the block's MMAs, the Q4_1 minimum m times the block's activation sum); an activation travels as fp16 hi + lo
// (two MMAs), so products keep ~22 bits and accumulation is fp32, as in the decode kernels.
//
// The weight side (each type's A fragments, the fragment map, the scales applied after the MMAs) is mma_weights.cuh,
// shared with the long-prompt GEMM (prompt_gemm.cu).
//
// Shared layout of X (the "slot" layout, also the global layout of the activations the attention and the gate/up
// projection hand on, kernels.cuh): token rows of K/4 16-byte slots; slot s holds elements 4s..4s+3 as
// [hi x4 | lo x4] halves, so one 16-byte load gives a thread both B fragments (hi and lo) of a step. An rmsnorm'ed
// input (QKV, gate/up) is staged as fp32 in the same 16-byte slots and turned into [hi | lo] of x * norm_w as the
// fragment is loaded; each lane also sums the squares it sees, and 1/rms per token is applied to the outputs (the
// projection is linear). Shared rows are padded by 64 bytes so that the eight lanes of a quarter-warp (2 tokens x 4
// slots) hit distinct banks.
#include <algorithm>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "mma_weights.cuh"

namespace metalattn::cuda {

namespace {

using namespace mma;  // the weight blocks (mma_weights.cuh)

// Warps per block: 16, each computing one row tile (~86 registers a thread, so 16 warps fit the register file, and
// one block per SM is all that X's shared memory allows). The kernels are bound by latency at one block per SM (ncu,
// benchmarks/NOTES.md, session 17), so every warp the SM can hold counts. (Two tiles a warp at 8 warps, ~172
// registers, was the wide projections' form until session 29: faster at one token tile on the 1.7B, slower from 16
// tokens on.)
constexpr int kMmaWarps = 16;
constexpr int kMmaTileRows = 16;
constexpr int kMmaMaxTiles = kPromptMmaMaxTokens / 8;  // n-tiles of 8 tokens

// [hi x4 | lo x4] of four floats.
__device__ __forceinline__ uint4 split_slot(float4 v) {
  const __half2 h01 = __floats2half2_rn(v.x, v.y), h23 = __floats2half2_rn(v.z, v.w);
  const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
  uint4 s;
  s.x = *reinterpret_cast<const uint32_t*>(&h01);
  s.y = *reinterpret_cast<const uint32_t*>(&h23);
  s.z = pack_half2(v.x - f01.x, v.y - f01.y);
  s.w = pack_half2(v.z - f23.x, v.w - f23.y);
  return s;
}

__device__ __forceinline__ float slot_sum(uint4 s) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&s.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&s.y));
  const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&s.z));
  const float2 d = __half22float2(*reinterpret_cast<const __half2*>(&s.w));
  return ((a.x + c.x) + (a.y + c.y)) + ((b.x + d.x) + (b.y + d.y));
}

// Slots per token row in shared memory (K/4 plus 4 slots = 64 bytes of padding).
__host__ __device__ inline int slot_stride(int K) { return K / 4 + 4; }

// K is staged in chunks of kMmaChunkCols columns where the whole of X does not fit in kMmaSmemCap (SmolLM2-1.7B:
// K 2048 and 8192 at 32 tokens): 8 * kMmaPrefetch blocks, which holds every block the KS warps splitting a tile's K
// load before the wait (mma_prefetch caps them to fit).
constexpr int kMmaChunkCols = 8 * kMmaPrefetch * 32;
// Weight blocks each of up to W warps splitting a tile's K loads before the programmatic wait: the type's own depth,
// fewer where W warps would take them past the first chunk.
template <typename WB, int W>
constexpr int mma_prefetch() {
  return WB::kPrefetch < kMmaChunkCols / 32 / W ? WB::kPrefetch : kMmaChunkCols / 32 / W;
}
constexpr int kMmaSmemCap = 227 * 1024;  // the H100's opt-in shared memory per block

// Shared memory of one block: X (8 * n_tiles token rows of 16-byte slots: fp32 quads for an rmsnorm'ed input, [hi|lo]
// slots otherwise) and the norm weights, both of one chunk of K, each warp's partial sums of squares per token and
// 1/rms per token (normed input). The cross-warp reduction reuses X's space.
struct MmaSmem {
  int chunk_cols, x_bytes, norm_off, ss_off, rms_off, total;
  __host__ __device__ MmaSmem(int K, int n_tiles) {
    layout(K, n_tiles);
    if (total > kMmaSmemCap && K > kMmaChunkCols) layout(kMmaChunkCols, n_tiles);
  }
  __host__ __device__ void layout(int cols, int n_tiles) {
    const int rows = 8 * n_tiles;
    chunk_cols = cols;
    x_bytes = rows * slot_stride(cols) * 16;
    const int red_bytes = kMmaWarps * kMmaTileRows * (rows + 1) * 4;
    norm_off = x_bytes > red_bytes ? x_bytes : red_bytes;
    ss_off = norm_off + cols * 4;
    rms_off = ss_off + kMmaWarps * rows * 4;
    total = rms_off + rows * 4;
  }
};

// Copies X into shared memory, one 16-byte slot (4 values) per cp.async, token rows past n zeroed; ends with
// __syncthreads. An rmsnorm'ed input stays fp32 here: at one tile a block the MMA loop scales it by the norm weights
// and splits it into [hi | lo] as it loads each fragment (each value is read by exactly one lane, so converting there
// costs no more than a separate pass, and saves that pass's barrier and shared-memory round trip); where tpb tiles
// share a block each value is read by tpb lanes, and the kernel converts it once in place after staging (convert_x).
// Each warp copies whole token rows, so there is no per-element index arithmetic. The arguments are copied into
// registers first: cp.async's memory clobber would otherwise make the compiler reload them from the parameter space in
// every iteration (measured: +30% instructions in the down projection). One chunk: the columns [col0, col0 + cols) of K
// (chunk_cols wide in shared memory; the last chunk may be narrower), and with norm_s set (a later chunk of a normed
// input) the chunk's norm weights too.
template <bool kNormed, int W>
__device__ void stage_x(const PromptMmaArgs& a, int K, int chunk_cols, int col0, int cols, int n_rows, uint4* x_s,
                        float* norm_s = nullptr) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slots = cols / 4, stride = slot_stride(chunk_cols), n = a.n;
  const float* const x = a.x;
  const __half* const x_slots = a.x_slots;
  for (int t = warp; t < n_rows; t += W)
    for (int s = lane; s < slots; s += 32) {
      uint4* dst = &x_s[t * stride + s];
      if (t >= n) *dst = make_uint4(0u, 0u, 0u, 0u);
      else if constexpr (kNormed) detail::cp_async16(dst, x + static_cast<int64_t>(t) * K + col0 + 4 * s);
      else detail::cp_async16(dst, x_slots + static_cast<int64_t>(t) * 2 * K + 2 * col0 + 8 * s);
    }
  if (kNormed && norm_s != nullptr) {
    const float* const norm_w = a.norm_w;
    for (int i = threadIdx.x; i < slots; i += 32 * W) detail::cp_async16(norm_s + 4 * i, norm_w + col0 + 4 * i);
  }
  detail::cp_async_wait_all();
  __syncthreads();  // also publishes the norm weights, copied by other threads
}

// W row of tile row r (0..15) of row tile `tile`: rows tile*16 + r, or for the gate/up SiLU output, gate rows
// 8*tile + r (r < 8) and the matching up rows d_ff + 8*tile + r - 8; -1 past the matrix.
__device__ __forceinline__ int tile_row(const PromptMmaArgs& a, int tile, int r) {
  if (a.out_kind == PromptMmaOut::SiluHalf) {
    const int j = 8 * tile + (r & 7);
    return j < a.d_ff ? (r < 8 ? j : a.d_ff + j) : -1;
  }
  const int row = tile * kMmaTileRows + r;
  return row < a.W.rows ? row : -1;
}

// tpb row tiles per block (more than one where the tiles outnumber the SMs: fewer blocks, and with them less of the
// redundant staging of X, as every block converts the whole X); kMaxKS: 16 where tpb is 1, else 8 (at most that many
// warps split a tile's K: it sets how many weight blocks a warp can load before the wait). kNormed: the input is fp32
// rows to rmsnorm (a.x), else slot rows (a.x_slots). NT: token tiles of 8 (n <= 8 * NT). Both are template parameters
// so that the MMA loop has no runtime tests: with a runtime token-tile count ptxas turned each tile's fragment load and
// MMAs into a branch of its own, recomputing the shared-memory address every time (SASS: 1,400 instructions in the slot
// kernel's loop against 650). That and the argument reloads stage_x now avoids made the first version of this kernel
// slower than its predecessor (H100 pp1 0.57 -> 0.77 ms); with both fixed, pp1 is 0.43 ms.
template <typename WB, int kMaxKS, bool kNormed, int NT>
__global__ void __launch_bounds__(32 * kMmaWarps, 1) prompt_mma_kernel(const PromptMmaArgs a, const int tpb_arg) {
  constexpr int W = kMmaWarps, kThreads = 32 * W;
  // One tile a block is a compile-time geometry (its instantiation has kMaxKS == W), so that its index arithmetic
  // folds as when tpb was a template parameter (the all-runtime form measured SmolLM2-135M's pp32 +14%, session 30).
  const int tpb = kMaxKS == W ? 1 : tpb_arg;
  const int KS = W / tpb;  // warps that split one tile's K (<= kMaxKS)
  // A normed X that several tiles share is scaled by the norm weights and split into [hi | lo] once per block, in
  // place in shared memory (convert_x), rather than by each of the tpb warps reading it inside the MMA loop.
  constexpr bool kConvert = kNormed && kMaxKS < W;
  constexpr bool kLoopNorm = kNormed && !kConvert;
  extern __shared__ __align__(16) unsigned char mma_smem[];
  const int K = a.W.cols, nb = a.W.nb;
  constexpr int n_tiles = NT, n_rows = 8 * NT;
  const MmaSmem lay(K, n_tiles);
  uint4* x_s = reinterpret_cast<uint4*>(mma_smem);
  // After the MMA loop: [ks][tpb * 16 rows][n_rows + 1]; the odd row stride keeps the epilogue's reads, 16 or 32
  // consecutive rows of one token, on distinct banks.
  float* red = reinterpret_cast<float*>(mma_smem);
  const int red_ld = n_rows + 1;
  float* norm_s = reinterpret_cast<float*>(mma_smem + lay.norm_off);
  float* ss_s = reinterpret_cast<float*>(mma_smem + lay.ss_off);  // [warp][token]; kConvert: [token]
  float* rms_s = reinterpret_cast<float*>(mma_smem + lay.rms_off);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  // Warp w computes tile w % tpb of the block's tpb tiles over the weight blocks w / tpb, + KS, + 2 KS, ...; the
  // warps past tpb * KS have no blocks.
  const int my_tile = warp % tpb, ks = warp / tpb;
  const int rows[2] = {tile_row(a, blockIdx.x * tpb + my_tile, g), tile_row(a, blockIdx.x * tpb + my_tile, g + 8)};
  // Loads this warp's j-th weight block of its tile (-1 rows past the matrix), as the weight loaders take them.
  auto load_block = [&](int j, WB& w) {
    const int blk = ks + j * KS;
    const int64_t b[2] = {rows[0] >= 0 ? static_cast<int64_t>(rows[0]) * nb + blk : -1,
                          rows[1] >= 0 ? static_cast<int64_t>(rows[1]) * nb + blk : -1};
    w.load(a.W, b, c);
  };

  // Before the wait: this warp's first weight blocks, and the norm weights (neither depends on earlier kernels).
  detail::launch_dependents();
  const int my_blocks = ks < KS ? (nb - ks + KS - 1) / KS : 0;
  constexpr int kPre = mma_prefetch<WB, kMaxKS>();
  WB pre[kPre];
#pragma unroll
  for (int j = 0; j < kPre; ++j)
    if (j < my_blocks) load_block(j, pre[j]);
  const int Kc = lay.chunk_cols, chunk_blocks = Kc / 32;  // K itself unless X must be staged in chunks
  if constexpr (kNormed) {
    const float* const norm_w = a.norm_w;  // in a register: see stage_x
    for (int i = threadIdx.x; i < Kc / 4; i += kThreads) detail::cp_async16(norm_s + 4 * i, norm_w + 4 * i);
  }
  detail::grid_dependency_wait();
  // The weight blocks past the prefetched ones go kAhead ahead of the MMAs that use them, the first now, while X is
  // staged and the prefetched blocks are multiplied: the type's own depth (WB::kAhead, mma_weights.cuh) where the
  // loop holds no norm state (slot inputs and converted X), one where it does (the one-tile normed instantiations are
  // at the 128-register limit of 16 warps already).
  constexpr int kAhead = kLoopNorm ? 1 : WB::kAhead;
  WB cur, nxt;
  if (kPre < my_blocks) load_block(kPre, cur);
  if (kAhead > 1 && kPre + 1 < my_blocks) load_block(kPre + 1, nxt);

  static_assert(W * (kMmaMaxTiles / 2) == 8 * kMmaMaxTiles, "convert_x: two token rows a warp cover the tokens");
  float ss_own[kMmaMaxTiles / 2] = {};  // kConvert: sums of squares of tokens warp, warp + 16
  // kConvert: the staged chunk (cols columns) scaled by the norm weights and split into [hi | lo] slots in place; warp
  // w takes tokens w and w + 16 and adds their squares to ss_own.
  auto convert_x = [&](int cols) {
    if constexpr (kConvert) {
      const int stride_c = slot_stride(Kc);
#pragma unroll
      for (int h = 0; h < kMmaMaxTiles / 2; ++h) {
        const int t = warp + W * h;
        if (t < n_rows) {
          float sq = 0.f;
          for (int q = lane; q < cols / 4; q += 32) {
            uint4* p = &x_s[t * stride_c + q];
            const float4 v = *reinterpret_cast<const float4*>(p), nw = reinterpret_cast<const float4*>(norm_s)[q];
            sq += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
            *p = split_slot(make_float4(v.x * nw.x, v.y * nw.y, v.z * nw.z, v.w * nw.w));
          }
          ss_own[h] += sq;
        }
      }
      __syncthreads();
    }
  };
  stage_x<kNormed, W>(a, K, Kc, 0, min(K, Kc), n_rows, x_s);
  convert_x(min(K, Kc));

  float acc[kMmaMaxTiles][4];
#pragma unroll
  for (int nt = 0; nt < kMmaMaxTiles; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  const int stride = slot_stride(Kc);
  // Normed input: this lane's sum of squares of token nt * 8 + g over the slots it loads.
  float ss[kMmaMaxTiles] = {};
  // One 32-column block of K of this warp's row tile. blk0: the first block of the chunk in shared memory.
  auto do_block = [&](const WB& wb, int blk, int blk0) {
    float part[kMmaMaxTiles][4];
#pragma unroll
    for (int nt = 0; nt < kMmaMaxTiles; ++nt) part[nt][0] = part[nt][1] = part[nt][2] = part[nt][3] = 0.f;
    float xsum[kMmaMaxTiles] = {};  // kHasMin: token nt * 8 + g's activations in this lane's slots of the block
    // Adds the scaled partial tiles (and the min times the activation sums) to acc: once per block, or after each
    // step (16 elements) for the types with a scale per 16 (Q6_K, kWide8), which then start the next step afresh.
    auto apply = [&](int step) {
      float sum0[kMmaMaxTiles], sum1[kMmaMaxTiles];
      if constexpr (WB::kHasMin) lane_token_sums(xsum, sum0, sum1, n_tiles);
      add_scaled_tiles(acc, part, wb, sum0, sum1, step, n_tiles);
    };
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      uint32_t ar[4];
      wb.a_regs(step, ar);
      const int slot = (blk - blk0) * 8 + 4 * step + c;
      float4 nw;
      if constexpr (kLoopNorm) nw = reinterpret_cast<const float4*>(norm_s)[slot];
#pragma unroll
      for (int nt = 0; nt < kMmaMaxTiles; ++nt) {
        if (nt < n_tiles) {
          uint4 xv = x_s[(nt * 8 + g) * stride + slot];
          if constexpr (kLoopNorm) {
            const float4 v = *reinterpret_cast<const float4*>(&xv);
            ss[nt] += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
            const float4 y = make_float4(v.x * nw.x, v.y * nw.y, v.z * nw.z, v.w * nw.w);
            xv = split_slot(y);
            if constexpr (WB::kHasMin) xsum[nt] += (y.x + y.y) + (y.z + y.w);
          } else if constexpr (WB::kHasMin) {
            xsum[nt] += slot_sum(xv);
          }
          mma_16816(part[nt], ar, xv.x, xv.y);  // hi
          mma_16816(part[nt], ar, xv.z, xv.w);  // lo
        }
      }
      if constexpr (WB::kStepScales) {
        apply(step);
#pragma unroll
        for (int nt = 0; nt < kMmaMaxTiles; ++nt) part[nt][0] = part[nt][1] = part[nt][2] = part[nt][3] = 0.f;
#pragma unroll
        for (int nt = 0; nt < kMmaMaxTiles; ++nt) xsum[nt] = 0.f;
      }
    }
    if constexpr (!WB::kStepScales) apply(0);
  };
  // The prefetched blocks all lie in the first chunk (chunk_blocks >= kMaxKS * kPre >= KS * kPre).
#pragma unroll
  for (int j = 0; j < kPre; ++j)
    if (j < my_blocks) do_block(pre[j], ks + j * KS, 0);
  int j = kPre;  // K beyond kPre blocks per warp: loaded here, chunk by chunk
  for (int blk0 = 0; blk0 < nb; blk0 += chunk_blocks) {
    if (blk0 > 0) {
      __syncthreads();  // every warp is done with the previous chunk
      stage_x<kNormed, W>(a, K, Kc, 32 * blk0, min(K - 32 * blk0, Kc), n_rows, x_s, kNormed ? norm_s : nullptr);
      convert_x(min(K - 32 * blk0, Kc));
    }
    for (; j < my_blocks && ks + j * KS < blk0 + chunk_blocks; ++j) {
      WB next;
      if (j + kAhead < my_blocks) load_block(j + kAhead, next);
      do_block(cur, ks + j * KS, blk0);
      if constexpr (kAhead > 1) {
        cur = nxt;
        nxt = next;
      } else {
        cur = next;
      }
    }
  }

  if constexpr (kLoopNorm) {  // this warp's sum of squares per token, for 1/rms below
#pragma unroll
    for (int nt = 0; nt < kMmaMaxTiles; ++nt) {
      if (nt < n_tiles) {
        float v = ss[nt];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (c == 0) ss_s[warp * n_rows + nt * 8 + g] = v;
      }
    }
  } else if constexpr (kConvert) {  // the whole sums of squares of this warp's tokens
#pragma unroll
    for (int h = 0; h < kMmaMaxTiles / 2; ++h) {
      const float v = detail::warp_sum(ss_own[h]);
      if (lane == 0 && warp + W * h < n_rows) ss_s[warp + W * h] = v;
    }
  }

  // Sum the K-split warps' partial tiles in a fixed order: red is [ks][the block's tpb * 16 rows][token].
  const int block_rows = tpb * kMmaTileRows;
  __syncthreads();  // every warp is done reading x_s, which red overlays, and has written its ss_s
#pragma unroll
  for (int nt = 0; nt < kMmaMaxTiles; ++nt) {
    if (nt < n_tiles && ks < KS) {
      const int t0 = nt * 8 + 2 * c;
      float* r = red + (ks * block_rows + my_tile * kMmaTileRows) * red_ld;
      r[g * red_ld + t0] = acc[nt][0];
      r[g * red_ld + t0 + 1] = acc[nt][1];
      r[(g + 8) * red_ld + t0] = acc[nt][2];
      r[(g + 8) * red_ld + t0 + 1] = acc[nt][3];
    }
  }
  if (kNormed && threadIdx.x < n_rows) {  // 1/rms of token threadIdx.x (the projection is linear: applied to the outputs)
    float sq = 0.f;
    if constexpr (kConvert) sq = ss_s[threadIdx.x];
    else
      for (int w = 0; w < W; ++w) sq += ss_s[w * n_rows + threadIdx.x];
    rms_s[threadIdx.x] = 1.f / sqrtf(sq / static_cast<float>(K) + a.eps);
  }
  __syncthreads();
  auto tile_sum = [&](int r, int t) {  // r: row of the block's tpb * 16
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxKS; ++k)  // a compile-time bound, so that the loads issue together
      if (k < KS) v += red[(k * block_rows + r) * red_ld + t];
    return kNormed ? v * rms_s[t] : v;
  };
  if (a.out_kind == PromptMmaOut::SiluHalf) {
    // Column j = 8 * tile + r of h = silu(gate) * up, in the slot layout the down projection reads.
    for (int i = threadIdx.x; i < a.n * 8 * tpb; i += kThreads) {
      const int t = i / (8 * tpb), q = i % (8 * tpb), rt = q / 8, r = q % 8;
      const int j = 8 * (blockIdx.x * tpb + rt) + r;
      if (j >= a.d_ff) continue;
      const float gv = tile_sum(rt * kMmaTileRows + r, t), uv = tile_sum(rt * kMmaTileRows + r + 8, t);
      detail::store_operand(gv / (1.f + expf(-gv)) * uv, t, j, a.d_ff, a.out_slots);
    }
    return;
  }
  for (int i = threadIdx.x; i < a.n * block_rows; i += kThreads) {
    const int t = i / block_rows, r = i % block_rows;
    const int row = blockIdx.x * block_rows + r;
    if (row >= a.W.rows) continue;
    const float v = tile_sum(r, t);
    float* y = a.y + static_cast<int64_t>(t) * a.W.rows + row;
    *y = a.out_kind == PromptMmaOut::AddResidual ? *y + v : v;
  }
}

// 16-row tiles of the projection's output (SiluHalf: 8 gate + 8 up rows each).
int row_tiles(const PromptMmaArgs& a) {
  return a.out_kind == PromptMmaOut::SiluHalf ? (a.d_ff + 7) / 8 : (a.W.rows + kMmaTileRows - 1) / kMmaTileRows;
}

// Row tiles per block: the fewest that keep the grid in one wave (up to 16 a block, one warp each).
int row_tiles_per_block(const PromptMmaArgs& a) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  return std::min(kMmaWarps, (row_tiles(a) + sms - 1) / sms);
}

template <typename WB, int NT>
void launch_typed(const PromptMmaArgs& a, cudaStream_t s) {
  const MmaSmem lay(a.W.cols, NT);
  const int tiles = row_tiles(a), tpb = row_tiles_per_block(a);
  auto* kernel = tpb == 1 ? (a.x != nullptr ? prompt_mma_kernel<WB, kMmaWarps, true, NT>
                                            : prompt_mma_kernel<WB, kMmaWarps, false, NT>)
                          : (a.x != nullptr ? prompt_mma_kernel<WB, kMmaWarps / 2, true, NT>
                                            : prompt_mma_kernel<WB, kMmaWarps / 2, false, NT>);
  detail::allow_dynamic_smem(kernel, static_cast<size_t>(lay.total));
  detail::launch_programmatic(kernel, dim3((tiles + tpb - 1) / tpb), dim3(32 * kMmaWarps),
                              static_cast<size_t>(lay.total), s, a, tpb);
}

template <typename WB>
void launch_typed(const PromptMmaArgs& a, cudaStream_t s) {
  static_assert(kMmaMaxTiles == 4, "one case per token-tile count");
  switch ((a.n + 7) / 8) {
    case 1: launch_typed<WB, 1>(a, s); break;
    case 2: launch_typed<WB, 2>(a, s); break;
    case 3: launch_typed<WB, 3>(a, s); break;
    default: launch_typed<WB, 4>(a, s); break;
  }
}

// ------------------------------------------------------------------ causal attention of a few-token prompt

constexpr int kFewAttnThreads = 128;
constexpr int kFewAttnTile = 64;  // keys per shared-memory tile
constexpr int kFewHd = 64;
constexpr int kFewKStride = kFewHd + 4;  // padded K rows: a quarter warp's float4 loads of 8 rows hit distinct banks
constexpr int kFewQueries = kFewAttnThreads / 32;  // prompt tokens a block: one a warp

struct FewAttnSmem {
  float k[kFewAttnTile][kFewKStride];
  float v[kFewAttnTile][kFewHd];
  float q[kFewQueries][kFewHd];
  float p[kFewQueries][kFewAttnTile];
};

// One block per (query head, kFewQueries prompt tokens), a warp per token: RoPE of the token's q, the KV-head group's
// first head appends the tokens' roped k and plain v to the cache, then attention over keys 0..pos0+t in tiles of
// kFewAttnTile that the block's warps share (each tile loaded once for its tokens), each warp keeping its own online
// softmax: keys before pos0 come from the (fp16) cache, the prompt's own keys from the raw QKV rows (roped and rounded
// to fp16 here exactly as the append does, never read back from the cache, which other blocks are writing). Lane l of
// a warp scores keys l and l + 32 of a tile and accumulates output dims l and l + 32. Output: the slot layout the O
// projection reads. kBias: the raw rows get the Q/K/V biases first; kNeox: RoPE pair l of a head is (l, l + 32), not
// (2l, 2l + 1) (the cache keeps each value at its own index, as the decode kernels read it).
template <bool kNeox, bool kBias>
__global__ void __launch_bounds__(kFewAttnThreads) attention_prompt_few_kernel(const FewAttnArgs a) {
  extern __shared__ __align__(16) unsigned char few_smem_raw[];
  FewAttnSmem& sm = *reinterpret_cast<FewAttnSmem*>(few_smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.x, t0 = blockIdx.y * kFewQueries, t = t0 + warp, group = a.n_heads / a.n_kv_heads;
  const int kvh = h / group;
  const int q_dim = a.n_heads * kFewHd, kv_dim = a.n_kv_heads * kFewHd, qkv_rows = q_dim + 2 * kv_dim;
  const bool live = t < a.n;  // warp-uniform: the block's last warps may have no token
  // The two elements of a head that this thread turns together: RoPE pair `lane` (the q and the append below, and the
  // RoPE passes over the key tiles, whose threads all have pair index tid % 32 = lane).
  const int ia = kNeox ? lane : 2 * lane, ib = kNeox ? lane + kFewHd / 2 : 2 * lane + 1;
  auto pair_of = [&](const float* head) {  // elements ia, ib of a head's raw row
    return kNeox ? make_float2(head[ia], head[ib]) : *reinterpret_cast<const float2*>(head + ia);
  };
  // The biases this thread adds (weights: loaded before the wait): q's and k's pair, v's pair for the append, and the
  // four v values at 4 (tid % 16) that it stages in every key tile. Without kBias nothing is added (x + 0.f is not
  // x for x = -0.f, so the compiler would keep the additions).
  float2 bq{}, bk{}, bv{};
  float4 bv4{};
  auto add2 = [](float2 x, float2 b) { return kBias ? make_float2(x.x + b.x, x.y + b.y) : x; };
  auto turn = [](float2 v, float2 f) { return make_float2(v.x * f.x - v.y * f.y, v.x * f.y + v.y * f.x); };
  if constexpr (kBias) {
    bq = pair_of(a.bias + h * kFewHd);
    bk = pair_of(a.bias + q_dim + kvh * kFewHd);
    bv = pair_of(a.bias + q_dim + kv_dim + kvh * kFewHd);
    bv4 = *reinterpret_cast<const float4*>(a.bias + q_dim + kv_dim + kvh * kFewHd + 4 * (tid % (kFewHd / 4)));
  }
  // The start position was copied in before this graph began, so it may be read before the wait.
  const int pos0 = *a.pos0_dev, p = pos0 + t;
  const int n_keys = pos0 + min(a.n, t0 + kFewQueries);  // the keys of the block's last token
  const float2 cs = live ? a.rope_table[static_cast<int64_t>(p) * (kFewHd / 2) + lane] : make_float2(1.f, 0.f);
  // The RoPE factors of the first tile's prompt keys, also loaded before the wait (kFewRopePerThread per thread).
  constexpr int kFewRopePerThread = kFewAttnTile * (kFewHd / 2) / kFewAttnThreads;
  float2 rope0[kFewRopePerThread];
#pragma unroll
  for (int k = 0; k < kFewRopePerThread; ++k) {
    const int i = tid + k * kFewAttnThreads, j = i / (kFewHd / 2);
    rope0[k] = j < n_keys && j >= pos0 ? a.rope_table[static_cast<int64_t>(j) * (kFewHd / 2) + i % (kFewHd / 2)]
                                       : make_float2(1.f, 0.f);
  }
  detail::grid_dependency_wait();
  detail::launch_dependents();

  float m_run = -INFINITY, l_run = 0.f, acc0 = 0.f, acc1 = 0.f;  // this warp's token: dims lane, lane + 32
  for (int j0 = 0; j0 < n_keys; j0 += kFewAttnTile) {
    const int rows = min(kFewAttnTile, n_keys - j0);
    __syncthreads();  // every warp is done with the previous tile
    for (int i = tid; i < rows * (kFewHd / 4); i += kFewAttnThreads) {
      const int r = i / (kFewHd / 4), c = 4 * (i % (kFewHd / 4)), j = j0 + r;
      float4* kd = reinterpret_cast<float4*>(&sm.k[r][c]);
      float4* vd = reinterpret_cast<float4*>(&sm.v[r][c]);
      if (j < pos0) {  // fp16 cache rows
        const int64_t off = static_cast<int64_t>(j) * kv_dim + kvh * kFewHd + c;
        *kd = detail::kv4(__ldcg(reinterpret_cast<const uint2*>(a.k_cache + off)));
        *vd = detail::kv4(__ldcg(reinterpret_cast<const uint2*>(a.v_cache + off)));
      } else {  // the prompt's own rows: k raw (turned below), v rounded as the cache holds it
        const float* row = a.qkv + static_cast<int64_t>(j - pos0) * qkv_rows + q_dim + kvh * kFewHd + c;
        detail::cp_async16(kd, row);
        float4 v = *reinterpret_cast<const float4*>(row + kv_dim);
        if constexpr (kBias) v = make_float4(v.x + bv4.x, v.y + bv4.y, v.z + bv4.z, v.w + bv4.w);
        *vd = detail::kv_round4(v);
      }
    }
    if (j0 == 0 && live) {  // while the first tile is in flight: this warp's q, and its token's cache append
      const float* row = a.qkv + static_cast<int64_t>(t) * qkv_rows;
      const float2 q = turn(add2(pair_of(row + h * kFewHd), bq), cs);
      constexpr float kScale = 0.125f * 1.4426950408889634f;  // 1/sqrt(64) * log2(e): scores in base 2
      sm.q[warp][ia] = q.x * kScale;
      sm.q[warp][ib] = q.y * kScale;
      if (h % group == 0) {
        const float2 k = turn(add2(pair_of(row + q_dim + kvh * kFewHd), bk), cs);
        const float2 v = add2(pair_of(row + q_dim + kv_dim + kvh * kFewHd), bv);
        __half* kc = a.k_cache + static_cast<int64_t>(p) * kv_dim + kvh * kFewHd;
        __half* vc = a.v_cache + static_cast<int64_t>(p) * kv_dim + kvh * kFewHd;
        kc[ia] = detail::kv_store(k.x);
        kc[ib] = detail::kv_store(k.y);
        vc[ia] = detail::kv_store(v.x);
        vc[ib] = detail::kv_store(v.y);
      }
    }
    detail::cp_async_wait_all();
    __syncthreads();
    // The prompt's own keys arrive raw: turn them by their position (pair `lane` of tile row r, factors f), rounded
    // as the cache holds them.
    auto turn_key = [&](int r, float2 f) {
      const float2 k = turn(add2(make_float2(sm.k[r][ia], sm.k[r][ib]), bk), f);
      sm.k[r][ia] = detail::kv_round(k.x);
      sm.k[r][ib] = detail::kv_round(k.y);
    };
    if (j0 == 0) {
#pragma unroll
      for (int k = 0; k < kFewRopePerThread; ++k) {
        const int r = (tid + k * kFewAttnThreads) / (kFewHd / 2);
        if (r < rows && r >= pos0) turn_key(r, rope0[k]);
      }
    } else {
      for (int i = tid; i < rows * (kFewHd / 2); i += kFewAttnThreads) {
        const int r = i / (kFewHd / 2), j = j0 + r;
        if (j >= pos0) turn_key(r, a.rope_table[static_cast<int64_t>(j) * (kFewHd / 2) + lane]);
      }
    }
    __syncthreads();
    const int n_mine = live ? min(rows, p + 1 - j0) : 0;  // the tile's keys this warp's token sees (causal)
    if (n_mine > 0) {
      // Scores: lane takes keys lane and lane + 32, all 64 dims (q is read by every lane at once: a broadcast).
      const float4* q4 = reinterpret_cast<const float4*>(sm.q[warp]);
      auto score = [&](int r) {  // key r of the tile against this warp's q
        const float4* k4 = reinterpret_cast<const float4*>(sm.k[r]);
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < kFewHd / 4; ++c) {
          const float4 kv = k4[c], qv = q4[c];
          s += (kv.x * qv.x + kv.y * qv.y) + (kv.z * qv.z + kv.w * qv.w);
        }
        return s;
      };
      const float s0 = lane < n_mine ? score(lane) : -INFINITY;
      const float s1 = lane + 32 < n_mine ? score(lane + 32) : -INFINITY;
      // Online softmax of this warp's token (lane 0's key is always live, so m_new is finite).
      const float m_new = fmaxf(m_run, detail::warp_max(fmaxf(s0, s1)));
      const float e0 = lane < n_mine ? exp2f(s0 - m_new) : 0.f, e1 = lane + 32 < n_mine ? exp2f(s1 - m_new) : 0.f;
      const float alpha = exp2f(m_run - m_new);  // 0 on the first tile (m_run = -inf)
      l_run = l_run * alpha + detail::warp_sum(e0 + e1);
      m_run = m_new;
      sm.p[warp][lane] = e0;
      sm.p[warp][lane + 32] = e1;
      __syncwarp();
      acc0 *= alpha;
      acc1 *= alpha;
      for (int r = 0; r < n_mine; ++r) {
        const float pr = sm.p[warp][r];
        acc0 += pr * sm.v[r][lane];
        acc1 += pr * sm.v[r][lane + 32];
      }
      __syncwarp();  // p is read before the next tile writes it
    }
  }
  if (live) {
    detail::store_operand(acc0 / l_run, t, h * kFewHd + lane, q_dim, a.out_slots);
    detail::store_operand(acc1 / l_run, t, h * kFewHd + lane + 32, q_dim, a.out_slots);
  }
}

}  // namespace

bool prompt_mma_supported(GgmlType type, int cols, int d_ff_or_zero) {
  switch (type) {
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q8_0:
    case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K: break;
    default:
      if (type != kWide8) return false;
  }
  if (cols % 32 != 0 || d_ff_or_zero % 8 != 0) return false;
  const int total = MmaSmem(cols, kMmaMaxTiles).total;
  const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  return total <= optin && total <= kMmaSmemCap;
}

void launch_prompt_mma(const PromptMmaArgs& a, cudaStream_t s) {
  if (a.n < 1 || a.n > kPromptMmaMaxTokens) throw EngineError("launch_prompt_mma: token count out of range");
  if (!prompt_mma_supported(a.W.type, a.W.cols, a.out_kind == PromptMmaOut::SiluHalf ? a.d_ff : 0))
    throw EngineError("launch_prompt_mma: unsupported weight type or shape");
  if ((a.x != nullptr) == (a.x_slots != nullptr)) throw EngineError("launch_prompt_mma: give exactly one input");
  if (a.x != nullptr && a.norm_w == nullptr) throw EngineError("launch_prompt_mma: fp32 input needs norm weights");
  if ((a.out_kind == PromptMmaOut::SiluHalf) != (a.out_slots != nullptr) || (a.y == nullptr) == (a.out_slots == nullptr))
    throw EngineError("launch_prompt_mma: the output does not match out_kind");
  if (mma_scale_count(a.W.type) > 0 && a.W.mma_scales == nullptr)
    throw EngineError("launch_prompt_mma: K-quant matrix without its mma_scales");
  if (a.W.type == kWide8) {
    launch_typed<WBlockWide8>(a, s);
    return;
  }
  switch (a.W.type) {
    case GgmlType::Q4_0: launch_typed<WBlock<GgmlType::Q4_0>>(a, s); break;
    case GgmlType::Q4_1: launch_typed<WBlock<GgmlType::Q4_1>>(a, s); break;
    case GgmlType::Q8_0: launch_typed<WBlock<GgmlType::Q8_0>>(a, s); break;
    case GgmlType::Q5_0: launch_typed<WBlock<GgmlType::Q5_0>>(a, s); break;
    case GgmlType::Q5_1: launch_typed<WBlock<GgmlType::Q5_1>>(a, s); break;
    case GgmlType::Q4_K: launch_typed<WBlock<GgmlType::Q4_K>>(a, s); break;
    case GgmlType::Q5_K: launch_typed<WBlock<GgmlType::Q5_K>>(a, s); break;
    case GgmlType::Q6_K: launch_typed<WBlock<GgmlType::Q6_K>>(a, s); break;
    default: throw EngineError("launch_prompt_mma: unsupported weight type");
  }
}

void launch_attention_prompt_few(const FewAttnArgs& a, cudaStream_t s) {
  if (a.n < 1 || a.n > kPromptMmaMaxTokens) throw EngineError("launch_attention_prompt_few: token count out of range");
  if (a.head_dim != kFewHd || a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0)
    throw EngineError("launch_attention_prompt_few: needs head_dim 64 and whole query-head groups");
  void (*k)(FewAttnArgs) = a.neox ? (a.bias != nullptr ? attention_prompt_few_kernel<true, true>
                                                        : attention_prompt_few_kernel<true, false>)
                                  : (a.bias != nullptr ? attention_prompt_few_kernel<false, true>
                                                       : attention_prompt_few_kernel<false, false>);
  detail::launch_programmatic(k, dim3(a.n_heads, (a.n + kFewQueries - 1) / kFewQueries), dim3(kFewAttnThreads),
                              sizeof(FewAttnSmem), s, a);
}

}  // namespace metalattn::cuda
