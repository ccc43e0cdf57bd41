// The model as the C++ core sees it: hyperparameters and borrowed weight views.
// Weights are not owned: they point into the memory-mapped GGUF that the Python layer keeps alive.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "metalattn/quant.h"

namespace metalattn {

// How RoPE pairs the dimensions of a head: llama's GGUF layout rotates adjacent pairs (2i, 2i+1); the NeoX layout
// (Qwen, Gemma, ...) rotates (i, i + head_dim/2). Pair i turns by pos * rope_scale * base^(-2i/head_dim) / factor[i].
enum class RopeStyle : int { Interleaved = 0, Neox = 1 };
// The gated feed-forward's activation: down(act(gate x) * up x).
enum class Activation : int { Silu = 0, GeluTanh = 1 };

// What may differ from layer to layer (Gemma 3 alternates sliding-window layers with their own RoPE base and
// global layers).
struct LayerSpec {
  float rope_base = 10000.f;
  float rope_scale = 1.f;  // positions are multiplied by this (linear RoPE scaling: 1 / factor)
  int window = 0;          // sliding window: a query sees the last `window` positions, itself included; 0 = all
};

// An architecture, described as data that every backend reads: which norms and biases a layer has, the activation,
// how RoPE turns, the attention scale, and the per-layer RoPE/window. Adding an architecture means filling this in
// (python/metalattn/gguf_model.py, ARCHITECTURES), not branching in the kernels.
struct ModelSpec {
  int n_layers = 0;
  int d_model = 0;
  int d_ff = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;   // need not be d_model / n_heads (Gemma 3, Qwen 3)
  int vocab = 0;
  int n_ctx = 0;      // KV-cache length this engine was created with (per sequence slot)
  int n_seq = 1;      // KV-cache slots: sequences that Backend::forward_batch decodes together, n_ctx positions each
  float rope_base = 10000.f;  // RoPE base of every layer that `layers` does not describe
  float rms_eps = 1e-5f;

  RopeStyle rope_style = RopeStyle::Interleaved;
  Activation activation = Activation::Silu;
  float embed_scale = 1.f;   // the token embedding is multiplied by this (Gemma: sqrt(d_model))
  float attn_scale = 0.f;    // q.k multiplier; 0 means 1/sqrt(head_dim)
  bool attn_bias = false;    // q, k, v projections have biases (Qwen 2)
  bool qk_norm = false;      // RMSNorm over each head of q and k before RoPE (Qwen 3, Gemma 3)
  bool post_norms = false;   // RMSNorm of the attention and FFN outputs before each residual add (Gemma 3)
  std::vector<LayerSpec> layers;  // n_layers entries, or empty: every layer {rope_base, 1, full attention}

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  float attention_scale() const { return attn_scale > 0.f ? attn_scale : 1.f / __builtin_sqrtf(float(head_dim)); }
  LayerSpec layer(int l) const { return layers.empty() ? LayerSpec{rope_base, 1.f, 0} : layers.at(l); }
  // True for the plain Llama layer with one RoPE for every layer (what the fused CUDA kernels were written for).
  bool plain_llama() const { return rope_style == RopeStyle::Interleaved && !attn_bias && llama_layer_up_to_qkv(); }
  // The Llama layer, allowing Q/K/V biases and either RoPE pairing (Qwen 2): what the fused CUDA decode kernels run
  // (their QKV epilogue adds the bias and turns the pairs), and whose prompts run the plain CUDA prompt path too
  // (cuda_backend.h, fused_decode_).
  bool llama_layer_up_to_qkv() const {
    if (activation != Activation::Silu || embed_scale != 1.f || qk_norm || post_norms ||
        attention_scale() != 1.f / __builtin_sqrtf(float(head_dim)))
      return false;
    for (int l = 0; l < n_layers; ++l) {
      const LayerSpec ls = layer(l);
      if (ls.window != 0 || ls.rope_scale != 1.f || ls.rope_base != rope_base) return false;
    }
    return true;
  }
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
  const float* bq = nullptr;         // attn_bias: [q_dim], [kv_dim], [kv_dim]
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* q_norm = nullptr;     // qk_norm: [head_dim] each
  const float* k_norm = nullptr;
  const float* post_attn_norm = nullptr;  // post_norms: [d_model] each
  const float* post_ffn_norm = nullptr;
  const float* ffn_norm = nullptr;   // [d_model]
  WeightView w_gate, w_up, w_down;   // [d_ff x d], [d_ff x d], [d x d_ff]
};

struct ModelWeights {
  WeightView tok_embd;               // [vocab x d]
  const float* output_norm = nullptr;
  WeightView output;                 // [vocab x d]; the same view as tok_embd when tied
  const float* rope_freqs = nullptr; // optional [head_dim / 2]: RoPE pair i turns by theta_i / rope_freqs[i] (Llama 3)
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
// The model is valid but this backend cannot run it (an architecture feature or tensor type it lacks); surfaces as
// metalattn.UnsupportedModelError, and device="auto" then falls back to the CPU.
struct BackendUnsupported : EngineError {
  using EngineError::EngineError;
};
// Every logit of a step is NaN (the argmax has no candidate): almost always non-finite or corrupt weights; surfaces
// as metalattn.NonFiniteError. The engine's position does not advance.
struct NonFiniteLogits : EngineError {
  using EngineError::EngineError;
};

// Checks every shape and type against the spec; throws EngineError naming the tensor.
void validate_model(const ModelSpec& spec, const ModelWeights& w);
// Backend::read_kv_rows's arguments against the spec (layer, slot, rows [pos0, pos0 + n) within n_ctx); throws
// EngineError.
void check_kv_rows(const ModelSpec& spec, int layer, int slot, int pos0, int n);

}  // namespace metalattn
