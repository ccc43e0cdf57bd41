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

void Engine::check_tokens(const int32_t* tokens, int n) const {
  if (n <= 0) throw EngineError("empty prompt: at least one token is needed");
  if (pos_ + n > spec_.n_ctx)
    throw EngineError("context overflow: position " + std::to_string(pos_) + " + " + std::to_string(n) +
                      " tokens exceeds n_ctx=" + std::to_string(spec_.n_ctx));
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= spec_.vocab)
      throw EngineError("token id " + std::to_string(tokens[i]) + " out of range [0, " + std::to_string(spec_.vocab) +
                        ")");
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
