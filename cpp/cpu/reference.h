// Plain scalar kernels: the reference every SIMD and CUDA kernel is tested against, and the CPU
// backend's fallback where no SIMD path applies. Float activations throughout (no activation quantization).
#pragma once
#include <cstdint>

#include "metalattn/backend.h"
#include "metalattn/model.h"

namespace metalattn::ref {

// Expands one stored row to floats.
void dequantize_row(GgmlType type, const void* row, float* out, int64_t cols);

// Dot product of one stored row with float activations x[cols].
float dot_row(GgmlType type, const void* row, const float* x, int64_t cols);

// y[r] = W[r,:] . x for r in [row_begin, row_end).
void matvec(const WeightView& w, const float* x, float* y, int64_t row_begin, int64_t row_end);

// out = x / rms(x) * weight, rms over n elements with eps inside the root. out may alias x.
void rmsnorm(const float* x, const float* weight, float eps, int n, float* out);

// Rotates each head of v in place at position pos, GGUF llama convention: adjacent pairs (2i, 2i+1)
// turn by pos * base^(-2i/head_dim).
void rope(float* v, int n_heads, int head_dim, int pos, float base);

// Grouped-query attention of one query (all heads) over cache positions [0, n_pos).
// k_cache/v_cache: n_pos rows of kv_dim floats (row stride kv_dim). out: n_heads * head_dim.
void attention(const float* q, const float* k_cache, const float* v_cache, int n_heads, int n_kv_heads,
               int head_dim, int n_pos, float* out);

inline float silu(float x) { return x / (1.f + __builtin_expf(-x)); }

// Largest finite-or-infinite value: NaN never chosen, ties to the lowest index, +inf wins.
// Throws EngineError if every element is NaN.
ArgmaxResult argmax(const float* x, int n);

}  // namespace metalattn::ref
