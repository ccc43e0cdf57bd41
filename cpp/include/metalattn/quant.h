// One truth for the GGUF/ggml block layouts, included by the CPU and the CUDA code alike.
// A row of a quantized matrix is cols/32 consecutive blocks; within a block, weight j (0..15) sits in the
// low nibble of qs[j] and weight j+16 in the high nibble (Q4_*), exactly as ggml stores them.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define MA_HOST_DEVICE __host__ __device__
#else
#define MA_HOST_DEVICE
#endif

namespace metalattn {

// Values are ggml's type ids, as written in GGUF tensor infos.
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30
};

constexpr int kQuantBlock = 32;  // weights per block of the legacy types (Q4_0 .. Q8_0)
constexpr int kSuperBlock = 256; // weights per super-block of the K-quants (ggml's QK_K)

// ---------------------------------------------------------------- legacy 32-weight blocks
struct block_q4_0 {
  uint16_t d;      // fp16 scale
  uint8_t qs[16];  // 32 unsigned nibbles; weight = d * (q - 8)
};
struct block_q4_1 {
  uint16_t d;      // fp16 scale
  uint16_t m;      // fp16 min
  uint8_t qs[16];  // weight = d * q + m
};
struct block_q5_0 {
  uint16_t d;      // fp16 scale
  uint8_t qh[4];   // bit j of the little-endian uint32: 5th bit of weight j
  uint8_t qs[16];  // low nibbles as in Q4_0; weight = d * (q - 16), q = nibble | (bit << 4)
};
struct block_q5_1 {
  uint16_t d;      // fp16 scale
  uint16_t m;      // fp16 min
  uint8_t qh[4];   // as Q5_0
  uint8_t qs[16];  // weight = d * q + m
};
struct block_q8_0 {
  uint16_t d;      // fp16 scale
  int8_t qs[32];   // weight = d * q
};
static_assert(sizeof(block_q4_0) == 18, "GGUF Q4_0 block is 18 bytes");
static_assert(sizeof(block_q4_1) == 20, "GGUF Q4_1 block is 20 bytes");
static_assert(sizeof(block_q5_0) == 22, "GGUF Q5_0 block is 22 bytes");
static_assert(sizeof(block_q5_1) == 24, "GGUF Q5_1 block is 24 bytes");
static_assert(sizeof(block_q8_0) == 34, "GGUF Q8_0 block is 34 bytes");

// ---------------------------------------------------------------- K-quants: 256-weight super-blocks
// Q4_K / Q5_K: 8 sub-blocks of 32. Sub-block j has a 6-bit scale sc[j] and a 6-bit min m[j], packed in
// scales[12]: for j < 4, sc = scales[j] & 63, m = scales[j + 4] & 63; for j >= 4,
// sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4).
// weight = d * sc[j] * q - dmin * m[j]. Nibbles: qs[32 * c + l] holds weight 64c + l (low) and 64c + 32 + l (high).
struct block_q4_K {
  uint16_t d;           // fp16 super-scale of the scales
  uint16_t dmin;        // fp16 super-scale of the mins
  uint8_t scales[12];
  uint8_t qs[128];
};
// Q5_K: Q4_K plus the 5th bit of weight 32 * j + l in bit j of qh[l] (q = nibble | bit << 4).
struct block_q5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
// Q6_K: 16 sub-blocks of 16, int8 scales; weight = d * scales[sub] * (q - 32), q 6 bits. For each half h (128
// weights) and l < 32: ql[64h + l] low nibble / high nibble hold the low 4 bits of weights 128h + l / 128h + 64 + l,
// ql[64h + 32 + l] those of 128h + 32 + l / 128h + 96 + l; qh[32h + l] bits 0-1, 2-3, 4-5, 6-7 hold the high 2 bits
// of weights 128h + l, + 32 + l, + 64 + l, + 96 + l. Weight i uses scales[i / 16].
struct block_q6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;           // fp16
};
// Q3_K: 16 sub-blocks of 16; weight = d * (sc - 32) * q3 with q3 = (2 low bits) - (hmask bit clear ? 4 : 0).
struct block_q3_K {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];   // 16 6-bit scales
  uint16_t d;
};
// Q2_K: 16 sub-blocks of 16; scales[i] low nibble = scale, high nibble = min; weight = d * sc * q2 - dmin * m.
struct block_q2_K {
  uint8_t scales[16];
  uint8_t qs[64];
  uint16_t d;
  uint16_t dmin;
};
static_assert(sizeof(block_q4_K) == 144, "GGUF Q4_K block is 144 bytes");
static_assert(sizeof(block_q5_K) == 176, "GGUF Q5_K block is 176 bytes");
static_assert(sizeof(block_q6_K) == 210, "GGUF Q6_K block is 210 bytes");
static_assert(sizeof(block_q3_K) == 110, "GGUF Q3_K block is 110 bytes");
static_assert(sizeof(block_q2_K) == 84, "GGUF Q2_K block is 84 bytes");

// Weights per block of a type: 32 (legacy), 256 (K-quants), 1 (float types), 0 (unknown).
constexpr MA_HOST_DEVICE int block_elems(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16: return 1;
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0: return kQuantBlock;
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K: return kSuperBlock;
  }
  return 0;
}

// Bytes of one block of a type (one element for the float types); 0 for an unknown type.
constexpr MA_HOST_DEVICE size_t block_bytes(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return 4;
    case GgmlType::F16:
    case GgmlType::BF16: return 2;
    case GgmlType::Q4_0: return sizeof(block_q4_0);
    case GgmlType::Q4_1: return sizeof(block_q4_1);
    case GgmlType::Q5_0: return sizeof(block_q5_0);
    case GgmlType::Q5_1: return sizeof(block_q5_1);
    case GgmlType::Q8_0: return sizeof(block_q8_0);
    case GgmlType::Q2_K: return sizeof(block_q2_K);
    case GgmlType::Q3_K: return sizeof(block_q3_K);
    case GgmlType::Q4_K: return sizeof(block_q4_K);
    case GgmlType::Q5_K: return sizeof(block_q5_K);
    case GgmlType::Q6_K: return sizeof(block_q6_K);
  }
  return 0;
}

// Bytes of one row of `cols` weights; 0 for an unknown type. Quantized types need cols % block_elems == 0.
inline MA_HOST_DEVICE size_t row_bytes(GgmlType t, int64_t cols) {
  const int be = block_elems(t);
  return be == 0 ? 0 : static_cast<size_t>(cols / be) * block_bytes(t);
}

inline MA_HOST_DEVICE bool is_quantized(GgmlType t) { return block_elems(t) > 1; }
inline MA_HOST_DEVICE bool is_k_quant(GgmlType t) { return block_elems(t) == kSuperBlock; }

const char* type_name(GgmlType t);

// ---------------------------------------------------------------- bit-field helpers of the block layouts

// The 32 fifth bits of a Q5_0 / Q5_1 block (bit j belongs to weight j).
inline MA_HOST_DEVICE uint32_t q5_high_bits(const uint8_t qh[4]) {
  return static_cast<uint32_t>(qh[0]) | static_cast<uint32_t>(qh[1]) << 8 | static_cast<uint32_t>(qh[2]) << 16 |
         static_cast<uint32_t>(qh[3]) << 24;
}

// Scale and min (6 bits each) of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline MA_HOST_DEVICE void k_scale_min(const uint8_t scales[12], int j, int* sc, int* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
    *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// Signed 6-bit value (-32..31) of weight i (0..255) of a Q6_K super-block.
inline MA_HOST_DEVICE int q6_k_value(const block_q6_K& b, int i) {
  const int h = i / 128, g = (i % 128) / 32, l = i % 32;
  const uint8_t low_byte = b.ql[64 * h + 32 * (g & 1) + l];
  const int low = g < 2 ? (low_byte & 0x0f) : (low_byte >> 4);
  const int high = (b.qh[32 * h + l] >> (2 * g)) & 3;
  return (low | (high << 4)) - 32;
}

// Scale (6 bits, 0..63; the weight uses it minus 32) of sub-block s (0..15) of a Q3_K super-block.
inline MA_HOST_DEVICE int q3_k_scale(const uint8_t scales[12], int s) {
  const int low = s < 8 ? (scales[s] & 0x0f) : (scales[s - 8] >> 4);
  const int high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
  return low | (high << 4);
}

// IEEE half -> float by bit manipulation (host reference; CUDA code uses __half2float).
inline MA_HOST_DEVICE float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// float -> IEEE half, round to nearest even, by bit manipulation: what F16C's
// _mm_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT) and CUDA's __float2half_rn give (the KV caches of both backends store
// their values through one or the other). |x| >= 65520 (the midpoint of 65504 and 2^16, whose odd mantissa rounds up)
// gives +-inf, as inf does; halves' subnormals are kept and float subnormals round to +-0. A NaN gives a quiet NaN
// (the sign and the top 10 mantissa bits kept, the quiet bit set, as F16C does).
inline MA_HOST_DEVICE uint16_t float_to_fp16_rne(float f) {
  uint32_t x;
  __builtin_memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));  // NaN
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);                      // >= 65520, inf
  if (x >= 0x38800000u) {  // a normal half (>= 2^-14): rebias, then add just under half an ulp plus the ulp's low
    // bit, so a tie rounds to even; a carry out of the mantissa steps the exponent (up to 0x7bff, 65504)
    x = x - ((127u - 15u) << 23) + 0xfffu + ((x >> 13) & 1u);
    return static_cast<uint16_t>(sign | (x >> 13));
  }
  const int e = static_cast<int>(x >> 23);  // below 2^-14: a multiple of 2^-24 (a subnormal, or 0x0400 on a carry)
  const int shift = 126 - e;                // |f| * 2^24 = m * 2^-shift, m the 24-bit significand
  if (shift > 24) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to 0 (float subnormals and 0 too)
  const uint32_t m = (x & 0x7fffffu) | 0x800000u;
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline MA_HOST_DEVICE float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

}  // namespace metalattn
