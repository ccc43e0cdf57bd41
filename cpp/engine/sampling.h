// Drawing the next token from a logits row on the host, and the row's log-probabilities. sample_logits is the CPU
// backend's draw (Backend::forward_token_sample's default) and the reference of the CUDA backend's device draw
// (shaders/cuda/sampling.cu), which falls back to it for the rows it leaves to the host; greedy decoding never comes
// here (its argmax runs where the logits are). metalattn.sampling.sample validates the arguments, draws the uniform
// from the caller's seeded generator and calls sample_logits.
#pragma once
#include <cstdint>
#include <vector>

#include "metalattn/backend.h"

namespace metalattn {

// Throws EngineError for a temperature not > 0, top_k < 0, top_p outside (0, 1] or u outside [0, 1).
void check_sampling_args(const SamplingParams& p, double u);

// The token that the uniform u in [0, 1) draws from logits x[0 .. n):
// - NaN logits are never drawn; the first +inf logit takes all the mass; every logit NaN or -inf throws
//   NonFiniteLogits.
// - A token's weight is exp((x - max) / temperature) (float, relative error ~1e-7; sums in double).
// - top_k keeps the k largest logits, top_p then the fewest of the remaining in order of decreasing logit whose
//   weight reaches top_p of theirs (ties in both go to the lower index).
// - u picks the first candidate whose running weight passes u x the candidates' total: in order of decreasing logit
//   where top_k chose, or top_p among the 1,024 largest logits; in token-id order otherwise (no filter, or a top_p
//   nucleus larger than that, found by bucketing). The order changes which u draws a token, not its probability.
// A 262,144-token row takes 0.12-0.2 ms on one core of the EPYC dev machine, AVX-512 or AVX2, and ~1.3 ms for a
// flat row's bucketed nucleus (the numpy form it replaced: 8-12 ms, 42 ms for that nucleus).
int64_t sample_logits(const float* x, int64_t n, const SamplingParams& p, double u);

// Log-probabilities under the raw logits' softmax (temperature 1), as OpenAI-style `logprobs` report them:
// x - (max + log sum exp(x - max)), the sum over the non-NaN logits. `token`'s own, and the k largest (ids and values,
// best first; ties to the lower id; NaN never among them). Every logit NaN throws NonFiniteLogits.
struct LogProbs {
  double token = 0;
  std::vector<int64_t> top_ids;
  std::vector<double> top;
};
LogProbs log_probs(const float* x, int64_t n, int64_t token, int64_t k);

}  // namespace metalattn
