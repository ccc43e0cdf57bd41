// The decode issue's two-layer prototype, grown to a whole layer stack: is a persistent decode kernel faster per
// layer than today's chain of kernels, and does streaming the next layer's weights into shared memory while the
// current layer computes pay?
//
// Shape: Qwen2.5-0.5B's layer (d 896, ffn 4864, 14 query heads / 2 KV heads of 64), every matrix Q4_0 in the GPU
// layout the engine uses (16 bytes of nibbles per 32 weights, the fp16 scales in their own array), a KV cache of
// `ctx` earlier positions. One launch runs all `layers` layers for one token: per layer five instructions
//   0 rmsnorm + QKV rows          (every block its share of the 1152 rows)
//   1 attention, one block per query head, over the cache and the new K/V
//   2 O rows + residual           (every block its share of the 896 rows)
//   3 rmsnorm + gate/up + SiLU    (every block its share of the 4864 units, both halves)
//   4 down rows + residual        (every block its share of the 896 rows, 4864 wide)
// Instruction i + 1 starts once every block (attention: every head) has counted instruction i done on a counter in
// global memory (release add / acquire spin); no grid barrier, no kernel boundary. With --prefetch 1 each block
// copies its rows of all five matrices of layer l + 1 into shared memory (cp.async) while it runs layer l, so the
// weight reads leave the dependent chain; with --prefetch 0 the dot products read the weights from global memory
// after each wait. One block per SM.
//
// Checked against a float64 CPU forward of the same weights (2 layers) before timing. Timed as graph replays
// (counter reset + kernel) with CUDA events after warm-up: median per token and per layer.
// Build and run (H100): nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/bench_megakernel_proto.cu -o /tmp/bmk && /tmp/bmk
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int D = 896, FF = 4864, NH = 14, NKV = 2, HD = 64, QKV_ROWS = D + 2 * NKV * HD;
constexpr int THREADS = 512, WARPS = THREADS / 32, MAX_CTX = 1024;
constexpr float EPS = 1e-6f;

// A Q4_0 matrix in the engine's GPU layout: nib[row * nb + b] holds block b's 32 weights (element j < 16 in the low
// nibble of byte j, element j + 16 in its high nibble, each minus 8), sc[row * nb + b] its fp16 scale.
struct Mat {
  const uint4* nib;
  const __half* sc;
  int rows, nb;
};
struct LayerW {
  Mat qkv, o, gu, down;  // gu: gate rows 0..FF-1, up rows FF..2FF-1
  const float* norm1;
  const float* norm2;
};
struct Args {
  const LayerW* layers;
  int n_layers, ctx;
  const float* k_cache;  // [layer][NKV][ctx][HD]
  const float* v_cache;
  float* x;     // residual stream [D]
  float* qkv;   // [QKV_ROWS]
  float* attn;  // [D]
  float* h;     // [FF]
  unsigned* counters;  // [layer][5], zero at launch
  int prefetch;
};

// This block's share [r0, r1) of n items.
__device__ __forceinline__ void share(int n, int& r0, int& r1) {
  r0 = static_cast<int>(static_cast<int64_t>(n) * blockIdx.x / gridDim.x);
  r1 = static_cast<int>(static_cast<int64_t>(n) * (blockIdx.x + 1) / gridDim.x);
}
__host__ __device__ constexpr int max_share(int n, int blocks) { return (n + blocks - 1) / blocks; }

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void wait_count(const unsigned* c, unsigned target) {
  if (threadIdx.x == 0)
    while (ld_acquire(c) < target) {
    }
  __syncthreads();
}
__device__ __forceinline__ void signal_done(unsigned* c) {
  __syncthreads();  // every thread's writes of this instruction precede the release
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(s), "l"(gmem) : "memory");
}

// Where this block's rows of one matrix live: global, or the shared-memory copy (rows from r0 on).
struct Rows {
  const uint4* nib;
  const __half* sc;
  int r0, nb;
  __device__ __forceinline__ uint4 q(int row, int b) const { return nib[(row - r0) * nb + b]; }
  __device__ __forceinline__ float s(int row, int b) const { return __half2float(sc[(row - r0) * nb + b]); }
};
__device__ __forceinline__ Rows global_rows(const Mat& m) { return Rows{m.nib, m.sc, 0, m.nb}; }

// The shared-memory slots of one layer: per part (QKV, O, gate, up, down) this block's rows, nibbles then scales.
struct Slot {
  uint4* nib[5];
  __half* sc[5];
};
constexpr int kParts = 5;
__host__ __device__ inline int part_rows(int part) {
  return part == 0 ? QKV_ROWS : part == 1 ? D : part == 4 ? D : FF;
}
__host__ __device__ inline int part_nb(int part) { return part == 4 ? FF / 32 : D / 32; }
__host__ __device__ inline size_t slot_bytes(int blocks) {
  size_t b = 0;
  for (int p = 0; p < kParts; ++p) {
    const size_t blks = static_cast<size_t>(max_share(part_rows(p), blocks)) * part_nb(p);
    b += blks * 16 + ((blks * 2 + 15) / 16) * 16;
  }
  return b;
}
__device__ Slot make_slot(char* base) {
  Slot s;
  for (int p = 0; p < kParts; ++p) {
    const size_t blks = static_cast<size_t>(max_share(part_rows(p), gridDim.x)) * part_nb(p);
    s.nib[p] = reinterpret_cast<uint4*>(base);
    base += blks * 16;
    s.sc[p] = reinterpret_cast<__half*>(base);
    base += ((blks * 2 + 15) / 16) * 16;
  }
  return s;
}
// Part p's matrix and the first row of this block's share of it.
__device__ void part_of(const LayerW& L, int p, Mat& m, int& r0, int& r1) {
  if (p == 0) { m = L.qkv; share(QKV_ROWS, r0, r1); }
  if (p == 1) { m = L.o; share(D, r0, r1); }
  if (p == 2 || p == 3) { m = L.gu; share(FF, r0, r1); if (p == 3) { r0 += FF; r1 += FF; } }
  if (p == 4) { m = L.down; share(D, r0, r1); }
}
// Issues the copies of layer L's rows of this block into slot s (one cp.async group, committed by the caller).
__device__ void load_layer(const LayerW& L, const Slot& s) {
  for (int p = 0; p < kParts; ++p) {
    Mat m;
    int r0, r1;
    part_of(L, p, m, r0, r1);
    const int n = (r1 - r0) * m.nb;
    const uint4* gn = m.nib + static_cast<int64_t>(r0) * m.nb;
    for (int i = threadIdx.x; i < n; i += THREADS) cp_async16(s.nib[p] + i, gn + i);
    const char* gs = reinterpret_cast<const char*>(m.sc + static_cast<int64_t>(r0) * m.nb);  // 8-byte aligned
    for (int i = threadIdx.x; i < n * 2 / 8; i += THREADS) cp_async8(reinterpret_cast<char*>(s.sc[p]) + 8 * i, gs + 8 * i);
  }
}
__device__ Rows slot_rows(const LayerW& L, const Slot& s, int p) {
  Mat m;
  int r0, r1;
  part_of(L, p, m, r0, r1);
  return Rows{s.nib[p], s.sc[p], r0, m.nb};
}

// One row's dot product with x_s (the whole warp; lanes split the 32-weight blocks). Returns the sum in every lane.
__device__ __forceinline__ float row_dot(const Rows& w, int row, const float* x_s) {
  const int lane = threadIdx.x % 32;
  float acc = 0.f;
  for (int b = lane; b < w.nb; b += 32) {
    const uint4 q = w.q(row, b);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    const float* xb = x_s + b * 32;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int byte = (words[k] >> (8 * j)) & 0xff;
        s += xb[4 * k + j] * static_cast<float>((byte & 0xf) - 8) + xb[16 + 4 * k + j] * static_cast<float>((byte >> 4) - 8);
      }
    }
    acc += s * w.s(row, b);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

__device__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < WARPS; ++i) t += red[i];
  __syncthreads();
  return t;
}

// x_s = src * norm_w / rms(src) (norm_w null: a plain copy); src is read through L2 (written by other blocks).
__device__ void stage(const float* src, int n, const float* norm_w, float* x_s, float* red) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += THREADS) {
    const float v = __ldcg(src + i);
    x_s[i] = v;
    ss += v * v;
  }
  if (norm_w == nullptr) {
    __syncthreads();
    return;
  }
  const float inv = rsqrtf(block_sum(ss, red) / n + EPS);
  for (int i = threadIdx.x; i < n; i += THREADS) x_s[i] = x_s[i] * inv * norm_w[i];
  __syncthreads();
}

__global__ void __launch_bounds__(THREADS, 1) decode_layers(Args a) {
  extern __shared__ float4 smem4[];
  float* x_s = reinterpret_cast<float*>(smem4);  // FF floats
  char* slot_base = reinterpret_cast<char*>(x_s + FF);
  __shared__ float red[WARPS];
  __shared__ float scores[MAX_CTX + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t sb = slot_bytes(gridDim.x);
  const Slot slots[2] = {make_slot(slot_base), make_slot(slot_base + sb)};
  if (a.prefetch) {
    load_layer(a.layers[0], slots[0]);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  for (int l = 0; l < a.n_layers; ++l) {
    const LayerW& L = a.layers[l];
    unsigned* cnt = a.counters + l * 5;
    const unsigned G = gridDim.x;
    if (a.prefetch) {
      if (l + 1 < a.n_layers) load_layer(a.layers[l + 1], slots[(l + 1) & 1]);
      asm volatile("cp.async.commit_group;" ::: "memory");
      asm volatile("cp.async.wait_group 1;" ::: "memory");  // layer l's copies are in
      __syncthreads();
    }
    const Slot& s = slots[l & 1];
    auto rows = [&](int p, const Mat& m) { return a.prefetch ? slot_rows(L, s, p) : global_rows(m); };

    // 0: rmsnorm + QKV
    if (l > 0) wait_count(cnt - 1, G);  // the previous layer's down rows
    stage(a.x, D, L.norm1, x_s, red);
    {
      int r0, r1;
      share(QKV_ROWS, r0, r1);
      const Rows w = rows(0, L.qkv);
      for (int r = r0 + warp; r < r1; r += WARPS) {
        const float v = row_dot(w, r, x_s);
        if (lane == 0) a.qkv[r] = v;
      }
    }
    signal_done(cnt + 0);

    // 1: attention, block h for query head h (the new K/V are this step's, the cache holds ctx earlier positions)
    wait_count(cnt + 0, G);
    if (blockIdx.x < NH) {
      const int h = blockIdx.x, g = h / (NH / NKV);
      const float* q = a.qkv + h * HD;
      const float* kn = a.qkv + D + g * HD;
      const float* vn = a.qkv + D + NKV * HD + g * HD;
      const float* kc = a.k_cache + (static_cast<size_t>(l) * NKV + g) * a.ctx * HD;
      const float* vc = a.v_cache + (static_cast<size_t>(l) * NKV + g) * a.ctx * HD;
      const float q0 = __ldcg(q + lane), q1 = __ldcg(q + lane + 32);
      for (int p = warp; p <= a.ctx; p += WARPS) {
        const float* k = p < a.ctx ? kc + p * HD : kn;
        float d = q0 * __ldcg(k + lane) + q1 * __ldcg(k + lane + 32);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (lane == 0) scores[p] = d * 0.125f;  // 1/sqrt(64)
      }
      __syncthreads();
      if (warp == 0) {
        float m = -INFINITY;
        for (int p = lane; p <= a.ctx; p += 32) m = fmaxf(m, scores[p]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float t = 0.f;
        for (int p = lane; p <= a.ctx; p += 32) {
          const float e = expf(scores[p] - m);
          scores[p] = e;
          t += e;
        }
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (lane == 0) red[0] = 1.f / t;
      }
      __syncthreads();
      if (threadIdx.x < HD) {
        const int dd = threadIdx.x;
        float o = 0.f;
        for (int p = 0; p <= a.ctx; ++p) o += scores[p] * (p < a.ctx ? vc[p * HD + dd] : __ldcg(vn + dd));
        a.attn[h * HD + dd] = o * red[0];
      }
    }
    signal_done(cnt + 1);

    // 2: O rows + residual
    wait_count(cnt + 1, G);
    stage(a.attn, D, nullptr, x_s, red);
    {
      int r0, r1;
      share(D, r0, r1);
      const Rows w = rows(1, L.o);
      for (int r = r0 + warp; r < r1; r += WARPS) {
        const float v = row_dot(w, r, x_s);
        if (lane == 0) a.x[r] = __ldcg(a.x + r) + v;
      }
    }
    signal_done(cnt + 2);

    // 3: rmsnorm + gate/up + SiLU
    wait_count(cnt + 2, G);
    stage(a.x, D, L.norm2, x_s, red);
    {
      int u0, u1;
      share(FF, u0, u1);
      const Rows wg = rows(2, L.gu), wu = rows(3, L.gu);
      for (int u = u0 + warp; u < u1; u += WARPS) {
        const float gt = row_dot(wg, u, x_s), up = row_dot(wu, FF + u, x_s);
        if (lane == 0) a.h[u] = gt / (1.f + expf(-gt)) * up;
      }
    }
    signal_done(cnt + 3);

    // 4: down rows + residual
    wait_count(cnt + 3, G);
    stage(a.h, FF, nullptr, x_s, red);
    {
      int r0, r1;
      share(D, r0, r1);
      const Rows w = rows(4, L.down);
      for (int r = r0 + warp; r < r1; r += WARPS) {
        const float v = row_dot(w, r, x_s);
        if (lane == 0) a.x[r] = __ldcg(a.x + r) + v;
      }
    }
    signal_done(cnt + 4);
  }
  if (a.prefetch) asm volatile("cp.async.wait_all;" ::: "memory");
}

// ------------------------------------------------------------------------------------------------ host side

struct HostMat {
  std::vector<uint4> nib;
  std::vector<__half> sc;
  int rows, nb;
  float w(int r, int c) const {  // dequantized weight
    const int b = c / 32, j = c % 32;
    const uint8_t* q = reinterpret_cast<const uint8_t*>(&nib[static_cast<size_t>(r) * nb + b]);
    const int v = j < 16 ? (q[j] & 0xf) : (q[j - 16] >> 4);
    return (v - 8) * __half2float(sc[static_cast<size_t>(r) * nb + b]);
  }
};
HostMat random_mat(int rows, int cols, float scale, std::mt19937& g) {
  HostMat m{{}, {}, rows, cols / 32};
  m.nib.resize(static_cast<size_t>(rows) * m.nb);
  m.sc.resize(m.nib.size());
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> nd(0.f, scale);
  for (auto& q : m.nib) q = make_uint4(bits(g), bits(g), bits(g), bits(g));
  for (auto& s : m.sc) s = __float2half(nd(g));
  return m;
}
template <typename T>
T* upload(const std::vector<T>& v) {
  T* p = nullptr;
  CK(cudaMalloc(&p, v.size() * sizeof(T)));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

struct HostLayer {
  HostMat qkv, o, gu, down;
  std::vector<float> n1, n2;
};

// float64 forward of the same layers (the reference).
std::vector<double> reference(const std::vector<HostLayer>& Ls, std::vector<double> x, const std::vector<float>& kc,
                              const std::vector<float>& vc, int n_layers, int ctx) {
  auto matvec = [](const HostMat& m, const std::vector<double>& v, int r0, int rows) {
    std::vector<double> y(rows);
    for (int r = 0; r < rows; ++r) {
      double s = 0;
      for (int c = 0; c < m.nb * 32; ++c) s += m.w(r0 + r, c) * v[c];
      y[r] = s;
    }
    return y;
  };
  auto norm = [](const std::vector<double>& v, const std::vector<float>& w) {
    double ss = 0;
    for (double e : v) ss += e * e;
    const double inv = 1.0 / std::sqrt(ss / v.size() + EPS);
    std::vector<double> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = v[i] * inv * w[i];
    return o;
  };
  for (int l = 0; l < n_layers; ++l) {
    const HostLayer& L = Ls[l];
    const std::vector<double> qkv = matvec(L.qkv, norm(x, L.n1), 0, QKV_ROWS);
    std::vector<double> attn(D);
    for (int h = 0; h < NH; ++h) {
      const int g = h / (NH / NKV);
      std::vector<double> sc(ctx + 1);
      double m = -1e300;
      for (int p = 0; p <= ctx; ++p) {
        double d = 0;
        for (int i = 0; i < HD; ++i) {
          const double k = p < ctx ? kc[((static_cast<size_t>(l) * NKV + g) * ctx + p) * HD + i] : qkv[D + g * HD + i];
          d += qkv[h * HD + i] * k;
        }
        sc[p] = d / 8.0;
        m = std::max(m, sc[p]);
      }
      double t = 0;
      for (double& e : sc) t += (e = std::exp(e - m));
      for (int i = 0; i < HD; ++i) {
        double o = 0;
        for (int p = 0; p <= ctx; ++p) {
          const double v = p < ctx ? vc[((static_cast<size_t>(l) * NKV + g) * ctx + p) * HD + i]
                                   : qkv[D + NKV * HD + g * HD + i];
          o += sc[p] * v;
        }
        attn[h * HD + i] = o / t;
      }
    }
    const std::vector<double> o = matvec(L.o, attn, 0, D);
    for (int i = 0; i < D; ++i) x[i] += o[i];
    const std::vector<double> xn = norm(x, L.n2);
    const std::vector<double> gt = matvec(L.gu, xn, 0, FF), up = matvec(L.gu, xn, FF, FF);
    std::vector<double> hh(FF);
    for (int i = 0; i < FF; ++i) hh[i] = gt[i] / (1 + std::exp(-gt[i])) * up[i];
    const std::vector<double> dn = matvec(L.down, hh, 0, D);
    for (int i = 0; i < D; ++i) x[i] += dn[i];
  }
  return x;
}

int main(int argc, char** argv) {
  int n_layers = 24, ctx = 32, iters = 200;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--layers")) n_layers = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--ctx")) ctx = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
  }
  if (ctx < 1 || ctx > MAX_CTX || n_layers < 2) {
    std::fprintf(stderr, "--ctx 1..%d, --layers >= 2\n", MAX_CTX);
    return 2;
  }
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int blocks = sms;
  std::mt19937 g(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.8f, 1.2f);
  std::vector<HostLayer> hl(n_layers);
  std::vector<LayerW> lw(n_layers);
  auto dev_mat = [](const HostMat& m) { return Mat{upload(m.nib), upload(m.sc), m.rows, m.nb}; };
  for (int l = 0; l < n_layers; ++l) {
    HostLayer& L = hl[l];
    L.qkv = random_mat(QKV_ROWS, D, 0.3f / std::sqrt(static_cast<float>(D)), g);
    L.o = random_mat(D, D, 0.1f / std::sqrt(static_cast<float>(D)), g);
    L.gu = random_mat(2 * FF, D, 0.3f / std::sqrt(static_cast<float>(D)), g);
    L.down = random_mat(D, FF, 0.1f / std::sqrt(static_cast<float>(FF)), g);
    L.n1.resize(D);
    L.n2.resize(D);
    for (auto& v : L.n1) v = ud(g);
    for (auto& v : L.n2) v = ud(g);
    lw[l] = LayerW{dev_mat(L.qkv), dev_mat(L.o), dev_mat(L.gu), dev_mat(L.down), upload(L.n1), upload(L.n2)};
  }
  std::vector<float> kc(static_cast<size_t>(n_layers) * NKV * ctx * HD), vc(kc.size()), x0(D);
  for (auto& v : kc) v = nd(g);
  for (auto& v : vc) v = nd(g);
  for (auto& v : x0) v = nd(g);

  Args a{};
  a.layers = upload(lw);
  a.n_layers = n_layers;
  a.ctx = ctx;
  a.k_cache = upload(kc);
  a.v_cache = upload(vc);
  a.x = upload(x0);
  CK(cudaMalloc(&a.qkv, QKV_ROWS * sizeof(float)));
  CK(cudaMalloc(&a.attn, D * sizeof(float)));
  CK(cudaMalloc(&a.h, FF * sizeof(float)));
  CK(cudaMalloc(&a.counters, n_layers * 5 * sizeof(unsigned)));
  const size_t smem = FF * sizeof(float) + 2 * slot_bytes(blocks);
  CK(cudaFuncSetAttribute(decode_layers, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_layers, THREADS, smem));
  std::printf("Qwen2.5-0.5B layer shape, Q4_0, ctx %d: %d blocks of %d threads, %zu B shared memory each "
              "(%d per SM fit), weights %.1f MB per layer\n",
              ctx, blocks, THREADS, smem, per_sm,
              ((QKV_ROWS + D + 2 * FF) * (D / 32) + D * (FF / 32)) * 18.0 / 1e6);
  if (per_sm < 1) {
    std::fprintf(stderr, "the kernel does not fit on an SM\n");
    return 1;
  }
  cudaStream_t st;
  CK(cudaStreamCreate(&st));

  // Correctness: 2 layers from x0, each mode, against the float64 forward.
  for (int pf = 0; pf < 2; ++pf) {
    Args c = a;
    c.n_layers = 2;
    c.prefetch = pf;
    CK(cudaMemcpy(a.x, x0.data(), D * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemset(a.counters, 0, n_layers * 5 * sizeof(unsigned)));
    decode_layers<<<blocks, THREADS, smem, st>>>(c);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(st));
    std::vector<float> got(D);
    CK(cudaMemcpy(got.data(), a.x, D * sizeof(float), cudaMemcpyDeviceToHost));
    const std::vector<double> want = reference(hl, std::vector<double>(x0.begin(), x0.end()), kc, vc, 2, ctx);
    double num = 0, den = 0;
    for (int i = 0; i < D; ++i) {
      num += (got[i] - want[i]) * (got[i] - want[i]);
      den += want[i] * want[i];
    }
    const double rel = std::sqrt(num / den);
    std::printf("check, 2 layers, prefetch %d: rel L2 vs float64 %.2e %s\n", pf, rel, rel < 1e-4 ? "ok" : "FAILED");
    if (!(rel < 1e-4)) return 1;
  }

  // Timing: graph of (counter reset, kernel); x drifts over replays, which does not change the work.
  for (int pf = 0; pf < 2; ++pf) {
    Args t = a;
    t.prefetch = pf;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    CK(cudaMemsetAsync(a.counters, 0, n_layers * 5 * sizeof(unsigned), st));
    decode_layers<<<blocks, THREADS, smem, st>>>(t);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int i = 0; i < iters + 20; ++i) {
      CK(cudaEventRecord(e0, st));
      CK(cudaGraphLaunch(exec, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float m = 0;
      CK(cudaEventElapsedTime(&m, e0, e1));
      if (i >= 20) ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2] * 1e3;
    std::printf("prefetch %d: %d layers %.1f us per token (min %.1f, max %.1f) = %.2f us per layer\n", pf, n_layers, med,
                ms.front() * 1e3, ms.back() * 1e3, med / n_layers);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }
  return 0;
}
