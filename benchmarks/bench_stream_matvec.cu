// Can a decode matvec stream its weights at HBM speed? The SmolLM2-1.7B shape's matvecs reach 0.8-1.3 TB/s alone
// (RESULTS, session 21), while 132 blocks that each keep 128 KB of cp.async.bulk copies in flight stream 2.9 TB/s
// (bench_cluster.cu). This compares, on the 1.7B's gate/up (16,384 x 2,048) and down (2,048 x 8,192) Q4_0 shapes, with
// cold weights (copies rotated, 80 MB or more in all: more than L2), timed as a graph of 20 back-to-back launches:
//   regs   8 lanes a row, each lane loading its weight blocks into registers (8 in flight) then dotting them: the shape
//          of the engine's decode matvecs;
//   ring   one block a SM; thread 0 streams chunks of whole rows (payload and scales, two bulk copies) into a ring of
//          shared-memory stages, each with an mbarrier; all warps dot a stage as soon as it lands while the later
//          stages are in flight, then thread 0 refills it.
// Both stage x (fp32) in shared memory and write y; checked against a float64 reference.
// Build and run (H100): nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/bench_stream_matvec.cu -o /tmp/bsm && /tmp/bsm
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

constexpr int kThreads = 256;
constexpr int kStride = 36;  // padded 32-float blocks of staged x

struct Q4 {
  const uint4* q;     // [rows][nb] nibbles
  const __half* d;    // [rows][nb] scales
  int rows, nb;
};

// Q4_0 block (q - 8) . 32 staged floats (low nibbles: weights 0-15, high: 16-31).
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

__device__ __forceinline__ void stage_x(float* xs, const float* x, int n) {
  for (int i = threadIdx.x; i < n; i += kThreads) xs[(i >> 5) * kStride + (i & 31)] = x[i];
  __syncthreads();
}

// regs: 8 lanes a row, 32 rows a block; each lane's blocks loaded 8 at a time before any is used.
__global__ void __launch_bounds__(kThreads) regs_kernel(Q4 W, const float* __restrict__ x, float* __restrict__ y) {
  extern __shared__ float xs[];
  stage_x(xs, x, W.nb * 32);
  const int row = blockIdx.x * (kThreads / 8) + threadIdx.x / 8, sub = threadIdx.x % 8;
  float acc = 0.f;
  if (row < W.rows) {
    const uint4* q = W.q + static_cast<size_t>(row) * W.nb;
    const __half* d = W.d + static_cast<size_t>(row) * W.nb;
    for (int b0 = sub; b0 < W.nb; b0 += 8 * 8) {
      uint4 qs[8];
      float ds[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int b = b0 + 8 * u;
        qs[u] = b < W.nb ? __ldcs(q + b) : make_uint4(0, 0, 0, 0);
        ds[u] = b < W.nb ? __half2float(d[b]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (b0 + 8 * u < W.nb) acc += q4_dot(qs[u], ds[u], xs + (b0 + 8 * u) * kStride);
    }
  }
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (row < W.rows && sub == 0) y[row] = acc;
}

// ring: chunks of kRows whole rows; chunk c's payload is q[c * kRows * nb ..) and its scales d[c * kRows * nb ..), both
// contiguous. Block b takes chunks b, b + G, ...; kStages of them in flight.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void wait_parity(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(parity)
                 : "memory");
}

template <int kRows, int kStages>
__global__ void __launch_bounds__(kThreads, 1) ring_kernel(Q4 W, const float* __restrict__ x, float* __restrict__ y) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full[kStages];
  __shared__ float part[2][kThreads / 32];  // rows wider than a warp: per-warp sums (chunk parity)
  const int nb = W.nb, n_chunks = W.rows / kRows, G = gridDim.x;
  const unsigned q_bytes = kRows * nb * 16, d_bytes = kRows * nb * 2;
  const unsigned stage_bytes = (q_bytes + d_bytes + 127) / 128 * 128;
  float* xs = reinterpret_cast<float*>(smem + kStages * stage_bytes);
  auto issue = [&](int i) {  // this block's i-th chunk into stage i % kStages (thread 0)
    const int c = blockIdx.x + i * G, s = i % kStages;
    unsigned char* st = smem + s * stage_bytes;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])),
                 "r"(q_bytes + d_bytes)
                 : "memory");
    bulk_copy(st, W.q + static_cast<size_t>(c) * kRows * nb, q_bytes, &full[s]);
    bulk_copy(st + q_bytes, W.d + static_cast<size_t>(c) * kRows * nb, d_bytes, &full[s]);
  };
  const int mine = (n_chunks - static_cast<int>(blockIdx.x) + G - 1) / G;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int i = 0; i < kStages && i < mine; ++i) issue(i);
  }
  stage_x(xs, x, nb * 32);  // its barrier also publishes the mbarrier initialisation
  // A chunk's kRows x nb blocks over the 256 threads: kLanes lanes a row, each lane every kLanes-th block of its row.
  constexpr int kLanes = kThreads / kRows;
  const int r = threadIdx.x / kLanes, sub = threadIdx.x % kLanes;
  for (int i = 0; i < mine; ++i) {
    const int s = i % kStages, c = blockIdx.x + i * G;
    wait_parity(&full[s], (i / kStages) & 1);
    const unsigned char* st = smem + s * stage_bytes;
    const uint4* q = reinterpret_cast<const uint4*>(st) + r * nb;
    const __half* d = reinterpret_cast<const __half*>(st + q_bytes) + r * nb;
    float acc0 = 0.f, acc1 = 0.f;
    int b = sub;
    for (; b + kLanes < nb; b += 2 * kLanes) {
      acc0 += q4_dot(q[b], __half2float(d[b]), xs + b * kStride);
      acc1 += q4_dot(q[b + kLanes], __half2float(d[b + kLanes]), xs + (b + kLanes) * kStride);
    }
    if (b < nb) acc0 += q4_dot(q[b], __half2float(d[b]), xs + b * kStride);
    float acc = acc0 + acc1;
#pragma unroll
    for (int o = (kLanes < 32 ? kLanes : 32) / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if constexpr (kLanes <= 32) {
      if (sub == 0) y[c * kRows + r] = acc;
    } else if ((threadIdx.x & 31) == 0) {
      part[i & 1][threadIdx.x >> 5] = acc;  // a row over several warps: their sums meet after the barrier
    }
    __syncthreads();  // every warp is done with stage s
    if constexpr (kLanes > 32) {
      if (threadIdx.x < kRows) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < kLanes / 32; ++w) t += part[i & 1][threadIdx.x * (kLanes / 32) + w];
        y[c * kRows + threadIdx.x] = t;
      }
    }
    if (threadIdx.x == 0 && i + kStages < mine) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(i + kStages);
    }
  }
}

// ---------------------------------------------------------------- host
std::mt19937 rng(11);

struct HostQ4 {
  int rows, nb;
  std::vector<uint4> q;
  std::vector<__half> d;
};
HostQ4 random_q4(int rows, int cols) {
  HostQ4 m{rows, cols / 32, {}, {}};
  std::uniform_int_distribution<uint32_t> u32;
  std::uniform_real_distribution<float> ud(0.005f, 0.02f);
  m.q.resize(static_cast<size_t>(rows) * m.nb);
  m.d.resize(m.q.size());
  for (size_t i = 0; i < m.q.size(); ++i) {
    m.q[i] = make_uint4(u32(rng), u32(rng), u32(rng), u32(rng));
    m.d[i] = __float2half(ud(rng) * (u32(rng) & 1 ? 1.f : -1.f));
  }
  return m;
}
std::vector<double> reference(const HostQ4& m, const std::vector<float>& x) {
  std::vector<double> y(m.rows, 0.0);
  for (int r = 0; r < m.rows; ++r) {
    double acc = 0.0;
    for (int b = 0; b < m.nb; ++b) {
      const uint4 blk = m.q[static_cast<size_t>(r) * m.nb + b];
      const uint32_t w[4] = {blk.x, blk.y, blk.z, blk.w};
      double s = 0.0;
      for (int j = 0; j < 16; ++j) {
        const uint32_t byte = (w[j / 4] >> (8 * (j % 4))) & 0xff;
        s += x[b * 32 + j] * (static_cast<int>(byte & 0xf) - 8) + x[b * 32 + 16 + j] * (static_cast<int>(byte >> 4) - 8);
      }
      acc += s * __half2float(m.d[static_cast<size_t>(r) * m.nb + b]);
    }
    y[r] = acc;
  }
  return y;
}

template <typename K>
void run_case(const char* name, K kernel, int grid, size_t smem, const std::vector<Q4>& copies, const float* x, float* y,
              const std::vector<double>& ref, double bytes) {
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  CK(cudaMemset(y, 0xff, ref.size() * sizeof(float)));  // poisoned: rows never written show as NaN
  kernel<<<grid, kThreads, smem, st>>>(copies[0], x, y);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(st));
  std::vector<float> out(ref.size());
  CK(cudaMemcpy(out.data(), y, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double err = 0.0, mag = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    err = std::isfinite(out[i]) ? std::max(err, std::fabs(out[i] - ref[i])) : INFINITY;
    mag = std::max(mag, std::fabs(ref[i]));
  }
  // A graph of kLaunches back-to-back launches, each on the next copy (its weights are not in L2): the per-launch time
  // without the event and launch overheads that a single timed launch carries (~10 us here).
  constexpr int kLaunches = 20;
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int l = 0; l < kLaunches; ++l) kernel<<<grid, kThreads, smem, st>>>(copies[l % copies.size()], x, y);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> us;
  for (int it = 0; it < 24; ++it) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (it >= 4) us.push_back(ms * 1e3f / kLaunches);
  }
  std::sort(us.begin(), us.end());
  const double med = us[us.size() / 2];
  std::printf("  %-24s grid %5d  %7.2f us (min %.2f)  %5.2f TB/s   max |y - ref| %.1e (max |ref| %.1f)%s\n", name, grid,
              med, us.front(), bytes / med / 1e6, err, mag, err <= 1e-4 * std::max(1.0, mag) ? "" : "  <-- MISMATCH");
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(st));
}

template <int kRows, int kStages>
void run_ring(int n_sms, int per_sm, const std::vector<Q4>& copies, const float* x, float* y,
              const std::vector<double>& ref, double bytes) {
  const int nb = copies[0].nb;
  const size_t stage = (static_cast<size_t>(kRows) * nb * 18 + 127) / 128 * 128;
  const size_t smem = kStages * stage + static_cast<size_t>(nb) * kStride * 4;
  char name[64];
  std::snprintf(name, sizeof name, "ring %d rows x %d stages", kRows, kStages);
  if (smem > 227 * 1024) {
    std::printf("  %-24s does not fit (%zu bytes)\n", name, smem);
    return;
  }
  run_case(name, ring_kernel<kRows, kStages>, std::min(n_sms * per_sm, copies[0].rows / kRows), smem, copies, x, y,
           ref, bytes);
}

}  // namespace

int main() {
  int n_sms = 0;
  CK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  struct Shape {
    const char* name;
    int rows, cols;
  };
  for (const Shape sh : {Shape{"gate/up 16384 x 2048", 16384, 2048}, Shape{"down 2048 x 8192", 2048, 8192},
                         Shape{"QKV 6144 x 2048", 6144, 2048}}) {
    const HostQ4 h = random_q4(sh.rows, sh.cols);
    std::uniform_real_distribution<float> ux(-1.f, 1.f);
    std::vector<float> hx(sh.cols);
    for (float& v : hx) v = ux(rng);
    const std::vector<double> ref = reference(h, hx);
    std::vector<Q4> copies;
    const int n_copies = std::max(4, static_cast<int>(std::ceil(80e6 / (h.q.size() * 18.0))));
    for (int c = 0; c < n_copies; ++c) {
      uint4* q = nullptr;
      __half* d = nullptr;
      CK(cudaMalloc(&q, h.q.size() * sizeof(uint4)));
      CK(cudaMalloc(&d, h.d.size() * sizeof(__half)));
      CK(cudaMemcpy(q, h.q.data(), h.q.size() * sizeof(uint4), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d, h.d.data(), h.d.size() * sizeof(__half), cudaMemcpyHostToDevice));
      copies.push_back(Q4{q, d, h.rows, h.nb});
    }
    float *x = nullptr, *y = nullptr;
    CK(cudaMalloc(&x, hx.size() * 4));
    CK(cudaMalloc(&y, sh.rows * 4));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    const double bytes = h.q.size() * 18.0;
    std::printf("%s: %.1f MB of Q4_0, %d copies rotated\n", sh.name, bytes / 1e6, n_copies);
    run_case("regs (8 lanes a row)", regs_kernel, (sh.rows + 31) / 32, static_cast<size_t>(h.nb) * kStride * 4, copies,
             x, y, ref, bytes);
    if (sh.cols <= 2048) {
      run_ring<16, 4>(n_sms, 1, copies, x, y, ref, bytes);
      run_ring<16, 8>(n_sms, 1, copies, x, y, ref, bytes);
      run_ring<8, 8>(n_sms, 1, copies, x, y, ref, bytes);
      run_ring<8, 4>(n_sms, 2, copies, x, y, ref, bytes);
      run_ring<32, 4>(n_sms, 1, copies, x, y, ref, bytes);
    } else {
      run_ring<4, 4>(n_sms, 1, copies, x, y, ref, bytes);
      run_ring<4, 8>(n_sms, 1, copies, x, y, ref, bytes);
      run_ring<2, 8>(n_sms, 1, copies, x, y, ref, bytes);
      run_ring<2, 4>(n_sms, 2, copies, x, y, ref, bytes);
    }
  }
  return 0;
}
