// CUDA backend: batched decode (forward_batch), rows of several sequences in their own cache slots.

#include <algorithm>
#include <cstring>
#include <vector>

#include "cuda/cuda_backend.h"
#include "engine/sampling.h"

namespace metalattn {
namespace cuda {

// ------------------------------------------------------------------ batched decode (forward_batch)

void CudaBackend::setup_batch() {
  const ModelSpec& s = spec_;
  const size_t S = static_cast<size_t>(s.n_seq);
  // Tensor-core path: chains of 8 rows side by side. A chain's time is its ~150 dependent launches whatever its rows
  // (1 row 0.63 ms, 8 rows 0.63 ms per step on the H100), and parallel chains overlap: 64 rows in 8 chains ran 21.1x
  // one stream, in 2 chains of 32 18.9x, in 16 chains of 4 13.1x (benchmarks/NOTES.md).
  batch_group_ = prompt_mma_ ? kBatchChainRows : chunk_;
  batch_lm_head_mma_ = prompt_mma_supported(lm_head_.type, lm_head_.cols, 0);
  batch_io_dev_ = device_alloc<int32_t>(3 * S, mem_.scratch);
  batch_io_host_ = pinned_alloc<int32_t>(3 * S, cudaHostAllocDefault);
  batch_result_host_ = pinned_alloc<ArgmaxResult>(S, cudaHostAllocMapped);
  batch_result_dev_ = device_alias(batch_result_host_);
  batch_logits_ = device_alloc<float>(S * s.vocab, mem_.scratch);
  if (!prompt_mma_) return;
  bx_ = device_alloc<float>(S * s.d_model, mem_.scratch);
  bqkv_ = device_alloc<float>(S * (s.q_dim() + 2 * s.kv_dim()), mem_.scratch);
  ba_ = device_alloc<__half>(S * 2 * std::max(s.q_dim(), s.d_ff), mem_.scratch);
  // Group g > 0 runs on side stream g - 1, forked from the main stream by event 2 (g - 1) and joined by 2 (g - 1) + 1.
  const int groups = (s.n_seq + batch_group_ - 1) / batch_group_;
  for (int g = 1; g < groups; ++g) {
    cudaStream_t x = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    res_.side_streams.push_back(x);
    for (int k = 0; k < 2; ++k) {
      cudaEvent_t e = nullptr;
      CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      res_.events.push_back(e);
    }
  }
}

void CudaBackend::enqueue_batch(int n, const int32_t* io) {
  const ProgrammaticLaunchScope pdl_scope(use_pdl_);
  cudaStream_t st = res_.stream;
  if (!prompt_mma_) {  // the long-prompt path: groups of chunk_ rows in turn, through the prefill scratch
    for (int g0 = 0; g0 < n; g0 += batch_group_) {
      const int m = std::min(batch_group_, n - g0);
      enqueue_layers_general(m, io + g0, nullptr, BatchRows{io + 2 * n + g0, io + n + g0, slot_stride_});
      enqueue_batch_lm_head(m, g0, px_, st);
    }
    return;
  }
  // Groups of rows are independent chains of small, latency-bound kernels: each but the first forks onto its own
  // stream and the main stream joins them all at the end.
  const int groups = (n + batch_group_ - 1) / batch_group_;
  for (int g = 1; g < groups; ++g) {
    CUDA_CHECK(cudaEventRecord(res_.events[2 * (g - 1)], st));
    CUDA_CHECK(cudaStreamWaitEvent(res_.side_streams[g - 1], res_.events[2 * (g - 1)], 0));
  }
  for (int g = 0; g < groups; ++g) {
    const int g0 = g * batch_group_;
    cudaStream_t gs = g == 0 ? st : res_.side_streams[g - 1];
    enqueue_batch_group_mma(std::min(batch_group_, n - g0), g0, n, io, gs);
    if (g > 0) CUDA_CHECK(cudaEventRecord(res_.events[2 * (g - 1) + 1], gs));
  }
  for (int g = 1; g < groups; ++g) CUDA_CHECK(cudaStreamWaitEvent(st, res_.events[2 * (g - 1) + 1], 0));
}

// Rows g0 .. g0 + m of the batch on the tensor-core path: the layers of a few-token prompt (prompt_mma.cu), with the
// QKV finish and attention of arch.cuh reading each row's position and slot.
void CudaBackend::enqueue_batch_group_mma(int m, int g0, int n, const int32_t* io, cudaStream_t st) {
  const ModelSpec& s = spec_;
  const int d = s.d_model, qkv_rows = s.q_dim() + 2 * s.kv_dim();
  const BatchRows rows{io + 2 * n + g0, io + n + g0, slot_stride_};
  float* x = bx_ + static_cast<size_t>(g0) * d;
  float* qkv_out = bqkv_ + static_cast<size_t>(g0) * qkv_rows;
  __half* a = ba_ + static_cast<size_t>(g0) * 2 * std::max(s.q_dim(), s.d_ff);
  launch_embed_rows(embd_, io + g0, m, x, st);
  after_launch();
  for (int l = 0; l < s.n_layers; ++l) {
    const DevLayer& L = layers_[l];
    PromptMmaArgs qkv = mma_normed(L.qkv, m, x, L.attn_norm, s.rms_eps);
    qkv.y = qkv_out;
    launch_prompt_mma(qkv, st);
    after_launch();
    ArchAttnArgs att = attention_args(L, nullptr, m, nullptr, layer_k(l), layer_v(l));  // finishes q, k, v itself
    att.rows = rows;
    att.max_splits = 1;
    att.fused_finish = true;
    att.finish = finish_args(L, qkv_out, m, nullptr, nullptr, layer_k(l), layer_v(l));
    att.finish.rows = rows;
    att.out_half = a;
    launch_arch_attention(att, st);
    after_launch();
    enqueue_mma_o_ffn(L, m, a, x, st);
  }
  enqueue_batch_lm_head(m, g0, x, st);
}

// The rest of a layer on the tensor-core path once attention has written its m rows to `a` (slot layout): the O
// projection added into the residual rows x, norm + gate/up + SiLU*up into a, the down projection added into x.
void CudaBackend::enqueue_mma_o_ffn(const DevLayer& L, int m, __half* a, float* x, cudaStream_t st) {
  launch_prompt_mma(mma_add_residual(L.o, m, a, x), st);
  after_launch();
  PromptMmaArgs gate_up = mma_normed(L.gate_up, m, x, L.ffn_norm, spec_.rms_eps);
  gate_up.out_kind = PromptMmaOut::SiluHalf;
  gate_up.out_slots = a;
  gate_up.d_ff = spec_.d_ff;
  launch_prompt_mma(gate_up, st);
  after_launch();
  launch_prompt_mma(mma_add_residual(L.down, m, a, x), st);
  after_launch();
}

// Final norm + lm_head + argmax of rows g0 .. g0 + m (their residual streams at x): on tensor cores, up to
// kPromptMmaMaxTokens rows per launch, then one argmax launch; or, for lm_head types prompt_mma lacks, the decode
// kernel once per row. Logits into batch_logits_, argmaxes into batch_result_dev_.
void CudaBackend::enqueue_batch_lm_head(int m, int g0, const float* x, cudaStream_t st) {
  const ModelSpec& s = spec_;
  float* logits = batch_logits_ + static_cast<size_t>(g0) * s.vocab;
  if (!batch_lm_head_mma_) {
    for (int t = 0; t < m; ++t) {
      launch_norm_matvec_argmax(lm_head_, x + static_cast<size_t>(t) * s.d_model, out_norm_, s.rms_eps,
                                logits + static_cast<size_t>(t) * s.vocab, argmax_, batch_result_dev_ + g0 + t,
                                nullptr, st);
      after_launch();
    }
    return;
  }
  for (int t0 = 0; t0 < m; t0 += kPromptMmaMaxTokens) {
    PromptMmaArgs head = mma_normed(lm_head_, std::min(kPromptMmaMaxTokens, m - t0),
                                    x + static_cast<size_t>(t0) * s.d_model, out_norm_, s.rms_eps);
    head.y = logits + static_cast<size_t>(t0) * s.vocab;
    launch_prompt_mma(head, st);
    after_launch();
  }
  launch_rows_argmax(logits, m, s.vocab, batch_result_dev_ + g0, st);
  after_launch();
}

void CudaBackend::forward_batch(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n, float* logits,
                                ArgmaxResult* out) {
  enqueue_forward_batch(tokens, slots, pos, n, logits);
  finish_forward_batch(n, out);
}

// The batch step, then the draw of every sampled row on the device (launch_sample_rows: up to kSampleMaxRows rows a
// launch set, a grid row each), one wait for all; a row the device leaves to the host (and a top_k past
// kSampleMaxTopK) is drawn from its logits copied back.
void CudaBackend::forward_batch_sample(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n,
                                       const SamplingParams* params, const double* u, float* logits, bool copy_logits,
                                       int64_t vocab, ArgmaxResult* out) {
  bool host_rows = false;
  for (int i = 0; i < n; ++i)
    if (params[i].temperature > 0) {
      check_sampling_args(params[i], u[i]);
      host_rows |= !device_draws(params[i], vocab);
    }
  const bool copied = copy_logits || host_rows;
  enqueue_forward_batch(tokens, slots, pos, n, copied ? logits : nullptr);
  auto dev_row = [&](int i) { return batch_logits_ + static_cast<size_t>(i) * spec_.vocab; };
  std::vector<SampleArgs> args(n, SampleArgs{0.f, 0, 1.0, 0.0});  // inv_t 0: the row is not drawn on the device
  bool any = false;
  for (int i = 0; i < n; ++i) {
    if (!(params[i].temperature > 0) || !device_draws(params[i], vocab)) continue;
    args[i] = device_sample_args(params[i], u[i], vocab);
    any = true;
  }
  for (int g0 = 0; any && g0 < n; g0 += kSampleMaxRows) {
    launch_sample_rows(dev_row(g0), spec_.vocab, spec_.vocab, std::min(kSampleMaxRows, n - g0), batch_result_dev_ + g0,
                       args.data() + g0, sample_work_, sample_dev_ + g0, nullptr, res_.stream);
    after_launch();
  }
  finish_forward_batch(n, out);
  for (int i = 0; i < n; ++i) {
    const SamplingParams& p = params[i];
    if (!(p.temperature > 0)) continue;
    float* row = logits + static_cast<size_t>(i) * vocab;
    out[i].token = static_cast<uint32_t>(device_draws(p, vocab)
                                             ? draw_result(sample_host_[i], p, u[i], dev_row(i), row, copied, vocab)
                                             : sample_logits(row, vocab, p, u[i]));
  }
}

void CudaBackend::enqueue_forward_batch(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n,
                                        float* logits) {
  const ModelSpec& s = spec_;
  if (n <= 0 || n > s.n_seq) throw EngineError("forward_batch: 1 to n_seq rows");
  for (int i = 0; i < n; ++i) {
    check_token(tokens[i]);
    if (slots[i] < 0 || slots[i] >= s.n_seq) throw EngineError("forward_batch: sequence slot out of range");
    if (pos[i] < 0 || pos[i] >= s.n_ctx) throw EngineError("forward_batch: position past the context");
  }
  cudaStream_t st = res_.stream;
  if (batch_io_dev_ == nullptr) setup_batch();
  std::memcpy(batch_io_host_, tokens, n * sizeof(int32_t));
  std::memcpy(batch_io_host_ + n, slots, n * sizeof(int32_t));
  std::memcpy(batch_io_host_ + 2 * n, pos, n * sizeof(int32_t));
  CUDA_CHECK(cudaMemcpyAsync(batch_io_dev_, batch_io_host_, 3 * n * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  run_cached_graph(res_.batch_graphs, n, 0, 0, [&] { enqueue_batch(n, batch_io_dev_); });
  if (logits != nullptr)
    CUDA_CHECK(cudaMemcpyAsync(logits, batch_logits_, static_cast<size_t>(n) * s.vocab * sizeof(float),
                               cudaMemcpyDeviceToHost, st));
}

void CudaBackend::finish_forward_batch(int n, ArgmaxResult* out) {
  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
  for (int i = 0; i < n; ++i) {
    out[i] = batch_result_host_[i];
    if (out[i].token == kNoIndex) throw NonFiniteLogits("argmax: every logit is NaN");
  }
}


}  // namespace cuda
}  // namespace metalattn
