// The scalar reference kernels themselves: everything else is tested against them, so they are checked here
// against hand-computed values and first principles.
#include <gtest/gtest.h>

#include <cmath>
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
