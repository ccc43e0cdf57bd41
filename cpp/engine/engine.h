// Backend-neutral driver: owns the backend, the current position in the KV cache, and the checks every
// entry point needs (token range, context overflow), so each backend only computes.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "metalattn/backend.h"

namespace metalattn {

class Engine {
 public:
  Engine(const ModelSpec& spec, const ModelWeights& weights, const std::string& device, int n_threads, bool debug);

  const ModelSpec& spec() const { return spec_; }
  const char* device() const { return backend_->name(); }
  // The single-sequence API (pos, reset, truncate, forward_*) works on KV slot 0; the *_slot calls and
  // forward_batch on any of the spec's n_seq slots, each with its own position.
  int pos() const { return pos_[0]; }
  void reset() { pos_[0] = 0; }
  // Keeps the first n tokens of the KV cache (0 <= n <= pos): the next token goes to position n. The backends
  // write K/V at the position they are given, so entries past n are simply overwritten later (prefix reuse).
  void truncate(int n) { truncate_slot(0, n); }

  ArgmaxResult forward_token_greedy(int32_t token);
  // n greedy steps from `token` (Backend::forward_tokens_greedy): out[i] is step i's argmax; the position advances n.
  void forward_tokens_greedy(int32_t token, int n, ArgmaxResult* out);
  void forward_token(int32_t token, float* logits);
  // One token, then the next drawn from its logits by the uniform u (Backend::forward_token_sample).
  int64_t forward_token_sample(int32_t token, const SamplingParams& p, double u);
  // Up to n sampled steps from `token`, u[i] drawing step i (Backend::forward_tokens_sample): returns the steps done,
  // their tokens in out; the position advances by that many.
  int forward_tokens_sample(int32_t token, int n, const SamplingParams& p, const double* u, int64_t* out);
  void forward_token_debug(int32_t token, float* hidden, float* logits);
  ArgmaxResult forward_prompt(const int32_t* tokens, int n, float* last_logits, float* all_logits) {
    return forward_prompt_slot(0, tokens, n, last_logits, all_logits);
  }

  int n_seq() const { return spec_.n_seq; }
  int slot_pos(int slot) const { return pos_[check_slot(slot)]; }
  void truncate_slot(int slot, int n);
  ArgmaxResult forward_prompt_slot(int slot, const int32_t* tokens, int n, float* last_logits, float* all_logits);
  // One decode step for n sequences: row i feeds tokens[i] to slot slots[i] (distinct slots) at that slot's
  // position, which then advances. out[i]: row i's argmax; logits (n x vocab) may be null.
  void forward_batch(const int32_t* tokens, const int32_t* slots, int n, float* logits, ArgmaxResult* out);
  // The same step, rows with params[i].temperature > 0 drawn by u[i] (Backend::forward_batch_sample); logits (n x
  // vocab) may be null.
  void forward_batch_sample(const int32_t* tokens, const int32_t* slots, int n, const SamplingParams* params,
                            const double* u, float* logits, ArgmaxResult* out);
  MemoryInfo memory_info() const { return backend_->memory_info(); }
  int kernels_per_token() const { return backend_->kernels_per_token(); }

 private:
  void check_tokens(const int32_t* tokens, int n, int slot) const;
  // A run of n steps from `token` in slot 0 (forward_tokens_greedy / _sample): 1 <= n <= kMaxGreedyRun, inside the
  // context; `name` and `steps` ("greedy", "sampled") word the errors.
  void check_run(int32_t token, int n, const char* name, const char* steps) const;
  void check_batch(const int32_t* tokens, const int32_t* slots, int n);  // fills batch_pos_
  int check_slot(int slot) const;
  ModelSpec spec_;
  ModelWeights weights_;
  std::unique_ptr<Backend> backend_;
  std::vector<int> pos_;  // per slot: tokens in its KV cache
  std::vector<int32_t> batch_pos_;  // forward_batch's positions, reused
  std::vector<float> sample_logits_;  // forward_token_sample's host row, where the draw is the host's
};

}  // namespace metalattn
