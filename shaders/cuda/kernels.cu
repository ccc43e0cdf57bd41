// Decode kernels: one token per step, float activations, float accumulation, weights decoded on the fly.
//
// Matvec geometry: a row group of TPR lanes (8, 16 or 32 consecutive lanes of a warp) owns one output row; lane
// `sub` of the group takes weight blocks sub, sub + TPR, ... of that row, reads each block's payload with 16-byte
// loads (consecutive lanes read consecutive blocks, so a group reads one contiguous span), and the group sums by
// xor-shuffles. A block of 128 (or 256) threads therefore covers 128/TPR rows. Each block stages the activation
// vector in shared memory once (recomputing RMSNorm from the residual, which is cheaper than a separate launch),
// after issuing the loads of its first weight blocks so their latency overlaps the staging.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "cpu/reference.h"
#include "cuda/cuda_check.h"
#include "kernels.cuh"

namespace metalattn::cuda {

// ------------------------------------------------------------------ host packing

GgmlType common_exact_type(const std::vector<const WeightView*>& parts) {
  const GgmlType first = parts.at(0)->type;
  bool same = true, q4_0_or_q8_0 = true;
  for (const WeightView* p : parts) {
    same = same && p->type == first;
    q4_0_or_q8_0 = q4_0_or_q8_0 && (p->type == GgmlType::Q4_0 || p->type == GgmlType::Q8_0);
  }
  if (same) return first;
  return q4_0_or_q8_0 ? GgmlType::Q8_0 : GgmlType::F32;  // Q4_0 values d*(q-8) are Q8_0 values exactly
}

PackedMatrix pack_matrix(const std::vector<const WeightView*>& parts, GgmlType target) {
  PackedMatrix m;
  m.type = target;
  m.cols = static_cast<int>(parts.at(0)->cols);
  m.nb = (m.cols + 31) / 32;
  for (const WeightView* p : parts) {
    if (p->cols != m.cols) throw EngineError("pack_matrix: stacked parts differ in columns");
    if (is_quantized(p->type) && p->cols % kQuantBlock != 0) throw EngineError("pack_matrix: ragged quant row");
    m.rows += static_cast<int>(p->rows);
  }
  const int pb = payload_bytes(target), sc = scale_count(target);
  if (pb == 0) throw EngineError("pack_matrix: unsupported type");
  m.payload.assign(static_cast<size_t>(m.rows) * m.nb * pb, 0);
  m.scales.assign(static_cast<size_t>(m.rows) * m.nb * sc, 0);
  std::vector<float> row_f(static_cast<size_t>(m.nb) * 32, 0.f);
  int64_t out_row = 0;
  for (const WeightView* p : parts) {
    for (int64_t r = 0; r < p->rows; ++r, ++out_row) {
      uint8_t* dst = m.payload.data() + static_cast<size_t>(out_row) * m.nb * pb;
      uint16_t* dsc = m.scales.data() + static_cast<size_t>(out_row) * m.nb * sc;
      const uint8_t* src = p->row(r);
      if (p->type == target) {
        switch (target) {
          case GgmlType::Q4_0: {
            const auto* b = reinterpret_cast<const block_q4_0*>(src);
            for (int k = 0; k < m.nb; ++k) { std::memcpy(dst + k * 16, b[k].qs, 16); dsc[k] = b[k].d; }
            break;
          }
          case GgmlType::Q4_1: {
            const auto* b = reinterpret_cast<const block_q4_1*>(src);
            for (int k = 0; k < m.nb; ++k) {
              std::memcpy(dst + k * 16, b[k].qs, 16);
              dsc[2 * k] = b[k].d;
              dsc[2 * k + 1] = b[k].m;
            }
            break;
          }
          case GgmlType::Q8_0: {
            const auto* b = reinterpret_cast<const block_q8_0*>(src);
            for (int k = 0; k < m.nb; ++k) { std::memcpy(dst + k * 32, b[k].qs, 32); dsc[k] = b[k].d; }
            break;
          }
          case GgmlType::F16:
          case GgmlType::BF16: std::memcpy(dst, src, static_cast<size_t>(m.cols) * 2); break;
          case GgmlType::F32: std::memcpy(dst, src, static_cast<size_t>(m.cols) * 4); break;
        }
      } else if (target == GgmlType::Q8_0 && p->type == GgmlType::Q4_0) {
        const auto* b = reinterpret_cast<const block_q4_0*>(src);
        for (int k = 0; k < m.nb; ++k) {
          dsc[k] = b[k].d;
          for (int j = 0; j < 16; ++j) {
            dst[k * 32 + j] = static_cast<uint8_t>(static_cast<int8_t>((b[k].qs[j] & 15) - 8));
            dst[k * 32 + j + 16] = static_cast<uint8_t>(static_cast<int8_t>((b[k].qs[j] >> 4) - 8));
          }
        }
      } else if (target == GgmlType::F32) {
        ref::dequantize_row(p->type, src, row_f.data(), m.cols);
        std::memcpy(dst, row_f.data(), static_cast<size_t>(m.cols) * 4);
      } else {
        throw EngineError("pack_matrix: no exact conversion to the target type");
      }
    }
  }
  return m;
}

// ------------------------------------------------------------------ launch plumbing

static bool g_programmatic = false;
void set_programmatic_launch(bool on) { g_programmatic = on; }
bool programmatic_launch() { return g_programmatic; }

template <typename... KernelArgs, typename... Args>
static void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = g_programmatic ? attr : nullptr;
  cfg.numAttrs = g_programmatic ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// ------------------------------------------------------------------ weight blocks

using detail::grid_dependency_wait;

__device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

template <GgmlType T>
struct Blk;

template <>
struct Blk<GgmlType::Q4_0> {
  static constexpr int kUnroll = 4;
  uint4 q;
  uint16_t d;
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    q = __ldg(reinterpret_cast<const uint4*>(W.payload) + blk);
    d = __ldg(W.scales + blk);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 lo = ld4(xb + 4 * i), hi = ld4(xb + 16 + 4 * i);
      const uint32_t v = w[i];
      s += lo.x * static_cast<float>(static_cast<int>(v & 15) - 8);
      s += lo.y * static_cast<float>(static_cast<int>((v >> 8) & 15) - 8);
      s += lo.z * static_cast<float>(static_cast<int>((v >> 16) & 15) - 8);
      s += lo.w * static_cast<float>(static_cast<int>((v >> 24) & 15) - 8);
      s += hi.x * static_cast<float>(static_cast<int>((v >> 4) & 15) - 8);
      s += hi.y * static_cast<float>(static_cast<int>((v >> 12) & 15) - 8);
      s += hi.z * static_cast<float>(static_cast<int>((v >> 20) & 15) - 8);
      s += hi.w * static_cast<float>(static_cast<int>((v >> 28) & 15) - 8);
    }
    return h2f(d) * s;
  }
};

template <>
struct Blk<GgmlType::Q4_1> {
  static constexpr int kUnroll = 4;
  uint4 q;
  uint32_t dm;  // fp16 d (low half) and m (high half)
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    q = __ldg(reinterpret_cast<const uint4*>(W.payload) + blk);
    dm = __ldg(reinterpret_cast<const unsigned int*>(W.scales) + blk);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float s = 0.f, sx = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 lo = ld4(xb + 4 * i), hi = ld4(xb + 16 + 4 * i);
      const uint32_t v = w[i];
      s += lo.x * static_cast<float>(v & 15) + lo.y * static_cast<float>((v >> 8) & 15) +
           lo.z * static_cast<float>((v >> 16) & 15) + lo.w * static_cast<float>((v >> 24) & 15);
      s += hi.x * static_cast<float>((v >> 4) & 15) + hi.y * static_cast<float>((v >> 12) & 15) +
           hi.z * static_cast<float>((v >> 20) & 15) + hi.w * static_cast<float>((v >> 28) & 15);
      sx += (lo.x + lo.y) + (lo.z + lo.w) + (hi.x + hi.y) + (hi.z + hi.w);
    }
    return h2f(static_cast<uint16_t>(dm & 0xffffu)) * s + h2f(static_cast<uint16_t>(dm >> 16)) * sx;
  }
};

template <>
struct Blk<GgmlType::Q8_0> {
  static constexpr int kUnroll = 3;
  uint4 q[2];
  uint16_t d;
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    const uint4* p = reinterpret_cast<const uint4*>(W.payload) + 2 * blk;
    q[0] = __ldg(p);
    q[1] = __ldg(p + 1);
    d = __ldg(W.scales + blk);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    const uint32_t w[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 x = ld4(xb + 4 * i);
      const uint32_t v = w[i];
      s += x.x * static_cast<float>(static_cast<int8_t>(v & 0xff)) +
           x.y * static_cast<float>(static_cast<int8_t>((v >> 8) & 0xff)) +
           x.z * static_cast<float>(static_cast<int8_t>((v >> 16) & 0xff)) +
           x.w * static_cast<float>(static_cast<int8_t>(v >> 24));
    }
    return h2f(d) * s;
  }
};

template <>
struct Blk<GgmlType::F16> {
  static constexpr int kUnroll = 2;
  uint4 q[4];
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    const uint4* p = reinterpret_cast<const uint4*>(W.payload) + 4 * blk;
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = __ldg(p + i);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
      const float4 a = ld4(xb + 8 * i), b = ld4(xb + 8 * i + 4);
      const float2 w0 = __half22float2(*reinterpret_cast<const __half2*>(&w[0]));
      const float2 w1 = __half22float2(*reinterpret_cast<const __half2*>(&w[1]));
      const float2 w2 = __half22float2(*reinterpret_cast<const __half2*>(&w[2]));
      const float2 w3 = __half22float2(*reinterpret_cast<const __half2*>(&w[3]));
      s += a.x * w0.x + a.y * w0.y + a.z * w1.x + a.w * w1.y + b.x * w2.x + b.y * w2.y + b.z * w3.x + b.w * w3.y;
    }
    return s;
  }
};

template <>
struct Blk<GgmlType::BF16> {
  static constexpr int kUnroll = 2;
  uint4 q[4];
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    const uint4* p = reinterpret_cast<const uint4*>(W.payload) + 4 * blk;
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = __ldg(p + i);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        s += xb[8 * i + 2 * k] * __uint_as_float(w[k] << 16);
        s += xb[8 * i + 2 * k + 1] * __uint_as_float(w[k] & 0xffff0000u);
      }
    }
    return s;
  }
};

template <>
struct Blk<GgmlType::F32> {
  static constexpr int kUnroll = 1;
  float4 q[8];
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    const float4* p = reinterpret_cast<const float4*>(W.payload) + 8 * blk;
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = __ldg(p + i);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 x = ld4(xb + 4 * i);
      s += x.x * q[i].x + x.y * q[i].y + x.z * q[i].z + x.w * q[i].w;
    }
    return s;
  }
};

// One row group's dot product: the first kUnroll blocks per lane are loaded by prefetch() (before the activations
// exist), the rest streamed in finish().
template <GgmlType T, int TPR>
struct RowDot {
  using B = Blk<T>;
  static constexpr int U = B::kUnroll;
  B first[U];

  __device__ __forceinline__ void prefetch(const DevMatrix& W, int row, int sub) {
    if (row >= W.rows) return;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = sub + u * TPR;
      if (b < W.nb) first[u].load(W, static_cast<int64_t>(row) * W.nb + b);
    }
  }

  // x_s: the activations in the padded shared layout. Returns the row's dot product in every lane of the group.
  __device__ __forceinline__ float finish(const DevMatrix& W, int row, int sub, const float* x_s) {
    float acc = 0.f;
    if (row < W.rows) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int b = sub + u * TPR;
        if (b < W.nb) acc += first[u].dot(x_s + b * kSmemBlockStride);
      }
      for (int b0 = sub + U * TPR; b0 < W.nb; b0 += U * TPR) {
        B blk[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (b0 + u * TPR < W.nb) blk[u].load(W, static_cast<int64_t>(row) * W.nb + b0 + u * TPR);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (b0 + u * TPR < W.nb) acc += blk[u].dot(x_s + (b0 + u * TPR) * kSmemBlockStride);
      }
    }
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
  }
};

constexpr int kStageBatch = 8;  // activation loads each thread issues before using any

__device__ __forceinline__ int smem_index(int i) { return (i >> 5) * kSmemBlockStride + (i & 31); }

// ------------------------------------------------------------------ fused RMSNorm + matvec

enum class NormOut : int { Plain = 0, Qkv = 1, Argmax = 2 };

struct NormMatvecArgs {
  NormOut mode = NormOut::Plain;
  float* y = nullptr;  // Plain and Argmax: the output rows
  QkvTargets qkv;
  ArgmaxScratch am;
  ArgmaxResult* result = nullptr;
  DecodeIO* io_next = nullptr;
};

template <GgmlType T, int TPR>
__global__ void __launch_bounds__(256) norm_matvec_kernel(DevMatrix W, const float* __restrict__ x,
                                                          const float* __restrict__ norm_w, float eps,
                                                          NormMatvecArgs a) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  __shared__ float red[32];
  __shared__ float y_s[256 / 8];
  const int rows_per_block = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int row = blockIdx.x * rows_per_block + local;

  detail::launch_dependents();
  RowDot<T, TPR> rd;
  rd.prefetch(W, row, sub);
  grid_dependency_wait();

  const int n = W.nb * 32;
  float ss = 0.f;
  // Loads first, in batches of kStageBatch per thread: the staging costs one L2 round trip, not one per element.
  for (int i0 = threadIdx.x; i0 < n; i0 += kStageBatch * blockDim.x) {
    float v[kStageBatch];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * blockDim.x;
      v[u] = i < W.cols ? x[i] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < n) {
        x_s[smem_index(i)] = v[u];
        ss += v[u] * v[u];
      }
    }
  }
  if (norm_w != nullptr) {
    const float total = detail::block_sum(ss, red);
    const float scale = 1.f / sqrtf(total / static_cast<float>(W.cols) + eps);
    for (int i = threadIdx.x; i < W.cols; i += blockDim.x) x_s[smem_index(i)] = x_s[smem_index(i)] * scale * norm_w[i];
  }
  __syncthreads();

  const float acc = rd.finish(W, row, sub, x_s);

  if (a.mode == NormOut::Plain) {
    if (sub == 0 && row < W.rows) a.y[row] = acc;
  } else if (a.mode == NormOut::Qkv) {
    if (sub == 0) y_s[local] = acc;
    __syncthreads();
    const int pair = threadIdx.x;
    const int r0 = blockIdx.x * rows_per_block + 2 * pair;
    if (pair < rows_per_block / 2 && r0 < W.rows) {
      const QkvTargets& t = a.qkv;
      detail::store_qkv_pair(r0, y_s[2 * pair], y_s[2 * pair + 1], t.io->pos, t.rope_table, t.q_dim, t.kv_dim,
                             t.head_dim, t.q_out, t.k_cache, t.v_cache);
    }
  } else {
    if (sub == 0 && row < W.rows) a.y[row] = acc;
    ArgmaxPartial c{0.f, kNoIndex};
    if (sub == 0 && row < W.rows && !isnan(acc)) c = ArgmaxPartial{acc, static_cast<uint32_t>(row)};
    __shared__ ArgmaxPartial am_red[32];
    c = detail::block_argmax(c, am_red);
    detail::argmax_finish(c, a.am, a.result, a.io_next);
  }
}

// ------------------------------------------------------------------ matvec + residual

enum class ResidualIn : int { Plain = 0, Silu = 1, Attn = 2 };

struct ResidualArgs {
  ResidualIn mode = ResidualIn::Plain;
  const float* x = nullptr;        // Plain: the input vector; Silu: [gate; up]
  AttnPartials attn;               // Attn
  const DecodeIO* io = nullptr;    // Attn
  int head_dim = 0;                // Attn
};

template <GgmlType T, int TPR>
__global__ void __launch_bounds__(256) matvec_residual_kernel(DevMatrix W, ResidualArgs a, float* residual) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  const int rows_per_block = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int row = blockIdx.x * rows_per_block + local;

  detail::launch_dependents();
  RowDot<T, TPR> rd;
  rd.prefetch(W, row, sub);
  grid_dependency_wait();

  const int n = W.nb * 32;
  if (a.mode != ResidualIn::Attn) {
    const bool silu = a.mode == ResidualIn::Silu;
    for (int i0 = threadIdx.x; i0 < n; i0 += kStageBatch * blockDim.x) {
      float g[kStageBatch], up[kStageBatch];
#pragma unroll
      for (int u = 0; u < kStageBatch; ++u) {
        const int i = i0 + u * blockDim.x;
        g[u] = i < W.cols ? a.x[i] : 0.f;
        up[u] = silu && i < W.cols ? a.x[W.cols + i] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kStageBatch; ++u) {
        const int i = i0 + u * blockDim.x;
        if (i < n) x_s[smem_index(i)] = silu ? g[u] / (1.f + expf(-g[u])) * up[u] : g[u];
      }
    }
  } else {
    // Combine the flash-decoding partials: o = sum_s o_s w_s with w_s = e^(m_s - M) / sum_s' l_s' e^(m_s' - M).
    // One warp per head computes the split weights once; then every output sums its splits (independent loads).
    const int n_pos = a.io->pos + 1;
    const int n_splits = a.attn.n_splits;
    const int chunk = attn_chunk(n_pos, n_splits);
    const int active = (n_pos + chunk - 1) / chunk;
    const int hd = a.head_dim, n_heads = W.cols / hd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    float* weights = x_s + W.nb * kSmemBlockStride;  // [n_heads][n_splits]
    for (int h = warp; h < n_heads; h += n_warps) {
      const float* ml = a.attn.ml + static_cast<int64_t>(h) * n_splits * 2;
      float m = -INFINITY;
      for (int s = lane; s < active; s += 32) m = fmaxf(m, ml[2 * s]);
      m = detail::warp_max(m);
      float l = 0.f;
      for (int s = lane; s < active; s += 32) {
        const float w = expf(ml[2 * s] - m);
        weights[h * n_splits + s] = w;
        l += ml[2 * s + 1] * w;
      }
      const float inv = 1.f / detail::warp_sum(l);
      for (int s = lane; s < active; s += 32) weights[h * n_splits + s] *= inv;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float v = 0.f;
      if (i < W.cols) {
        const int h = i / hd, d = i % hd;
        const float* o = a.attn.o + static_cast<int64_t>(h) * n_splits * hd + d;
        const float* w = weights + h * n_splits;
#pragma unroll 4
        for (int s = 0; s < active; ++s) v += w[s] * o[static_cast<int64_t>(s) * hd];
      }
      x_s[smem_index(i)] = v;
    }
  }
  __syncthreads();

  const float acc = rd.finish(W, row, sub, x_s);
  if (sub == 0 && row < W.rows) residual[row] += acc;
}

// ------------------------------------------------------------------ attention (flash-decoding partials)

constexpr int kMaxGroup = 8;     // query heads per KV head the decode attention supports
constexpr int kAttnThreads = 128;
constexpr int kMaxPairsPerLane = 2;  // head_dim <= 128: a lane owns up to 2 float2 columns in P.V

// Shared memory of one attention block: q of the group, the scores of the chunk, per-warp P.V partial sums.
inline size_t attention_smem_bytes(int group, int head_dim, int chunk_cap) {
  return static_cast<size_t>(group) * (head_dim + chunk_cap + (kAttnThreads / 32) * head_dim) * sizeof(float);
}

// One block per (KV head, split): every thread scores whole cache rows (16-byte loads, no shuffles), so a chunk's
// K rows are all in flight at once; P.V then runs with warps over positions and lanes over columns.
__global__ void __launch_bounds__(kAttnThreads) attention_decode_kernel(const float* __restrict__ q,
                                                                        const float* __restrict__ k_cache,
                                                                        const float* __restrict__ v_cache,
                                                                        const DecodeIO* io, int n_heads,
                                                                        int n_kv_heads, int hd, int chunk_cap,
                                                                        AttnPartials p) {
  detail::launch_dependents();
  grid_dependency_wait();
  extern __shared__ float4 smem_dyn[];
  float* q_s = reinterpret_cast<float*>(smem_dyn);
  const int group = n_heads / n_kv_heads, kv_dim = n_kv_heads * hd;
  float* sc = q_s + group * hd;          // [group][chunk_cap] scores, then probabilities
  float* part = sc + group * chunk_cap;  // [n_warps][group][hd]
  const int kvh = blockIdx.x, split = blockIdx.y;
  const int n_pos = io->pos + 1;
  const int chunk = attn_chunk(n_pos, p.n_splits);
  const int start = split * chunk;
  if (start >= n_pos) return;  // whole block: this split is past the context
  const int len = min(chunk, n_pos - start);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;

  for (int i = threadIdx.x; i < group * hd; i += blockDim.x) q_s[i] = q[static_cast<int64_t>(kvh) * group * hd + i];
  __syncthreads();

  const float scale = 1.f / sqrtf(static_cast<float>(hd));
  const int hd4 = hd / 4;
  for (int t = threadIdx.x; t < len; t += blockDim.x) {
    const float4* k4 = reinterpret_cast<const float4*>(k_cache + static_cast<int64_t>(start + t) * kv_dim + kvh * hd);
    const float4* q4 = reinterpret_cast<const float4*>(q_s);
    float acc[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) acc[g] = 0.f;
#pragma unroll 8
    for (int c = 0; c < hd4; ++c) {
      const float4 k = k4[c];
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < group) {
          const float4 qq = q4[g * hd4 + c];
          acc[g] += qq.x * k.x + qq.y * k.y + qq.z * k.z + qq.w * k.w;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
      if (g < group) sc[g * chunk_cap + t] = acc[g] * scale;
  }
  __syncthreads();

  for (int g = warp; g < group; g += n_warps) {
    float* sg = sc + g * chunk_cap;
    float m = -INFINITY;
    for (int t = lane; t < len; t += 32) m = fmaxf(m, sg[t]);
    m = detail::warp_max(m);
    float l = 0.f;
    for (int t = lane; t < len; t += 32) {
      const float e = expf(sg[t] - m);
      sg[t] = e;
      l += e;
    }
    l = detail::warp_sum(l);
    if (lane == 0) {
      float* ml = p.ml + (static_cast<int64_t>(kvh * group + g) * p.n_splits + split) * 2;
      ml[0] = m;
      ml[1] = l;
    }
  }
  __syncthreads();

  // P.V: warp w takes positions w, w + n_warps, ...; lane owns float2 columns lane and lane + 32.
  const int pairs = hd / 2;
  float2 o[kMaxGroup][kMaxPairsPerLane];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g)
#pragma unroll
    for (int c = 0; c < kMaxPairsPerLane; ++c) o[g][c] = make_float2(0.f, 0.f);
#pragma unroll 8
  for (int t = warp; t < len; t += n_warps) {
    const float2* v2 = reinterpret_cast<const float2*>(v_cache + static_cast<int64_t>(start + t) * kv_dim + kvh * hd);
#pragma unroll
    for (int c = 0; c < kMaxPairsPerLane; ++c) {
      if (lane + 32 * c < pairs) {
        const float2 v = v2[lane + 32 * c];
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g < group) {
            const float pg = sc[g * chunk_cap + t];
            o[g][c].x += pg * v.x;
            o[g][c].y += pg * v.y;
          }
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g)
#pragma unroll
    for (int c = 0; c < kMaxPairsPerLane; ++c)
      if (g < group && lane + 32 * c < pairs)
        reinterpret_cast<float2*>(part + (warp * group + g) * hd)[lane + 32 * c] = o[g][c];
  __syncthreads();
  for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
    float sum = 0.f;
    for (int w = 0; w < n_warps; ++w) sum += part[w * group * hd + i];
    const int g = i / hd, d = i % hd;
    p.o[(static_cast<int64_t>(kvh * group + g) * p.n_splits + split) * hd + d] = sum;
  }
}

// ------------------------------------------------------------------ embedding, argmax, dequant

__global__ void embed_kernel(DevMatrix E, const DecodeIO* io, const int32_t* tokens, float* x) {
  detail::launch_dependents();
  grid_dependency_wait();
  const int t = blockIdx.x;
  const int token = tokens != nullptr ? tokens[t] : io->token;
  for (int i = threadIdx.x; i < E.cols; i += blockDim.x)
    x[static_cast<int64_t>(t) * E.cols + i] = detail::load_weight(E, token, i);
}

__global__ void __launch_bounds__(256) argmax_kernel(const float* __restrict__ x, int n, ArgmaxScratch sc,
                                                     ArgmaxResult* result, DecodeIO* io_next) {
  detail::launch_dependents();
  grid_dependency_wait();
  __shared__ ArgmaxPartial red[32];
  ArgmaxPartial c{0.f, kNoIndex};
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const ArgmaxPartial p{x[i], static_cast<uint32_t>(i)};
    if (!isnan(p.value) && detail::argmax_better(p, c)) c = p;
  }
  c = detail::block_argmax(c, red);
  detail::argmax_finish(c, sc, result, io_next);
}

__global__ void dequant_to_half_kernel(DevMatrix W, __half* out) {
  const int64_t total = static_cast<int64_t>(W.rows) * W.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2half_rn(detail::load_weight(W, i / W.cols, static_cast<int>(i % W.cols)));
}

// ------------------------------------------------------------------ launch helpers

namespace {

struct Geometry {
  int tpr, threads, grid;
  size_t smem;
};

Geometry matvec_geometry(const DevMatrix& W) {
  Geometry g;
  g.tpr = W.nb <= 32 ? 8 : W.nb <= 64 ? 16 : 32;
  g.threads = W.rows >= 8192 ? 256 : 128;
  const int rows_per_block = g.threads / g.tpr;
  g.grid = (W.rows + rows_per_block - 1) / rows_per_block;
  g.smem = static_cast<size_t>(W.nb) * kSmemBlockStride * sizeof(float);
  return g;
}

using NormKernel = void (*)(DevMatrix, const float*, const float*, float, NormMatvecArgs);
using ResidualKernel = void (*)(DevMatrix, ResidualArgs, float*);

template <int TPR>
NormKernel norm_kernel_for(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return norm_matvec_kernel<GgmlType::Q4_0, TPR>;
    case GgmlType::Q4_1: return norm_matvec_kernel<GgmlType::Q4_1, TPR>;
    case GgmlType::Q8_0: return norm_matvec_kernel<GgmlType::Q8_0, TPR>;
    case GgmlType::F16: return norm_matvec_kernel<GgmlType::F16, TPR>;
    case GgmlType::BF16: return norm_matvec_kernel<GgmlType::BF16, TPR>;
    case GgmlType::F32: return norm_matvec_kernel<GgmlType::F32, TPR>;
  }
  throw EngineError("matvec: unsupported weight type");
}
template <int TPR>
ResidualKernel residual_kernel_for(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return matvec_residual_kernel<GgmlType::Q4_0, TPR>;
    case GgmlType::Q4_1: return matvec_residual_kernel<GgmlType::Q4_1, TPR>;
    case GgmlType::Q8_0: return matvec_residual_kernel<GgmlType::Q8_0, TPR>;
    case GgmlType::F16: return matvec_residual_kernel<GgmlType::F16, TPR>;
    case GgmlType::BF16: return matvec_residual_kernel<GgmlType::BF16, TPR>;
    case GgmlType::F32: return matvec_residual_kernel<GgmlType::F32, TPR>;
  }
  throw EngineError("matvec: unsupported weight type");
}

template <typename K>
K pick(int tpr, K k8, K k16, K k32) {
  return tpr == 8 ? k8 : tpr == 16 ? k16 : k32;
}

template <typename K>
void allow_smem(K kernel, size_t smem) {
  constexpr size_t kDefaultLimit = 48 * 1024;
  if (smem > kDefaultLimit)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

void run_norm_matvec(const DevMatrix& W, const float* x, const float* norm_w, float eps, const NormMatvecArgs& a,
                     cudaStream_t s) {
  const Geometry g = matvec_geometry(W);
  NormKernel k = pick(g.tpr, norm_kernel_for<8>(W.type), norm_kernel_for<16>(W.type), norm_kernel_for<32>(W.type));
  allow_smem(k, g.smem);
  launch(k, dim3(g.grid), dim3(g.threads), g.smem, s, W, x, norm_w, eps, a);
}

void run_matvec_residual(const DevMatrix& W, const ResidualArgs& a, float* residual, cudaStream_t s) {
  Geometry g = matvec_geometry(W);
  if (a.mode == ResidualIn::Attn) g.smem += static_cast<size_t>(W.cols / a.head_dim) * a.attn.n_splits * sizeof(float);
  ResidualKernel k =
      pick(g.tpr, residual_kernel_for<8>(W.type), residual_kernel_for<16>(W.type), residual_kernel_for<32>(W.type));
  allow_smem(k, g.smem);
  launch(k, dim3(g.grid), dim3(g.threads), g.smem, s, W, a, residual);
}

}  // namespace

int argmax_partials_needed(const DevMatrix& lm_head) {
  const int g = matvec_geometry(lm_head).grid;
  return g > kArgmaxMaxBlocks ? g : kArgmaxMaxBlocks;
}

void launch_embed(const DevMatrix& emb, const DecodeIO* io, float* x, cudaStream_t s) {
  launch(embed_kernel, dim3(1), dim3(256), 0, s, emb, io, static_cast<const int32_t*>(nullptr), x);
}

void launch_embed_rows(const DevMatrix& emb, const int32_t* tokens, int n, float* x, cudaStream_t s) {
  embed_kernel<<<n, 256, 0, s>>>(emb, nullptr, tokens, x);
  CUDA_CHECK_LAUNCH();
}

void launch_dequant_to_half(const DevMatrix& W, __half* out, cudaStream_t s) {
  const int64_t total = static_cast<int64_t>(W.rows) * W.cols;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65536));
  dequant_to_half_kernel<<<blocks, 256, 0, s>>>(W, out);
  CUDA_CHECK_LAUNCH();
}

void launch_norm_matvec(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* y,
                        cudaStream_t s) {
  NormMatvecArgs a;
  a.mode = NormOut::Plain;
  a.y = y;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_norm_matvec_qkv(const DevMatrix& W, const float* x, const float* norm_w, float eps, const QkvTargets& t,
                            cudaStream_t s) {
  if (W.rows != t.q_dim + 2 * t.kv_dim || t.head_dim % 2 != 0) throw EngineError("qkv matvec: bad geometry");
  NormMatvecArgs a;
  a.mode = NormOut::Qkv;
  a.qkv = t;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_norm_matvec_argmax(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* logits,
                               const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                               cudaStream_t s) {
  if (matvec_geometry(W).grid > scratch.capacity) throw EngineError("argmax scratch too small");
  NormMatvecArgs a;
  a.mode = NormOut::Argmax;
  a.y = logits;
  a.am = scratch;
  a.result = result;
  a.io_next = io_next;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_matvec_residual(const DevMatrix& W, const float* x, float* residual, cudaStream_t s) {
  ResidualArgs a;
  a.mode = ResidualIn::Plain;
  a.x = x;
  run_matvec_residual(W, a, residual, s);
}

void launch_matvec_residual_silu(const DevMatrix& W, const float* gate_up, float* residual, cudaStream_t s) {
  ResidualArgs a;
  a.mode = ResidualIn::Silu;
  a.x = gate_up;
  run_matvec_residual(W, a, residual, s);
}

void launch_matvec_residual_attn(const DevMatrix& W, const AttnPartials& p, const DecodeIO* io, int head_dim,
                                 float* residual, cudaStream_t s) {
  ResidualArgs a;
  a.mode = ResidualIn::Attn;
  a.attn = p;
  a.io = io;
  a.head_dim = head_dim;
  run_matvec_residual(W, a, residual, s);
}

void launch_attention_decode(const float* q, const float* k_cache, const float* v_cache, const DecodeIO* io,
                             int n_heads, int n_kv_heads, int head_dim, int n_ctx, const AttnPartials& p,
                             cudaStream_t s) {
  const int group = n_heads / n_kv_heads;
  if (group > kMaxGroup || group * n_kv_heads != n_heads) throw EngineError("attention: unsupported head grouping");
  const int chunk_cap = attn_chunk(n_ctx, p.n_splits);
  if (head_dim % 32 != 0 || head_dim > 64 * kMaxPairsPerLane)
    throw EngineError("decode attention needs head_dim a multiple of 32, at most 128");
  const size_t smem = attention_smem_bytes(group, head_dim, chunk_cap);
  allow_smem(attention_decode_kernel, smem);
  launch(attention_decode_kernel, dim3(n_kv_heads, p.n_splits), dim3(kAttnThreads), smem, s, q, k_cache, v_cache, io, n_heads,
         n_kv_heads, head_dim, chunk_cap, p);
}

void launch_argmax(const float* x, int n, const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                   cudaStream_t s) {
  int blocks = (n + 1023) / 1024;
  blocks = std::max(1, std::min(blocks, std::min(scratch.capacity, kArgmaxMaxBlocks)));
  launch(argmax_kernel, dim3(blocks), dim3(256), 0, s, x, n, scratch, result, io_next);
}

}  // namespace metalattn::cuda
