// How long does one dependent step cost on this GPU? The decode step is a chain of ~120 small dependent phases, so
// this floor decides the design. Measures, per step (median of graph replays after warm-up, CUDA events):
//   1. a graph of N tiny kernels, each reading what the previous one wrote, launched plainly;
//   2. the same with programmatic dependent launch (griddepcontrol);
//   3. one persistent cooperative kernel that crosses N grid-wide barriers (one block per SM), each phase reading
//      what another block wrote before the barrier;
//   4. one persistent kernel (one block per SM) whose N steps hop from SM to SM: step s runs on block s % blocks once
//      the counter says step s - 1 is done (acquire load, spinning), reads what that step wrote, writes its own and
//      releases the counter: the point-to-point hand-over a persistent decode kernel's instructions would use
//      instead of a kernel boundary or a grid barrier.
// Build: nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/bench_sync_floor.cu -o /tmp/bench_sync_floor
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

__global__ void step_kernel(const float* in, float* out, int n, bool pdl) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[(i * 7) % n] + 1.f;
}

struct Barrier {
  unsigned int count;
  unsigned int epoch;
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void persistent_kernel(Barrier* bar, float* buf, int n_steps, int n) {
  const unsigned G = gridDim.x;
  const unsigned base = bar->epoch * static_cast<unsigned>(n_steps) * G;
  for (int s = 0; s < n_steps; ++s) {
    float* in = buf + (s & 1) * n;
    float* out = buf + ((s + 1) & 1) * n;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __ldcg(in + (i * 7) % n) + 1.f;
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned target = base + static_cast<unsigned>(s + 1) * G;
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&bar->count) : "memory");
      while (static_cast<int>(ld_acquire(&bar->count) - target) < 0) {
      }
    }
    __syncthreads();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) bar->epoch += 1;
}

// Counter value for step s of this launch: epoch * n_steps + s (the counter keeps counting across graph replays).
__global__ void handover_kernel(unsigned* counter, const unsigned* epoch, float* buf, int n_steps) {
  const unsigned base = *epoch * static_cast<unsigned>(n_steps);
  for (int s = blockIdx.x; s < n_steps; s += gridDim.x) {
    if (threadIdx.x == 0) {
      while (static_cast<int>(ld_acquire(counter) - (base + static_cast<unsigned>(s))) < 0) {
      }
    }
    __syncthreads();
    const int i = threadIdx.x % 256;
    const float v = __ldcg(buf + (s & 1) * 256 + i) + 1.f;
    buf[((s + 1) & 1) * 256 + i] = v;
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
  }
}

__global__ void bump_epoch(unsigned* epoch) { *epoch += 1; }

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static float time_graph(cudaGraphExec_t exec, cudaStream_t s, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(exec, s));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.f);
  }
  return median(t);
}

// Captures what `enqueue` launches on s into a graph, times its replays (median, us) and frees the graph.
template <typename F>
static float time_captured(cudaStream_t s, F enqueue) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  enqueue();
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, g, 0));
  const float us = time_graph(exec, s, 50);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(g));
  return us;
}

int main(int argc, char** argv) {
  const int n_steps = argc > 1 ? std::atoi(argv[1]) : 120;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int n_sms = 0;
  CK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  const int n = 4096;
  float* buf;
  CK(cudaMalloc(&buf, 2 * n * sizeof(float)));
  CK(cudaMemset(buf, 0, 2 * n * sizeof(float)));

  for (int pdl = 0; pdl < 2; ++pdl) {
    for (int blocks : {32, 132}) {
      const float us = time_captured(s, [&] {
        for (int i = 0; i < n_steps; ++i) {
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attr[0].val.programmaticStreamSerializationAllowed = 1;
          cudaLaunchConfig_t cfg{};
          cfg.gridDim = dim3(blocks);
          cfg.blockDim = dim3(128);
          cfg.stream = s;
          cfg.attrs = pdl ? attr : nullptr;
          cfg.numAttrs = pdl ? 1 : 0;
          const float* in = buf + (i & 1) * n;
          float* out = buf + ((i + 1) & 1) * n;
          CK(cudaLaunchKernelEx(&cfg, step_kernel, in, out, std::min(n, blocks * 128), pdl != 0));
        }
      });
      std::printf("kernel chain  pdl=%d blocks=%3d: %8.1f us for %d steps = %.3f us/step\n", pdl, blocks, us, n_steps,
                  us / n_steps);
    }
  }

  Barrier* bar;
  CK(cudaMalloc(&bar, sizeof(Barrier)));
  CK(cudaMemset(bar, 0, sizeof(Barrier)));
  for (int threads : {256, 512}) {
    const float us = time_captured(s, [&] {
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeCooperative;
      attr[0].val.cooperative = 1;
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(n_sms);
      cfg.blockDim = dim3(threads);
      cfg.stream = s;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, persistent_kernel, bar, buf, n_steps, n));
    });
    std::printf("persistent    blocks=%3d x %d: %8.1f us for %d barriers = %.3f us/barrier\n", n_sms, threads, us,
                n_steps, us / n_steps);
  }

  unsigned* counter;
  CK(cudaMalloc(&counter, 2 * sizeof(unsigned)));
  CK(cudaMemset(counter, 0, 2 * sizeof(unsigned)));
  for (int blocks : {2, 32, n_sms}) {
    for (int threads : {128, 512}) {
      const float us = time_captured(s, [&] {
        handover_kernel<<<blocks, threads, 0, s>>>(counter, counter + 1, buf, n_steps);
        bump_epoch<<<1, 1, 0, s>>>(counter + 1);
      });
      std::printf("hand-over     blocks=%3d x %d: %8.1f us for %d SM-to-SM steps = %.3f us/step\n", blocks, threads, us,
                  n_steps, us / n_steps);
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
