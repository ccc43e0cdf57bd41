// Issue 13's second step: a persistent decode prototype on SmolLM2-135M's layer shapes, to measure what a layer costs
// when one resident block per SM runs every instruction of the step and the hand-overs are counters instead of kernel
// boundaries, with each block's weights for its next task copied into shared memory (cp.async) while it waits.
//
// One launch runs L layers of one decode step: per layer five instructions, each split into tasks of a few rows:
//   QKV    norm(x) . Wqkv (960 x 576), 120 tasks of 8 rows; the k and v rows also go to the cache at position P - 1
//   ATTN   one query head over P cached positions (softmax scale 1/8, no RoPE: the cost, not the model), 9 tasks
//   O      x += Wo . attn (576 x 576), 72 tasks of 8 rows
//   GU     act = silu(gate) * up of norm(x) (2 x 1536 x 576), 128 tasks of 12 units (24 rows)
//   DOWN   x += Wdown . act (576 x 1536), 72 tasks of 8 rows
// Task t of an instruction runs on block (t + offset) % blocks, the offset rotating by each instruction's task count so
// the work spreads over the SMs (a block takes several tasks of one instruction where it has more tasks than blocks).
// An instruction's tasks wait (thread 0 spinning on an acquire load) until the counter of the instruction they read
// reaches its task count, and each task adds one to its own instruction's counter with a release after a barrier. Every
// block walks the same instruction order, so with one resident block per SM (grid = SM count, checked by the occupancy
// query) the schedule cannot deadlock; a spin of 2^22 loads traps instead of hanging.
// Weights are Q4_0 (the engine's layout: 16 bytes of nibbles and an fp16 scale per 32 weights), activations fp32, the
// cache fp32. The result (x after L layers) is checked against a float64 CPU reference of the same computation.
//
// Two hand-overs (the template parameter LL): the counters above, or "LL": every activation value travels as one
// 64-bit word {value, generation} written by one store, and a consumer polls the words it needs until each carries the
// generation it waits for (no counter, no fence; the idea of NCCL's LL protocol).
//
// Measured: median of graph replays (counters zeroed and x reset inside the graph) for L = 2 and L = 30; the per-layer
// cost is the slope; prefetch 0 copies each task's weights after its wait instead (the prefetch's share). Then one
// traced run of each hand-over (%globaltimer by each task's thread 0) prints where an instruction's time goes.
// Session 22 (RESULTS, NOTES): counters 14.2 us a layer, LL 12.7-13.2; the engine's graph path ~11.9.
// Build and run (H100): nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/bench_megakernel.cu -o /tmp/bench_megakernel &&
//   /tmp/bench_megakernel
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace {

#ifdef MK_1_7B  // SmolLM2-1.7B's decode shapes: tasks of 55-74 KB of weights, about one a SM per instruction
constexpr int D = 2048, NH = 32, NKV = 32, FF = 8192, kLayers = 24;
constexpr int kQkvRows = 48, kORows = 16, kGuUnits = 32, kDownRows = 16;
constexpr const char* kShape = "SmolLM2-1.7B";
#else  // SmolLM2-135M's
constexpr int D = 576, NH = 9, NKV = 3, FF = 1536, kLayers = 30;
constexpr int kQkvRows = 8, kORows = 8, kGuUnits = 12, kDownRows = 8;
constexpr const char* kShape = "SmolLM2-135M";
#endif
constexpr int NB = D / 32, HD = 64, KVD = NKV * HD, QKV = D + 2 * KVD;
constexpr int NBF = FF / 32, P = 32;  // P: positions attended (the new one is P - 1)
constexpr int kThreads = 256, kWarps = kThreads / 32;
enum Instr { kQkv = 0, kAttn = 1, kO = 2, kGu = 3, kDown = 4 };
__host__ __device__ constexpr int task_count(int in) {
  return in == kQkv    ? QKV / kQkvRows
         : in == kAttn ? NH
         : in == kO    ? D / kORows
         : in == kGu   ? FF / kGuUnits
                       : D / kDownRows;
}
constexpr int kLayerTasks = task_count(0) + task_count(1) + task_count(2) + task_count(3) + task_count(4);
constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int kMaxTaskBlocks = cmax(cmax(kQkvRows * NB, kORows * NB), cmax(2 * kGuUnits * NB, kDownRows * NBF));
constexpr int kMaxTasks = cmax(cmax(task_count(0), task_count(1)), cmax(task_count(2), cmax(task_count(3),
                                                                                               task_count(4))));
constexpr int kStride = 36;  // padded 32-float blocks of staged activations
static_assert(P <= 32 && P * HD % kThreads == 0, "attention: one warp's softmax, whole staging passes");

struct Matrix {
  const uint4* q;      // [rows][nb] nibbles
  const __half* d;     // [rows][nb] scales
  int nb;
};
struct LayerW {
  Matrix qkv, o, gu, down;  // gu: gate rows 0 .. FF - 1, up rows FF .. 2 FF - 1
  const float* attn_norm;
  const float* ffn_norm;
};
struct Args {
  const LayerW* layers;
  int n_layers;
  float* x;       // [D] residual stream
  float* qkv;     // [QKV]
  float* attn;    // [D]
  float* act;     // [FF]
  float* kc;      // [L][P][KVD]
  float* vc;
  unsigned* counters;  // [L][5], zero at launch
  int prefetch;
  // LL hand-over (megakernel<true>): every activation travels as one 64-bit word {value, generation}, written with
  // one store, so a consumer polls the data itself and needs no counter and no fence; generation = producing
  // instruction + 1 (x starts at 0).
  unsigned long long *xll, *qkvll, *attnll, *actll;
  // null, or [instruction][task][6] %globaltimer ns: waiting, released, staged, done; counters mode also: the
  // staging loads stored (4), the norm reduced (5)
  unsigned long long* trace;
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void cp16(void* s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(s))),
               "l"(g) : "memory");
}
__device__ __forceinline__ void cp4(void* s, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(s))),
               "l"(g) : "memory");
}
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long ld_relaxed64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed64(unsigned long long* p, float v, unsigned gen) {
  const unsigned long long w = static_cast<unsigned long long>(gen) << 32 | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
// The value at p once its generation is gen (spins; traps after ~2^22 polls: a schedule that cannot finish).
__device__ __forceinline__ float ll_wait(const unsigned long long* p, unsigned gen) {
  unsigned long long w = ld_relaxed64(p);
  for (long long spins = 0; static_cast<unsigned>(w >> 32) != gen; w = ld_relaxed64(p))
    if (++spins > (1ll << 22)) __trap();
  return __uint_as_float(static_cast<unsigned>(w));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Q4_0 block (q - 8) . 32 staged floats.
__device__ __forceinline__ float q4_dot(uint4 q, float d, const float* xb) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int lo = static_cast<int>((w[i] >> (8 * j)) & 0xf) - 8;
      const int hi = static_cast<int>((w[i] >> (8 * j + 4)) & 0xf) - 8;
      s += xb[4 * i + j] * static_cast<float>(lo) + xb[16 + 4 * i + j] * static_cast<float>(hi);
    }
  return d * s;
}

struct Smem {
  uint4 wq[2][kMaxTaskBlocks];
  __half wd[2][kMaxTaskBlocks + 8];
  float x[NBF * kStride];
  float red[kWarps];
  float sc[P];
  float kv[2][P][HD + 1];  // attention: the head's K and V rows (padded: a warp's lanes read different rows)
};

// The rows of instruction `in`'s task t as up to two contiguous ranges of its matrix: (first row, count) each.
struct Rows {
  const Matrix* m;
  int r0, n0, r1, n1;
};
__device__ __forceinline__ Rows task_rows(const LayerW& L, int in, int t) {
  switch (in) {
    case kQkv: return {&L.qkv, t * kQkvRows, kQkvRows, 0, 0};
    case kO: return {&L.o, t * kORows, kORows, 0, 0};
    case kGu: return {&L.gu, t * kGuUnits, kGuUnits, FF + t * kGuUnits, kGuUnits};
    case kDown: return {&L.down, t * kDownRows, kDownRows, 0, 0};
    default: return {nullptr, 0, 0, 0, 0};
  }
}

// Copies a task's weight blocks (both ranges, rows in order) into buffer b; commits one group (empty for attention).
__device__ __forceinline__ void fetch(Smem& sm, int b, const LayerW& L, int in, int t) {
  const Rows r = task_rows(L, in, t);
  if (r.m != nullptr) {
    const int nb = r.m->nb;
    for (int part = 0; part < 2; ++part) {
      const int row0 = part == 0 ? r.r0 : r.r1, n = part == 0 ? r.n0 : r.n1, base = part == 0 ? 0 : r.n0 * nb;
      for (int i = threadIdx.x; i < n * nb; i += kThreads) cp16(&sm.wq[b][base + i], r.m->q + row0 * nb + i);
      for (int i = threadIdx.x; i < n * nb / 2; i += kThreads)  // scales two at a time (nb is even)
        cp4(&sm.wd[b][base + 2 * i], r.m->d + row0 * nb + 2 * i);
    }
  }
  cp_commit();
}

// Stages v[0 .. n) (read through L2) into the padded layout, times norm_w if given; returns 1/rms (or 1). tr: trace
// slot 4 (thread 0's loads stored) when tracing.
__device__ __forceinline__ float stage(Smem& sm, const float* v, int n, const float* norm_w, unsigned long long* tr) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float a = __ldcg(v + i);
    ss += a * a;
    sm.x[(i >> 5) * kStride + (i & 31)] = norm_w != nullptr ? a * norm_w[i] : a;
  }
  if (tr) tr[4] = now_ns();
  if (norm_w == nullptr) return 1.f;
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) sm.red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += sm.red[w];
  return rsqrtf(t / n + 1e-5f);
}

// stage() for the LL hand-over: every thread issues all its loads first, then re-polls the words not yet at gen.
__device__ __forceinline__ float stage_ll(Smem& sm, const unsigned long long* v, int n, const float* norm_w,
                                          unsigned gen) {
  constexpr int kPer = (FF + kThreads - 1) / kThreads;
  unsigned long long w[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u)
    if (threadIdx.x + u * kThreads < n) w[u] = ld_relaxed64(v + threadIdx.x + u * kThreads);
  for (long long spins = 0;; ++spins) {  // re-poll every stale word at once, not one round trip a word
    bool ready = true;
#pragma unroll
    for (int u = 0; u < kPer; ++u)
      if (threadIdx.x + u * kThreads < n && static_cast<unsigned>(w[u] >> 32) != gen) ready = false;
    if (ready) break;
    if (spins > (1ll << 22)) __trap();
#pragma unroll
    for (int u = 0; u < kPer; ++u)
      if (threadIdx.x + u * kThreads < n && static_cast<unsigned>(w[u] >> 32) != gen)
        w[u] = ld_relaxed64(v + threadIdx.x + u * kThreads);
  }
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = threadIdx.x + u * kThreads;
    if (i < n) {
      const float a = __uint_as_float(static_cast<unsigned>(w[u]));
      ss += a * a;
      sm.x[(i >> 5) * kStride + (i & 31)] = norm_w != nullptr ? a * norm_w[i] : a;
    }
  }
  if (norm_w == nullptr) return 1.f;
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) sm.red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += sm.red[w];
  return rsqrtf(t / n + 1e-5f);
}

// Local row r of the task (rows of both ranges in order) . staged x, a warp a row.
__device__ __forceinline__ float row_dot(const Smem& sm, int b, int r, int nb) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  for (int k = lane; k < nb; k += 32)
    acc += q4_dot(sm.wq[b][r * nb + k], __half2float(sm.wd[b][r * nb + k]), sm.x + k * kStride);
  return warp_sum(acc);
}

template <bool LL>
__global__ void __launch_bounds__(kThreads, 1) megakernel(Args a) {
  extern __shared__ __align__(16) unsigned char raw[];
  Smem& sm = *reinterpret_cast<Smem*>(raw);
  const int G = gridDim.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_instr = a.n_layers * 5;
  // This block's tasks, in schedule order: of instruction k (k = layer * 5 + in) the tasks t0, t0 + G, ... below its
  // task count, t0 = (block - offset) mod G (more than one only where an instruction has more tasks than blocks).
  struct Pos {
    int k, t;
  };
  auto first_task = [&](int k) {
    int off = (k / 5) * kLayerTasks;
    for (int j = 0; j < k % 5; ++j) off += task_count(j);
    const int t = ((static_cast<int>(blockIdx.x) - off) % G + G) % G;
    return t < task_count(k % 5) ? t : -1;
  };
  auto next = [&](Pos p) {
    if (p.k >= 0 && p.t + G < task_count(p.k % 5)) return Pos{p.k, p.t + G};
    for (int k = p.k + 1; k < n_instr; ++k)
      if (const int t = first_task(k); t >= 0) return Pos{k, t};
    return Pos{n_instr, 0};
  };
  int buf = 0;
  Pos cur = next(Pos{-1, 0});
  if (a.prefetch && cur.k < n_instr) fetch(sm, buf, a.layers[cur.k / 5], cur.k % 5, cur.t);
  for (Pos nxt; cur.k < n_instr; cur = nxt) {
    const int k = cur.k, l = k / 5, in = k % 5, t = cur.t;
    const LayerW& L = a.layers[l];
    nxt = next(cur);
    if (a.prefetch) {
      if (nxt.k < n_instr) fetch(sm, buf ^ 1, a.layers[nxt.k / 5], nxt.k % 5, nxt.t);
      else cp_commit();
    }
    unsigned long long* tr = nullptr;  // thread 0's six timestamps of this task, when tracing
    if (a.trace != nullptr && threadIdx.x == 0) tr = a.trace + (static_cast<size_t>(k) * kMaxTasks + t) * 6;
    if (tr) tr[0] = now_ns();
    // Wait for the instruction this one reads (LL: each thread waits for the words it loads, below).
    const int dep = in == kQkv ? (l == 0 ? -1 : (l - 1) * 5 + kDown) : k - 1;
    const unsigned gen = static_cast<unsigned>(k) + 1, dep_gen = static_cast<unsigned>(k);  // dep_gen: of k - 1
    if (!LL && threadIdx.x == 0 && dep >= 0) {
      const unsigned target = task_count(dep % 5);
      long long spins = 0;
      while (ld_acquire(a.counters + dep) < target)
        if (++spins > (1ll << 22)) __trap();  // ~2-4 s: a schedule that cannot finish
    }
    if (!LL) __syncthreads();
    if (tr && !LL) tr[1] = now_ns();
    if (!a.prefetch) fetch(sm, buf, L, in, t);
    float scale = 1.f;
    if constexpr (LL) {
      if (in == kQkv || in == kGu) scale = stage_ll(sm, a.xll, D, in == kQkv ? L.attn_norm : L.ffn_norm, dep_gen);
      else if (in == kO) scale = stage_ll(sm, a.attnll, D, nullptr, dep_gen);
      else if (in == kDown) scale = stage_ll(sm, a.actll, FF, nullptr, dep_gen);
      if (tr && in != kAttn) tr[1] = now_ns();
    } else {
      if (in == kQkv || in == kGu) scale = stage(sm, a.x, D, in == kQkv ? L.attn_norm : L.ffn_norm, tr);
      else if (in == kO) scale = stage(sm, a.attn, D, nullptr, tr);
      else if (in == kDown) scale = stage(sm, a.act, FF, nullptr, tr);
      if (tr) tr[5] = now_ns();
    }
    if (a.prefetch) cp_wait<1>();
    else cp_wait<0>();
    __syncthreads();
    if (tr) tr[2] = now_ns();
    if (in == kQkv) {
      for (int r = warp; r < kQkvRows; r += kWarps) {
        const int row = t * kQkvRows + r;
        const float v = row_dot(sm, buf, r, NB) * scale;
        if (lane == 0) {
          if constexpr (LL) st_relaxed64(a.qkvll + row, v, gen);
          else a.qkv[row] = v;
          if (row >= D && row < D + KVD) a.kc[(static_cast<size_t>(l) * P + P - 1) * KVD + row - D] = v;
          if (row >= D + KVD) a.vc[(static_cast<size_t>(l) * P + P - 1) * KVD + row - D - KVD] = v;
        }
      }
    } else if (in == kO || in == kDown) {
      const int rows = in == kO ? kORows : kDownRows;
      for (int r = warp; r < rows; r += kWarps) {
        const int row = t * rows + r;
        const float v = row_dot(sm, buf, r, in == kO ? NB : NBF);
        if (lane == 0) {
          // LL: x[row] as the last down (for O: generation k - 2) or this layer's O (for down: k - 1) left it.
          if constexpr (LL)
            st_relaxed64(a.xll + row, ll_wait(a.xll + row, in == kO ? k - 2 : k - 1) + v, gen);
          else
            a.x[row] = __ldcg(a.x + row) + v;
        }
      }
    } else if (in == kGu) {  // 8 lanes a row: a warp's lanes 0-7 gate row u, 8-15 up row u, 16-31 unit u + 1
      for (int u0 = 0; u0 < kGuUnits; u0 += 2 * kWarps) {
        const int u = u0 + warp * 2 + (lane >> 4), r = (lane & 8) ? kGuUnits + u : u, sub = lane & 7;
        float acc = 0.f;
        if (u < kGuUnits)
          for (int kb = sub; kb < NB; kb += 8)
            acc += q4_dot(sm.wq[buf][r * NB + kb], __half2float(sm.wd[buf][r * NB + kb]), sm.x + kb * kStride);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        acc *= scale;
        const float up = __shfl_xor_sync(0xffffffffu, acc, 8);
        if (u < kGuUnits && (lane & 15) == 0) {
          const float act = acc / (1.f + expf(-acc)) * up;
          if constexpr (LL) st_relaxed64(a.actll + t * kGuUnits + u, act, gen);
          else a.act[t * kGuUnits + u] = act;
        }
      }
    } else {  // attention of head t over P positions: K, V and q staged first (one round trip), then from smem
      const int h = t, kvh = h / (NH / NKV);
      const float* kc = a.kc + static_cast<size_t>(l) * P * KVD + kvh * HD;
      const float* vc = a.vc + static_cast<size_t>(l) * P * KVD + kvh * HD;
      float* q = sm.x;  // 64 floats
      constexpr int kPer = P * HD / kThreads;  // values of K (and of V) a thread stages
      float kr[kPer], vr[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int i = threadIdx.x + u * kThreads, p = i / HD, c = i % HD;
        kr[u] = __ldcg(kc + p * KVD + c);
        vr[u] = __ldcg(vc + p * KVD + c);
      }
      float qv = 0.f, knew = 0.f;  // LL: q, and the new position's k (threads 0-63) and v (64-127) rows, polled
      if constexpr (LL) {
        if (threadIdx.x < HD) qv = ll_wait(a.qkvll + h * HD + threadIdx.x, dep_gen);
        if (threadIdx.x < 2 * HD)
          knew = ll_wait(a.qkvll + D + (threadIdx.x < HD ? 0 : KVD) + kvh * HD + threadIdx.x % HD, dep_gen);
        if (tr) tr[1] = now_ns();
      } else {
        qv = threadIdx.x < HD ? __ldcg(a.qkv + h * HD + threadIdx.x) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int i = threadIdx.x + u * kThreads, p = i / HD, c = i % HD;
        if (LL && p == P - 1) continue;  // the new position comes from the LL words
        sm.kv[0][p][c] = kr[u];
        sm.kv[1][p][c] = vr[u];
      }
      if (LL && threadIdx.x < 2 * HD) sm.kv[threadIdx.x / HD][P - 1][threadIdx.x % HD] = knew;
      if (threadIdx.x < HD) q[threadIdx.x] = qv;
      __syncthreads();
      for (int p = warp; p < P; p += kWarps) {  // a warp a position, lanes over dimension pairs
        const float s = warp_sum(q[lane] * sm.kv[0][p][lane] + q[lane + 32] * sm.kv[0][p][lane + 32]);
        if (lane == 0) sm.sc[p] = s * 0.125f;
      }
      __syncthreads();
      if (warp == 0) {
        const float s = lane < P ? sm.sc[lane] : -INFINITY;
        const float m = warp_max(s);
        const float e = lane < P ? expf(s - m) : 0.f;
        const float den = warp_sum(e);
        if (lane < P) sm.sc[lane] = e / den;
      }
      __syncthreads();
      if (threadIdx.x < HD) {
        float o = 0.f;
        for (int p = 0; p < P; ++p) o += sm.sc[p] * sm.kv[1][p][threadIdx.x];
        if constexpr (LL) st_relaxed64(a.attnll + h * HD + threadIdx.x, o, gen);
        else a.attn[h * HD + threadIdx.x] = o;
      }
    }
    __syncthreads();  // every thread's stores (and reads of buffer buf) before the release
    if (tr) tr[3] = now_ns();
    if (!LL && threadIdx.x == 0)
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.counters + k) : "memory");
    if (a.prefetch) buf ^= 1;
  }
  cp_wait<0>();
}

// ---------------------------------------------------------------- host: random model, reference, timing
std::mt19937 rng(7);

struct HostMatrix {
  int rows, nb;
  std::vector<uint4> q;
  std::vector<__half> d;
  float w(int r, int c) const {
    const uint4 b = q[r * nb + c / 32];
    const uint32_t words[4] = {b.x, b.y, b.z, b.w};
    const int j = c % 32, byte = j % 16, word = byte / 4, sh = 8 * (byte % 4) + (j < 16 ? 0 : 4);
    return __half2float(d[r * nb + c / 32]) * static_cast<float>(static_cast<int>((words[word] >> sh) & 0xf) - 8);
  }
};
HostMatrix random_q4(int rows, int cols, float scale) {
  HostMatrix m{rows, cols / 32, {}, {}};
  std::uniform_int_distribution<uint32_t> u32;
  std::uniform_real_distribution<float> ud(0.5f * scale, 1.5f * scale);
  for (int i = 0; i < rows * m.nb; ++i) {
    m.q.push_back(make_uint4(u32(rng), u32(rng), u32(rng), u32(rng)));
    m.d.push_back(__float2half(ud(rng) * (u32(rng) & 1 ? 1.f : -1.f)));
  }
  return m;
}
std::vector<float> random_vec(int n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

struct HostLayer {
  HostMatrix qkv, o, gu, down;
  std::vector<float> an, fn;
};

std::vector<double> matvec(const HostMatrix& m, const std::vector<double>& x) {
  std::vector<double> y(m.rows, 0.0);
  for (int r = 0; r < m.rows; ++r)
    for (int c = 0; c < m.nb * 32; ++c) y[r] += m.w(r, c) * x[c];
  return y;
}
std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<float>& w) {
  double ss = 0.0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / x.size() + 1e-5);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

// The same computation in float64; kc / vc as the kernel leaves them (row P - 1 recomputed here).
std::vector<double> reference(const std::vector<HostLayer>& layers, int n_layers, const std::vector<float>& x0,
                              std::vector<float> kc, std::vector<float> vc) {
  std::vector<double> x(x0.begin(), x0.end());
  for (int l = 0; l < n_layers; ++l) {
    const HostLayer& L = layers[l];
    const std::vector<double> qkv = matvec(L.qkv, rmsnorm(x, L.an));
    const size_t c0 = static_cast<size_t>(l) * P * KVD, c1 = c0 + static_cast<size_t>(P) * KVD;
    std::vector<double> k(kc.begin() + c0, kc.begin() + c1), v(vc.begin() + c0, vc.begin() + c1);
    for (int c = 0; c < KVD; ++c) {
      k[(P - 1) * KVD + c] = qkv[D + c];
      v[(P - 1) * KVD + c] = qkv[D + KVD + c];
    }
    std::vector<double> attn(D);
    for (int h = 0; h < NH; ++h) {
      const int kvh = h / (NH / NKV);
      std::vector<double> s(P);
      double m = -1e300, den = 0.0;
      for (int p = 0; p < P; ++p) {
        double dot = 0.0;
        for (int c = 0; c < HD; ++c) dot += qkv[h * HD + c] * k[p * KVD + kvh * HD + c];
        s[p] = dot * 0.125;
        m = std::max(m, s[p]);
      }
      for (int p = 0; p < P; ++p) den += (s[p] = std::exp(s[p] - m));
      for (int c = 0; c < HD; ++c) {
        double o = 0.0;
        for (int p = 0; p < P; ++p) o += s[p] / den * v[p * KVD + kvh * HD + c];
        attn[h * HD + c] = o;
      }
    }
    const std::vector<double> ov = matvec(L.o, attn);
    for (int i = 0; i < D; ++i) x[i] += ov[i];
    const std::vector<double> gu = matvec(L.gu, rmsnorm(x, L.fn));
    std::vector<double> act(FF);
    for (int i = 0; i < FF; ++i) act[i] = gu[i] / (1.0 + std::exp(-gu[i])) * gu[FF + i];
    const std::vector<double> dv = matvec(L.down, act);
    for (int i = 0; i < D; ++i) x[i] += dv[i];
  }
  return x;
}

template <typename T>
T* upload(const std::vector<T>& v) {
  T* p = nullptr;
  CK(cudaMalloc(&p, v.size() * sizeof(T)));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
Matrix upload(const HostMatrix& m) { return Matrix{upload(m.q), upload(m.d), m.nb}; }

}  // namespace

int main() {
  int n_sms = 0, per_sm = 0;
  CK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t smem = sizeof(Smem);
  for (auto k : {megakernel<false>, megakernel<true>})
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, megakernel<true>, kThreads, smem));
  if (per_sm < 1) {
    std::printf("the kernel does not fit an SM\n");
    return 1;
  }
  const int max_layers = kLayers;
  std::vector<HostLayer> hl;
  std::vector<LayerW> dl;
  const float sd = 1.f / std::sqrt(static_cast<float>(D)), sf = 1.f / std::sqrt(static_cast<float>(FF));
  for (int l = 0; l < max_layers; ++l) {
    // Scales so that a dot product of unit-size inputs has about unit size (Q4_0 values are -8 .. 7, rms ~4.6).
    HostLayer L{random_q4(QKV, D, sd / 4.6f), random_q4(D, D, 0.5f * sd / 4.6f), random_q4(2 * FF, D, sd / 4.6f),
                random_q4(D, FF, 0.5f * sf / 4.6f), random_vec(D, 0.5f, 1.5f), random_vec(D, 0.5f, 1.5f)};
    dl.push_back(LayerW{upload(L.qkv), upload(L.o), upload(L.gu), upload(L.down), upload(L.an), upload(L.fn)});
    hl.push_back(std::move(L));
  }
  const std::vector<float> x0 = random_vec(D, -1.f, 1.f);
  const std::vector<float> kc = random_vec(max_layers * P * KVD, -1.f, 1.f);
  const std::vector<float> vc = random_vec(max_layers * P * KVD, -1.f, 1.f);
  Args a{};
  a.layers = upload(dl);
  a.x = upload(x0);
  float* x_init = upload(x0);
  a.qkv = upload(std::vector<float>(QKV));
  a.attn = upload(std::vector<float>(D));
  a.act = upload(std::vector<float>(FF));
  a.kc = upload(kc);
  a.vc = upload(vc);
  a.counters = upload(std::vector<unsigned>(max_layers * 5));
  std::vector<unsigned long long> x0ll(D);  // x0 as generation-0 words
  for (int i = 0; i < D; ++i) {
    unsigned u;
    std::memcpy(&u, &x0[i], 4);
    x0ll[i] = u;
  }
  a.xll = upload(x0ll);
  unsigned long long* xll_init = upload(x0ll);
  a.qkvll = upload(std::vector<unsigned long long>(QKV));
  a.attnll = upload(std::vector<unsigned long long>(D));
  a.actll = upload(std::vector<unsigned long long>(FF));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  std::printf("%s shapes, %d layers; %d SMs, %d block(s) a SM fit, %zu bytes of shared memory a block\n", kShape,
              max_layers, n_sms, per_sm, smem);
  // One step as the graph replays it: the hand-over state reset, x restored, the kernel.
  auto enqueue = [&](bool ll) {
    CK(cudaMemsetAsync(a.counters, 0, max_layers * 5 * sizeof(unsigned), st));
    CK(cudaMemcpyAsync(a.x, x_init, D * sizeof(float), cudaMemcpyDeviceToDevice, st));
    CK(cudaMemcpyAsync(a.xll, xll_init, D * 8, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemsetAsync(a.qkvll, 0, QKV * 8, st));
    CK(cudaMemsetAsync(a.attnll, 0, D * 8, st));
    CK(cudaMemsetAsync(a.actll, 0, FF * 8, st));
    if (ll) megakernel<true><<<n_sms, kThreads, smem, st>>>(a);
    else megakernel<false><<<n_sms, kThreads, smem, st>>>(a);
    CK(cudaGetLastError());
  };
  auto result = [&](bool ll) {
    std::vector<float> x(D);
    if (ll) {
      std::vector<unsigned long long> w(D);
      CK(cudaMemcpy(w.data(), a.xll, D * 8, cudaMemcpyDeviceToHost));
      for (int i = 0; i < D; ++i) {
        const unsigned u = static_cast<unsigned>(w[i]);
        std::memcpy(&x[i], &u, 4);
      }
    } else {
      CK(cudaMemcpy(x.data(), a.x, D * sizeof(float), cudaMemcpyDeviceToHost));
    }
    return x;
  };
  std::map<int, std::vector<double>> refs;  // the float64 reference for each layer count
  for (bool ll : {false, true}) {
    for (int prefetch : {1, 0}) {
      for (int n_layers : {2, max_layers}) {
        a.n_layers = n_layers;
        a.prefetch = prefetch;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        enqueue(ll);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaStreamSynchronize(st));
        const std::vector<float> x = result(ll);
        if (refs.count(n_layers) == 0) refs[n_layers] = reference(hl, n_layers, x0, kc, vc);
        const std::vector<double>& ref = refs[n_layers];
        double err = 0.0, mag = 0.0;
        for (int i = 0; i < D; ++i) {
          err = std::max(err, std::fabs(x[i] - ref[i]));
          mag = std::max(mag, std::fabs(ref[i]));
        }
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        std::vector<float> ms;
        for (int it = 0; it < 220; ++it) {
          CK(cudaEventRecord(e0, st));
          CK(cudaGraphLaunch(ge, st));
          CK(cudaEventRecord(e1, st));
          CK(cudaEventSynchronize(e1));
          float t = 0.f;
          CK(cudaEventElapsedTime(&t, e0, e1));
          if (it >= 20) ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        std::printf("%-8s prefetch %d, %2d layers: %8.1f us a step (median of 200; min %.1f), max |x - ref| %.2e "
                    "(max |ref| %.2f)%s\n",
                    ll ? "LL" : "counters", prefetch, n_layers, ms[ms.size() / 2] * 1e3, ms.front() * 1e3, err, mag,
                    err <= 1e-3 * std::max(1.0, mag) ? "" : "  <-- MISMATCH");
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
      }
    }
  }
  // Traced runs (30 layers, prefetch on): where an instruction's time goes, averaged over layers 5 .. 24.
  const size_t n = static_cast<size_t>(max_layers) * 5 * kMaxTasks * 6;
  unsigned long long* trace = upload(std::vector<unsigned long long>(n, 0ull));
  for (bool ll : {false, true}) {
    a.n_layers = max_layers;
    a.prefetch = 1;
    a.trace = trace;
    CK(cudaMemset(trace, 0, n * sizeof(unsigned long long)));
    for (int rep = 0; rep < 3; ++rep) enqueue(ll);  // the last of three runs
    CK(cudaStreamSynchronize(st));
    a.trace = nullptr;
    std::vector<unsigned long long> tr(n);
    CK(cudaMemcpy(tr.data(), trace, n * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    auto at = [&](int k, int t, int j) {
      return static_cast<double>(tr[(static_cast<size_t>(k) * kMaxTasks + t) * 6 + j]);
    };
    const char* names[5] = {"QKV", "ATTN", "O", "GU", "DOWN"};
    std::printf("%s, traced, us, averages over layers 5..%d: hand-over = first release seen (LL: first thread 0 with "
                "its words) - last task of the read instruction done; span = last done - last done of the read "
                "instruction\n", ll ? "LL" : "counters", max_layers - 6);
    std::printf("%-5s %6s %9s %9s %9s %9s %9s %8s   staging = loads + norm + weights (counters only)\n", "instr",
                "tasks", "hand-over", "seen-skew", "staging", "compute", "release", "span");
    double layer = 0.0;
    for (int in = 0; in < 5; ++in) {
      double ho = 0, skew = 0, stg = 0, cmp = 0, spn = 0, rel = 0, lds = 0, nrm = 0, wts = 0;
      int cnt = 0;
      for (int l = 5; l < max_layers - 5; ++l, ++cnt) {
        const int k = l * 5 + in, dep = k - 1, nt = task_count(in), nd = task_count(dep % 5);
        double dep_done = 0, first_seen = 1e300, last_seen = 0, last_done = 0, s_stg = 0, s_cmp = 0, s_ld = 0,
               s_nrm = 0, s_wts = 0;
        for (int t = 0; t < nd; ++t) dep_done = std::max(dep_done, at(dep, t, 3));
        for (int t = 0; t < nt; ++t) {
          first_seen = std::min(first_seen, at(k, t, 1));
          last_seen = std::max(last_seen, at(k, t, 1));
          last_done = std::max(last_done, at(k, t, 3));
          s_stg += at(k, t, 2) - at(k, t, 1);
          s_cmp += at(k, t, 3) - at(k, t, 2);
          if (at(k, t, 4) > 0) {
            s_ld += at(k, t, 4) - at(k, t, 1);
            s_nrm += at(k, t, 5) - at(k, t, 4);
            s_wts += at(k, t, 2) - at(k, t, 5);
          }
        }
        lds += s_ld / nt;
        nrm += s_nrm / nt;
        wts += s_wts / nt;
        ho += first_seen - dep_done;
        skew += last_seen - first_seen;
        stg += s_stg / nt;
        cmp += s_cmp / nt;
        rel += last_done - last_seen;
        spn += last_done - dep_done;
      }
      std::printf("%-5s %6d %9.2f %9.2f %9.2f %9.2f %9.2f %8.2f", names[in], task_count(in), ho / cnt / 1e3,
                  skew / cnt / 1e3, stg / cnt / 1e3, cmp / cnt / 1e3, rel / cnt / 1e3, spn / cnt / 1e3);
      if (!ll) std::printf("   %.2f + %.2f + %.2f", lds / cnt / 1e3, nrm / cnt / 1e3, wts / cnt / 1e3);
      std::printf("\n");
      layer += spn / cnt / 1e3;
    }
    std::printf("layer (sum of spans): %.2f us\n", layer);
  }
  return 0;
}
