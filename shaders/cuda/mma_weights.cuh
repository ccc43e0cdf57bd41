// The weight side of the tensor-core projections (prompt_mma.cu: few-token prompts; prompt_gemm.cu: long prompts):
// per weight type, how the two rows a thread feeds an mma.sync m16n8k16 (tile rows g and g + 8, g = lane / 4) are
// loaded for one 32-weight block of the GPU layout (kernels.cuh, DevMatrix) and turned into A fragments, exactly.
//
// Fragment map (c = lane % 4): of the 16 k-slots of one MMA step, thread c's slots 2c, 2c+1 carry elements 4c, 4c+1 of
// the step's 16 and slots 2c+8, 2c+9 elements 4c+2, 4c+3 (a dot product does not care about the order, so the quants
// are used in their stored order). Step 0 of a block covers elements 0..15 (for Q4: the low nibbles of payload word
// c), step 1 elements 16..31 (the high nibbles). The activations' B fragments follow the same map: thread (g, c) of a
// step gives token g's elements 16 step + 4c .. +3.
//
// Every WB type has: load(W, blocks[2], c) (the two rows' block indices row * W.nb + blk, -1 for a row past the
// matrix: zeros); a_regs(step, a[4]) (the integer quants as fp16, exact); scale(i, step)
// and min(i, step) applied in fp32 after the block's MMAs (kStepScales: after each step's); kHasMin (the min times the
// block's activation sum); kWeightLo: float weights travel as fp16 hi + lo, a_regs_lo(step, a) the lo part.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels.cuh"

namespace metalattn::cuda::mma {

// Weight blocks per warp the few-token kernel loads before its programmatic wait (d_ff 1536 / 8 warps / 32); the
// long-prompt GEMM keeps a chunk of blocks in flight instead and ignores kPrefetch.
constexpr int kMmaPrefetch = 6;
// kAhead: how many blocks ahead of their MMAs the few-token kernel loads the blocks past those (where its loop holds
// no per-lane norm state): two where the kernel's instantiations still fit 128 registers, one where two spilled
// (ptxas, session 30: Q5_K, Q6_K, Q8_0). H200: two ahead was -1.1% on SmolLM2-1.7B's first token, -0.6% on Qwen2.5's.

// The two rows a thread feeds the MMA (tile rows g and g + 8), one block: payload words and scales.
template <GgmlType T>
struct WBlock;

// Q4: word c of the 16-byte payload holds elements 4c..4c+3 (low nibbles) and 16+4c..16+4c+3 (high nibbles).
// Returns the A registers of step `step` for one row: {elements 4c,4c+1 ; 4c+2,4c+3} as half2 of (q - bias).
__device__ __forceinline__ void q4_pairs(uint32_t w, int step, uint32_t bias_h2, uint32_t& p01, uint32_t& p23) {
  const uint32_t t01 = __byte_perm(w, 0u, 0x4140), t23 = __byte_perm(w, 0u, 0x4342);  // bytes -> 16-bit lanes
  const int sh = 4 * step;
  const uint32_t h01 = ((t01 >> sh) & 0x000F000Fu) | 0x64006400u;  // fp16 1024 + q
  const uint32_t h23 = ((t23 >> sh) & 0x000F000Fu) | 0x64006400u;
  const __half2 b = *reinterpret_cast<const __half2*>(&bias_h2);
  const __half2 r01 = __hsub2(*reinterpret_cast<const __half2*>(&h01), b);
  const __half2 r23 = __hsub2(*reinterpret_cast<const __half2*>(&h23), b);
  p01 = *reinterpret_cast<const uint32_t*>(&r01);
  p23 = *reinterpret_cast<const uint32_t*>(&r23);
}

// Q8: word w holds 4 signed bytes; (b ^ 0x80) | 0x6400 is fp16 1024 + b + 128.
__device__ __forceinline__ void q8_pairs(uint32_t w, uint32_t& p01, uint32_t& p23) {
  const uint32_t u = w ^ 0x80808080u;
  const uint32_t h01 = __byte_perm(u, 0x64646464u, 0x4140), h23 = __byte_perm(u, 0x64646464u, 0x4342);
  const __half2 b = __float2half2_rn(1152.f);
  const __half2 r01 = __hsub2(*reinterpret_cast<const __half2*>(&h01), b);
  const __half2 r23 = __hsub2(*reinterpret_cast<const __half2*>(&h23), b);
  p01 = *reinterpret_cast<const uint32_t*>(&r01);
  p23 = *reinterpret_cast<const uint32_t*>(&r23);
}

constexpr uint32_t kHalf1032x2 = 0x64086408u;  // fp16 1032 = 1024 + 8 (Q4_0's offset)
constexpr uint32_t kHalf1024x2 = 0x64006400u;

template <>
struct WBlock<GgmlType::Q4_0> {
  static constexpr int kPrefetch = kMmaPrefetch;
  static constexpr int kAhead = 2;
  static constexpr bool kStepScales = false;
  static constexpr bool kHasMin = false;
  static constexpr bool kWeightLo = false;
  uint32_t w[2];
  uint16_t d[2];
  __device__ __forceinline__ void load(const DevMatrix& W, const int64_t blocks[2], int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t b = blocks[i];
      w[i] = b >= 0 ? __ldg(reinterpret_cast<const uint32_t*>(W.payload) + b * 4 + c) : 0u;
      d[i] = b >= 0 ? __ldg(W.scales + b) : 0;
    }
  }
  __device__ __forceinline__ void a_regs(int step, uint32_t a[4]) const {
    q4_pairs(w[0], step, kHalf1032x2, a[0], a[2]);
    q4_pairs(w[1], step, kHalf1032x2, a[1], a[3]);
  }
  __device__ __forceinline__ float scale(int i, int) const { return __half2float(__ushort_as_half(d[i])); }
  __device__ __forceinline__ float min(int, int) const { return 0.f; }
};

template <>
struct WBlock<GgmlType::Q4_1> {
  static constexpr int kPrefetch = kMmaPrefetch;
  static constexpr int kAhead = 2;
  static constexpr bool kStepScales = false;
  static constexpr bool kHasMin = true;
  static constexpr bool kWeightLo = false;
  uint32_t w[2];
  uint32_t dm[2];  // fp16 d (low half), m (high half)
  __device__ __forceinline__ void load(const DevMatrix& W, const int64_t blocks[2], int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t b = blocks[i];
      w[i] = b >= 0 ? __ldg(reinterpret_cast<const uint32_t*>(W.payload) + b * 4 + c) : 0u;
      dm[i] = b >= 0 ? __ldg(reinterpret_cast<const unsigned int*>(W.scales) + b) : 0u;
    }
  }
  __device__ __forceinline__ void a_regs(int step, uint32_t a[4]) const {
    q4_pairs(w[0], step, kHalf1024x2, a[0], a[2]);
    q4_pairs(w[1], step, kHalf1024x2, a[1], a[3]);
  }
  __device__ __forceinline__ float scale(int i, int) const {
    return __half2float(__ushort_as_half(static_cast<uint16_t>(dm[i] & 0xffffu)));
  }
  __device__ __forceinline__ float min(int i, int) const {
    return __half2float(__ushort_as_half(static_cast<uint16_t>(dm[i] >> 16)));
  }
};

template <>
struct WBlock<GgmlType::Q8_0> {
  static constexpr int kPrefetch = kMmaPrefetch;
  static constexpr int kAhead = 1;
  static constexpr bool kStepScales = false;
  static constexpr bool kHasMin = false;
  static constexpr bool kWeightLo = false;
  uint32_t w[2][2];  // [row][step]: word 4 * step + c of the 32-byte payload
  uint16_t d[2];
  __device__ __forceinline__ void load(const DevMatrix& W, const int64_t blocks[2], int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t b = blocks[i];
      const uint32_t* p = reinterpret_cast<const uint32_t*>(W.payload) + b * 8 + c;
      w[i][0] = b >= 0 ? __ldg(p) : 0u;
      w[i][1] = b >= 0 ? __ldg(p + 4) : 0u;
      d[i] = b >= 0 ? __ldg(W.scales + b) : 0;
    }
  }
  __device__ __forceinline__ void a_regs(int step, uint32_t a[4]) const {
    q8_pairs(w[0][step], a[0], a[2]);
    q8_pairs(w[1][step], a[1], a[3]);
  }
  __device__ __forceinline__ float scale(int i, int) const { return __half2float(__ushort_as_half(d[i])); }
  __device__ __forceinline__ float min(int, int) const { return 0.f; }
};

// ---- the types of Q4_K_M files (DevMatrix in kernels.cuh has their layouts). The quants enter the MMA exactly as
// fp16 integers (at most 6 bits), the fp32 scales (and mins) after the block's (or, per-16 scales, the step's) MMAs.

// Four unsigned byte values (< 256) as two half2 of (value - bias): {bytes 0, 1} and {bytes 2, 3}.
__device__ __forceinline__ void byte_pairs(uint32_t bytes, uint32_t bias_h2, uint32_t& p01, uint32_t& p23) {
  const uint32_t h01 = __byte_perm(bytes, 0x64646464u, 0x4140), h23 = __byte_perm(bytes, 0x64646464u, 0x4342);
  const __half2 b = *reinterpret_cast<const __half2*>(&bias_h2);
  const __half2 r01 = __hsub2(*reinterpret_cast<const __half2*>(&h01), b);
  const __half2 r23 = __hsub2(*reinterpret_cast<const __half2*>(&h23), b);
  p01 = *reinterpret_cast<const uint32_t*>(&r01);
  p23 = *reinterpret_cast<const uint32_t*>(&r23);
}
constexpr uint32_t kHalf1040x2 = 0x64106410u;  // fp16 1040 = 1024 + 16 (Q5_0's offset)
constexpr uint32_t kHalf1056x2 = 0x64206420u;  // fp16 1056 = 1024 + 32 (Q6_K's offset)

// Q5_0 / Q5_1 / Q4_K / Q5_K: a nibble payload word (elements 4c..4c+3: low nibbles, step 0; high nibbles, step 1),
// with a Q5 aux word shifted right by c (kernels.cuh, q5_aux_bit: its bits for this word's bytes at bit 8k, step 1's
// four higher). Q5_0's stored bits are inverted.
template <GgmlType T>
struct WBlockQ5K {
  static constexpr bool kFive = T != GgmlType::Q4_K;
  static constexpr bool kHasMin = T != GgmlType::Q5_0;
  static constexpr bool kWeightLo = false;
  static constexpr int kPrefetch = kMmaPrefetch;
  static constexpr int kAhead = T == GgmlType::Q5_K ? 1 : 2;
  static constexpr bool kStepScales = false;
  uint32_t w[2], h[2];
  float2 sm[2];  // scale, min: fp16 d (and m) widened, or the K-quants' mma_scales
  __device__ __forceinline__ void load(const DevMatrix& W, const int64_t blocks[2], int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t b = blocks[i];
      const bool ok = b >= 0;
      w[i] = ok ? __ldg(reinterpret_cast<const uint32_t*>(W.payload) + b * 4 + c) : 0u;
      h[i] = kFive && ok ? __ldg(W.aux + b) >> c : 0u;
      if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K) {
        sm[i] = ok ? __ldg(W.mma_scales + b) : make_float2(0.f, 0.f);
      } else if constexpr (T == GgmlType::Q5_1) {
        const uint32_t dm = ok ? __ldg(reinterpret_cast<const unsigned int*>(W.scales) + b) : 0u;
        sm[i] = make_float2(__half2float(__ushort_as_half(static_cast<uint16_t>(dm & 0xffffu))),
                            __half2float(__ushort_as_half(static_cast<uint16_t>(dm >> 16))));
      } else {
        sm[i] = make_float2(ok ? __half2float(__ushort_as_half(__ldg(W.scales + b))) : 0.f, 0.f);
      }
    }
  }
  __device__ __forceinline__ void a_regs(int step, uint32_t a[4]) const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint32_t bytes = (w[i] >> (4 * step)) & 0x0f0f0f0fu;
      if constexpr (T == GgmlType::Q5_0) bytes |= (~(h[i] >> (4 * step)) & 0x01010101u) << 4;
      else if constexpr (kFive) bytes |= ((h[i] >> (4 * step)) & 0x01010101u) << 4;
      byte_pairs(bytes, T == GgmlType::Q5_0 ? kHalf1040x2 : kHalf1024x2, a[i], a[i + 2]);
    }
  }
  __device__ __forceinline__ float scale(int i, int) const { return sm[i].x; }
  __device__ __forceinline__ float min(int i, int) const { return sm[i].y; }
};
template <>
struct WBlock<GgmlType::Q5_0> : WBlockQ5K<GgmlType::Q5_0> {};
template <>
struct WBlock<GgmlType::Q5_1> : WBlockQ5K<GgmlType::Q5_1> {};
template <>
struct WBlock<GgmlType::Q4_K> : WBlockQ5K<GgmlType::Q4_K> {};
template <>
struct WBlock<GgmlType::Q5_K> : WBlockQ5K<GgmlType::Q5_K> {};

// Q6_K: nibble payload word c plus the block's two aux words (high bits xor 2 of elements 0..15 and 16..31, two per
// byte: kernels.cuh q6_aux_bit) shifted right by 2c; a scale per step (16 elements).
template <>
struct WBlock<GgmlType::Q6_K> {
  static constexpr int kPrefetch = 4;
  static constexpr int kAhead = 1;
  static constexpr bool kStepScales = true;
  static constexpr bool kHasMin = false;
  static constexpr bool kWeightLo = false;
  uint32_t w[2], h[2][2];
  float2 sc[2];  // d * sc of elements 0..15, 16..31
  __device__ __forceinline__ void load(const DevMatrix& W, const int64_t blocks[2], int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t b = blocks[i];
      const bool ok = b >= 0;
      w[i] = ok ? __ldg(reinterpret_cast<const uint32_t*>(W.payload) + b * 4 + c) : 0u;
      const uint2 hh = ok ? __ldg(reinterpret_cast<const uint2*>(W.aux) + b) : make_uint2(0u, 0u);
      h[i][0] = hh.x >> (2 * c);
      h[i][1] = hh.y >> (2 * c);
      sc[i] = ok ? __ldg(W.mma_scales + b) : make_float2(0.f, 0.f);
    }
  }
  __device__ __forceinline__ void a_regs(int step, uint32_t a[4]) const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t hi2 = (h[i][step] & 0x03030303u) ^ 0x02020202u;  // the stored bits back to q6 >> 4
      byte_pairs(((w[i] >> (4 * step)) & 0x0f0f0f0fu) | (hi2 << 4), kHalf1056x2, a[i], a[i + 2]);
    }
  }
  __device__ __forceinline__ float scale(int i, int step) const { return step == 0 ? sc[i].x : sc[i].y; }
  __device__ __forceinline__ float min(int, int) const { return 0.f; }
};

// kWide8 (a plain struct, not WBlock<kWide8>: nvcc's host stubs cannot spell a non-enumerator kernel argument):
// int8 words c and 4 + c as Q8_0, fp32 scale and min per step.
struct WBlockWide8 {
  static constexpr int kPrefetch = 3;
  static constexpr int kAhead = 1;
  static constexpr bool kStepScales = true;
  static constexpr bool kHasMin = true;
  static constexpr bool kWeightLo = false;
  uint32_t w[2][2];
  uint4 sm[2];  // s0, s1, m0, m1 (float bits)
  __device__ __forceinline__ void load(const DevMatrix& W, const int64_t blocks[2], int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t b = blocks[i];
      const bool ok = b >= 0;
      const uint32_t* p = reinterpret_cast<const uint32_t*>(W.payload) + b * 8 + c;
      w[i][0] = ok ? __ldg(p) : 0u;
      w[i][1] = ok ? __ldg(p + 4) : 0u;
      sm[i] = ok ? __ldg(reinterpret_cast<const uint4*>(W.aux) + b) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  __device__ __forceinline__ void a_regs(int step, uint32_t a[4]) const {
    q8_pairs(w[0][step], a[0], a[2]);
    q8_pairs(w[1][step], a[1], a[3]);
  }
  __device__ __forceinline__ float scale(int i, int step) const { return __uint_as_float(step == 0 ? sm[i].x : sm[i].y); }
  __device__ __forceinline__ float min(int i, int step) const { return -__uint_as_float(step == 0 ? sm[i].z : sm[i].w); }
};

__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// ---- float weights (F16, BF16, F32 rows, zero-padded to whole blocks): the values of elements 4c..4c+3 of each step.
// F16 enters the MMA exactly; BF16 and F32 as fp16 hi + lo (hi = fp16(w), lo = fp16(w - hi)), a third MMA with the
// activations' hi: ~22 bits of each weight, as the activations.
template <GgmlType T>
struct WBlockFloat {  // long-prompt kernel only (the few-token kernels take no float weights), so no kPrefetch
  static constexpr bool kStepScales = false;
  static constexpr bool kHasMin = false;
  static constexpr bool kWeightLo = T != GgmlType::F16;
  // [row][step]: elements 16 step + 4c .. +3 as four fp32 bit patterns (F32, BF16 widened) or two half2 (F16: .x, .y)
  uint4 bits[2][2];
  __device__ __forceinline__ void load(const DevMatrix& W, const int64_t blocks[2], int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t b = blocks[i];
      const bool ok = b >= 0;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int q = 4 * s + c;  // this lane's quad of the block
        if constexpr (T == GgmlType::F32) {
          bits[i][s] = ok ? __ldg(reinterpret_cast<const uint4*>(W.payload) + b * 8 + q) : make_uint4(0u, 0u, 0u, 0u);
        } else {
          const uint2 u = ok ? __ldg(reinterpret_cast<const uint2*>(W.payload) + b * 8 + q) : make_uint2(0u, 0u);
          if constexpr (T == GgmlType::F16) bits[i][s] = make_uint4(u.x, u.y, 0u, 0u);
          else bits[i][s] = make_uint4(u.x << 16, u.x & 0xffff0000u, u.y << 16, u.y & 0xffff0000u);  // bf16 -> fp32
        }
      }
    }
  }
  __device__ __forceinline__ float4 values(int i, int step) const {
    const uint4 u = bits[i][step];
    return make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
  }
  __device__ __forceinline__ void a_regs(int step, uint32_t a[4]) const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if constexpr (T == GgmlType::F16) {
        a[i] = bits[i][step].x;
        a[i + 2] = bits[i][step].y;
      } else {
        const float4 f = values(i, step);
        a[i] = pack_half2(f.x, f.y);
        a[i + 2] = pack_half2(f.z, f.w);
      }
    }
  }
  __device__ __forceinline__ void a_regs_lo(int step, uint32_t a[4]) const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float4 f = values(i, step);
      const float2 h01 = __half22float2(__floats2half2_rn(f.x, f.y)), h23 = __half22float2(__floats2half2_rn(f.z, f.w));
      a[i] = pack_half2(f.x - h01.x, f.y - h01.y);
      a[i + 2] = pack_half2(f.z - h23.x, f.w - h23.y);
    }
  }
  __device__ __forceinline__ float scale(int, int) const { return 1.f; }
  __device__ __forceinline__ float min(int, int) const { return 0.f; }
};

// The activation sums a lane needs for the min term, from each lane's own partial sums: xsum[nt] is this lane's sum
// of token nt * 8 + g's activations over the elements it fed the block (step); the lanes c of group g together hold
// the block's, and lane c's accumulators hold tokens nt * 8 + 2c (sum0) and + 2c + 1 (sum1).
template <int NT>
__device__ __forceinline__ void lane_token_sums(const float (&xsum)[NT], float (&sum0)[NT], float (&sum1)[NT],
                                                int n_tiles) {
  const int c = threadIdx.x & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt < n_tiles) {
      float xs = xsum[nt];
      xs += __shfl_xor_sync(0xffffffffu, xs, 1);
      xs += __shfl_xor_sync(0xffffffffu, xs, 2);
      sum0[nt] = __shfl_sync(0xffffffffu, xs, 8 * c);
      sum1[nt] = __shfl_sync(0xffffffffu, xs, 8 * c + 4);
    }
  }
}

// Adds a block's (kStepScales: a step's) partial MMA tiles, scaled, to the accumulators of one row tile: NT token
// tiles of 8, of which the first n_tiles are live. part[nt] holds rows g, g + 8 x tokens 2c, 2c + 1 as the MMA left
// them; with kHasMin, sum0[nt] / sum1[nt] are the block's (step's) activation sums of those two tokens
// (lane_token_sums), which the rows' mins multiply.
template <typename WB, int NT>
__device__ __forceinline__ void add_scaled_tiles(float (&acc)[NT][4], const float (&part)[NT][4], const WB& wb,
                                                 const float (&sum0)[NT], const float (&sum1)[NT], int step,
                                                 int n_tiles) {
  const float d0 = wb.scale(0, step), d1 = wb.scale(1, step);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt < n_tiles) {
      float* ac = acc[nt];
      ac[0] += d0 * part[nt][0];
      ac[1] += d0 * part[nt][1];
      ac[2] += d1 * part[nt][2];
      ac[3] += d1 * part[nt][3];
      if constexpr (WB::kHasMin) {
        const float m0 = wb.min(0, step), m1 = wb.min(1, step);
        ac[0] += m0 * sum0[nt];
        ac[1] += m0 * sum1[nt];
        ac[2] += m1 * sum0[nt];
        ac[3] += m1 * sum1[nt];
      }
    }
  }
}

}  // namespace metalattn::cuda::mma
