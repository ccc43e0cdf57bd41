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
    case GgmlType::Q5_0: {
      const block_q5_0* b = static_cast<const block_q5_0*>(row);
      for (int64_t k = 0; k < cols / kQuantBlock; ++k) {
        const float d = fp16_to_float(b[k].d);
        const uint32_t qh = q5_high_bits(b[k].qh);
        for (int j = 0; j < 16; ++j) {
          const int lo = static_cast<int>((b[k].qs[j] & 0x0f) | ((qh >> j & 1) << 4));
          const int hi = static_cast<int>((b[k].qs[j] >> 4) | ((qh >> (j + 16) & 1) << 4));
          out[k * 32 + j] = d * static_cast<float>(lo - 16);
          out[k * 32 + j + 16] = d * static_cast<float>(hi - 16);
        }
      }
      return;
    }
    case GgmlType::Q5_1: {
      const block_q5_1* b = static_cast<const block_q5_1*>(row);
      for (int64_t k = 0; k < cols / kQuantBlock; ++k) {
        const float d = fp16_to_float(b[k].d), m = fp16_to_float(b[k].m);
        const uint32_t qh = q5_high_bits(b[k].qh);
        for (int j = 0; j < 16; ++j) {
          out[k * 32 + j] = d * static_cast<float>((b[k].qs[j] & 0x0f) | ((qh >> j & 1) << 4)) + m;
          out[k * 32 + j + 16] = d * static_cast<float>((b[k].qs[j] >> 4) | ((qh >> (j + 16) & 1) << 4)) + m;
        }
      }
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = type == GgmlType::Q5_K;
      const size_t bs = block_bytes(type);
      for (int64_t k = 0; k < cols / kSuperBlock; ++k) {
        const uint8_t* blk = static_cast<const uint8_t*>(row) + k * bs;
        // Both layouts start with d, dmin, scales[12]; Q5_K then has qh[32] before qs[128].
        const auto* h = reinterpret_cast<const block_q4_K*>(blk);
        const float d = fp16_to_float(h->d), dmin = fp16_to_float(h->dmin);
        const uint8_t* qh = five ? reinterpret_cast<const block_q5_K*>(blk)->qh : nullptr;
        const uint8_t* qs = five ? reinterpret_cast<const block_q5_K*>(blk)->qs : h->qs;
        for (int j = 0; j < 8; ++j) {  // sub-block j: weights 32j .. 32j + 31
          int sc, m;
          k_scale_min(h->scales, j, &sc, &m);
          const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
          const uint8_t* q = qs + 32 * (j / 2);
          for (int l = 0; l < 32; ++l) {
            int v = (j % 2 == 0) ? (q[l] & 0x0f) : (q[l] >> 4);
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            out[k * kSuperBlock + 32 * j + l] = dl * static_cast<float>(v) - ml;
          }
        }
      }
      return;
    }
    case GgmlType::Q6_K: {
      const block_q6_K* b = static_cast<const block_q6_K*>(row);
      for (int64_t k = 0; k < cols / kSuperBlock; ++k) {
        const float d = fp16_to_float(b[k].d);
        float* y = out + k * kSuperBlock;
        for (int i = 0; i < kSuperBlock; ++i) y[i] = d * static_cast<float>(b[k].scales[i / 16]) * static_cast<float>(q6_k_value(b[k], i));
      }
      return;
    }
    case GgmlType::Q3_K: {
      const block_q3_K* b = static_cast<const block_q3_K*>(row);
      for (int64_t k = 0; k < cols / kSuperBlock; ++k) {
        const float d = fp16_to_float(b[k].d);
        float* y = out + k * kSuperBlock;
        for (int i = 0; i < kSuperBlock; ++i) {
          // Weight i: half h = i / 128 of qs (32 bytes each), 2-bit field f = (i % 128) / 32, byte l = i % 32.
          const int h = i / 128, f = (i % 128) / 32, l = i % 32;
          const int low = (b[k].qs[32 * h + l] >> (2 * f)) & 3;
          const int high = (b[k].hmask[l] >> (4 * h + f)) & 1;
          const int sc = q3_k_scale(b[k].scales, i / 16) - 32;
          y[i] = d * static_cast<float>(sc) * static_cast<float>(low - (high ? 0 : 4));
        }
      }
      return;
    }
    case GgmlType::Q2_K: {
      const block_q2_K* b = static_cast<const block_q2_K*>(row);
      for (int64_t k = 0; k < cols / kSuperBlock; ++k) {
        const float d = fp16_to_float(b[k].d), dmin = fp16_to_float(b[k].dmin);
        float* y = out + k * kSuperBlock;
        for (int i = 0; i < kSuperBlock; ++i) {
          const int h = i / 128, f = (i % 128) / 32, l = i % 32;
          const int q = (b[k].qs[32 * h + l] >> (2 * f)) & 3;
          const uint8_t sm = b[k].scales[i / 16];
          y[i] = d * static_cast<float>(sm & 0x0f) * static_cast<float>(q) - dmin * static_cast<float>(sm >> 4);
        }
      }
      return;
    }
  }
  throw EngineError("dequantize_row: unsupported type");
}

float dot_row(GgmlType type, const void* row, const float* x, int64_t cols) {
  // Dequantize one storage block at a time (32 weights; a 256-weight super-block for the K-quants; 32 values of a
  // float type) so the reference stays obviously equal to dequantize-then-dot; each 32 weights sum in float.
  const int64_t chunk = is_k_quant(type) ? kSuperBlock : kQuantBlock;
  float block[kSuperBlock];
  double acc = 0.0;
  const uint8_t* p = static_cast<const uint8_t*>(row);
  const size_t chunk_bytes = row_bytes(type, chunk);
  for (int64_t c = 0; c < cols; c += chunk) {
    const int64_t n = cols - c < chunk ? cols - c : chunk;
    dequantize_row(type, p, block, n);
    for (int64_t j0 = 0; j0 < n; j0 += kQuantBlock) {
      float s = 0.f;
      for (int64_t j = j0; j < n && j < j0 + kQuantBlock; ++j) s += block[j] * x[c + j];
      acc += s;
    }
    p += chunk_bytes;
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
  if (best < 0) throw NonFiniteLogits("argmax: every logit is NaN");
  return {static_cast<uint32_t>(best), best_v};
}

}  // namespace metalattn::ref
