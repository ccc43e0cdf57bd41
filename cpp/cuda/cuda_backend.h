// CUDA backend, host side, shared by its translation units: cuda_backend.cu (device queries, weight upload,
// construction, the fused decode step and prompts), cuda_general.cu (the general-architecture path, arch.cuh) and
// cuda_batch.cu (batched decode). Internal to the backend; the public entry is make_cuda_backend (backend.h).
#pragma once

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

namespace metalattn {
namespace cuda {

// An environment switch: unset or empty gives fallback, "0" false, anything else true.
bool env_flag(const char* name, bool fallback);

// Everything that must be released, in one place whose destructor runs even when the backend's constructor
// throws half-way (e.g. cudaMalloc out of memory).
struct Resources {
  cudaStream_t stream = nullptr;
  // Decode graphs, one per DecodeVariant (short, long, short beside), each captured at first use.
  cudaGraph_t graph[3] = {nullptr, nullptr, nullptr};
  cudaGraphExec_t graph_exec[3] = {nullptr, nullptr, nullptr};
  std::vector<void*> device;
  std::vector<void*> pinned;
  std::vector<cudaStream_t> side_streams;  // forward_batch's row groups beyond the first
  std::vector<cudaEvent_t> events;         // per side stream: its fork and join events
  // Prefill and batch graphs, one per (rows, variant, extra) (a small LRU each); exec stays null until the key's
  // second use.
  struct PrefillGraph {
    int n = 0;
    int variant = 0;  // CudaBackend::PrefillVariant
    int extra = 0;    // a prompt: its KV slot (batches: 0)
    int uses = 0;
    uint64_t last_use = 0;
    cudaGraphExec_t exec = nullptr;
  };
  std::vector<PrefillGraph> prefill_graphs, batch_graphs;

  ~Resources() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (PrefillGraph& g : prefill_graphs)
      if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
    for (PrefillGraph& g : batch_graphs)
      if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
    for (cudaGraphExec_t e : graph_exec)
      if (e != nullptr) cudaGraphExecDestroy(e);
    for (cudaGraph_t g : graph)
      if (g != nullptr) cudaGraphDestroy(g);
    for (cudaStream_t x : side_streams) cudaStreamSynchronize(x);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (cudaStream_t x : side_streams) cudaStreamDestroy(x);
    for (void* p : device) cudaFree(p);
    for (void* p : pinned) cudaFreeHost(p);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

// Programmatic launches on (or off) for the enclosing scope's enqueues; the previous setting comes back at its end.
struct ProgrammaticLaunchScope {
  bool previous = programmatic_launch();
  explicit ProgrammaticLaunchScope(bool on) { set_programmatic_launch(on); }
  ~ProgrammaticLaunchScope() { set_programmatic_launch(previous); }
};

// The tensor-core projections (prompt_mma.cu) of n rows as the prompt and batch paths use them: from the fp32
// residual rows x, rmsnorm'ed with norm_w here (out_kind Store by default: set y, or SiluHalf and its fields) ...
inline PromptMmaArgs mma_normed(const DevMatrix& W, int n, const float* x, const float* norm_w, float eps) {
  PromptMmaArgs p;
  p.W = W;
  p.n = n;
  p.x = x;
  p.norm_w = norm_w;
  p.eps = eps;
  return p;
}
// ... or from slot-layout operand rows, the product added into the residual rows y.
inline PromptMmaArgs mma_add_residual(const DevMatrix& W, int n, const __half* x_slots, float* y) {
  PromptMmaArgs p;
  p.W = W;
  p.n = n;
  p.x_slots = x_slots;
  p.out_kind = PromptMmaOut::AddResidual;
  p.y = y;
  return p;
}

struct DevLayer {
  DevMatrix qkv, o, gate_up, down;  // decode layout
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  // General path only (arch.cuh): the architecture's extra tensors (null where it has none), RoPE table and window.
  const float* qkv_bias = nullptr;  // [q_dim + 2 kv_dim]: bq | bk | bv
  const float *q_norm = nullptr, *k_norm = nullptr;
  const float *post_attn_norm = nullptr, *post_ffn_norm = nullptr;
  const float2* rope = nullptr;
  int window = 0;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const ModelSpec& spec, const ModelWeights& w, bool debug);
  const char* name() const override { return "cuda"; }
  ArgmaxResult forward_token_greedy(int32_t token, int pos) override;
  void forward_tokens_greedy(int32_t token, int pos, int n, ArgmaxResult* out) override;
  void forward_token(int32_t token, int pos, float* logits) override;
  int64_t forward_token_sample(int32_t token, int pos, const SamplingParams& p, double u, float* logits,
                               int64_t vocab) override;
  int forward_tokens_sample(int32_t token, int pos, int n, const SamplingParams& p, const double* u, float* logits,
                            int64_t vocab, int64_t* out) override;
  void forward_batch_sample(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n,
                            const SamplingParams* params, const double* u, float* logits, bool copy_logits,
                            int64_t vocab, ArgmaxResult* out) override;
  void forward_token_debug(int32_t token, int pos, float* hidden, float* logits) override;
  ArgmaxResult forward_prompt(const int32_t* tokens, int n, int pos, float* last_logits, float* all_logits,
                              int slot) override;
  void forward_batch(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n, float* logits,
                     ArgmaxResult* out) override;
  void read_kv_rows(int layer, int slot, int pos0, int n, float* k, float* v) const override;
  MemoryInfo memory_info() const override { return mem_; }
  // 5 per layer, plus the final norm + lm_head + argmax.
  int kernels_per_token() const override {
    if (!fused_decode_) return general_kernels_per_token();
    if (spec_.n_layers == 0) return 2;
    return 5 * spec_.n_layers + 1;
  }

 private:
  template <typename T>
  T* device_alloc(size_t count, size_t& counter) {
    void* p = nullptr;
    const size_t bytes = count * sizeof(T);
    CUDA_CHECK(cudaMalloc(&p, bytes < 16 ? 16 : bytes));
    res_.device.push_back(p);
    counter += bytes;
    return static_cast<T*>(p);
  }
  // Pinned host memory (cudaHostAllocMapped: the kernels reach it through device_alias), counted as scratch.
  template <typename T>
  T* pinned_alloc(size_t count, unsigned flags) {
    void* p = nullptr;
    const size_t bytes = count * sizeof(T);
    CUDA_CHECK(cudaHostAlloc(&p, bytes < 16 ? 16 : bytes, flags));
    res_.pinned.push_back(p);
    mem_.scratch += bytes;
    return static_cast<T*>(p);
  }
  template <typename T>
  static T* device_alias(T* mapped) {
    void* d = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(&d, mapped, 0));
    return static_cast<T*>(d);
  }
  // Decode activation buffers: device memory, or in debug mode mapped pinned host memory (the kernels reach it
  // through its device alias), so a debugger or a host-side probe can read every intermediate of a step.
  template <typename T>
  T* activation_alloc(size_t count) {
    if (!debug_) return device_alloc<T>(count, mem_.scratch);
    return device_alias(pinned_alloc<T>(count, cudaHostAllocMapped));
  }
  DevMatrix upload(const std::vector<const WeightView*>& parts);
  const float* upload_floats(const float* host, size_t n);

  void check_token(int32_t token) const;
  // A run of n decode steps from pos (forward_tokens_greedy / _sample): 1 <= n <= kMaxGreedyRun, inside the context.
  void check_run(const char* name, int pos, int n) const;
  void set_io(int32_t token, int pos);
  void after_launch();
  // Decode graphs by context length: while attention runs in one pass, one block per query head with all K/V rows
  // in shared memory (more SMs share the latency-bound work); once the context is split, one block per KV head per
  // chunk (each KV head's rows read once, one combine per KV head).
  enum DecodeVariant { kDecodeShort = 0, kDecodeLong = 1, kDecodeShortBeside = 2 };
  DecodeVariant decode_variant_at(int pos) const {
    // The general path: the short attention kernel at its smaller cap up to g_short_beside_cap_ positions
    // (kDecodeShortBeside: blocks that leave kShortAttnRoomBeside of an SM's shared memory), at its full cap up to
    // g_short_cap_ (kDecodeShort), then the split one, which picks its context split at run time (kDecodeLong); one
    // graph where the short kernel serves nothing.
    if (!fused_decode_ && pos + 1 <= g_short_beside_cap_) return kDecodeShortBeside;
    if (!fused_decode_) return g_short_cap_ == 0 || pos + 1 <= g_short_cap_ ? kDecodeShort : kDecodeLong;
    return pos + 1 <= short_decode_max() ? kDecodeShort : kDecodeLong;
  }
  // The last context length kDecodeShort serves: head_dim 64 runs the short kernel (every K/V row in shared memory)
  // up to kShortAttnMaxPos positions; other head_dims the split-capable kernel, one pass up to kAttnSinglePassMax.
  int short_decode_max() const { return spec_.head_dim == 64 ? kShortAttnMaxPos : kAttnSinglePassMax; }
  void enqueue_decode(bool capture_hidden, DecodeVariant variant);
  void run_decode(int pos);
  ArgmaxResult finish_decode(int pos);
  // y[t] = W . pa_[t] (accumulate: y[t] +=), t < n: one projection of a prompt chunk or batch group (prompt_gemm.cu,
  // or for a few tokens prompt_mma.cu).
  void gemm(const DevMatrix& W, int n, float* y, bool accumulate);
  void ensure_all_logits_buffer();
  // How a prompt chunk runs: the long-prompt projections (prompt_gemm.cu), or (at most kPromptMmaMaxTokens tokens)
  // those of prompt_mma.cu with the few-token attention (while the chunk ends by kPromptFewAttnMaxKeys) or the
  // prefill one.
  enum PrefillVariant { kPrefillGemm = 0, kPrefillFewAttention = 1, kPrefillFewLongAttention = 2 };
  PrefillVariant prefill_variant(int m, int pos) const {
    if (!prompt_mma_ || m > kPromptMmaMaxTokens) return kPrefillGemm;
    return pos + m <= kPromptFewAttnMaxKeys ? kPrefillFewAttention : kPrefillFewLongAttention;
  }
  // Tokens a chunk of an n-token prompt takes. Up to kPromptFewChunks * kPromptMmaMaxTokens tokens the prompt runs as
  // that many few-token chunks of (nearly) equal length as it needs: at these lengths the long path's small grids cost
  // more than the few-token path's five launches a layer per chunk (H200, session 32, against one long-path chunk:
  // pp64 -5% / -14% / -12% and pp96 -8% / -23% / even for SmolLM2-1.7B / Qwen2.5 / SmolLM2-135M shapes; at 128 tokens
  // four chunks lose on two of them; benchmarks/NOTES.md). Longer prompts run in chunks of chunk_.
  static constexpr int kPromptFewChunks = 3;
  int prompt_chunk_len(int n) const {
    if (!prompt_mma_ || n <= kPromptMmaMaxTokens || n > kPromptFewChunks * kPromptMmaMaxTokens) return chunk_;
    const int chunks = (n + kPromptMmaMaxTokens - 1) / kPromptMmaMaxTokens;
    return (n + chunks - 1) / chunks;
  }
  // Graph key: a chunk before the prompt's last one, which skips the lm_head.
  static constexpr int kPrefillNoLmHead = 4;
  void enqueue_prefill_chunk(int m, const int32_t* io, PrefillVariant variant, bool last);
  void run_prefill_chunk(int m, const int32_t* io, PrefillVariant variant, bool last);
  // Runs enqueue() eagerly on a key's first use, from its second use on as a graph captured then (LRU of 8).
  template <class Enqueue>
  void run_cached_graph(std::vector<Resources::PrefillGraph>& graphs, int n, int variant, int extra,
                        Enqueue&& enqueue);
  // forward_batch: n rows, io = [tokens | slots | positions] (3 n values) in device memory. The rows run in groups
  // of at most batch_group_: on the tensor-core path (kBatchChainRows rows each) the groups run side by side on
  // their own streams, on the long-prompt path (chunk_ rows, the prefill scratch) one after the other.
  static constexpr int kBatchChainRows = 8;
  void setup_batch();
  // forward_batch in two halves: the step (and the logits' copy when `logits` is set) queued; the wait and the argmax.
  void enqueue_forward_batch(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n, float* logits);
  void finish_forward_batch(int n, ArgmaxResult* out);
  // Sampled draws on the device (sampling.cu): whether the device takes p (every top_k up to kSampleMaxTopK; one of
  // the whole vocabulary or more is off), launch_sample's arguments for it, and a finished draw's token: its own, or
  // sample_logits over the row where the device left the draw to the host (the row copied from dev_row into `row`
  // unless row_copied); every logit NaN or -inf throws.
  static bool device_draws(const SamplingParams& p, int64_t vocab) {
    return p.top_k <= kSampleMaxTopK || p.top_k >= vocab;
  }
  static SampleArgs device_sample_args(const SamplingParams& p, double u, int64_t vocab);
  static int64_t draw_result(const SampleResult& r, const SamplingParams& p, double u, const float* dev_row, float* row,
                             bool row_copied, int64_t vocab);
  void enqueue_batch(int n, const int32_t* io);
  void enqueue_batch_group_mma(int m, int g0, int n, const int32_t* io, cudaStream_t st);
  void enqueue_batch_lm_head(int m, int g0, const float* x, cudaStream_t st);
  void enqueue_mma_o_ffn(const DevLayer& L, int m, __half* a, float* x, cudaStream_t st);
  // Layer l's caches of slot 0 ([n_ctx][kv_dim] fp16); slot s's are s * slot_stride_ values further.
  __half* layer_k(int l) const { return k_cache_ + static_cast<size_t>(l) * spec_.n_ctx * spec_.kv_dim(); }
  __half* layer_v(int l) const { return v_cache_ + static_cast<size_t>(l) * spec_.n_ctx * spec_.kv_dim(); }

  // The general path (every ModelSpec; see arch.cuh): taken for specs that are not the plain Llama layer, for
  // head_dim > 128 or more than 8 query heads per KV head, or when METALATTN_CUDA_GENERAL=1 forces it.
  void setup_general(const ModelWeights& w);
  void enqueue_decode_general(bool capture_hidden, DecodeVariant variant);
  void enqueue_prefill_chunk_general(int m, const int32_t* io, bool last);
  // Embedding and every layer of m rows on the general path: a prompt chunk (tokens = io + 1 at positions *io..) or
  // a batch group (rows.pos set; tokens its token array).
  void enqueue_layers_general(int m, const int32_t* tokens, const int32_t* pos0, const BatchRows& rows);
  int general_kernels_per_token() const;
  QkvFinishArgs finish_args(const DevLayer& L, const float* qkv, int n, const int32_t* pos0, float* q_out,
                            __half* kc, __half* vc) const;
  ArchAttnArgs attention_args(const DevLayer& L, const float* q, int n, const int32_t* pos0, const __half* kc,
                              const __half* vc) const;
  bool general_ = false;
  // Decode on the fused kernels of kernels.cuh, and prompt chunks and batches on the plain path's: the plain Llama
  // layer, and also the Llama layer with Q/K/V biases or NeoX RoPE pairs (Qwen 2; the K/V cache layout is the same),
  // whose few-token attention adds the biases and turns NeoX pairs itself and whose longer chunks run
  // launch_qkv_finish before a prefill attention that reads the roped q rows (enqueue_prompt_attention).
  bool fused_decode_ = false;
  void enqueue_prompt_attention(const DevLayer& L, int m, const int32_t* io, __half* kc, __half* vc,
                                PrefillVariant variant);
  float* g_qkv_ = nullptr;     // decode: raw QKV projections [q_dim + 2 kv_dim]
  float* g_tmp_ = nullptr;     // decode: O / down projection before its post-norm [d_model]
  float* g_xalt_ = nullptr;    // decode with post-norms: the residual stream's second buffer [d_model] (PreAdd)
  float* g_ptmp_ = nullptr;    // prefill: O / down projection before its post-norm [chunk][d_model]
  int g_max_splits_ = 1;
  int g_short_beside_cap_ = 0;  // arch_short_attention_cap_beside (0: no such variant)
  int g_short_cap_ = 0;  // arch_short_attention_cap: decode positions the short attention kernel serves (0: none)
  float *g_part_o_ = nullptr, *g_part_ml_ = nullptr;
  unsigned int* g_counters_ = nullptr;

  ModelSpec spec_;
  bool debug_;
  bool use_pdl_;
  // Prompt chunks of at most kPromptMmaMaxTokens tokens take the tensor-core projections of prompt_mma.cu instead of
  // the long-prompt projections (METALATTN_CUDA_PROMPT_MMA=0 turns that off; needs every layer matrix in a type it
  // reads).
  bool prompt_mma_ = false;
  Resources res_;
  MemoryInfo mem_;

  std::vector<DevLayer> layers_;
  DevMatrix embd_, lm_head_;
  const float* out_norm_ = nullptr;
  // [n_seq][n_layers][n_ctx][kv_dim] fp16 (kernels.cuh, kv_store; the CPU backend rounds alike): slot 0 first (the
  // single-sequence calls' cache)
  __half* k_cache_ = nullptr;
  __half* v_cache_ = nullptr;
  int64_t slot_stride_ = 0;   // values from one slot's cache to the next's
  int prompt_slot_ = 0;       // the running prompt's KV slot (the prefill enqueues read it)
  float2* rope_ = nullptr;    // [n_ctx][head_dim/2]

  // decode scratch
  DecodeIO* io_dev_ = nullptr;
  DecodeIO* io_host_ = nullptr;          // pinned staging for the occasional host-to-device write
  // Mapped pinned, written by the last kernel: decode steps leave position p's argmax in slot p % kResultRing (so
  // that forward_tokens_greedy's steps each have their own), prompts theirs in slot 0.
  static constexpr int kResultRing = 64;
  static_assert(kResultRing >= kMaxGreedyRun, "a run's steps need distinct slots");
  ArgmaxResult* result_host_ = nullptr;
  ArgmaxResult* result_dev_ = nullptr;   // its device alias
  void* sample_work_ = nullptr;          // forward_token_sample's device scratch (launch_sample)
  // mapped pinned [max(n_seq, kResultRing)]: each draw's token and status (batch row i's in i; a run's step at position
  // p in p % kResultRing)
  SampleResult* sample_host_ = nullptr;
  SampleResult* sample_dev_ = nullptr;
  float *x_ = nullptr, *q_ = nullptr, *logits_ = nullptr, *hidden_ = nullptr;
  float* ffn_act_ = nullptr;  // [d_ff]: silu(gate) * up, the down projection's input
  AttnScratch attn_;
  float* attn_out_ = nullptr;  // [q_dim]: attention output, the O projection's input
  ArgmaxScratch argmax_;
  DecodeIO io_shadow_{0, 0};
  bool io_shadow_valid_ = false;

  // prefill scratch (chunk_ tokens at a time)
  int chunk_ = 0;
  int32_t* tokens_dev_ = nullptr;  // [start position, chunk_ tokens]: the one address every prefill graph reads
  int32_t* tokens_host_ = nullptr;  // pinned staging: one [position, tokens] slot per chunk of the longest prompt
  int max_chunks_ = 0;
  uint64_t prefill_clock_ = 0;
  float *px_ = nullptr, *pq_ = nullptr, *pc_ = nullptr;
  __half* pa_ = nullptr;  // projection operand rows (store_operand), 2 * width halves per token
  float* plogits_ = nullptr;
  int logits_chunk_ = 0;

  // batch scratch (allocated at the first forward_batch)
  int batch_group_ = 0;
  bool batch_lm_head_mma_ = false;    // lm_head rows on tensor cores (prompt_mma) rather than one launch per row
  int32_t* batch_io_dev_ = nullptr;   // [tokens | slots | positions] of the batch's rows
  int32_t* batch_io_host_ = nullptr;  // its pinned staging
  ArgmaxResult* batch_result_host_ = nullptr;  // mapped pinned [n_seq]: each row's argmax
  ArgmaxResult* batch_result_dev_ = nullptr;
  float* batch_logits_ = nullptr;     // [n_seq][vocab]
  // Tensor-core path: activations of every row (each group its own rows), [n_seq] rows each.
  float *bx_ = nullptr, *bqkv_ = nullptr;  // residual stream, raw QKV projections
  __half* ba_ = nullptr;              // slot-layout operands, 2 * max(q_dim, d_ff) halves per row
};

// Defined here, beside the class: the prompt path (cuda_backend.cu) and batched decode (cuda_batch.cu) both use it.
template <class Enqueue>
void CudaBackend::run_cached_graph(std::vector<Resources::PrefillGraph>& graphs, int n, int variant, int extra,
                                   Enqueue&& enqueue) {
  constexpr size_t kMaxGraphs = 8;
  if (debug_) {
    enqueue();
    return;
  }
  auto it = std::find_if(graphs.begin(), graphs.end(), [&](const Resources::PrefillGraph& g) {
    return g.n == n && g.variant == variant && g.extra == extra;
  });
  if (it == graphs.end()) {
    if (graphs.size() >= kMaxGraphs) {
      it = std::min_element(graphs.begin(), graphs.end(),
                            [](const Resources::PrefillGraph& a, const Resources::PrefillGraph& b) {
                              return a.last_use < b.last_use;
                            });
      if (it->exec != nullptr) CUDA_CHECK(cudaGraphExecDestroy(it->exec));
      *it = Resources::PrefillGraph{};
    } else {
      it = graphs.emplace(graphs.end());
    }
    it->n = n;
    it->variant = variant;
    it->extra = extra;
  }
  it->last_use = ++prefill_clock_;
  if (it->exec == nullptr && it->uses++ == 0) {
    enqueue();
    return;
  }
  if (it->exec == nullptr) {
    cudaGraph_t g = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(res_.stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(res_.stream, &g);
      if (g != nullptr) cudaGraphDestroy(g);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(res_.stream, &g));
    const cudaError_t e = cudaGraphInstantiate(&it->exec, g, 0);
    cudaGraphDestroy(g);
    CUDA_CHECK(e);
  }
  CUDA_CHECK(cudaGraphLaunch(it->exec, res_.stream));
}

}  // namespace cuda
}  // namespace metalattn
