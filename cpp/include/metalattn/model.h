// The model as the C++ core sees it: hyperparameters and borrowed weight views.
// Weights are not owned: they point into the memory-mapped GGUF that the Python layer keeps alive.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "metalattn/quant.h"

namespace metalattn {

struct ModelSpec {
  int n_layers = 0;
  int d_model = 0;
  int d_ff = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;   // d_model / n_heads
  int vocab = 0;
  int n_ctx = 0;      // KV-cache length this engine was created with
  float rope_base = 10000.f;
  float rms_eps = 1e-5f;

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

// A 2-D weight matrix, row-major: `rows` outputs, each a row of `cols` inputs stored as row_bytes(type, cols).
struct WeightView {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_stride() const { return row_bytes(type, cols); }
  const uint8_t* row(int64_t r) const { return static_cast<const uint8_t*>(data) + r * row_stride(); }
};

struct LayerWeights {
  const float* attn_norm = nullptr;  // [d_model]
  WeightView wq, wk, wv, wo;         // [q_dim x d], [kv_dim x d], [kv_dim x d], [d x q_dim]
  const float* ffn_norm = nullptr;   // [d_model]
  WeightView w_gate, w_up, w_down;   // [d_ff x d], [d_ff x d], [d x d_ff]
};

struct ModelWeights {
  WeightView tok_embd;               // [vocab x d]
  const float* output_norm = nullptr;
  WeightView output;                 // [vocab x d]; the same view as tok_embd when tied
  std::vector<LayerWeights> layers;
};

// Thrown for misuse and for internal checks; surfaces as ValueError.
struct EngineError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The engine validates every call's tokens itself (so a prompt that is already an int32 array needs no Python-side
// pass over it); these surface as metalattn.TokenError and metalattn.ContextOverflowError.
struct TokenRangeError : EngineError {
  using EngineError::EngineError;
};
struct ContextOverflow : EngineError {
  using EngineError::EngineError;
};

// Checks every shape and type against the spec; throws EngineError naming the tensor.
void validate_model(const ModelSpec& spec, const ModelWeights& w);

}  // namespace metalattn
