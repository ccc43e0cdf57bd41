#include "engine/engine.h"

namespace metalattn {

Engine::Engine(const ModelSpec& spec, const ModelWeights& weights, const std::string& device, int n_threads, bool debug)
    : spec_(spec), weights_(weights) {
  validate_model(spec_, weights_);
  if (device == "cpu")
    backend_ = make_cpu_backend(spec_, weights_, n_threads);
  else if (device == "cuda")
    backend_ = make_cuda_backend(spec_, weights_, debug);
  else
    throw EngineError("unknown device '" + device + "' (expected cpu or cuda)");
}

// Messages as the Python layer words them (tests match on "out of range", "empty" and the exception types).
void Engine::check_tokens(const int32_t* tokens, int n) const {
  if (n <= 0) throw TokenRangeError("empty prompt: at least one token is needed");
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= spec_.vocab)
      throw TokenRangeError("token id " + std::to_string(tokens[i]) +
                            (n > 1 ? " at index " + std::to_string(i) : std::string()) + " out of range [0, " +
                            std::to_string(spec_.vocab) + ")");
  if (pos_ + n > spec_.n_ctx) {
    if (n == 1)
      throw ContextOverflow("the context is full (" + std::to_string(spec_.n_ctx) +
                            " tokens); call reset() or load with a larger n_ctx");
    throw ContextOverflow(std::to_string(n) + " prompt tokens at position " + std::to_string(pos_) +
                          " exceed the context of " + std::to_string(spec_.n_ctx) + " tokens");
  }
}

void Engine::truncate(int n) {
  if (n < 0 || n > pos_)
    throw TokenRangeError("truncate(" + std::to_string(n) + "): the KV cache holds " + std::to_string(pos_) +
                          " tokens; keep 0 to " + std::to_string(pos_) + " of them (out of range)");
  pos_ = n;
}

ArgmaxResult Engine::forward_token_greedy(int32_t token) {
  check_tokens(&token, 1);
  const ArgmaxResult r = backend_->forward_token_greedy(token, pos_);
  ++pos_;
  return r;
}

void Engine::forward_token(int32_t token, float* logits) {
  check_tokens(&token, 1);
  backend_->forward_token(token, pos_, logits);
  ++pos_;
}

void Engine::forward_token_debug(int32_t token, float* hidden, float* logits) {
  check_tokens(&token, 1);
  backend_->forward_token_debug(token, pos_, hidden, logits);
  ++pos_;
}

ArgmaxResult Engine::forward_prompt(const int32_t* tokens, int n, float* last_logits, float* all_logits) {
  check_tokens(tokens, n);
  const ArgmaxResult r = backend_->forward_prompt(tokens, n, pos_, last_logits, all_logits);
  pos_ += n;
  return r;
}

}  // namespace metalattn
