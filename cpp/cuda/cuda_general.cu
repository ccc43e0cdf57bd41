// CUDA backend: the general-architecture path (arch.cuh) of decode and prompts: biases, QK-norm, post-norms,
// sliding windows, GELU; the plain Llama path runs the fused kernels (cuda_backend.cu).

#include "cuda/cuda_backend.h"

namespace metalattn {
namespace cuda {

// ------------------------------------------------------------------ general path (arch.cuh)

// The architecture's extra per-layer tensors, one RoPE table per distinct (base, scale) among the layers (the plain
// table serves the model's own base at scale 1), and the general path's scratch.
void CudaBackend::setup_general(const ModelWeights& w) {
  const ModelSpec& s = spec_;
  const int d = s.d_model, q_dim = s.q_dim(), kv_dim = s.kv_dim();
  cudaStream_t st = res_.stream;
  struct Table {
    float base, scale;
    const float2* dev;
  };
  std::vector<Table> tables{{s.rope_base, 1.f, rope_}};
  for (int l = 0; l < s.n_layers; ++l) {
    const LayerWeights& src = w.layers[l];
    DevLayer& dl = layers_[l];
    if (s.attn_bias) {
      float* b = device_alloc<float>(static_cast<size_t>(q_dim) + 2 * kv_dim, mem_.weights);
      CUDA_CHECK(cudaMemcpyAsync(b, src.bq, q_dim * sizeof(float), cudaMemcpyHostToDevice, st));
      CUDA_CHECK(cudaMemcpyAsync(b + q_dim, src.bk, kv_dim * sizeof(float), cudaMemcpyHostToDevice, st));
      CUDA_CHECK(cudaMemcpyAsync(b + q_dim + kv_dim, src.bv, kv_dim * sizeof(float), cudaMemcpyHostToDevice, st));
      dl.qkv_bias = b;
    }
    if (s.qk_norm) {
      dl.q_norm = upload_floats(src.q_norm, s.head_dim);
      dl.k_norm = upload_floats(src.k_norm, s.head_dim);
    }
    if (s.post_norms) {
      dl.post_attn_norm = upload_floats(src.post_attn_norm, d);
      dl.post_ffn_norm = upload_floats(src.post_ffn_norm, d);
    }
    const LayerSpec ls = s.layer(l);
    dl.window = ls.window;
    auto it = std::find_if(tables.begin(), tables.end(), [&](const Table& t) {
      return t.base == ls.rope_base && t.scale == ls.rope_scale;
    });
    if (it == tables.end()) {
      const std::vector<float2> t = rope_table_host(s.n_ctx, s.head_dim, ls.rope_base, ls.rope_scale, w.rope_freqs);
      float2* dev = device_alloc<float2>(t.size(), mem_.scratch);
      CUDA_CHECK(cudaMemcpyAsync(dev, t.data(), t.size() * sizeof(float2), cudaMemcpyHostToDevice, st));
      CUDA_CHECK(cudaStreamSynchronize(st));  // `t` dies here
      tables.push_back({ls.rope_base, ls.rope_scale, dev});
      it = tables.end() - 1;
    }
    dl.rope = it->dev;
  }
  g_qkv_ = activation_alloc<float>(static_cast<size_t>(q_dim) + 2 * kv_dim);
  g_tmp_ = activation_alloc<float>(d);
  if (s.post_norms) g_xalt_ = activation_alloc<float>(d);
  if (s.post_norms) g_ptmp_ = device_alloc<float>(static_cast<size_t>(chunk_) * d, mem_.scratch);
  g_max_splits_ = arch_attn_max_splits(s.n_ctx);
  if (!fused_decode_) {
    g_short_cap_ = arch_short_attention_cap(s.head_dim, s.n_ctx);
    g_short_beside_cap_ = arch_short_attention_cap_beside(s.head_dim, s.n_ctx);
  }
  g_part_o_ = device_alloc<float>(static_cast<size_t>(s.n_heads) * g_max_splits_ * s.head_dim, mem_.scratch);
  g_part_ml_ = device_alloc<float>(static_cast<size_t>(s.n_heads) * g_max_splits_ * 2, mem_.scratch);
  g_counters_ = device_alloc<unsigned int>(s.n_heads, mem_.scratch);
  CUDA_CHECK(cudaMemsetAsync(g_counters_, 0, s.n_heads * sizeof(unsigned int), st));
}

// Embedding, then per layer 5 launches (norm+QKV, attention with the QKV finish, O, norm+gate/up with the GLU
// epilogue, down), then the final norm + lm_head + argmax; post-norm models fold each post-norm + residual add into
// the next norm+matvec's staging (PreAdd) and add the last layer's in one more launch.
int CudaBackend::general_kernels_per_token() const {
  const ModelSpec& s = spec_;
  return 2 + 5 * s.n_layers + (s.post_norms ? 1 : 0);
}

QkvFinishArgs CudaBackend::finish_args(const DevLayer& L, const float* qkv, int n, const int32_t* pos0, float* q_out,
                                       __half* kc, __half* vc) const {
  QkvFinishArgs a;
  a.qkv = qkv;
  a.n = n;
  a.pos0 = pos0;
  a.bias = L.qkv_bias;
  a.q_norm = L.q_norm;
  a.k_norm = L.k_norm;
  a.eps = spec_.rms_eps;
  a.rope_table = L.rope != nullptr ? L.rope : rope_;  // the plain path has one table (setup_general sets none)
  a.style = spec_.rope_style;
  a.n_heads = spec_.n_heads;
  a.n_kv_heads = spec_.n_kv_heads;
  a.head_dim = spec_.head_dim;
  a.q_out = q_out;
  a.k_cache = kc;
  a.v_cache = vc;
  return a;
}

// One query (decode, or a one-token prompt) splits the visible positions over up to g_max_splits_ blocks per head.
ArchAttnArgs CudaBackend::attention_args(const DevLayer& L, const float* q, int n, const int32_t* pos0,
                                         const __half* kc, const __half* vc) const {
  ArchAttnArgs a;
  a.q = q;
  a.k_cache = kc;
  a.v_cache = vc;
  a.pos0 = pos0;
  a.n = n;
  a.n_heads = spec_.n_heads;
  a.n_kv_heads = spec_.n_kv_heads;
  a.head_dim = spec_.head_dim;
  a.window = L.window;
  a.scale = spec_.attention_scale();
  if (n == 1) {
    a.max_splits = g_max_splits_;
    a.part_o = g_part_o_;
    a.part_ml = g_part_ml_;
    a.counters = g_counters_;
  }
  return a;
}

void CudaBackend::enqueue_decode_general(bool capture_hidden, DecodeVariant variant) {
  const ModelSpec& s = spec_;
  const int d = s.d_model;
  cudaStream_t st = res_.stream;
  const int32_t* pos = &io_dev_->pos;
  launch_embed_scaled(embd_, io_dev_, nullptr, 1, s.embed_scale, x_, st);
  after_launch();
  if (capture_hidden) CUDA_CHECK(cudaMemcpyAsync(hidden_, x_, d * sizeof(float), cudaMemcpyDefault, st));
  // Post-norm models: the O / down projection's output waits in g_tmp_ (`pending`) for the next norm+matvec, which
  // stages x + rmsnorm(g_tmp_) * post_norm and writes that sum to the other residual buffer (PreAdd). take_pending
  // hands that add to the next launch and returns the launch's input; `x` then names the buffer holding the sum.
  float* x = x_;
  PreAdd pending;
  auto take_pending = [&](PreAdd* pre) {
    float* in = x;
    *pre = pending;
    pending = PreAdd{};
    if (pre->y != nullptr) x = pre->x_next = x == x_ ? g_xalt_ : x_;
    return in;
  };
  PreAdd pre;
  for (int l = 0; l < s.n_layers; ++l) {
    const DevLayer& L = layers_[l];
    __half* kc = layer_k(l);
    __half* vc = layer_v(l);
    const float* in = take_pending(&pre);
    launch_norm_matvec(L.qkv, in, L.attn_norm, s.rms_eps, g_qkv_, st, pre);
    after_launch();
    if (capture_hidden && l > 0)  // the previous layer's output (its post-norm add completed by the launch above)
      CUDA_CHECK(cudaMemcpyAsync(hidden_ + static_cast<size_t>(l) * d, x, d * sizeof(float), cudaMemcpyDefault, st));
    ArchAttnArgs att = attention_args(L, q_, 1, pos, kc, vc);  // finishes q, k, v itself and appends k, v
    att.fused_finish = true;
    att.finish = finish_args(L, g_qkv_, 1, pos, nullptr, kc, vc);
    att.out = attn_out_;
    if (variant == kDecodeShortBeside) launch_arch_attention_short(att, g_short_beside_cap_, st);
    else if (variant == kDecodeShort && g_short_cap_ > 0) launch_arch_attention_short(att, g_short_cap_, st);
    else launch_arch_attention(att, st);
    after_launch();
    if (s.post_norms) {
      launch_matvec(L.o, attn_out_, g_tmp_, st);
      pending = PreAdd{g_tmp_, L.post_attn_norm, s.rms_eps, nullptr};
    } else {
      launch_matvec_residual(L.o, attn_out_, x, st);
    }
    after_launch();
    in = take_pending(&pre);
    launch_norm_matvec_silu_glu(L.gate_up, in, L.ffn_norm, s.rms_eps, ffn_act_, st, s.activation, pre);
    after_launch();
    if (s.post_norms) {
      launch_matvec(L.down, ffn_act_, g_tmp_, st);
      pending = PreAdd{g_tmp_, L.post_ffn_norm, s.rms_eps, nullptr};
    } else {
      launch_matvec_residual(L.down, ffn_act_, x, st);
    }
    after_launch();
  }
  if (pending.y != nullptr) {  // the last layer's post-norm + residual, in place
    launch_add_normed(pending.y, pending.w, pending.eps, 1, d, x, st);
    after_launch();
  }
  if (capture_hidden)
    CUDA_CHECK(cudaMemcpyAsync(hidden_ + static_cast<size_t>(s.n_layers) * d, x, d * sizeof(float),
                               cudaMemcpyDefault, st));
  launch_norm_matvec_argmax(lm_head_, x, out_norm_, s.rms_eps, logits_, argmax_, result_dev_, io_dev_, st,
                            kResultRing);
  after_launch();
}

// A prompt chunk on the general path: the tensor-core projections of the plain path (prompt_gemm.cu) with the
// kernels of arch.cuh between them, per layer: norm->operand, QKV projection, QKV finish, attention->operand, O
// projection (+residual, or into g_ptmp_ and add_normed), norm->operand, gate/up projection, GLU->operand, down
// projection (likewise); then the last token's norm + lm_head + argmax.
void CudaBackend::enqueue_prefill_chunk_general(int m, const int32_t* io, bool last) {
  const ProgrammaticLaunchScope pdl_scope(use_pdl_);
  enqueue_layers_general(m, io + 1, io, BatchRows{});
  if (!last) return;
  launch_norm_matvec_argmax(lm_head_, px_ + static_cast<size_t>(m - 1) * spec_.d_model, out_norm_, spec_.rms_eps,
                            logits_, argmax_, result_dev_, nullptr, res_.stream);
  after_launch();
}

void CudaBackend::enqueue_layers_general(int m, const int32_t* tokens, const int32_t* pos0, const BatchRows& rows) {
  const ModelSpec& s = spec_;
  cudaStream_t st = res_.stream;
  const int d = s.d_model;
  const int64_t off = rows.pos != nullptr ? 0 : prompt_slot_ * slot_stride_;  // batch rows find their slots
  launch_embed_scaled(embd_, nullptr, tokens, m, s.embed_scale, px_, st);
  after_launch();
  for (int l = 0; l < s.n_layers; ++l) {
    const DevLayer& L = layers_[l];
    __half* kc = layer_k(l) + off;
    __half* vc = layer_v(l) + off;
    launch_rmsnorm_to_half(px_, m, d, L.attn_norm, s.rms_eps, pa_, st);
    after_launch();
    gemm(L.qkv, m, pc_, false);
    ArchAttnArgs att = attention_args(L, pq_, m, pos0, kc, vc);
    att.out_half = pa_;
    if (rows.pos == nullptr) {
      launch_qkv_finish(finish_args(L, pc_, m, pos0, pq_, kc, vc), st);
      after_launch();
    } else {  // batch rows: the attention finishes each row's q, k, v itself (one block per row and head)
      att.rows = rows;
      att.max_splits = 1;
      att.fused_finish = true;
      att.finish = finish_args(L, pc_, m, nullptr, nullptr, kc, vc);
      att.finish.rows = rows;
    }
    launch_arch_attention(att, st);
    after_launch();
    if (s.post_norms) {
      gemm(L.o, m, g_ptmp_, false);
      launch_add_normed(g_ptmp_, L.post_attn_norm, s.rms_eps, m, d, px_, st);
      after_launch();
    } else {
      gemm(L.o, m, px_, true);  // added into the residual stream
    }
    launch_rmsnorm_to_half(px_, m, d, L.ffn_norm, s.rms_eps, pa_, st);
    after_launch();
    gemm(L.gate_up, m, pc_, false);
    launch_glu(pc_, m, s.d_ff, s.activation, nullptr, pa_, st);
    after_launch();
    if (s.post_norms) {
      gemm(L.down, m, g_ptmp_, false);
      launch_add_normed(g_ptmp_, L.post_ffn_norm, s.rms_eps, m, d, px_, st);
      after_launch();
    } else {
      gemm(L.down, m, px_, true);
    }
  }
}


}  // namespace cuda
}  // namespace metalattn
