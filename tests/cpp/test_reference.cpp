// The scalar reference kernels themselves: everything else is tested against them, so they are checked here
// against hand-computed values and first principles.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/reference.h"

using namespace metalattn;

namespace {
uint16_t f2h(float f) {  // exact for the small integers and halves used below
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
  if ((b & 0x7fffffffu) == 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (exp << 10) | ((b >> 13) & 0x3ffu));
}
}  // namespace

TEST(Reference, Fp16Conversion) {
  EXPECT_EQ(fp16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(fp16_to_float(0xc000), -2.0f);
  EXPECT_EQ(fp16_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(fp16_to_float(0x7c00)));
  EXPECT_TRUE(std::isnan(fp16_to_float(0x7e00)));
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
}

// float_to_fp16_rne (the K/V caches' rounding; tested bit for bit against F16C in test_cpu_kernels) from first
// principles: every half's value comes back as itself, ties go to the even neighbour, overflow to inf.
TEST(Reference, Fp16RoundingToNearestEven) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = fp16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16_rne(f)))) << h;
    } else {
      ASSERT_EQ(float_to_fp16_rne(f), h) << f;
    }
  }
  EXPECT_EQ(float_to_fp16_rne(1.f + std::ldexp(1.f, -11)), 0x3c00);       // tie: to 1 (even)
  EXPECT_EQ(float_to_fp16_rne(1.f + std::ldexp(3.f, -11)), 0x3c02);       // tie: to the even 1 + 2^-9
  EXPECT_EQ(float_to_fp16_rne(std::nextafter(1.f + std::ldexp(1.f, -11), 2.f)), 0x3c01);
  EXPECT_EQ(float_to_fp16_rne(65519.f), 0x7bff);
  EXPECT_EQ(float_to_fp16_rne(65520.f), 0x7c00);                          // tie past 65504: inf
  EXPECT_EQ(float_to_fp16_rne(-1e30f), 0xfc00);
  EXPECT_EQ(float_to_fp16_rne(std::ldexp(1.f, -25)), 0x0000);              // tie: to 0
  EXPECT_EQ(float_to_fp16_rne(std::ldexp(3.f, -25)), 0x0002);              // 1.5 x 2^-24: to 2 x 2^-24
  EXPECT_EQ(float_to_fp16_rne(std::ldexp(2047.f, -25)), 0x0400);           // the largest subnormal's tie: 2^-14
  EXPECT_EQ(float_to_fp16_rne(-std::ldexp(1.f, -30)), 0x8000);
  EXPECT_EQ(float_to_fp16_rne(1e-45f), 0x0000);                           // a float subnormal
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16_rne(std::nanf("")))));
}

TEST(Reference, DequantizeQ4LayoutLowNibblesFirst) {
  block_q4_0 b0{};
  block_q4_1 b1{};
  b0.d = f2h(0.5f);
  b1.d = f2h(2.0f);
  b1.m = f2h(-1.0f);
  for (int j = 0; j < 16; ++j) b0.qs[j] = b1.qs[j] = static_cast<uint8_t>((j & 0xf) | ((15 - j) << 4));
  float o0[32], o1[32];
  ref::dequantize_row(GgmlType::Q4_0, &b0, o0, 32);
  ref::dequantize_row(GgmlType::Q4_1, &b1, o1, 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(o0[j], 0.5f * (j - 8));
    EXPECT_EQ(o0[j + 16], 0.5f * (15 - j - 8));
    EXPECT_EQ(o1[j], 2.0f * j - 1.0f);
    EXPECT_EQ(o1[j + 16], 2.0f * (15 - j) - 1.0f);
  }
  block_q8_0 b8{};
  b8.d = f2h(0.25f);
  for (int j = 0; j < 32; ++j) b8.qs[j] = static_cast<int8_t>(j * 8 - 128);
  float o8[32];
  ref::dequantize_row(GgmlType::Q8_0, &b8, o8, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(o8[j], 0.25f * (j * 8 - 128));
}

// Q5_0 / Q5_1: one block from known codes; the fifth bit of weight j is bit j of the little-endian qh.
TEST(Reference, DequantizeQ5LayoutFifthBits) {
  std::mt19937 rng(3);
  int codes[32];
  for (int& c : codes) c = static_cast<int>(rng() % 32);
  block_q5_0 b0{};
  block_q5_1 b1{};
  b0.d = f2h(0.5f);
  b1.d = f2h(0.25f);
  b1.m = f2h(-3.0f);
  uint32_t qh = 0;
  for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>(codes[j] >> 4) << j;
  for (int k = 0; k < 4; ++k) b0.qh[k] = b1.qh[k] = static_cast<uint8_t>(qh >> (8 * k));
  for (int j = 0; j < 16; ++j) b0.qs[j] = b1.qs[j] = static_cast<uint8_t>((codes[j] & 15) | (codes[j + 16] & 15) << 4);
  float o0[32], o1[32];
  ref::dequantize_row(GgmlType::Q5_0, &b0, o0, 32);
  ref::dequantize_row(GgmlType::Q5_1, &b1, o1, 32);
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(o0[j], 0.5f * (codes[j] - 16)) << j;
    EXPECT_EQ(o1[j], 0.25f * codes[j] - 3.0f) << j;
  }
}

// Q4_K / Q5_K: sub-block j of 32 has 6-bit scale sc[j] and min m[j] (packed as quant.h describes), weight =
// d * sc * q - dmin * m, q from nibble l of qs[32 (j / 2) + l] (low for even j) plus bit j of qh[l] (Q5_K).
TEST(Reference, DequantizeQ4KQ5KLayout) {
  std::mt19937 rng(4);
  int q[8][32], sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = static_cast<int>(rng() % 64);
    mn[j] = static_cast<int>(rng() % 64);
    for (int l = 0; l < 32; ++l) q[j][l] = static_cast<int>(rng() % 32);
  }
  uint8_t scales[12];
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
    scales[j + 4] = static_cast<uint8_t>(mn[j] | (mn[j + 4] >> 4) << 6);
    scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
  }
  block_q4_K b4{};
  block_q5_K b5{};
  b4.d = b5.d = f2h(0.125f);
  b4.dmin = b5.dmin = f2h(0.5f);
  std::memcpy(b4.scales, scales, 12);
  std::memcpy(b5.scales, scales, 12);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      b4.qs[32 * c + l] = b5.qs[32 * c + l] = static_cast<uint8_t>((q[2 * c][l] & 15) | (q[2 * c + 1][l] & 15) << 4);
    }
  for (int l = 0; l < 32; ++l)
    for (int j = 0; j < 8; ++j) b5.qh[l] |= static_cast<uint8_t>((q[j][l] >> 4) << j);
  // Two super-blocks in a row: the second repeats the first with d doubled (block order check).
  block_q4_K r4[2] = {b4, b4};
  block_q5_K r5[2] = {b5, b5};
  r4[1].d = r5[1].d = f2h(0.25f);
  std::vector<float> o4(512), o5(512);
  ref::dequantize_row(GgmlType::Q4_K, r4, o4.data(), 512);
  ref::dequantize_row(GgmlType::Q5_K, r5, o5.data(), 512);
  for (int k = 0; k < 2; ++k)
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        const float dl = (k ? 0.25f : 0.125f) * sc[j], ml = 0.5f * mn[j];
        EXPECT_EQ(o4[256 * k + 32 * j + l], dl * (q[j][l] & 15) - ml) << k << " " << j << " " << l;
        EXPECT_EQ(o5[256 * k + 32 * j + l], dl * q[j][l] - ml) << k << " " << j << " " << l;
      }
}

// Q6_K: weight i = d * scales[i / 16] * (q - 32), q's low 4 bits in ql, high 2 bits in qh (layout in quant.h).
TEST(Reference, DequantizeQ6KLayout) {
  std::mt19937 rng(5);
  int q[256];
  block_q6_K b{};
  for (int i = 0; i < 256; ++i) {
    q[i] = static_cast<int>(rng() % 64);
    const int h = i / 128, g = (i % 128) / 32, l = i % 32;
    b.ql[64 * h + 32 * (g % 2) + l] |= static_cast<uint8_t>((q[i] & 15) << (4 * (g / 2)));
    b.qh[32 * h + l] |= static_cast<uint8_t>((q[i] >> 4) << (2 * g));
  }
  for (int s = 0; s < 16; ++s) b.scales[s] = static_cast<int8_t>(static_cast<int>(rng() % 256) - 128);
  b.d = f2h(0.25f);
  float o[256];
  ref::dequantize_row(GgmlType::Q6_K, &b, o, 256);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(o[i], 0.25f * b.scales[i / 16] * (q[i] - 32)) << i;
}

// Q3_K: weight i = d * (sc[i / 16] - 32) * (2-bit field - (hmask bit clear ? 4 : 0)); Q2_K: d * sc * q - dmin * m.
TEST(Reference, DequantizeQ3KQ2KLayout) {
  std::mt19937 rng(6);
  int q2[256], hb[256], sc3[16], sc2[16], mn2[16];
  block_q3_K b3{};
  block_q2_K b2{};
  for (int i = 0; i < 256; ++i) {
    q2[i] = static_cast<int>(rng() % 4);
    hb[i] = static_cast<int>(rng() % 2);
    const int h = i / 128, f = (i % 128) / 32, l = i % 32;
    b3.qs[32 * h + l] |= static_cast<uint8_t>(q2[i] << (2 * f));
    b2.qs[32 * h + l] |= static_cast<uint8_t>(q2[i] << (2 * f));
    b3.hmask[l] |= static_cast<uint8_t>(hb[i] << (4 * h + f));
  }
  for (int s = 0; s < 16; ++s) {
    sc3[s] = static_cast<int>(rng() % 64);
    sc2[s] = static_cast<int>(rng() % 16);
    mn2[s] = static_cast<int>(rng() % 16);
    b3.scales[s % 8] |= static_cast<uint8_t>((sc3[s] & 15) << (4 * (s / 8)));
    b3.scales[8 + s % 4] |= static_cast<uint8_t>((sc3[s] >> 4) << (2 * (s / 4)));
    b2.scales[s] = static_cast<uint8_t>(sc2[s] | mn2[s] << 4);
  }
  b3.d = f2h(0.5f);
  b2.d = f2h(0.25f);
  b2.dmin = f2h(0.125f);
  float o3[256], o2[256];
  ref::dequantize_row(GgmlType::Q3_K, &b3, o3, 256);
  ref::dequantize_row(GgmlType::Q2_K, &b2, o2, 256);
  for (int i = 0; i < 256; ++i) {
    EXPECT_EQ(o3[i], 0.5f * (sc3[i / 16] - 32) * (q2[i] - (hb[i] ? 0 : 4))) << i;
    EXPECT_EQ(o2[i], 0.25f * sc2[i / 16] * q2[i] - 0.125f * mn2[i / 16]) << i;
  }
}

// dot_row walks whole storage blocks (256-weight super-blocks for the K-quants): equal to dequantize-then-dot.
TEST(Reference, DotRowWalksWholeBlocks) {
  std::mt19937 rng(8);
  for (GgmlType t : {GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q2_K}) {
    const int64_t cols = 768;
    std::vector<uint8_t> row(row_bytes(t, cols));
    for (auto& v : row) v = static_cast<uint8_t>(rng());
    // Ordinary fp16 scales (1/8) in every block, so nothing is non-finite.
    const size_t bb = block_bytes(t);
    const size_t d_off = t == GgmlType::Q6_K ? offsetof(block_q6_K, d) : t == GgmlType::Q2_K ? offsetof(block_q2_K, d) : 0;
    for (size_t off = 0; off < row.size(); off += bb) {
      const uint16_t h = f2h(0.125f);
      std::memcpy(&row[off + d_off], &h, 2);
      if (t == GgmlType::Q4_K || t == GgmlType::Q2_K) std::memcpy(&row[off + d_off + 2], &h, 2);  // dmin
    }
    std::vector<float> x(cols), w(cols);
    for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 17) - 8) * 0.5f;
    ref::dequantize_row(t, row.data(), w.data(), cols);
    double expect = 0;
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      float s = 0.f;
      for (int64_t c = c0; c < c0 + 32; ++c) s += w[c] * x[c];
      expect += s;
    }
    EXPECT_EQ(ref::dot_row(t, row.data(), x.data(), cols), static_cast<float>(expect)) << type_name(t);
  }
}

TEST(Reference, ArgmaxSemantics) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> a = {1.f, 3.f, nan, 3.f, 2.f};
  EXPECT_EQ(ref::argmax(a.data(), 5).token, 1u);  // tie -> lowest index
  std::vector<float> b = {nan, -inf, 5.f, inf, inf};
  EXPECT_EQ(ref::argmax(b.data(), 5).token, 3u);  // +inf wins, first one
  std::vector<float> c = {nan, -inf, -inf};
  EXPECT_EQ(ref::argmax(c.data(), 3).token, 1u);  // -inf beats NaN
  std::vector<float> d = {nan, nan};
  EXPECT_THROW(ref::argmax(d.data(), 2), EngineError);
  std::mt19937 rng(7);
  std::normal_distribution<float> g;
  std::vector<float> big(49152);
  for (float& x : big) x = g(rng);
  size_t best = 0;
  for (size_t i = 1; i < big.size(); ++i)
    if (big[i] > big[best]) best = i;
  EXPECT_EQ(ref::argmax(big.data(), 49152).token, best);
  EXPECT_EQ(ref::argmax(big.data(), 49152).value, big[best]);
}

TEST(Reference, RmsNormAndRope) {
  std::vector<float> x = {3.f, 4.f}, w = {1.f, 2.f}, out(2);
  ref::rmsnorm(x.data(), w.data(), 0.f, 2, out.data());
  const float rms = std::sqrt(12.5f);
  EXPECT_NEAR(out[0], 3.f / rms, 1e-6);
  EXPECT_NEAR(out[1], 8.f / rms, 1e-6);
  // RoPE: pair i of a head turns by pos * base^(-2i/d); norms are preserved, position 0 is the identity.
  std::vector<float> v = {1.f, 0.f, 0.f, 1.f};
  ref::rope(v.data(), 1, 4, 0, 10000.f);
  EXPECT_EQ(v, (std::vector<float>{1.f, 0.f, 0.f, 1.f}));
  ref::rope(v.data(), 1, 4, 3, 10000.f);
  EXPECT_NEAR(v[0], std::cos(3.0), 1e-6);
  EXPECT_NEAR(v[1], std::sin(3.0), 1e-6);
  const double t1 = 3.0 * std::pow(10000.0, -0.5);
  EXPECT_NEAR(v[2], -std::sin(t1), 1e-6);
  EXPECT_NEAR(v[3], std::cos(t1), 1e-6);
}

TEST(Reference, AttentionSinglePositionReturnsValue) {
  // One cached position: softmax weight 1, so each head outputs its KV head's value row.
  const int heads = 4, kv_heads = 2, hd = 8;
  std::vector<float> q(heads * hd, 0.3f), k(kv_heads * hd, 0.1f), v(kv_heads * hd), out(heads * hd, NAN);
  for (int i = 0; i < kv_heads * hd; ++i) v[i] = static_cast<float>(i);
  ref::attention(q.data(), k.data(), v.data(), heads, kv_heads, hd, 1, out.data());
  for (int h = 0; h < heads; ++h)
    for (int j = 0; j < hd; ++j) EXPECT_EQ(out[h * hd + j], v[(h / 2) * hd + j]);
}
