// Prefill kernels: the glue around the tensor-core projections of a layer-major prompt pass (prompt_gemm.cu): norms
// and SiLU that emit the projections' inputs, RoPE + KV append of a whole chunk, causal attention over the prompt.
//
// Projection inputs are operand rows in the slot layout (kernels.cuh, store_operand): each value as fp16 hi + lo,
// so the fp16 rounding of the activations (about 2^-12 relative, which compounded to ~1e-3 on the logits of a
// 30-layer, 2048-token prompt) stays out of the products.
#include <algorithm>
#include <cmath>
#include <utility>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "wmma_frags.cuh"

namespace metalattn::cuda {

namespace {

using detail::store_operand;

__global__ void __launch_bounds__(256) rmsnorm_to_half_kernel(const float* __restrict__ x, int d,
                                                              const float* __restrict__ w, float eps,
                                                              __half* out) {
  __shared__ float red[32];
  detail::grid_dependency_wait();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += x[base + i] * x[base + i];
  const float total = detail::block_sum(ss, red);
  const float scale = 1.f / sqrtf(total / static_cast<float>(d) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    store_operand(x[base + i] * scale * w[i], blockIdx.x, i, d, out);
}

__global__ void rope_append_kernel(const float* __restrict__ qkv, int n, const int32_t* pos0_dev, int pos0_value,
                                   const float2* rope_table, int q_dim, int kv_dim, int head_dim, float* q_out,
                                   __half* k_cache, __half* v_cache) {
  detail::grid_dependency_wait();
  detail::launch_dependents();  // the attention may launch now; it waits for this grid before reading
  const int pos0 = pos0_dev != nullptr ? *pos0_dev : pos0_value;
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

__global__ void silu_to_half_kernel(const float* __restrict__ gate_up, int n, int d_ff, __half* out) {
  detail::grid_dependency_wait();
  const int64_t total = static_cast<int64_t>(n) * d_ff;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / d_ff;
    const int j = static_cast<int>(i % d_ff);
    const float g = gate_up[t * 2 * d_ff + j], u = gate_up[t * 2 * d_ff + d_ff + j];
    store_operand(g / (1.f + expf(-g)) * u, t, j, d_ff, out);
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
                                                                const __half* __restrict__ k_cache,
                                                                const __half* __restrict__ v_cache, int n,
                                                                const int32_t* pos0_dev, int pos0_value, int n_heads,
                                                                int n_kv_heads, int hd, __half* out) {
  extern __shared__ float4 smem_dyn[];
  float* q_s = reinterpret_cast<float*>(smem_dyn);  // [kQTile][hd]
  float* k_s = q_s + kQTile * hd;                   // [kKTile][hd + 1]: the pad makes per-lane rows conflict-free
  float* v_s = k_s + kKTile * (hd + 1);             // [kKTile][hd]
  detail::grid_dependency_wait();
  const int pos0 = pos0_dev != nullptr ? *pos0_dev : pos0_value;
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
      k_s[r * (hd + 1) + d] = key <= last_key ? __half2float(k_cache[src]) : 0.f;
      v_s[r * hd + d] = key <= last_key ? __half2float(v_cache[src]) : 0.f;
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
        store_operand(o[j][c] / l[j], q0 + qi, h * hd + lane + 32 * c, q_dim, out);
  }
}


// ------------------------------------------------------------------ tensor-core attention (head_dim 64)
// Flash-attention tiling on wmma fp16 tiles with fp32 accumulation. K and V are the cache's fp16 values, exact; the
// fp32 operands (Q, the probabilities P) are carried as a hi/lo pair (v = hi + lo) and each product as hi.K + lo.K,
// which keeps about 21 bits of them: plain fp16 would put ~1e-3 relative error on the scores and the output.
// A block: one query head, 64 queries, 4 warps of 16 query rows; it streams 64-key K/V tiles through shared
// memory. Scores live in log2 units (log2(e)/sqrt(64) is folded into Q) so the softmax uses exp2f.
constexpr int kTcHeadDim = 64;
constexpr int kTcRows = 16;  // query rows per warp: one wmma tile
constexpr int kTcWarps = 4;
constexpr int kTcQTile = kTcRows * kTcWarps;
constexpr int kTcKTile = 64;
constexpr int kTcHalfLd = kTcHeadDim + 8;  // 144-byte rows: 16-byte aligned, tiles at 32-byte multiples
constexpr int kTcFloatLd = kTcKTile + 4;

struct TcAttnSmem {
  __half k[kTcKTile][kTcHalfLd];  // the tile's K and V rows, fp16 as cached
  __half v[kTcKTile][kTcHalfLd];
  float s[kTcWarps][kTcRows][kTcFloatLd];               // scores, then the tile's P.V product
  __half p_hi[kTcWarps][kTcRows][kTcHalfLd], p_lo[kTcWarps][kTcRows][kTcHalfLd];  // Q staging, then P
};


// Where the kernel reads its queries and the chunk's keys: either roped q rows plus a cache that already holds the
// chunk (qkv == nullptr), or the raw QKV GEMM rows of the chunk, roped here; then the first query head of each KV
// head also appends its query tile's K (roped) / V rows to the cache. Keys before pos0 always come from the cache.
struct TcAttnArgs {
  const float* q = nullptr;    // [n][q_dim], roped
  const float* qkv = nullptr;  // [n][q_dim + 2 kv_dim], raw
  const float2* rope_table = nullptr;
  __half* k_cache = nullptr;  // fp16 (kernels.cuh, kv_store)
  __half* v_cache = nullptr;
  int n = 0;
  const int32_t* pos0_dev = nullptr;
  int pos0_value = 0;
  int n_heads = 0, n_kv_heads = 0;
  __half* out = nullptr;  // operand rows (store_operand)
};

__device__ __forceinline__ float4 rope4(float4 v, const float2* table_row, int c) {
  const float2 a = table_row[c / 2], b = table_row[c / 2 + 1];
  return make_float4(v.x * a.x - v.y * a.y, v.x * a.y + v.y * a.x, v.z * b.x - v.w * b.y, v.z * b.y + v.w * b.x);
}

__global__ void __launch_bounds__(kTcWarps * 32) attention_prefill_tc_kernel(const TcAttnArgs a) {
  extern __shared__ __align__(128) unsigned char tc_smem_raw[];
  TcAttnSmem& sm = *reinterpret_cast<TcAttnSmem*>(tc_smem_raw);
  detail::grid_dependency_wait();
  detail::launch_dependents();  // the next projection may load its weights now; it waits for this grid to finish
  const int pos0 = a.pos0_dev != nullptr ? *a.pos0_dev : a.pos0_value;
  const int n_heads = a.n_heads, group = n_heads / a.n_kv_heads;
  const int h = blockIdx.x, kvh = h / group;
  const int q0 = blockIdx.y * kTcQTile, q_count = min(kTcQTile, a.n - q0);
  const int q_dim = n_heads * kTcHeadDim, kv_dim = a.n_kv_heads * kTcHeadDim, qkv_rows = q_dim + 2 * kv_dim;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int w_row0 = warp * kTcRows, w_rows = max(0, min(kTcRows, q_count - w_row0));
  const float q_scale = 0.125f * 1.4426950408889634f;  // 1/sqrt(64) * log2(e)
  const __half* __restrict__ k_cache = a.k_cache;
  const __half* __restrict__ v_cache = a.v_cache;
  const float* __restrict__ qkv = a.qkv;
  constexpr int kHalfRow = kTcHeadDim / 2;  // rope table entries per position

  // This warp's 16 query rows as hi/lo A fragments (staged through its P buffers), one pair of dims per step.
  FragA qa_hi[kTcHeadDim / 16], qa_lo[kTcHeadDim / 16];
  for (int i = lane; i < kTcRows * kHalfRow; i += 32) {
    const int r = i / kHalfRow, c = 2 * (i % kHalfRow);
    float2 v = make_float2(0.f, 0.f);
    if (r < w_rows) {
      const int t = q0 + w_row0 + r;
      if (qkv == nullptr) {
        v = *reinterpret_cast<const float2*>(a.q + static_cast<int64_t>(t) * q_dim + h * kTcHeadDim + c);
      } else {
        const float2 raw = *reinterpret_cast<const float2*>(qkv + static_cast<int64_t>(t) * qkv_rows + h * kTcHeadDim + c);
        const float2 cs = a.rope_table[static_cast<int64_t>(pos0 + t) * kHalfRow + c / 2];
        v = make_float2(raw.x * cs.x - raw.y * cs.y, raw.x * cs.y + raw.y * cs.x);
      }
    }
    split_half(v.x * q_scale, sm.p_hi[warp][r][c], sm.p_lo[warp][r][c]);
    split_half(v.y * q_scale, sm.p_hi[warp][r][c + 1], sm.p_lo[warp][r][c + 1]);
  }
  if (qkv != nullptr && h % group == 0) {
    // Append this query tile's K/V rows: every other block reads the chunk's keys from qkv, never from these rows.
    for (int i = threadIdx.x; i < q_count * (kTcHeadDim / 4); i += blockDim.x) {
      const int t = q0 + i / (kTcHeadDim / 4), c = (i % (kTcHeadDim / 4)) * 4, pos = pos0 + t;
      const float* src = qkv + static_cast<int64_t>(t) * qkv_rows + q_dim + kvh * kTcHeadDim + c;
      const int64_t dst = static_cast<int64_t>(pos) * kv_dim + kvh * kTcHeadDim + c;
      *reinterpret_cast<uint2*>(a.k_cache + dst) = detail::kv_pack4(
          rope4(*reinterpret_cast<const float4*>(src), a.rope_table + static_cast<int64_t>(pos) * kHalfRow, c));
      *reinterpret_cast<uint2*>(a.v_cache + dst) = detail::kv_pack4(*reinterpret_cast<const float4*>(src + kv_dim));
    }
  }
  __syncwarp();
#pragma unroll
  for (int ks = 0; ks < kTcHeadDim / 16; ++ks) {
    wm::load_matrix_sync(qa_hi[ks], &sm.p_hi[warp][0][ks * 16], kTcHalfLd);
    wm::load_matrix_sync(qa_lo[ks], &sm.p_lo[warp][0][ks * 16], kTcHalfLd);
  }
  __syncwarp();

  // Softmax state: lane owns row r of the warp tile and the columns 2i + half (i < 32) of scores and output.
  const int r = lane >> 1, half = lane & 1;
  const bool row_ok = r < w_rows;
  const int qpos = pos0 + q0 + w_row0 + r;
  const int warp_last_qpos = pos0 + q0 + w_row0 + w_rows - 1;
  float m = -INFINITY, l = 0.f, o[kTcHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kTcHeadDim / 2; ++i) o[i] = 0.f;

  const int last_key = pos0 + q0 + q_count - 1;
  for (int kt = 0; kt <= last_key; kt += kTcKTile) {
    __syncthreads();  // the previous tile is no longer read
    for (int i = threadIdx.x; i < kTcKTile * (kTcHeadDim / 4); i += blockDim.x) {
      const int row = i / (kTcHeadDim / 4), c = (i % (kTcHeadDim / 4)) * 4, key = kt + row;
      uint2 kb = make_uint2(0u, 0u), vb = kb;  // keys past the last one: zero, never NaN garbage
      if (key <= last_key) {
        if (qkv == nullptr || key < pos0) {
          const int64_t src = static_cast<int64_t>(key) * kv_dim + kvh * kTcHeadDim + c;
          kb = *reinterpret_cast<const uint2*>(k_cache + src);
          vb = *reinterpret_cast<const uint2*>(v_cache + src);
        } else {  // the chunk's own keys, rounded as the cache holds them
          const float* src = qkv + static_cast<int64_t>(key - pos0) * qkv_rows + q_dim + kvh * kTcHeadDim + c;
          kb = detail::kv_pack4(
              rope4(*reinterpret_cast<const float4*>(src), a.rope_table + static_cast<int64_t>(key) * kHalfRow, c));
          vb = detail::kv_pack4(*reinterpret_cast<const float4*>(src + kv_dim));
        }
      }
      *reinterpret_cast<uint2*>(&sm.k[row][c]) = kb;
      *reinterpret_cast<uint2*>(&sm.v[row][c]) = vb;
    }
    __syncthreads();
    if (w_rows == 0 || kt > warp_last_qpos) continue;  // warp-uniform: the whole tile is masked for this warp

    // S = Q . K^T (16 x 64 for this warp)
#pragma unroll
    for (int j = 0; j < kTcKTile / 16; ++j) {
      FragAcc acc;
      wm::fill_fragment(acc, 0.f);
#pragma unroll
      for (int ks = 0; ks < kTcHeadDim / 16; ++ks) {
        FragBCol kb;
        wm::load_matrix_sync(kb, &sm.k[j * 16][ks * 16], kTcHalfLd);
        wm::mma_sync(acc, qa_hi[ks], kb, acc);
        wm::mma_sync(acc, qa_lo[ks], kb, acc);
      }
      wm::store_matrix_sync(&sm.s[warp][0][j * 16], acc, kTcFloatLd, wm::mem_row_major);
    }
    __syncwarp();

    // Online softmax over the tile (causal mask), P written as hi/lo fp16.
    float sv[kTcKTile / 2];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kTcKTile / 2; ++i) {
      const int col = 2 * i + half;
      sv[i] = row_ok && kt + col <= qpos ? sm.s[warp][r][col] : -INFINITY;
      mx = fmaxf(mx, sv[i]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet: all p = 0, no NaN
    const float corr = exp2f(m - m_ref);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kTcKTile / 2; ++i) {
      const float p = exp2f(sv[i] - m_ref);
      sum += p;
      split_half(p, sm.p_hi[warp][r][2 * i + half], sm.p_lo[warp][r][2 * i + half]);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * corr + sum;
    m = m_new;
#pragma unroll
    for (int i = 0; i < kTcHeadDim / 2; ++i) o[i] *= corr;
    __syncwarp();

    // O_tile = P . V (16 x 64), added to the running output.
    FragA pa_hi[kTcKTile / 16], pa_lo[kTcKTile / 16];
#pragma unroll
    for (int ks = 0; ks < kTcKTile / 16; ++ks) {
      wm::load_matrix_sync(pa_hi[ks], &sm.p_hi[warp][0][ks * 16], kTcHalfLd);
      wm::load_matrix_sync(pa_lo[ks], &sm.p_lo[warp][0][ks * 16], kTcHalfLd);
    }
#pragma unroll
    for (int j = 0; j < kTcHeadDim / 16; ++j) {
      FragAcc acc;
      wm::fill_fragment(acc, 0.f);
#pragma unroll
      for (int ks = 0; ks < kTcKTile / 16; ++ks) {
        FragBRow vb;
        wm::load_matrix_sync(vb, &sm.v[ks * 16][j * 16], kTcHalfLd);
        wm::mma_sync(acc, pa_hi[ks], vb, acc);
        wm::mma_sync(acc, pa_lo[ks], vb, acc);
      }
      wm::store_matrix_sync(&sm.s[warp][0][j * 16], acc, kTcFloatLd, wm::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kTcHeadDim / 2; ++i) o[i] += sm.s[warp][r][2 * i + half];
    __syncwarp();  // s and p are rewritten by the next tile
  }

  if (row_ok) {
    const float inv = 1.f / l;  // l > 0: the query's own key is always visible
    const int t = q0 + w_row0 + r;
#pragma unroll
    for (int i = 0; i < kTcHeadDim / 2; ++i)
      store_operand(o[i] * inv, t, h * kTcHeadDim + 2 * i + half, q_dim, a.out);
  }
}

// Every kernel here calls grid_dependency_wait() first, so all of them may launch programmatically.
template <typename... KernelArgs, typename... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  detail::launch_programmatic(kernel, grid, block, smem, s, std::forward<Args>(args)...);
}

int grid_for(int64_t total, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + threads - 1) / threads, 8192)));
}

void rope_append(const float* qkv, int n, const int32_t* pos0_dev, int pos0_value, const float2* rope_table, int q_dim,
                 int kv_dim, int head_dim, float* q_out, __half* k_cache, __half* v_cache, cudaStream_t s) {
  const int64_t total = static_cast<int64_t>(n) * ((q_dim + 2 * kv_dim) / 2);
  launch_pdl(rope_append_kernel, dim3(grid_for(total, 256)), dim3(256), 0, s, qkv, n, pos0_dev, pos0_value, rope_table,
             q_dim, kv_dim, head_dim, q_out, k_cache, v_cache);
}

void launch_tc(const TcAttnArgs& a, cudaStream_t s) {
  // Set once, before any graph capture could need it (a backend's first prefill of a length runs eagerly).
  static const bool smem_allowed = [] {
    CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_tc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(sizeof(TcAttnSmem))));
    return true;
  }();
  (void)smem_allowed;
  const dim3 grid(a.n_heads, (a.n + kTcQTile - 1) / kTcQTile);
  launch_pdl(attention_prefill_tc_kernel, grid, dim3(kTcWarps * 32), sizeof(TcAttnSmem), s, a);
}

void attention_prefill(const float* q, const __half* k_cache, const __half* v_cache, int n, const int32_t* pos0_dev,
                       int pos0_value, int n_heads, int n_kv_heads, int head_dim, __half* out, cudaStream_t s) {
  if (head_dim % 32 != 0 || head_dim > 32 * kMaxDimsPerLane)
    throw EngineError("prefill attention needs head_dim a multiple of 32, at most 128");
  if (head_dim == kTcHeadDim) {
    TcAttnArgs a;
    a.q = q;
    a.k_cache = const_cast<__half*>(k_cache);  // not written: qkv is null
    a.v_cache = const_cast<__half*>(v_cache);
    a.n = n;
    a.pos0_dev = pos0_dev;
    a.pos0_value = pos0_value;
    a.n_heads = n_heads;
    a.n_kv_heads = n_kv_heads;
    a.out = out;
    launch_tc(a, s);
    return;
  }
  const size_t smem = static_cast<size_t>(kQTile * head_dim + kKTile * (head_dim + 1) + kKTile * head_dim) * 4;
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  const dim3 grid(n_heads, (n + kQTile - 1) / kQTile);
  launch_pdl(attention_prefill_kernel, grid, dim3(256), smem, s, q, k_cache, v_cache, n, pos0_dev, pos0_value, n_heads,
             n_kv_heads, head_dim, out);
}

// The tensor-core attention's arguments when it starts from the raw QKV rows of a chunk (RoPE + KV append inside).
TcAttnArgs tc_args_from_qkv(const float* qkv, int n, const int32_t* pos0, const float2* rope_table, int n_heads,
                            int n_kv_heads, __half* k_cache, __half* v_cache, __half* out) {
  TcAttnArgs a;
  a.qkv = qkv;
  a.rope_table = rope_table;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.n = n;
  a.pos0_dev = pos0;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.out = out;
  return a;
}

}  // namespace

void launch_rmsnorm_to_half(const float* x, int n, int d, const float* w, float eps, __half* out, cudaStream_t s) {
  launch_pdl(rmsnorm_to_half_kernel, dim3(n), dim3(256), 0, s, x, d, w, eps, out);
}

void launch_rope_append(const float* qkv, int n, int pos0, const float2* rope_table, int q_dim, int kv_dim,
                        int head_dim, float* q_out, __half* k_cache, __half* v_cache, cudaStream_t s) {
  rope_append(qkv, n, nullptr, pos0, rope_table, q_dim, kv_dim, head_dim, q_out, k_cache, v_cache, s);
}

void launch_rope_append_at(const float* qkv, int n, const int32_t* pos0, const float2* rope_table, int q_dim,
                           int kv_dim, int head_dim, float* q_out, __half* k_cache, __half* v_cache, cudaStream_t s) {
  rope_append(qkv, n, pos0, 0, rope_table, q_dim, kv_dim, head_dim, q_out, k_cache, v_cache, s);
}

void launch_attention_prefill(const float* q, const __half* k_cache, const __half* v_cache, int n, int pos0,
                              int n_heads, int n_kv_heads, int head_dim, __half* out, cudaStream_t s) {
  attention_prefill(q, k_cache, v_cache, n, nullptr, pos0, n_heads, n_kv_heads, head_dim, out, s);
}

void launch_attention_prefill_at(const float* q, const __half* k_cache, const __half* v_cache, int n,
                                 const int32_t* pos0, int n_heads, int n_kv_heads, int head_dim, __half* out,
                                 cudaStream_t s) {
  attention_prefill(q, k_cache, v_cache, n, pos0, 0, n_heads, n_kv_heads, head_dim, out, s);
}

void launch_rope_attention_prefill(const float* qkv, int n, const int32_t* pos0, const float2* rope_table,
                                   int n_heads, int n_kv_heads, int head_dim, __half* k_cache, __half* v_cache,
                                   float* q_scratch, __half* out, cudaStream_t s) {
  if (head_dim != kTcHeadDim) {
    const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    rope_append(qkv, n, pos0, 0, rope_table, q_dim, kv_dim, head_dim, q_scratch, k_cache, v_cache, s);
    attention_prefill(q_scratch, k_cache, v_cache, n, pos0, 0, n_heads, n_kv_heads, head_dim, out, s);
    return;
  }
  launch_tc(tc_args_from_qkv(qkv, n, pos0, rope_table, n_heads, n_kv_heads, k_cache, v_cache, out), s);
}

void launch_silu_to_half(const float* gate_up, int n, int d_ff, __half* out, cudaStream_t s) {
  launch_pdl(silu_to_half_kernel, dim3(grid_for(static_cast<int64_t>(n) * d_ff, 256)), dim3(256), 0, s, gate_up, n, d_ff,
             out);
}

}  // namespace metalattn::cuda
