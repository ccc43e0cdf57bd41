#include "kernels.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>  // vec_ops.h widens the fp16 K/V cache with F16C where the baseline build has it
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels_isa.h"
#include "reference.h"

namespace metalattn::cpu {

namespace {

Isa detect_best_isa() {
#ifdef METALATTN_X86
  __builtin_cpu_init();
  // kernels_avx512.cpp is compiled with -mavx512dq -mavx2 -mfma -mf16c as well, so those are required too.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni");
  if (avx512) return Isa::Avx512;
  if (avx2) return Isa::Avx2;
#endif
  return Isa::Scalar;
}

void check_isa(Isa isa, const char* what) {
  if (!isa_supported(isa))
    throw EngineError(std::string(what) + ": ISA " + isa_name(isa) + " is not supported by this CPU or build");
}

void check_args(const WeightView& w, const block_q16_act* xq, Isa isa, int64_t r0, int64_t r1, const char* what) {
  if (r0 < 0 || r1 > w.rows || r0 > r1) throw EngineError(std::string(what) + ": row range out of bounds");
  if (is_quantized(w.type) && w.cols % block_elems(w.type) != 0)
    throw EngineError(std::string(what) + ": " + type_name(w.type) + " weights need cols % " +
                      std::to_string(block_elems(w.type)) + " == 0");
  if (uses_quantized_acts(isa, w.type) && xq == nullptr)
    throw EngineError(std::string(what) + ": quantized activations are required for this ISA and weight type");
}

}  // namespace

namespace scalar {

void quantize_acts(const float* x, int64_t n, block_q16_act* out) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float amax = 0.f;
    for (int j = 0; j < kQuantBlock; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float d = amax / 32767.f;
    int sum = 0;
    for (int j = 0; j < kQuantBlock; ++j) {
      // nearbyint rounds half to even, as the SIMD conversions do, so every ISA produces the same bytes.
      const int q = d == 0.f ? 0 : static_cast<int>(std::nearbyint(xb[j] / d));
      out[b].qs[j] = static_cast<int16_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

#include "vec_ops.h"
METALATTN_VEC_OPS_ENTRY_POINTS(v16f)  // 16 floats split into SSE registers by the baseline build

}  // namespace scalar

Isa best_isa() {
  static const Isa best = detect_best_isa();
  return best;
}

bool isa_supported(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(best_isa()); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "unknown";
}

Isa selected_isa() {
  // Read on every call (cheap) so tests and callers can change the override at run time.
  const char* env = std::getenv("METALATTN_CPU_ISA");
  if (env == nullptr || env[0] == '\0') return best_isa();
  Isa isa;
  if (std::strcmp(env, "scalar") == 0) {
    isa = Isa::Scalar;
  } else if (std::strcmp(env, "avx2") == 0) {
    isa = Isa::Avx2;
  } else if (std::strcmp(env, "avx512") == 0) {
    isa = Isa::Avx512;
  } else {
    throw EngineError(std::string("METALATTN_CPU_ISA='") + env + "' is not one of: scalar, avx2, avx512");
  }
  if (!isa_supported(isa))
    throw EngineError(std::string("METALATTN_CPU_ISA=") + env + " is not supported by this CPU or build (best: " +
                      isa_name(best_isa()) + ")");
  return isa;
}

void quantize_acts(Isa isa, const float* x, int64_t n, block_q16_act* out) {
  if (n % kQuantBlock != 0) throw EngineError("quantize_acts: n must be a multiple of 32");
  check_isa(isa, "quantize_acts");
  switch (isa) {
#ifdef METALATTN_X86
    case Isa::Avx512: return avx512::quantize_acts(x, n, out);
    case Isa::Avx2: return avx2::quantize_acts(x, n, out);
#endif
    default: return scalar::quantize_acts(x, n, out);
  }
}

namespace {
// The weight types the SIMD tiles handle; Q2_K and Q3_K run the scalar reference on every ISA.
bool simd_type(GgmlType t) { return t != GgmlType::Q2_K && t != GgmlType::Q3_K; }
// Every SIMD type runs on each SIMD ISA (AVX-512: its own tiles for the legacy and float types, the AVX2 group tiles
// with vpdpwssd for the others; the int16 activations are the same bytes on every ISA).
Isa tile_isa(Isa isa, GgmlType t) { return simd_type(t) ? isa : Isa::Scalar; }
}  // namespace

bool uses_quantized_acts(Isa isa, GgmlType weight_type) {
  return isa != Isa::Scalar && is_quantized(weight_type) && simd_type(weight_type);
}

void matvec(Isa isa, const WeightView& w, const float* x, const block_q16_act* xq, float* y, int64_t r0, int64_t r1) {
  check_isa(isa, "matvec");
  check_args(w, xq, isa, r0, r1, "matvec");
  isa = tile_isa(isa, w.type);
  switch (isa) {
#ifdef METALATTN_X86
    case Isa::Avx512: return avx512::matmul(w, x, xq, 1, y, 0, r0, r1);
    case Isa::Avx2: return avx2::matmul(w, x, xq, 1, y, 0, r0, r1);
#endif
    default: return ref::matvec(w, x, y, r0, r1);
  }
}

void matmul(Isa isa, const WeightView& w, const float* X, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
            int64_t r0, int64_t r1) {
  check_isa(isa, "matmul");
  check_args(w, Xq, isa, r0, r1, "matmul");
  if (n_tok <= 0) return;
  isa = tile_isa(isa, w.type);
  switch (isa) {
#ifdef METALATTN_X86
    case Isa::Avx512: return avx512::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
    case Isa::Avx2: return avx2::matmul(w, X, Xq, n_tok, Y, ldy, r0, r1);
#endif
    default:
      for (int t = 0; t < n_tok; ++t) ref::matvec(w, X + t * w.cols, Y + t * ldy, r0, r1);
  }
}

void glu(Isa isa, bool gelu, float* gate, const float* up, int64_t n) {
  check_isa(isa, "glu");
  switch (isa) {
#ifdef METALATTN_X86
    case Isa::Avx512: return avx512::glu(gelu, gate, up, n);
    case Isa::Avx2: return avx2::glu(gelu, gate, up, n);
#endif
    default: return scalar::glu(gelu, gate, up, n);
  }
}

ArgmaxResult argmax_logits(Isa isa, const float* x, int n) {
  check_isa(isa, "argmax");
  switch (isa) {
#ifdef METALATTN_X86
    case Isa::Avx512: return avx512::argmax(x, n);
    case Isa::Avx2: return avx2::argmax(x, n);
#endif
    default: return scalar::argmax(x, n);
  }
}

double exp_weights(Isa isa, const float* x, int64_t n, float m, float inv_t, float* w) {
  check_isa(isa, "exp_weights");
  switch (isa) {
#ifdef METALATTN_X86
    case Isa::Avx512: return avx512::exp_weights(x, n, m, inv_t, w);
    case Isa::Avx2: return avx2::exp_weights(x, n, m, inv_t, w);
#endif
    default: return scalar::exp_weights(x, n, m, inv_t, w);
  }
}

AttendFns attend_fns(Isa isa, int group) {
  check_isa(isa, "attention");
  switch (isa) {
#ifdef METALATTN_X86
    case Isa::Avx512: return avx512::attend_fns(group);
    case Isa::Avx2: return avx2::attend_fns(group);
#endif
    default: return scalar::attend_fns(group);
  }
}

void attention_begin(float* o, float* ml, int head_dim) {
  std::fill_n(o, head_dim, 0.f);
  ml[0] = -INFINITY;
  ml[1] = 0.f;
}

void attention_fold(float* o, float* ml, const float* o_i, const float* ml_i, int head_dim) {
  const float m = std::max(ml[0], ml_i[0]);
  if (m == -INFINITY) return;  // neither has seen a position
  const float a = std::exp(ml[0] - m), b = std::exp(ml_i[0] - m);  // exp(-inf) = 0
  for (int c = 0; c < head_dim; ++c) o[c] = o[c] * a + o_i[c] * b;
  ml[0] = m;
  ml[1] = ml[1] * a + ml_i[1] * b;
}

void attention_finish(const float* o, const float* ml, int head_dim, float* out) {
  const float inv = 1.f / ml[1];
  for (int c = 0; c < head_dim; ++c) out[c] = o[c] * inv;
}

bool lane_rows_supported(Isa isa, GgmlType type) {
#ifdef METALATTN_X86
  return isa == Isa::Avx2 && type == GgmlType::Q4_0 && isa_supported(isa);
#else
  return false;
#endif
}

void pack_lane_rows(Isa isa, const WeightView& w, uint8_t* out) {
  if (!lane_rows_supported(isa, w.type) || w.cols % kQuantBlock != 0)
    throw EngineError("pack_lane_rows: needs the AVX2 ISA and Q4_0 rows of whole blocks");
#ifdef METALATTN_X86
  avx2::pack_lane_rows(w, out);
#endif
}

size_t lane_acts_bytes(int64_t cols) {
#ifdef METALATTN_X86
  return avx2::lane_acts_bytes(cols);
#else
  return 0;
#endif
}

void pack_lane_acts(Isa isa, const block_q16_act* xq, int64_t cols, void* out) {
  if (!lane_rows_supported(isa, GgmlType::Q4_0) || cols % kQuantBlock != 0)
    throw EngineError("pack_lane_acts: needs the AVX2 ISA and whole blocks");
#ifdef METALATTN_X86
  avx2::pack_lane_acts(xq, cols, out);
#endif
}

void matvec_lane_rows(Isa isa, const WeightView& packed, const void* acts, float* y, int64_t r0, int64_t r1) {
  if (!lane_rows_supported(isa, packed.type)) throw EngineError("matvec_lane_rows: needs the AVX2 ISA and Q4_0");
  if (r0 < 0 || r1 > packed.rows || r0 > r1) throw EngineError("matvec_lane_rows: row range out of bounds");
#ifdef METALATTN_X86
  avx2::matvec_lane_rows(packed, acts, y, r0, r1);
#endif
}

bool slot_rows_supported(Isa isa, const WeightView& w) {
#ifdef METALATTN_X86
  const bool type = w.type == GgmlType::Q4_0 || w.type == GgmlType::Q4_1 || w.type == GgmlType::Q8_0;
  return (isa == Isa::Avx512 || isa == Isa::Avx2) && isa_supported(isa) && type && w.cols % (2 * kQuantBlock) == 0;
#else
  return false;
#endif
}

int slot_min_tokens(Isa isa) { return isa == Isa::Avx512 ? 3 : isa == Isa::Avx2 ? 6 : 0; }

void pack_slot_rows(Isa isa, const WeightView& w, uint8_t* out) {
  if (!slot_rows_supported(isa, w))
    throw EngineError("pack_slot_rows: needs a SIMD ISA and Q4_0 / Q4_1 / Q8_0 rows of an even number of blocks");
#ifdef METALATTN_X86
  avx2::pack_slot_rows(w, out);  // the same bytes for both ISAs
#endif
}

void matmul_slot_rows(Isa isa, const WeightView& packed, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
                      int64_t r0, int64_t r1) {
  if (!slot_rows_supported(isa, packed)) throw EngineError("matmul_slot_rows: needs a SIMD ISA and a slot-row type");
  if (r0 < 0 || r1 > packed.rows || r0 > r1) throw EngineError("matmul_slot_rows: row range out of bounds");
  if (Xq == nullptr) throw EngineError("matmul_slot_rows: needs the quantized activations");
  if (n_tok <= 0) return;
#ifdef METALATTN_X86
  if (isa == Isa::Avx512) return avx512::matmul_slot_rows(packed, Xq, n_tok, Y, ldy, r0, r1);
  avx2::matmul_slot_rows(packed, Xq, n_tok, Y, ldy, r0, r1);
#endif
}

}  // namespace metalattn::cpu
