// Host side of the GPU weight layout (kernels.cuh, DevMatrix): GGUF tensors packed into payload / scales / aux arrays
// (and the few-token kernels' mma_scales), stacks of differently typed parts widened to one exact common type.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "cpu/reference.h"
#include "cuda/cuda_check.h"
#include "kernels.cuh"

namespace metalattn::cuda {

const char* gpu_type_name(GgmlType t) { return t == kWide8 ? "WIDE8" : type_name(t); }

GgmlType common_exact_type(const std::vector<const WeightView*>& parts) {
  const GgmlType first = parts.at(0)->type;
  bool same = true, q8_family = true, all_quant = true;
  for (const WeightView* p : parts) {
    same = same && p->type == first;
    q8_family = q8_family && (p->type == GgmlType::Q4_0 || p->type == GgmlType::Q5_0 || p->type == GgmlType::Q8_0);
    all_quant = all_quant && is_quantized(p->type);
  }
  if (same) return first == GgmlType::Q2_K || first == GgmlType::Q3_K ? kWide8 : first;
  // Q4_0 values d*(q-8) and Q5_0 values d*(q-16) are Q8_0 values exactly (same d): 1.0625 B/weight for the widened
  // parts (SmolLM2 / Qwen2.5 Q4_K_M files stack Q5_0 q, k with a Q8_0 v).
  if (q8_family) return GgmlType::Q8_0;
  // Any other quantized mix (e.g. Q4_K q, k with a Q6_K v): int8 with fp32 per-16 scales and mins, 1.5 B/weight.
  return all_quant ? kWide8 : GgmlType::F32;
}

namespace {

// Block k (32 weights) of a quantized GGUF row as kWide8: weight j = s[j / 16] * q[j] - m[j / 16], each value
// exactly the reference's (ref::dequantize_row; the tests check it bit for bit).
void wide_block(GgmlType t, const uint8_t* row, int64_t k, int8_t q[32], float s[2], float m[2]) {
  m[0] = m[1] = 0.f;
  switch (t) {
    case GgmlType::Q4_0: {
      const block_q4_0& b = reinterpret_cast<const block_q4_0*>(row)[k];
      s[0] = s[1] = fp16_to_float(b.d);
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>((b.qs[j] & 15) - 8);
        q[j + 16] = static_cast<int8_t>((b.qs[j] >> 4) - 8);
      }
      return;
    }
    case GgmlType::Q4_1: {
      const block_q4_1& b = reinterpret_cast<const block_q4_1*>(row)[k];
      s[0] = s[1] = fp16_to_float(b.d);
      m[0] = m[1] = -fp16_to_float(b.m);
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>(b.qs[j] & 15);
        q[j + 16] = static_cast<int8_t>(b.qs[j] >> 4);
      }
      return;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool one = t == GgmlType::Q5_1;
      const uint8_t* blk = row + k * block_bytes(t);
      uint16_t d, mm = 0;
      const uint8_t *qh, *qs;
      if (one) {
        const block_q5_1& b = *reinterpret_cast<const block_q5_1*>(blk);
        d = b.d, mm = b.m, qh = b.qh, qs = b.qs;
      } else {
        const block_q5_0& b = *reinterpret_cast<const block_q5_0*>(blk);
        d = b.d, qh = b.qh, qs = b.qs;
      }
      const uint32_t h = q5_high_bits(qh);
      s[0] = s[1] = fp16_to_float(d);
      if (one) m[0] = m[1] = -fp16_to_float(mm);
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 15) | static_cast<int>((h >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | static_cast<int>((h >> (j + 16)) & 1) << 4;
        q[j] = static_cast<int8_t>(one ? lo : lo - 16);
        q[j + 16] = static_cast<int8_t>(one ? hi : hi - 16);
      }
      return;
    }
    case GgmlType::Q8_0: {
      const block_q8_0& b = reinterpret_cast<const block_q8_0*>(row)[k];
      s[0] = s[1] = fp16_to_float(b.d);
      for (int j = 0; j < 32; ++j) q[j] = b.qs[j];
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = t == GgmlType::Q5_K;
      const int sub = static_cast<int>(k % 8);
      const uint8_t* blk = row + (k / 8) * block_bytes(t);
      const block_q4_K& h = *reinterpret_cast<const block_q4_K*>(blk);  // both start with d, dmin, scales[12]
      const uint8_t* qs = five ? reinterpret_cast<const block_q5_K*>(blk)->qs : h.qs;
      const uint8_t* qh = five ? reinterpret_cast<const block_q5_K*>(blk)->qh : nullptr;
      int sc, mn;
      k_scale_min(h.scales, sub, &sc, &mn);
      s[0] = s[1] = fp16_to_float(h.d) * static_cast<float>(sc);
      m[0] = m[1] = fp16_to_float(h.dmin) * static_cast<float>(mn);
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = qs[32 * (sub / 2) + l];
        int v = sub % 2 == 0 ? (byte & 15) : (byte >> 4);
        if (five) v |= ((qh[l] >> sub) & 1) << 4;
        q[l] = static_cast<int8_t>(v);
      }
      return;
    }
    case GgmlType::Q6_K: {
      const int sub = static_cast<int>(k % 8);
      const block_q6_K& b = reinterpret_cast<const block_q6_K*>(row)[k / 8];
      const float d = fp16_to_float(b.d);
      s[0] = d * static_cast<float>(b.scales[2 * sub]);
      s[1] = d * static_cast<float>(b.scales[2 * sub + 1]);
      for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>(q6_k_value(b, 32 * sub + l));
      return;
    }
    case GgmlType::Q3_K: {
      const int sub = static_cast<int>(k % 8);
      const block_q3_K& b = reinterpret_cast<const block_q3_K*>(row)[k / 8];
      const float d = fp16_to_float(b.d);
      for (int h = 0; h < 2; ++h) s[h] = d * static_cast<float>(q3_k_scale(b.scales, 2 * sub + h) - 32);
      for (int l = 0; l < 32; ++l) {
        const int i = 32 * sub + l, hh = i / 128, f = (i % 128) / 32, ll = i % 32;
        const int low = (b.qs[32 * hh + ll] >> (2 * f)) & 3;
        const int high = (b.hmask[ll] >> (4 * hh + f)) & 1;
        q[l] = static_cast<int8_t>(low - (high ? 0 : 4));
      }
      return;
    }
    case GgmlType::Q2_K: {
      const int sub = static_cast<int>(k % 8);
      const block_q2_K& b = reinterpret_cast<const block_q2_K*>(row)[k / 8];
      const float d = fp16_to_float(b.d), dmin = fp16_to_float(b.dmin);
      for (int h = 0; h < 2; ++h) {
        const uint8_t sm = b.scales[2 * sub + h];
        s[h] = d * static_cast<float>(sm & 15);
        m[h] = dmin * static_cast<float>(sm >> 4);
      }
      for (int l = 0; l < 32; ++l) {
        const int i = 32 * sub + l, hh = i / 128, f = (i % 128) / 32, ll = i % 32;
        q[l] = static_cast<int8_t>((b.qs[32 * hh + ll] >> (2 * f)) & 3);
      }
      return;
    }
    default: throw EngineError("pack_matrix: no exact conversion to the wide type");
  }
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The nibble payload of one block (weight j: low nibble of byte j, or high nibble of byte j - 16) from its 32 values.
void put_nibbles(const int v[32], uint8_t* dst) {
  for (int j = 0; j < 16; ++j) dst[j] = static_cast<uint8_t>((v[j] & 15) | (v[j + 16] & 15) << 4);
}

}  // namespace

PackedMatrix pack_matrix(const std::vector<const WeightView*>& parts, GgmlType target) {
  PackedMatrix m;
  m.type = target;
  m.cols = static_cast<int>(parts.at(0)->cols);
  m.nb = (m.cols + 31) / 32;
  for (const WeightView* p : parts) {
    if (p->cols != m.cols) throw EngineError("pack_matrix: stacked parts differ in columns");
    if (is_quantized(p->type) && p->cols % block_elems(p->type) != 0) throw EngineError("pack_matrix: ragged quant row");
    m.rows += static_cast<int>(p->rows);
  }
  const int pb = payload_bytes(target), sc = scale_count(target), aw = aux_words(target);
  if (pb == 0) throw EngineError("pack_matrix: unsupported type");
  if (has_superblock_header(target) && m.nb % 8 != 0) throw EngineError("pack_matrix: ragged K-quant row");
  m.payload.assign(static_cast<size_t>(m.rows) * m.nb * pb, 0);
  m.scales.assign(static_cast<size_t>(m.rows) * m.nb * sc, 0);
  m.aux.assign(static_cast<size_t>(m.rows) * m.nb * aw, 0);
  const int ms = mma_scale_count(target);
  m.mma_scales.assign(static_cast<size_t>(m.rows) * m.nb * ms, 0.f);
  std::vector<float> row_f(static_cast<size_t>(m.nb) * 32, 0.f);
  int64_t out_row = 0;
  for (const WeightView* p : parts) {
    for (int64_t r = 0; r < p->rows; ++r, ++out_row) {
      uint8_t* dst = m.payload.data() + static_cast<size_t>(out_row) * m.nb * pb;
      uint16_t* dsc = m.scales.data() + static_cast<size_t>(out_row) * m.nb * sc;
      uint32_t* daux = m.aux.data() + static_cast<size_t>(out_row) * m.nb * aw;
      float* dms = m.mma_scales.data() + static_cast<size_t>(out_row) * m.nb * ms;
      const uint8_t* src = p->row(r);
      if (p->type == target) {
        switch (target) {
          case GgmlType::Q4_0: {
            const auto* b = reinterpret_cast<const block_q4_0*>(src);
            for (int k = 0; k < m.nb; ++k) { std::memcpy(dst + k * 16, b[k].qs, 16); dsc[k] = b[k].d; }
            break;
          }
          case GgmlType::Q4_1: {
            const auto* b = reinterpret_cast<const block_q4_1*>(src);
            for (int k = 0; k < m.nb; ++k) {
              std::memcpy(dst + k * 16, b[k].qs, 16);
              dsc[2 * k] = b[k].d;
              dsc[2 * k + 1] = b[k].m;
            }
            break;
          }
          case GgmlType::Q8_0: {
            const auto* b = reinterpret_cast<const block_q8_0*>(src);
            for (int k = 0; k < m.nb; ++k) { std::memcpy(dst + k * 32, b[k].qs, 32); dsc[k] = b[k].d; }
            break;
          }
          case GgmlType::Q5_0: {
            const auto* b = reinterpret_cast<const block_q5_0*>(src);
            for (int k = 0; k < m.nb; ++k) {
              std::memcpy(dst + k * 16, b[k].qs, 16);  // same nibble order as Q4_0
              dsc[k] = b[k].d;
              const uint32_t h = q5_high_bits(b[k].qh);
              for (int j = 0; j < 32; ++j) daux[k] |= static_cast<uint32_t>(((h >> j) & 1) ^ 1) << q5_aux_bit(j);
            }
            break;
          }
          case GgmlType::Q5_1: {
            const auto* b = reinterpret_cast<const block_q5_1*>(src);
            for (int k = 0; k < m.nb; ++k) {
              std::memcpy(dst + k * 16, b[k].qs, 16);
              dsc[2 * k] = b[k].d;
              dsc[2 * k + 1] = b[k].m;
              const uint32_t h = q5_high_bits(b[k].qh);
              for (int j = 0; j < 32; ++j) daux[k] |= ((h >> j) & 1) << q5_aux_bit(j);
            }
            break;
          }
          case GgmlType::Q4_K:
          case GgmlType::Q5_K: {
            const bool five = target == GgmlType::Q5_K;
            const size_t bs = block_bytes(target);
            for (int s = 0; s < m.nb / 8; ++s) {
              const uint8_t* blk = src + s * bs;
              std::memcpy(dsc + 8 * s, blk, 16);  // d, dmin, scales[12]: the header as the file stores it
              const uint8_t* qs = five ? reinterpret_cast<const block_q5_K*>(blk)->qs
                                       : reinterpret_cast<const block_q4_K*>(blk)->qs;
              const uint8_t* qh = five ? reinterpret_cast<const block_q5_K*>(blk)->qh : nullptr;
              for (int j = 0; j < 8; ++j) {  // sub-block j = GPU block 8s + j
                const int k = 8 * s + j;
                int v[32];
                for (int l = 0; l < 32; ++l) {
                  const uint8_t byte = qs[32 * (j / 2) + l];
                  v[l] = j % 2 == 0 ? (byte & 15) : (byte >> 4);
                  if (five) daux[k] |= static_cast<uint32_t>((qh[l] >> j) & 1) << q5_aux_bit(l);
                }
                put_nibbles(v, dst + k * 16);
              }
            }
            break;
          }
          case GgmlType::Q6_K: {
            const auto* b = reinterpret_cast<const block_q6_K*>(src);
            for (int s = 0; s < m.nb / 8; ++s) {
              for (int j = 0; j < 8; ++j) {
                const int k = 8 * s + j;
                dsc[2 * k] = b[s].d;
                dsc[2 * k + 1] = static_cast<uint16_t>(static_cast<uint8_t>(b[s].scales[2 * j]) |
                                                       static_cast<uint8_t>(b[s].scales[2 * j + 1]) << 8);
                int v[32];
                for (int l = 0; l < 32; ++l) {
                  const int q6 = q6_k_value(b[s], 32 * j + l) + 32;  // 0..63
                  v[l] = q6 & 15;
                  daux[2 * k + q6_aux_word(l)] |= static_cast<uint32_t>((q6 >> 4) ^ 2) << q6_aux_bit(l);
                }
                put_nibbles(v, dst + k * 16);
              }
            }
            break;
          }
          case GgmlType::F16:
          case GgmlType::BF16: std::memcpy(dst, src, static_cast<size_t>(m.cols) * 2); break;
          case GgmlType::F32: std::memcpy(dst, src, static_cast<size_t>(m.cols) * 4); break;
          default: throw EngineError("pack_matrix: unsupported type");
        }
        if (ms > 0) {  // the prompt kernels' fp32 scales: wide_block's exact s, m of each block
          for (int k = 0; k < m.nb; ++k) {
            int8_t q[32];
            float s2[2], m2[2];
            wide_block(target, src, k, q, s2, m2);
            dms[2 * k] = s2[0];
            dms[2 * k + 1] = target == GgmlType::Q6_K ? s2[1] : -m2[0];
          }
        }
      } else if (target == GgmlType::Q8_0 && (p->type == GgmlType::Q4_0 || p->type == GgmlType::Q5_0)) {
        for (int k = 0; k < m.nb; ++k) {
          int8_t q[32];
          float s2[2], m2[2];
          wide_block(p->type, src, k, q, s2, m2);  // q - 8 or q - 16, the block's own d
          std::memcpy(dst + k * 32, q, 32);
          dsc[k] = p->type == GgmlType::Q4_0 ? reinterpret_cast<const block_q4_0*>(src)[k].d
                                             : reinterpret_cast<const block_q5_0*>(src)[k].d;
        }
      } else if (target == kWide8) {
        for (int k = 0; k < m.nb; ++k) {
          int8_t q[32];
          float s2[2], m2[2];
          wide_block(p->type, src, k, q, s2, m2);
          std::memcpy(dst + k * 32, q, 32);
          daux[4 * k] = float_bits(s2[0]);
          daux[4 * k + 1] = float_bits(s2[1]);
          daux[4 * k + 2] = float_bits(m2[0]);
          daux[4 * k + 3] = float_bits(m2[1]);
        }
      } else if (target == GgmlType::F32) {
        ref::dequantize_row(p->type, src, row_f.data(), m.cols);
        std::memcpy(dst, row_f.data(), static_cast<size_t>(m.cols) * 4);
      } else {
        throw EngineError("pack_matrix: no exact conversion to the target type");
      }
    }
  }
  return m;
}

}  // namespace metalattn::cuda
