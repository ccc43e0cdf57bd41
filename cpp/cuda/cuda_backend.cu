// CUDA backend, host side: weight upload (the GPU matvec layout, which every kernel reads), device-private
// KV cache and scratch, the decode step captured once as a CUDA graph, and the layer-major batched prefill. The
// class is declared in cuda_backend.h; the general-architecture path is cuda_general.cu, batched decode cuda_batch.cu.
//
// Per decode token: at most one 8-byte host-to-device copy (token, position), one graph launch, one stream sync,
// and the 8-byte ArgmaxResult read from mapped pinned memory that the last kernel wrote. The last kernel also writes
// the chosen token and pos + 1 into the device-side DecodeIO, so a greedy loop that feeds the result back needs no
// host-to-device copy at all: the host keeps a shadow of what the device slot holds and copies only on a mismatch.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "arch.cuh"
#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "metalattn/backend.h"
#include "cuda/cuda_backend.h"
#include "engine/sampling.h"

namespace metalattn {

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return n;
}

std::string cuda_device_name() {
  if (cuda_device_count() <= 0) return {};
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  return prop.name;
}

size_t cuda_device_memory_used() {
  if (cuda_device_count() <= 0) return 0;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return total_b - free_b;
}

double cuda_copy_bandwidth() {
  if (cuda_device_count() <= 0) return 0.0;
  const size_t bytes = size_t{1} << 30;  // far larger than the 50 MB L2
  void *a = nullptr, *b = nullptr;
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  double result = 0.0;
  if (cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess &&
      cudaEventCreate(&t0) == cudaSuccess && cudaEventCreate(&t1) == cudaSuccess) {
    cudaMemset(a, 1, bytes);
    float best_ms = 1e30f;
    for (int i = 0; i < 6; ++i) {
      cudaEventRecord(t0);
      cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
      cudaEventRecord(t1);
      cudaEventSynchronize(t1);
      float ms = 0.f;
      cudaEventElapsedTime(&ms, t0, t1);
      if (i > 0 && ms < best_ms) best_ms = ms;  // the first copy warms up
    }
    result = 2.0 * bytes / (best_ms * 1e-3);   // each byte is read once and written once
  }
  if (t0) cudaEventDestroy(t0);
  if (t1) cudaEventDestroy(t1);
  if (a) cudaFree(a);
  if (b) cudaFree(b);
  cudaGetLastError();
  return result;
}

namespace cuda {

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strcmp(v, "0") != 0;
}

// Host-to-device copies are ordered on our stream (a plain cudaMemcpy from pageable memory may return before its
// DMA lands, which would race kernels on a non-blocking stream); the packed host image is synchronised before it
// goes out of scope.
DevMatrix CudaBackend::upload(const std::vector<const WeightView*>& parts) {
  const PackedMatrix p = pack_matrix(parts, common_exact_type(parts));
  DevMatrix m;
  m.type = p.type;
  m.rows = p.rows;
  m.cols = p.cols;
  m.nb = p.nb;
  uint8_t* payload = device_alloc<uint8_t>(p.payload.size(), mem_.weights);
  CUDA_CHECK(cudaMemcpyAsync(payload, p.payload.data(), p.payload.size(), cudaMemcpyHostToDevice, res_.stream));
  m.payload = payload;
  if (!p.scales.empty()) {
    uint16_t* scales = device_alloc<uint16_t>(p.scales.size(), mem_.weights);
    CUDA_CHECK(cudaMemcpyAsync(scales, p.scales.data(), p.scales.size() * 2, cudaMemcpyHostToDevice, res_.stream));
    m.scales = scales;
  }
  if (!p.aux.empty()) {
    uint32_t* aux = device_alloc<uint32_t>(p.aux.size(), mem_.weights);
    CUDA_CHECK(cudaMemcpyAsync(aux, p.aux.data(), p.aux.size() * 4, cudaMemcpyHostToDevice, res_.stream));
    m.aux = aux;
  }
  if (!p.mma_scales.empty()) {
    float* ms = device_alloc<float>(p.mma_scales.size(), mem_.weights);
    CUDA_CHECK(cudaMemcpyAsync(ms, p.mma_scales.data(), p.mma_scales.size() * 4, cudaMemcpyHostToDevice, res_.stream));
    m.mma_scales = reinterpret_cast<const float2*>(ms);
  }
  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
  return m;
}

const float* CudaBackend::upload_floats(const float* host, size_t n) {
  float* d = device_alloc<float>(n, mem_.weights);
  CUDA_CHECK(cudaMemcpyAsync(d, host, n * sizeof(float), cudaMemcpyHostToDevice, res_.stream));
  return d;
}

CudaBackend::CudaBackend(const ModelSpec& spec, const ModelWeights& w, bool debug)
    : spec_(spec),
      debug_(debug),
      use_pdl_(env_flag("METALATTN_CUDA_PDL", true)) {  // measured +5% decode on H100; =0 turns it off
  validate_model(spec, w);
  // The plain Llama layer (RoPE factors included: they only change the RoPE table) runs the fused kernels of
  // kernels.cuh; every other architecture the general path of arch.cuh, except that the Llama layer with Q/K/V
  // biases or NeoX pairs (Qwen 2) decodes on the fused kernels too (measured on the H100, Qwen2.5-0.5B shape and
  // types: 701 us a token on the general path, 610 fused).
  const bool fused_fits = spec.head_dim <= 128 && spec.n_heads / spec.n_kv_heads <= 8 &&
                          !env_flag("METALATTN_CUDA_GENERAL", false);
  general_ = !(spec.plain_llama() && fused_fits);
  fused_decode_ = spec.llama_layer_up_to_qkv() && fused_fits;
  if (spec.head_dim % 32 != 0 || spec.head_dim > kArchMaxHeadDim)
    throw BackendUnsupported("the CUDA backend needs head_dim a multiple of 32, at most " +
                             std::to_string(kArchMaxHeadDim) + " (this model: " + std::to_string(spec.head_dim) + ")");
  auto check_type = [](const WeightView& m, const std::string& name) {
    switch (m.type) {
      case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16:
      case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q8_0:
      case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
      case GgmlType::Q2_K: case GgmlType::Q3_K: return;  // Q2_K / Q3_K as kWide8 (kernels.cuh, DevMatrix)
      default:
        throw BackendUnsupported(std::string("the CUDA backend does not run ") + type_name(m.type) +
                                 " tensors yet (" + name + ")");
    }
  };
  check_type(w.tok_embd, "token_embd.weight");
  check_type(w.output, "output.weight");
  for (int l = 0; l < spec.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    for (const WeightView* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
      check_type(*m, "blk." + std::to_string(l));
  }
  if (cuda_device_count() <= 0) throw EngineError("no CUDA device is available");
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaStreamCreateWithFlags(&res_.stream, cudaStreamNonBlocking));

  const int L = spec.n_layers, d = spec.d_model, kv_dim = spec.kv_dim(), q_dim = spec.q_dim();
  // The KV cache first: it is the allocation that grows with n_ctx, so an impossible n_ctx fails before any work.
  slot_stride_ = static_cast<int64_t>(L) * spec.n_ctx * kv_dim;
  const size_t cache_elems = static_cast<size_t>(spec.n_seq) * slot_stride_;
  k_cache_ = device_alloc<__half>(cache_elems, mem_.kv_cache);
  v_cache_ = device_alloc<__half>(cache_elems, mem_.kv_cache);

  // Weights.
  embd_ = upload({&w.tok_embd});
  lm_head_ = (w.output.data == w.tok_embd.data && w.output.type == w.tok_embd.type) ? embd_ : upload({&w.output});
  out_norm_ = upload_floats(w.output_norm, d);
  layers_.resize(L);
  for (int l = 0; l < L; ++l) {
    const LayerWeights& src = w.layers[l];
    DevLayer& dl = layers_[l];
    dl.qkv = upload({&src.wq, &src.wk, &src.wv});
    dl.o = upload({&src.wo});
    dl.gate_up = upload({&src.w_gate, &src.w_up});
    dl.down = upload({&src.w_down});
    dl.attn_norm = upload_floats(src.attn_norm, d);
    dl.ffn_norm = upload_floats(src.ffn_norm, d);
  }

  // RoPE table, computed exactly as the reference does (double angle, float cos/sin; Llama 3 factors included).
  {
    const std::vector<float2> table = rope_table_host(spec.n_ctx, spec.head_dim, spec.rope_base, 1.f, w.rope_freqs);
    rope_ = device_alloc<float2>(table.size(), mem_.scratch);
    CUDA_CHECK(cudaMemcpyAsync(rope_, table.data(), table.size() * sizeof(float2), cudaMemcpyHostToDevice, res_.stream));
    CUDA_CHECK(cudaStreamSynchronize(res_.stream));  // `table` dies here
  }

  // Every model the fused decode kernels run (Qwen 2's layer too) prompts on the plain path's kernels.
  prompt_mma_ = fused_decode_ && env_flag("METALATTN_CUDA_PROMPT_MMA", true) && spec.head_dim == 64;
  for (const DevLayer& dl : layers_)
    prompt_mma_ = prompt_mma_ && prompt_mma_supported(dl.qkv.type, dl.qkv.cols, 0) &&
                  prompt_mma_supported(dl.o.type, dl.o.cols, 0) &&
                  prompt_mma_supported(dl.gate_up.type, dl.gate_up.cols, spec.d_ff) &&
                  prompt_mma_supported(dl.down.type, dl.down.cols, 0);

  // Decode scratch.
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  // Attention splits the context only past kAttnSinglePassMax positions, into at most one block per SM.
  attn_.max_splits = attn_max_splits(spec.n_ctx, spec.n_kv_heads, prop.multiProcessorCount);
  attn_.o = device_alloc<float>(static_cast<size_t>(spec.n_heads) * attn_.max_splits * spec.head_dim, mem_.scratch);
  attn_.ml = device_alloc<float>(static_cast<size_t>(spec.n_heads) * attn_.max_splits * 2, mem_.scratch);
  attn_.counters = device_alloc<unsigned int>(spec.n_heads, mem_.scratch);  // one per head block
  CUDA_CHECK(cudaMemsetAsync(attn_.counters, 0, spec.n_heads * sizeof(unsigned int), res_.stream));
  attn_out_ = activation_alloc<float>(q_dim);
  argmax_.capacity = argmax_partials_needed(lm_head_);
  argmax_.partials = device_alloc<ArgmaxPartial>(argmax_.capacity, mem_.scratch);
  argmax_.counter = device_alloc<unsigned int>(1, mem_.scratch);
  argmax_.last = device_alloc<ArgmaxResult>(1, mem_.scratch);
  CUDA_CHECK(cudaMemsetAsync(argmax_.counter, 0, sizeof(unsigned int), res_.stream));
  io_dev_ = device_alloc<DecodeIO>(1, mem_.scratch);
  x_ = activation_alloc<float>(d);
  q_ = activation_alloc<float>(q_dim);
  ffn_act_ = activation_alloc<float>(spec.d_ff);
  logits_ = activation_alloc<float>(spec.vocab);
  hidden_ = activation_alloc<float>(static_cast<size_t>(L + 1) * d);
  io_host_ = pinned_alloc<DecodeIO>(1, cudaHostAllocDefault);
  result_host_ = pinned_alloc<ArgmaxResult>(kResultRing, cudaHostAllocMapped);
  result_dev_ = device_alias(result_host_);
  {
    const size_t works = static_cast<size_t>(std::max(1, std::min(spec.n_seq, kSampleMaxRows)));  // a batch's rows
    sample_work_ = device_alloc<uint8_t>(works * sample_work_bytes(), mem_.scratch);
    CUDA_CHECK(cudaMemsetAsync(sample_work_, 0, works * sample_work_bytes(), res_.stream));
  }
  sample_host_ = pinned_alloc<SampleResult>(std::max(spec.n_seq, kResultRing), cudaHostAllocMapped);
  sample_dev_ = device_alias(sample_host_);

  // Prefill scratch.
  // Up to 2048 tokens per chunk: the tensor-core attention runs a block per (head, 64 queries), so a 1024-token chunk
  // left SmolLM2 with 144 four-warp blocks on 132 SMs, and a 2048-token prompt took the longest key row twice over.
  chunk_ = std::min(spec.n_ctx, 2048);
  const size_t widest_in = std::max({static_cast<size_t>(d), static_cast<size_t>(q_dim), static_cast<size_t>(spec.d_ff)});
  const size_t widest_out = std::max(static_cast<size_t>(q_dim + 2 * kv_dim), 2 * static_cast<size_t>(spec.d_ff));
  // At least kPromptFewChunks: a prompt of a few dozen tokens runs as that many chunks (prompt_chunk_len).
  max_chunks_ = std::max(kPromptFewChunks, (spec.n_ctx + chunk_ - 1) / chunk_);
  tokens_dev_ = device_alloc<int32_t>(static_cast<size_t>(chunk_) + 1, mem_.scratch);
  tokens_host_ = pinned_alloc<int32_t>(static_cast<size_t>(max_chunks_) * (chunk_ + 1), cudaHostAllocDefault);
  px_ = device_alloc<float>(static_cast<size_t>(chunk_) * d, mem_.scratch);
  pq_ = device_alloc<float>(static_cast<size_t>(chunk_) * q_dim, mem_.scratch);
  pc_ = device_alloc<float>(static_cast<size_t>(chunk_) * widest_out, mem_.scratch);
  pa_ = device_alloc<__half>(2 * static_cast<size_t>(chunk_) * widest_in, mem_.scratch);
  if (general_) setup_general(w);

  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
}

void CudaBackend::read_kv_rows(int layer, int slot, int pos0, int n, float* k, float* v) const {
  check_kv_rows(spec_, layer, slot, pos0, n);
  const size_t count = static_cast<size_t>(n) * spec_.kv_dim();
  const int64_t off = slot * slot_stride_ + static_cast<int64_t>(pos0) * spec_.kv_dim();
  std::vector<__half> h(count);
  CUDA_CHECK(cudaStreamSynchronize(res_.stream));  // every enqueued step has written its rows
  for (int which = 0; which < 2; ++which) {
    const __half* src = (which == 0 ? layer_k(layer) : layer_v(layer)) + off;
    CUDA_CHECK(cudaMemcpy(h.data(), src, count * sizeof(__half), cudaMemcpyDeviceToHost));
    float* dst = which == 0 ? k : v;
    for (size_t i = 0; i < count; ++i) dst[i] = __half2float(h[i]);
  }
}

void CudaBackend::check_token(int32_t token) const {
  if (token < 0 || token >= spec_.vocab)
    throw EngineError("token id " + std::to_string(token) + " is outside the vocabulary");
}

void CudaBackend::set_io(int32_t token, int pos) {
  check_token(token);
  if (pos < 0 || pos >= spec_.n_ctx)
    throw EngineError("position " + std::to_string(pos) + " is outside the context of " + std::to_string(spec_.n_ctx));
  if (io_shadow_valid_ && io_shadow_.token == token && io_shadow_.pos == pos) return;
  io_shadow_valid_ = false;
  *io_host_ = DecodeIO{token, pos};
  CUDA_CHECK(cudaMemcpyAsync(io_dev_, io_host_, sizeof(DecodeIO), cudaMemcpyHostToDevice, res_.stream));
}

void CudaBackend::after_launch() {
  if (!debug_) return;
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
}

void CudaBackend::enqueue_decode(bool capture_hidden, DecodeVariant variant) {
  if (!fused_decode_) return enqueue_decode_general(capture_hidden, variant);
  const ModelSpec& s = spec_;
  cudaStream_t st = res_.stream;
  if (s.n_layers == 0) {  // no first layer to fold the embedding gather into
    launch_embed(embd_, io_dev_, x_, st);
    after_launch();
    if (capture_hidden) CUDA_CHECK(cudaMemcpyAsync(hidden_, x_, s.d_model * sizeof(float), cudaMemcpyDefault, st));
  }
  for (int l = 0; l < s.n_layers; ++l) {
    const DevLayer& L = layers_[l];
    __half* kc = layer_k(l);
    __half* vc = layer_v(l);
    QkvTargets t = qkv_targets(rope_, io_dev_, s.q_dim(), s.kv_dim(), s.head_dim, q_, kc, vc);
    t.bias = L.qkv_bias;  // null unless the layer has biases (general_ then uploaded them)
    t.neox = s.rope_style == RopeStyle::Neox;
    if (l == 0) {
      launch_embed_norm_matvec_qkv(embd_, x_, L.qkv, L.attn_norm, s.rms_eps, t, st);  // also x_ = embedding row
      after_launch();
      if (capture_hidden)
        CUDA_CHECK(cudaMemcpyAsync(hidden_, x_, s.d_model * sizeof(float), cudaMemcpyDefault, st));
    } else {
      launch_norm_matvec_qkv(L.qkv, x_, L.attn_norm, s.rms_eps, t, st);
      after_launch();
    }
    if (variant == kDecodeShort && s.head_dim == 64) {
      // kDecodeShort serves pos + 1 <= kShortAttnMaxPos, all of whose K and V rows fit in shared memory.
      launch_attention_decode_short(q_, kc, vc, io_dev_, s.n_heads, s.n_kv_heads, s.head_dim,
                                    std::min(s.n_ctx, kShortAttnMaxPos), attn_out_, st);
    } else {
      if (variant == kDecodeLong && tc_decode_attention_fits(s.n_heads, s.n_kv_heads, s.head_dim, s.n_ctx,
                                                             attn_.max_splits)) {
        launch_attention_decode_tc(q_, kc, vc, io_dev_, s.n_heads, s.n_kv_heads, s.head_dim, s.n_ctx, attn_,
                                   attn_out_, st);
      } else {
        const int heads_per_block = variant == kDecodeLong ? s.n_heads / s.n_kv_heads : 1;
        launch_attention_decode(q_, kc, vc, io_dev_, s.n_heads, s.n_kv_heads, s.head_dim, s.n_ctx, attn_, attn_out_,
                                st, heads_per_block);
      }
    }
    after_launch();
    launch_matvec_residual(L.o, attn_out_, x_, st);
    after_launch();
    launch_norm_matvec_silu_glu(L.gate_up, x_, L.ffn_norm, s.rms_eps, ffn_act_, st);
    after_launch();
    launch_matvec_residual(L.down, ffn_act_, x_, st);
    after_launch();
    if (capture_hidden)
      CUDA_CHECK(cudaMemcpyAsync(hidden_ + static_cast<size_t>(l + 1) * s.d_model, x_, s.d_model * sizeof(float),
                                 cudaMemcpyDefault, st));
  }
  launch_norm_matvec_argmax(lm_head_, x_, out_norm_, s.rms_eps, logits_, argmax_, result_dev_, io_dev_, st,
                            kResultRing);
  after_launch();
}

// The host knows the position, so it picks the graph (see DecodeVariant).
void CudaBackend::run_decode(int pos) {
  const DecodeVariant variant = decode_variant_at(pos);
  auto enqueue = [&] { enqueue_decode(false, variant); };
  if (debug_) {
    enqueue();
    return;
  }
  cudaGraph_t& graph = res_.graph[variant];
  cudaGraphExec_t& graph_exec = res_.graph_exec[variant];
  if (graph_exec == nullptr) {
    const bool previous = programmatic_launch();
    set_programmatic_launch(use_pdl_);
    CUDA_CHECK(cudaStreamBeginCapture(res_.stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(res_.stream, &g);
      if (g != nullptr) cudaGraphDestroy(g);
      set_programmatic_launch(previous);
      throw;
    }
    set_programmatic_launch(previous);
    CUDA_CHECK(cudaStreamEndCapture(res_.stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
  }
  CUDA_CHECK(cudaGraphLaunch(graph_exec, res_.stream));
}

ArgmaxResult CudaBackend::finish_decode(int pos) {
  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
  const ArgmaxResult r = result_host_[pos % kResultRing];
  if (r.token == kNoIndex) {
    io_shadow_valid_ = false;
    throw NonFiniteLogits("argmax: every logit is NaN");
  }
  io_shadow_ = DecodeIO{static_cast<int32_t>(r.token), pos + 1};
  io_shadow_valid_ = true;
  return r;
}

ArgmaxResult CudaBackend::forward_token_greedy(int32_t token, int pos) {
  set_io(token, pos);
  run_decode(pos);
  return finish_decode(pos);
}

// Every step's graph is launched before the first is waited on: the argmax kernel of step i writes the next token
// and position into io_dev_ for step i + 1, and its result into its own slot of the mapped ring, so nothing crosses
// the bus between the steps: the launch, the wait and the wake-up of each forward_token_greedy call cost 7-10 us a
// token on the H100 (NOTES, "CUDA, session 25").
void CudaBackend::check_run(const char* name, int pos, int n) const {
  if (n < 1 || n > kMaxGreedyRun)
    throw EngineError(std::string(name) + ": 1 to " + std::to_string(kMaxGreedyRun) + " steps at a time, not " +
                      std::to_string(n));
  if (pos + n > spec_.n_ctx)
    throw EngineError(std::string(name) + ": positions past the context of " + std::to_string(spec_.n_ctx));
}

void CudaBackend::forward_tokens_greedy(int32_t token, int pos, int n, ArgmaxResult* out) {
  check_run("forward_tokens_greedy", pos, n);
  set_io(token, pos);
  io_shadow_valid_ = false;
  for (int i = 0; i < n; ++i) run_decode(pos + i);
  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
  for (int i = 0; i < n; ++i) {
    out[i] = result_host_[(pos + i) % kResultRing];
    if (out[i].token == kNoIndex)  // the steps after it decoded a stale token: the whole run is void
      throw NonFiniteLogits("argmax: every logit is NaN (decode step at position " + std::to_string(pos + i) + ")");
  }
  io_shadow_ = DecodeIO{static_cast<int32_t>(out[n - 1].token), pos + n};
  io_shadow_valid_ = true;
}

void CudaBackend::forward_token(int32_t token, int pos, float* logits) {
  set_io(token, pos);
  run_decode(pos);
  finish_decode(pos);
  CUDA_CHECK(cudaMemcpy(logits, logits_, spec_.vocab * sizeof(float), cudaMemcpyDefault));
}

// The step's graph, then the draw on the device (sampling.cu) from the logits the lm_head left and its argmax: 8 bytes
// come back, and the drawn token is already in io_dev_ for the next step. A draw the device leaves to the host (a
// top_k past kSampleMaxTopK, a flat row's top_p) copies the row back, as forward_token does.
SampleArgs CudaBackend::device_sample_args(const SamplingParams& p, double u, int64_t vocab) {
  SampleArgs a;
  a.inv_t = static_cast<float>(1.0 / p.temperature);
  a.top_k = p.top_k < vocab ? static_cast<int>(p.top_k) : 0;
  a.top_p = p.top_p;
  a.u = u;
  return a;
}

int64_t CudaBackend::draw_result(const SampleResult& r, const SamplingParams& p, double u, const float* dev_row,
                                 float* row, bool row_copied, int64_t vocab) {
  if (r.status == kSampleNoCandidate) throw NonFiniteLogits("sampling: every logit is NaN or -inf: nothing to sample");
  if (r.status != kSampleOnHost) return r.token;
  if (!row_copied) CUDA_CHECK(cudaMemcpy(row, dev_row, vocab * sizeof(float), cudaMemcpyDefault));
  return sample_logits(row, vocab, p, u);
}

int64_t CudaBackend::forward_token_sample(int32_t token, int pos, const SamplingParams& p, double u, float* logits,
                                          int64_t vocab) {
  check_sampling_args(p, u);
  if (!device_draws(p, vocab)) return Backend::forward_token_sample(token, pos, p, u, logits, vocab);
  set_io(token, pos);
  run_decode(pos);
  launch_sample(logits_, spec_.vocab, argmax_.last, device_sample_args(p, u, vocab), sample_work_,
                sample_dev_, io_dev_, res_.stream);
  after_launch();
  finish_decode(pos);  // the sync; every logit NaN throws here
  const SampleResult r = *sample_host_;
  // A drawn token is in io_dev_ for the next step; otherwise io_dev_ still holds the argmax, as finish_decode's shadow
  // says (a row of nothing but NaN and -inf leaves the shadow unused).
  if (r.status == kSampleNoCandidate) io_shadow_valid_ = false;
  if (r.status == kSampleDrawn) io_shadow_ = DecodeIO{r.token, pos + 1};
  return draw_result(r, p, u, logits_, logits, false, vocab);
}

// Every step's graph and draw queued before the first is waited on: step i's draw writes its token into io_dev_,
// which step i + 1's graph reads, and its result into slot (pos + i) % kResultRing, so nothing crosses the bus between
// the steps (as forward_tokens_greedy). A draw left to the host voids the steps after it: that step is run again on
// its own (the same input at the same position writes the same K/V) and its token drawn from the row copied back.
int CudaBackend::forward_tokens_sample(int32_t token, int pos, int n, const SamplingParams& p, const double* u,
                                       float* logits, int64_t vocab, int64_t* out) {
  check_run("forward_tokens_sample", pos, n);
  for (int i = 0; i < n; ++i) check_sampling_args(p, u[i]);
  if (!device_draws(p, vocab)) return Backend::forward_tokens_sample(token, pos, n, p, u, logits, vocab, out);
  set_io(token, pos);
  io_shadow_valid_ = false;
  for (int i = 0; i < n; ++i) {
    run_decode(pos + i);
    launch_sample(logits_, spec_.vocab, argmax_.last, device_sample_args(p, u[i], vocab),
                  sample_work_, sample_dev_ + (pos + i) % kResultRing, io_dev_, res_.stream);
    after_launch();
  }
  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
  for (int i = 0; i < n; ++i) {
    const int slot = (pos + i) % kResultRing;
    if (result_host_[slot].token == kNoIndex)  // the steps after it decoded a stale token: the whole run is void
      throw NonFiniteLogits("argmax: every logit is NaN (decode step at position " + std::to_string(pos + i) + ")");
    const SampleResult r = sample_host_[slot];
    if (r.status == kSampleNoCandidate)
      throw NonFiniteLogits("sampling: every logit is NaN or -inf: nothing to sample (decode step at position " +
                            std::to_string(pos + i) + ")");
    if (r.status == kSampleOnHost) {
      out[i] = forward_token_sample(i == 0 ? token : static_cast<int32_t>(out[i - 1]), pos + i, p, u[i], logits, vocab);
      return i + 1;
    }
    out[i] = r.token;
  }
  io_shadow_ = DecodeIO{static_cast<int32_t>(out[n - 1]), pos + n};
  io_shadow_valid_ = true;
  return n;
}

void CudaBackend::forward_token_debug(int32_t token, int pos, float* hidden, float* logits) {
  set_io(token, pos);
  enqueue_decode(true, decode_variant_at(pos));
  finish_decode(pos);
  CUDA_CHECK(cudaMemcpy(hidden, hidden_, static_cast<size_t>(spec_.n_layers + 1) * spec_.d_model * sizeof(float),
                        cudaMemcpyDefault));
  CUDA_CHECK(cudaMemcpy(logits, logits_, spec_.vocab * sizeof(float), cudaMemcpyDefault));
}

// Up to 2 kPromptMmaMaxTokens tokens the projection runs on the few-token kernels instead (prompt_mma.cu), 32 tokens a
// launch: their blocks own 16 rows and split K, so a short prompt still spreads over the GPU, where the 64 x 64 tiles
// of prompt_gemm.cu leave most SMs idle (H100, Qwen2.5-0.5B shape, a 64-token prompt: 14.4k tok/s on prompt_gemm.cu,
// 19.0k this way; 32.7k on the cuBLAS GEMMs before them).
void CudaBackend::gemm(const DevMatrix& W, int n, float* y, bool accumulate) {
  if (n <= 2 * kPromptMmaMaxTokens && prompt_mma_supported(W.type, W.cols, 0)) {
    for (int t0 = 0; t0 < n; t0 += kPromptMmaMaxTokens) {
      const size_t row = static_cast<size_t>(t0);
      PromptMmaArgs p = mma_add_residual(W, std::min(kPromptMmaMaxTokens, n - t0), pa_ + row * 2 * W.cols,
                                         y + row * W.rows);
      if (!accumulate) p.out_kind = PromptMmaOut::Store;
      launch_prompt_mma(p, res_.stream);
      after_launch();
    }
    return;
  }
  PromptGemmArgs g;
  g.W = W;
  g.n = n;
  g.x_slots = pa_;
  g.y = y;
  g.accumulate = accumulate;
  launch_prompt_gemm(g, res_.stream);
  after_launch();
}

void CudaBackend::ensure_all_logits_buffer() {
  if (plogits_ != nullptr) return;
  logits_chunk_ = std::min(chunk_, 64);
  plogits_ = device_alloc<float>(static_cast<size_t>(logits_chunk_) * spec_.vocab, mem_.scratch);
}

// One chunk of a prompt, layer-major: io points at [start position, m tokens] in device memory, so the same
// sequence (captured once as a graph) serves every start position. Only the prompt's last chunk (last) ends with the
// lm_head. Per layer 8 launches (9 when head_dim != 64, or
// with Qwen 2's QKV finish before the attention: enqueue_prompt_attention): norm->operand, QKV projection,
// RoPE+KV append+attention->operand, O projection (+residual), norm->operand, gate/up projection, SiLU*up->operand,
// down projection (+residual), the projections on tensor cores (prompt_gemm.cu); then the last token's
// norm+lm_head+argmax. Our kernels launch with PDL (unless METALATTN_CUDA_PDL=0). Chunks of at most
// kPromptMmaMaxTokens tokens run 5 launches per layer instead, whose projections split K (prompt_mma.cu).
void CudaBackend::enqueue_prefill_chunk(int m, const int32_t* io, PrefillVariant variant, bool last) {
  if (!fused_decode_) return enqueue_prefill_chunk_general(m, io, last);
  const ProgrammaticLaunchScope pdl_scope(use_pdl_);
  const ModelSpec& s = spec_;
  cudaStream_t st = res_.stream;
  const int d = s.d_model;
  launch_embed_rows(embd_, io + 1, m, px_, st);
  after_launch();
  const bool few_tokens = variant != kPrefillGemm;
  for (int l = 0; l < s.n_layers; ++l) {
    const DevLayer& L = layers_[l];
    __half* kc = layer_k(l) + prompt_slot_ * slot_stride_;
    __half* vc = layer_v(l) + prompt_slot_ * slot_stride_;
    if (few_tokens) {
      // Five programmatic launches, the projections straight from the quantized weights (prompt_mma.cu).
      PromptMmaArgs qkv = mma_normed(L.qkv, m, px_, L.attn_norm, s.rms_eps);
      qkv.y = pc_;
      launch_prompt_mma(qkv, st);
      after_launch();
      enqueue_prompt_attention(L, m, io, kc, vc, variant);
      enqueue_mma_o_ffn(L, m, pa_, px_, st);
      continue;
    }
    launch_rmsnorm_to_half(px_, m, d, L.attn_norm, s.rms_eps, pa_, st);
    after_launch();
    gemm(L.qkv, m, pc_, false);
    enqueue_prompt_attention(L, m, io, kc, vc, variant);
    gemm(L.o, m, px_, true);  // added into the residual stream
    launch_rmsnorm_to_half(px_, m, d, L.ffn_norm, s.rms_eps, pa_, st);
    after_launch();
    gemm(L.gate_up, m, pc_, false);
    launch_silu_to_half(pc_, m, s.d_ff, pa_, st);
    after_launch();
    gemm(L.down, m, px_, true);
  }
  if (!last) return;
  launch_norm_matvec_argmax(lm_head_, px_ + static_cast<size_t>(m - 1) * d, out_norm_, s.rms_eps, logits_, argmax_,
                            result_dev_, nullptr, st);
  after_launch();
}

// The attention of a prompt chunk from its raw QKV rows (pc_) into the operand rows pa_, appending its k and v rows to
// the layer's cache: the few-token kernel (kPrefillFewAttention; it adds Q/K/V biases and turns NeoX pairs itself), or
// the tensor-core prefill attention, which for a general_ model on this path (Qwen 2's layer: biases or NeoX pairs)
// reads q rows that launch_qkv_finish has biased and roped (into pq_, k and v into the cache) the launch before.
void CudaBackend::enqueue_prompt_attention(const DevLayer& L, int m, const int32_t* io, __half* kc, __half* vc,
                                           PrefillVariant variant) {
  const ModelSpec& s = spec_;
  cudaStream_t st = res_.stream;
  if (variant == kPrefillFewAttention) {
    FewAttnArgs fa;
    fa.qkv = pc_;
    fa.bias = L.qkv_bias;
    fa.neox = s.rope_style == RopeStyle::Neox;
    fa.n = m;
    fa.pos0_dev = io;
    fa.rope_table = rope_;
    fa.k_cache = kc;
    fa.v_cache = vc;
    fa.n_heads = s.n_heads;
    fa.n_kv_heads = s.n_kv_heads;
    fa.head_dim = s.head_dim;
    fa.out_slots = pa_;
    launch_attention_prompt_few(fa, st);
  } else if (general_) {
    launch_qkv_finish(finish_args(L, pc_, m, io, pq_, kc, vc), st);
    after_launch();
    launch_attention_prefill_at(pq_, kc, vc, m, io, s.n_heads, s.n_kv_heads, s.head_dim, pa_, st);
  } else {
    launch_rope_attention_prefill(pc_, m, io, rope_, s.n_heads, s.n_kv_heads, s.head_dim, kc, vc, pq_, pa_, st);
  }
  after_launch();
}

// A chunk length's first use runs eagerly (modules load, no capture cost for a one-off
// length); from the second use on it is one graph launch. The graph bakes in the prompt's slot.
void CudaBackend::run_prefill_chunk(int m, const int32_t* io, PrefillVariant variant, bool last) {
  run_cached_graph(res_.prefill_graphs, m, variant + (last ? 0 : kPrefillNoLmHead), prompt_slot_,
                   [&] { enqueue_prefill_chunk(m, io, variant, last); });
}


ArgmaxResult CudaBackend::forward_prompt(const int32_t* tokens, int n, int pos, float* last_logits,
                                         float* all_logits, int slot) {
  const ModelSpec& s = spec_;
  if (slot < 0 || slot >= s.n_seq) throw EngineError("forward_prompt: sequence slot out of range");
  if (n <= 0) throw EngineError("forward_prompt needs at least one token");
  if (pos < 0 || static_cast<int64_t>(pos) + n > s.n_ctx)
    throw EngineError("prompt of " + std::to_string(n) + " tokens at position " + std::to_string(pos) +
                      " does not fit the context of " + std::to_string(s.n_ctx));
  for (int i = 0; i < n; ++i) check_token(tokens[i]);
  if (all_logits != nullptr) ensure_all_logits_buffer();

  cudaStream_t st = res_.stream;
  const int d = s.d_model;
  prompt_slot_ = slot;
  const int step = prompt_chunk_len(n);
  for (int c0 = 0, c = 0; c0 < n; c0 += step, ++c) {
    const int m = std::min(step, n - c0);
    // Each chunk has its own pinned staging slot (an earlier chunk's copy may still be queued); the device slot is
    // shared, its copy is ordered after the previous chunk's kernels.
    int32_t* io_host = tokens_host_ + static_cast<size_t>(c) * (chunk_ + 1);
    io_host[0] = pos + c0;
    std::memcpy(io_host + 1, tokens + c0, m * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpyAsync(tokens_dev_, io_host, (m + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
    run_prefill_chunk(m, tokens_dev_, prefill_variant(m, pos + c0), c0 + m == n);
    if (all_logits != nullptr) {
      // Every row through the exact quantized lm_head (the decode kernel), not an fp16 copy of it: rounding the
      // weights to fp16 cost up to 8e-3 relative error on some models. Rows run in order, so the last one leaves
      // the prompt's argmax in result_dev_, as the chunk's own last-token launch did.
      for (int t0 = 0; t0 < m; t0 += logits_chunk_) {
        const int k = std::min(logits_chunk_, m - t0);
        for (int t = 0; t < k; ++t) {
          launch_norm_matvec_argmax(lm_head_, px_ + static_cast<size_t>(t0 + t) * d, out_norm_, s.rms_eps,
                                    plogits_ + static_cast<size_t>(t) * s.vocab, argmax_, result_dev_, nullptr, st);
          after_launch();
        }
        CUDA_CHECK(cudaMemcpyAsync(all_logits + static_cast<size_t>(c0 + t0) * s.vocab, plogits_,
                                   static_cast<size_t>(k) * s.vocab * sizeof(float), cudaMemcpyDeviceToHost, st));
      }
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(st));
  const ArgmaxResult r = *result_host_;
  if (last_logits != nullptr)
    CUDA_CHECK(cudaMemcpy(last_logits, logits_, s.vocab * sizeof(float), cudaMemcpyDefault));
  if (r.token == kNoIndex) throw NonFiniteLogits("argmax: every logit is NaN");
  return r;
}

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(const ModelSpec& spec, const ModelWeights& w, bool debug) {
  return std::make_unique<cuda::CudaBackend>(spec, w, debug);
}

}  // namespace metalattn
