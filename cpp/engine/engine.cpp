#include "engine/engine.h"

namespace metalattn {

Engine::Engine(const ModelSpec& spec, const ModelWeights& weights, const std::string& device, int n_threads, bool debug)
    : spec_(spec), weights_(weights) {
  validate_model(spec_, weights_);
  if (spec_.n_seq < 1) throw EngineError("n_seq must be at least 1, got " + std::to_string(spec_.n_seq));
  pos_.assign(spec_.n_seq, 0);
  if (device == "cpu")
    backend_ = make_cpu_backend(spec_, weights_, n_threads);
  else if (device == "cuda")
    backend_ = make_cuda_backend(spec_, weights_, debug);
  else
    throw EngineError("unknown device '" + device + "' (expected cpu or cuda)");
}

int Engine::check_slot(int slot) const {
  if (slot < 0 || slot >= spec_.n_seq)
    throw TokenRangeError("sequence slot " + std::to_string(slot) + " out of range [0, " +
                          std::to_string(spec_.n_seq) + ")");
  return slot;
}

// Messages as the Python layer words them (tests match on "out of range", "empty" and the exception types).
void Engine::check_tokens(const int32_t* tokens, int n, int slot) const {
  if (n <= 0) throw TokenRangeError("empty prompt: at least one token is needed");
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= spec_.vocab)
      throw TokenRangeError("token id " + std::to_string(tokens[i]) +
                            (n > 1 ? " at index " + std::to_string(i) : std::string()) + " out of range [0, " +
                            std::to_string(spec_.vocab) + ")");
  const int pos = pos_[slot];
  if (pos + n > spec_.n_ctx) {
    const std::string where = spec_.n_seq > 1 ? " of sequence slot " + std::to_string(slot) : std::string();
    if (n == 1)
      throw ContextOverflow("the context" + where + " is full (" + std::to_string(spec_.n_ctx) +
                            " tokens); call reset() or load with a larger n_ctx");
    throw ContextOverflow(std::to_string(n) + " prompt tokens at position " + std::to_string(pos) + where +
                          " exceed the context of " + std::to_string(spec_.n_ctx) + " tokens");
  }
}

void Engine::truncate_slot(int slot, int n) {
  const int pos = pos_[check_slot(slot)];
  if (n < 0 || n > pos)
    throw TokenRangeError("truncate(" + std::to_string(n) + "): the KV cache holds " + std::to_string(pos) +
                          " tokens; keep 0 to " + std::to_string(pos) + " of them (out of range)");
  pos_[slot] = n;
}

ArgmaxResult Engine::forward_token_greedy(int32_t token) {
  check_tokens(&token, 1, 0);
  const ArgmaxResult r = backend_->forward_token_greedy(token, pos_[0]);
  ++pos_[0];
  return r;
}

void Engine::check_run(int32_t token, int n, const char* name, const char* steps) const {
  check_tokens(&token, 1, 0);
  if (n < 1 || n > Backend::kMaxGreedyRun)
    throw TokenRangeError(std::string(name) + ": n must be 1 to " + std::to_string(Backend::kMaxGreedyRun) +
                          ", got " + std::to_string(n) + " (out of range)");
  if (pos_[0] + n > spec_.n_ctx)
    throw ContextOverflow(std::to_string(n) + " " + steps + " steps at position " + std::to_string(pos_[0]) +
                          " exceed the context of " + std::to_string(spec_.n_ctx) + " tokens");
}

void Engine::forward_tokens_greedy(int32_t token, int n, ArgmaxResult* out) {
  check_run(token, n, "forward_tokens_greedy", "greedy");
  backend_->forward_tokens_greedy(token, pos_[0], n, out);
  pos_[0] += n;
}

void Engine::forward_token(int32_t token, float* logits) {
  check_tokens(&token, 1, 0);
  backend_->forward_token(token, pos_[0], logits);
  ++pos_[0];
}

int64_t Engine::forward_token_sample(int32_t token, const SamplingParams& p, double u) {
  check_tokens(&token, 1, 0);
  sample_logits_.resize(static_cast<size_t>(spec_.vocab));
  const int64_t next = backend_->forward_token_sample(token, pos_[0], p, u, sample_logits_.data(), spec_.vocab);
  ++pos_[0];
  return next;
}

int Engine::forward_tokens_sample(int32_t token, int n, const SamplingParams& p, const double* u, int64_t* out) {
  check_run(token, n, "forward_tokens_sample", "sampled");
  sample_logits_.resize(static_cast<size_t>(spec_.vocab));
  const int done = backend_->forward_tokens_sample(token, pos_[0], n, p, u, sample_logits_.data(), spec_.vocab, out);
  pos_[0] += done;
  return done;
}

void Engine::forward_token_debug(int32_t token, float* hidden, float* logits) {
  check_tokens(&token, 1, 0);
  backend_->forward_token_debug(token, pos_[0], hidden, logits);
  ++pos_[0];
}

ArgmaxResult Engine::forward_prompt_slot(int slot, const int32_t* tokens, int n, float* last_logits,
                                         float* all_logits) {
  check_tokens(tokens, n, check_slot(slot));
  const ArgmaxResult r = backend_->forward_prompt(tokens, n, pos_[slot], last_logits, all_logits, slot);
  pos_[slot] += n;
  return r;
}

void Engine::forward_batch(const int32_t* tokens, const int32_t* slots, int n, float* logits, ArgmaxResult* out) {
  check_batch(tokens, slots, n);
  backend_->forward_batch(tokens, slots, batch_pos_.data(), n, logits, out);
  for (int i = 0; i < n; ++i) ++pos_[slots[i]];
}

void Engine::forward_batch_sample(const int32_t* tokens, const int32_t* slots, int n, const SamplingParams* params,
                                  const double* u, float* logits, ArgmaxResult* out) {
  check_batch(tokens, slots, n);
  float* rows = logits;
  if (rows == nullptr) {
    sample_logits_.resize(static_cast<size_t>(n) * spec_.vocab);
    rows = sample_logits_.data();
  }
  backend_->forward_batch_sample(tokens, slots, batch_pos_.data(), n, params, u, rows, logits != nullptr, spec_.vocab,
                                 out);
  for (int i = 0; i < n; ++i) ++pos_[slots[i]];
}

void Engine::check_batch(const int32_t* tokens, const int32_t* slots, int n) {
  if (n <= 0) throw TokenRangeError("empty batch: at least one sequence is needed");
  if (n > spec_.n_seq)
    throw TokenRangeError("a batch of " + std::to_string(n) + " rows for " + std::to_string(spec_.n_seq) +
                          " sequence slots");
  std::vector<char> seen(spec_.n_seq, 0);
  batch_pos_.resize(n);
  for (int i = 0; i < n; ++i) {
    const int s = check_slot(slots[i]);
    if (seen[s]) throw TokenRangeError("sequence slot " + std::to_string(s) + " appears twice in one batch");
    seen[s] = 1;
    check_tokens(tokens + i, 1, s);
    batch_pos_[i] = pos_[s];
  }
}

}  // namespace metalattn
