// The short-context decode attention's one-head body (every K and V row in shared memory), shared by the fused path's
// short decode attention kernel (decode_attention.cu, head_dim 64) and the general path's (arch.cu, head_dim 64 to
// 256). Its tests: CudaFused.DecodeAttentionShortContextEveryPosition, CudaArch.AttentionDecodeWithFusedQkvFinish and
// the decode tests of both paths.
#pragma once
#include <cuda_fp16.h>

#include "kernels.cuh"

namespace metalattn::cuda {

constexpr int kShortAttnThreads = 512;
constexpr int kShortAttnHd = 64;                     // the fused path's head_dim
// Padded fp16 K rows (HD + 16 values): the 16-byte loads of a quarter warp (4 positions x 2 halves) hit distinct
// banks.
template <int HD>
constexpr int short_attn_k_stride = HD + 16;
constexpr int kShortAttnKStride = short_attn_k_stride<kShortAttnHd>;
constexpr int kShortAttnPvGroups = kShortAttnThreads / 32;  // position groups (warps) of the P.V
static_assert(kShortAttnMaxPos % (kShortAttnThreads / 2) == 0, "whole passes of two threads per position");

// Score buffers hold a multiple of 4 floats, so the buffers after them stay 16-byte aligned for float4 access.
__host__ __device__ inline int score_slots(int pos_cap) { return (pos_cap + 3) / 4 * 4; }

// Copies cache rows first .. first + n - 1 of one KV head (K and V rows at k_head, v_head, kv_dim halves apart) into
// the shared layout attend_head<HD> reads, 16 bytes a cp.async by all kShortAttnThreads threads; complete after
// detail::cp_async_wait_all(). The decode kernels call it before their programmatic wait (rows of earlier steps).
template <int HD>
__device__ __forceinline__ void stage_kv_rows(__half* k_s, __half* v_s, const __half* k_head, const __half* v_head,
                                              int first, int n, int kv_dim) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks of a cache row
  for (int c = threadIdx.x; c < n * kChunks; c += kShortAttnThreads) {
    const int t = c / kChunks, j = c % kChunks;
    detail::cp_async16(k_s + t * short_attn_k_stride<HD> + 8 * j,
                       k_head + static_cast<int64_t>(first + t) * kv_dim + 8 * j);
    detail::cp_async16(v_s + t * HD + 8 * j, v_head + static_cast<int64_t>(first + t) * kv_dim + 8 * j);
  }
}

// Attention of one query head of head_dim HD (a multiple of 64, at most 256) over n_pos positions whose q (fp32),
// K rows (fp16, HD + 16 halves apart: the 16-byte loads of a quarter warp, 4 positions x 2 halves, hit distinct
// banks) and V rows (fp16) are all in shared memory; kShortAttnThreads threads. Scores (times `scale`): a thread pair
// per position (a pass per 256 positions), each half of the dot product (16-byte chunks of 8 values, 2c + half);
// softmax: one warp; P.V: a warp per position group (kShortAttnPvGroups) and a lane per column pair (4-byte loads of
// two fp16 values; HD / 64 pairs a lane), then a fixed-order sum. Returns output element threadIdx.x in threads < HD.
// sc: [n_pos], pv: [kShortAttnPvGroups][HD], sum_exp: one shared float. Starts and ends with all threads in step.
template <int HD>
__device__ __forceinline__ float attend_head(const float* q_s, const __half* k_s, const __half* v_s, int n_pos,
                                             float scale, float* sc, float* pv, float* sum_exp) {
  static_assert(HD % 64 == 0 && HD <= 256, "column pairs: a whole number a lane; output: a thread an element");
  constexpr int KS = short_attn_k_stride<HD>, PAIRS = HD / 64;
  const int tid = threadIdx.x;
  for (int base = 0; base < n_pos; base += kShortAttnThreads / 2) {  // every lane of a warp takes each pass
    const int t = base + (tid >> 1), half = tid & 1;
    float acc0 = 0.f, acc1 = 0.f;
    if (t < n_pos) {
      const uint4* k8 = reinterpret_cast<const uint4*>(k_s + t * KS);
      const float4* q4 = reinterpret_cast<const float4*>(q_s);
#pragma unroll
      for (int c = 0; c < HD / 16; ++c) {
        float4 ka, kb;
        detail::kv8(k8[2 * c + half], ka, kb);
        const float4 qa = q4[2 * (2 * c + half)], qb = q4[2 * (2 * c + half) + 1];
        acc0 += qa.x * ka.x + qa.y * ka.y + qa.z * ka.z + qa.w * ka.w;
        acc1 += qb.x * kb.x + qb.y * kb.y + qb.z * kb.z + qb.w * kb.w;
      }
    }
    float acc = acc0 + acc1;
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0 && t < n_pos) sc[t] = acc * scale;
  }
  __syncthreads();
  if (tid < 32) {
    const float l = detail::warp_exp_of_max(sc, n_pos, tid).y;
    if (tid == 0) *sum_exp = l;
  }
  __syncthreads();
  {
    constexpr int G = kShortAttnPvGroups;
    const int g = tid >> 5, lane = tid & 31;  // position group; the lane's column pairs lane + 32 j
    float2 acc0[PAIRS], acc1[PAIRS];
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) acc0[j] = acc1[j] = make_float2(0.f, 0.f);
    int t = g;
    for (; t + G < n_pos; t += 2 * G) {
      const float p0 = sc[t], p1 = sc[t + G];
      const __half2* v0 = reinterpret_cast<const __half2*>(v_s + t * HD);
      const __half2* v1 = reinterpret_cast<const __half2*>(v_s + (t + G) * HD);
#pragma unroll
      for (int j = 0; j < PAIRS; ++j) {
        const float2 a = __half22float2(v0[lane + 32 * j]), b = __half22float2(v1[lane + 32 * j]);
        acc0[j].x += p0 * a.x;
        acc0[j].y += p0 * a.y;
        acc1[j].x += p1 * b.x;
        acc1[j].y += p1 * b.y;
      }
    }
    if (t < n_pos) {
      const float p0 = sc[t];
      const __half2* v0 = reinterpret_cast<const __half2*>(v_s + t * HD);
#pragma unroll
      for (int j = 0; j < PAIRS; ++j) {
        const float2 a = __half22float2(v0[lane + 32 * j]);
        acc0[j].x += p0 * a.x;
        acc0[j].y += p0 * a.y;
      }
    }
#pragma unroll
    for (int j = 0; j < PAIRS; ++j)
      reinterpret_cast<float2*>(pv + g * HD)[lane + 32 * j] =
          make_float2(acc0[j].x + acc1[j].x, acc0[j].y + acc1[j].y);
  }
  __syncthreads();
  float o = 0.f;
  if (tid < HD) {
#pragma unroll
    for (int g = 0; g < kShortAttnPvGroups; ++g) o += pv[g * HD + tid];
    o /= *sum_exp;
  }
  return o;
}

// head_dim 64 at 1 / sqrt(64): the fused path's short decode attention (decode_attention.cu).
__device__ __forceinline__ float attend_head64(const float* q_s, const __half* k_s, const __half* v_s, int n_pos,
                                               float* sc, float* pv, float* sum_exp) {
  return attend_head<kShortAttnHd>(q_s, k_s, v_s, n_pos, 1.f / sqrtf(static_cast<float>(kShortAttnHd)), sc, pv,
                                   sum_exp);
}

}  // namespace metalattn::cuda
