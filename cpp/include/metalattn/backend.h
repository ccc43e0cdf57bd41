// The seam between the engine (positions, validation) and a device (cpu, cuda; a Metal one would slot in here).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "metalattn/model.h"

namespace metalattn {

// What a greedy step hands back: 8 bytes, token id and its logit.
struct ArgmaxResult {
  uint32_t token;
  float value;
};

struct MemoryInfo {
  size_t weights = 0;  // bytes the backend holds for weights beyond the file's mmap (CPU: repacked copies only)
  size_t kv_cache = 0;
  size_t scratch = 0;  // activations, logits, staging
};

// Sampled decoding's parameters (sample_logits, cpp/engine/sampling.h, defines the draw).
struct SamplingParams {
  double temperature = 1.0;  // > 0
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // in (0, 1]; 1: off
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // One token at position `pos` (0 <= pos < n_ctx); appends its K/V to the cache.
  virtual ArgmaxResult forward_token_greedy(int32_t token, int pos) = 0;
  // As above but copies the full logits row (vocab floats) to `logits`.
  virtual void forward_token(int32_t token, int pos, float* logits) = 0;
  // One token at `pos`, then the next token that the uniform u in [0, 1) draws from its logits (sample_logits's
  // semantics; arguments as it checks them). `logits`: host scratch of `vocab` floats for a draw made on the host.
  // This default copies the row back and draws there; the CUDA backend draws on the device (8 bytes back).
  virtual int64_t forward_token_sample(int32_t token, int pos, const SamplingParams& p, double u, float* logits,
                                       int64_t vocab);
  // n sampled steps (1 <= n <= kMaxGreedyRun, pos + n <= n_ctx): step 0 feeds `token` at `pos`, step i the token step
  // i - 1 drew; u[i] draws step i's token into out[i]. Returns the steps done: n, or k < n where step k - 1's draw had
  // to be made on the host (the steps after it are void; the caller goes on from out[k - 1] at pos + k). This default
  // runs them one by one; the CUDA backend queues all n (each drawn token passed to the next step on the device).
  virtual int forward_tokens_sample(int32_t token, int pos, int n, const SamplingParams& p, const double* u,
                                    float* logits, int64_t vocab, int64_t* out) {
    for (int i = 0; i < n; ++i) {
      out[i] = forward_token_sample(token, pos + i, p, u[i], logits, vocab);
      token = static_cast<int32_t>(out[i]);
    }
    return n;
  }
  // Debug path: also writes the residual stream after the embedding and after every layer,
  // (n_layers + 1) x d_model floats, into `hidden`.
  virtual void forward_token_debug(int32_t token, int pos, float* hidden, float* logits) = 0;
  // n greedy steps (1 <= n <= kMaxGreedyRun, pos + n <= n_ctx): step 0 feeds `token` at `pos`, step i the argmax of
  // step i - 1 at pos + i; out[i] = step i's argmax. This default runs them one by one; the CUDA backend enqueues all
  // n before it waits, each step's token passed on to the next on the device, so the GPU runs them back to back.
  static constexpr int kMaxGreedyRun = 64;
  virtual void forward_tokens_greedy(int32_t token, int pos, int n, ArgmaxResult* out) {
    for (int i = 0; i < n; ++i) {
      out[i] = forward_token_greedy(token, pos + i);
      token = static_cast<int32_t>(out[i].token);
    }
  }

  // n prompt tokens of KV slot `slot` (0 <= slot < n_seq) starting at position `pos`, layer by layer. lm_head only
  // for the last token unless `all_logits` is non-null (n x vocab, for perplexity). `last_logits` (vocab) may be null.
  // The single-token calls above use slot 0.
  virtual ArgmaxResult forward_prompt(const int32_t* tokens, int n, int pos, float* last_logits, float* all_logits,
                                      int slot = 0) = 0;

  // One decode step of n sequences together (continuous batching): row i feeds tokens[i] to KV slot slots[i] at
  // position pos[i] (the slots distinct, 0 <= pos[i] < n_ctx) and attends over that slot's positions [0, pos[i]].
  // Writes row i's argmax to out[i] and, when `logits` is non-null, its logits to logits + i * vocab.
  virtual void forward_batch(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n, float* logits,
                             ArgmaxResult* out) = 0;

  // forward_batch, and each row with params[i].temperature > 0 drawn by the uniform u[i] from its logits
  // (sample_logits's semantics; arguments as it checks them): out[i].token is that row's draw, the others' their
  // argmax. `logits`: n x vocab host floats, every row's logits when copy_logits, else scratch for draws made on the
  // host. This default draws on the host; the CUDA backend on the device.
  virtual void forward_batch_sample(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n,
                                    const SamplingParams* params, const double* u, float* logits, bool copy_logits,
                                    int64_t vocab, ArgmaxResult* out);

  // For tests and debugging: the K and V cache rows [pos0, pos0 + n) of `layer` in KV slot `slot`, as the cache holds
  // them (fp16 values widened exactly; K after RoPE), row-major [n][kv_dim] into k and into v.
  virtual void read_kv_rows(int layer, int slot, int pos0, int n, float* k, float* v) const = 0;

  virtual MemoryInfo memory_info() const = 0;
  // Kernel launches one decode step makes (0 where it is not counted, e.g. the CPU).
  virtual int kernels_per_token() const { return 0; }
};

std::unique_ptr<Backend> make_cpu_backend(const ModelSpec& spec, const ModelWeights& w, int n_threads);
bool cuda_compiled();
int cuda_device_count();  // 0 when not compiled or no device
std::unique_ptr<Backend> make_cuda_backend(const ModelSpec& spec, const ModelWeights& w, bool debug);
// The current GPU's name (e.g. "NVIDIA H100 80GB HBM3"); empty without CUDA or a device.
std::string cuda_device_name();
// Device memory in use on the current GPU (total - free), for leak checks; 0 without CUDA.
size_t cuda_device_memory_used();
// Device-to-device copy bandwidth in bytes/s (bytes read + written), the yardstick of the decode floor.
double cuda_copy_bandwidth();

}  // namespace metalattn
