// Kernels of the general-architecture path (arch.cuh): embedding with scale, the QKV finish (bias, QK-norm, RoPE,
// K/V append), attention with sliding window / any scale / head_dim up to 256, post-norm + residual, and the GLU
// activations. Written for clarity first: each is one simple pass over its data.
#include <algorithm>
#include <cmath>
#include <utility>

#include "arch.cuh"
#include "cuda/cuda_check.h"
#include "short_attention.cuh"
#include "trace.cuh"

namespace metalattn::cuda {

METALATTN_TRACE_UNIT(arch)

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

// One head of the QKV projection finished by one warp: bias, RMS norm (q and k heads with QK-norm), RoPE (q and k).
// Lane owns pairs i = lane + 32 j: elements (i, i + half) in the NeoX layout, (2i, 2i + 1) interleaved (and for v).
// prefetch() loads what does not depend on the projection (biases, norm weights, RoPE factors at `pos`), so kernels
// call it before their programmatic wait; finish() then reads the raw head and writes the finished one.
enum HeadKind : int { kHeadQ = 0, kHeadK = 1, kHeadV = 2 };
struct HeadFinish {
  float ba[kFinishPairs], bb[kFinishPairs], wa[kFinishPairs], wb[kFinishPairs];
  float2 cs[kFinishPairs];
  int kind, off, half;
  bool neox, norm;

  // head: index among the heads of its kind.
  __device__ __forceinline__ void prefetch(const QkvFinishArgs& a, HeadKind k, int head, int pos, int lane) {
    const int hd = a.head_dim, q_dim = a.n_heads * hd, kv_dim = a.n_kv_heads * hd;
    kind = k;
    half = hd / 2;
    off = k == kHeadQ ? head * hd : k == kHeadK ? q_dim + head * hd : q_dim + kv_dim + head * hd;
    neox = a.style == RopeStyle::Neox && k != kHeadV;
    const float* norm_w = k == kHeadQ ? a.q_norm : k == kHeadK ? a.k_norm : nullptr;
    norm = norm_w != nullptr;
#pragma unroll
    for (int j = 0; j < kFinishPairs; ++j) {
      const int i = lane + 32 * j;
      ba[j] = bb[j] = 0.f;
      wa[j] = wb[j] = 1.f;
      cs[j] = make_float2(1.f, 0.f);
      if (i >= half) continue;
      const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
      if (a.bias != nullptr) {
        ba[j] = a.bias[off + ia];
        bb[j] = a.bias[off + ib];
      }
      if (norm) {
        wa[j] = norm_w[ia];
        wb[j] = norm_w[ib];
      }
      if (k != kHeadV) cs[j] = a.rope_table[static_cast<int64_t>(pos) * half + i];
    }
  }

  __device__ static __forceinline__ void put(float* p, float v) { *p = v; }
  __device__ static __forceinline__ void put(__half* p, float v) { *p = detail::kv_store(v); }

  // row: the token's raw projection row (q_dim + 2 kv_dim floats); dst: the head's hd outputs (fp32 rows, or fp16
  // cache rows).
  template <typename T>
  __device__ __forceinline__ void finish(const float* row, float eps, T* dst, int lane) const {
    const float* src = row + off;
    float va[kFinishPairs], vb[kFinishPairs];
    // Every load first and none under a branch (pairs past the head read element 0 and are dropped): loads of the
    // previous kernel's output (__ldcg) inside `if (i < half)` were issued a pair at a time, each pair's use waiting
    // for it, i.e. four L2 round trips in a row at head_dim 256 (q's finish in Gemma 3's decode attention ended 1.3 us
    // after its first load returned; this form saved 0.55 us a layer: NOTES, "CUDA, session 28").
#pragma unroll
    for (int j = 0; j < kFinishPairs; ++j) {
      const int i = lane + 32 * j;
      const bool live = i < half;
      const int ia = !live ? 0 : neox ? i : 2 * i, ib = !live ? 0 : neox ? i + half : 2 * i + 1;
      va[j] = __ldcg(src + ia);
      vb[j] = __ldcg(src + ib);
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kFinishPairs; ++j) {
      const bool live = lane + 32 * j < half;
      va[j] = live ? va[j] + ba[j] : 0.f;
      vb[j] = live ? vb[j] + bb[j] : 0.f;
      ss += va[j] * va[j] + vb[j] * vb[j];
    }
    float inv_rms = 1.f;
    if (norm) {
      ss = detail::warp_sum(ss);
      inv_rms = 1.f / sqrtf(ss / static_cast<float>(2 * half) + eps);
    }
#pragma unroll
    for (int j = 0; j < kFinishPairs; ++j) {
      const int i = lane + 32 * j;
      if (i >= half) continue;
      const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
      float x = va[j], y = vb[j];
      if (norm) {
        x = x * inv_rms * wa[j];
        y = y * inv_rms * wb[j];
      }
      if (kind == kHeadV) {
        put(dst + ia, x);
        put(dst + ib, y);
      } else {
        put(dst + ia, x * cs[j].x - y * cs[j].y);
        put(dst + ib, x * cs[j].y + y * cs[j].x);
      }
    }
  }
};

__global__ void __launch_bounds__(kFinishWarps * 32) qkv_finish_kernel(QkvFinishArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int head = blockIdx.x * kFinishWarps + warp;  // q heads, then k heads, then v heads
  const int t = blockIdx.y;
  launch_dependents();
  const int hd = a.head_dim, q_dim = a.n_heads * hd, kv_dim = a.n_kv_heads * hd;
  const bool valid = head < a.n_heads + 2 * a.n_kv_heads;
  const HeadKind kind = head < a.n_heads ? kHeadQ : head < a.n_heads + a.n_kv_heads ? kHeadK : kHeadV;
  const int index = kind == kHeadQ ? head : kind == kHeadK ? head - a.n_heads : head - a.n_heads - a.n_kv_heads;
  // The position (and a batch row's slot) was written before this graph or launch sequence started.
  const int pos = a.rows.pos != nullptr ? a.rows.pos[t] : *a.pos0 + t;
  HeadFinish f;
  if (valid) f.prefetch(a, kind, index, pos, lane);
  grid_dependency_wait();
  if (!valid) return;
  const int64_t cache_row = static_cast<int64_t>(pos) * kv_dim + (a.rows.slot != nullptr ? a.rows.slot[t] * a.rows.slot_stride : 0);
  const float* row = a.qkv + static_cast<int64_t>(t) * (q_dim + 2 * kv_dim);
  if (kind == kHeadQ)
    f.finish(row, a.eps, a.q_out + static_cast<int64_t>(t) * q_dim + index * hd, lane);
  else
    f.finish(row, a.eps, (kind == kHeadK ? a.k_cache : a.v_cache) + cache_row + index * hd, lane);
}

// ------------------------------------------------------------------ attention

constexpr int kAttnWarpsArch = 8;
constexpr int kAttnThreadsArch = kAttnWarpsArch * 32;

// Writes output value v of query t (absolute row), column j.
__device__ __forceinline__ void store_attn(const ArchAttnArgs& a, int64_t t, int j, int q_dim, float v) {
  if (a.out != nullptr)
    a.out[t * q_dim + j] = v;
  else
    detail::store_operand(v, t, j, q_dim, a.out_half);
}

// NC = head_dim / 32 (a lane owns dims c * 32 + lane), TQ queries per block, U positions in flight per warp.
// Warps take positions in turn (U at a time); for each, the warp's lanes sum q.k over their dims (one warp_sum per
// query), and each query folds the group's positions it sees into its own online softmax (running max m, sum l and
// the unnormalized output acc), one update per group. The block's warps then meet in shared memory.
// Before the programmatic wait each warp loads the cache rows of its first U positions that lie before *pos0 (written
// by earlier steps or chunks; *pos0 itself is written before the graph or launch sequence starts): after the wait
// only q and the rows of the current tokens come from memory.
template <int NC, int TQ, int U>
__global__ void __launch_bounds__(kAttnThreadsArch) arch_attention_kernel(ArchAttnArgs a) {
  constexpr int HD = NC * 32;
  static_assert(kArchAttnMaxSplits <= 64, "the combine holds two splits per lane of one warp");
  __shared__ float s_m[TQ][kAttnWarpsArch], s_l[TQ][kAttnWarpsArch];
  __shared__ float s_acc[TQ][kAttnWarpsArch][HD];
  __shared__ float s_w[kArchAttnMaxSplits];
  __shared__ float s_sum;
  __shared__ float s_fin[TQ == 1 ? 3 : 1][HD];  // fused finish: q, and k, v of the current position
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.x;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const int q_dim = a.n_heads * HD, kv_dim = a.n_kv_heads * HD;
  const bool splitting = a.max_splits > 1;
  const int tile = splitting ? 0 : blockIdx.y;
  const int split = splitting ? blockIdx.y : 0;
  KernelTrace trace(kTraceAttention);
  launch_dependents();

  const int t0 = tile * TQ;
  // A batch row (TQ == 1) at its own position: pos0 + t0 is that position (p_first below).
  const bool batch = a.rows.pos != nullptr;
  const int pos0 = batch ? (t0 < a.n ? a.rows.pos[t0] - t0 : 0) : *a.pos0;
  const int64_t slot_off = batch && a.rows.slot != nullptr && t0 < a.n ? a.rows.slot[t0] * a.rows.slot_stride : 0;
  const int nq = min(TQ, a.n - t0);
  const int p_first = pos0 + t0, p_last = p_first + nq - 1;
  // Cache rows before this are earlier steps' or chunks' (loaded before the programmatic wait); from it on, this
  // launch's predecessor (or, fused, this block) writes them. A decode step or batch row: its own position.
  const int written_before = batch ? p_first : pos0;
  const int lo = a.window > 0 ? max(0, p_first - a.window + 1) : 0;  // the first query's first position
  const int n_vis = p_last + 1 - lo;
  const int n_splits = splitting ? min(a.max_splits, (n_vis + kArchAttnMinChunk - 1) / kArchAttnMinChunk) : 1;
  if (t0 >= a.n || split >= n_splits) {
    grid_dependency_wait();
    return;
  }
  const int chunk = (n_vis + n_splits - 1) / n_splits;
  const int begin = lo + split * chunk, end = min(p_last + 1, begin + chunk);
  const __half* kb = a.k_cache + slot_off + kvh * HD + lane;
  const __half* vb = a.v_cache + slot_off + kvh * HD + lane;
  // Fused finish (decode): warp 0 finishes q, and in the block that covers the position warps 1 and 2 its k and v.
  const bool fused = TQ == 1 && a.fused_finish;
  const bool covers_pos = end == p_last + 1;
  const bool finisher = fused && (warp == 0 || (covers_pos && warp <= 2));
  HeadFinish fin;
  if (finisher)
    fin.prefetch(a.finish, warp == 0 ? kHeadQ : warp == 1 ? kHeadK : kHeadV, warp == 0 ? h : kvh, p_first, lane);
  const int p_start = begin + warp * U;  // this warp's first positions
  float kr[U][NC], vr[U][NC];
  {
    // Loaded as fp16 and widened after the wait: a conversion before it would hold the warp until the loads land.
    __half kh[U][NC], vh[U][NC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p_start + u;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const bool early = p < end && p < written_before;
        kh[u][c] = early ? __ldcg(kb + static_cast<int64_t>(p) * kv_dim + c * 32) : __float2half_rn(0.f);
        vh[u][c] = early ? __ldcg(vb + static_cast<int64_t>(p) * kv_dim + c * 32) : __float2half_rn(0.f);
      }
    }
    grid_dependency_wait();
    trace.released();
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        kr[u][c] = __half2float(kh[u][c]);
        vr[u][c] = __half2float(vh[u][c]);
      }
  }

  if (fused) {
    if (finisher)
      fin.finish(a.finish.qkv + static_cast<int64_t>(t0) * (q_dim + 2 * kv_dim), a.finish.eps,
                 s_fin[TQ == 1 ? warp : 0], lane);
    __syncthreads();
    if (covers_pos && h % (a.n_heads / a.n_kv_heads) == 0) {  // one block per KV head appends k, v
      const int64_t row = slot_off + static_cast<int64_t>(p_first) * kv_dim + kvh * HD;
      for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        a.finish.k_cache[row + i] = detail::kv_store(s_fin[TQ == 1 ? 1 : 0][i]);
        a.finish.v_cache[row + i] = detail::kv_store(s_fin[TQ == 1 ? 2 : 0][i]);
      }
    }
  }
  float q[TQ][NC];
#pragma unroll
  for (int t = 0; t < TQ; ++t)
#pragma unroll
    for (int c = 0; c < NC; ++c)
      q[t][c] = t >= nq ? 0.f
                : fused ? s_fin[0][c * 32 + lane]
                        : __ldcg(a.q + static_cast<int64_t>(t0 + t) * q_dim + h * HD + c * 32 + lane);
  float m[TQ], l[TQ], acc[TQ][NC];
#pragma unroll
  for (int t = 0; t < TQ; ++t) {
    m[t] = -INFINITY;
    l[t] = 0.f;
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[t][c] = 0.f;
  }

  for (int p0 = p_start; p0 < end; p0 += kAttnWarpsArch * U) {
    const bool first = p0 == p_start;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + u;
      if (first && p < written_before) continue;  // loaded before the wait
      if (fused && p == p_first) {  // this step's k, v: finished above, in shared memory (as the cache holds them)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          kr[u][c] = detail::kv_round(s_fin[TQ == 1 ? 1 : 0][c * 32 + lane]);
          vr[u][c] = detail::kv_round(s_fin[TQ == 1 ? 2 : 0][c * 32 + lane]);
        }
        continue;
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        kr[u][c] = p < end ? __half2float(__ldcg(kb + static_cast<int64_t>(p) * kv_dim + c * 32)) : 0.f;
        vr[u][c] = p < end ? __half2float(__ldcg(vb + static_cast<int64_t>(p) * kv_dim + c * 32)) : 0.f;
      }
    }
    // Per query: the group's U scores first (independent dot products and warp sums), then one online-softmax update
    // for the group, whose U + 1 exps are independent; folding position by position made each score wait for the
    // previous position's two exps (NOTES, "CUDA, session 14").
#pragma unroll
    for (int t = 0; t < TQ; ++t) {
      if (t >= nq) break;
      const int pt = p_first + t;
      const int lo_t = a.window > 0 ? max(0, pt - a.window + 1) : 0;
      float s[U];
      float m_grp = -INFINITY;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u;
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c) dot += q[t][c] * kr[u][c];
        s[u] = detail::warp_sum(dot) * a.scale;
        if (p >= end || p < lo_t || p > pt) s[u] = -INFINITY;  // past the chunk, or masked for this query
        m_grp = fmaxf(m_grp, s[u]);
      }
      if (m_grp == -INFINITY) continue;  // nothing this query sees in the group (warp-uniform)
      const float m_new = fmaxf(m[t], m_grp);
      const float corr = expf(m[t] - m_new);  // 0 while m was -inf
      float e[U], e_sum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        e[u] = expf(s[u] - m_new);  // 0 where s is -inf
        e_sum += e[u];
      }
      l[t] = l[t] * corr + e_sum;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float pv = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) pv += e[u] * vr[u][c];
        acc[t][c] = acc[t][c] * corr + pv;
      }
      m[t] = m_new;
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
  if (!detail::last_block_to_arrive(&a.counters[h], n_splits)) return;
  const int64_t slot0 = static_cast<int64_t>(h) * a.max_splits;
  if (warp == 0) {  // the splits' weights exp(m_s - max) and the total sum, one warp, two splits per lane
    const float m0 = lane < n_splits ? __ldcg(a.part_ml + (slot0 + lane) * 2) : -INFINITY;
    const float l0 = lane < n_splits ? __ldcg(a.part_ml + (slot0 + lane) * 2 + 1) : 0.f;
    const float m1 = lane + 32 < n_splits ? __ldcg(a.part_ml + (slot0 + lane + 32) * 2) : -INFINITY;
    const float l1 = lane + 32 < n_splits ? __ldcg(a.part_ml + (slot0 + lane + 32) * 2 + 1) : 0.f;
    const float mx = detail::warp_max(fmaxf(m0, m1));
    const float f0 = m0 == -INFINITY ? 0.f : expf(m0 - mx), f1 = m1 == -INFINITY ? 0.f : expf(m1 - mx);
    const float sum = detail::warp_sum(l0 * f0 + l1 * f1);
    if (lane < n_splits) s_w[lane] = f0;
    if (lane + 32 < n_splits) s_w[lane + 32] = f1;
    if (lane == 0) s_sum = sum;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float o = 0.f;
#pragma unroll 8
    for (int sp = 0; sp < n_splits; ++sp) o += s_w[sp] * __ldcg(a.part_o + (slot0 + sp) * HD + d);
    store_attn(a, t0, h * HD + d, q_dim, o / s_sum);
  }
  if (threadIdx.x == 0) a.counters[h] = 0u;
}

// Decode attention of one query with every visible K/V row in shared memory (the general path's short regime): one
// kShortAttnThreads block per query head. Before the programmatic wait the block copies the rows of the positions
// before this one (earlier steps') into shared memory; after it, warps 0-2 finish q and this position's k and v from
// the raw QKV row (HeadFinish, as the split kernel's fused finish), the first query head of each KV head appends k
// and v to the caches, and attend_head does the rest with no split and no combine. Visible positions (the window's)
// at most pos_cap (arch_short_attention_cap), else the kernel traps.
template <int HD>
__global__ void __launch_bounds__(kShortAttnThreads) arch_attention_short_kernel(ArchAttnArgs a, int pos_cap) {
  extern __shared__ float4 short_smem_dyn[];
  constexpr int KS = short_attn_k_stride<HD>;
  __half* k_s = reinterpret_cast<__half*>(short_smem_dyn);  // [pos_cap][KS]
  __half* v_s = k_s + pos_cap * KS;                            // [pos_cap][HD]
  float* fin = reinterpret_cast<float*>(v_s + pos_cap * HD);   // [3][HD]: this position's q, k, v, finished
  float* sc = fin + 3 * HD;                                    // [score_slots(pos_cap)]
  float* pv = sc + score_slots(pos_cap);                       // [kShortAttnPvGroups][HD]
  float* sum_exp = pv + kShortAttnPvGroups * HD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.x, group = a.n_heads / a.n_kv_heads, kvh = h / group, kv_dim = a.n_kv_heads * HD;
  KernelTrace trace(kTraceAttention);
  launch_dependents();
  const int pos = *a.pos0;  // written before the graph starts
  const int lo = a.window > 0 ? max(0, pos - a.window + 1) : 0, n_pos = pos + 1 - lo;
  if (n_pos > pos_cap) __trap();  // the backend takes this kernel only up to pos_cap positions
  HeadFinish f;
  if (warp < 3) f.prefetch(a.finish, warp == 0 ? kHeadQ : warp == 1 ? kHeadK : kHeadV, warp == 0 ? h : kvh, pos, lane);
  stage_kv_rows<HD>(k_s, v_s, a.k_cache + kvh * HD, a.v_cache + kvh * HD, lo, n_pos - 1, kv_dim);
  grid_dependency_wait();
  trace.released();
  if (warp < 3) f.finish(a.finish.qkv, a.finish.eps, fin + warp * HD, lane);
  trace.mark(2);  // (block 0's thread 0) q finished
  detail::cp_async_wait_all();
  trace.mark(3);  // (block 0's thread 0) its staged rows landed
  __syncthreads();
  trace.mark(0);  // this position's q, k, v finished; every staged row landed
  const int64_t row = static_cast<int64_t>(pos) * kv_dim + kvh * HD;
  for (int i = threadIdx.x; i < HD; i += kShortAttnThreads) {  // this position's row, as the cache holds it
    const __half kh = detail::kv_store(fin[HD + i]), vh = detail::kv_store(fin[2 * HD + i]);
    k_s[(n_pos - 1) * KS + i] = kh;
    v_s[(n_pos - 1) * HD + i] = vh;
    if (h % group == 0) {
      a.finish.k_cache[row + i] = kh;
      a.finish.v_cache[row + i] = vh;
    }
  }
  __syncthreads();
  trace.mark(1);  // k, v appended
  const float o = attend_head<HD>(fin, k_s, v_s, n_pos, a.scale, sc, pv, sum_exp);
  if (threadIdx.x < HD) a.out[static_cast<int64_t>(h) * HD + threadIdx.x] = o;
}

size_t arch_short_smem(int head_dim, int pos_cap) {
  return static_cast<size_t>(pos_cap) * (2 * head_dim + 16) * sizeof(__half) +
         (3 * head_dim + score_slots(pos_cap) + kShortAttnPvGroups * head_dim + 4) * sizeof(float);
}

// ------------------------------------------------------------------ argmax of logits rows

// One block per row: its argmax (NaN never wins, ties go to the lower index; kNoIndex for a row of NaN) into out[row].
constexpr int kRowsArgmaxThreads = 1024;
__global__ void __launch_bounds__(kRowsArgmaxThreads) rows_argmax_kernel(const float* logits, int vocab,
                                                                           ArgmaxResult* out) {
  __shared__ ArgmaxPartial red[32];
  launch_dependents();
  grid_dependency_wait();
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  ArgmaxPartial best{0.f, kNoIndex};
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const ArgmaxPartial c{__ldcg(row + i), static_cast<uint32_t>(i)};
    if (!isnan(c.value) && detail::argmax_better(c, best)) best = c;
  }
  best = detail::block_argmax(best, red);
  if (threadIdx.x == 0) out[blockIdx.x] = ArgmaxResult{best.index, best.value};
}

// ------------------------------------------------------------------ post-norm + residual, GLU

constexpr int kAddThreads = 256, kAddPer = 16;  // rows of up to 4096 floats stay in registers

// The norm weights are loaded before the programmatic wait; after it, y and x in one batch of loads per thread.
__global__ void __launch_bounds__(kAddThreads) add_normed_kernel(const float* y, const float* w, float eps, int d,
                                                                 float* x) {
  __shared__ float red[32];
  launch_dependents();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d;
  if (d > kAddThreads * kAddPer) {  // wide rows: two plain passes
    grid_dependency_wait();
    float scale = 1.f;
    if (w != nullptr) {
      float ss = 0.f;
      for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = __ldcg(y + base + i);
        ss += v * v;
      }
      scale = 1.f / sqrtf(detail::block_sum(ss, red) / static_cast<float>(d) + eps);
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      const float v = __ldcg(y + base + i);
      x[base + i] = __ldcg(x + base + i) + (w != nullptr ? v * scale * w[i] : v);
    }
    return;
  }
  float wv[kAddPer], yv[kAddPer], xv[kAddPer];
#pragma unroll
  for (int u = 0; u < kAddPer; ++u) {
    const int i = threadIdx.x + u * kAddThreads;
    wv[u] = w != nullptr && i < d ? w[i] : 1.f;
  }
  grid_dependency_wait();
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < kAddPer; ++u) {
    const int i = threadIdx.x + u * kAddThreads;
    yv[u] = i < d ? __ldcg(y + base + i) : 0.f;
    xv[u] = i < d ? __ldcg(x + base + i) : 0.f;
    ss += yv[u] * yv[u];
  }
  const float scale = w != nullptr ? 1.f / sqrtf(detail::block_sum(ss, red) / static_cast<float>(d) + eps) : 1.f;
#pragma unroll
  for (int u = 0; u < kAddPer; ++u) {
    const int i = threadIdx.x + u * kAddThreads;
    if (i < d) x[base + i] = xv[u] + (w != nullptr ? yv[u] * scale * wv[u] : yv[u]);
  }
}

__global__ void __launch_bounds__(256) glu_kernel(const float* gate_up, int n, int d_ff, int gelu, float* out,
                                                  __half* out_half) {
  launch_dependents();
  grid_dependency_wait();
  const int64_t total = static_cast<int64_t>(n) * d_ff;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / d_ff;
    const int j = static_cast<int>(i % d_ff);
    const float g = __ldcg(gate_up + t * 2 * d_ff + j), up = __ldcg(gate_up + t * 2 * d_ff + d_ff + j);
    const float v = detail::glu_unit(g, up, gelu);
    if (out != nullptr)
      out[i] = v;
    else
      detail::store_operand(v, t, j, d_ff, out_half);
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

namespace {
// The most visible positions (a multiple of 32, at least 64) whose short-kernel block takes at most `limit` bytes of
// shared memory; 0 where none.
int short_cap_within(int head_dim, int n_ctx, size_t limit) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return 0;
  int cap = std::min(n_ctx, kShortAttnMaxPos) / 32 * 32;
  while (cap >= 64 && arch_short_smem(head_dim, cap) > limit) cap -= 32;
  return cap >= 64 ? cap : 0;
}
}  // namespace

int arch_short_attention_cap(int head_dim, int n_ctx) {
  return short_cap_within(head_dim, n_ctx, device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
}

int arch_short_attention_cap_beside(int head_dim, int n_ctx) {
  const size_t sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  const int cap = sm > kShortAttnRoomBeside ? short_cap_within(head_dim, n_ctx, sm - kShortAttnRoomBeside) : 0;
  return cap < arch_short_attention_cap(head_dim, n_ctx) ? cap : 0;
}

void launch_arch_attention_short(const ArchAttnArgs& a, int pos_cap, cudaStream_t s) {
  if (a.n != 1 || a.rows.pos != nullptr || !a.fused_finish || a.out == nullptr || a.n_kv_heads < 1 ||
      a.n_heads % a.n_kv_heads != 0 || pos_cap < 1 || pos_cap > kShortAttnMaxPos)
    throw EngineError("attention: the short kernel serves one decode query with its fused finish");
  void (*k)(ArchAttnArgs, int) = a.head_dim == 64    ? arch_attention_short_kernel<64>
                                 : a.head_dim == 128 ? arch_attention_short_kernel<128>
                                 : a.head_dim == 256 ? arch_attention_short_kernel<256>
                                                     : nullptr;
  if (k == nullptr) throw EngineError("attention: the short kernel serves head_dim 64, 128 and 256");
  const size_t smem = arch_short_smem(a.head_dim, pos_cap);
  detail::allow_dynamic_smem(k, smem);
  launch(k, dim3(a.n_heads), dim3(kShortAttnThreads), smem, s, a, pos_cap);
}

void launch_arch_attention(const ArchAttnArgs& a, cudaStream_t s) {
  if (a.head_dim % 32 != 0 || a.head_dim < 32 || a.head_dim > kArchMaxHeadDim)
    throw EngineError("attention: head_dim must be a multiple of 32, at most 256");
  if (a.n < 1 || a.n_kv_heads < 1 || a.n_heads % a.n_kv_heads != 0) throw EngineError("attention: bad geometry");
  if ((a.out == nullptr) == (a.out_half == nullptr)) throw EngineError("attention: exactly one output");
  if (a.max_splits < 1 || a.max_splits > kArchAttnMaxSplits) throw EngineError("attention: bad split capacity");
  if (a.max_splits > 1 && (a.n != 1 || a.part_o == nullptr || a.part_ml == nullptr || a.counters == nullptr))
    throw EngineError("attention: the context split serves one query and needs its scratch");
  const bool batch = a.rows.pos != nullptr;
  if (batch && a.max_splits != 1) throw EngineError("attention: batch rows take no context split");
  if (a.fused_finish) {
    const QkvFinishArgs& f = a.finish;
    if ((a.n != 1 && !batch) || f.qkv == nullptr || f.rope_table == nullptr || f.k_cache == nullptr ||
        f.v_cache == nullptr || f.pos0 != a.pos0 || f.rows.pos != a.rows.pos || f.rows.slot != a.rows.slot ||
        f.rows.slot_stride != a.rows.slot_stride || f.n_heads != a.n_heads || f.n_kv_heads != a.n_kv_heads ||
        f.head_dim != a.head_dim || (f.q_norm == nullptr) != (f.k_norm == nullptr))
      throw EngineError("attention: bad fused QKV finish");
  }
  const bool decode = a.n == 1 || batch;  // one query per block
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
  const int tq = attn_tile(a.head_dim, decode);  // decode: 1
  const int grid_y = a.max_splits > 1 ? a.max_splits : (a.n + tq - 1) / tq;
  launch(k, dim3(a.n_heads, grid_y), dim3(kAttnThreadsArch), 0, s, a);
}

void launch_rows_argmax(const float* logits, int n, int vocab, ArgmaxResult* out, cudaStream_t s) {
  if (n < 1 || vocab < 1) throw EngineError("rows argmax: bad geometry");
  launch(rows_argmax_kernel, dim3(n), dim3(kRowsArgmaxThreads), 0, s, logits, vocab, out);
}

void launch_add_normed(const float* y, const float* w, float eps, int n, int d, float* x, cudaStream_t s) {
  if (n < 1 || d < 1) throw EngineError("add_normed: bad geometry");
  launch(add_normed_kernel, dim3(n), dim3(kAddThreads), 0, s, y, w, eps, d, x);
}

void launch_glu(const float* gate_up, int n, int d_ff, Activation act, float* out, __half* out_half,
                cudaStream_t s) {
  if ((out == nullptr) == (out_half == nullptr)) throw EngineError("glu: exactly one output");
  launch(glu_kernel, dim3(grid_for(static_cast<int64_t>(n) * d_ff, 256)), dim3(256), 0, s, gate_up, n, d_ff,
         act == Activation::GeluTanh ? 1 : 0, out, out_half);
}

}  // namespace metalattn::cuda
