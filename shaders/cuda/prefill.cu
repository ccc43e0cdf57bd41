// Prefill kernels: the glue around the cuBLAS GEMMs of a layer-major prompt pass (norms and SiLU that emit the
// fp16 GEMM inputs, RoPE + KV append of a whole chunk, causal attention over the prompt).
//
// GEMM inputs are fp16. Where a `lo` buffer is given, a value v is written as hi = fp16(v) and
// lo = fp16(v - hi), and the caller runs the GEMM on both (W.hi + W.lo), which removes the activation rounding
// (about 2^-12 relative) and leaves only the fp16 rounding of the weights.
#include <algorithm>
#include <cmath>

#include "cuda/cuda_check.h"
#include "kernels.cuh"

namespace metalattn::cuda {

namespace {

__device__ __forceinline__ void store_split(float v, int64_t i, __half* hi, __half* lo) {
  const __half h = __float2half_rn(v);
  hi[i] = h;
  if (lo != nullptr) lo[i] = __float2half_rn(v - __half2float(h));
}

__global__ void __launch_bounds__(256) rmsnorm_to_half_kernel(const float* __restrict__ x, int d,
                                                              const float* __restrict__ w, float eps, __half* hi,
                                                              __half* lo) {
  __shared__ float red[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += x[base + i] * x[base + i];
  const float total = detail::block_sum(ss, red);
  const float scale = 1.f / sqrtf(total / static_cast<float>(d) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) store_split(x[base + i] * scale * w[i], base + i, hi, lo);
}

__global__ void rope_append_kernel(const float* __restrict__ qkv, int n, int pos0, const float2* rope_table,
                                   int q_dim, int kv_dim, int head_dim, float* q_out, float* k_cache,
                                   float* v_cache) {
  const int rows = q_dim + 2 * kv_dim, pairs = rows / 2;
  const int64_t total = static_cast<int64_t>(n) * pairs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(i / pairs), r0 = 2 * static_cast<int>(i % pairs);
    const float* src = qkv + static_cast<int64_t>(t) * rows + r0;
    detail::store_qkv_pair(r0, src[0], src[1], pos0 + t, rope_table, q_dim, kv_dim, head_dim,
                           q_out + static_cast<int64_t>(t) * q_dim, k_cache, v_cache);
  }
}

__global__ void silu_to_half_kernel(const float* __restrict__ gate_up, int n, int d_ff, __half* hi, __half* lo) {
  const int64_t total = static_cast<int64_t>(n) * d_ff;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / d_ff, j = i % d_ff;
    const float g = gate_up[t * 2 * d_ff + j], u = gate_up[t * 2 * d_ff + d_ff + j];
    store_split(g / (1.f + expf(-g)) * u, i, hi, lo);
  }
}

constexpr int kQTile = 32;         // queries per block (8 warps x 4)
constexpr int kKTile = 32;         // keys per shared-memory tile: one per lane when scoring
constexpr int kQueriesPerWarp = 4;
constexpr int kMaxDimsPerLane = 4;  // head_dim <= 128

// One block: one query head, kQTile consecutive queries; streams K/V tiles of the cache through shared memory
// with an online softmax per query (each warp owns 4 queries; a lane scores one key of the tile, then owns
// head_dim/32 output dimensions for the P.V product).
__global__ void __launch_bounds__(256) attention_prefill_kernel(const float* __restrict__ q,
                                                                const float* __restrict__ k_cache,
                                                                const float* __restrict__ v_cache, int n, int pos0,
                                                                int n_heads, int n_kv_heads, int hd, __half* out_hi,
                                                                __half* out_lo) {
  extern __shared__ float4 smem_dyn[];
  float* q_s = reinterpret_cast<float*>(smem_dyn);  // [kQTile][hd]
  float* k_s = q_s + kQTile * hd;                   // [kKTile][hd + 1]: the pad makes per-lane rows conflict-free
  float* v_s = k_s + kKTile * (hd + 1);             // [kKTile][hd]
  const int h = blockIdx.x, kvh = h / (n_heads / n_kv_heads);
  const int q0 = blockIdx.y * kQTile, q_count = min(kQTile, n - q0);
  const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd, dims_per_lane = hd / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = 1.f / sqrtf(static_cast<float>(hd));

  for (int i = threadIdx.x; i < kQTile * hd; i += blockDim.x) {
    const int r = i / hd, d = i % hd;
    q_s[i] = r < q_count ? q[static_cast<int64_t>(q0 + r) * q_dim + h * hd + d] : 0.f;
  }

  float m[kQueriesPerWarp], l[kQueriesPerWarp], o[kQueriesPerWarp][kMaxDimsPerLane];
#pragma unroll
  for (int j = 0; j < kQueriesPerWarp; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c) o[j][c] = 0.f;
  }

  const int last_key = pos0 + q0 + q_count - 1;
  for (int kt = 0; kt <= last_key; kt += kKTile) {
    __syncthreads();
    for (int i = threadIdx.x; i < kKTile * hd; i += blockDim.x) {
      const int r = i / hd, d = i % hd, key = kt + r;
      const int64_t src = static_cast<int64_t>(key) * kv_dim + kvh * hd + d;
      k_s[r * (hd + 1) + d] = key <= last_key ? k_cache[src] : 0.f;
      v_s[r * hd + d] = key <= last_key ? v_cache[src] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kQueriesPerWarp; ++j) {
      const int qi = warp + 8 * j;
      const int qpos = pos0 + q0 + qi;
      if (qi >= q_count || kt > qpos) continue;  // warp-uniform
      const int key = kt + lane;
      float s = -INFINITY;
      if (key <= qpos) {
        float dot = 0.f;
        const float* qr = q_s + qi * hd;
        const float* kr = k_s + lane * (hd + 1);
        for (int d = 0; d < hd; ++d) dot += qr[d] * kr[d];
        s = dot * scale;
      }
      const float m_new = fmaxf(m[j], detail::warp_max(s));
      const float corr = expf(m[j] - m_new);
      const float p = expf(s - m_new);
      l[j] = l[j] * corr + detail::warp_sum(p);
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c) o[j][c] *= corr;
      for (int t = 0; t < kKTile; ++t) {
        const float pt = __shfl_sync(0xffffffffu, p, t);
#pragma unroll
        for (int c = 0; c < kMaxDimsPerLane; ++c)
          if (c < dims_per_lane) o[j][c] += pt * v_s[t * hd + lane + 32 * c];
      }
      m[j] = m_new;
    }
  }

#pragma unroll
  for (int j = 0; j < kQueriesPerWarp; ++j) {
    const int qi = warp + 8 * j;
    if (qi >= q_count) continue;
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c)
      if (c < dims_per_lane)
        store_split(o[j][c] / l[j], static_cast<int64_t>(q0 + qi) * q_dim + h * hd + lane + 32 * c, out_hi, out_lo);
  }
}

int grid_for(int64_t total, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + threads - 1) / threads, 8192)));
}

}  // namespace

void launch_rmsnorm_to_half(const float* x, int n, int d, const float* w, float eps, __half* hi, __half* lo,
                            cudaStream_t s) {
  rmsnorm_to_half_kernel<<<n, 256, 0, s>>>(x, d, w, eps, hi, lo);
  CUDA_CHECK_LAUNCH();
}

void launch_rope_append(const float* qkv, int n, int pos0, const float2* rope_table, int q_dim, int kv_dim,
                        int head_dim, float* q_out, float* k_cache, float* v_cache, cudaStream_t s) {
  const int64_t total = static_cast<int64_t>(n) * ((q_dim + 2 * kv_dim) / 2);
  rope_append_kernel<<<grid_for(total, 256), 256, 0, s>>>(qkv, n, pos0, rope_table, q_dim, kv_dim, head_dim, q_out,
                                                          k_cache, v_cache);
  CUDA_CHECK_LAUNCH();
}

void launch_attention_prefill(const float* q, const float* k_cache, const float* v_cache, int n, int pos0,
                              int n_heads, int n_kv_heads, int head_dim, __half* out_hi, __half* out_lo,
                              cudaStream_t s) {
  if (head_dim % 32 != 0 || head_dim > 32 * kMaxDimsPerLane)
    throw EngineError("prefill attention needs head_dim a multiple of 32, at most 128");
  const size_t smem = static_cast<size_t>(kQTile * head_dim + kKTile * (head_dim + 1) + kKTile * head_dim) * 4;
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  const dim3 grid(n_heads, (n + kQTile - 1) / kQTile);
  attention_prefill_kernel<<<grid, 256, smem, s>>>(q, k_cache, v_cache, n, pos0, n_heads, n_kv_heads, head_dim,
                                                   out_hi, out_lo);
  CUDA_CHECK_LAUNCH();
}

void launch_silu_to_half(const float* gate_up, int n, int d_ff, __half* hi, __half* lo, cudaStream_t s) {
  silu_to_half_kernel<<<grid_for(static_cast<int64_t>(n) * d_ff, 256), 256, 0, s>>>(gate_up, n, d_ff, hi, lo);
  CUDA_CHECK_LAUNCH();
}

}  // namespace metalattn::cuda
