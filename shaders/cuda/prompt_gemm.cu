// Long-prompt projections on tensor cores: Y = W . X for a prompt chunk (or a batch group) of any number of tokens,
// read straight from the quantized decode weights, the way the few-token kernels of prompt_mma.cu do for up to 32.
// It replaces cuBLAS GEMMs on fp16 copies of the weights ([W_hi | W_hi | W_lo], 6 bytes a weight: 2.5 GB for
// Qwen2.5-0.5B, whose file is 463 MB), whose fp32 accumulation over 3K products carried ~1e-5 relative error per
// projection (benchmarks/NOTES.md, sessions 11-12).
//
// Geometry: a block owns a tile of 64 rows of W x 64 tokens. Each group of 4 warps covers it: warp w of a group the
// 16 rows at 16 w (one m16 tile of mma.sync m16n8k16) x all 64 tokens (eight n8 tiles), so each A fragment it decodes
// serves eight MMAs. K is walked in chunks of two 32-weight blocks; a block of KG groups (KG = 2 for projections of
// at most one tile per SM, where 4 warps per SM could not hide the latencies) gives chunk ch to group ch % KG and
// sums the groups' tiles at the end, in group order. Where a projection has few tiles, a thread-block cluster of 2 or 4
// such blocks splits K further (chunk ch to the cluster's group ch % (2 x cluster size)), and the cluster's first
// block sums the blocks' tiles in block order, reading them from the others' shared memory (cluster_split): a fixed
// order of sums, so replays stay bit-identical. The activations (kernels.cuh store_operand: per 4 values
// [hi x4 | lo x4] fp16) of the chunks are copied into shared memory by cp.async, rounds of KG chunks in flight;
// each lane's B fragment of a step is one 16-byte load that holds both the hi and the lo half. Each warp reads its
// own rows' weights from global memory into registers (mma_weights.cuh), two of its chunks ahead of the MMAs that use
// them. For the types with a min (Q4_1, Q5_1, Q4_K, Q5_K, kWide8) the block sums the activations per token and 16
// elements once per chunk, in shared memory, for all its warps.
//
// Numerics, as prompt_mma.cu: the integer quants enter the MMA exactly, the block (or per-16) scale is applied in
// fp32 after the block's MMAs (a promotion every 32 products: no long fp32 sum inside the tensor core), the
// activation as hi + lo (two MMAs, ~22 bits), float weights as hi + lo too (a third MMA).
//
// Speed: pp512 0.5-0.7x what the cuBLAS GEMMs reached (H100; NOTES, "CUDA, session 15"): the L1/shared pipe is the
// busiest unit (each warp of a group reads the whole 64-token B tile) and small grids keep one warp per scheduler.
#include <cooperative_groups.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "mma_weights.cuh"

namespace metalattn::cuda {

namespace {

using namespace mma;

constexpr int kGemmRows = 64;              // block tile: 64 rows x 64 tokens
constexpr int kGemmTokens = 64;
constexpr int kGemmNT = kGemmTokens / 8;   // n8 tiles per warp
constexpr int kGemmChunkBlocks = 2;        // 32-weight blocks of K per chunk
constexpr int kGemmChunkSlots = kGemmChunkBlocks * 8;  // 16-byte slots of one token row per chunk
// A token row of a staged chunk: 16 slots (256 bytes) + 64 bytes of padding, so the eight lanes of a quarter-warp
// (2 tokens x 4 consecutive slots) read distinct banks.
constexpr int kGemmRowSlots = kGemmChunkSlots + 4;
constexpr int kGemmChunkBytes = kGemmTokens * kGemmRowSlots * 16;    // 20,480
constexpr int kGemmSums = 2 * kGemmChunkBlocks * kGemmTokens;       // per chunk: per 16 elements and token
constexpr int kGemmAhead = 2 * kGemmChunkBlocks;  // weight blocks in registers: a group's chunk and its next one

// KG groups of 4 warps; rounds of KG chunks (one per group), kRounds of them in shared memory.
template <int KG>
struct GemmShape {
  static constexpr int kThreads = 128 * KG;
  static constexpr int kRounds = KG == 1 ? 3 : 2;
  static constexpr int kSmemBytes = kRounds * KG * kGemmChunkBytes + KG * kGemmSums * 4;  // 62,464 / 83,968
};

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <typename WB, int KG>
__global__ void __launch_bounds__(GemmShape<KG>::kThreads, KG == 1 ? 3 : 1) prompt_gemm_kernel(const PromptGemmArgs a) {
  using Shape = GemmShape<KG>;
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  uint4* chunks = reinterpret_cast<uint4*>(gemm_smem);  // [round % kRounds][group] staged chunks
  float* sums = reinterpret_cast<float*>(gemm_smem + Shape::kRounds * KG * kGemmChunkBytes);  // [group][kGemmSums]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int kg = warp / 4, wr = warp % 4;
  // A projection of few tiles splits K over a thread-block cluster of S = gridDim.z blocks as well (launch_typed):
  // its G = S * KG groups take the chunks in turn (chunk ch to group ch % G), block z holding groups z * KG ..
  // z * KG + KG - 1. Without a cluster S is 1 and G is KG (a constant in the one-group form, which never clusters).
  const int S = KG > 1 ? static_cast<int>(gridDim.z) : 1, G = S * KG, gg = (KG > 1 ? blockIdx.z * KG : 0) + kg;
  const int K = a.W.cols, nb = a.W.nb, n_chunks = (nb + kGemmChunkBlocks - 1) / kGemmChunkBlocks;
  const int n_rounds = (n_chunks + G - 1) / G;
  const int tok0 = blockIdx.x * kGemmTokens, row0 = blockIdx.y * kGemmRows + 16 * wr;
  const int rows[2] = {row0 + g < a.W.rows ? row0 + g : -1, row0 + g + 8 < a.W.rows ? row0 + g + 8 : -1};
  // Block indices of the two rows at block 0 (a row past the matrix: -1, which every block offset keeps negative).
  const int64_t row_blk[2] = {rows[0] >= 0 ? static_cast<int64_t>(rows[0]) * nb : -(int64_t{1} << 40),
                              rows[1] >= 0 ? static_cast<int64_t>(rows[1]) * nb : -(int64_t{1} << 40)};
  auto load_w = [&](WB& wb, int blk) {
    const int64_t b[2] = {row_blk[0] + blk, row_blk[1] + blk};
    wb.load(a.W, b, c);
  };

  // Staging: thread i copies slot i % 16 of token rows i / 16 + kTokStride m of every chunk of a round.
  constexpr int kTokStride = Shape::kThreads / kGemmChunkSlots, kTokPer = kGemmTokens / kTokStride;
  const int my_slot = threadIdx.x % kGemmChunkSlots, my_tok = threadIdx.x / kGemmChunkSlots;
  const __half* const x_base = a.x_slots + static_cast<int64_t>(tok0 + my_tok) * 2 * K + 8 * my_slot;
  const int64_t tok_step = static_cast<int64_t>(kTokStride) * 2 * K;
  unsigned tok_ok = 0;  // bit m: token row my_tok + kTokStride m is in the prompt
#pragma unroll
  for (int m = 0; m < kTokPer; ++m) tok_ok |= (tok0 + my_tok + kTokStride * m < a.n ? 1u : 0u) << m;
  // Round r into ring slot `slot` (= r % kRounds, kept by the caller).
  auto stage_round = [&](int r, int slot) {
#pragma unroll
    for (int q = 0; q < KG; ++q) {
      const int ch = r * G + (gg - kg) + q;
      const unsigned ok = ch < n_chunks && 4 * (ch * kGemmChunkSlots + my_slot) < K ? tok_ok : 0u;
      uint4* dst = chunks + (slot * KG + q) * (kGemmChunkBytes / 16) + my_tok * kGemmRowSlots + my_slot;
      const __half* src = x_base + ch * 8 * kGemmChunkSlots;
#pragma unroll
      for (int m = 0; m < kTokPer; ++m, src += tok_step)
        cp_async16_zfill(dst + m * kTokStride * kGemmRowSlots, (ok >> m) & 1u ? src : a.x_slots, (ok >> m) & 1u);
    }
  };

  // Before the wait: this group's first weight blocks (they do not depend on earlier kernels).
  WB w[kGemmAhead];
#pragma unroll
  for (int j = 0; j < kGemmAhead; ++j) {
    const int blk = (gg + G * (j / kGemmChunkBlocks)) * kGemmChunkBlocks + j % kGemmChunkBlocks;
    if (blk < nb) load_w(w[j], blk);
  }
  detail::grid_dependency_wait();
#pragma unroll
  for (int r = 0; r < Shape::kRounds - 1; ++r) {
    if (r < n_rounds) stage_round(r, r);
    cp_async_commit();
  }
  int slot = 0;  // ring slot of round r below; round r + kRounds - 1 goes to the slot before it

  float acc[kGemmNT][4];
#pragma unroll
  for (int nt = 0; nt < kGemmNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  // Two rounds per iteration, so that the ring of weight registers is indexed by constants.
  for (int r0 = 0; r0 < n_rounds; r0 += 2) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int r = r0 + cc;
      if (r >= n_rounds) break;
      cp_async_wait_group<Shape::kRounds - 2>();  // round r has landed (this thread's copies) ...
      __syncthreads();                             // ... and everyone's; the round refilled below is no longer read
      const int fill = slot == 0 ? Shape::kRounds - 1 : slot - 1;
      if (r + Shape::kRounds - 1 < n_rounds) stage_round(r + Shape::kRounds - 1, fill);
      cp_async_commit();
      const uint4* round = chunks + slot * KG * (kGemmChunkBytes / 16);
      slot = slot + 1 == Shape::kRounds ? 0 : slot + 1;
      if constexpr (WB::kHasMin) {
        // Sums of the round's activations (hi + lo) per chunk, token and 16 elements: sums[q][h * 64 + t].
        for (int i = threadIdx.x; i < KG * kGemmSums; i += Shape::kThreads) {
          const int q = i / kGemmSums, h = (i % kGemmSums) / kGemmTokens, t = i % kGemmTokens;
          const uint4* p = round + q * (kGemmChunkBytes / 16) + t * kGemmRowSlots + 4 * h;
          float s = 0.f;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint4 v = p[k];
            const float2 x0 = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
            const float2 x1 = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
            const float2 l0 = __half22float2(*reinterpret_cast<const __half2*>(&v.z));
            const float2 l1 = __half22float2(*reinterpret_cast<const __half2*>(&v.w));
            s += ((x0.x + l0.x) + (x0.y + l0.y)) + ((x1.x + l1.x) + (x1.y + l1.y));
          }
          sums[i] = s;
        }
        __syncthreads();
      }
      const int ch = r * G + gg;
      if (ch >= n_chunks) continue;  // the last round's spare groups (uniform per group)
      const uint4* st = round + kg * (kGemmChunkBytes / 16) + g * kGemmRowSlots;
      const float* my_sums = sums + kg * kGemmSums;
#pragma unroll
      for (int j = 0; j < kGemmChunkBlocks; ++j) {
        const int blk = ch * kGemmChunkBlocks + j;
        if (blk >= nb) break;
        WB& wb = w[cc * kGemmChunkBlocks + j];
        float part[kGemmNT][4] = {};
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          uint32_t ar[4], al[4];
          wb.a_regs(step, ar);
          if constexpr (WB::kWeightLo) wb.a_regs_lo(step, al);
#pragma unroll
          for (int nt = 0; nt < kGemmNT; ++nt) {
            const uint4 xv = st[nt * 8 * kGemmRowSlots + j * 8 + 4 * step + c];
            mma_16816(part[nt], ar, xv.x, xv.y);  // hi
            mma_16816(part[nt], ar, xv.z, xv.w);  // lo
            if constexpr (WB::kWeightLo) mma_16816(part[nt], al, xv.x, xv.y);
          }
          if (WB::kStepScales || step == 1) {
            // The activation sums of this lane's tokens nt * 8 + 2c, + 1 over the step (or the whole block).
            float sum0[kGemmNT], sum1[kGemmNT];
            if constexpr (WB::kHasMin) {
#pragma unroll
              for (int nt = 0; nt < kGemmNT; ++nt) {
                const float* s0 = my_sums + (2 * j + step) * kGemmTokens + nt * 8 + 2 * c;
                float2 v = *reinterpret_cast<const float2*>(s0);
                if (!WB::kStepScales) {
                  const float2 v0 = *reinterpret_cast<const float2*>(s0 - kGemmTokens);  // step 0's
                  v.x += v0.x;
                  v.y += v0.y;
                }
                sum0[nt] = v.x;
                sum1[nt] = v.y;
              }
            }
            add_scaled_tiles(acc, part, wb, sum0, sum1, step, kGemmNT);
            if constexpr (WB::kStepScales) {
#pragma unroll
              for (int nt = 0; nt < kGemmNT; ++nt)
                part[nt][0] = part[nt][1] = part[nt][2] = part[nt][3] = 0.f;
            }
          }
        }
        // These registers take the same block of this group's chunk after next.
        const int next = blk + 2 * G * kGemmChunkBlocks;
        if (next < nb) load_w(wb, next);
      }
    }
  }
  // Dependents launch only now: a projection may take several waves of blocks, and waiting blocks of the next kernel
  // would hold SM resources its later waves need.
  detail::launch_dependents();

  if constexpr (KG > 1) {
    // The groups' tiles summed in group order, through the (now idle) chunk buffers: [group - 1][warp][lane][32].
    cp_async_wait_group<0>();
    __syncthreads();
    float* red = reinterpret_cast<float*>(gemm_smem);
    if (kg > 0) {
      float* mine = red + (((kg - 1) * 4 + wr) * 32 + lane) * (4 * kGemmNT);
#pragma unroll
      for (int nt = 0; nt < kGemmNT; ++nt)
        *reinterpret_cast<float4*>(mine + 4 * nt) =
            make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
    }
    __syncthreads();
    auto add_tile = [&](const float* other) {
#pragma unroll
      for (int nt = 0; nt < kGemmNT; ++nt) {
        const float4 v = *reinterpret_cast<const float4*>(other + 4 * nt);
        acc[nt][0] += v.x;
        acc[nt][1] += v.y;
        acc[nt][2] += v.z;
        acc[nt][3] += v.w;
      }
    };
    if (kg == 0)
#pragma unroll
      for (int q = 1; q < KG; ++q) add_tile(red + (((q - 1) * 4 + wr) * 32 + lane) * (4 * kGemmNT));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // clusters: Hopper on (cluster_split gives older GPUs none)
    if (S > 1) {
      // The cluster's tiles summed in block order by block 0, which reads the others' from their shared memory
      // (past the groups' tiles); every thread of every block takes part in both cluster barriers.
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      float* part = red + (KG - 1) * 4 * 32 * (4 * kGemmNT);
      const int me = (wr * 32 + lane) * (4 * kGemmNT);
      const unsigned rank = cluster.block_rank();
      if (kg == 0 && rank > 0)
#pragma unroll
        for (int nt = 0; nt < kGemmNT; ++nt)
          *reinterpret_cast<float4*>(part + me + 4 * nt) = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
      cluster.sync();
      if (kg == 0 && rank == 0)
        for (int q = 1; q < S; ++q) add_tile(cluster.map_shared_rank(part, q) + me);
      cluster.sync();  // block 0 has read every tile: the others' shared memory may go
      if (rank > 0) return;
    }
#endif
    if (kg > 0) return;
  }
  // acc[nt]: rows g, g + 8 x tokens nt * 8 + 2c, + 1.
#pragma unroll
  for (int nt = 0; nt < kGemmNT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = rows[i >> 1], t = tok0 + nt * 8 + 2 * c + (i & 1);
      if (r < 0 || t >= a.n) continue;
      float* y = a.y + static_cast<int64_t>(t) * a.W.rows + r;
      *y = a.accumulate ? *y + acc[nt][i] : acc[nt][i];
    }
}

// The cluster's partial tiles sit after the groups' in the chunk buffers.
static_assert(2 * 4 * 32 * 4 * kGemmNT * 4 <= GemmShape<2>::kRounds * 2 * kGemmChunkBytes,
              "the cluster reduction's two tiles fit the chunk buffers");

template <typename WB, int KG>
void launch_kg(const PromptGemmArgs& a, cudaStream_t s, dim3 grid, int split) {
  constexpr int smem = GemmShape<KG>::kSmemBytes;
  detail::allow_dynamic_smem(prompt_gemm_kernel<WB, KG>, smem);
  grid.z = split;
  detail::launch_programmatic_clusters(prompt_gemm_kernel<WB, KG>, grid, dim3(GemmShape<KG>::kThreads), smem, s,
                                       dim3(1, 1, split), a);
}

// Blocks of a cluster that split K where a projection has few tiles: the most of 4 and 2 that keep the grid within
// the SMs and every one of the cluster's groups at two chunks or more; else 1 (no cluster). At such sizes a tile's
// whole K on one SM was the projection's latency: Qwen2.5-0.5B's down at 128 tokens is 28 tiles of 152 weight blocks
// each, on 28 of 132 SMs. H200, session 32 (benchmarks/NOTES.md): pp128 -32% (Qwen2.5), -15% (SmolLM2-1.7B), -13%
// (SmolLM2-135M). A shallow projection (fewer than 12 chunks: a few us of work a tile) splits only while the
// cluster grid leaves a quarter of the SMs free: SmolLM2-135M's QKV at 256 tokens (60 tiles of 9 chunks) as 120
// blocks in pairs cost more than its split saved (session 33: pp256 3.48 -> 3.02 ms without it). GPUs without
// thread-block clusters (before Hopper) get none.
int cluster_split(int tiles, int sms, int n_chunks) {
  if (device_attribute(cudaDevAttrClusterLaunch) == 0) return 1;
  for (int split = 4; split > 1; split /= 2) {
    if (n_chunks < 12 && tiles * split > sms * 3 / 4) continue;
    if (tiles * split <= sms && n_chunks >= 2 * 2 * split) return split;
  }
  return 1;
}

// Two groups per block where the projection has at most one 64 x 64 tile per SM, and K split further over a cluster
// of blocks where it has few (cluster_split).
template <typename WB>
void launch_typed(const PromptGemmArgs& a, cudaStream_t s) {
  const dim3 grid((a.n + kGemmTokens - 1) / kGemmTokens, (a.W.rows + kGemmRows - 1) / kGemmRows);
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount), tiles = static_cast<int>(grid.x * grid.y);
  const int n_chunks = (a.W.nb + kGemmChunkBlocks - 1) / kGemmChunkBlocks;
  if (tiles <= sms) launch_kg<WB, 2>(a, s, grid, cluster_split(tiles, sms, n_chunks));
  else launch_kg<WB, 1>(a, s, grid, 1);
}

}  // namespace

bool prompt_gemm_supported(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q8_0: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
    case GgmlType::F16: case GgmlType::BF16: case GgmlType::F32: return true;
    default: return type == kWide8;
  }
}

void launch_prompt_gemm(const PromptGemmArgs& a, cudaStream_t s) {
  if (a.n < 1) throw EngineError("launch_prompt_gemm: no tokens");
  if (a.W.cols % 32 != 0 || a.W.rows < 1) throw EngineError("launch_prompt_gemm: the matrix is not whole blocks");
  if (a.x_slots == nullptr || a.y == nullptr) throw EngineError("launch_prompt_gemm: missing input or output");
  if (mma_scale_count(a.W.type) > 0 && a.W.mma_scales == nullptr)
    throw EngineError("launch_prompt_gemm: K-quant matrix without its mma_scales");
  if (a.W.type == kWide8) return launch_typed<WBlockWide8>(a, s);
  switch (a.W.type) {
    case GgmlType::Q4_0: return launch_typed<WBlock<GgmlType::Q4_0>>(a, s);
    case GgmlType::Q4_1: return launch_typed<WBlock<GgmlType::Q4_1>>(a, s);
    case GgmlType::Q8_0: return launch_typed<WBlock<GgmlType::Q8_0>>(a, s);
    case GgmlType::Q5_0: return launch_typed<WBlock<GgmlType::Q5_0>>(a, s);
    case GgmlType::Q5_1: return launch_typed<WBlock<GgmlType::Q5_1>>(a, s);
    case GgmlType::Q4_K: return launch_typed<WBlock<GgmlType::Q4_K>>(a, s);
    case GgmlType::Q5_K: return launch_typed<WBlock<GgmlType::Q5_K>>(a, s);
    case GgmlType::Q6_K: return launch_typed<WBlock<GgmlType::Q6_K>>(a, s);
    case GgmlType::F16: return launch_typed<WBlockFloat<GgmlType::F16>>(a, s);
    case GgmlType::BF16: return launch_typed<WBlockFloat<GgmlType::BF16>>(a, s);
    case GgmlType::F32: return launch_typed<WBlockFloat<GgmlType::F32>>(a, s);
    default: throw EngineError(std::string("launch_prompt_gemm: no kernel for ") + gpu_type_name(a.W.type));
  }
}

}  // namespace metalattn::cuda
