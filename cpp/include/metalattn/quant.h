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
enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };

constexpr int kQuantBlock = 32;  // weights per block for every quantized type here

struct block_q4_0 {
  uint16_t d;      // fp16 scale
  uint8_t qs[16];  // 32 unsigned nibbles; weight = d * (q - 8)
};
struct block_q4_1 {
  uint16_t d;      // fp16 scale
  uint16_t m;      // fp16 min
  uint8_t qs[16];  // weight = d * q + m
};
struct block_q8_0 {
  uint16_t d;      // fp16 scale
  int8_t qs[32];   // weight = d * q
};
static_assert(sizeof(block_q4_0) == 18, "GGUF Q4_0 block is 18 bytes");
static_assert(sizeof(block_q4_1) == 20, "GGUF Q4_1 block is 20 bytes");
static_assert(sizeof(block_q8_0) == 34, "GGUF Q8_0 block is 34 bytes");

// Bytes of one row of `cols` weights; 0 for an unknown type. Quantized types need cols % 32 == 0.
inline MA_HOST_DEVICE size_t row_bytes(GgmlType t, int64_t cols) {
  switch (t) {
    case GgmlType::F32: return static_cast<size_t>(cols) * 4;
    case GgmlType::F16:
    case GgmlType::BF16: return static_cast<size_t>(cols) * 2;
    case GgmlType::Q4_0: return static_cast<size_t>(cols / kQuantBlock) * sizeof(block_q4_0);
    case GgmlType::Q4_1: return static_cast<size_t>(cols / kQuantBlock) * sizeof(block_q4_1);
    case GgmlType::Q8_0: return static_cast<size_t>(cols / kQuantBlock) * sizeof(block_q8_0);
  }
  return 0;
}

inline bool is_quantized(GgmlType t) {
  return t == GgmlType::Q4_0 || t == GgmlType::Q4_1 || t == GgmlType::Q8_0;
}

const char* type_name(GgmlType t);

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

inline MA_HOST_DEVICE float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

}  // namespace metalattn
