#include "metalattn/model.h"

#include <string>

namespace metalattn {

const char* type_name(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return "F32";
    case GgmlType::F16: return "F16";
    case GgmlType::BF16: return "BF16";
    case GgmlType::Q4_0: return "Q4_0";
    case GgmlType::Q4_1: return "Q4_1";
    case GgmlType::Q5_0: return "Q5_0";
    case GgmlType::Q5_1: return "Q5_1";
    case GgmlType::Q8_0: return "Q8_0";
    case GgmlType::Q2_K: return "Q2_K";
    case GgmlType::Q3_K: return "Q3_K";
    case GgmlType::Q4_K: return "Q4_K";
    case GgmlType::Q5_K: return "Q5_K";
    case GgmlType::Q6_K: return "Q6_K";
  }
  return "unknown";
}

static void check_matrix(const WeightView& w, const std::string& name, int64_t rows, int64_t cols) {
  if (w.data == nullptr) throw EngineError("missing tensor " + name);
  if (w.rows != rows || w.cols != cols)
    throw EngineError("tensor " + name + " has shape [" + std::to_string(w.rows) + " x " + std::to_string(w.cols) +
                      "], expected [" + std::to_string(rows) + " x " + std::to_string(cols) + "]");
  if (row_bytes(w.type, w.cols) == 0) throw EngineError("tensor " + name + " has an unsupported type");
  if (w.cols % block_elems(w.type) != 0)
    throw EngineError("tensor " + name + ": " + type_name(w.type) + " rows need a multiple of " +
                      std::to_string(block_elems(w.type)) + " columns");
}

static void check_vector(const float* v, const std::string& name, bool wanted) {
  if (wanted && v == nullptr) throw EngineError("missing tensor " + name);
  if (!wanted && v != nullptr) throw EngineError("tensor " + name + " is given but the architecture has no use for it");
}

void check_kv_rows(const ModelSpec& s, int layer, int slot, int pos0, int n) {
  if (layer < 0 || layer >= s.n_layers || slot < 0 || slot >= s.n_seq || pos0 < 0 || n < 0 || pos0 > s.n_ctx - n)
    throw EngineError("read_kv_rows: layer " + std::to_string(layer) + ", slot " + std::to_string(slot) + ", rows " +
                      std::to_string(pos0) + " + " + std::to_string(n) + " outside the cache (" +
                      std::to_string(s.n_layers) + " layers, " + std::to_string(s.n_seq) + " slots, n_ctx " +
                      std::to_string(s.n_ctx) + ")");
}

void validate_model(const ModelSpec& s, const ModelWeights& w) {
  if (s.n_layers <= 0 || s.d_model <= 0 || s.d_ff <= 0 || s.n_heads <= 0 || s.n_kv_heads <= 0 || s.vocab <= 0 ||
      s.n_ctx <= 0)
    throw EngineError("model spec has a non-positive dimension");
  if (s.n_heads % s.n_kv_heads != 0) throw EngineError("n_heads must be a multiple of n_kv_heads");
  if (s.head_dim <= 0 || s.head_dim % 2 != 0) throw EngineError("head_dim must be positive and even");
  if (!s.layers.empty() && static_cast<int>(s.layers.size()) != s.n_layers)
    throw EngineError("the spec describes " + std::to_string(s.layers.size()) + " layers, the model has " +
                      std::to_string(s.n_layers));
  for (int l = 0; l < s.n_layers; ++l) {
    const LayerSpec ls = s.layer(l);
    if (!(ls.rope_base > 0.f) || !(ls.rope_scale > 0.f) || ls.window < 0)
      throw EngineError("layer " + std::to_string(l) + ": RoPE base and scale must be positive, the window >= 0");
  }
  if (!(s.embed_scale > 0.f) || s.attn_scale < 0.f) throw EngineError("embed_scale must be > 0 and attn_scale >= 0");
  if (static_cast<int>(w.layers.size()) != s.n_layers) throw EngineError("layer count does not match the spec");
  check_matrix(w.tok_embd, "token_embd.weight", s.vocab, s.d_model);
  check_matrix(w.output, "output.weight", s.vocab, s.d_model);
  if (w.output_norm == nullptr) throw EngineError("missing tensor output_norm.weight");
  for (int l = 0; l < s.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    if (L.attn_norm == nullptr) throw EngineError("missing tensor " + p + "attn_norm.weight");
    if (L.ffn_norm == nullptr) throw EngineError("missing tensor " + p + "ffn_norm.weight");
    check_vector(L.bq, p + "attn_q.bias", s.attn_bias);
    check_vector(L.bk, p + "attn_k.bias", s.attn_bias);
    check_vector(L.bv, p + "attn_v.bias", s.attn_bias);
    check_vector(L.q_norm, p + "attn_q_norm.weight", s.qk_norm);
    check_vector(L.k_norm, p + "attn_k_norm.weight", s.qk_norm);
    check_vector(L.post_attn_norm, p + "post_attention_norm.weight", s.post_norms);
    check_vector(L.post_ffn_norm, p + "post_ffw_norm.weight", s.post_norms);
    check_matrix(L.wq, p + "attn_q.weight", s.q_dim(), s.d_model);
    check_matrix(L.wk, p + "attn_k.weight", s.kv_dim(), s.d_model);
    check_matrix(L.wv, p + "attn_v.weight", s.kv_dim(), s.d_model);
    check_matrix(L.wo, p + "attn_output.weight", s.d_model, s.q_dim());
    check_matrix(L.w_gate, p + "ffn_gate.weight", s.d_ff, s.d_model);
    check_matrix(L.w_up, p + "ffn_up.weight", s.d_ff, s.d_model);
    check_matrix(L.w_down, p + "ffn_down.weight", s.d_model, s.d_ff);
  }
}

}  // namespace metalattn
