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
#include <string>

#include "cuda/cuda_check.h"
#include "kernels.cuh"

namespace metalattn::cuda {

// ------------------------------------------------------------------ launch plumbing

// Per host thread: a backend sets it around its own enqueues (ProgrammaticLaunchScope), and models driven from
// different threads must not switch it under each other's launches.
static thread_local bool g_programmatic = false;
void set_programmatic_launch(bool on) { g_programmatic = on; }
bool programmatic_launch() { return g_programmatic; }

// Every decode kernel launches programmatically while programmatic_launch() is on (kernels.cuh).
template <typename... KernelArgs, typename... Args>
static void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   Args&&... args) {
  detail::launch_programmatic(kernel, grid, block, smem, s, std::forward<Args>(args)...);
}

// ------------------------------------------------------------------ weight blocks

using detail::grid_dependency_wait;

// ------------------------------------------------------------------ chain trace (METALATTN_TRACE builds only)

#ifdef METALATTN_TRACE
__device__ TraceRecord g_trace[kTraceCapacity];
__device__ unsigned int g_trace_count;
// Block 0, thread 0 of a kernel stamps enter (construction), released (after the programmatic wait) and exit
// (destruction, whichever return the kernel takes).
// Per kernel kind, over all blocks: how many blocks ran, and how many were released from the programmatic wait
// less than 1 us after they entered (their weight prefetch could not overlap the kernel before).
__device__ unsigned int g_trace_blocks[kTraceKinds], g_trace_late_blocks[kTraceKinds];
struct KernelTrace {
  int slot = -1;
  int kind_ = 0;
  unsigned long long block_enter = 0;
  __device__ explicit KernelTrace(int kind) : kind_(kind) {
    if (threadIdx.x == 0) block_enter = detail::global_ns();
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
      const unsigned s = atomicAdd(&g_trace_count, 1u);
      if (s < kTraceCapacity) {
        slot = static_cast<int>(s);
        g_trace[slot].enter = detail::global_ns();
        g_trace[slot].kind = kind;
        for (int i = 0; i < kTraceMarks; ++i) g_trace[slot].mark[i] = 0;
      }
    }
  }
  __device__ void released() {
    if (threadIdx.x == 0) {
      const unsigned long long now = detail::global_ns();
      atomicAdd(&g_trace_blocks[kind_], 1u);
      if (now - block_enter < 1000) atomicAdd(&g_trace_late_blocks[kind_], 1u);
      if (slot >= 0) g_trace[slot].released = now;
    }
  }
  __device__ void mark(int i) {
    if (slot >= 0) g_trace[slot].mark[i] = detail::global_ns();
  }
  __device__ ~KernelTrace() {
    if (slot >= 0) g_trace[slot].exit = detail::global_ns();
  }
};
bool trace_reset() {
  const unsigned zero = 0, zeros[kTraceKinds] = {};
  CUDA_CHECK(cudaMemcpyToSymbol(g_trace_count, &zero, sizeof(zero)));
  CUDA_CHECK(cudaMemcpyToSymbol(g_trace_blocks, zeros, sizeof(zeros)));
  CUDA_CHECK(cudaMemcpyToSymbol(g_trace_late_blocks, zeros, sizeof(zeros)));
  return true;
}
void trace_block_counts(unsigned* blocks, unsigned* late) {
  CUDA_CHECK(cudaMemcpyFromSymbol(blocks, g_trace_blocks, kTraceKinds * sizeof(unsigned)));
  CUDA_CHECK(cudaMemcpyFromSymbol(late, g_trace_late_blocks, kTraceKinds * sizeof(unsigned)));
}
std::vector<TraceRecord> trace_read() {
  unsigned n = 0;
  CUDA_CHECK(cudaMemcpyFromSymbol(&n, g_trace_count, sizeof(n)));
  std::vector<TraceRecord> r(std::min<unsigned>(n, kTraceCapacity));
  if (!r.empty()) CUDA_CHECK(cudaMemcpyFromSymbol(r.data(), g_trace, r.size() * sizeof(TraceRecord)));
  return r;
}
#else
struct KernelTrace {
  __device__ explicit KernelTrace(int) {}
  __device__ void released() {}
  __device__ void mark(int) {}
};
bool trace_reset() { return false; }
std::vector<TraceRecord> trace_read() { return {}; }
void trace_block_counts(unsigned* blocks, unsigned* late) {
  for (int k = 0; k < kTraceKinds; ++k) blocks[k] = late[k] = 0;
}
#endif

__device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Weight bytes as exact floats without the conversion unit. An int8/uint8 -> float conversion (I2F) issues at 16
// results per clock per SM on sm_90, an eighth of FFMA's rate, and with one per weight it bounded the dot products
// of the byte-valued types after the activations arrived. Here the byte goes into the mantissa of 2^23 (one PRMT:
// 0x4B0000bb read as a float is 2^23 + bb) and the offset comes off in one FADD: exact for every byte, on full-rate
// pipes. `off` is 2^23 plus the value a stored byte of 0 stands for (signed bytes are first xor'ed with 0x80).
template <int kByte>
__device__ __forceinline__ float byte_f(uint32_t u, float off) {
  return __int_as_float(static_cast<int>(__byte_perm(u, 0x4B000000u, 0x7540u | kByte))) - off;
}
constexpr float kMagicU = 8388608.f;          // 2^23: unsigned bytes
constexpr float kMagicS = 8388608.f + 128.f;  // signed bytes, xor'ed with 0x80 first
__device__ __forceinline__ float4 bytes_f4(uint32_t u, float off) {
  return make_float4(byte_f<0>(u, off), byte_f<1>(u, off), byte_f<2>(u, off), byte_f<3>(u, off));
}

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
    // One accumulator per 32-bit word: four independent FMA chains of 8, not one of 32 (decode is latency-bound).
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 lo = ld4(xb + 4 * i), hi = ld4(xb + 16 + 4 * i);
      const float4 a = bytes_f4(w[i] & 0x0f0f0f0fu, kMagicU + 8.f);  // q - 8
      const float4 b = bytes_f4((w[i] >> 4) & 0x0f0f0f0fu, kMagicU + 8.f);
      s[i] = lo.x * a.x;
      s[i] += lo.y * a.y;
      s[i] += lo.z * a.z;
      s[i] += lo.w * a.w;
      s[i] += hi.x * b.x;
      s[i] += hi.y * b.y;
      s[i] += hi.z * b.z;
      s[i] += hi.w * b.w;
    }
    return h2f(d) * ((s[0] + s[1]) + (s[2] + s[3]));
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
    float s[4], sx[4];  // per-word accumulators: short dependency chains
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 lo = ld4(xb + 4 * i), hi = ld4(xb + 16 + 4 * i);
      const float4 a = bytes_f4(w[i] & 0x0f0f0f0fu, kMagicU), b = bytes_f4((w[i] >> 4) & 0x0f0f0f0fu, kMagicU);
      s[i] = lo.x * a.x + lo.y * a.y + lo.z * a.z + lo.w * a.w;
      s[i] += hi.x * b.x + hi.y * b.y + hi.z * b.z + hi.w * b.w;
      sx[i] = (lo.x + lo.y) + (lo.z + lo.w) + (hi.x + hi.y) + (hi.z + hi.w);
    }
    return h2f(static_cast<uint16_t>(dm & 0xffffu)) * ((s[0] + s[1]) + (s[2] + s[3])) +
           h2f(static_cast<uint16_t>(dm >> 16)) * ((sx[0] + sx[1]) + (sx[2] + sx[3]));
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
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // four independent FMA chains
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 x = ld4(xb + 4 * i);
      const float4 q4 = bytes_f4(w[i] ^ 0x80808080u, kMagicS);
      s[i & 3] += x.x * q4.x + x.y * q4.y + x.z * q4.z + x.w * q4.w;
    }
    return h2f(d) * ((s[0] + s[1]) + (s[2] + s[3]));
  }
};

// ---- the new types (DevMatrix in kernels.cuh has their layouts). Helpers: the four bytes of v, signed or unsigned,
// times x, added to acc as one FMA chain.
__device__ __forceinline__ float fma_s8x4(uint32_t v, float4 x, float acc) {
  const float4 q = bytes_f4(v ^ 0x80808080u, kMagicS);
  acc += x.x * q.x;
  acc += x.y * q.y;
  acc += x.z * q.z;
  acc += x.w * q.w;
  return acc;
}
__device__ __forceinline__ float fma_u8x4(uint32_t v, float4 x, float acc) {
  const float4 q = bytes_f4(v, kMagicU);
  acc += x.x * q.x;
  acc += x.y * q.y;
  acc += x.z * q.z;
  acc += x.w * q.w;
  return acc;
}
__device__ __forceinline__ float sum4(float4 x) { return (x.x + x.y) + (x.z + x.w); }

// Payload word i of a nibble block as bytes: its four low nibbles (weights 4i..4i+3) or its four high nibbles
// (weights 16+4i..16+4i+3), with the extra bits of a Q5 aux word (q5_aux_bit) at bit 4 of each byte.
__device__ __forceinline__ uint32_t q5_lo_bytes(uint32_t w, uint32_t aux, int i) {
  return (w & 0x0f0f0f0fu) | (((aux >> i) & 0x01010101u) << 4);
}
__device__ __forceinline__ uint32_t q5_hi_bytes(uint32_t w, uint32_t aux, int i) {
  return ((w >> 4) & 0x0f0f0f0fu) | (((aux >> (4 + i)) & 0x01010101u) << 4);
}

// Unsigned 5-bit (Q5_1, Q5_K) or 4-bit (Q4_K) quants: sums of x * q and of x over one block.
template <bool kFive>
__device__ __forceinline__ void unsigned_block_sums(const uint4& q, uint32_t aux, const float* xb, float& sq,
                                                    float& sx) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  float s[4], t[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 lo = ld4(xb + 4 * i), hi = ld4(xb + 16 + 4 * i);
    const uint32_t bl = kFive ? q5_lo_bytes(w[i], aux, i) : (w[i] & 0x0f0f0f0fu);
    const uint32_t bh = kFive ? q5_hi_bytes(w[i], aux, i) : ((w[i] >> 4) & 0x0f0f0f0fu);
    s[i] = fma_u8x4(bh, hi, fma_u8x4(bl, lo, 0.f));
    t[i] = sum4(lo) + sum4(hi);
  }
  sq = (s[0] + s[1]) + (s[2] + s[3]);
  sx = (t[0] + t[1]) + (t[2] + t[3]);
}

template <>
struct Blk<GgmlType::Q5_0> {
  static constexpr int kUnroll = 3;
  uint4 q;
  uint32_t h;  // inverted fifth bits
  uint16_t d;
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    q = __ldg(reinterpret_cast<const uint4*>(W.payload) + blk);
    h = __ldg(W.aux + blk);
    d = __ldg(W.scales + blk);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    // nibble | (inverted fifth bit ? 0xF0 : 0) is the signed byte q - 16.
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t bl = (w[i] & 0x0f0f0f0fu) | (((h >> i) & 0x01010101u) * 0xf0u);
      const uint32_t bh = ((w[i] >> 4) & 0x0f0f0f0fu) | (((h >> (4 + i)) & 0x01010101u) * 0xf0u);
      s[i] = fma_s8x4(bh, ld4(xb + 16 + 4 * i), fma_s8x4(bl, ld4(xb + 4 * i), 0.f));
    }
    return h2f(d) * ((s[0] + s[1]) + (s[2] + s[3]));
  }
};

template <>
struct Blk<GgmlType::Q5_1> {
  static constexpr int kUnroll = 3;
  uint4 q;
  uint32_t h;
  uint32_t dm;  // fp16 d (low half) and m (high half)
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    q = __ldg(reinterpret_cast<const uint4*>(W.payload) + blk);
    h = __ldg(W.aux + blk);
    dm = __ldg(reinterpret_cast<const unsigned int*>(W.scales) + blk);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    float sq, sx;
    unsigned_block_sums<true>(q, h, xb, sq, sx);
    return h2f(static_cast<uint16_t>(dm & 0xffffu)) * sq + h2f(static_cast<uint16_t>(dm >> 16)) * sx;
  }
};

// Q4_K / Q5_K: the super-block header (d, dmin, packed 6-bit scales and mins) is loaded whole (the eight lanes of a
// super-block read the same 16 bytes) and the block's scale d * sc and min dmin * m decoded after the loads.
template <bool kFive>
struct BlkK {
  static constexpr int kUnroll = 2;
  uint4 q;
  uint4 hdr;
  uint32_t h;  // Q5_K: fifth bits
  int sub;     // sub-block 0..7 of the super-block
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    q = __ldg(reinterpret_cast<const uint4*>(W.payload) + blk);
    hdr = __ldg(reinterpret_cast<const uint4*>(W.scales) + (blk >> 3));
    h = kFive ? __ldg(W.aux + blk) : 0u;
    sub = static_cast<int>(blk & 7);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    float sq, sx;
    unsigned_block_sums<kFive>(q, h, xb, sq, sx);
    int sc, m;
    detail::k_header_scale_min(hdr.y, hdr.z, hdr.w, sub, &sc, &m);
    const float dl = h2f(static_cast<uint16_t>(hdr.x & 0xffffu)) * static_cast<float>(sc);
    const float ml = h2f(static_cast<uint16_t>(hdr.x >> 16)) * static_cast<float>(m);
    return dl * sq - ml * sx;
  }
};
template <>
struct Blk<GgmlType::Q4_K> : BlkK<false> {};
template <>
struct Blk<GgmlType::Q5_K> : BlkK<true> {};

template <>
struct Blk<GgmlType::Q6_K> {
  static constexpr int kUnroll = 2;
  uint4 q;
  uint2 h;      // high bits xor 2: weights 0..15, 16..31
  uint32_t sw;  // fp16 d | int8 sc of weights 0..15 << 16 | int8 sc of 16..31 << 24
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    q = __ldg(reinterpret_cast<const uint4*>(W.payload) + blk);
    h = __ldg(reinterpret_cast<const uint2*>(W.aux) + blk);
    sw = __ldg(reinterpret_cast<const unsigned int*>(W.scales) + blk);
  }
  // nibble | t << 4 with bits 6, 7 copied from bit 5: the signed byte q - 32 (t = the stored bits, xor 2).
  __device__ __forceinline__ static uint32_t bytes(uint32_t nibbles, uint32_t t) {
    return nibbles | (t << 4) | ((t & 0x02020202u) * 0x60u);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float s_lo[4], s_hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t bl = bytes(w[i] & 0x0f0f0f0fu, (h.x >> (2 * i)) & 0x03030303u);
      const uint32_t bh = bytes((w[i] >> 4) & 0x0f0f0f0fu, (h.y >> (2 * i)) & 0x03030303u);
      s_lo[i] = fma_s8x4(bl, ld4(xb + 4 * i), 0.f);
      s_hi[i] = fma_s8x4(bh, ld4(xb + 16 + 4 * i), 0.f);
    }
    const float d = h2f(static_cast<uint16_t>(sw & 0xffffu));
    const float d0 = d * static_cast<float>(static_cast<int8_t>((sw >> 16) & 0xff));
    const float d1 = d * static_cast<float>(static_cast<int8_t>(sw >> 24));
    return d0 * ((s_lo[0] + s_lo[1]) + (s_lo[2] + s_lo[3])) + d1 * ((s_hi[0] + s_hi[1]) + (s_hi[2] + s_hi[3]));
  }
};

// kWide8's block is a plain struct, not Blk<kWide8>: the kernels are templated on the block type, and nvcc's host stubs
// cannot spell a kernel template argument that is not one of GgmlType's enumerators.
struct BlkWide8 {
  static constexpr int kUnroll = 1;
  uint4 q[2];  // int8 weights 0..15, 16..31
  uint4 sm;    // fp32 s0, s1, m0, m1
  __device__ __forceinline__ void load(const DevMatrix& W, int64_t blk) {
    const uint4* p = reinterpret_cast<const uint4*>(W.payload) + 2 * blk;
    q[0] = __ldg(p);
    q[1] = __ldg(p + 1);
    sm = __ldg(reinterpret_cast<const uint4*>(W.aux) + blk);
  }
  __device__ __forceinline__ float dot(const float* xb) const {
    float s[2][2], t[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t w[4] = {q[h].x, q[h].y, q[h].z, q[h].w};
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // two chains per half
        const float4 xa = ld4(xb + 16 * h + 8 * c), xc = ld4(xb + 16 * h + 8 * c + 4);
        s[h][c] = fma_s8x4(w[2 * c + 1], xc, fma_s8x4(w[2 * c], xa, 0.f));
        t[h][c] = sum4(xa) + sum4(xc);
      }
    }
    return __uint_as_float(sm.x) * (s[0][0] + s[0][1]) + __uint_as_float(sm.y) * (s[1][0] + s[1][1]) -
           (__uint_as_float(sm.z) * (t[0][0] + t[0][1]) + __uint_as_float(sm.w) * (t[1][0] + t[1][1]));
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
// The block decoder of a DevMatrix type (kWide8's is BlkWide8, see there).
template <GgmlType T>
struct BlkSel {
  using type = Blk<T>;
};
template <>
struct BlkSel<kWide8> {
  using type = BlkWide8;
};

template <typename B, int TPR, int UN = B::kUnroll>
struct RowDotB {
  static constexpr int U = UN;
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
    for (int o = (TPR < 32 ? TPR : 32) / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;  // TPR 64: each warp's half of the row (the caller adds the two)
  }
};

constexpr int kStageBatch = 8;  // activation loads each thread issues before using any
constexpr int kStageVec = 4;    // the same in 16-byte loads (matvec_residual_kernel)

__device__ __forceinline__ int smem_index(int i) { return (i >> 5) * kSmemBlockStride + (i & 31); }

// ------------------------------------------------------------------ fused RMSNorm + matvec

// Norm weights of the first staging batch, loaded before the programmatic wait (they are weights, so this takes
// one L2 round trip out of the critical path).
struct NormPrefetch {
  float w[kStageBatch];
  __device__ __forceinline__ void load(const float* __restrict__ norm_w, int cols) {
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = threadIdx.x + u * blockDim.x;
      w[u] = norm_w != nullptr && i < cols ? __ldg(norm_w + i) : 1.f;
    }
  }
};

// Stages x[0..n) (zero past `cols`) times the norm weights into the padded shared layout and returns rmsnorm's
// 1/rms (1 without norm_w), which the caller applies to its dot products: W.(x*w) / rms = W.rmsnorm(x), with no
// second pass over x_s. x is read through L2 (it was written by the kernel before), in batches of kStageBatch loads
// per thread, so the staging costs one round trip. With add.y set (PreAdd, kernels.cuh), x + rmsnorm(add.y) * add.w
// is staged instead of x, as add_normed_kernel computes it, and block 0 writes it to add.x_next. Ends with a barrier.
__device__ __forceinline__ float stage_normed(const float* x, const float* __restrict__ norm_w, const NormPrefetch& pre,
                                              float eps, int cols, int n, float* x_s, float* red,
                                              const PreAdd& add = PreAdd{}) {
  // PreAdd: y's reduction first, then the add as x is staged: two round trips to L2 and one block reduction more
  // than plain staging. (Loading x, y and the post-norm weights of the first batch together ahead of the reduction,
  // one round trip fewer, measured slower on the H100: Gemma 3 270M-shaped decode 1,853 -> 1,737 tok/s, NOTES.)
  float add_scale = 0.f;
  if (add.y != nullptr) {
    float sy = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
      const float v = __ldcg(add.y + i);
      sy += v * v;
    }
    add_scale = 1.f / sqrtf(detail::block_sum(sy, red) / static_cast<float>(cols) + add.eps);
  }
  float ss = 0.f;
  for (int i0 = threadIdx.x, batch = 0; i0 < n; i0 += kStageBatch * blockDim.x, ++batch) {
    float v[kStageBatch], w[kStageBatch];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * blockDim.x;
      v[u] = i < cols ? __ldcg(x + i) : 0.f;
      w[u] = batch == 0 ? pre.w[u] : (norm_w != nullptr && i < cols ? __ldg(norm_w + i) : 1.f);
    }
    if (add.y != nullptr) {
#pragma unroll
      for (int u = 0; u < kStageBatch; ++u) {
        const int i = i0 + u * blockDim.x;
        if (i < cols) {
          v[u] = v[u] + __ldcg(add.y + i) * add_scale * __ldg(add.w + i);
          if (blockIdx.x == 0) add.x_next[i] = v[u];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < n) {
        x_s[smem_index(i)] = v[u] * w[u];
        ss += v[u] * v[u];
      }
    }
  }
  if (norm_w == nullptr) {
    __syncthreads();
    return 1.f;
  }
  const float total = detail::block_sum(ss, red);  // its barriers also publish x_s
  return 1.f / sqrtf(total / static_cast<float>(cols) + eps);
}

// Plain: y = the rows. Qkv: RoPE and the cache append (QkvTargets). SiluGlu: W = [gate; up] stacked, and each block
// takes the same units of both halves (its first warps gate rows u.., the rest up rows u..), so that y[u] =
// silu(gate_u) * up_u leaves the kernel finished and the down projection stages plain activations.
enum class NormOut : int { Plain = 0, Qkv = 1, SiluGlu = 2 };

struct NormMatvecArgs {
  NormOut mode = NormOut::Plain;
  bool gelu = false;   // SiluGlu: GELU (tanh form) in place of SiLU
  PreAdd pre;          // a residual add folded into the staging (see stage_normed)
  float* y = nullptr;  // Plain: the output rows; SiluGlu: the W.rows / 2 activations
  QkvTargets qkv;
  DevMatrix embed;           // Qkv with embed.payload set: x is row qkv.io->token of embed
  float* x_out = nullptr;    // ... and block 0 writes that row here (the residual stream)
};

// Blocks per lane loaded before the wait: at least 4 for quarter-warp rows (TPR 8), so that all blocks of a row of
// up to 32 (SmolLM2, Qwen2.5-0.5B, Gemma 3 widths) are in flight before the wait (small block types only).
// The one-wave kernel (norm_matvec_kernel_5) holds at most 2, so that 16-lane rows of up to 32 blocks fit 48 registers.
template <typename B>
constexpr int unroll_for(int tpr, int minb = 1) {
  return minb > 1 ? (B::kUnroll < 2 ? B::kUnroll : 2) : tpr == 8 && sizeof(B) <= 32 && B::kUnroll < 4 ? 4 : B::kUnroll;
}

// The body of the fused norm + matvec kernels below. PRE: the PreAdd variant (a.pre set), a separate instantiation so
// that the kernels of every other layer compile as if it did not exist (a runtime test cost Qwen2.5-0.5B-shaped
// decode 2.5% on the H100). MINB: see norm_matvec_kernel_5.
template <typename B, int TPR, bool PRE, int MINB>
__device__ __forceinline__ void norm_matvec_body(const DevMatrix& W, const float* __restrict__ x,
                                                 const float* __restrict__ norm_w, float eps, const NormMatvecArgs& a) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  __shared__ float red[32];
  __shared__ float y_s[512 / 8];
  const int rows_per_block = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int n = W.nb * 32;
  // SiluGlu: this block's units [unit0, unit0 + units_per_block) of both halves; rows past a half map to W.rows,
  // which every row test treats as absent.
  const int units = W.rows / 2, units_per_block = rows_per_block / 2, unit0 = blockIdx.x * units_per_block;
  const int glu_unit = unit0 + (local < units_per_block ? local : local - units_per_block);
  // Qkv: the rows in pair order (detail::qkv_pair_row), so that the two rows RoPE turns together are adjacent here.
  const int row = a.mode == NormOut::Qkv
                      ? detail::qkv_pair_row(blockIdx.x * rows_per_block + local, a.qkv.neox, a.qkv.q_dim,
                                             a.qkv.kv_dim, a.qkv.head_dim)
                  : a.mode != NormOut::SiluGlu ? blockIdx.x * rows_per_block + local
                  : glu_unit >= units          ? W.rows
                                               : glu_unit + (local < units_per_block ? 0 : units);

  KernelTrace trace(a.mode == NormOut::Qkv ? kTraceQkv : kTraceNormMatvec);
  detail::launch_dependents();
  RowDotB<B, TPR, unroll_for<B>(TPR, MINB)> rd;
  rd.prefetch(W, row, sub);
  NormPrefetch nw;
  nw.load(norm_w, W.cols);
  // QKV: the RoPE factors of the rows this thread stores (the position was written before this graph launch).
  const int pair = threadIdx.x;
  const int r0 = blockIdx.x * rows_per_block + 2 * pair;
  const bool stores_pair = a.mode == NormOut::Qkv && pair < rows_per_block / 2 && r0 < W.rows;
  float2 cs = make_float2(1.f, 0.f);
  if (stores_pair) {
    const QkvTargets& t = a.qkv;
    cs = detail::rope_factors(r0, t.io->pos, t.rope_table, t.q_dim, t.kv_dim, t.head_dim);
  }
  const float bias = a.mode == NormOut::Qkv && a.qkv.bias != nullptr && sub == 0 && row < W.rows ? a.qkv.bias[row] : 0.f;

  float scale = 1.f;
  if (a.embed.payload != nullptr) {
    // The token id was written before this graph launch (by the host or the previous step's argmax), and the
    // embedding is a weight, so the whole gather and the norm run before the wait.
    const int64_t token = a.qkv.io->token;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = i < W.cols ? detail::load_weight(a.embed, token, i) : 0.f;
      x_s[smem_index(i)] = v;
      ss += v * v;
    }
    const float total = detail::block_sum(ss, red);
    const float inv_rms = 1.f / sqrtf(total / static_cast<float>(W.cols) + eps);
    grid_dependency_wait();  // the previous step's kernels may still read x
    trace.released();
    for (int i = threadIdx.x; i < W.cols; i += blockDim.x) {
      const float v = x_s[smem_index(i)];
      if (blockIdx.x == 0) a.x_out[i] = v;
      x_s[smem_index(i)] = v * inv_rms * norm_w[i];
    }
    __syncthreads();
  } else {
    grid_dependency_wait();
    trace.released();
    scale = stage_normed(x, norm_w, nw, eps, W.cols, n, x_s, red, PRE ? a.pre : PreAdd{});
  }

  const float acc = rd.finish(W, row, sub, x_s) * scale;

  if (a.mode == NormOut::Plain) {
    if (sub == 0 && row < W.rows) a.y[row] = acc;
  } else if (a.mode == NormOut::SiluGlu) {
    if (sub == 0) y_s[local] = acc;
    __syncthreads();
    const int u = unit0 + threadIdx.x;
    if (threadIdx.x < units_per_block && u < units) {
      const float g = y_s[threadIdx.x], up = y_s[threadIdx.x + units_per_block];
      if (a.gelu) {  // the formula of glu_kernel (arch.cu) and the CPU reference
        const float t = 0.7978845608028654f * g * (1.f + 0.044715f * g * g);
        a.y[u] = 0.5f * g * (1.f + tanhf(t)) * up;
      } else {
        a.y[u] = g / (1.f + expf(-g)) * up;
      }
    }
  } else {
    if (sub == 0) y_s[local] = acc + bias;
    __syncthreads();
    if (stores_pair) {
      const QkvTargets& t = a.qkv;
      const bool gathered = t.neox && r0 < t.q_dim + t.kv_dim;  // a NeoX pair: rows i and i + head_dim/2
      detail::store_qkv_pair_rotated(detail::qkv_pair_row(r0, t.neox, t.q_dim, t.kv_dim, t.head_dim), y_s[2 * pair],
                                     y_s[2 * pair + 1], t.io->pos, cs, t.q_dim, t.kv_dim, t.head_dim, t.q_out,
                                     t.k_cache, t.v_cache, gathered ? t.head_dim / 2 : 1);
    }
  }
}

template <typename B, int TPR, bool PRE>
__global__ void __launch_bounds__(512) norm_matvec_kernel(DevMatrix W, const float* __restrict__ x,
                                                          const float* __restrict__ norm_w, float eps,
                                                          NormMatvecArgs a) {
  norm_matvec_body<B, TPR, PRE, 1>(W, x, norm_w, eps, a);
}

// 16-lane rows in 256-thread blocks, five resident per SM (48 registers, 2 blocks a lane before the wait), for matrices
// that one wave of norm_matvec_kernel does not cover (run_norm_matvec). Its own kernel, not a launch-bounds template
// argument of the one above: `__launch_bounds__(512, 1)` there let ptxas take 85-111 registers instead of 64 and cost
// SmolLM2-135M 7% (NOTES, "CUDA, session 14").
template <typename B>
__global__ void __launch_bounds__(256, 5) norm_matvec_kernel_5(DevMatrix W, const float* __restrict__ x,
                                                               const float* __restrict__ norm_w, float eps,
                                                               NormMatvecArgs a) {
  norm_matvec_body<B, 16, false, 5>(W, x, norm_w, eps, a);
}

// ------------------------------------------------------------------ final norm + lm_head + argmax

struct ArgmaxArgs {
  bool prefetch_l2 = false;      // the rows of later passes go to L2 before the wait (when they fit there)
  float* logits = nullptr;
  ArgmaxScratch am;
  ArgmaxResult* result = nullptr;
  DecodeIO* io_next = nullptr;
};

// Few blocks, each looping over several row groups: the norm is staged and the argmax reduced once per block, not
// once per 32 rows, and the next group's weights are loaded while the current one is summed.
template <typename B, int TPR>
__global__ void __launch_bounds__(256) norm_matvec_argmax_kernel(DevMatrix W, const float* __restrict__ x,
                                                                 const float* __restrict__ norm_w, float eps,
                                                                 ArgmaxArgs a) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  __shared__ float red[32];
  __shared__ ArgmaxPartial am_red[32];
  const int rows_per_pass = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int stride = gridDim.x * rows_per_pass;
  int base = blockIdx.x * rows_per_pass;

  KernelTrace trace(kTraceLmHead);
  detail::launch_dependents();
  RowDotB<B, TPR> rd;
  rd.prefetch(W, base + local, sub);
  NormPrefetch nw;
  nw.load(norm_w, W.cols);
  // The rows of the later passes go to L2 now, while the kernels before still run: the lm_head is the one matrix
  // too large for its first pass to hide the rest of its reads.
  if (a.prefetch_l2) {
    const int pb = payload_bytes(W.type), sc = scale_count(W.type);
    for (int g = base + stride; g < W.rows; g += stride) {
      const int rows = min(rows_per_pass, W.rows - g);
      const char* pay = reinterpret_cast<const char*>(W.payload) + static_cast<int64_t>(g) * W.nb * pb;
      const int pay_bytes = rows * W.nb * pb;
      for (int off = threadIdx.x * 128; off < pay_bytes; off += blockDim.x * 128) prefetch_l2(pay + off);
      if (sc > 0) {
        const char* scl = reinterpret_cast<const char*>(W.scales) + static_cast<int64_t>(g) * W.nb * sc * 2;
        const int scl_bytes = rows * W.nb * sc * 2;
        for (int off = threadIdx.x * 128; off < scl_bytes; off += blockDim.x * 128) prefetch_l2(scl + off);
      }
      const int aw = aux_words(W.type);
      if (aw > 0) {
        const char* aux = reinterpret_cast<const char*>(W.aux) + static_cast<int64_t>(g) * W.nb * aw * 4;
        const int aux_bytes = rows * W.nb * aw * 4;
        for (int off = threadIdx.x * 128; off < aux_bytes; off += blockDim.x * 128) prefetch_l2(aux + off);
      }
    }
  }
  grid_dependency_wait();
  trace.released();
  const float scale = stage_normed(x, norm_w, nw, eps, W.cols, W.nb * 32, x_s, red);

  ArgmaxPartial best{0.f, kNoIndex};
  for (; base < W.rows; base += stride) {  // block-uniform: every lane takes part in the group shuffles
    RowDotB<B, TPR> next;
    next.prefetch(W, base + stride + local, sub);
    const int row = base + local;
    const float acc = rd.finish(W, row, sub, x_s) * scale;
    if (sub == 0 && row < W.rows) {
      a.logits[row] = acc;
      if (!isnan(acc) && detail::argmax_better(ArgmaxPartial{acc, static_cast<uint32_t>(row)}, best))
        best = ArgmaxPartial{acc, static_cast<uint32_t>(row)};
    }
    rd = next;
  }
  best = detail::block_argmax(best, am_red);
  detail::argmax_finish(best, a.am, a.result, a.io_next);
}

// ------------------------------------------------------------------ matvec + residual

// TPR 64 (two warps per row, 512 threads) serves wide matrices such as the down projection (48 blocks per row):
// each lane then sums at most one weight block after the wait instead of two. U: the weight blocks each lane loads
// before the wait (launch_matvec_residual gives rows of more than two blocks a lane three).
template <typename B, int TPR, int U = B::kUnroll>
__global__ void __launch_bounds__(512) matvec_residual_kernel(DevMatrix W, const float* __restrict__ x,
                                                              float* residual) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  __shared__ float half_sums[TPR > 32 ? 512 / 32 : 1];
  const int rows_per_block = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int row = blockIdx.x * rows_per_block + local;

  KernelTrace trace(W.nb > 32 ? kTraceDown : kTraceResidual);
  detail::launch_dependents();
  RowDotB<B, TPR, U> rd;
  rd.prefetch(W, row, sub);
  grid_dependency_wait();
  trace.released();
  // The residual row is loaded now, in the same L2 round trip as the activations, not after the dot product.
  const float res = sub == 0 && row < W.rows ? __ldcg(residual + row) : 0.f;

  // x in 16-byte loads, kStageVec per thread per round trip to L2: one round trip up to 8,192 columns at 512
  // threads (the down projection's 4,864 took two with scalar loads; NOTES, "CUDA, session 14").
  const int n = W.nb * 32;
  const bool vec = (reinterpret_cast<uintptr_t>(x) & 15) == 0 && W.cols % 4 == 0;
  for (int j0 = threadIdx.x; j0 < n / 4; j0 += kStageVec * blockDim.x) {
    float4 v[kStageVec];
#pragma unroll
    for (int u = 0; u < kStageVec; ++u) {
      const int j = j0 + u * blockDim.x, i = 4 * j;
      if (vec) {
        v[u] = i < W.cols ? __ldcg(reinterpret_cast<const float4*>(x) + j) : make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        v[u].x = i < W.cols ? __ldcg(x + i) : 0.f;
        v[u].y = i + 1 < W.cols ? __ldcg(x + i + 1) : 0.f;
        v[u].z = i + 2 < W.cols ? __ldcg(x + i + 2) : 0.f;
        v[u].w = i + 3 < W.cols ? __ldcg(x + i + 3) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kStageVec; ++u) {
      const int j = j0 + u * blockDim.x;
      if (j < n / 4) *reinterpret_cast<float4*>(x_s + smem_index(4 * j)) = v[u];
    }
  }
  __syncthreads();
  trace.mark(0);

  float acc = rd.finish(W, row, sub, x_s);
  if constexpr (TPR > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) half_sums[warp] = acc;
    __syncthreads();
    if (sub == 0) acc = half_sums[warp] + half_sums[warp + 1];
  }
  trace.mark(1);
  if (sub == 0 && row < W.rows) residual[row] = res + acc;
}

// ------------------------------------------------------------------ attention

constexpr int kMaxGroup = 8;  // query heads per KV head the decode attention supports
constexpr int kAttnThreads = kAttnSinglePassMax;  // also: the block holds up to 256 rows in registers
constexpr int kAttnWarps = kAttnThreads / 32;

// Shared memory of one attention block: the staged V rows of the chunk, q of its heads, the scores of the chunk,
// per-warp P.V partial sums.
inline size_t attention_smem_bytes(int heads_per_block, int head_dim, int chunk_cap, int stage_rows) {
  return (static_cast<size_t>(stage_rows) * head_dim +
          static_cast<size_t>(heads_per_block) * (head_dim + chunk_cap + kAttnWarps * head_dim)) *
         sizeof(float);
}


using detail::cp_async16;
using detail::cp_async_wait_all;

// One block per (heads_per_block query heads of one KV head, split); splits = attn_splits(pos + 1), blocks past it
// exit at once. Cache rows before pos were written by earlier steps, so before the programmatic wait each thread
// loads its K row into registers and the block copies the chunk's V rows (the first stage_rows of them) into shared
// memory: after the wait only q and row pos come from L2, in one round trip. Scores: a thread per position (16-byte
// loads, no shuffles); P.V: warps over positions, lanes over float2 columns.
template <int HD>
__global__ void __launch_bounds__(kAttnThreads) attention_decode_kernel(const float* q, const float* k_cache,
                                                                        const float* v_cache,
                                                                        const DecodeIO* io, int n_heads,
                                                                        int n_kv_heads, int heads_per_block,
                                                                        int chunk_cap, int stage_rows,
                                                                        AttnScratch p, float* __restrict__ out) {
  constexpr int kHd4 = HD / 4, kPairs = HD / 2, kPairsPerLane = (kPairs + 31) / 32;
  KernelTrace trace(kTraceAttention);
  detail::launch_dependents();
  extern __shared__ float4 smem_dyn[];
  const int hpb = heads_per_block, kv_dim = n_kv_heads * HD;
  float* v_s = reinterpret_cast<float*>(smem_dyn);  // [stage_rows][HD]
  float* q_s = v_s + stage_rows * HD;                // [hpb][HD]
  float* sc = q_s + hpb * HD;                        // [hpb][chunk_cap] scores, then probabilities
  float* part = sc + hpb * chunk_cap;                // [kAttnWarps][hpb][HD]
  __shared__ float m_s[kMaxGroup], l_s[kMaxGroup];
  __shared__ bool is_last;

  const int head_block = blockIdx.x, split = blockIdx.y;
  const int head0 = head_block * hpb, kvh = head0 / (n_heads / n_kv_heads);
  const int pos = io->pos, n_pos = pos + 1;  // io was written before this graph launch
  const int n_splits = attn_splits(n_pos, p.max_splits);
  if (split >= n_splits) return;
  const int chunk = attn_chunk(n_pos, n_splits);
  const int start = split * chunk;
  const int len = min(chunk, n_pos - start);
  const int n_staged = min(len, stage_rows);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  const float* k_head = k_cache + kvh * HD;
  const float* v_head = v_cache + kvh * HD;
  float4 k_own[kHd4];
  const int t0 = threadIdx.x;
  const bool own_early = t0 < len && start + t0 < pos;
  if (own_early) {
    const float4* k4 = reinterpret_cast<const float4*>(k_head + static_cast<int64_t>(start + t0) * kv_dim);
#pragma unroll
    for (int c = 0; c < kHd4; ++c) k_own[c] = __ldg(k4 + c);
  }
  const int n_early = min(n_staged, pos - start);  // staged rows written by earlier steps
  for (int i = threadIdx.x; i < n_early * kHd4; i += kAttnThreads) {
    const int t = i / kHd4, c = i % kHd4;
    cp_async16(v_s + t * HD + c * 4, v_head + static_cast<int64_t>(start + t) * kv_dim + c * 4);
  }
  grid_dependency_wait();
  trace.released();

  // After the wait, data the kernel before wrote (q, K and V row pos) is read through L2 only (__ldcg), all at once.
  if (t0 < len && !own_early) {
    const float4* k4 = reinterpret_cast<const float4*>(k_head + static_cast<int64_t>(start + t0) * kv_dim);
#pragma unroll
    for (int c = 0; c < kHd4; ++c) k_own[c] = __ldcg(k4 + c);
  }
  if (pos - start < n_staged && threadIdx.x < kHd4)  // row pos is staged too (the last row of the last chunk)
    reinterpret_cast<float4*>(v_s + (pos - start) * HD)[threadIdx.x] =
        __ldcg(reinterpret_cast<const float4*>(v_head + static_cast<int64_t>(pos) * kv_dim) + threadIdx.x);
  for (int i = threadIdx.x; i < hpb * HD; i += blockDim.x) q_s[i] = __ldcg(q + static_cast<int64_t>(head0) * HD + i);
  cp_async_wait_all();
  __syncthreads();
  trace.mark(0);

  const float scale = 1.f / sqrtf(static_cast<float>(HD));
  const float4* q4 = reinterpret_cast<const float4*>(q_s);
  for (int t = t0; t < len; t += blockDim.x) {
    if (t != t0) {
      const float4* k4 = reinterpret_cast<const float4*>(k_head + static_cast<int64_t>(start + t) * kv_dim);
#pragma unroll
      for (int c = 0; c < kHd4; ++c) k_own[c] = __ldcg(k4 + c);
    }
    // Two accumulators per head halve the dependent FMA chain (the latency, not the FMA count, is the cost here).
    float acc[kMaxGroup][2];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) acc[g][0] = acc[g][1] = 0.f;
#pragma unroll
    for (int c = 0; c < kHd4; ++c) {
      const float4 k = k_own[c];
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < hpb) {
          const float4 qq = q4[g * kHd4 + c];
          acc[g][c & 1] += qq.x * k.x + qq.y * k.y + qq.z * k.z + qq.w * k.w;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
      if (g < hpb) sc[g * chunk_cap + t] = (acc[g][0] + acc[g][1]) * scale;
  }
  __syncthreads();
  trace.mark(1);

  for (int g = warp; g < hpb; g += kAttnWarps) {
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
      m_s[g] = m;
      l_s[g] = l;
    }
  }
  __syncthreads();
  trace.mark(2);

  // P.V: warp w takes positions w, w + kAttnWarps, ...; lane owns float2 columns lane, lane + 32. Staged rows come
  // from shared memory, the rest (long chunks of a one-split capacity only) from L2.
  float2 o[kMaxGroup][kPairsPerLane];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g)
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) o[g][c] = make_float2(0.f, 0.f);
#pragma unroll 4
  for (int t = warp; t < len; t += kAttnWarps) {
    const bool staged = t < n_staged;
    const float2* v2 = staged ? reinterpret_cast<const float2*>(v_s + t * HD)
                              : reinterpret_cast<const float2*>(v_head + static_cast<int64_t>(start + t) * kv_dim);
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      if (lane + 32 * c < kPairs) {
        const float2 v = staged ? v2[lane + 32 * c] : __ldcg(v2 + lane + 32 * c);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g < hpb) {
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
    for (int c = 0; c < kPairsPerLane; ++c)
      if (g < hpb && lane + 32 * c < kPairs)
        reinterpret_cast<float2*>(part + (warp * hpb + g) * HD)[lane + 32 * c] = o[g][c];
  __syncthreads();
  trace.mark(3);

  if (n_splits == 1) {
    for (int i = threadIdx.x; i < hpb * HD; i += blockDim.x) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) sum += part[w * hpb * HD + i];
      out[static_cast<int64_t>(head0) * HD + i] = sum / l_s[i / HD];
    }
    return;
  }

  // Split: post this chunk's partial; the last block of this head block combines all of them:
  // o = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s.
  for (int i = threadIdx.x; i < hpb * HD; i += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) sum += part[w * hpb * HD + i];
    const int g = i / HD, d = i % HD;
    p.o[(static_cast<int64_t>(head0 + g) * p.max_splits + split) * HD + d] = sum;
  }
  if (threadIdx.x < hpb) {
    float* ml = p.ml + (static_cast<int64_t>(head0 + threadIdx.x) * p.max_splits + split) * 2;
    ml[0] = m_s[threadIdx.x];
    ml[1] = l_s[threadIdx.x];
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(p.counters + head_block, 1u) == static_cast<unsigned>(n_splits) - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < hpb * HD; i += blockDim.x) {
    const int g = i / HD, d = i % HD;
    const int64_t head = head0 + g;
    const float* ml = p.ml + head * p.max_splits * 2;
    float m = -INFINITY;
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, __ldcg(ml + 2 * s));
    float num = 0.f, den = 0.f;
    for (int s = 0; s < n_splits; ++s) {
      const float w = expf(__ldcg(ml + 2 * s) - m);
      den += __ldcg(ml + 2 * s + 1) * w;
      num += __ldcg(p.o + (head * p.max_splits + s) * HD + d) * w;
    }
    out[head * HD + d] = num / den;
  }
  if (threadIdx.x == 0) p.counters[head_block] = 0u;  // re-armed for the next launch
}

// ------------------------------------------------------------------ short-context decode attention
// Up to kAttnSinglePassMax positions (the decode graph's single-pass regime), head_dim 64: one block of
// kShortAttnThreads per query head with every K and V row in shared memory.

constexpr int kShortAttnThreads = 512;
constexpr int kShortAttnHd = 64;                     // the one head_dim it serves
constexpr int kShortAttnKStride = kShortAttnHd + 8;  // padded K rows: the 8 float4 loads of a quarter warp hit 32 banks
constexpr int kShortAttnPvGroups = kShortAttnThreads / kShortAttnHd;  // position groups of the P.V product
static_assert(2 * kAttnSinglePassMax <= kShortAttnThreads, "two threads per position in the score pass");

// Score buffers hold a multiple of 4 floats, so the buffers after them stay 16-byte aligned for float4 access.
__host__ __device__ inline int score_slots(int pos_cap) { return (pos_cap + 3) / 4 * 4; }

// Attention of one query head (head_dim 64) over n_pos <= kAttnSinglePassMax positions whose q, K rows
// (kShortAttnKStride apart) and V rows are all in shared memory; kShortAttnThreads threads. Scores: a thread pair
// per position, each half of the dot product (float4 chunks 2c + half); softmax: one warp; P.V: kShortAttnPvGroups
// position groups x 64 dims, then a fixed-order sum. Returns output element threadIdx.x in threads < 64.
// sc: [n_pos], pv: [kShortAttnPvGroups][64], sum_exp: one shared float. Starts and ends with all threads in step.
__device__ __forceinline__ float attend_head64(const float* q_s, const float* k_s, const float* v_s, int n_pos,
                                               float* sc, float* pv, float* sum_exp) {
  constexpr int HD = kShortAttnHd;
  const int tid = threadIdx.x;
  {
    const int t = tid >> 1, half = tid & 1;
    float acc0 = 0.f, acc1 = 0.f;
    if (t < n_pos) {
      const float4* k4 = reinterpret_cast<const float4*>(k_s + t * kShortAttnKStride);
      const float4* q4 = reinterpret_cast<const float4*>(q_s);
#pragma unroll
      for (int c = 0; c < HD / 8; c += 2) {
        const float4 ka = k4[2 * c + half], qa = q4[2 * c + half];
        const float4 kb = k4[2 * c + 2 + half], qb = q4[2 * c + 2 + half];
        acc0 += qa.x * ka.x + qa.y * ka.y + qa.z * ka.z + qa.w * ka.w;
        acc1 += qb.x * kb.x + qb.y * kb.y + qb.z * kb.z + qb.w * kb.w;
      }
    }
    float acc = acc0 + acc1;
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0 && t < n_pos) sc[t] = acc * (1.f / sqrtf(static_cast<float>(HD)));
  }
  __syncthreads();
  if (tid < 32) {
    float m = -INFINITY;
    for (int t = tid; t < n_pos; t += 32) m = fmaxf(m, sc[t]);
    m = detail::warp_max(m);
    float l = 0.f;
    for (int t = tid; t < n_pos; t += 32) {
      const float e = expf(sc[t] - m);
      sc[t] = e;
      l += e;
    }
    l = detail::warp_sum(l);
    if (tid == 0) *sum_exp = l;
  }
  __syncthreads();
  {
    const int g = tid / HD, e = tid % HD;
    float acc0 = 0.f, acc1 = 0.f;
    int t = g;
    for (; t + kShortAttnPvGroups < n_pos; t += 2 * kShortAttnPvGroups) {
      acc0 += sc[t] * v_s[t * HD + e];
      acc1 += sc[t + kShortAttnPvGroups] * v_s[(t + kShortAttnPvGroups) * HD + e];
    }
    if (t < n_pos) acc0 += sc[t] * v_s[t * HD + e];
    pv[g * HD + e] = acc0 + acc1;
  }
  __syncthreads();
  float o = 0.f;
  if (tid < HD) {
#pragma unroll
    for (int g = 0; g < kShortAttnPvGroups; ++g) o += pv[g * HD + tid];
    o /= *sum_exp;
  }
  return o;
}

// Short-context decode attention, head_dim 64: one block of kShortAttnThreads per query head; the K and V rows of
// earlier steps are copied into shared memory before the programmatic wait, and after it only q and this step's
// K and V rows come from L2 (one round trip). n_pos = io->pos + 1 <= pos_cap <= kAttnSinglePassMax.
__global__ void __launch_bounds__(kShortAttnThreads) attention_decode_short_kernel(const float* q,
                                                                                   const float* k_cache,
                                                                                   const float* v_cache,
                                                                                   const DecodeIO* io, int n_heads,
                                                                                   int n_kv_heads, int pos_cap,
                                                                                   float* __restrict__ out) {
  constexpr int HD = kShortAttnHd;
  KernelTrace trace(kTraceAttention);
  detail::launch_dependents();
  extern __shared__ float4 smem_dyn[];
  float* k_s = reinterpret_cast<float*>(smem_dyn);  // [pos_cap][kShortAttnKStride]
  float* v_s = k_s + pos_cap * kShortAttnKStride;    // [pos_cap][HD]
  float* q_s = v_s + pos_cap * HD;                   // [HD]
  float* sc = q_s + HD;                              // [score_slots(pos_cap)]
  float* pv = sc + score_slots(pos_cap);             // [kShortAttnPvGroups][HD]
  __shared__ float sum_exp;
  const int head = blockIdx.x, kvh = head / (n_heads / n_kv_heads), kv_dim = n_kv_heads * HD;
  const int pos = io->pos, n_pos = pos + 1;  // io was written before this graph launch
  if (n_pos > pos_cap) __trap();
  const int tid = threadIdx.x;
  const float* k_head = k_cache + kvh * HD;
  const float* v_head = v_cache + kvh * HD;
  for (int c = tid; c < pos * (HD / 4); c += kShortAttnThreads) {
    const int t = c / (HD / 4), j = c % (HD / 4);
    cp_async16(k_s + t * kShortAttnKStride + 4 * j, k_head + static_cast<int64_t>(t) * kv_dim + 4 * j);
    cp_async16(v_s + t * HD + 4 * j, v_head + static_cast<int64_t>(t) * kv_dim + 4 * j);
  }
  grid_dependency_wait();
  trace.released();
  if (tid < HD / 4) {
    reinterpret_cast<float4*>(q_s)[tid] = __ldcg(reinterpret_cast<const float4*>(q + head * HD) + tid);
  } else if (tid < HD / 2) {
    const int j = tid - HD / 4;
    reinterpret_cast<float4*>(k_s + pos * kShortAttnKStride)[j] =
        __ldcg(reinterpret_cast<const float4*>(k_head + static_cast<int64_t>(pos) * kv_dim) + j);
  } else if (tid < 3 * HD / 4) {
    const int j = tid - HD / 2;
    reinterpret_cast<float4*>(v_s + pos * HD)[j] =
        __ldcg(reinterpret_cast<const float4*>(v_head + static_cast<int64_t>(pos) * kv_dim) + j);
  }
  cp_async_wait_all();
  __syncthreads();
  trace.mark(0);
  const float o = attend_head64(q_s, k_s, v_s, n_pos, sc, pv, &sum_exp);
  if (tid < HD) out[head * HD + tid] = o;
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

// ------------------------------------------------------------------ launch helpers

namespace {

struct Geometry {
  int tpr, threads, grid;
  size_t smem;
};

// Decode matvecs are latency-bound: after the programmatic wait a block stages x and each lane sums its weight
// blocks, so a whole warp per row (each lane one or two 32-weight blocks at SmolLM2's widths) and 256 threads per
// block (x staged in one batch of loads, eight warps to hide the shared-memory latency of the dot products) make
// the dependent part shortest; the idle lanes of an 18-block row cost nothing that matters here.
constexpr int kMatvecTpr = 32;
Geometry matvec_geometry(const DevMatrix& W, int tpr = kMatvecTpr, int threads = 256) {
  Geometry g;
  g.tpr = tpr;
  g.threads = threads;
  const int rows_per_block = g.threads / g.tpr;
  g.grid = (W.rows + rows_per_block - 1) / rows_per_block;
  g.smem = static_cast<size_t>(W.nb) * kSmemBlockStride * sizeof(float);
  return g;
}

// The lm_head streams 49k+ rows through a few resident blocks (norm_matvec_argmax_kernel): fewer lanes per row
// keep more rows in flight per pass.
Geometry lm_head_geometry(const DevMatrix& W) {
  Geometry g;
  g.tpr = W.nb <= 32 ? 8 : W.nb <= 64 ? 16 : 32;
  g.threads = 256;
  g.grid = 0;  // chosen from occupancy at launch
  g.smem = static_cast<size_t>(W.nb) * kSmemBlockStride * sizeof(float);
  return g;
}

// The one switch from a weight type to a kernel instantiation: Family::get<T>() names the kernel for type T.
template <typename Family>
typename Family::Fn kernel_for(GgmlType t) {
  if (t == kWide8) return Family::template get<kWide8>();
  switch (t) {
    case GgmlType::Q4_0: return Family::template get<GgmlType::Q4_0>();
    case GgmlType::Q4_1: return Family::template get<GgmlType::Q4_1>();
    case GgmlType::Q8_0: return Family::template get<GgmlType::Q8_0>();
    case GgmlType::Q5_0: return Family::template get<GgmlType::Q5_0>();
    case GgmlType::Q5_1: return Family::template get<GgmlType::Q5_1>();
    case GgmlType::Q4_K: return Family::template get<GgmlType::Q4_K>();
    case GgmlType::Q5_K: return Family::template get<GgmlType::Q5_K>();
    case GgmlType::Q6_K: return Family::template get<GgmlType::Q6_K>();
    case GgmlType::F16: return Family::template get<GgmlType::F16>();
    case GgmlType::BF16: return Family::template get<GgmlType::BF16>();
    case GgmlType::F32: return Family::template get<GgmlType::F32>();
    default: break;
  }
  throw EngineError(std::string("matvec: unsupported weight type ") + gpu_type_name(t));
}

template <bool PRE, int TPR>
struct NormKernels {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, NormMatvecArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_kernel<typename BlkSel<T>::type, TPR, PRE>; }
};
struct NormKernels5 {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, NormMatvecArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_kernel_5<typename BlkSel<T>::type>; }
};
// U: weight blocks per lane loaded before the wait, at least the type's own kUnroll.
template <int TPR, int U = 0>
struct ResidualKernels {
  using Fn = void (*)(DevMatrix, const float*, float*);
  template <GgmlType T>
  static Fn get() {
    using B = typename BlkSel<T>::type;
    return matvec_residual_kernel<B, TPR, (U > B::kUnroll ? U : B::kUnroll)>;
  }
};
template <int TPR>
struct ArgmaxKernels {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, ArgmaxArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_argmax_kernel<typename BlkSel<T>::type, TPR>; }
};

template <typename K>
K pick(int tpr, K k8, K k16, K k32) {
  return tpr == 8 ? k8 : tpr == 16 ? k16 : k32;
}

template <typename K>
void allow_smem(K kernel, size_t smem) {
  detail::allow_dynamic_smem(kernel, smem);
}

template <int TPR>
typename NormKernels<false, TPR>::Fn norm_kernel(const DevMatrix& W, bool pre) {
  return pre ? kernel_for<NormKernels<true, TPR>>(W.type) : kernel_for<NormKernels<false, TPR>>(W.type);
}

// Rows that one wave of resident blocks of kernel k covers.
template <typename K>
int64_t rows_per_wave(K k, const Geometry& g) {
  int device = 0, n_sms = 0, per_sm = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  allow_smem(k, g.smem);
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, g.threads, g.smem));
  return static_cast<int64_t>(std::max(per_sm, 1)) * n_sms * (g.threads / g.tpr);
}

void run_norm_matvec(const DevMatrix& W, const float* x, const float* norm_w, float eps, const NormMatvecArgs& a,
                     cudaStream_t s) {
  // A whole warp per row keeps the part after the wait shortest (each lane one or two weight blocks), as long as
  // the rows fit about one wave of resident blocks: a later wave pays the launch, the wait, the staging and the
  // reduction again with HBM idle. Larger matrices take half a warp per row, or a quarter, in 256-thread blocks.
  // H100, us per token (NOTES, "CUDA, session 13"): Qwen2.5-0.5B's gate/up (9,728 rows, 2.3 waves at 32 lanes)
  // 612 -> 528 at 16 lanes (1.15 waves; 8 lanes, 0.6 waves but four blocks a lane, 578); SmolLM2-1.7B's gate/up
  // (16,384 rows) 1,003 -> 873 at 8 lanes (0.97 waves; 16 lanes, 1.9 waves, 907) and its QKV (6,144 rows, 1.45
  // waves) -> 16 lanes +3%; the one-wave gate/up of Gemma 3 270M and SmolLM2-135M lose 4-20% at fewer lanes.
  // SiluGlu at 32 lanes in 512 threads (16 rows per block): the gate/up matrix's 3072 rows as 192 blocks instead of
  // 384, each staging and normalizing x once for twice the rows. Measured in the decode chain (H100): 402 -> 390 us
  // per token; QKV at 512 threads was slower (391 -> 398) and O even, so they keep 256 (NOTES, "Fifth session").
  const bool pre = a.pre.y != nullptr;
  constexpr double kWaveSlack = 1.25;  // a last wave of a quarter of the SMs' blocks costs less than fewer lanes
  Geometry g = matvec_geometry(W, kMatvecTpr, a.mode == NormOut::SiluGlu ? 512 : 256);
  auto k = norm_kernel<kMatvecTpr>(W, pre);
  if (W.rows > kWaveSlack * static_cast<double>(rows_per_wave(k, g))) {
    g = matvec_geometry(W, 16, 256);
    k = norm_kernel<16>(W, pre);
    const int64_t wave16 = rows_per_wave(k, g);
    // Past one wave of the 64-register kernel (4 blocks a SM), the 48-register instantiation (5 a SM, 2 blocks a
    // lane before the wait) may still hold every row in one wave: Qwen2.5-0.5B's gate/up, 9,728 rows in 608 blocks
    // against 528 resident. H100, Qwen2.5-0.5B shape: 510 -> 482 us per token, the gate/up's share of the chain
    // 6.9 -> 5.4 us a layer (NOTES, "CUDA, session 14").
    // (Quantized types only: the float blocks spill 150-300 bytes in 48 registers.)
    const bool quantized = W.type != GgmlType::F32 && W.type != GgmlType::F16 && W.type != GgmlType::BF16;
    const auto k5 = pre || !quantized ? k : kernel_for<NormKernels5>(W.type);
    if (k5 != k && W.rows > wave16 && W.rows <= rows_per_wave(k5, g)) {
      k = k5;
    } else if (W.rows > kWaveSlack * static_cast<double>(wave16)) {
      g = matvec_geometry(W, 8, 256);
      k = norm_kernel<8>(W, pre);
    }
  }
  allow_smem(k, g.smem);
  launch(k, dim3(g.grid), dim3(g.threads), g.smem, s, W, x, norm_w, eps, a);
}


// The lm_head kernel's row groups (rows_per_pass rows each); its grid is at most this many blocks.
constexpr int kArgmaxThreads = 256;
int argmax_row_groups(const DevMatrix& W) {
  const int rows_per_pass = kArgmaxThreads / lm_head_geometry(W).tpr;
  return (W.rows + rows_per_pass - 1) / rows_per_pass;
}

}  // namespace

int argmax_partials_needed(const DevMatrix& lm_head) {
  const int g = argmax_row_groups(lm_head);
  return g > kArgmaxMaxBlocks ? g : kArgmaxMaxBlocks;
}

void launch_embed(const DevMatrix& emb, const DecodeIO* io, float* x, cudaStream_t s) {
  launch(embed_kernel, dim3(1), dim3(256), 0, s, emb, io, static_cast<const int32_t*>(nullptr), x);
}

void launch_embed_rows(const DevMatrix& emb, const int32_t* tokens, int n, float* x, cudaStream_t s) {
  embed_kernel<<<n, 256, 0, s>>>(emb, nullptr, tokens, x);
  CUDA_CHECK_LAUNCH();
}

static void check_pre_add(const PreAdd& pre, const float* x) {
  if (pre.y != nullptr && (pre.w == nullptr || pre.x_next == nullptr || pre.x_next == x))
    throw EngineError("norm matvec: a folded residual add needs its norm weights and a separate output buffer");
}

void launch_norm_matvec(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* y,
                        cudaStream_t s, const PreAdd& pre) {
  check_pre_add(pre, x);
  NormMatvecArgs a;
  a.mode = NormOut::Plain;
  a.y = y;
  a.pre = pre;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_norm_matvec_silu_glu(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* act,
                                 cudaStream_t s, Activation act_fn, const PreAdd& pre) {
  // Every block takes units_per_block units of each half, so a grid of rows / rows-per-block blocks
  // covers exactly the units when the halves are equal.
  if (W.rows % 2 != 0) throw EngineError("gate/up matvec: the stacked matrix needs two equal halves");
  check_pre_add(pre, x);
  NormMatvecArgs a;
  a.mode = NormOut::SiluGlu;
  a.gelu = act_fn == Activation::GeluTanh;
  a.pre = pre;
  a.y = act;
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

void launch_embed_norm_matvec_qkv(const DevMatrix& emb, float* x, const DevMatrix& W, const float* norm_w, float eps,
                                  const QkvTargets& t, cudaStream_t s) {
  if (W.rows != t.q_dim + 2 * t.kv_dim || t.head_dim % 2 != 0) throw EngineError("qkv matvec: bad geometry");
  if (emb.cols != W.cols || norm_w == nullptr) throw EngineError("embedding + qkv matvec: bad geometry");
  NormMatvecArgs a;
  a.mode = NormOut::Qkv;
  a.qkv = t;
  a.embed = emb;
  a.x_out = x;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_norm_matvec_argmax(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* logits,
                               const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                               cudaStream_t s) {
  const Geometry g = lm_head_geometry(W);
  const auto k = pick(g.tpr, kernel_for<ArgmaxKernels<8>>(W.type), kernel_for<ArgmaxKernels<16>>(W.type),
                      kernel_for<ArgmaxKernels<32>>(W.type));
  allow_smem(k, g.smem);
  // As many blocks as fit on the GPU at once, spread so that every block takes the same number of row groups.
  int device = 0, n_sms = 0, per_sm = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kArgmaxThreads, g.smem));
  const int groups = argmax_row_groups(W);
  const int resident = std::max(1, per_sm * n_sms);
  const int passes = (groups + resident - 1) / resident;
  const int grid = (groups + passes - 1) / passes;
  if (grid > scratch.capacity) throw EngineError("argmax scratch too small");
  ArgmaxArgs a;
  // Prefetching the whole matrix to L2 pays only where it fits there with room to spare (SmolLM2's Q8_0 lm_head is
  // 28 MB of the H100's 50 MB); a larger one would evict its own lines and the KV cache.
  int l2_bytes = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const size_t matrix_bytes =
      static_cast<size_t>(W.rows) * W.nb * gpu_block_bytes(W.type);
  a.prefetch_l2 = matrix_bytes <= static_cast<size_t>(l2_bytes) * 3 / 5;
  a.logits = logits;
  a.am = scratch;
  a.result = result;
  a.io_next = io_next;
  launch(k, dim3(grid), dim3(kArgmaxThreads), g.smem, s, W, x, norm_w, eps, a);
}

void launch_matvec_residual(const DevMatrix& W, const float* x, float* residual, cudaStream_t s) {
  // More weight blocks per row than a warp has lanes: two warps per row (see the kernel). Rows of more than two
  // blocks a lane (Qwen2.5-0.5B's down projection: 152 blocks over 64 lanes) load three a lane before the wait;
  // with two, the third came from HBM after the activations (H100, Qwen2.5-0.5B shape: 513 -> 503 us per token;
  // NOTES, "CUDA, session 14").
  const bool wide = W.nb > kMatvecTpr, deep = W.nb > 2 * 2 * kMatvecTpr;
  const Geometry g = wide ? matvec_geometry(W, 2 * kMatvecTpr, 512) : matvec_geometry(W);
  const auto k = deep   ? kernel_for<ResidualKernels<2 * kMatvecTpr, 3>>(W.type)
                 : wide ? kernel_for<ResidualKernels<2 * kMatvecTpr>>(W.type)
                        : kernel_for<ResidualKernels<kMatvecTpr>>(W.type);
  allow_smem(k, g.smem);
  launch(k, dim3(g.grid), dim3(g.threads), g.smem, s, W, x, residual);
}

void launch_attention_decode(const float* q, const float* k_cache, const float* v_cache, const DecodeIO* io,
                             int n_heads, int n_kv_heads, int head_dim, int n_ctx, const AttnScratch& p, float* out,
                             cudaStream_t s, int heads_per_block) {
  const int group = n_heads / n_kv_heads;
  if (group > kMaxGroup || group * n_kv_heads != n_heads) throw EngineError("attention: unsupported head grouping");
  if (p.max_splits < 1 || p.max_splits > kMaxAttnSplits) throw EngineError("attention: bad split capacity");
  if (heads_per_block == 0) heads_per_block = kAttnDefaultHeadsPerBlock;
  if (heads_per_block < 1 || group % heads_per_block != 0)
    throw EngineError("attention: heads per block must divide the query heads per KV head");
  using AttnKernel = void (*)(const float*, const float*, const float*, const DecodeIO*, int, int, int, int, int,
                              AttnScratch, float*);
  AttnKernel k = head_dim == 32    ? attention_decode_kernel<32>
                 : head_dim == 64  ? attention_decode_kernel<64>
                 : head_dim == 96  ? attention_decode_kernel<96>
                 : head_dim == 128 ? attention_decode_kernel<128>
                                   : nullptr;
  if (k == nullptr) throw EngineError("decode attention needs head_dim 32, 64, 96 or 128");
  const int chunk_cap = attn_chunk_cap(n_ctx, p.max_splits);
  // V rows staged in shared memory: the whole chunk when it fits (every chunk of a split context does), else as many
  // leading rows as the opt-in limit leaves room for after the other buffers.
  int dev = 0, smem_optin = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const size_t fixed = attention_smem_bytes(heads_per_block, head_dim, chunk_cap, 0);
  const size_t static_smem = 1024;  // m_s, l_s, is_last and slack
  if (fixed + static_smem > static_cast<size_t>(smem_optin))
    throw EngineError("attention: context too long for shared memory");
  const size_t room_rows = (static_cast<size_t>(smem_optin) - fixed - static_smem) / (head_dim * sizeof(float));
  const int stage_rows = static_cast<int>(std::min<size_t>(room_rows, std::min(chunk_cap, kAttnSinglePassMax)));
  const size_t smem = attention_smem_bytes(heads_per_block, head_dim, chunk_cap, stage_rows);
  allow_smem(k, smem);
  launch(k, dim3(n_heads / heads_per_block, p.max_splits), dim3(kAttnThreads), smem, s, q, k_cache, v_cache, io,
         n_heads, n_kv_heads, heads_per_block, chunk_cap, stage_rows, p, out);
}

void launch_attention_decode_short(const float* q, const float* k_cache, const float* v_cache, const DecodeIO* io,
                                   int n_heads, int n_kv_heads, int head_dim, int pos_cap, float* out,
                                   cudaStream_t s) {
  if (head_dim != kShortAttnHd) throw EngineError("short decode attention needs head_dim 64");
  if (n_kv_heads < 1 || n_heads % n_kv_heads != 0) throw EngineError("attention: unsupported head grouping");
  if (pos_cap < 1 || pos_cap > kAttnSinglePassMax) throw EngineError("short decode attention: bad capacity");
  const size_t smem = (static_cast<size_t>(pos_cap) * (kShortAttnKStride + kShortAttnHd) + score_slots(pos_cap) +
                       kShortAttnHd + kShortAttnPvGroups * kShortAttnHd) * sizeof(float);
  allow_smem(attention_decode_short_kernel, smem);
  launch(attention_decode_short_kernel, dim3(n_heads), dim3(kShortAttnThreads), smem, s, q, k_cache, v_cache, io,
         n_heads, n_kv_heads, pos_cap, out);
}

void launch_argmax(const float* x, int n, const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                   cudaStream_t s) {
  int blocks = (n + 1023) / 1024;
  blocks = std::max(1, std::min(blocks, std::min(scratch.capacity, kArgmaxMaxBlocks)));
  launch(argmax_kernel, dim3(blocks), dim3(256), 0, s, x, n, scratch, result, io_next);
}

}  // namespace metalattn::cuda
