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
  int pos() const { return pos_; }
  void reset() { pos_ = 0; }
  // Keeps the first n tokens of the KV cache (0 <= n <= pos): the next token goes to position n. The backends
  // write K/V at the position they are given, so entries past n are simply overwritten later (prefix reuse).
  void truncate(int n);

  ArgmaxResult forward_token_greedy(int32_t token);
  void forward_token(int32_t token, float* logits);
  void forward_token_debug(int32_t token, float* hidden, float* logits);
  ArgmaxResult forward_prompt(const int32_t* tokens, int n, float* last_logits, float* all_logits);
  MemoryInfo memory_info() const { return backend_->memory_info(); }
  int kernels_per_token() const { return backend_->kernels_per_token(); }

 private:
  void check_tokens(const int32_t* tokens, int n) const;
  ModelSpec spec_;
  ModelWeights weights_;
  std::unique_ptr<Backend> backend_;
  int pos_ = 0;
};

}  // namespace metalattn
