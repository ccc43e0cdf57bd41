#include "reference.h"

#include <cmath>
#include <vector>

namespace metalattn::ref {

void dequantize_row(GgmlType type, const void* row, float* out, int64_t cols) {
  switch (type) {
    case GgmlType::F32: {
      const float* src = static_cast<const float*>(row);
      for (int64_t i = 0; i < cols; ++i) out[i] = src[i];
      return;
    }
    case GgmlType::F16: {
      const uint16_t* src = static_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < cols; ++i) out[i] = fp16_to_float(src[i]);
      return;
    }
    case GgmlType::BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < cols; ++i) out[i] = bf16_to_float(src[i]);
      return;
    }
    case GgmlType::Q4_0: {
      const block_q4_0* b = static_cast<const block_q4_0*>(row);
      for (int64_t k = 0; k < cols / kQuantBlock; ++k) {
        const float d = fp16_to_float(b[k].d);
        for (int j = 0; j < 16; ++j) {
          out[k * 32 + j] = d * static_cast<float>((b[k].qs[j] & 0x0f) - 8);
          out[k * 32 + j + 16] = d * static_cast<float>((b[k].qs[j] >> 4) - 8);
        }
      }
      return;
    }
    case GgmlType::Q4_1: {
      const block_q4_1* b = static_cast<const block_q4_1*>(row);
      for (int64_t k = 0; k < cols / kQuantBlock; ++k) {
        const float d = fp16_to_float(b[k].d), m = fp16_to_float(b[k].m);
        for (int j = 0; j < 16; ++j) {
          out[k * 32 + j] = d * static_cast<float>(b[k].qs[j] & 0x0f) + m;
          out[k * 32 + j + 16] = d * static_cast<float>(b[k].qs[j] >> 4) + m;
        }
      }
      return;
    }
    case GgmlType::Q8_0: {
      const block_q8_0* b = static_cast<const block_q8_0*>(row);
      for (int64_t k = 0; k < cols / kQuantBlock; ++k) {
        const float d = fp16_to_float(b[k].d);
        for (int j = 0; j < 32; ++j) out[k * 32 + j] = d * static_cast<float>(b[k].qs[j]);
      }
      return;
    }
  }
  throw EngineError("dequantize_row: unsupported type");
}

float dot_row(GgmlType type, const void* row, const float* x, int64_t cols) {
  // Dequantize one block at a time so the reference stays obviously equal to dequantize-then-dot.
  float block[kQuantBlock];
  double acc = 0.0;
  const uint8_t* p = static_cast<const uint8_t*>(row);
  const size_t block_bytes = row_bytes(type, kQuantBlock);
  for (int64_t c = 0; c < cols; c += kQuantBlock) {
    const int64_t n = cols - c < kQuantBlock ? cols - c : kQuantBlock;
    dequantize_row(type, p, block, n);
    float s = 0.f;
    for (int64_t j = 0; j < n; ++j) s += block[j] * x[c + j];
    acc += s;
    p += block_bytes;
  }
  return static_cast<float>(acc);
}

void matvec(const WeightView& w, const float* x, float* y, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) y[r] = dot_row(w.type, w.row(r), x, w.cols);
}

void rmsnorm(const float* x, const float* weight, float eps, int n, float* out) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

void rope(float* v, int n_heads, int head_dim, int pos, float base) {
  for (int i = 0; i < head_dim / 2; ++i) {
    const double theta = pos * std::pow(static_cast<double>(base), -2.0 * i / head_dim);
    const float c = static_cast<float>(std::cos(theta)), s = static_cast<float>(std::sin(theta));
    for (int h = 0; h < n_heads; ++h) {
      float* p = v + h * head_dim + 2 * i;
      const float a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = a * s + b * c;
    }
  }
}

void attention(const float* q, const float* k_cache, const float* v_cache, int n_heads, int n_kv_heads,
               int head_dim, int n_pos, float* out) {
  const int kv_dim = n_kv_heads * head_dim;
  const int group = n_heads / n_kv_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> score(n_pos);
  for (int h = 0; h < n_heads; ++h) {
    const int kvh = h / group;
    const float* qh = q + h * head_dim;
    float mx = -INFINITY;
    for (int t = 0; t < n_pos; ++t) {
      const float* k = k_cache + static_cast<int64_t>(t) * kv_dim + kvh * head_dim;
      float s = 0.f;
      for (int j = 0; j < head_dim; ++j) s += qh[j] * k[j];
      score[t] = s * scale;
      mx = std::fmax(mx, score[t]);
    }
    float sum = 0.f;
    for (int t = 0; t < n_pos; ++t) {
      score[t] = std::exp(score[t] - mx);
      sum += score[t];
    }
    float* o = out + h * head_dim;
    for (int j = 0; j < head_dim; ++j) o[j] = 0.f;
    for (int t = 0; t < n_pos; ++t) {
      const float* v = v_cache + static_cast<int64_t>(t) * kv_dim + kvh * head_dim;
      const float p = score[t] / sum;
      for (int j = 0; j < head_dim; ++j) o[j] += p * v[j];
    }
  }
}

ArgmaxResult argmax(const float* x, int n) {
  int best = -1;
  float best_v = 0.f;
  for (int i = 0; i < n; ++i) {
    if (std::isnan(x[i])) continue;
    if (best < 0 || x[i] > best_v) { best = i; best_v = x[i]; }
  }
  if (best < 0) throw EngineError("argmax: every logit is NaN");
  return {static_cast<uint32_t>(best), best_v};
}

}  // namespace metalattn::ref
