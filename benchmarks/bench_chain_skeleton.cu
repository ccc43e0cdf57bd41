// The decode chain stripped to its skeleton: what does a SmolLM2-shaped step of 30 x 5 dependent kernels cost
// when each kernel does only what the real ones must (weights into registers before the dependency wait, stage
// the activation vector in shared memory, one warp per Q4_0 row, write the rows) and nothing else? Compared with
// the real step (441 us), it says how much of the per-kernel time is the design and how much is fat.
//
// Variants, each timed as graph replays (median after warm-up, CUDA events):
//   wait  = griddepcontrol.wait (the real kernels' hand-over: the previous grid completes and flushes);
//   flag  = the previous kernel's blocks each add 1 to a counter with release semantics after their last store,
//           and this kernel's blocks spin on it with acquire loads (deadlock-free because a programmatic launch only
//           starts a kernel once every block of the one before is resident);
//   hbm   = each layer reads its own weights (90 MB per step, they stream from HBM as in the model);
//   l2    = every layer reads layer 0's weights (2 MB, L2-resident);
//   work  = what a kernel does after its wait (see kWork below): nothing but its store, staging x, staging x and
//           the Q4_0 dot, the dot on weights dequantized before the wait, or the two halves of that split apart;
//   model = the layer's five shapes (QKV 960x576, a 72-row stand-in for attention, O, gate/up 3072x576, down
//           576x1536); 72 blocks = five 576x576 matvecs.
// Fifth-session figures (H100) are in benchmarks/NOTES.md.
// Build: nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/bench_chain_skeleton.cu -o /tmp/bench_chain_skeleton
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 32, kMaxCols = 1536;
// Shared layout of the staged activations: each 32-value block padded to 36 floats, so that lanes reading
// consecutive blocks with 16-byte loads hit different banks (the real kernels' kSmemBlockStride).
constexpr int kStride = 36;
__device__ __forceinline__ int sidx(int i) { return (i >> 5) * kStride + (i & 31); }

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

struct Step {
  const uint4* w;       // rows x nb blocks of 16 nibble bytes
  const __half* scale;  // rows x nb
  const float* x;
  float* y;
  int rows, cols;
  unsigned* wait_on;  // flag mode: counter of the kernel before (nullptr: none)
  unsigned wait_for;  // its block count
  unsigned* signal;   // flag mode: this kernel's counter
};

// kWork: 0 = write only, 1 = stage x + write, 2 = stage x + Q4_0 dot (nibbles converted after the wait, as the
// real kernels did up to the fifth session), 3 = the same dot with the weights dequantized to floats before the wait.
template <bool kFlag, int kWork>
__global__ void __launch_bounds__(kThreads) skeleton_matvec(Step s) {
  __shared__ __align__(16) float x_s[kMaxCols / 32 * kStride];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kRowsPerBlock + warp;
  const int nb = s.cols / 32;
  uint4 w[2] = {};
  float d[2] = {};
  float wf[2][32];
  if (row < s.rows) {  // a real branch keeps the loads ahead of the wait (see NOTES, fourth session)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int b = lane + 32 * u;
      if (kWork == 5) {
        w[u] = make_uint4(row * 0x9e3779b9u, lane * 0x85ebca6bu, b * 0xc2b2ae35u, 0x27d4eb2fu);
        d[u] = 0.01f;
      } else if (b < nb) {
        w[u] = __ldg(s.w + static_cast<int64_t>(row) * nb + b);
        d[u] = __half2float(s.scale[static_cast<int64_t>(row) * nb + b]);
      }
    }
    if (kWork >= 3) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const uint32_t q[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const uint32_t byte = (q[j / 4] >> (8 * (j % 4))) & 0xffu;
          wf[u][j] = d[u] * static_cast<float>(static_cast<int>(byte & 15u) - 8);
          wf[u][j + 16] = d[u] * static_cast<float>(static_cast<int>(byte >> 4) - 8);
        }
      }
    }
  }
  if (kFlag) {
    if (s.wait_on != nullptr && threadIdx.x == 0)
      while (ld_acquire(s.wait_on) < s.wait_for) __nanosleep(32);
    __syncthreads();
  } else {
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  if (kWork >= 1) {  // every load issued before the first store: one L2 round trip, as in the real kernels' staging
    constexpr int kPer = kMaxCols / kThreads;
    float v[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = threadIdx.x + u * kThreads;
      v[u] = i < s.cols ? __ldcg(s.x + i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = threadIdx.x + u * kThreads;
      if (i < s.cols) x_s[sidx(i)] = v[u];
    }
  }
  __syncthreads();
  float acc = kWork == 1 ? x_s[sidx(row % s.cols)] : 0.f;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int b = lane + 32 * u;
    if (kWork >= 2 && b < nb) {
      const float* xb = x_s + b * kStride;
      if (kWork == 4) {
        float p = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) p += wf[u][j];
        acc += p * xb[0];
      } else if (kWork == 2) {
        const uint32_t q[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
        float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 16; j += 4) {
          const float4 lo = *reinterpret_cast<const float4*>(xb + j), hi = *reinterpret_cast<const float4*>(xb + 16 + j);
          const float l[4] = {lo.x, lo.y, lo.z, lo.w}, h[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t byte = (q[(j + k) / 4] >> (8 * ((j + k) % 4))) & 0xffu;
            p[k] += static_cast<float>(static_cast<int>(byte & 15u) - 8) * l[k];
            p[k] += static_cast<float>(static_cast<int>(byte >> 4) - 8) * h[k];
          }
        }
        acc += d[u] * ((p[0] + p[1]) + (p[2] + p[3]));
      } else {
        float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 32; j += 4) {
          const float4 x4 = *reinterpret_cast<const float4*>(xb + j);
          p[0] += wf[u][j] * x4.x;
          p[1] += wf[u][j + 1] * x4.y;
          p[2] += wf[u][j + 2] * x4.z;
          p[3] += wf[u][j + 3] * x4.w;
        }
        acc += (p[0] + p[1]) + (p[2] + p[3]);
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0 && row < s.rows) s.y[row] = acc * 1e-3f;  // keeps the chain's values bounded
  if (kFlag) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(s.signal) : "memory");
  }
}

template <bool kFlag>
static void launch_skeleton(const cudaLaunchConfig_t& cfg, const Step& s, int work) {
  switch (work) {
    case 0: CK(cudaLaunchKernelEx(&cfg, skeleton_matvec<kFlag, 0>, s)); break;
    case 1: CK(cudaLaunchKernelEx(&cfg, skeleton_matvec<kFlag, 1>, s)); break;
    case 2: CK(cudaLaunchKernelEx(&cfg, skeleton_matvec<kFlag, 2>, s)); break;
    case 3: CK(cudaLaunchKernelEx(&cfg, skeleton_matvec<kFlag, 3>, s)); break;
    case 4: CK(cudaLaunchKernelEx(&cfg, skeleton_matvec<kFlag, 4>, s)); break;
    default: CK(cudaLaunchKernelEx(&cfg, skeleton_matvec<kFlag, 5>, s)); break;
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  constexpr int kLayers = 30, d = 576, ffn = 1536;
  struct Shape {
    int rows, cols;
  };
  // Per layer: QKV, an attention stand-in (9 blocks: 72 rows of the O shape), O, gate/up, down.
  const Shape shapes[5] = {{960, d}, {72, d}, {d, d}, {2 * ffn, d}, {d, ffn}};
  size_t layer_blocks = 0;
  for (const Shape& sh : shapes) layer_blocks += static_cast<size_t>(sh.rows) * sh.cols / 32;
  uint4* w;
  __half* sc;
  CK(cudaMalloc(&w, layer_blocks * kLayers * sizeof(uint4)));
  CK(cudaMalloc(&sc, layer_blocks * kLayers * sizeof(__half)));
  {
    std::vector<uint32_t> host(layer_blocks * kLayers * 4);
    uint32_t r = 12345;
    for (uint32_t& v : host) v = (r = r * 1664525u + 1013904223u);
    CK(cudaMemcpy(w, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
    std::vector<__half> hs(layer_blocks * kLayers);
    for (size_t i = 0; i < hs.size(); ++i) hs[i] = __float2half(0.01f + 0.001f * static_cast<float>(i % 7));
    CK(cudaMemcpy(sc, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
  }
  float* act;
  CK(cudaMalloc(&act, 2 * 4096 * sizeof(float)));
  std::vector<float> ones(2 * 4096, 0.5f);
  CK(cudaMemcpy(act, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  const int n_kernels = kLayers * 5;
  unsigned* counters;
  CK(cudaMalloc(&counters, n_kernels * sizeof(unsigned)));

  const Shape uniform[5] = {{d, d}, {d, d}, {d, d}, {d, d}, {d, d}};
  struct Variant {
    int flag, l2, work;
    bool uniform;
  };
  const Variant variants[] = {{0, 0, 2, false}, {0, 1, 2, false}, {0, 0, 3, false}, {0, 0, 4, false},
                              {0, 0, 5, false}, {0, 1, 1, false}, {0, 1, 0, false}, {0, 1, 2, true},
                              {0, 1, 3, true},  {0, 1, 4, true},  {0, 1, 5, true},  {0, 1, 1, true},
                              {0, 1, 0, true},  {0, 1, 2, false}};
  for (const Variant& v : variants) {
    const int flag = v.flag, l2 = v.l2;
    {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      CK(cudaMemsetAsync(counters, 0, n_kernels * sizeof(unsigned), st));
      int k = 0;
      unsigned prev_blocks = 0;
      for (int l = 0; l < kLayers; ++l) {
        size_t off = (l2 ? 0 : l) * layer_blocks;
        for (const Shape& sh : v.uniform ? uniform : shapes) {
          Step s{};
          s.w = w + off;
          s.scale = sc + off;
          off += static_cast<size_t>(sh.rows) * sh.cols / 32;
          s.x = act + (k & 1) * 4096;
          s.y = act + ((k + 1) & 1) * 4096;
          s.rows = sh.rows;
          s.cols = sh.cols;
          s.wait_on = k > 0 ? counters + k - 1 : nullptr;
          s.wait_for = prev_blocks;
          s.signal = counters + k;
          const unsigned blocks = (sh.rows + kRowsPerBlock - 1) / kRowsPerBlock;
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attr[0].val.programmaticStreamSerializationAllowed = 1;
          cudaLaunchConfig_t cfg{};
          cfg.gridDim = dim3(blocks);
          cfg.blockDim = dim3(kThreads);
          cfg.stream = st;
          cfg.attrs = attr;
          cfg.numAttrs = 1;
          if (flag) launch_skeleton<true>(cfg, s, v.work);
          else launch_skeleton<false>(cfg, s, v.work);
          prev_blocks = blocks;
          ++k;
        }
      }
      CK(cudaStreamEndCapture(st, &g));
      cudaGraphExec_t exec;
      CK(cudaGraphInstantiate(&exec, g, 0));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(exec, st));
      std::vector<float> t;
      for (int i = 0; i < 200; ++i) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(exec, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1000.f);
      }
      const float us = median(t);
      static const char* work_names[] = {"write only", "stage+write", "stage+dot", "stage+fdot", "load only", "no load"};
      std::printf("skeleton %s %s %-11s %-9s: %7.1f us per step of %d kernels = %.3f us per kernel\n",
                  flag ? "flag" : "wait", l2 ? "l2 " : "hbm", work_names[v.work], v.uniform ? "72 blocks" : "model",
                  us, n_kernels, us / n_kernels);
      CK(cudaGraphExecDestroy(exec));
      CK(cudaGraphDestroy(g));
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
