// Kernels of the general-architecture path (arch.cuh): embedding with scale, the QKV finish (bias, QK-norm, RoPE,
// K/V append), attention with sliding window / any scale / head_dim up to 256, post-norm + residual, and the GLU
// activations. Written for clarity first: each is one simple pass over its data.
#include <algorithm>
#include <cmath>
#include <utility>

#include "arch.cuh"
#include "cuda/cuda_check.h"

namespace metalattn::cuda {

namespace {

using detail::grid_dependency_wait;
using detail::launch_dependents;

template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  detail::launch_programmatic(kernel, grid, block, smem, s, std::forward<Args>(args)...);
}

// ------------------------------------------------------------------ embedding

__global__ void __launch_bounds__(256) embed_scaled_kernel(DevMatrix E, const DecodeIO* io, const int32_t* tokens,
                                                           float scale, float* x) {
  launch_dependents();
  grid_dependency_wait();  // the previous step's kernels may still read x
  const int t = blockIdx.x;
  const int64_t token = tokens != nullptr ? tokens[t] : io->token;
  float* row = x + static_cast<int64_t>(t) * E.cols;
  for (int i = threadIdx.x; i < E.cols; i += blockDim.x) row[i] = detail::load_weight(E, token, i) * scale;
}

// ------------------------------------------------------------------ QKV finish

constexpr int kFinishWarps = 4;                       // one warp per head, four heads per block
constexpr int kFinishPairs = kArchMaxHeadDim / 2 / 32;  // RoPE pairs per lane at most

__global__ void __launch_bounds__(kFinishWarps * 32) qkv_finish_kernel(QkvFinishArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int head = blockIdx.x * kFinishWarps + warp;  // q heads, then k heads, then v heads
  const int t = blockIdx.y;
  launch_dependents();
  grid_dependency_wait();
  const int hd = a.head_dim, q_dim = a.n_heads * hd, kv_dim = a.n_kv_heads * hd, rows = q_dim + 2 * kv_dim;
  if (head >= a.n_heads + 2 * a.n_kv_heads) return;
  const int pos = *a.pos0 + t;
  const float* src = a.qkv + static_cast<int64_t>(t) * rows;
  const int64_t cache_row = static_cast<int64_t>(pos) * kv_dim;

  if (head >= a.n_heads + a.n_kv_heads) {  // v: bias only
    const int vh = head - a.n_heads - a.n_kv_heads;
    const int off = q_dim + kv_dim + vh * hd;
    float* dst = a.v_cache + cache_row + vh * hd;
    for (int i = lane; i < hd; i += 32) {
      float v = __ldcg(src + off + i);
      if (a.bias != nullptr) v += a.bias[off + i];
      dst[i] = v;
    }
    return;
  }

  const bool is_q = head < a.n_heads;
  const int off = is_q ? head * hd : q_dim + (head - a.n_heads) * hd;
  const float* norm_w = is_q ? a.q_norm : a.k_norm;
  float* dst = is_q ? a.q_out + static_cast<int64_t>(t) * q_dim + head * hd
                    : a.k_cache + cache_row + (head - a.n_heads) * hd;
  const int half = hd / 2;
  const bool neox = a.style == RopeStyle::Neox;
  // Lane owns pairs i = lane + 32 j: elements (i, i + half) in the NeoX layout, (2i, 2i + 1) interleaved.
  float va[kFinishPairs], vb[kFinishPairs];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kFinishPairs; ++j) {
    const int i = lane + 32 * j;
    va[j] = vb[j] = 0.f;
    if (i < half) {
      const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
      float x = __ldcg(src + off + ia), y = __ldcg(src + off + ib);
      if (a.bias != nullptr) {
        x += a.bias[off + ia];
        y += a.bias[off + ib];
      }
      va[j] = x;
      vb[j] = y;
      ss += x * x + y * y;
    }
  }
  float inv_rms = 1.f;
  if (norm_w != nullptr) {
    ss = detail::warp_sum(ss);
    inv_rms = 1.f / sqrtf(ss / static_cast<float>(hd) + a.eps);
  }
  const float2* cs_row = a.rope_table + static_cast<int64_t>(pos) * half;
#pragma unroll
  for (int j = 0; j < kFinishPairs; ++j) {
    const int i = lane + 32 * j;
    if (i >= half) continue;
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    float x = va[j], y = vb[j];
    if (norm_w != nullptr) {
      x = x * inv_rms * norm_w[ia];
      y = y * inv_rms * norm_w[ib];
    }
    const float2 cs = cs_row[i];
    dst[ia] = x * cs.x - y * cs.y;
    dst[ib] = x * cs.y + y * cs.x;
  }
}

// ------------------------------------------------------------------ attention

constexpr int kAttnWarpsArch = 8;
constexpr int kAttnThreadsArch = kAttnWarpsArch * 32;

// Writes output value v of query t (absolute row), column j.
__device__ __forceinline__ void store_attn(const ArchAttnArgs& a, int64_t t, int j, int q_dim, float v) {
  if (a.out != nullptr)
    a.out[t * q_dim + j] = v;
  else
    detail::store_operand(v, t, j, q_dim, a.split_operand, a.out_half);
}

// NC = head_dim / 32 (a lane owns dims c * 32 + lane), TQ queries per block, U positions in flight per warp.
// Warps take positions in turn (U at a time); for each, the warp's lanes sum q.k over their dims (one warp_sum per
// query), and every query that sees the position folds it into its own online softmax (running max m, sum l and
// the unnormalized output acc). The block's warps then meet in shared memory.
template <int NC, int TQ, int U>
__global__ void __launch_bounds__(kAttnThreadsArch) arch_attention_kernel(ArchAttnArgs a) {
  constexpr int HD = NC * 32;
  __shared__ float s_m[TQ][kAttnWarpsArch], s_l[TQ][kAttnWarpsArch];
  __shared__ float s_acc[TQ][kAttnWarpsArch][HD];
  __shared__ bool s_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.x;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const int q_dim = a.n_heads * HD, kv_dim = a.n_kv_heads * HD;
  const bool splitting = a.max_splits > 1;
  const int tile = splitting ? 0 : blockIdx.y;
  const int split = splitting ? blockIdx.y : 0;
  launch_dependents();
  grid_dependency_wait();

  const int t0 = tile * TQ;
  if (t0 >= a.n) return;
  const int nq = min(TQ, a.n - t0);
  const int p_first = *a.pos0 + t0, p_last = p_first + nq - 1;
  const int lo = a.window > 0 ? max(0, p_first - a.window + 1) : 0;  // the first query's first position
  const int n_vis = p_last + 1 - lo;
  const int n_splits = splitting ? min(a.max_splits, (n_vis + kArchAttnMinChunk - 1) / kArchAttnMinChunk) : 1;
  if (split >= n_splits) return;
  const int chunk = (n_vis + n_splits - 1) / n_splits;
  const int begin = lo + split * chunk, end = min(p_last + 1, begin + chunk);

  float q[TQ][NC];
#pragma unroll
  for (int t = 0; t < TQ; ++t)
#pragma unroll
    for (int c = 0; c < NC; ++c)
      q[t][c] = t < nq ? __ldcg(a.q + static_cast<int64_t>(t0 + t) * q_dim + h * HD + c * 32 + lane) : 0.f;
  float m[TQ], l[TQ], acc[TQ][NC];
#pragma unroll
  for (int t = 0; t < TQ; ++t) {
    m[t] = -INFINITY;
    l[t] = 0.f;
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[t][c] = 0.f;
  }
  const float* kb = a.k_cache + kvh * HD + lane;
  const float* vb = a.v_cache + kvh * HD + lane;

  for (int p0 = begin + warp * U; p0 < end; p0 += kAttnWarpsArch * U) {
    float kr[U][NC], vr[U][NC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + u;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        kr[u][c] = p < end ? __ldcg(kb + static_cast<int64_t>(p) * kv_dim + c * 32) : 0.f;
        vr[u][c] = p < end ? __ldcg(vb + static_cast<int64_t>(p) * kv_dim + c * 32) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + u;
      if (p >= end) break;  // warp-uniform
#pragma unroll
      for (int t = 0; t < TQ; ++t) {
        if (t >= nq) break;
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c) dot += q[t][c] * kr[u][c];
        const float s = detail::warp_sum(dot) * a.scale;
        const int pt = p_first + t;
        const int lo_t = a.window > 0 ? max(0, pt - a.window + 1) : 0;
        if (p < lo_t || p > pt) continue;  // masked for this query (warp-uniform)
        const float m_new = fmaxf(m[t], s);
        const float corr = expf(m[t] - m_new);  // 0 while m was -inf
        const float e = expf(s - m_new);
        l[t] = l[t] * corr + e;
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[t][c] = acc[t][c] * corr + e * vr[u][c];
        m[t] = m_new;
      }
    }
  }

#pragma unroll
  for (int t = 0; t < TQ; ++t) {
    if (lane == 0) {
      s_m[t][warp] = m[t];
      s_l[t][warp] = l[t];
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) s_acc[t][warp][c * 32 + lane] = acc[t][c];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nq * HD; i += blockDim.x) {
    const int t = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarpsArch; ++w) mx = fmaxf(mx, s_m[t][w]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarpsArch; ++w) {
      const float f = s_m[t][w] == -INFINITY ? 0.f : expf(s_m[t][w] - mx);
      sum += s_l[t][w] * f;
      o += s_acc[t][w][d] * f;
    }
    if (!splitting) {
      store_attn(a, t0 + t, h * HD + d, q_dim, o / sum);
    } else {
      const int64_t slot = static_cast<int64_t>(h) * a.max_splits + split;
      a.part_o[slot * HD + d] = o;
      if (d == 0) {
        a.part_ml[slot * 2] = mx;
        a.part_ml[slot * 2 + 1] = sum;
      }
    }
  }
  if (!splitting) return;

  // The last of the head's n_splits blocks combines the partials (and re-arms the counter).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&a.counters[h], 1u) == static_cast<unsigned>(n_splits - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int64_t slot0 = static_cast<int64_t>(h) * a.max_splits;
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float mx = -INFINITY;
    for (int sp = 0; sp < n_splits; ++sp) mx = fmaxf(mx, __ldcg(a.part_ml + (slot0 + sp) * 2));
    float sum = 0.f, o = 0.f;
    for (int sp = 0; sp < n_splits; ++sp) {
      const float ms = __ldcg(a.part_ml + (slot0 + sp) * 2);
      const float f = ms == -INFINITY ? 0.f : expf(ms - mx);
      sum += __ldcg(a.part_ml + (slot0 + sp) * 2 + 1) * f;
      o += __ldcg(a.part_o + (slot0 + sp) * HD + d) * f;
    }
    store_attn(a, t0, h * HD + d, q_dim, o / sum);
  }
  if (threadIdx.x == 0) a.counters[h] = 0u;
}

// ------------------------------------------------------------------ post-norm + residual, GLU

__global__ void __launch_bounds__(256) add_normed_kernel(const float* y, const float* w, float eps, int d, float* x) {
  __shared__ float red[32];
  launch_dependents();
  grid_dependency_wait();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d;
  float scale = 1.f;
  if (w != nullptr) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      const float v = __ldcg(y + base + i);
      ss += v * v;
    }
    const float total = detail::block_sum(ss, red);
    scale = 1.f / sqrtf(total / static_cast<float>(d) + eps);
  }
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = __ldcg(y + base + i);
    x[base + i] = __ldcg(x + base + i) + (w != nullptr ? v * scale * w[i] : v);
  }
}

__global__ void __launch_bounds__(256) glu_kernel(const float* gate_up, int n, int d_ff, int gelu, float* out,
                                                  bool split_operand, __half* out_half) {
  launch_dependents();
  grid_dependency_wait();
  const int64_t total = static_cast<int64_t>(n) * d_ff;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / d_ff;
    const int j = static_cast<int>(i % d_ff);
    const float g = __ldcg(gate_up + t * 2 * d_ff + j), up = __ldcg(gate_up + t * 2 * d_ff + d_ff + j);
    float v;
    if (gelu) {
      const float u = 0.7978845608028654f * g * (1.f + 0.044715f * g * g);
      v = 0.5f * g * (1.f + tanhf(u)) * up;
    } else {
      v = g / (1.f + expf(-g)) * up;
    }
    if (out != nullptr)
      out[i] = v;
    else
      detail::store_operand(v, t, j, d_ff, split_operand, out_half);
  }
}

int grid_for(int64_t total, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + threads - 1) / threads, 8192)));
}

// Decode: one query, U = 4 positions in flight per warp. Prompts: TQ queries per block sharing each K/V row (8 for
// head_dim <= 128, 4 beyond, which keeps q and the accumulators in registers), U = 2.
using AttnFn = void (*)(ArchAttnArgs);
template <int NC>
AttnFn attn_kernel_for(bool decode) {
  constexpr int kTq = NC <= 4 ? 8 : 4;
  return decode ? arch_attention_kernel<NC, 1, 4> : arch_attention_kernel<NC, kTq, 2>;
}
int attn_tile(int head_dim, bool decode) { return decode ? 1 : head_dim <= 128 ? 8 : 4; }

}  // namespace

std::vector<float2> rope_table_host(int n_ctx, int head_dim, float base, float scale, const float* factors) {
  const int half = head_dim / 2;
  std::vector<float2> table(static_cast<size_t>(n_ctx) * half);
  for (int i = 0; i < half; ++i) {
    const double inv_freq = std::pow(static_cast<double>(base), -2.0 * i / head_dim);
    for (int p = 0; p < n_ctx; ++p) {
      double theta = static_cast<double>(p) * scale * inv_freq;
      if (factors != nullptr) theta /= factors[i];
      table[static_cast<size_t>(p) * half + i] =
          make_float2(static_cast<float>(std::cos(theta)), static_cast<float>(std::sin(theta)));
    }
  }
  return table;
}

void launch_embed_scaled(const DevMatrix& emb, const DecodeIO* io, const int32_t* tokens, int n, float scale, float* x,
                         cudaStream_t s) {
  if (tokens == nullptr && (io == nullptr || n != 1)) throw EngineError("embedding: one token from DecodeIO");
  if (n < 1) throw EngineError("embedding: no tokens");
  launch(embed_scaled_kernel, dim3(n), dim3(256), 0, s, emb, io, tokens, scale, x);
}

void launch_qkv_finish(const QkvFinishArgs& a, cudaStream_t s) {
  if (a.head_dim % 32 != 0 || a.head_dim < 32 || a.head_dim > kArchMaxHeadDim)
    throw EngineError("qkv finish: head_dim must be a multiple of 32, at most 256");
  if (a.n < 1 || a.n_kv_heads < 1 || a.n_heads % a.n_kv_heads != 0) throw EngineError("qkv finish: bad geometry");
  if ((a.q_norm == nullptr) != (a.k_norm == nullptr)) throw EngineError("qkv finish: QK-norm needs both weights");
  const int heads = a.n_heads + 2 * a.n_kv_heads;
  launch(qkv_finish_kernel, dim3((heads + kFinishWarps - 1) / kFinishWarps, a.n), dim3(kFinishWarps * 32), 0, s, a);
}

void launch_arch_attention(const ArchAttnArgs& a, cudaStream_t s) {
  if (a.head_dim % 32 != 0 || a.head_dim < 32 || a.head_dim > kArchMaxHeadDim)
    throw EngineError("attention: head_dim must be a multiple of 32, at most 256");
  if (a.n < 1 || a.n_kv_heads < 1 || a.n_heads % a.n_kv_heads != 0) throw EngineError("attention: bad geometry");
  if ((a.out == nullptr) == (a.out_half == nullptr)) throw EngineError("attention: exactly one output");
  if (a.max_splits < 1 || a.max_splits > kArchAttnMaxSplits) throw EngineError("attention: bad split capacity");
  if (a.max_splits > 1 && (a.n != 1 || a.part_o == nullptr || a.part_ml == nullptr || a.counters == nullptr))
    throw EngineError("attention: the context split serves one query and needs its scratch");
  const bool decode = a.n == 1;
  AttnFn k = nullptr;
  switch (a.head_dim / 32) {
    case 1: k = attn_kernel_for<1>(decode); break;
    case 2: k = attn_kernel_for<2>(decode); break;
    case 3: k = attn_kernel_for<3>(decode); break;
    case 4: k = attn_kernel_for<4>(decode); break;
    case 5: k = attn_kernel_for<5>(decode); break;
    case 6: k = attn_kernel_for<6>(decode); break;
    case 7: k = attn_kernel_for<7>(decode); break;
    case 8: k = attn_kernel_for<8>(decode); break;
  }
  const int tq = attn_tile(a.head_dim, decode);
  const int grid_y = a.max_splits > 1 ? a.max_splits : (a.n + tq - 1) / tq;
  launch(k, dim3(a.n_heads, grid_y), dim3(kAttnThreadsArch), 0, s, a);
}

void launch_add_normed(const float* y, const float* w, float eps, int n, int d, float* x, cudaStream_t s) {
  if (n < 1 || d < 1) throw EngineError("add_normed: bad geometry");
  launch(add_normed_kernel, dim3(n), dim3(256), 0, s, y, w, eps, d, x);
}

void launch_glu(const float* gate_up, int n, int d_ff, Activation act, float* out, bool split_operand,
                __half* out_half, cudaStream_t s) {
  if ((out == nullptr) == (out_half == nullptr)) throw EngineError("glu: exactly one output");
  launch(glu_kernel, dim3(grid_for(static_cast<int64_t>(n) * d_ff, 256)), dim3(256), 0, s, gate_up, n, d_ff,
         act == Activation::GeluTanh ? 1 : 0, out, split_operand, out_half);
}

}  // namespace metalattn::cuda
