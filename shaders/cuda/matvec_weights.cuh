// The decode matvecs' weight blocks: Blk<T> holds one 32-weight block of type T as one lane loads it (16-byte
// loads) and dots it with 32 staged activations; BlkSel maps a GGUF type to its block. The bit layouts are GGUF's
// (metalattn/quant.h); the GPU layouts they are packed into are DevMatrix's (kernels.cuh). Included by matvec.cu and
// lm_head.cu; each type's reference is the scalar CPU dequantizer (cpu/reference.h), and CudaMatvec / CudaQuant test
// them.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels.cuh"

namespace metalattn::cuda {

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

// Two rows a lane group, a and b, whose dots share every x block read from shared memory (the gate and up rows of
// one GLU unit). Row b is valid wherever row a is. Returns both rows' dot products in every lane of the group.
template <typename B, int TPR, int UN = B::kUnroll>
struct RowDotPair {
  static constexpr int U = UN;
  B first[U], second[U];

  __device__ __forceinline__ void prefetch(const DevMatrix& W, int row_a, int row_b, int sub) {
    if (row_a >= W.rows) return;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = sub + u * TPR;
      if (b < W.nb) {
        first[u].load(W, static_cast<int64_t>(row_a) * W.nb + b);
        second[u].load(W, static_cast<int64_t>(row_b) * W.nb + b);
      }
    }
  }

  __device__ __forceinline__ float2 finish(const DevMatrix& W, int row_a, int row_b, int sub, const float* x_s) {
    float acc_a = 0.f, acc_b = 0.f;
    if (row_a < W.rows) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int b = sub + u * TPR;
        if (b < W.nb) {
          const float* xb = x_s + b * kSmemBlockStride;
          acc_a += first[u].dot(xb);
          acc_b += second[u].dot(xb);
        }
      }
      for (int b0 = sub + U * TPR; b0 < W.nb; b0 += U * TPR) {
        B blk_a[U], blk_b[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (b0 + u * TPR < W.nb) {
            blk_a[u].load(W, static_cast<int64_t>(row_a) * W.nb + b0 + u * TPR);
            blk_b[u].load(W, static_cast<int64_t>(row_b) * W.nb + b0 + u * TPR);
          }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (b0 + u * TPR < W.nb) {
            const float* xb = x_s + (b0 + u * TPR) * kSmemBlockStride;
            acc_a += blk_a[u].dot(xb);
            acc_b += blk_b[u].dot(xb);
          }
      }
    }
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) {
      acc_a += __shfl_xor_sync(0xffffffffu, acc_a, o);
      acc_b += __shfl_xor_sync(0xffffffffu, acc_b, o);
    }
    return make_float2(acc_a, acc_b);
  }
};

constexpr int kStageVec = 4;  // 16-byte activation loads each thread of matvec_residual_kernel issues before using any

__device__ __forceinline__ int smem_index(int i) { return (i >> 5) * kSmemBlockStride + (i & 31); }

}  // namespace metalattn::cuda
