// Issue 13's persistent decode prototype, second form: three dependent steps a layer instead of five. One resident
// block per SM runs every instruction of one decode step (SmolLM2-135M's layer shapes, or SmolLM2-1.7B's with
// -DMK_1_7B); hand-overs are counters instead of kernel boundaries, and each block copies its next task's weights into
// shared memory (cp.async) while it waits.
//
// The first form (five instructions: QKV, attention, O, gate/up, down; session 22) ran a 135M layer in 14.2 us with
// counters and 12.7-13.2 with LL words, against the engine's graph path at ~11.9: a hand-over inside a busy persistent
// kernel costs as much as a kernel boundary under programmatic launch, so only fewer dependent steps can win (NOTES,
// "CUDA, session 22" and "session 23"). Here the O and down projections are split over K and folded into the
// instruction before them; their partial sums go to the residual stream by vector atomics (red.global.add.v4.f32), so
// no instruction waits for the attention output or the FFN activations of the whole model:
//   QKV     norm(x_in) . Wqkv (QKV rows), tasks of kQkvRows rows; the k and v rows also go to the cache at P - 1
//   ATTN_O  query head h over P cached positions (scale 1/8, no RoPE: the cost, not the model), then its 64 columns
//           of Wo for a kOParts-th of the rows: x_mid += Wo[rows, h] . attn_h (head 0 also adds x_in); NH x kOParts
//           tasks (each part recomputes the head's attention: on other SMs, in parallel)
//   FFN     act = silu(gate) * up of norm(x_mid) for kGuUnits units, then x_out += Wdown[:, units] . act for all D
//           rows (task 0 also adds x_mid); FF / kGuUnits tasks. With 16 units a task uses one half of each Q4_0
//           block of its down column (the low nibbles hold weights 0-15, the high ones 16-31)
// x_in, x_mid and x_out of layer l are xs[2l], xs[2l + 1], xs[2l + 2], zero before the step (but xs[0]).
// Each instruction waits for the counter of the one before it (thread 0 spinning on an acquire load) to reach its task
// count; each task adds one to its own counter with a release after a barrier. Task t of an instruction runs on block
// (t + offset) % blocks, the offset rotating by each instruction's task count; every block walks the same instruction
// order, so with one resident block per SM (grid = SM count) the schedule cannot deadlock; a spin of 2^22 loads traps
// instead of hanging.
// Weights are Q4_0 (the engine's layout), activations fp32, the cache fp32. The result (x after L layers) is checked
// against a float64 CPU reference of the same computation.
//
// Measured: median of graph replays (counters and xs reset inside the graph) for L = 2 and L = all layers; the
// per-layer cost is the slope; prefetch 0 copies each task's weights after its wait instead. Then one traced run
// (%globaltimer by each task's thread 0) prints where an instruction's time goes.
// Session 23 (H200; RESULTS, NOTES): 135M shapes 9.9 us a layer (the five-step form 14.2 in the same call, the
// engine's graph path ~11.5); 1.7B shapes 52-56 (five-step 44.4, engine ~28: with one 8-warp block a SM the FFN's dots
// are the bound).
// Build and run: nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/bench_megakernel.cu -o /tmp/bench_megakernel &&
//   /tmp/bench_megakernel   (-DMK_1_7B for the 1.7B shapes; -DMK_OPARTS=N, -DMK_UNITS=16|32 for the task sizes)
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

// Task sizes: -DMK_OPARTS (ATTN_O tasks a head, default 4), -DMK_UNITS (FFN units a task, 16 or 32; default 16).
#ifndef MK_OPARTS
#define MK_OPARTS 4
#endif
#ifndef MK_UNITS
#define MK_UNITS 16
#endif
constexpr int kOParts = MK_OPARTS, kGuUnits = MK_UNITS;
#if defined(MK_1_7B)  // SmolLM2-1.7B's decode shapes
constexpr int D = 2048, NH = 32, NKV = 32, FF = 8192, kLayers = 24, kQkvRowsDefault = 48;
constexpr const char* kShape = "SmolLM2-1.7B";
#elif defined(MK_360M)  // SmolLM2-360M's
constexpr int D = 960, NH = 15, NKV = 5, FF = 2560, kLayers = 32, kQkvRowsDefault = 8;
constexpr const char* kShape = "SmolLM2-360M";
#else  // SmolLM2-135M's
constexpr int D = 576, NH = 9, NKV = 3, FF = 1536, kLayers = 30, kQkvRowsDefault = 8;
constexpr const char* kShape = "SmolLM2-135M";
#endif
// -DMK_QKV_ROWS (rows a QKV task), -DMK_THREADS (a block's threads, 256 or 512), -DMK_POLL_RELAXED (the counter
// polled with relaxed loads, one acquire fence after it is reached, instead of an acquire load a poll).
#ifdef MK_QKV_ROWS
constexpr int kQkvRows = MK_QKV_ROWS;
#else
constexpr int kQkvRows = kQkvRowsDefault;
#endif
#ifndef MK_THREADS
#define MK_THREADS 256
#endif
constexpr int NB = D / 32, HD = 64, KVD = NKV * HD, QKV = D + 2 * KVD;
constexpr int NBF = FF / 32, P = 32;  // P: positions attended (the new one is P - 1)
constexpr int kORows = D / kOParts;   // rows of Wo an ATTN_O task multiplies
constexpr int kThreads = MK_THREADS, kWarps = kThreads / 32;
// gate/up rows: kGuTpr lanes a row (8, 16 or 32), every row of the task in one pass where the block has the lanes
constexpr int kGuTpr = kThreads / (2 * kGuUnits) >= 32 ? 32 : kThreads / (2 * kGuUnits) >= 16 ? 16 : 8;
constexpr int kSteps = 3;
enum Instr { kQkv = 0, kAttnO = 1, kFfn = 2 };
__host__ __device__ constexpr int task_count(int in) {
  return in == kQkv ? QKV / kQkvRows : in == kAttnO ? NH * kOParts : FF / kGuUnits;
}
constexpr int kLayerTasks = task_count(0) + task_count(1) + task_count(2);
constexpr int cmax(int a, int b) { return a > b ? a : b; }
// Weight blocks of a task: QKV rows; the O rows' two blocks of head h; gate and up rows, then one down block a row.
constexpr int kMaxTaskBlocks = cmax(kQkvRows * NB, cmax(kORows * 2, 2 * kGuUnits * NB + D));
constexpr int kMaxTasks = cmax(task_count(0), cmax(task_count(1), task_count(2)));
constexpr int kStride = 36;  // padded 32-float blocks of staged activations
static_assert(P <= 32 && P * HD % kThreads == 0, "attention: one warp's softmax, whole staging passes");
static_assert(kThreads >= 2 * HD && kThreads % 32 == 0, "attention: q and the output a thread a dimension");
static_assert(kGuUnits == 16 || kGuUnits == 32, "a task's units are one Q4_0 block of the down rows, or half of one");
static_assert(D % kOParts == 0 && kORows % 4 == 0 && D % 4 == 0, "whole float4 atomics");
static_assert(QKV % kQkvRows == 0 && FF % kGuUnits == 0, "whole tasks");
static_assert(NB % 2 == 0 && NBF % 2 == 0, "scales copied in aligned pairs");

struct Matrix {
  const uint4* q;   // [rows][nb] nibbles
  const __half* d;  // [rows][nb] scales
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
  float* xs;   // [2 L + 1][D] residual stream: layer l reads xs[2l], O adds into xs[2l + 1], down into xs[2l + 2]
  float* qkv;  // [QKV]
  float* kc;   // [L][P][KVD]
  float* vc;
  unsigned* counters;  // [L][3], zero at launch
  int prefetch;
  // null, or [instruction][task][6] %globaltimer ns: waiting, released, staged, done, staging loads stored, norm
  unsigned long long* trace;
};

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
// One half of a Q4_0 block (half 0: weights 0-15, the low nibbles; half 1: weights 16-31) . 16 floats.
__device__ __forceinline__ float q4_half_dot(uint4 q, float d, int half, const float* xh) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  const int sh = 4 * half;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int q = static_cast<int>((w[i] >> (8 * j + sh)) & 0xf) - 8;
      s += xh[4 * i + j] * static_cast<float>(q);
    }
  return d * s;
}

struct Smem {
  uint4 wq[2][kMaxTaskBlocks];
  __half wd[2][kMaxTaskBlocks + 8];
  float x[NB * kStride];
  float red[kWarps];
  float sc[P];
  float o[HD];             // ATTN_O: the head's attention output
  float gu[2 * kGuUnits];  // FFN: the task's gate and up rows
  float act[kGuUnits];     // FFN: the task's activations
  float kv[2][P][HD + 1];  // attention: the head's K and V rows (padded: a warp's lanes read different rows)
  __half2 dsc[2][D];       // FFN: each down row's scale pair that holds its column's scale
};

// Copies a task's weight blocks into buffer b (layout: see kMaxTaskBlocks); commits one group.
__device__ __forceinline__ void fetch(Smem& sm, int b, const LayerW& L, int in, int t) {
  auto copy = [&](const Matrix& m, int dst, int row0, int rows, int blk0, int blks) {
    for (int i = threadIdx.x; i < rows * blks; i += kThreads) {
      const int r = row0 + i / blks, c = blk0 + i % blks;
      cp16(&sm.wq[b][dst + i], m.q + r * m.nb + c);
    }
  };
  auto copy_scales = [&](const Matrix& m, int dst, int row0, int rows, int blk0, int blks) {  // two at a time
    for (int i = threadIdx.x; i < rows * blks / 2; i += kThreads) {
      const int r = row0 + (2 * i) / blks, c = blk0 + (2 * i) % blks;
      cp4(&sm.wd[b][dst + 2 * i], m.d + r * m.nb + c);
    }
  };
  if (in == kQkv) {
    copy(L.qkv, 0, t * kQkvRows, kQkvRows, 0, NB);
    copy_scales(L.qkv, 0, t * kQkvRows, kQkvRows, 0, NB);
  } else if (in == kAttnO) {
    const int h = t / kOParts, j = t % kOParts;
    copy(L.o, 0, j * kORows, kORows, 2 * h, 2);
    copy_scales(L.o, 0, j * kORows, kORows, 2 * h, 2);
  } else {
    const int u0 = t * kGuUnits;
    copy(L.gu, 0, u0, kGuUnits, 0, NB);
    copy(L.gu, kGuUnits * NB, FF + u0, kGuUnits, 0, NB);
    copy(L.down, 2 * kGuUnits * NB, 0, D, u0 / 32, 1);
    copy_scales(L.gu, 0, u0, kGuUnits, 0, NB);
    copy_scales(L.gu, kGuUnits * NB, FF + u0, kGuUnits, 0, NB);
    // the down column's scales: the aligned pair that holds each (cp.async copies 4 bytes at least)
    for (int r = threadIdx.x; r < D; r += kThreads) cp4(&sm.dsc[b][r], L.down.d + r * NBF + (u0 / 32 & ~1));
  }
  cp_commit();
}

// Stages v[0 .. D) (read through L2, every load of a thread issued before the first store) into the padded layout,
// times norm_w; returns 1/rms. tr: trace slot 4 (thread 0's loads stored) when tracing.
__device__ __forceinline__ float stage(Smem& sm, const float* v, const float* norm_w, unsigned long long* tr) {
  constexpr int kPer = (D + kThreads - 1) / kThreads;
  float a[kPer], w[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = threadIdx.x + u * kThreads;
    a[u] = i < D ? __ldcg(v + i) : 0.f;
    w[u] = i < D ? __ldg(norm_w + i) : 0.f;
  }
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = threadIdx.x + u * kThreads;
    if (i < D) {
      ss += a[u] * a[u];
      sm.x[(i >> 5) * kStride + (i & 31)] = a[u] * w[u];
    }
  }
  if (tr) tr[4] = now_ns();
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) sm.red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w2 = 0; w2 < kWarps; ++w2) t += sm.red[w2];
  return rsqrtf(t / D + 1e-5f);
}

// y[r .. r + 4) += the values of lanes 4i .. 4i + 3 (row r = lane 4i's), plus add[r .. r + 4) where add is set: one
// vector atomic a group of four lanes. Every lane of the warp calls it; live: this lane's row exists.
__device__ __forceinline__ void add_rows4(float* y, int r, bool live, float v, const float* add) {
  const int lane = threadIdx.x & 31, base = lane & ~3;
  float4 v4 = make_float4(__shfl_sync(0xffffffffu, v, base), __shfl_sync(0xffffffffu, v, base + 1),
                          __shfl_sync(0xffffffffu, v, base + 2), __shfl_sync(0xffffffffu, v, base + 3));
  if (!live || (lane & 3) != 0) return;
  if (add != nullptr) {
    const float4 b = __ldcg(reinterpret_cast<const float4*>(add + r));
    v4.x += b.x;
    v4.y += b.y;
    v4.z += b.z;
    v4.w += b.w;
  }
  atomicAdd(reinterpret_cast<float4*>(y + r), v4);
}

// This task's weights landed: all but the next task's group (prefetch), or every group.
__device__ __forceinline__ void wait_task_weights(bool prefetch) {
  if (prefetch) cp_wait<1>();
  else cp_wait<0>();
}

// The counter's value: an acquire load, or (-DMK_POLL_RELAXED) a relaxed one, whose caller fences after its last poll.
__device__ __forceinline__ unsigned poll_counter(const unsigned* p) {
  unsigned v;
#ifdef MK_POLL_RELAXED
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

__global__ void __launch_bounds__(kThreads, 1) megakernel(Args a) {
  extern __shared__ __align__(16) unsigned char raw[];
  Smem& sm = *reinterpret_cast<Smem*>(raw);
  const int G = gridDim.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_instr = a.n_layers * kSteps;
  // This block's tasks, in schedule order: of instruction k (k = layer * kSteps + in) the tasks t0, t0 + G, ... below
  // its task count, t0 = (block - offset) mod G.
  struct Pos {
    int k, t;
  };
  auto first_task = [&](int k) {
    int off = (k / kSteps) * kLayerTasks;
    for (int j = 0; j < k % kSteps; ++j) off += task_count(j);
    const int t = ((static_cast<int>(blockIdx.x) - off) % G + G) % G;
    return t < task_count(k % kSteps) ? t : -1;
  };
  auto next = [&](Pos p) {
    if (p.k >= 0 && p.t + G < task_count(p.k % kSteps)) return Pos{p.k, p.t + G};
    for (int k = p.k + 1; k < n_instr; ++k)
      if (const int t = first_task(k); t >= 0) return Pos{k, t};
    return Pos{n_instr, 0};
  };
  int buf = 0;
  Pos cur = next(Pos{-1, 0});
  if (a.prefetch && cur.k < n_instr) fetch(sm, buf, a.layers[cur.k / kSteps], cur.k % kSteps, cur.t);
  for (Pos nxt; cur.k < n_instr; cur = nxt) {
    const int k = cur.k, l = k / kSteps, in = k % kSteps, t = cur.t;
    const LayerW& L = a.layers[l];
    float* x_in = a.xs + static_cast<size_t>(2 * l) * D;
    float* x_mid = x_in + D;
    float* x_out = x_mid + D;
    nxt = next(cur);
    if (a.prefetch) {
      if (nxt.k < n_instr) fetch(sm, buf ^ 1, a.layers[nxt.k / kSteps], nxt.k % kSteps, nxt.t);
      else cp_commit();
    }
    unsigned long long* tr = nullptr;  // thread 0's six timestamps of this task, when tracing
    if (a.trace != nullptr && threadIdx.x == 0) tr = a.trace + (static_cast<size_t>(k) * kMaxTasks + t) * 6;
    if (tr) tr[0] = now_ns();
    if (threadIdx.x == 0 && k > 0) {  // every instruction reads the one before it
      const unsigned target = task_count((k - 1) % kSteps);
      long long spins = 0;
      while (poll_counter(a.counters + k - 1) < target)
        if (++spins > (1ll << 22)) __trap();  // ~2-4 s: a schedule that cannot finish
#ifdef MK_POLL_RELAXED
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
    }
    __syncthreads();
    if (tr) tr[1] = now_ns();
    if (!a.prefetch) fetch(sm, buf, L, in, t);
    if (in == kQkv) {
      const float scale = stage(sm, x_in, L.attn_norm, tr);
      if (tr) tr[5] = now_ns();
      wait_task_weights(a.prefetch);
      __syncthreads();
      if (tr) tr[2] = now_ns();
      for (int r = warp; r < kQkvRows; r += kWarps) {
        const int row = t * kQkvRows + r;
        float acc = 0.f;
        for (int kb = lane; kb < NB; kb += 32)
          acc += q4_dot(sm.wq[buf][r * NB + kb], __half2float(sm.wd[buf][r * NB + kb]), sm.x + kb * kStride);
        const float v = warp_sum(acc) * scale;
        if (lane == 0) {
          a.qkv[row] = v;
          if (row >= D && row < D + KVD) a.kc[(static_cast<size_t>(l) * P + P - 1) * KVD + row - D] = v;
          if (row >= D + KVD) a.vc[(static_cast<size_t>(l) * P + P - 1) * KVD + row - D - KVD] = v;
        }
      }
    } else if (in == kAttnO) {
      // Attention of head h over P positions: K, V and q staged first (one round trip), then from shared memory.
      const int h = t / kOParts, part = t % kOParts, kvh = h / (NH / NKV);
      const float* kc = a.kc + static_cast<size_t>(l) * P * KVD + kvh * HD;
      const float* vc = a.vc + static_cast<size_t>(l) * P * KVD + kvh * HD;
      constexpr int kPer = P * HD / kThreads;  // values of K (and of V) a thread stages
      float kr[kPer], vr[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int i = threadIdx.x + u * kThreads, p = i / HD, c = i % HD;
        kr[u] = __ldcg(kc + p * KVD + c);
        vr[u] = __ldcg(vc + p * KVD + c);
      }
      const float qv = threadIdx.x < HD ? __ldcg(a.qkv + h * HD + threadIdx.x) : 0.f;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int i = threadIdx.x + u * kThreads, p = i / HD, c = i % HD;
        sm.kv[0][p][c] = kr[u];
        sm.kv[1][p][c] = vr[u];
      }
      if (threadIdx.x < HD) sm.x[threadIdx.x] = qv;
      wait_task_weights(a.prefetch);
      __syncthreads();
      if (tr) tr[2] = now_ns();
      for (int p = warp; p < P; p += kWarps) {  // a warp a position, lanes over dimension pairs
        const float s = warp_sum(sm.x[lane] * sm.kv[0][p][lane] + sm.x[lane + 32] * sm.kv[0][p][lane + 32]);
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
        sm.o[threadIdx.x] = o;
      }
      __syncthreads();
      // Wo[rows of this part, head h's 64 columns] . o: a thread a row (two blocks), four rows a vector atomic.
      for (int r0 = 0; r0 < kORows; r0 += kThreads) {
        const int r = r0 + threadIdx.x;
        float v = 0.f;
        if (r < kORows)
          v = q4_dot(sm.wq[buf][2 * r], __half2float(sm.wd[buf][2 * r]), sm.o) +
              q4_dot(sm.wq[buf][2 * r + 1], __half2float(sm.wd[buf][2 * r + 1]), sm.o + 32);
        add_rows4(x_mid, part * kORows + r, r < kORows, v, h == 0 ? x_in : nullptr);
      }
    } else {  // FFN
      const float scale = stage(sm, x_mid, L.ffn_norm, tr);
      if (tr) tr[5] = now_ns();
      wait_task_weights(a.prefetch);
      __syncthreads();
      if (tr) tr[2] = now_ns();
      // gate/up: kGuTpr lanes a row (rows 0 .. U - 1 gate, U .. 2U - 1 up), the sums to shared memory, then the
      // activations a thread a unit.
      for (int r = threadIdx.x / kGuTpr; r < 2 * kGuUnits; r += kThreads / kGuTpr) {
        const int sub = threadIdx.x % kGuTpr;
        float acc = 0.f;
        for (int kb = sub; kb < NB; kb += kGuTpr)
          acc += q4_dot(sm.wq[buf][r * NB + kb], __half2float(sm.wd[buf][r * NB + kb]), sm.x + kb * kStride);
#pragma unroll
        for (int o = kGuTpr / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (sub == 0) sm.gu[r] = acc * scale;
      }
      __syncthreads();
      if (threadIdx.x < kGuUnits) {
        const float g = sm.gu[threadIdx.x], up = sm.gu[kGuUnits + threadIdx.x];
        sm.act[threadIdx.x] = g / (1.f + expf(-g)) * up;
      }
      __syncthreads();
      // Wdown[:, units] . act: a thread a row (one block or half of one), four rows a vector atomic.
      const int u0 = t * kGuUnits, half = kGuUnits == 16 ? (u0 / 16) % 2 : 0;
      const int dn = 2 * kGuUnits * NB;  // the down blocks' offset in the buffer
      for (int r0 = 0; r0 < D; r0 += kThreads) {
        const int r = r0 + threadIdx.x;
        float v = 0.f;
        if (r < D) {
          const uint4 q = sm.wq[buf][dn + r];
          const __half2 d2 = sm.dsc[buf][r];
          const float d = __half2float((u0 / 32) % 2 == 0 ? __low2half(d2) : __high2half(d2));
          v = kGuUnits == 16 ? q4_half_dot(q, d, half, sm.act) : q4_dot(q, d, sm.act);
        }
        add_rows4(x_out, r, r < D, v, t == 0 ? x_mid : nullptr);
      }
    }
    __syncthreads();  // every thread's stores and atomics (and reads of buffer buf) before the release
    if (tr) tr[3] = now_ns();
    if (threadIdx.x == 0)
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
                              const std::vector<float>& kc, const std::vector<float>& vc) {
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
  CK(cudaFuncSetAttribute(megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, megakernel, kThreads, smem));
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
  std::vector<float> xs0(static_cast<size_t>(2 * max_layers + 1) * D, 0.f);
  std::copy(x0.begin(), x0.end(), xs0.begin());
  a.xs = upload(xs0);
  a.qkv = upload(std::vector<float>(QKV));
  a.kc = upload(kc);
  a.vc = upload(vc);
  a.counters = upload(std::vector<unsigned>(max_layers * kSteps));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  std::printf("%s shapes, %d layers, 3 steps a layer (tasks %d / %d / %d); %d SMs, %d block(s) a SM fit, %zu bytes "
              "of shared memory a block\n",
              kShape, max_layers, task_count(0), task_count(1), task_count(2), n_sms, per_sm, smem);
  // One step as the graph replays it: the counters and the accumulated residuals reset, the kernel.
  auto enqueue = [&]() {
    CK(cudaMemsetAsync(a.counters, 0, max_layers * kSteps * sizeof(unsigned), st));
    CK(cudaMemsetAsync(a.xs + D, 0, static_cast<size_t>(2 * max_layers) * D * sizeof(float), st));
    megakernel<<<n_sms, kThreads, smem, st>>>(a);
    CK(cudaGetLastError());
  };
  std::map<int, std::vector<double>> refs;  // the float64 reference for each layer count
  for (int prefetch : {1, 0}) {
    for (int n_layers : {2, max_layers}) {
      a.n_layers = n_layers;
      a.prefetch = prefetch;
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      enqueue();
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphLaunch(ge, st));
      CK(cudaStreamSynchronize(st));
      std::vector<float> x(D);
      CK(cudaMemcpy(x.data(), a.xs + static_cast<size_t>(2 * n_layers) * D, D * sizeof(float),
                    cudaMemcpyDeviceToHost));
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
        float tm = 0.f;
        CK(cudaEventElapsedTime(&tm, e0, e1));
        if (it >= 20) ms.push_back(tm);
      }
      std::sort(ms.begin(), ms.end());
      std::printf("prefetch %d, %2d layers: %8.1f us a step (median of 200; min %.1f), max |x - ref| %.2e "
                  "(max |ref| %.2f)%s\n",
                  prefetch, n_layers, ms[ms.size() / 2] * 1e3, ms.front() * 1e3, err, mag,
                  err <= 1e-3 * std::max(1.0, mag) ? "" : "  <-- MISMATCH");
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
  }
  // One traced run (all layers, prefetch on): where an instruction's time goes, averaged over the middle layers.
  const size_t n = static_cast<size_t>(max_layers) * kSteps * kMaxTasks * 6;
  unsigned long long* trace = upload(std::vector<unsigned long long>(n, 0ull));
  a.n_layers = max_layers;
  a.prefetch = 1;
  a.trace = trace;
  for (int rep = 0; rep < 3; ++rep) enqueue();  // the last of three runs
  CK(cudaStreamSynchronize(st));
  std::vector<unsigned long long> tr(n);
  CK(cudaMemcpy(tr.data(), trace, n * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  auto at = [&](int k, int t, int j) {
    return static_cast<double>(tr[(static_cast<size_t>(k) * kMaxTasks + t) * 6 + j]);
  };
  const char* names[kSteps] = {"QKV", "ATTN_O", "FFN"};
  std::printf("traced, us, averages over layers 5..%d: hand-over = first release seen - last task of the read "
              "instruction done; span = last done - last done of the read instruction\n", max_layers - 6);
  std::printf("%-6s %6s %9s %9s %9s %9s %9s %8s   staging = x loads + norm + weights (QKV, FFN)\n", "instr", "tasks",
              "hand-over", "seen-skew", "staging", "compute", "release", "span");
  double layer = 0.0;
  for (int in = 0; in < kSteps; ++in) {
    double ho = 0, skew = 0, stg = 0, cmp = 0, spn = 0, rel = 0, lds = 0, nrm = 0, wts = 0;
    int cnt = 0;
    for (int l = 5; l < max_layers - 5; ++l, ++cnt) {
      const int k = l * kSteps + in, dep = k - 1, nt = task_count(in), nd = task_count(dep % kSteps);
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
    std::printf("%-6s %6d %9.2f %9.2f %9.2f %9.2f %9.2f %8.2f", names[in], task_count(in), ho / cnt / 1e3,
                skew / cnt / 1e3, stg / cnt / 1e3, cmp / cnt / 1e3, rel / cnt / 1e3, spn / cnt / 1e3);
    if (in != kAttnO) std::printf("   %.2f + %.2f + %.2f", lds / cnt / 1e3, nrm / cnt / 1e3, wts / cnt / 1e3);
    std::printf("\n");
    layer += spn / cnt / 1e3;
  }
  std::printf("layer (sum of spans): %.2f us\n", layer);
  return 0;
}
