// CPU SIMD kernels and thread pool against the scalar reference (cpp/cpu/reference.h), on fresh random data.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(METALATTN_X86)
#include <immintrin.h>
#endif

#include "cpu/kernels.h"
#include "metalattn/backend.h"
#include "cpu/reference.h"
#include "cpu/thread_pool.h"

using namespace metalattn;
using namespace metalattn::cpu;

namespace {

const float kPoison = std::numeric_limits<float>::quiet_NaN();

bool is_poison(float v) {
  uint32_t a, b;
  std::memcpy(&a, &v, 4);
  std::memcpy(&b, &kPoison, 4);
  return a == b;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

// ---------------------------------------------------------------- a tiny quantizer (ggml block layouts)

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) return sign | 0x7c00u;  // overflow -> inf (never reached by the test data)
  if (x < 0x38800000u) {                         // below the smallest normal half: multiples of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.f));
  }
  const uint32_t mant = x & 0x7fffffu;
  uint32_t h = ((((x >> 23) - 127 + 15)) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // round half to even; a carry bumps the exponent
  return sign | static_cast<uint16_t>(h);
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

// Quantizes one row of `cols` floats into `dst` (row_bytes(type, cols) bytes), round to nearest.
void quantize_row(GgmlType type, const float* x, int64_t cols, uint8_t* dst) {
  switch (type) {
    case GgmlType::F32: std::memcpy(dst, x, cols * 4); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < cols; ++i) {
        const uint16_t h = float_to_half(x[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < cols; ++i) {
        const uint16_t h = float_to_bf16(x[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    default: break;
  }
  for (int64_t k = 0; k < cols / 32; ++k) {
    const float* xb = x + k * 32;
    if (type == GgmlType::Q4_0) {
      float vmax = 0.f;  // the value of largest magnitude, with its sign: it maps to q = 0 exactly
      for (int j = 0; j < 32; ++j)
        if (std::fabs(xb[j]) > std::fabs(vmax)) vmax = xb[j];
      block_q4_0 b;
      b.d = float_to_half(vmax / -8.f);
      const float d = fp16_to_float(b.d);
      int q[32];
      for (int j = 0; j < 32; ++j) q[j] = d == 0.f ? 8 : clampi(static_cast<int>(std::nearbyint(xb[j] / d)) + 8, 0, 15);
      for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
      std::memcpy(dst + k * sizeof(b), &b, sizeof(b));
    } else if (type == GgmlType::Q4_1) {
      float mn = xb[0], mx = xb[0];
      for (int j = 1; j < 32; ++j) mn = std::fmin(mn, xb[j]), mx = std::fmax(mx, xb[j]);
      block_q4_1 b;
      b.d = float_to_half((mx - mn) / 15.f);
      b.m = float_to_half(mn);
      const float d = fp16_to_float(b.d), m = fp16_to_float(b.m);
      int q[32];
      for (int j = 0; j < 32; ++j) q[j] = d == 0.f ? 0 : clampi(static_cast<int>(std::nearbyint((xb[j] - m) / d)), 0, 15);
      for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
      std::memcpy(dst + k * sizeof(b), &b, sizeof(b));
    } else {
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
      block_q8_0 b;
      b.d = float_to_half(amax / 127.f);
      const float d = fp16_to_float(b.d);
      for (int j = 0; j < 32; ++j)
        b.qs[j] = static_cast<int8_t>(d == 0.f ? 0 : clampi(static_cast<int>(std::nearbyint(xb[j] / d)), -127, 127));
      std::memcpy(dst + k * sizeof(b), &b, sizeof(b));
    }
  }
}

// A random weight matrix: rows and blocks of varied magnitude, so scales differ from block to block.
struct Matrix {
  std::vector<uint8_t> bytes;
  WeightView view;
};

// The types without a quantizer here (Q5_0 .. Q6_K): random bytes are valid blocks of each; only the fp16 scale
// fields are set, to random magnitudes that differ from row to row and block to block.
bool random_block_type(GgmlType t) {
  return t == GgmlType::Q5_0 || t == GgmlType::Q5_1 || t == GgmlType::Q2_K || t == GgmlType::Q3_K ||
         t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K;
}

// Byte offsets of the fp16 fields of a block: scales (d, dmin / m) get magnitudes ~s.
std::vector<size_t> half_fields(GgmlType t) {
  switch (t) {
    case GgmlType::Q5_0: return {0};
    case GgmlType::Q5_1: return {0, 2};
    case GgmlType::Q4_K: case GgmlType::Q5_K: return {0, 2};
    case GgmlType::Q6_K: return {offsetof(block_q6_K, d)};
    case GgmlType::Q3_K: return {offsetof(block_q3_K, d)};
    case GgmlType::Q2_K: return {offsetof(block_q2_K, d), offsetof(block_q2_K, dmin)};
    default: return {};
  }
}

void random_blocks(GgmlType type, int64_t rows, int64_t cols, std::mt19937& rng, uint8_t* out) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.0005f, 0.05f);
  const size_t bb = block_bytes(type), n = static_cast<size_t>(rows) * (cols / block_elems(type));
  for (size_t i = 0; i < n * bb; ++i) out[i] = static_cast<uint8_t>(byte(rng));
  const bool k = is_k_quant(type);
  for (size_t b = 0; b < n; ++b)
    for (size_t off : half_fields(type)) {
      // Legacy blocks get d ~ 0.01-1 (weights d * q); K-quant super-scales are smaller (times 6-bit scales).
      const float v = (k ? 1.f : 20.f) * scale(rng) * (off == 2 && type == GgmlType::Q5_1 ? -4.f : 1.f);
      const uint16_t h = float_to_half(v);
      std::memcpy(out + b * bb + off, &h, 2);
    }
}

Matrix random_matrix(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> scale(0.02f, 1.f);
  Matrix m;
  const size_t stride = row_bytes(type, cols);
  m.bytes.resize(stride * rows);
  m.view.type = type;
  m.view.data = m.bytes.data();
  m.view.rows = rows;
  m.view.cols = cols;
  if (random_block_type(type)) {
    random_blocks(type, rows, cols, rng, m.bytes.data());
    return m;
  }
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = scale(rng);
    for (int64_t c = 0; c < cols; ++c) row[c] = normal(rng) * row_scale;
    for (int64_t c = 0; c < cols; c += 32) {
      const float block_scale = scale(rng);
      for (int64_t j = c; j < std::min(cols, c + 32); ++j) row[j] *= block_scale;
    }
    quantize_row(type, row.data(), cols, m.bytes.data() + r * stride);
  }
  if (type == GgmlType::Q8_0) {
    // -128 is a legal stored byte the quantizer never writes; make sure the kernels handle it.
    std::uniform_int_distribution<size_t> pick(0, m.bytes.size() / sizeof(block_q8_0) - 1);
    auto* blocks = reinterpret_cast<block_q8_0*>(m.bytes.data());
    for (int i = 0; i < 64; ++i) blocks[pick(rng)].qs[i % 32] = -128;
  }
  return m;
}

// Activations: unit normal scaled per block (0.05..4), with a few outliers, like a residual stream.
std::vector<float> random_acts(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> scale(0.05f, 4.f);
  std::uniform_int_distribution<int> outlier(0, 199);
  std::vector<float> x(n);
  float s = 1.f;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 32 == 0) s = scale(rng);
    x[i] = normal(rng) * s * (outlier(rng) == 0 ? 20.f : 1.f);
  }
  return x;
}

std::vector<float> dequantize_acts(const std::vector<block_q16_act>& xq) {
  std::vector<float> out(xq.size() * 32);
  for (size_t b = 0; b < xq.size(); ++b)
    for (int j = 0; j < 32; ++j) out[b * 32 + j] = xq[b].d * xq[b].qs[j];
  return out;
}

// Error budget of one row r, from the data itself.
//  acts: activations quantized to int16 with step d_b = amax_b / 32767 (per block b) are off by at most d_b/2
//        each, so the dot product of the dequantized row w with them moves by at most
//        sum_b d_b/2 * sum_{j in b} |w_j|. This is the exact worst case of the quantization, not a guess;
//        random data typically lands ~sqrt(32) below it.
//  float: the kernels accumulate exact int32 partial block dots (one rounding when a Q8_0 partial sum passes
//        2^24 on its way to float), one rounding for the scale product, one per fma (~12 quads + a 4-level
//        reduction tree); the reference sums each block in float (32 terms) and blocks in double; the test's
//        dequantized activations d * q are rounded once each: together < 60 roundings of 2^-24 relative to
//        mag = sum_j (|d q_j| + |m|) |x_j|, i.e. < 4e-6 * mag; we allow 1e-5 * mag.
struct RowBudget {
  std::vector<double> acts;  // activation quantization
  std::vector<double> mag;   // magnitude scale for float rounding
};

// |m| of the block holding weight c, for types whose weights are d*q + m (both parts count: they may cancel).
double min_magnitude(GgmlType type, const uint8_t* row, int64_t c) {
  switch (type) {
    case GgmlType::Q4_1: return std::fabs(fp16_to_float((reinterpret_cast<const block_q4_1*>(row) + c / 32)->m));
    case GgmlType::Q5_1: return std::fabs(fp16_to_float((reinterpret_cast<const block_q5_1*>(row) + c / 32)->m));
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const auto* h = reinterpret_cast<const block_q4_K*>(row + (c / kSuperBlock) * block_bytes(type));
      int sc, m;
      k_scale_min(h->scales, static_cast<int>(c % kSuperBlock) / 32, &sc, &m);
      return std::fabs(fp16_to_float(h->dmin) * m);
    }
    case GgmlType::Q2_K: {
      const auto* h = reinterpret_cast<const block_q2_K*>(row) + c / kSuperBlock;
      return std::fabs(fp16_to_float(h->dmin) * (h->scales[(c % kSuperBlock) / 16] >> 4));
    }
    default: return 0.0;
  }
}

RowBudget row_budget(const WeightView& w, const float* x, const std::vector<block_q16_act>* xq, int64_t r0,
                     int64_t r1) {
  RowBudget b;
  b.acts.assign(w.rows, 0.0);
  b.mag.assign(w.rows, 0.0);
  std::vector<float> row(w.cols);
  for (int64_t r = r0; r < r1; ++r) {
    ref::dequantize_row(w.type, w.row(r), row.data(), w.cols);
    double e = 0, m = 0;
    for (int64_t c = 0; c < w.cols; ++c) {
      const double min_term = min_magnitude(w.type, w.row(r), c);
      const double step = xq ? (*xq)[c / 32].d : 0.0;
      e += step / 2 * std::fabs(row[c]);
      m += (std::fabs(row[c]) + 2 * min_term) * (std::fabs(x[c]) + step);
    }
    b.acts[r] = e;
    b.mag[r] = m;
  }
  return b;
}

class QuantTypes : public ::testing::TestWithParam<GgmlType> {};

std::string type_param_name(const ::testing::TestParamInfo<GgmlType>& info) { return type_name(info.param); }

// Checks one matrix at one shape on every ISA: full range against the reference, then a mid-matrix row range
// that must reproduce the same values and leave every other element untouched.
void check_matvec(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << type_name(type) << " " << rows << "x" << cols);
  const Matrix m = random_matrix(type, rows, cols, seed);
  const std::vector<float> x = random_acts(cols, seed + 1);
  std::vector<float> ref_y(rows);
  ref::matvec(m.view, x.data(), ref_y.data(), 0, rows);

  std::vector<block_q16_act> xq;
  std::vector<float> ref_yhat(rows);  // reference on the dequantized int16 activations
  if (is_quantized(type) && cols % 32 == 0) {
    xq.resize(cols / 32);
    quantize_acts(Isa::Scalar, x.data(), cols, xq.data());
    const std::vector<float> xhat = dequantize_acts(xq);
    ref::matvec(m.view, xhat.data(), ref_yhat.data(), 0, rows);
  }
  const RowBudget budget = row_budget(m.view, x.data(), xq.empty() ? nullptr : &xq, 0, rows);

  constexpr int kGuard = 4;
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    const bool quant_acts = uses_quantized_acts(isa, type);
    std::vector<float> buf(rows + 2 * kGuard, kPoison);
    float* y = buf.data() + kGuard;
    matvec(isa, m.view, x.data(), quant_acts ? xq.data() : nullptr, y, 0, rows);
    for (int i = 0; i < kGuard; ++i) {
      ASSERT_TRUE(is_poison(buf[i])) << "write before y";
      ASSERT_TRUE(is_poison(buf[kGuard + rows + i])) << "write past y";
    }
    int failures = 0;
    for (int64_t r = 0; r < rows && failures < 5; ++r) {
      const double float_tol = 1e-5 * budget.mag[r] + 1e-30;
      const double tol = (quant_acts ? budget.acts[r] : 0.0) + float_tol;
      const double err = std::fabs(static_cast<double>(y[r]) - ref_y[r]);
      if (!(err <= tol)) {
        ADD_FAILURE() << "row " << r << ": " << y[r] << " vs reference " << ref_y[r] << " (err " << err << " > " << tol
                      << ")";
        ++failures;
      }
      if (quant_acts) {  // same int16 activations as the kernel: only float rounding may differ
        const double err_hat = std::fabs(static_cast<double>(y[r]) - ref_yhat[r]);
        if (!(err_hat <= float_tol)) {
          ADD_FAILURE() << "row " << r << ": " << y[r] << " vs reference on int8 activations " << ref_yhat[r]
                        << " (err " << err_hat << " > " << float_tol << ")";
          ++failures;
        }
      }
    }
    // Rows split mid-matrix at odd boundaries (as a thread's share would be): same values, nothing else written.
    const int64_t r0 = rows / 3 + 1, r1 = 2 * rows / 3 + 3 < rows ? 2 * rows / 3 + 3 : rows;
    std::vector<float> part(rows, kPoison);
    matvec(isa, m.view, x.data(), quant_acts ? xq.data() : nullptr, part.data(), r0, r1);
    for (int64_t r = 0; r < rows; ++r) {
      if (r >= r0 && r < r1) {
        ASSERT_TRUE(same_bits(part[r], y[r])) << "row " << r << " differs in a partial range";
      } else {
        ASSERT_TRUE(is_poison(part[r])) << "row " << r << " written outside [" << r0 << ", " << r1 << ")";
      }
    }
  }
}

// Rows x cols of the matrices the supported models use in this type: SmolLM2-135M (576 / 1536), Gemma 3 270M
// (640, 1024, 2048; head_dim 256), Qwen2.5-0.5B (896, 4864); the K-quants only where rows hold whole super-blocks.
std::vector<std::array<int64_t, 2>> model_shapes(GgmlType type) {
  if (is_k_quant(type)) return {{640, 1024}, {640, 2048}, {896, 4864}, {576, 1536}, {4864, 256}};
  return {{576, 576}, {192, 576}, {1536, 576}, {576, 1536}, {49152, 576}, {1024, 640}, {256, 640}, {2048, 640},
          {640, 2048}, {896, 896}, {128, 896}, {4864, 896}, {16384, 896}};
}

TEST_P(QuantTypes, MatvecModelShapes) {
  const GgmlType type = GetParam();
  uint32_t seed = 100 + static_cast<uint32_t>(type) * 1000;
  for (const auto& s : model_shapes(type)) check_matvec(type, s[0], s[1], seed += 17);
}

// Matmul at the row counts a batched decode step (8 rows: every row in the lanes of one token tile) and a short prompt
// (16: two token registers) give, at every model shape, on every ISA: each token's outputs against the scalar reference
// (float activations, and the same int16 activations as the kernel) with check_matvec's bounds, nothing written
// outside the rows asked for.
void check_matmul(GgmlType type, int64_t rows, int64_t cols, int n_tok, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << type_name(type) << " " << rows << "x" << cols << " n_tok=" << n_tok);
  const Matrix m = random_matrix(type, rows, cols, seed);
  const std::vector<float> X = random_acts(n_tok * cols, seed + 1);
  const bool quantized = is_quantized(type) && cols % 32 == 0;
  std::vector<block_q16_act> xq_all(quantized ? n_tok * cols / 32 : 0);
  if (quantized) quantize_acts(Isa::Scalar, X.data(), n_tok * cols, xq_all.data());
  std::vector<std::vector<float>> ref_y(n_tok, std::vector<float>(rows)), ref_yhat(n_tok, std::vector<float>(rows));
  std::vector<RowBudget> budget;
  for (int t = 0; t < n_tok; ++t) {
    const float* x = X.data() + static_cast<int64_t>(t) * cols;
    ref::matvec(m.view, x, ref_y[t].data(), 0, rows);
    std::vector<block_q16_act> xq;
    if (quantized) {
      xq.assign(xq_all.begin() + t * cols / 32, xq_all.begin() + (t + 1) * cols / 32);
      const std::vector<float> xhat = dequantize_acts(xq);
      ref::matvec(m.view, xhat.data(), ref_yhat[t].data(), 0, rows);
    }
    budget.push_back(row_budget(m.view, x, xq.empty() ? nullptr : &xq, 0, rows));
  }
  const int64_t ldy = rows + 3;
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    const bool quant_acts = uses_quantized_acts(isa, type);
    std::vector<block_q16_act> Xq(n_tok * cols / 32);
    if (quant_acts) quantize_acts(isa, X.data(), n_tok * cols, Xq.data());
    std::vector<float> Y(n_tok * ldy, kPoison);
    matmul(isa, m.view, X.data(), quant_acts ? Xq.data() : nullptr, n_tok, Y.data(), ldy, 0, rows);
    int failures = 0;
    for (int t = 0; t < n_tok; ++t) {
      for (int64_t r = rows; r < ldy; ++r) ASSERT_TRUE(is_poison(Y[t * ldy + r])) << "token " << t << ": write past y";
      for (int64_t r = 0; r < rows && failures < 5; ++r) {
        const float y = Y[t * ldy + r];
        const double float_tol = 1e-5 * budget[t].mag[r] + 1e-30;
        const double tol = (quant_acts ? budget[t].acts[r] : 0.0) + float_tol;
        const double err = std::fabs(static_cast<double>(y) - ref_y[t][r]);
        if (!(err <= tol)) {
          ADD_FAILURE() << "token " << t << " row " << r << ": " << y << " vs reference " << ref_y[t][r] << " (err "
                        << err << " > " << tol << ")";
          ++failures;
        }
        if (quant_acts) {
          const double err_hat = std::fabs(static_cast<double>(y) - ref_yhat[t][r]);
          if (!(err_hat <= float_tol)) {
            ADD_FAILURE() << "token " << t << " row " << r << ": " << y << " vs reference on int16 activations "
                          << ref_yhat[t][r] << " (err " << err_hat << " > " << float_tol << ")";
            ++failures;
          }
        }
      }
    }
  }
}

TEST_P(QuantTypes, MatmulModelShapes) {
  const GgmlType type = GetParam();
  uint32_t seed = 300 + static_cast<uint32_t>(type) * 1000;
  for (const auto& s : model_shapes(type))
    for (int n_tok : {8, 16})
      if (n_tok == 8 || s[0] < 16384) check_matmul(type, s[0], s[1], n_tok, seed += 23);  // lm_heads: 8 rows only
}

TEST_P(QuantTypes, MatvecOddShapes) {
  // Odd block counts (a lone tail block in the paired AVX-512 loop), float rows with a partial vector tail,
  // row counts that leave tile remainders.
  const GgmlType type = GetParam();
  if (is_k_quant(type)) {
    check_matvec(type, 7, 256, 11);
    check_matvec(type, 13, 768, 12);
    check_matvec(type, 37, 1280, 13);
  } else if (is_quantized(type)) {
    check_matvec(type, 7, 32, 11);
    check_matvec(type, 13, 96, 12);
    check_matvec(type, 37, 224, 13);
  } else {
    check_matvec(type, 7, 37, 14);
    check_matvec(type, 13, 100, 15);
    check_matvec(type, 37, 576, 16);
  }
}

TEST_P(QuantTypes, MatmulEqualsPerTokenMatvec) {
  const GgmlType type = GetParam();
  const std::vector<std::array<int64_t, 2>> shapes =
      is_k_quant(type) ? std::vector<std::array<int64_t, 2>>{{640, 1024}, {896, 4864}}
                       // 130x4864: rows past the last 4-row tile, and 64 tokens in two token blocks of the AVX2
                       // prompt tiles (token_tiles.h), whose packed activations are capped per block.
                       : std::vector<std::array<int64_t, 2>>{{576, 576}, {1536, 576}, {576, 1536}, {130, 4864}};
  uint32_t seed = 7 + static_cast<uint32_t>(type) * 1000;
  for (const auto& s : shapes) {
    const int64_t rows = s[0], cols = s[1];
    const Matrix m = random_matrix(type, rows, cols, seed += 31);
    for (int n_tok : {1, 3, 8, 17, 64}) {
      SCOPED_TRACE(testing::Message() << type_name(type) << " " << rows << "x" << cols << " n_tok=" << n_tok);
      const std::vector<float> X = random_acts(n_tok * cols, seed + n_tok);
      const int64_t ldy = rows + 5;  // a gap after each token's row catches writes past r1
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(isa_name(isa));
        const bool quant_acts = uses_quantized_acts(isa, type);
        std::vector<block_q16_act> Xq(n_tok * cols / 32);
        if (quant_acts) quantize_acts(isa, X.data(), n_tok * cols, Xq.data());
        std::vector<float> Y(n_tok * ldy, kPoison);
        matmul(isa, m.view, X.data(), quant_acts ? Xq.data() : nullptr, n_tok, Y.data(), ldy, 0, rows);
        std::vector<float> Ypart(n_tok * ldy, kPoison);
        const int64_t r0 = rows / 4 + 3, r1 = rows - rows / 5 - 1;
        matmul(isa, m.view, X.data(), quant_acts ? Xq.data() : nullptr, n_tok, Ypart.data(), ldy, r0, r1);
        std::vector<float> y(rows, kPoison);
        for (int t = 0; t < n_tok; ++t) {
          matvec(isa, m.view, X.data() + t * cols, quant_acts ? Xq.data() + t * cols / 32 : nullptr, y.data(), 0,
                 rows);
          for (int64_t r = 0; r < ldy; ++r) {
            const float v = Y[t * ldy + r], vp = Ypart[t * ldy + r];
            if (r >= rows) {
              ASSERT_TRUE(is_poison(v)) << "token " << t << ": write in the gap at " << r;
              ASSERT_TRUE(is_poison(vp)) << "token " << t << ": write in the gap at " << r;
              continue;
            }
            // Same numerics: every output is the same operation sequence as the per-token matvec.
            ASSERT_TRUE(same_bits(v, y[r])) << "token " << t << " row " << r << ": " << v << " vs matvec " << y[r];
            if (r >= r0 && r < r1) {
              ASSERT_TRUE(same_bits(vp, y[r])) << "token " << t << " row " << r << " (partial range)";
            } else {
              ASSERT_TRUE(is_poison(vp)) << "token " << t << " row " << r << " written outside the range";
            }
          }
        }
      }
    }
  }
}

// Lane rows (kernels.h: Q4_0 repacked for the AVX2 single-token matvec) at every model shape and a few odd ones: the
// reference on the same int16 activations within float rounding, and bit for bit what matvec gives on the GGUF
// rows (so decode, prompts and batch rows keep agreeing), full range and a mid-matrix range, nothing written
// outside it.
TEST(LaneRows, MatchMatvecAndReferenceAtModelShapes) {
  if (!lane_rows_supported(Isa::Avx2, GgmlType::Q4_0)) GTEST_SKIP() << "no AVX2 here";
  const Isa isa = Isa::Avx2;
  std::vector<std::array<int64_t, 2>> shapes = model_shapes(GgmlType::Q4_0);
  for (const auto& odd : std::vector<std::array<int64_t, 2>>{{7, 32}, {13, 96}, {37, 224}, {5, 256}, {9, 4864}})
    shapes.push_back(odd);
  uint32_t seed = 900;
  for (const auto& s : shapes) {
    const int64_t rows = s[0], cols = s[1];
    SCOPED_TRACE(testing::Message() << "Q4_0 " << rows << "x" << cols);
    const Matrix m = random_matrix(GgmlType::Q4_0, rows, cols, seed += 13);
    const std::vector<float> x = random_acts(cols, seed + 1);
    std::vector<block_q16_act> xq(cols / 32);
    quantize_acts(isa, x.data(), cols, xq.data());
    std::vector<float> ref_yhat(rows);
    const std::vector<float> xhat = dequantize_acts(xq);
    ref::matvec(m.view, xhat.data(), ref_yhat.data(), 0, rows);
    const RowBudget budget = row_budget(m.view, x.data(), &xq, 0, rows);
    std::vector<float> y(rows);
    matvec(isa, m.view, x.data(), xq.data(), y.data(), 0, rows);

    std::vector<uint8_t> packed(rows * m.view.row_stride());
    pack_lane_rows(isa, m.view, packed.data());
    const WeightView pv{GgmlType::Q4_0, packed.data(), rows, cols};
    std::vector<uint8_t> acts_buf(lane_acts_bytes(cols) + 32);
    void* acts = acts_buf.data() + (32 - reinterpret_cast<uintptr_t>(acts_buf.data()) % 32) % 32;
    pack_lane_acts(isa, xq.data(), cols, acts);

    constexpr int kGuard = 4;
    std::vector<float> buf(rows + 2 * kGuard, kPoison);
    float* yl = buf.data() + kGuard;
    matvec_lane_rows(isa, pv, acts, yl, 0, rows);
    for (int i = 0; i < kGuard; ++i) {
      ASSERT_TRUE(is_poison(buf[i])) << "write before y";
      ASSERT_TRUE(is_poison(buf[kGuard + rows + i])) << "write past y";
    }
    for (int64_t r = 0; r < rows; ++r) {
      const double float_tol = 1e-5 * budget.mag[r] + 1e-30;
      ASSERT_LE(std::fabs(static_cast<double>(yl[r]) - ref_yhat[r]), float_tol) << "row " << r << " vs reference";
      ASSERT_TRUE(same_bits(yl[r], y[r])) << "row " << r << ": " << yl[r] << " vs matvec " << y[r];
    }
    const int64_t r0 = rows / 3 + 1, r1 = 2 * rows / 3 + 3 < rows ? 2 * rows / 3 + 3 : rows;
    std::vector<float> part(rows, kPoison);
    matvec_lane_rows(isa, pv, acts, part.data(), r0, r1);
    for (int64_t r = 0; r < rows; ++r) {
      if (r >= r0 && r < r1) {
        ASSERT_TRUE(same_bits(part[r], y[r])) << "row " << r << " differs in a partial range";
      } else {
        ASSERT_TRUE(is_poison(part[r])) << "row " << r << " written outside [" << r0 << ", " << r1 << ")";
      }
    }
  }
}

TEST(LaneRows, OnlyAvx2Q4_0) {
  EXPECT_FALSE(lane_rows_supported(Isa::Scalar, GgmlType::Q4_0));
  EXPECT_FALSE(lane_rows_supported(Isa::Avx512, GgmlType::Q4_0));
  EXPECT_FALSE(lane_rows_supported(Isa::Avx2, GgmlType::Q4_1));
}

// Slot rows (kernels.h: Q4_0 / Q4_1 / Q8_0 repacked for the 8-token tiles of batched decode steps and prompts)
// at every model shape and a few odd ones, at the row counts of a batch step (8), a short prompt (17: a partial second
// tile) and a few tokens (3: padding lanes): bit for bit what per-token matvec gives on the GGUF rows (so batch rows
// equal solo decode), the reference on the same int16 activations within float rounding, full range and a mid-matrix
// range with odd bounds (the one-row tail tiles), nothing written outside it.
TEST(SlotRows, MatchMatvecAndReferenceAtModelShapes) {
  if (!isa_supported(Isa::Avx2)) GTEST_SKIP() << "no AVX2 here";
  for (Isa isa : supported_isas()) {
    if (isa == Isa::Scalar) continue;
    SCOPED_TRACE(isa_name(isa));
    for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
      std::vector<std::array<int64_t, 2>> shapes = model_shapes(type);
      for (const auto& odd : std::vector<std::array<int64_t, 2>>{{7, 64}, {13, 192}, {37, 448}, {9, 4864}})
        shapes.push_back(odd);
      uint32_t seed = 1900 + static_cast<uint32_t>(type) * 100;
      for (const auto& s : shapes) {
        const int64_t rows = s[0], cols = s[1];
        const Matrix m = random_matrix(type, rows, cols, seed += 13);
        ASSERT_TRUE(slot_rows_supported(isa, m.view));
        std::vector<uint8_t> packed(rows * m.view.row_stride());
        pack_slot_rows(isa, m.view, packed.data());
        const WeightView pv{type, packed.data(), rows, cols};
        for (int n_tok : {8, 17, 3}) {
          if (n_tok != 8 && rows >= 16384) continue;  // lm_heads: 8 rows only
          SCOPED_TRACE(testing::Message() << type_name(type) << " " << rows << "x" << cols << " n_tok=" << n_tok);
          const std::vector<float> X = random_acts(n_tok * cols, seed + n_tok);
          std::vector<block_q16_act> Xq(n_tok * cols / 32);
          quantize_acts(isa, X.data(), n_tok * cols, Xq.data());
          const int64_t ldy = rows + 3;  // a gap after each token's row catches writes past r1
          std::vector<float> Y(n_tok * ldy, kPoison), Ypart(n_tok * ldy, kPoison);
          matmul_slot_rows(isa, pv, Xq.data(), n_tok, Y.data(), ldy, 0, rows);
          const int64_t r0 = rows / 4 + 3 < rows ? rows / 4 + 3 : 0, r1 = rows - rows / 5 - 1 > r0 ? rows - rows / 5 - 1 : rows;
          matmul_slot_rows(isa, pv, Xq.data(), n_tok, Ypart.data(), ldy, r0, r1);
          std::vector<float> y(rows), ref_yhat(rows);
          for (int t = 0; t < n_tok; ++t) {
            const block_q16_act* xq = Xq.data() + t * cols / 32;
            matvec(isa, m.view, X.data() + t * cols, xq, y.data(), 0, rows);
            const std::vector<block_q16_act> xq_t(xq, xq + cols / 32);
            const std::vector<float> xhat = dequantize_acts(xq_t);
            ref::matvec(m.view, xhat.data(), ref_yhat.data(), 0, rows);
            const RowBudget budget = row_budget(m.view, X.data() + t * cols, &xq_t, 0, rows);
            for (int64_t r = 0; r < ldy; ++r) {
              const float v = Y[t * ldy + r], vp = Ypart[t * ldy + r];
              if (r >= rows) {
                ASSERT_TRUE(is_poison(v) && is_poison(vp)) << "token " << t << ": write in the gap at " << r;
                continue;
              }
              ASSERT_TRUE(same_bits(v, y[r])) << "token " << t << " row " << r << ": " << v << " vs matvec " << y[r];
              ASSERT_LE(std::fabs(static_cast<double>(v) - ref_yhat[r]), 1e-5 * budget.mag[r] + 1e-30)
                  << "token " << t << " row " << r << " vs reference";
              if (r >= r0 && r < r1) {
                ASSERT_TRUE(same_bits(vp, y[r])) << "token " << t << " row " << r << " (partial range)";
              } else {
                ASSERT_TRUE(is_poison(vp)) << "token " << t << " row " << r << " written outside the range";
              }
            }
          }
        }
      }
    }
  }
}

TEST(SlotRows, OnlySimdLegacyTypesOfEvenBlockCounts) {
  uint8_t dummy[64] = {};
  EXPECT_FALSE(slot_rows_supported(Isa::Scalar, WeightView{GgmlType::Q4_1, dummy, 1, 64}));
  for (Isa isa : supported_isas()) {
    if (isa == Isa::Scalar) continue;
    EXPECT_TRUE(slot_rows_supported(isa, WeightView{GgmlType::Q4_1, dummy, 1, 64}));
    EXPECT_TRUE(slot_rows_supported(isa, WeightView{GgmlType::Q8_0, dummy, 1, 64}));
    EXPECT_FALSE(slot_rows_supported(isa, WeightView{GgmlType::Q4_1, dummy, 1, 96}));  // 3 blocks a row
    EXPECT_FALSE(slot_rows_supported(isa, WeightView{GgmlType::Q5_0, dummy, 1, 64}));
    EXPECT_FALSE(slot_rows_supported(isa, WeightView{GgmlType::Q4_K, dummy, 1, 256}));
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantTypes,
                         ::testing::Values(GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F32,
                                           GgmlType::F16, GgmlType::BF16, GgmlType::Q5_0, GgmlType::Q5_1,
                                           GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q2_K,
                                           GgmlType::Q3_K),
                         type_param_name);

TEST(QuantizeActs, RoundTripAndIdenticalAcrossIsas) {
  const int64_t n = 1536;
  std::vector<float> x = random_acts(n, 5);
  for (int j = 64; j < 96; ++j) x[j] = 0.f;  // one all-zero block: d = 0, no division by zero
  x[200] = -1e4f;                           // a large negative extreme
  std::vector<block_q16_act> ref(n / 32);
  quantize_acts(Isa::Scalar, x.data(), n, ref.data());
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    std::vector<block_q16_act> q(n / 32);
    std::memset(q.data(), 0x5a, q.size() * sizeof(block_q16_act));  // poison
    quantize_acts(isa, x.data(), n, q.data());
    for (int64_t b = 0; b < n / 32; ++b) {
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[b * 32 + j]));
      ASSERT_EQ(q[b].d, amax / 32767.f) << "block " << b;
      int sum = 0, qmax = 0;
      for (int j = 0; j < 32; ++j) {
        const int v = q[b].qs[j];
        sum += v;
        qmax = std::max(qmax, std::abs(v));
        ASSERT_LE(std::abs(v), 32767);
        // Round to nearest: off by at most half a step, plus the rounding of x/d itself (half an ulp of a
        // float below 32768: 2^-10 steps). Checked in double so the check adds no rounding of its own.
        const double err = std::fabs(static_cast<double>(x[b * 32 + j]) - static_cast<double>(q[b].d) * v);
        ASSERT_LE(err, q[b].d * (0.5 + 1.0 / 1024)) << "block " << b << " j " << j;
      }
      ASSERT_EQ(qmax, amax == 0.f ? 0 : 32767) << "the largest element maps to +-32767";
      ASSERT_EQ(q[b].s, q[b].d * static_cast<float>(sum));
      ASSERT_EQ(std::memcmp(&q[b], &ref[b], sizeof(block_q16_act)), 0) << "block " << b << " differs from scalar";
    }
    EXPECT_EQ(q[2].d, 0.f);
    EXPECT_EQ(q[2].s, 0.f);
  }
}

// The integer path at its limits: every activation at +-amax (so every q is +-32767) against weights at their
// extremes (Q4_0 nibbles 0 and 15, i.e. -8 and 7; Q4_1 nibbles 0 and 15; Q8_0 bytes -128 and 127). Any int16
// saturation or int32 overflow would show as a gross error against the reference on the same activations.
TEST(QuantizedDot, ExtremeValuesDoNotOverflow) {
  const int64_t rows = 37, cols = 1536;
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> coin(0, 1);
  std::vector<float> x(cols);
  for (float& v : x) v = coin(rng) ? 3.5f : -3.5f;
  std::vector<block_q16_act> xq(cols / 32);
  quantize_acts(Isa::Scalar, x.data(), cols, xq.data());
  for (const block_q16_act& b : xq)
    for (int16_t q : b.qs) ASSERT_EQ(std::abs(q), 32767);
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
    SCOPED_TRACE(type_name(type));
    Matrix m = random_matrix(type, rows, cols, 22);
    // Keep the random fp16 scales (and mins); set every quant to an extreme, in most blocks the one whose sign
    // matches the activation's (7 times in 8), so the products are large and add up (the worst case for the
    // integer partial sums); in the other blocks the opposite, so the sums run negative.
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols / 32; ++k) {
        const bool agree = coin(rng);
        uint8_t* blk = m.bytes.data() + r * m.view.row_stride() + k * row_bytes(type, 32);
        for (int j = 0; j < 32; ++j) {
          const bool positive = (x[k * 32 + j] > 0) == (agree == (rng() % 8 != 0));
          if (type == GgmlType::Q8_0) {
            reinterpret_cast<block_q8_0*>(blk)->qs[j] = static_cast<int8_t>(positive ? 127 : -128);
          } else {
            uint8_t& byte = blk[(type == GgmlType::Q4_1 ? 4 : 2) + j % 16];
            const uint8_t nib = positive ? 15 : 0;
            byte = static_cast<uint8_t>(j < 16 ? (byte & 0xF0) | nib : (byte & 0x0F) | nib << 4);
          }
        }
      }
    }
    const std::vector<float> xhat = dequantize_acts(xq);
    std::vector<float> ref_yhat(rows);
    ref::matvec(m.view, xhat.data(), ref_yhat.data(), 0, rows);
    const RowBudget budget = row_budget(m.view, x.data(), &xq, 0, rows);
    for (Isa isa : supported_isas()) {
      if (!uses_quantized_acts(isa, type)) continue;
      SCOPED_TRACE(isa_name(isa));
      std::vector<float> y(rows, kPoison);
      matvec(isa, m.view, x.data(), xq.data(), y.data(), 0, rows);
      for (int64_t r = 0; r < rows; ++r) {
        const double err = std::fabs(static_cast<double>(y[r]) - ref_yhat[r]);
        ASSERT_LE(err, 1e-5 * budget.mag[r]) << "row " << r << ": " << y[r] << " vs " << ref_yhat[r];
      }
    }
  }
}

// Every kernel test above runs each ISA this CPU supports and silently leaves out the others; this one test says so
// (a skip in the ctest output) when a path could not be checked here, e.g. AVX-512 on an AVX2-only machine.
TEST(Dispatch, EveryIsaPathRanHere) {
  std::string missing;
  for (Isa isa : {Isa::Avx2, Isa::Avx512})
    if (!isa_supported(isa)) missing += std::string(missing.empty() ? "" : ", ") + isa_name(isa);
  if (!missing.empty())
    GTEST_SKIP() << "kernel tests skipped the " << missing << " path(s): this CPU lacks the instructions (best: "
                 << isa_name(best_isa()) << "); they were compiled but not run";
}

TEST(Dispatch, MissingQuantizedActivationsThrow) {
  const Matrix m = random_matrix(GgmlType::Q4_0, 4, 64, 3);
  const std::vector<float> x = random_acts(64, 4);
  std::vector<float> y(4);
  for (Isa isa : supported_isas()) {
    if (uses_quantized_acts(isa, GgmlType::Q4_0)) {
      EXPECT_THROW(matvec(isa, m.view, x.data(), nullptr, y.data(), 0, 4), EngineError);
    }
    EXPECT_THROW(matvec(isa, m.view, x.data(), nullptr, y.data(), 0, 5), EngineError);  // r1 > rows
  }
}

TEST(Dispatch, IsaEnvOverride) {
  unsetenv("METALATTN_CPU_ISA");
  EXPECT_EQ(selected_isa(), best_isa());
  EXPECT_TRUE(isa_supported(Isa::Scalar));
#ifdef METALATTN_X86
  EXPECT_NE(best_isa(), Isa::Scalar) << "every x86-64 machine we run on has at least AVX2";
#endif
  const struct { const char* value; Isa isa; } cases[] = {
      {"scalar", Isa::Scalar}, {"avx2", Isa::Avx2}, {"avx512", Isa::Avx512}};
  for (const auto& c : cases) {
    setenv("METALATTN_CPU_ISA", c.value, 1);
    if (isa_supported(c.isa)) {
      EXPECT_EQ(selected_isa(), c.isa) << c.value;
      EXPECT_STREQ(isa_name(c.isa), c.value);
    } else {
      EXPECT_THROW(selected_isa(), EngineError) << c.value;
    }
  }
  for (const char* bad : {"AVX512", "sse", "avx-512", " avx2"}) {
    setenv("METALATTN_CPU_ISA", bad, 1);
    try {
      selected_isa();
      ADD_FAILURE() << "no error for METALATTN_CPU_ISA=" << bad;
    } catch (const EngineError& e) {
      EXPECT_NE(std::string(e.what()).find("METALATTN_CPU_ISA"), std::string::npos) << e.what();
    }
  }
  unsetenv("METALATTN_CPU_ISA");
  EXPECT_EQ(selected_isa(), best_isa());
}

// ---------------------------------------------------------------- fp16 rounding of the K/V cache

#if defined(METALATTN_X86)
// F16C's conversion of 4 floats, round to nearest even whatever MXCSR says.
__attribute__((target("f16c"))) void hardware_fp16(const float* x, uint16_t* out) {
  const __m128i h = _mm_cvtps_ph(_mm_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(out, &h, 8);
}
#endif

// float_to_fp16_rne (quant.h: the CPU backend's K/V appends) against F16C bit for bit, NaNs included (F16C keeps a
// NaN's sign and top mantissa bits and sets the quiet bit; the CUDA backend's __float2half_rn gives a NaN too): the
// special values, every half and every midpoint between neighbouring halves with the floats either side of it (all
// the rounding boundaries, subnormal and overflow ones included), and 4 million random bit patterns.
TEST(Fp16Rounding, BitIdenticalToF16c) {
#if defined(METALATTN_X86)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C here";
  auto bits = [](uint32_t b) { return __builtin_bit_cast(float, b); };
  std::vector<float> xs = {0.f, -0.f, INFINITY, -INFINITY, std::nanf(""), -std::nanf(""), bits(0x7f800001u),
                           bits(0xff800001u), bits(0x7fbfffffu), bits(0x7fc00001u), bits(0x7fffe000u),
                           bits(0x7fffffffu),
                           65504.f, -65504.f, 65505.f, 65519.f, std::nextafter(65520.f, 0.f), 65520.f, -65520.f,
                           std::nextafter(65520.f, INFINITY), 65536.f, 1e10f, 3.4028235e38f, -3.4028235e38f,
                           std::ldexp(1.f, -14), std::nextafter(std::ldexp(1.f, -14), 0.f),
                           std::ldexp(1023.5f, -24), std::ldexp(1022.5f, -24),  // the largest subnormal's ties
                           std::ldexp(1.f, -24), std::ldexp(1.f, -25), std::nextafter(std::ldexp(1.f, -25), 1.f),
                           std::nextafter(std::ldexp(1.f, -25), 0.f), std::ldexp(1.5f, -24), std::ldexp(2.5f, -24),
                           -std::ldexp(1.5f, -24), 1.f + std::ldexp(1.f, -11), 1.f + std::ldexp(3.f, -11), 2049.f,
                           2051.f, -2049.f, 1.17549435e-38f, 1e-45f, -1e-45f, 0.1f, -0.333333f, 3.14159265f};
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float a = fp16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(a)) continue;
    xs.push_back(a);
    if ((h & 0x7fffu) < 0x7c00u) {  // finite: the midpoint to the next half away from 0 (65520 after 65504)
      const float b = (h & 0x7fffu) == 0x7bffu ? std::copysign(65536.f, a)
                                                 : fp16_to_float(static_cast<uint16_t>(h + 1));
      const float mid = a + (b - a) / 2;  // exact: a float has 13 more mantissa bits than a half
      xs.insert(xs.end(), {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 2 * b)});
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 4 << 20; ++i) xs.push_back(bits(static_cast<uint32_t>(rng())));
  while (xs.size() % 4 != 0) xs.push_back(1.f);
  uint16_t hw[4];
  int mismatches = 0;
  for (size_t i = 0; i < xs.size(); i += 4) {
    hardware_fp16(&xs[i], hw);
    for (int j = 0; j < 4; ++j) {
      const uint16_t ours = float_to_fp16_rne(xs[i + j]);
      if (ours != hw[j] && ++mismatches <= 10)
        ADD_FAILURE() << std::hexfloat << xs[i + j] << " (bits 0x" << std::hex
                      << __builtin_bit_cast(uint32_t, xs[i + j]) << "): ours 0x" << ours << ", F16C 0x" << hw[j];
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << xs.size() << " values";
  EXPECT_GT(xs.size(), (4u << 20) + 4 * 60000u);
#else
  GTEST_SKIP() << "not an x86 build";
#endif
}

// ---------------------------------------------------------------- attention of a GQA group

// One KV head's cache in the backend's layout, fp16 (float_to_fp16_rne of random floats, as the backend appends
// them): K transposed in blocks of 16 positions (k_t[p / 16][j][p % 16]), V row-major (row stride head_dim); and the
// rounded values as plain float [n_pos][head_dim] matrices for the reference.
struct HeadCache {
  int k_cap;
  std::vector<float> k_rows, v_rows;
  std::vector<uint16_t> k_t, v;
};
HeadCache random_head_cache(int n_pos, int head_dim, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  HeadCache c;
  c.k_cap = (n_pos + 15) / 16 * 16 + 16;
  c.k_rows.resize(static_cast<size_t>(n_pos) * head_dim);
  c.v_rows.resize(static_cast<size_t>(n_pos) * head_dim);
  c.v.assign(static_cast<size_t>(c.k_cap) * head_dim, 0x7fffu);  // a NaN: rows past n_pos must not be read
  c.k_t.assign(static_cast<size_t>(c.k_cap) * head_dim, 0);      // (K past n_pos may be read, its scores unused)
  for (int p = 0; p < n_pos; ++p)
    for (int j = 0; j < head_dim; ++j) {
      const size_t i = static_cast<size_t>(p) * head_dim + j;
      const uint16_t k = float_to_fp16_rne(u(rng)), v = float_to_fp16_rne(u(rng));
      c.k_t[static_cast<size_t>(p / 16) * 16 * head_dim + 16 * j + p % 16] = k;
      c.v[i] = v;
      c.k_rows[i] = fp16_to_float(k);
      c.v_rows[i] = fp16_to_float(v);
    }
  return c;
}

// Attention piece by piece (AttendFns on [k P, (k + 1) P), P = kAttentionPiece, folded with attention_fold and
// divided with attention_finish, as the backend does) over an fp16 cache against the float reference over the visible
// positions (the cache's values widened to float: the reading is exact, so the bound is the float one), on every
// ISA, for group sizes 1-8, head_dim 64 / 128 / 256, with and without a sliding window; and a prompt tile's rows (T =
// kQueryTile) bit for bit equal to the same rows decoded one at a time.
TEST(Attention, PiecesFoldToTheReferenceAndTilesEqualSingleRows) {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  constexpr int P = kAttentionPiece, T = kQueryTile;
  for (Isa isa : supported_isas())
    for (int group : {1, 3, 4, 8})
      for (int head_dim : {64, 128, 256})
        for (int n_last : {5, 300, 600, 1029})  // the tile's rows see n_last - T + 1 .. n_last positions
          for (int window : {0, 200}) {
            SCOPED_TRACE(std::string(isa_name(isa)) + " group " + std::to_string(group) + " head_dim " +
                         std::to_string(head_dim) + " n_last " + std::to_string(n_last) + " window " +
                         std::to_string(window));
            const HeadCache c = random_head_cache(n_last, head_dim, rng);
            const int n_pos0 = n_last - T + 1;
            std::vector<float> q(static_cast<size_t>(T) * group * head_dim);  // row stride group * head_dim
            for (float& x : q) x = u(rng);
            const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
            const AttendFns fns = attend_fns(isa, group);
            std::vector<float> scores(static_cast<size_t>(T) * group * c.k_cap);
            const int row = group * head_dim;
            // rows[T_used][t]: row t's outputs from tiles of T_used rows (1: each row alone).
            std::vector<float> rows[2];
            for (int pass = 0; pass < 2; ++pass) {
              const int tile = pass == 0 ? 1 : T;
              rows[pass].assign(static_cast<size_t>(T) * row, kPoison);
              for (int t0 = 0; t0 < T; t0 += tile) {
                std::vector<float> run_o(static_cast<size_t>(tile) * row), run_ml(tile * group * 2);
                for (int r = 0; r < tile * group; ++r)
                  attention_begin(&run_o[static_cast<size_t>(r) * head_dim], &run_ml[2 * r], head_dim);
                std::vector<float> o(static_cast<size_t>(tile) * row, kPoison), ml(tile * group * 2, kPoison);
                const int n0 = n_pos0 + t0, lo = window > 0 ? std::max(0, n0 - window) : 0;
                for (int k = lo / P; k <= (n0 + tile - 2) / P; ++k) {
                  (tile == 1 ? fns.one : fns.tile)(&q[static_cast<size_t>(t0) * row], row, c.k_t.data(), c.k_cap,
                                                   c.v.data(), head_dim, n0, window, k * P, (k + 1) * P, head_dim,
                                                   scale, scores.data(), c.k_cap, o.data(), row, ml.data());
                  for (int r = 0; r < tile * group; ++r)
                    attention_fold(&run_o[static_cast<size_t>(r) * head_dim], &run_ml[2 * r],
                                   &o[static_cast<size_t>(r) * head_dim], &ml[2 * r], head_dim);
                }
                for (int r = 0; r < tile * group; ++r)
                  attention_finish(&run_o[static_cast<size_t>(r) * head_dim], &run_ml[2 * r], head_dim,
                                   &rows[pass][static_cast<size_t>(t0) * row + static_cast<size_t>(r) * head_dim]);
              }
            }
            for (int t = 0; t < T; ++t) {
              const int n = n_pos0 + t, lo = window > 0 ? std::max(0, n - window) : 0;
              std::vector<float> expect(row);
              ref::attention(&q[static_cast<size_t>(t) * row], c.k_rows.data() + static_cast<size_t>(lo) * head_dim,
                             c.v_rows.data() + static_cast<size_t>(lo) * head_dim, group, 1, head_dim, n - lo,
                             expect.data());
              for (int k = 0; k < row; ++k) {
                const size_t i = static_cast<size_t>(t) * row + k;
                ASSERT_NEAR(rows[0][i], expect[k], 2e-5f) << "row " << t << " element " << k;
                ASSERT_TRUE(same_bits(rows[1][i], rows[0][i])) << "tile row " << t << " element " << k;
              }
            }
          }
}

// The logits' argmax (greedy decoding on the CPU) against ref::argmax on every ISA, at the vocabularies the models use
// and at lengths around the vector widths, with NaN sprinkled in, the largest value repeated (the first index wins),
// NaN and -inf only (the first -inf), +inf, and every logit NaN (NonFiniteLogits).
TEST(VecOps, ArgmaxLogitsEqualsTheReference) {
  std::mt19937 rng(41);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (Isa isa : supported_isas())
    for (int n : {1, 7, 8, 15, 16, 17, 33, 1000, 49152, 151936, 262144})
      for (int kind = 0; kind < 5; ++kind) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " n " + std::to_string(n) + " kind " + std::to_string(kind));
        std::vector<float> x(n);
        for (float& v : x) v = nd(rng);
        std::uniform_int_distribution<int> at(0, n - 1);
        if (kind == 1)  // NaN in a tenth of the places, the largest value at three places
          for (int k = 0; k < n / 10; ++k) x[at(rng)] = kPoison;
        if (kind == 1 || kind == 2) {
          const float top = 40.f;
          for (int k = 0; k < 3; ++k) x[at(rng)] = top;
        }
        if (kind == 3)  // nothing but NaN and -inf
          for (float& v : x) v = at(rng) % 2 ? -INFINITY : kPoison;
        if (kind == 4) x[at(rng)] = INFINITY;
        ArgmaxResult want{}, got{};
        bool none = false;
        try {
          want = ref::argmax(x.data(), n);
        } catch (const NonFiniteLogits&) {
          none = true;
        }
        if (none) {
          EXPECT_THROW(argmax_logits(isa, x.data(), n), NonFiniteLogits);
          continue;
        }
        got = argmax_logits(isa, x.data(), n);
        EXPECT_EQ(got.token, want.token);
        EXPECT_TRUE(same_bits(got.value, want.value));
      }
  for (Isa isa : supported_isas()) {
    std::vector<float> x(40, kPoison);
    EXPECT_THROW(argmax_logits(isa, x.data(), 40), NonFiniteLogits) << isa_name(isa);
    x[37] = -INFINITY;
    EXPECT_EQ(argmax_logits(isa, x.data(), 40).token, 37u) << isa_name(isa);
  }
}

// Sampling weights: exp((x - m) * inv_t) within the float form's error of the double one, exactly 0 for NaN and -inf,
// and their sum that of the weights (float lanes of 64 terms each), on every ISA.
TEST(VecOps, ExpWeightsMatchTheDoubleForm) {
  std::mt19937 rng(43);
  std::normal_distribution<float> nd(0.f, 4.f);
  for (Isa isa : supported_isas())
    for (int n : {1, 15, 16, 17, 1023, 1024, 1025, 49152, 262144}) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " n " + std::to_string(n));
      std::vector<float> x(n), w(n, kPoison);
      for (float& v : x) v = nd(rng);
      std::uniform_int_distribution<int> at(0, n - 1);
      for (int k = 0; k < n / 50; ++k) x[at(rng)] = k % 2 ? -INFINITY : kPoison;
      const float m = 9.f, inv_t = 1.f / 0.7f;
      const double sum = exp_weights(isa, x.data(), n, m, inv_t, w.data());
      double want_sum = 0, w_sum = 0;
      for (int i = 0; i < n; ++i) {
        w_sum += w[i];
        if (std::isnan(x[i]) || x[i] == -INFINITY) {
          ASSERT_EQ(w[i], 0.f) << "at " << i;
          continue;
        }
        const double arg = (static_cast<double>(x[i]) - m) * inv_t, want = std::exp(arg);
        want_sum += want;
        // The exponent is formed in float (a relative error of a few 1e-8 of |arg|), then fast_exp's ~1e-7.
        ASSERT_NEAR(w[i], want, want * (2e-7 + 2e-7 * std::fabs(arg))) << "at " << i << " x " << x[i];
      }
      EXPECT_NEAR(sum, w_sum, 4e-6 * w_sum);       // float lanes of 64 terms each, then double
      EXPECT_NEAR(sum, want_sum, 1e-5 * want_sum);  // and the weights' own error
    }
}

// Folding: a piece that saw nothing (-inf, 0) changes nothing; two pieces fold to the softmax of both.
TEST(Attention, FoldOfEmptyAndOfTwoPieces) {
  std::vector<float> o{kPoison, kPoison}, ml{kPoison, kPoison};
  attention_begin(o.data(), ml.data(), 2);
  EXPECT_EQ(o, (std::vector<float>{0.f, 0.f}));
  EXPECT_EQ(ml[1], 0.f);
  const std::vector<float> none_o{0.f, 0.f}, none_ml{-INFINITY, 0.f};
  attention_fold(o.data(), ml.data(), none_o.data(), none_ml.data(), 2);
  EXPECT_EQ(ml[0], -INFINITY);
  // Piece a: one position, score 1, value (1, 2); piece b: one position, score 3, value (5, -1).
  const std::vector<float> a_o{1.f, 2.f}, a_ml{1.f, 1.f}, b_o{5.f, -1.f}, b_ml{3.f, 1.f};
  attention_fold(o.data(), ml.data(), a_o.data(), a_ml.data(), 2);
  attention_fold(o.data(), ml.data(), none_o.data(), none_ml.data(), 2);
  attention_fold(o.data(), ml.data(), b_o.data(), b_ml.data(), 2);
  std::vector<float> out(2);
  attention_finish(o.data(), ml.data(), 2, out.data());
  const double wa = std::exp(1.0) / (std::exp(1.0) + std::exp(3.0)), wb = 1.0 - wa;
  EXPECT_NEAR(out[0], wa * 1 + wb * 5, 1e-6);
  EXPECT_NEAR(out[1], wa * 2 + wb * -1, 1e-6);
  EXPECT_EQ(ml[0], 3.f);
}

// ---------------------------------------------------------------- thread pool

TEST(ThreadPool, EveryIndexExactlyOncePerRun) {
  for (int n : {1, 2, 3, 4}) {
    ThreadPool pool(n);
    ASSERT_EQ(pool.size(), n);
    std::vector<std::atomic<int>> hits(n);
    std::atomic<int> bad_n{0};
    for (int run = 0; run < 5000; ++run) {
      for (auto& h : hits) h.store(0);
      pool.parallel([&](int i, int nt) {
        if (nt != n) bad_n.fetch_add(1);
        hits[i].fetch_add(1);
      });
      for (int i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "run " << run << " thread " << i << " of " << n;
    }
    EXPECT_EQ(bad_n.load(), 0);
  }
}

TEST(ThreadPool, ParallelSumsAreCorrect) {
  ThreadPool pool(0);
  EXPECT_EQ(pool.size(), ThreadPool::physical_cores());
  const int64_t n = 100003;
  std::vector<int64_t> data(n);
  for (int64_t i = 0; i < n; ++i) data[i] = i * 7 - 3;
  const int64_t expected = 7 * (n - 1) * n / 2 - 3 * n;
  std::vector<int64_t> partial(pool.size());
  for (int run = 0; run < 200; ++run) {
    std::fill(partial.begin(), partial.end(), -1);
    pool.parallel([&](int i, int nt) {
      int64_t b, e;
      split_range(n, i, nt, 16, &b, &e);
      int64_t s = 0;
      for (int64_t k = b; k < e; ++k) s += data[k];
      partial[i] = s;
    });
    int64_t total = 0;
    for (int64_t p : partial) total += p;
    ASSERT_EQ(total, expected) << "run " << run;
  }
}

TEST(ThreadPool, WakesAfterSleepingAndDestroysWhileIdle) {
  {
    ThreadPool pool(2);  // destroyed at once, workers possibly not started yet
  }
  {
    ThreadPool pool(3);
    std::atomic<int> count{0};
    for (int round = 0; round < 5; ++round) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3));  // past the spin: workers sleep on the cv
      pool.parallel([&](int, int) { count.fetch_add(1); });
    }
    EXPECT_EQ(count.load(), 15);
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }  // destroyed while asleep
  {
    ThreadPool pool(2);
    pool.parallel([](int, int) {});
  }  // destroyed while spinning
}

TEST(ThreadPool, WorkerExceptionIsRethrownInCaller) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel([](int i, int) {
                 if (i == 1) throw std::runtime_error("boom");
               }),
               std::runtime_error);
  std::atomic<int> count{0};
  pool.parallel([&](int, int) { count.fetch_add(1); });  // still usable
  EXPECT_EQ(count.load(), 2);
}

TEST(ThreadPool, SplitRangeCoversExactlyOnce) {
  for (int64_t n : {0, 1, 5, 576, 1537, 49152})
    for (int parts : {1, 2, 3, 7})
      for (int64_t align : {1, 4, 16}) {
        int64_t expect_begin = 0;
        for (int p = 0; p < parts; ++p) {
          int64_t b, e;
          split_range(n, p, parts, align, &b, &e);
          ASSERT_EQ(b, expect_begin);
          ASSERT_LE(b, e);
          if (e < n) {
            ASSERT_EQ(e % align, 0);
          }
          expect_begin = e;
        }
        ASSERT_EQ(expect_begin, n);
      }
}

}  // namespace

// ---------------------------------------------------------------- the CPU backend's cache read-back (tests' mirror)

// read_kv_rows returns the rows the backend cached, in the [pos][kv_dim] order whatever its internal layout: layer 0's
// K (after RoPE) and V of a prompt in slot 1 against the reference ops on the embedding rows, within one fp16 ulp
// (measured beyond it: 0 .. 4e-8 on the three ISAs; F32 weights, 2 KV heads of 32); rows of slot 0 never written read
// as 0; rows outside the cache throw.
TEST(CpuBackend, ReadKvRowsReturnsTheCachedRows) {
  std::mt19937 gen(std::random_device{}());
  std::uniform_real_distribution<float> u(-1.f, 1.f), un(0.6f, 1.4f);
  ModelSpec s;
  s.n_layers = 2, s.d_model = 64, s.d_ff = 96, s.n_heads = 4, s.n_kv_heads = 2, s.head_dim = 32, s.vocab = 16;
  s.n_ctx = 40, s.n_seq = 2;
  auto rnd = [&](size_t n, bool norm) {
    std::vector<float> v(n);
    for (float& x : v) x = norm ? un(gen) : u(gen) * 0.3f;
    return v;
  };
  std::vector<std::vector<float>> store;
  auto view = [&](int64_t rows, int64_t cols) {
    store.push_back(rnd(static_cast<size_t>(rows * cols), false));
    WeightView w;
    w.type = GgmlType::F32, w.data = store.back().data(), w.rows = rows, w.cols = cols;
    return w;
  };
  auto norm = [&](int n) {
    store.push_back(rnd(n, true));
    return store.back().data();
  };
  ModelWeights w;
  w.tok_embd = view(s.vocab, s.d_model);
  w.output = w.tok_embd;
  w.output_norm = norm(s.d_model);
  for (int l = 0; l < s.n_layers; ++l) {
    LayerWeights L;
    L.attn_norm = norm(s.d_model), L.ffn_norm = norm(s.d_model);
    L.wq = view(s.q_dim(), s.d_model), L.wk = view(s.kv_dim(), s.d_model), L.wv = view(s.kv_dim(), s.d_model);
    L.wo = view(s.d_model, s.q_dim());
    L.w_gate = view(s.d_ff, s.d_model), L.w_up = view(s.d_ff, s.d_model), L.w_down = view(s.d_model, s.d_ff);
    w.layers.push_back(L);
  }
  auto be = make_cpu_backend(s, w, 2);
  const int n = 21, kv = s.kv_dim();
  std::vector<int32_t> toks(n);
  for (int32_t& t : toks) t = static_cast<int32_t>(gen() % s.vocab);
  be->forward_prompt(toks.data(), n, 0, nullptr, nullptr, 1);
  std::vector<float> k(static_cast<size_t>(n) * kv), v(k.size());
  be->read_kv_rows(0, 1, 0, n, k.data(), v.data());
  const float* emb = static_cast<const float*>(w.tok_embd.data);
  double worst = 0;
  for (int p = 0; p < n; ++p) {
    std::vector<float> h(s.d_model), kr(kv), vr(kv);
    ref::rmsnorm(emb + static_cast<size_t>(toks[p]) * s.d_model, w.layers[0].attn_norm, s.rms_eps, s.d_model, h.data());
    ref::matvec(w.layers[0].wk, h.data(), kr.data(), 0, kv);
    ref::matvec(w.layers[0].wv, h.data(), vr.data(), 0, kv);
    ref::rope(kr.data(), s.n_kv_heads, s.head_dim, p, s.rope_base);
    for (int i = 0; i < kv; ++i)
      for (const auto& [got, want] : {std::make_pair(k[static_cast<size_t>(p) * kv + i], kr[i]),
                                      std::make_pair(v[static_cast<size_t>(p) * kv + i], vr[i])}) {
        const double e = std::fabs(static_cast<double>(got) - want) - std::fabs(want) * 0x1p-10;
        worst = std::max(worst, std::isnan(e) ? INFINITY : e);
      }
  }
  std::printf("[ layer 0 K/V rows vs reference, beyond one fp16 ulp: %.2e ]\n", worst);
  EXPECT_LE(worst, 1e-5) << "layer 0's K/V rows against the reference beyond one fp16 ulp";
  std::vector<float> k0(kv, NAN), v0(kv, NAN);
  be->read_kv_rows(1, 0, 39, 1, k0.data(), v0.data());
  for (int i = 0; i < kv; ++i) EXPECT_EQ(k0[i] + v0[i], 0.f) << "slot 0 was never written";
  EXPECT_THROW(be->read_kv_rows(2, 0, 0, 1, k0.data(), v0.data()), EngineError);
  EXPECT_THROW(be->read_kv_rows(0, 2, 0, 1, k0.data(), v0.data()), EngineError);
  EXPECT_THROW(be->read_kv_rows(0, 0, 40, 1, k0.data(), v0.data()), EngineError);
  EXPECT_THROW(be->read_kv_rows(0, 0, -1, 1, k0.data(), v0.data()), EngineError);
}
