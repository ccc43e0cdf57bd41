// Decode attention: one query position (the new token) over the KV cache. Three kernels: the split kernel (any
// head_dim of 32..128, the context split over blocks whose partial softmaxes the last block combines); the same split
// on tensor cores for head_dim 64 (the decode graph's long regime wherever its chunks fit 256 positions: 4% faster
// per token at 1,000-8,000 positions on the H100, RESULTS "CUDA, session 21"); and, up to kShortAttnMaxPos
// positions, the short kernel (head_dim 64, every K/V row in shared memory, one pass). The general architectures'
// decode attention (windows, scales, head_dim 256) is arch.cu's. The cache holds fp16 (kernels.cuh, kv_store): rows
// travel as fp16 and are widened to fp32 where they are used. Tests: CudaFused.DecodeAttention* (test_cuda_decode.cu),
// against the CPU reference at every head grouping the models use.
#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "short_attention.cuh"
#include "wmma_frags.cuh"
#include "trace.cuh"

namespace metalattn::cuda {

using detail::grid_dependency_wait;

METALATTN_TRACE_UNIT(decode_attention)

constexpr int kMaxGroup = 8;  // query heads per KV head the decode attention supports
constexpr int kAttnThreads = kAttnSinglePassMax;  // also: the block holds up to 256 rows in registers
constexpr int kAttnWarps = kAttnThreads / 32;
static_assert(kMaxAttnSplits <= 32, "the split combine reads the splits' (m, l) a lane each");
using AttnKernel = void (*)(const float*, const __half*, const __half*, const DecodeIO*, int, int, int, int,
                            AttnScratch, float*);

// Shared memory of one attention block: the staged V rows of the chunk (fp16, as cached), q of its heads, the scores
// of the chunk, per-warp P.V partial sums.
inline size_t attention_smem_bytes(int heads_per_block, int head_dim, int chunk_cap, int stage_rows) {
  return static_cast<size_t>(stage_rows) * head_dim * sizeof(__half) +
         static_cast<size_t>(heads_per_block) * (head_dim + chunk_cap + kAttnWarps * head_dim) * sizeof(float);
}


using detail::cp_async16;
using detail::cp_async_wait_all;

// The last block's combine of a split decode attention, for the HPB heads head0 .. of its block (all threads call it):
// o = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s. One L2 round trip: each thread's partials of its
// first output element (every split) and the splits' (m, l) (warp g reads head g's, a lane per split) are loaded
// together, then the weights go to w_s and the sums come from registers. Output elements past the block's thread
// count (groups of more than THREADS / HD heads) load theirs after the weights. Re-arms the done-counter for the
// next launch. THREADS: the block's.
template <int HPB, int HD, int THREADS>
__device__ __forceinline__ void combine_splits(const AttnScratch& p, int head0, int n_splits,
                                               float (*w_s)[kMaxAttnSplits], unsigned* counter,
                                               float* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i0 = threadIdx.x, g0 = i0 / HD, d0 = i0 % HD;
  const bool own = i0 < HPB * HD;
  float part[kMaxAttnSplits];
  if (own) {
    const float* po = p.o + static_cast<int64_t>(head0 + g0) * p.max_splits * HD + d0;
#pragma unroll
    for (int s = 0; s < kMaxAttnSplits; ++s) part[s] = s < n_splits ? __ldcg(po + static_cast<int64_t>(s) * HD) : 0.f;
  }
  for (int g = warp; g < HPB; g += THREADS / 32) {
    const float* ml = p.ml + static_cast<int64_t>(head0 + g) * p.max_splits * 2;
    const float2 ml_s =
        lane < n_splits ? __ldcg(reinterpret_cast<const float2*>(ml) + lane) : make_float2(-INFINITY, 0.f);
    const float m = detail::warp_max(ml_s.x);
    const float w = lane < n_splits ? expf(ml_s.x - m) : 0.f;
    const float den = detail::warp_sum(ml_s.y * w);
    if (lane < n_splits) w_s[g][lane] = w / den;
  }
  __syncthreads();
  if (own) {
    float num = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxAttnSplits; ++s)
      if (s < n_splits) num += part[s] * w_s[g0][s];
    out[static_cast<int64_t>(head0 + g0) * HD + d0] = num;
  }
  for (int i = threadIdx.x + THREADS; i < HPB * HD; i += THREADS) {
    const int g = i / HD, d = i % HD;
    const int64_t head = head0 + g;
    const float* po = p.o + head * p.max_splits * HD + d;
    float num = 0.f;
#pragma unroll 8
    for (int s = 0; s < n_splits; ++s) num += __ldcg(po + static_cast<int64_t>(s) * HD) * w_s[g][s];
    out[head * HD + d] = num;
  }
  if (threadIdx.x == 0) *counter = 0u;
}

// One block per (HPB query heads of one KV head, split); splits = attn_splits(pos + 1), blocks past it exit at once.
// HPB is a template parameter: with a run-time head count every per-head loop ran (predicated off) for kMaxGroup
// heads, 8/3 of the instructions SmolLM2's 3-head groups need (session 18, NOTES). Cache rows before pos were
// written by earlier steps, so before the programmatic wait each thread loads its K row into registers and the block
// copies the chunk's V rows (the first stage_rows of them) into shared memory: after the wait only q and row pos come
// from L2, in one round trip. Scores: a thread per position (16-byte loads of 8 fp16 values, no shuffles); P.V: warps
// over positions, lanes over column pairs.
template <int HD, int HPB>
__global__ void __launch_bounds__(kAttnThreads) attention_decode_kernel(const float* q, const __half* k_cache,
                                                                        const __half* v_cache,
                                                                        const DecodeIO* io, int n_heads,
                                                                        int n_kv_heads, int chunk_cap, int stage_rows,
                                                                        AttnScratch p, float* __restrict__ out) {
  constexpr int kHd4 = HD / 4, kHd8 = HD / 8, kPairs = HD / 2, kPairsPerLane = (kPairs + 31) / 32;
  KernelTrace trace(kTraceAttention);
  detail::launch_dependents();
  extern __shared__ float4 smem_dyn[];
  const int kv_dim = n_kv_heads * HD;
  __half* v_s = reinterpret_cast<__half*>(smem_dyn);            // [stage_rows][HD]
  float* q_s = reinterpret_cast<float*>(v_s + stage_rows * HD);  // [HPB][HD]
  float* sc = q_s + HPB * HD;                        // [HPB][chunk_cap] scores, then probabilities
  float* part = sc + HPB * chunk_cap;                // [kAttnWarps][HPB][HD]
  __shared__ float m_s[HPB], l_s[HPB];
  __shared__ float w_s[HPB][kMaxAttnSplits];  // the combine's weight e^(m_s - M) / den of each split

  const int head_block = blockIdx.x, split = blockIdx.y;
  const int head0 = head_block * HPB, kvh = head0 / (n_heads / n_kv_heads);
  const int pos = io->pos, n_pos = pos + 1;  // io was written before this graph launch
  const int n_splits = attn_splits(n_pos, p.max_splits);
  if (split >= n_splits) return;
  const int chunk = attn_chunk(n_pos, n_splits);
  const int start = split * chunk;
  const int len = min(chunk, n_pos - start);
  const int n_staged = min(len, stage_rows);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  const __half* k_head = k_cache + kvh * HD;
  const __half* v_head = v_cache + kvh * HD;
  uint4 k_own[kHd8];  // this thread's K row, 8 fp16 values a word
  const int t0 = threadIdx.x;
  const bool own_early = t0 < len && start + t0 < pos;
  if (own_early) {
    const uint4* k8 = reinterpret_cast<const uint4*>(k_head + static_cast<int64_t>(start + t0) * kv_dim);
#pragma unroll
    for (int c = 0; c < kHd8; ++c) k_own[c] = __ldg(k8 + c);
  }
  const int n_early = min(n_staged, pos - start);  // staged rows written by earlier steps
  for (int i = threadIdx.x; i < n_early * kHd8; i += kAttnThreads) {
    const int t = i / kHd8, c = i % kHd8;
    cp_async16(v_s + t * HD + c * 8, v_head + static_cast<int64_t>(start + t) * kv_dim + c * 8);
  }
  grid_dependency_wait();
  trace.released();

  // After the wait, data the kernel before wrote (q, K and V row pos) is read through L2 only (__ldcg), all at once.
  if (t0 < len && !own_early) {
    const uint4* k8 = reinterpret_cast<const uint4*>(k_head + static_cast<int64_t>(start + t0) * kv_dim);
#pragma unroll
    for (int c = 0; c < kHd8; ++c) k_own[c] = __ldcg(k8 + c);
  }
  if (pos - start < n_staged && threadIdx.x < kHd8)  // row pos is staged too (the last row of the last chunk)
    reinterpret_cast<uint4*>(v_s + (pos - start) * HD)[threadIdx.x] =
        __ldcg(reinterpret_cast<const uint4*>(v_head + static_cast<int64_t>(pos) * kv_dim) + threadIdx.x);
  for (int i = threadIdx.x; i < HPB * HD; i += blockDim.x) q_s[i] = __ldcg(q + static_cast<int64_t>(head0) * HD + i);
  cp_async_wait_all();
  __syncthreads();
  trace.mark(0);

  const float scale = 1.f / sqrtf(static_cast<float>(HD));
  const float4* q4 = reinterpret_cast<const float4*>(q_s);
  for (int t = t0; t < len; t += blockDim.x) {
    if (t != t0) {
      const uint4* k8 = reinterpret_cast<const uint4*>(k_head + static_cast<int64_t>(start + t) * kv_dim);
#pragma unroll
      for (int c = 0; c < kHd8; ++c) k_own[c] = __ldcg(k8 + c);
    }
    // Two accumulators per head halve the dependent FMA chain (the latency, not the FMA count, is the cost here).
    float acc[HPB][2];
#pragma unroll
    for (int g = 0; g < HPB; ++g) acc[g][0] = acc[g][1] = 0.f;
#pragma unroll
    for (int c = 0; c < kHd8; ++c) {
      float4 k[2];
      detail::kv8(k_own[c], k[0], k[1]);
#pragma unroll
      for (int g = 0; g < HPB; ++g)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float4 qq = q4[g * kHd4 + 2 * c + j];
          acc[g][j] += qq.x * k[j].x + qq.y * k[j].y + qq.z * k[j].z + qq.w * k[j].w;
        }
    }
#pragma unroll
    for (int g = 0; g < HPB; ++g) sc[g * chunk_cap + t] = (acc[g][0] + acc[g][1]) * scale;
  }
  __syncthreads();
  trace.mark(1);

  for (int g = warp; g < HPB; g += kAttnWarps) {
    const float2 ml = detail::warp_exp_of_max(sc + g * chunk_cap, len, lane);
    if (lane == 0) {
      m_s[g] = ml.x;
      l_s[g] = ml.y;
    }
  }
  __syncthreads();
  trace.mark(2);

  // P.V: warp w takes positions w, w + kAttnWarps, ...; lane owns float2 columns lane, lane + 32. Staged rows come
  // from shared memory, the rest (long chunks of a one-split capacity only) from L2, in a loop of their own so the
  // staged loop's loads are shared-memory loads.
  float2 o[HPB][kPairsPerLane];
#pragma unroll
  for (int g = 0; g < HPB; ++g)
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) o[g][c] = make_float2(0.f, 0.f);
  auto accumulate = [&](int t, const __half2* v2, bool from_l2) {
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      if (lane + 32 * c < kPairs) {
        const float2 v = __half22float2(from_l2 ? __ldcg(v2 + lane + 32 * c) : v2[lane + 32 * c]);
#pragma unroll
        for (int g = 0; g < HPB; ++g) {
          const float pg = sc[g * chunk_cap + t];
          o[g][c].x += pg * v.x;
          o[g][c].y += pg * v.y;
        }
      }
    }
  };
  int t = warp;
#pragma unroll 4
  for (; t < n_staged; t += kAttnWarps) accumulate(t, reinterpret_cast<const __half2*>(v_s + t * HD), false);
  for (; t < len; t += kAttnWarps)
    accumulate(t, reinterpret_cast<const __half2*>(v_head + static_cast<int64_t>(start + t) * kv_dim), true);
#pragma unroll
  for (int g = 0; g < HPB; ++g)
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c)
      if (lane + 32 * c < kPairs) reinterpret_cast<float2*>(part + (warp * HPB + g) * HD)[lane + 32 * c] = o[g][c];
  __syncthreads();
  trace.mark(3);

  if (n_splits == 1) {
    for (int i = threadIdx.x; i < HPB * HD; i += blockDim.x) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) sum += part[w * HPB * HD + i];
      out[static_cast<int64_t>(head0) * HD + i] = sum / l_s[i / HD];
    }
    return;
  }

  // Split: post this chunk's partial; the last block of this head block combines all of them (combine_splits).
  for (int i = threadIdx.x; i < HPB * HD; i += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) sum += part[w * HPB * HD + i];
    const int g = i / HD, d = i % HD;
    p.o[(static_cast<int64_t>(head0 + g) * p.max_splits + split) * HD + d] = sum;
  }
  if (threadIdx.x < HPB) {
    float* ml = p.ml + (static_cast<int64_t>(head0 + threadIdx.x) * p.max_splits + split) * 2;
    ml[0] = m_s[threadIdx.x];
    ml[1] = l_s[threadIdx.x];
  }
  if (!detail::last_block_to_arrive(p.counters + head_block, n_splits)) return;
  combine_splits<HPB, HD, kAttnThreads>(p, head0, n_splits, w_s, p.counters + head_block, out);
}

// ------------------------------------------------------------------ split decode attention on tensor cores
// head_dim 64. One block of kTcdThreads per (KV head, split): the group's query heads are the live rows of one
// 16-row tile, so a KV head's K/V rows are read once for all of them, and the scores (16 x len) and the P.V (16 x 64)
// are a few wmma steps a warp instead of per-position FMA chains. q and the probabilities are carried as fp16 hi + lo
// (about 21 bits of each), K and V are exact as cached, accumulation is fp32: the products match the FMA kernel's
// to ~1e-6. Partials and the last block's combine are the split kernel's (attention_decode_kernel).
constexpr int kTcdHd = 64;
constexpr int kTcdRows = 16;                     // rows of the query tile: the group's heads, the rest zero
constexpr int kTcdThreads = kTcDecodeMaxChunk;   // one thread a position in the softmax
constexpr int kTcdWarps = kTcdThreads / 32;
constexpr int kTcdHalfLd = kTcdHd + 8;           // K, V, q rows: 144 bytes (16-byte aligned, tiles at 32-byte steps)
constexpr int kTcdSLd = kTcDecodeMaxChunk + 4;   // score rows (floats)
constexpr int kTcdPLd = kTcDecodeMaxChunk + 8;   // probability rows (halves)
constexpr int kTcdOLd = kTcdHd + 4;              // output rows (floats)
static_assert(kTcdWarps == 8, "the P.V gives each of 8 warps one 16-dim column tile and one parity of key steps");

struct TcdSmem {  // every array at a 32-byte multiple (the wmma pointers' alignment)
  __half k[kTcDecodeMaxChunk][kTcdHalfLd];
  __half v[kTcDecodeMaxChunk][kTcdHalfLd];
  __half q_hi[kTcdRows][kTcdHalfLd], q_lo[kTcdRows][kTcdHalfLd];
  float s[kTcdRows][kTcdSLd];                          // scores
  __half p_hi[kTcdRows][kTcdPLd], p_lo[kTcdRows][kTcdPLd];  // probabilities e^(s - m), hi + lo
  float o[2][kTcdRows][kTcdOLd];                       // P.V over even / odd key steps
  float red_m[kTcdWarps][kTcdRows], red_l[kTcdWarps][kTcdRows];
  float w[kTcdRows][kMaxAttnSplits];                   // the combine's weight of each split
};

// HPB: query heads per KV head (the group), at most kTcdRows. Grid (n_kv_heads, max_splits); splits =
// attn_splits(pos + 1), blocks past it exit at once; chunks of at most kTcDecodeMaxChunk positions.
template <int HPB>
__global__ void __launch_bounds__(kTcdThreads) attention_decode_tc_kernel(const float* q, const __half* k_cache,
                                                                          const __half* v_cache, const DecodeIO* io,
                                                                          int n_kv_heads, AttnScratch p,
                                                                          float* __restrict__ out) {
  static_assert(HPB >= 1 && HPB <= kTcdRows, "the group fills at most one 16-row tile");
  extern __shared__ __align__(128) unsigned char tcd_raw[];
  TcdSmem& sm = *reinterpret_cast<TcdSmem*>(tcd_raw);
  KernelTrace trace(kTraceAttention);
  detail::launch_dependents();
  const int kvh = blockIdx.x, split = blockIdx.y, head0 = kvh * HPB;
  const int pos = io->pos, n_pos = pos + 1;  // io was written before this graph launch
  const int n_splits = attn_splits(n_pos, p.max_splits);
  if (split >= n_splits) return;
  const int chunk = attn_chunk(n_pos, n_splits);
  const int start = split * chunk, len = min(chunk, n_pos - start), len16 = (len + 15) & ~15;
  if (len16 > kTcDecodeMaxChunk) __trap();  // the launcher checks the capacity
  const int kv_dim = n_kv_heads * kTcdHd;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const __half* k_head = k_cache + kvh * kTcdHd;
  const __half* v_head = v_cache + kvh * kTcdHd;

  // Before the wait: the rows earlier steps wrote (all but row pos) by cp.async, the padding rows up to len16 zero
  // (their zero scores are not read, and zero V rows keep the P.V free of NaN garbage).
  const int n_early = min(len, pos - start);
  constexpr int kChunks = kTcdHd / 8;  // 16-byte pieces of a row
  for (int i = tid; i < len16 * kChunks; i += kTcdThreads) {
    const int t = i / kChunks, c = (i % kChunks) * 8;
    if (t < n_early) {
      cp_async16(&sm.k[t][c], k_head + static_cast<int64_t>(start + t) * kv_dim + c);
      cp_async16(&sm.v[t][c], v_head + static_cast<int64_t>(start + t) * kv_dim + c);
    } else if (t >= len) {
      *reinterpret_cast<uint4*>(&sm.k[t][c]) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(&sm.v[t][c]) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  // The probability tile's dead rows (the group fills rows 0 .. HPB - 1) are zero in every launch: written now, before
  // the wait, in 16-byte stores, not in the softmax after it (where their loop cost ~0.5 us at 8,000 positions).
  for (int i = tid; i < (kTcdRows - HPB) * (kTcdPLd / 8); i += kTcdThreads) {
    const int r = HPB + i / (kTcdPLd / 8), c = (i % (kTcdPLd / 8)) * 8;
    *reinterpret_cast<uint4*>(&sm.p_hi[r][c]) = make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(&sm.p_lo[r][c]) = make_uint4(0u, 0u, 0u, 0u);
  }
  grid_dependency_wait();
  trace.released();

  // After the wait: q of the group (scaled by 1/sqrt(64)) and, in the last chunk, row pos, all loads first.
  constexpr int kQ4 = kTcdRows * kTcdHd / 4 / kTcdThreads;  // float4 pieces of the tile per thread
  float4 qv[kQ4];
#pragma unroll
  for (int u = 0; u < kQ4; ++u) {
    const int i = tid + u * kTcdThreads, r = i / (kTcdHd / 4), c = (i % (kTcdHd / 4)) * 4;
    qv[u] = r < HPB ? __ldcg(reinterpret_cast<const float4*>(q + static_cast<int64_t>(head0 + r) * kTcdHd + c))
                    : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int t_pos = pos - start;  // row pos, when this chunk holds it (the last row of the last chunk)
  if (t_pos < len) {
    if (warp == kTcdWarps - 2 && lane < kChunks)
      *reinterpret_cast<uint4*>(&sm.k[t_pos][lane * 8]) =
          __ldcg(reinterpret_cast<const uint4*>(k_head + static_cast<int64_t>(pos) * kv_dim) + lane);
    else if (warp == kTcdWarps - 1 && lane < kChunks)
      *reinterpret_cast<uint4*>(&sm.v[t_pos][lane * 8]) =
          __ldcg(reinterpret_cast<const uint4*>(v_head + static_cast<int64_t>(pos) * kv_dim) + lane);
  }
  const float scale = 0.125f;  // 1 / sqrt(64)
#pragma unroll
  for (int u = 0; u < kQ4; ++u) {
    const int i = tid + u * kTcdThreads, r = i / (kTcdHd / 4), c = (i % (kTcdHd / 4)) * 4;
    split_half(qv[u].x * scale, sm.q_hi[r][c], sm.q_lo[r][c]);
    split_half(qv[u].y * scale, sm.q_hi[r][c + 1], sm.q_lo[r][c + 1]);
    split_half(qv[u].z * scale, sm.q_hi[r][c + 2], sm.q_lo[r][c + 2]);
    split_half(qv[u].w * scale, sm.q_hi[r][c + 3], sm.q_lo[r][c + 3]);
  }
  cp_async_wait_all();
  __syncthreads();
  trace.mark(0);

  // Scores: warp w takes the 16-key tiles w, w + 8, ...: S = q_hi K^T + q_lo K^T over four 16-dim steps.
  {
    FragA qa_hi[kTcdHd / 16], qa_lo[kTcdHd / 16];
#pragma unroll
    for (int ks = 0; ks < kTcdHd / 16; ++ks) {
      wm::load_matrix_sync(qa_hi[ks], &sm.q_hi[0][ks * 16], kTcdHalfLd);
      wm::load_matrix_sync(qa_lo[ks], &sm.q_lo[0][ks * 16], kTcdHalfLd);
    }
    for (int kt = warp; kt * 16 < len; kt += kTcdWarps) {
      FragAcc acc;
      wm::fill_fragment(acc, 0.f);
#pragma unroll
      for (int ks = 0; ks < kTcdHd / 16; ++ks) {
        FragBCol kb;
        wm::load_matrix_sync(kb, &sm.k[kt * 16][ks * 16], kTcdHalfLd);
        wm::mma_sync(acc, qa_hi[ks], kb, acc);
        wm::mma_sync(acc, qa_lo[ks], kb, acc);
      }
      wm::store_matrix_sync(&sm.s[0][kt * 16], acc, kTcdSLd, wm::mem_row_major);
    }
  }
  __syncthreads();
  trace.mark(1);

  // Softmax, a thread per position for every live row: the block's max and sum of each row through one shared
  // reduction each; probabilities e^(s - m) as hi + lo (zero past len; the dead rows were zeroed before the wait).
  const int t = tid;
  float sv[HPB];
#pragma unroll
  for (int g = 0; g < HPB; ++g) {
    sv[g] = t < len ? sm.s[g][t] : -INFINITY;
    const float mw = detail::warp_max(sv[g]);
    if (lane == 0) sm.red_m[warp][g] = mw;
  }
  __syncthreads();
  float mrow[HPB];
#pragma unroll
  for (int g = 0; g < HPB; ++g) {
    float mx = sm.red_m[0][g];
#pragma unroll
    for (int w = 1; w < kTcdWarps; ++w) mx = fmaxf(mx, sm.red_m[w][g]);
    mrow[g] = mx;
    const float e = t < len ? expf(sv[g] - mx) : 0.f;
    if (t < len16) split_half(e, sm.p_hi[g][t], sm.p_lo[g][t]);
    const float lw = detail::warp_sum(e);
    if (lane == 0) sm.red_l[warp][g] = lw;
  }
  __syncthreads();
  trace.mark(2);

  // P.V: warp w takes output dims (w % 4) * 16 .. + 15 over the key steps of parity w / 4 (two independent chains a
  // column tile); O = P_hi V + P_lo V.
  {
    const int ct = warp % 4, parity = warp / 4;
    FragAcc acc;
    wm::fill_fragment(acc, 0.f);
    for (int ks = parity; ks * 16 < len; ks += 2) {
      FragA pa_hi, pa_lo;
      FragBRow vb;
      wm::load_matrix_sync(pa_hi, &sm.p_hi[0][ks * 16], kTcdPLd);
      wm::load_matrix_sync(pa_lo, &sm.p_lo[0][ks * 16], kTcdPLd);
      wm::load_matrix_sync(vb, &sm.v[ks * 16][ct * 16], kTcdHalfLd);
      wm::mma_sync(acc, pa_hi, vb, acc);
      wm::mma_sync(acc, pa_lo, vb, acc);
    }
    wm::store_matrix_sync(&sm.o[parity][0][ct * 16], acc, kTcdOLd, wm::mem_row_major);
  }
  __syncthreads();
  trace.mark(3);

  if (n_splits == 1) {
    for (int i = tid; i < HPB * kTcdHd; i += kTcdThreads) {
      const int g = i / kTcdHd, d = i % kTcdHd;
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kTcdWarps; ++w) l += sm.red_l[w][g];
      out[static_cast<int64_t>(head0 + g) * kTcdHd + d] = (sm.o[0][g][d] + sm.o[1][g][d]) / l;
    }
    return;
  }
  // Split: post this chunk's partial (unnormalized output, max, sum); the last block of this KV head combines them
  // (combine_splits).
  for (int i = tid; i < HPB * kTcdHd; i += kTcdThreads) {
    const int g = i / kTcdHd, d = i % kTcdHd;
    p.o[(static_cast<int64_t>(head0 + g) * p.max_splits + split) * kTcdHd + d] = sm.o[0][g][d] + sm.o[1][g][d];
  }
  if (tid < HPB) {  // thread g posts head g's (m, l)
    float m_g = mrow[0];  // mrow[tid], without indexing registers at run time
#pragma unroll
    for (int g = 1; g < HPB; ++g)
      if (g == tid) m_g = mrow[g];
    float l_g = 0.f;
#pragma unroll
    for (int w = 0; w < kTcdWarps; ++w) l_g += sm.red_l[w][tid];
    float* ml = p.ml + (static_cast<int64_t>(head0 + tid) * p.max_splits + split) * 2;
    ml[0] = m_g;
    ml[1] = l_g;
  }
  if (!detail::last_block_to_arrive(p.counters + kvh, n_splits)) return;
  combine_splits<HPB, kTcdHd, kTcdThreads>(p, head0, n_splits, sm.w, p.counters + kvh, out);
}

// ------------------------------------------------------------------ short-context decode attention
// Up to kShortAttnMaxPos positions (the decode graph's short regime), head_dim 64: one block of kShortAttnThreads per
// query head with every K and V row in shared memory (attend_head64, short_attention.cuh).

// Short-context decode attention, head_dim 64: one block of kShortAttnThreads per query head; the K and V rows of
// earlier steps are copied into shared memory (fp16, as cached) before the programmatic wait, and after it only q
// and this step's K and V rows come from L2 (one round trip). n_pos = io->pos + 1 <= pos_cap <= kShortAttnMaxPos.
// The fp16 values are widened where they are used, after the wait: widening them before it (so that the code after
// the wait was the fp32 kernel's) made decode ~5% slower (session 19, NOTES).
__global__ void __launch_bounds__(kShortAttnThreads) attention_decode_short_kernel(const float* q,
                                                                                   const __half* k_cache,
                                                                                   const __half* v_cache,
                                                                                   const DecodeIO* io, int n_heads,
                                                                                   int n_kv_heads, int pos_cap,
                                                                                   float* __restrict__ out) {
  constexpr int HD = kShortAttnHd;
  KernelTrace trace(kTraceAttention);
  detail::launch_dependents();
  extern __shared__ float4 smem_dyn[];
  __half* k_s = reinterpret_cast<__half*>(smem_dyn);         // [pos_cap][kShortAttnKStride]
  __half* v_s = k_s + pos_cap * kShortAttnKStride;             // [pos_cap][HD]
  float* q_s = reinterpret_cast<float*>(v_s + pos_cap * HD);  // [HD]
  float* sc = q_s + HD;                              // [score_slots(pos_cap)]
  float* pv = sc + score_slots(pos_cap);             // [kShortAttnPvGroups][HD]
  __shared__ float sum_exp;
  const int head = blockIdx.x, kvh = head / (n_heads / n_kv_heads), kv_dim = n_kv_heads * HD;
  const int pos = io->pos, n_pos = pos + 1;  // io was written before this graph launch
  if (n_pos > pos_cap) __trap();
  const int tid = threadIdx.x;
  const __half* k_head = k_cache + kvh * HD;
  const __half* v_head = v_cache + kvh * HD;
  constexpr int kChunks = HD / 8;  // 16-byte chunks of a cache row
  stage_kv_rows<HD>(k_s, v_s, k_head, v_head, 0, pos, kv_dim);
  grid_dependency_wait();
  trace.released();
  // q, K row pos and V row pos each by its own warp: the three L2 round trips overlap (branches of one warp run one
  // after the other, each waiting for its load before its store).
  const int lane = tid & 31, warp = tid >> 5;
  if (warp == 0 && lane < HD / 4) {
    reinterpret_cast<float4*>(q_s)[lane] = __ldcg(reinterpret_cast<const float4*>(q + head * HD) + lane);
  } else if (warp == 1 && lane < kChunks) {
    reinterpret_cast<uint4*>(k_s + pos * kShortAttnKStride)[lane] =
        __ldcg(reinterpret_cast<const uint4*>(k_head + static_cast<int64_t>(pos) * kv_dim) + lane);
  } else if (warp == 2 && lane < kChunks) {
    reinterpret_cast<uint4*>(v_s + pos * HD)[lane] =
        __ldcg(reinterpret_cast<const uint4*>(v_head + static_cast<int64_t>(pos) * kv_dim) + lane);
  }
  cp_async_wait_all();
  __syncthreads();
  trace.mark(0);
  const float o = attend_head64(q_s, k_s, v_s, n_pos, sc, pv, &sum_exp);
  if (tid < HD) out[head * HD + tid] = o;
}
// The instantiation for head_dim hd and hpb heads a block (hpb in {1, 2, 3, 4, 8}), or null.
template <int HD>
AttnKernel attention_kernel_for_heads(int hpb) {
  return hpb == 1   ? attention_decode_kernel<HD, 1>
         : hpb == 2 ? attention_decode_kernel<HD, 2>
         : hpb == 3 ? attention_decode_kernel<HD, 3>
         : hpb == 4 ? attention_decode_kernel<HD, 4>
         : hpb == 8 ? attention_decode_kernel<HD, 8>
                    : nullptr;
}

void launch_attention_decode(const float* q, const __half* k_cache, const __half* v_cache, const DecodeIO* io,
                             int n_heads, int n_kv_heads, int head_dim, int n_ctx, const AttnScratch& p, float* out,
                             cudaStream_t s, int heads_per_block) {
  const int group = n_heads / n_kv_heads;
  if (group > kMaxGroup || group * n_kv_heads != n_heads) throw EngineError("attention: unsupported head grouping");
  if (p.max_splits < 1 || p.max_splits > kMaxAttnSplits) throw EngineError("attention: bad split capacity");
  if (heads_per_block == 0) heads_per_block = kAttnDefaultHeadsPerBlock;
  if (heads_per_block < 1 || group % heads_per_block != 0)
    throw EngineError("attention: heads per block must divide the query heads per KV head");
  // Instantiated head counts: a request between them (5, 6 or 7) runs the largest instantiated divisor of it.
  const int requested = heads_per_block;
  while (attention_kernel_for_heads<64>(heads_per_block) == nullptr || requested % heads_per_block != 0)
    --heads_per_block;
  AttnKernel k = head_dim == 32    ? attention_kernel_for_heads<32>(heads_per_block)
                 : head_dim == 64  ? attention_kernel_for_heads<64>(heads_per_block)
                 : head_dim == 96  ? attention_kernel_for_heads<96>(heads_per_block)
                 : head_dim == 128 ? attention_kernel_for_heads<128>(heads_per_block)
                                   : nullptr;
  if (k == nullptr) throw EngineError("decode attention needs head_dim 32, 64, 96 or 128");
  const int chunk_cap = attn_chunk_cap(n_ctx, p.max_splits);
  // V rows staged in shared memory: the whole chunk when it fits (every chunk of a split context does), else as many
  // leading rows as the opt-in limit leaves room for after the other buffers.
  const int smem_optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const size_t fixed = attention_smem_bytes(heads_per_block, head_dim, chunk_cap, 0);
  const size_t static_smem = 2048;  // m_s, l_s, w_s, the arrival flag and slack
  if (fixed + static_smem > static_cast<size_t>(smem_optin))
    throw EngineError("attention: context too long for shared memory");
  const size_t room_rows = (static_cast<size_t>(smem_optin) - fixed - static_smem) / (head_dim * sizeof(__half));
  const int stage_rows = static_cast<int>(std::min<size_t>(room_rows, std::min(chunk_cap, kAttnSinglePassMax)));
  const size_t smem = attention_smem_bytes(heads_per_block, head_dim, chunk_cap, stage_rows);
  detail::allow_dynamic_smem(k, smem);
  detail::launch_programmatic(k, dim3(n_heads / heads_per_block, p.max_splits), dim3(kAttnThreads), smem, s, q,
                              k_cache, v_cache, io, n_heads, n_kv_heads, chunk_cap, stage_rows, p, out);
}

void launch_attention_decode_short(const float* q, const __half* k_cache, const __half* v_cache, const DecodeIO* io,
                                   int n_heads, int n_kv_heads, int head_dim, int pos_cap, float* out,
                                   cudaStream_t s) {
  if (head_dim != kShortAttnHd) throw EngineError("short decode attention needs head_dim 64");
  if (n_kv_heads < 1 || n_heads % n_kv_heads != 0) throw EngineError("attention: unsupported head grouping");
  if (pos_cap < 1 || pos_cap > kShortAttnMaxPos) throw EngineError("short decode attention: bad capacity");
  const size_t smem = static_cast<size_t>(pos_cap) * (kShortAttnKStride + kShortAttnHd) * sizeof(__half) +
                      (score_slots(pos_cap) + kShortAttnHd + kShortAttnPvGroups * kShortAttnHd) * sizeof(float);
  detail::allow_dynamic_smem(attention_decode_short_kernel, smem);
  detail::launch_programmatic(attention_decode_short_kernel, dim3(n_heads), dim3(kShortAttnThreads), smem, s, q,
                              k_cache, v_cache, io, n_heads, n_kv_heads, pos_cap, out);
}

// The tensor-core kernel for a group of hpb query heads per KV head (1 .. 8), or null.
using TcdKernel = void (*)(const float*, const __half*, const __half*, const DecodeIO*, int, AttnScratch, float*);
TcdKernel tc_decode_kernel_for(int hpb) {
  switch (hpb) {
    case 1: return attention_decode_tc_kernel<1>;
    case 2: return attention_decode_tc_kernel<2>;
    case 3: return attention_decode_tc_kernel<3>;
    case 4: return attention_decode_tc_kernel<4>;
    case 5: return attention_decode_tc_kernel<5>;
    case 6: return attention_decode_tc_kernel<6>;
    case 7: return attention_decode_tc_kernel<7>;
    case 8: return attention_decode_tc_kernel<8>;
    default: return nullptr;
  }
}

bool tc_decode_attention_fits(int n_heads, int n_kv_heads, int head_dim, int n_ctx, int max_splits) {
  return head_dim == kTcdHd && n_kv_heads >= 1 && n_heads % n_kv_heads == 0 &&
         tc_decode_kernel_for(n_heads / n_kv_heads) != nullptr && max_splits >= 1 && max_splits <= kMaxAttnSplits &&
         attn_chunk_cap(n_ctx, max_splits) <= kTcDecodeMaxChunk;
}

void launch_attention_decode_tc(const float* q, const __half* k_cache, const __half* v_cache, const DecodeIO* io,
                                int n_heads, int n_kv_heads, int head_dim, int n_ctx, const AttnScratch& p,
                                float* out, cudaStream_t s) {
  if (!tc_decode_attention_fits(n_heads, n_kv_heads, head_dim, n_ctx, p.max_splits))
    throw EngineError("tensor-core decode attention: needs head_dim 64, at most 8 query heads per KV head and chunks "
                      "of at most " + std::to_string(kTcDecodeMaxChunk) + " positions");
  const TcdKernel k = tc_decode_kernel_for(n_heads / n_kv_heads);
  const size_t smem = sizeof(TcdSmem);
  detail::allow_dynamic_smem(k, smem);
  detail::launch_programmatic(k, dim3(n_kv_heads, p.max_splits), dim3(kTcdThreads), smem, s, q, k_cache, v_cache,
                              io, n_kv_heads, p, out);
}
}  // namespace metalattn::cuda
