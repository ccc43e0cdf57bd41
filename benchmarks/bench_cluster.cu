// Could one thread-block cluster run a small model's whole decode step? The persistent prototype
// (bench_megakernel.cu) spends 12-14 us a layer on SmolLM2-135M's shapes because every instruction is an all-to-all
// exchange between 132 SMs through L2 (~0.6 us a hand-over plus ~1 us of skew between the blocks). Inside a cluster the
// hand-over is a hardware barrier and the exchange goes through distributed shared memory; the price is that the
// cluster's 8-16 SMs must stream all the weights themselves. This measures the three figures that decide it:
//   1. a cluster barrier (barrier.cluster arrive.release + wait.acquire) back to back, at cluster sizes 2 .. 16;
//   2. an all-gather of 576 floats through distributed shared memory (each block writes its share into every block's
//      shared memory) plus the barrier after it: one decode hand-over inside a cluster;
//   3. HBM streaming: blocks that each copy their own slice of a 256 MB buffer into a ring of shared memory with
//      cp.async.bulk (one thread issues, an mbarrier a stage), at 1, 8, 16 and 132 blocks: GB/s a block (an SM).
// Build and run (H100): nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/bench_cluster.cu -o /tmp/bench_cluster &&
//   /tmp/bench_cluster
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 256;
constexpr int kGather = 576;  // SmolLM2-135M's d_model

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// 1 and 2: `iters` barriers (with the all-gather before each when gather is set); block 0's thread 0 reports ns each.
__global__ void __launch_bounds__(kThreads) barrier_kernel(int iters, bool gather, float* sink, double* ns_per) {
  __shared__ float buf[2][kGather];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), n = static_cast<int>(cluster.num_blocks());
  const int share = (kGather + n - 1) / n;
  for (int i = threadIdx.x; i < 2 * kGather; i += kThreads) buf[i / kGather][i % kGather] = 0.f;
  cluster.sync();
  const unsigned long long t0 = now_ns();
  float acc = 0.f;
  for (int it = 0; it < iters; ++it) {
    float* b = buf[it & 1];
    if (gather) {
      // This block's share (the values it would have computed), written into every block's buffer: n x share stores
      // spread over the threads, a store each.
      for (int i = threadIdx.x; i < n * share; i += kThreads) {
        const int dst = i / share, j = rank * share + i % share;
        if (j < kGather) cluster.map_shared_rank(b, dst)[j] = acc + static_cast<float>(it + j);
      }
    }
    cluster.sync();
    if (gather) acc += b[(threadIdx.x * 7 + it) % kGather];  // a value another block wrote, read after the barrier
  }
  const unsigned long long t1 = now_ns();
  if (acc == -1.f) sink[0] = acc;
  if (cluster.block_rank() == 0 && blockIdx.x == 0 && threadIdx.x == 0) *ns_per = double(t1 - t0) / iters;
}

// 3: each block streams bytes [blockIdx.x * per_block, +per_block) of src through a ring of kStages x kChunk bytes.
constexpr int kChunk = 16384, kStages = 8;
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__global__ void __launch_bounds__(kThreads) stream_kernel(const char* src, size_t per_block, unsigned* sink) {
  // src: this launch's region (the caller rotates it through the buffer so that no launch finds its bytes in L2).
  extern __shared__ __align__(128) unsigned char ring[];  // kStages x kChunk
  __shared__ __align__(8) unsigned long long bar[kStages];
  const int n_chunks = static_cast<int>(per_block / kChunk);
  const char* base = src + blockIdx.x * per_block;
  unsigned acc = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    auto issue = [&](int c) {
      const int s = c % kStages;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[s])), "r"(kChunk)
                   : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              smem_addr(ring + s * kChunk)),
          "l"(base + static_cast<size_t>(c) * kChunk), "r"(kChunk), "r"(smem_addr(&bar[s]))
          : "memory");
    };
    for (int c = 0; c < kStages && c < n_chunks; ++c) issue(c);
    for (int c = 0; c < n_chunks; ++c) {
      const int s = c % kStages;
      const unsigned parity = (c / kStages) & 1;
      unsigned done = 0;
      while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_addr(&bar[s])), "r"(parity)
            : "memory");
      acc += reinterpret_cast<const unsigned*>(ring + s * kChunk)[c & 1023];  // the data arrived; touch it
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before the next async write
      if (c + kStages < n_chunks) issue(c + kStages);
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <typename F>
float median_ms(cudaStream_t st, F launch, int reps = 21) {  // launch(r): the r-th launch
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < reps + 2; ++r) {
    CK(cudaEventRecord(e0, st));
    launch(r);
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float t = 0.f;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main() {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  float* sink = nullptr;
  double* ns = nullptr;
  CK(cudaMalloc(&sink, 64));
  CK(cudaMallocManaged(&ns, sizeof(double)));
  CK(cudaFuncSetAttribute(barrier_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  std::printf("cluster barrier, ns each (median of 5 launches of 20,000; block 0's clock):\n");
  std::printf("%8s %14s %22s\n", "cluster", "barrier alone", "all-gather + barrier");
  for (int cs : {2, 4, 8, 16}) {
    double r[2] = {0, 0};
    for (int gather = 0; gather < 2; ++gather) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(cs);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = st;
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeClusterDimension;
      at[0].val.clusterDim.x = cs;
      at[0].val.clusterDim.y = 1;
      at[0].val.clusterDim.z = 1;
      cfg.attrs = at;
      cfg.numAttrs = 1;
      std::vector<double> v;
      for (int rep = 0; rep < 5; ++rep) {
        const cudaError_t e = cudaLaunchKernelEx(&cfg, barrier_kernel, 20000, gather == 1, sink, ns);
        if (e != cudaSuccess) {
          std::printf("%8d launch failed: %s\n", cs, cudaGetErrorString(e));
          cudaGetLastError();
          break;
        }
        CK(cudaDeviceSynchronize());
        v.push_back(*ns);
      }
      std::sort(v.begin(), v.end());
      r[gather] = v.empty() ? -1 : v[v.size() / 2];
    }
    std::printf("%8d %14.1f %22.1f\n", cs, r[0], r[1]);
  }

  const size_t total = size_t{256} << 20;
  char* src = nullptr;
  CK(cudaMalloc(&src, total));
  CK(cudaMemset(src, 1, total));
  const int smem = kStages * kChunk;
  CK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int n_sms = 0;
  CK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("HBM streaming by cp.async.bulk, %d x %d KB in flight a block (256 MB buffer; each block its own "
              "slice; consecutive launches read different regions):\n", kStages, kChunk / 1024);
  std::printf("%8s %10s %12s %14s\n", "blocks", "MB", "GB/s total", "GB/s a block");
  for (int blocks : {1, 2, 8, 16, 32, n_sms}) {
    // Small grids read less (the slice a block streams stays 8 MB, or the whole buffer shared out).
    const size_t per_block = std::min(total / blocks, size_t{8} << 20) / kChunk * kChunk;
    const size_t region = per_block * blocks, n_regions = total / region;
    const float ms = median_ms(st, [&](int r) {
      stream_kernel<<<blocks, kThreads, smem, st>>>(src + (r % n_regions) * region, per_block,
                                                    reinterpret_cast<unsigned*>(sink));
      CK(cudaGetLastError());
    });
    const double bytes = static_cast<double>(per_block) * blocks;
    std::printf("%8d %10.0f %12.1f %14.1f\n", blocks, bytes / 1e6, bytes / ms / 1e6, bytes / ms / 1e6 / blocks);
  }
  return 0;
}
