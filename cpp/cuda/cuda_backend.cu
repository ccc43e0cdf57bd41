// CUDA backend, host side: weight upload (the GPU matvec layout, which every kernel reads), device-private
// KV cache and scratch, the decode step captured once as a CUDA graph, and the layer-major batched prefill.
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
namespace {

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strcmp(v, "0") != 0;
}

// Everything that must be released, in one place whose destructor runs even when the backend's constructor
// throws half-way (e.g. cudaMalloc out of memory).
struct Resources {
  cudaStream_t stream = nullptr;
  // Decode graphs, one per DecodeVariant (short, long), each captured at first use.
  cudaGraph_t graph[2] = {nullptr, nullptr};
  cudaGraphExec_t graph_exec[2] = {nullptr, nullptr};
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
PromptMmaArgs mma_normed(const DevMatrix& W, int n, const float* x, const float* norm_w, float eps) {
  PromptMmaArgs p;
  p.W = W;
  p.n = n;
  p.x = x;
  p.norm_w = norm_w;
  p.eps = eps;
  return p;
}
// ... or from slot-layout operand rows, the product added into the residual rows y.
PromptMmaArgs mma_add_residual(const DevMatrix& W, int n, const __half* x_slots, float* y) {
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
  void forward_token(int32_t token, int pos, float* logits) override;
  void forward_token_debug(int32_t token, int pos, float* hidden, float* logits) override;
  ArgmaxResult forward_prompt(const int32_t* tokens, int n, int pos, float* last_logits, float* all_logits,
                              int slot) override;
  void forward_batch(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n, float* logits,
                     ArgmaxResult* out) override;
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
  void set_io(int32_t token, int pos);
  void after_launch();
  // Decode graphs by context length: while attention runs in one pass, one block per query head with all K/V rows
  // in shared memory (more SMs share the latency-bound work); once the context is split, one block per KV head per
  // chunk (each KV head's rows read once, one combine per KV head).
  enum DecodeVariant { kDecodeShort = 0, kDecodeLong = 1 };
  DecodeVariant decode_variant_at(int pos) const {
    if (!fused_decode_) return kDecodeShort;  // one graph: its attention picks the context split at run time
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
  void enqueue_prefill_chunk(int m, const int32_t* io, PrefillVariant variant);
  void run_prefill_chunk(int m, const int32_t* io, PrefillVariant variant);
  // Runs enqueue() eagerly on a key's first use, from its second use on as a graph captured then (LRU of 8).
  template <class Enqueue>
  void run_cached_graph(std::vector<Resources::PrefillGraph>& graphs, int n, int variant, int extra,
                        Enqueue&& enqueue);
  // forward_batch: n rows, io = [tokens | slots | positions] (3 n values) in device memory. The rows run in groups
  // of at most batch_group_: on the tensor-core path (kBatchChainRows rows each) the groups run side by side on
  // their own streams, on the long-prompt path (chunk_ rows, the prefill scratch) one after the other.
  static constexpr int kBatchChainRows = 8;
  void setup_batch();
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
  void enqueue_decode_general(bool capture_hidden);
  void enqueue_prefill_chunk_general(int m, const int32_t* io);
  // Embedding and every layer of m rows on the general path: a prompt chunk (tokens = io + 1 at positions *io..) or
  // a batch group (rows.pos set; tokens its token array).
  void enqueue_layers_general(int m, const int32_t* tokens, const int32_t* pos0, const BatchRows& rows);
  int general_kernels_per_token() const;
  QkvFinishArgs finish_args(const DevLayer& L, const float* qkv, int n, const int32_t* pos0, float* q_out,
                            __half* kc, __half* vc) const;
  ArchAttnArgs attention_args(const DevLayer& L, const float* q, int n, const int32_t* pos0, const __half* kc,
                              const __half* vc) const;
  bool general_ = false;
  // Decode on the fused kernels of kernels.cuh: the plain Llama layer, and also the Llama layer with Q/K/V biases or
  // NeoX RoPE pairs (Qwen 2), whose prompts and batches run on the general path (the K/V cache layout is the same).
  bool fused_decode_ = false;
  float* g_qkv_ = nullptr;     // decode: raw QKV projections [q_dim + 2 kv_dim]
  float* g_tmp_ = nullptr;     // decode: O / down projection before its post-norm [d_model]
  float* g_xalt_ = nullptr;    // decode with post-norms: the residual stream's second buffer [d_model] (PreAdd)
  float* g_ptmp_ = nullptr;    // prefill: O / down projection before its post-norm [chunk][d_model]
  int g_max_splits_ = 1;
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
  ArgmaxResult* result_host_ = nullptr;  // mapped pinned: written by the last kernel
  ArgmaxResult* result_dev_ = nullptr;   // its device alias
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

  prompt_mma_ = !general_ && env_flag("METALATTN_CUDA_PROMPT_MMA", true) && spec.head_dim == 64;
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
  CUDA_CHECK(cudaMemsetAsync(argmax_.counter, 0, sizeof(unsigned int), res_.stream));
  io_dev_ = device_alloc<DecodeIO>(1, mem_.scratch);
  x_ = activation_alloc<float>(d);
  q_ = activation_alloc<float>(q_dim);
  ffn_act_ = activation_alloc<float>(spec.d_ff);
  logits_ = activation_alloc<float>(spec.vocab);
  hidden_ = activation_alloc<float>(static_cast<size_t>(L + 1) * d);
  io_host_ = pinned_alloc<DecodeIO>(1, cudaHostAllocDefault);
  result_host_ = pinned_alloc<ArgmaxResult>(1, cudaHostAllocMapped);
  result_dev_ = device_alias(result_host_);

  // Prefill scratch.
  // Up to 2048 tokens per chunk: the tensor-core attention runs a block per (head, 64 queries), so a 1024-token chunk
  // left SmolLM2 with 144 four-warp blocks on 132 SMs, and a 2048-token prompt took the longest key row twice over.
  chunk_ = std::min(spec.n_ctx, 2048);
  const size_t widest_in = std::max({static_cast<size_t>(d), static_cast<size_t>(q_dim), static_cast<size_t>(spec.d_ff)});
  const size_t widest_out = std::max(static_cast<size_t>(q_dim + 2 * kv_dim), 2 * static_cast<size_t>(spec.d_ff));
  max_chunks_ = (spec.n_ctx + chunk_ - 1) / chunk_;
  tokens_dev_ = device_alloc<int32_t>(static_cast<size_t>(chunk_) + 1, mem_.scratch);
  tokens_host_ = pinned_alloc<int32_t>(static_cast<size_t>(max_chunks_) * (chunk_ + 1), cudaHostAllocDefault);
  px_ = device_alloc<float>(static_cast<size_t>(chunk_) * d, mem_.scratch);
  pq_ = device_alloc<float>(static_cast<size_t>(chunk_) * q_dim, mem_.scratch);
  pc_ = device_alloc<float>(static_cast<size_t>(chunk_) * widest_out, mem_.scratch);
  pa_ = device_alloc<__half>(2 * static_cast<size_t>(chunk_) * widest_in, mem_.scratch);
  if (general_) setup_general(w);

  CUDA_CHECK(cudaStreamSynchronize(res_.stream));
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
  if (!fused_decode_) return enqueue_decode_general(capture_hidden);
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
      const int heads_per_block = variant == kDecodeLong ? s.n_heads / s.n_kv_heads : 1;
      launch_attention_decode(q_, kc, vc, io_dev_, s.n_heads, s.n_kv_heads, s.head_dim, s.n_ctx, attn_, attn_out_,
                              st, heads_per_block);
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
  launch_norm_matvec_argmax(lm_head_, x_, out_norm_, s.rms_eps, logits_, argmax_, result_dev_, io_dev_, st);
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
  const ArgmaxResult r = *result_host_;
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

void CudaBackend::forward_token(int32_t token, int pos, float* logits) {
  set_io(token, pos);
  run_decode(pos);
  finish_decode(pos);
  CUDA_CHECK(cudaMemcpy(logits, logits_, spec_.vocab * sizeof(float), cudaMemcpyDefault));
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
// sequence (captured once as a graph) serves every start position. Per layer 8 launches (9 when head_dim != 64):
// norm->operand, QKV projection, RoPE+KV append+attention->operand, O projection (+residual), norm->operand, gate/up
// projection, SiLU*up->operand, down projection (+residual), the projections on tensor cores (prompt_gemm.cu); then
// the last token's norm+lm_head+argmax. Our kernels launch with PDL (unless METALATTN_CUDA_PDL=0). Chunks of at most
// kPromptMmaMaxTokens tokens run 5 launches per layer instead, whose projections split K (prompt_mma.cu).
void CudaBackend::enqueue_prefill_chunk(int m, const int32_t* io, PrefillVariant variant) {
  if (general_) return enqueue_prefill_chunk_general(m, io);
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
      if (variant == kPrefillFewAttention) {
        FewAttnArgs fa;
        fa.qkv = pc_;
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
      } else {
        launch_rope_attention_prefill(pc_, m, io, rope_, s.n_heads, s.n_kv_heads, s.head_dim, kc, vc, pq_, pa_, st);
      }
      after_launch();
      enqueue_mma_o_ffn(L, m, pa_, px_, st);
      continue;
    }
    launch_rmsnorm_to_half(px_, m, d, L.attn_norm, s.rms_eps, pa_, st);
    after_launch();
    gemm(L.qkv, m, pc_, false);
    launch_rope_attention_prefill(pc_, m, io, rope_, s.n_heads, s.n_kv_heads, s.head_dim, kc, vc, pq_, pa_, st);
    after_launch();
    gemm(L.o, m, px_, true);  // added into the residual stream
    launch_rmsnorm_to_half(px_, m, d, L.ffn_norm, s.rms_eps, pa_, st);
    after_launch();
    gemm(L.gate_up, m, pc_, false);
    launch_silu_to_half(pc_, m, s.d_ff, pa_, st);
    after_launch();
    gemm(L.down, m, px_, true);
  }
  launch_norm_matvec_argmax(lm_head_, px_ + static_cast<size_t>(m - 1) * d, out_norm_, s.rms_eps, logits_, argmax_,
                            result_dev_, nullptr, st);
  after_launch();
}

// A chunk length's first use runs eagerly (modules load, no capture cost for a one-off
// length); from the second use on it is one graph launch. The graph bakes in the prompt's slot.
void CudaBackend::run_prefill_chunk(int m, const int32_t* io, PrefillVariant variant) {
  run_cached_graph(res_.prefill_graphs, m, variant, prompt_slot_, [&] { enqueue_prefill_chunk(m, io, variant); });
}

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
  for (int c0 = 0, c = 0; c0 < n; c0 += chunk_, ++c) {
    const int m = std::min(chunk_, n - c0);
    // Each chunk has its own pinned staging slot (an earlier chunk's copy may still be queued); the device slot is
    // shared, its copy is ordered after the previous chunk's kernels.
    int32_t* io_host = tokens_host_ + static_cast<size_t>(c) * (chunk_ + 1);
    io_host[0] = pos + c0;
    std::memcpy(io_host + 1, tokens + c0, m * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpyAsync(tokens_dev_, io_host, (m + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
    run_prefill_chunk(m, tokens_dev_, prefill_variant(m, pos + c0));
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

void CudaBackend::enqueue_decode_general(bool capture_hidden) {
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
    launch_arch_attention(att, st);
    after_launch();
    if (s.post_norms) {
      launch_norm_matvec(L.o, attn_out_, nullptr, 0.f, g_tmp_, st);
      pending = PreAdd{g_tmp_, L.post_attn_norm, s.rms_eps, nullptr};
    } else {
      launch_matvec_residual(L.o, attn_out_, x, st);
    }
    after_launch();
    in = take_pending(&pre);
    launch_norm_matvec_silu_glu(L.gate_up, in, L.ffn_norm, s.rms_eps, ffn_act_, st, s.activation, pre);
    after_launch();
    if (s.post_norms) {
      launch_norm_matvec(L.down, ffn_act_, nullptr, 0.f, g_tmp_, st);
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
  launch_norm_matvec_argmax(lm_head_, x, out_norm_, s.rms_eps, logits_, argmax_, result_dev_, io_dev_, st);
  after_launch();
}

// A prompt chunk on the general path: the tensor-core projections of the plain path (prompt_gemm.cu) with the
// kernels of arch.cuh between them, per layer: norm->operand, QKV projection, QKV finish, attention->operand, O
// projection (+residual, or into g_ptmp_ and add_normed), norm->operand, gate/up projection, GLU->operand, down
// projection (likewise); then the last token's norm + lm_head + argmax.
void CudaBackend::enqueue_prefill_chunk_general(int m, const int32_t* io) {
  const ProgrammaticLaunchScope pdl_scope(use_pdl_);
  enqueue_layers_general(m, io + 1, io, BatchRows{});
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
  CUDA_CHECK(cudaStreamSynchronize(st));
  for (int i = 0; i < n; ++i) {
    out[i] = batch_result_host_[i];
    if (out[i].token == kNoIndex) throw NonFiniteLogits("argmax: every logit is NaN");
  }
}

}  // namespace
}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(const ModelSpec& spec, const ModelWeights& w, bool debug) {
  return std::make_unique<cuda::CudaBackend>(spec, w, debug);
}

}  // namespace metalattn
