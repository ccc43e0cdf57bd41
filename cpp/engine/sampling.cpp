// sample_logits (sampling.h): one pass for the largest logit (the CPU backend's vectorised argmax), one vectorised
// pass for the weights where every token is a candidate, and a threshold selection for top_k and for top_p's probe.
#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "cpu/kernels.h"
#include "metalattn/model.h"

namespace metalattn {
namespace {

struct Cand {
  float v;
  int64_t i;
};
// The order of the candidates: larger logit first, the lower index among equal ones.
bool before(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// The first k (>= 1) non-NaN logits in `before` order, sorted in it. A threshold from a strided sample of the row
// (about twice k of the row lie above it) picks the few logits worth ordering; the k-th largest is at or above it
// whenever at least k are, so the result is exact, and where fewer are (a sample that missed) every logit is ordered.
// 262,144 logits: ~0.1 ms at k 1,024, where a heap of the k best took 0.75 ms (its early replacements).
std::vector<Cand> top_candidates(const float* x, int64_t n, int64_t k) {
  constexpr int64_t kSample = 4096;
  float tau = -INFINITY;
  if (k < n / 4) {
    const int64_t stride = std::max<int64_t>(1, n / kSample);
    std::vector<float> sample;
    sample.reserve(static_cast<size_t>(n / stride + 1));
    for (int64_t i = 0; i < n; i += stride)
      if (!std::isnan(x[i])) sample.push_back(x[i]);
    const int64_t above = std::min<int64_t>(static_cast<int64_t>(sample.size()),
                                            2 * k * static_cast<int64_t>(sample.size()) / n + 8);
    if (above > 0) {
      std::nth_element(sample.begin(), sample.begin() + (above - 1), sample.end(), std::greater<float>());
      tau = sample[static_cast<size_t>(above - 1)];
    }
  }
  std::vector<Cand> c;
  auto collect = [&](float t) {
    c.clear();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {  // 16 at a time against the threshold (a vectorised test), then one by one
      bool any = false;
      for (int j = 0; j < 16; ++j) any |= x[i + j] >= t;
      if (any)
        for (int j = 0; j < 16; ++j)
          if (x[i + j] >= t) c.push_back({x[i + j], i + j});
    }
    for (; i < n; ++i)
      if (x[i] >= t) c.push_back({x[i], i});
  };
  collect(tau);
  if (static_cast<int64_t>(c.size()) < k && tau > -INFINITY) collect(-INFINITY);
  if (static_cast<int64_t>(c.size()) > k) {
    std::nth_element(c.begin(), c.begin() + (k - 1), c.end(), before);
    c.resize(static_cast<size_t>(k));
  }
  std::sort(c.begin(), c.end(), before);
  return c;
}

// The first candidate whose running weight passes target (w[j]: candidate j's weight); the last one with weight
// where rounding leaves the running sum at or below it.
template <class WeightOf>
int64_t draw(const std::vector<Cand>& c, WeightOf w, double target) {
  double run = 0;
  int64_t last = c.front().i;
  for (size_t j = 0; j < c.size(); ++j) {
    const float wj = w(j);
    if (wj <= 0.f) continue;
    run += wj;
    last = c[j].i;
    if (run > target) return c[j].i;
  }
  return last;
}

// What top_p keeps of the candidates (in order): the fewest whose weight reaches top_p of `total` (all of them where
// none do: reached false), and their weight.
struct Nucleus {
  size_t keep;
  double kept;
  bool reached;
};
template <class WeightOf>
Nucleus nucleus(const std::vector<Cand>& c, WeightOf w, double total, double top_p) {
  double run = 0;
  for (size_t j = 0; j < c.size(); ++j) {
    run += w(j);
    if (run / total >= top_p) return {j + 1, run, true};
  }
  return {c.size(), run, false};
}

constexpr int64_t kNucleusProbe = 1024;  // top_p looks among this many largest logits first

// top_p over a row whose 1,024 largest logits hold less than top_p of the mass (a flat row, where sorting the nucleus
// would cost ~30 ms at 262,144 tokens): the nucleus is found by bucketing, and the draw runs over it in token-id order.
// Buckets of 1/8 of (max - logit) / temperature, the last one everything past 32; the bucket where the running mass
// reaches top_p is cut again into 256 over its own range while it holds more than 4,096 tokens of unequal logits; the
// tokens left are sorted, and the last one the nucleus needs is the threshold: every token before it in `before` order
// is in. w: every token's weight (0 for NaN and -inf), total: their sum.
int64_t draw_flat_nucleus(const float* x, int64_t n, const float* w, double total, float m, float inv_t, double top_p,
                          double u) {
  constexpr int kBuckets = 256;
  constexpr size_t kSortable = 4096;
  const double need = top_p * total;
  double above = 0;  // the weight of the tokens before the band
  std::vector<Cand> band;
  {
    // Each token's bucket is kept (one byte) for the band's collection; the sums run in four interleaved sets so
    // that neighbouring tokens of one bucket do not wait on each other's add through memory.
    thread_local std::vector<uint8_t> bk;
    bk.resize(static_cast<size_t>(n));
    double mass[4][kBuckets] = {};
    int64_t count[4][kBuckets] = {};
    for (int64_t i = 0; i < n; ++i) {
      const float d = (m - x[i]) * inv_t * 8.f;
      const int b = d < kBuckets - 1 ? static_cast<int>(d) : kBuckets - 1;  // NaN: the last (its weight is 0)
      bk[i] = static_cast<uint8_t>(b);
      if (w[i] > 0.f) {
        mass[i & 3][b] += w[i];
        ++count[i & 3][b];
      }
    }
    int b = 0;
    auto mass_of = [&](int j) { return (mass[0][j] + mass[1][j]) + (mass[2][j] + mass[3][j]); };
    for (; b < kBuckets - 1 && above + mass_of(b) < need; ++b) above += mass_of(b);
    band.reserve(static_cast<size_t>(count[0][b] + count[1][b] + count[2][b] + count[3][b]));
    for (int64_t i = 0; i < n; ++i)
      if (bk[i] == b && w[i] > 0.f) band.push_back({x[i], i});
  }
  while (band.size() > kSortable) {
    float lo = band.front().v, hi = lo;
    for (const Cand& c : band) {
      lo = std::min(lo, c.v);
      hi = std::max(hi, c.v);
    }
    if (lo == hi) break;  // equal logits: the sort below orders them by id
    const float scale = kBuckets / (hi - lo);
    auto bucket = [&](float v) { return std::min(kBuckets - 1, static_cast<int>((hi - v) * scale)); };
    std::vector<double> mass(kBuckets, 0.0);
    for (const Cand& c : band) mass[bucket(c.v)] += w[c.i];
    int b = 0;
    for (; b < kBuckets - 1 && above + mass[b] < need; ++b) above += mass[b];
    band.erase(std::remove_if(band.begin(), band.end(), [&](const Cand& c) { return bucket(c.v) != b; }),
               band.end());
  }
  std::sort(band.begin(), band.end(), before);
  Cand last_in{-INFINITY, n};  // an empty band (the sums' rounding): every token is in
  double kept = above;
  for (const Cand& c : band) {
    kept += w[c.i];
    last_in = c;
    if (kept >= need) break;
  }
  if (band.empty()) kept = total;
  const double target = u * kept;
  const float lv = last_in.v;
  const int64_t li = last_in.i;
  auto in = [&](int64_t i) { return w[i] > 0.f && (x[i] > lv || (x[i] == lv && i <= li)); };
  // In token-id order: whole chunks while the running weight stays at or below the target (the nucleus's weights
  // summed in four lanes), then token by token, as the unfiltered draw does.
  constexpr int64_t kChunk = 256;
  double run = 0;
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    double lanes[4] = {0, 0, 0, 0};
    for (int64_t j = 0; j < kChunk; j += 4)
      for (int l = 0; l < 4; ++l) lanes[l] += in(i + j + l) ? w[i + j + l] : 0.f;
    const double chunk = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    if (run + chunk > target) break;
    run += chunk;
  }
  for (; i < n; ++i)
    if (in(i)) {
      run += w[i];
      if (run > target) return i;
    }
  for (i = n - 1; i > 0 && !in(i); --i) {  // rounding left the sum at the target: the nucleus's last token
  }
  return i;
}

}  // namespace

void check_sampling_args(const SamplingParams& p, double u) {
  if (!(p.temperature > 0)) throw EngineError("sampling: temperature must be > 0");
  if (!(p.top_p > 0 && p.top_p <= 1)) throw EngineError("sampling: top_p must be in (0, 1]");
  if (p.top_k < 0) throw EngineError("sampling: top_k must be >= 0");
  if (!(u >= 0 && u < 1)) throw EngineError("sampling: the uniform must be in [0, 1)");
}

int64_t Backend::forward_token_sample(int32_t token, int pos, const SamplingParams& p, double u, float* logits,
                                      int64_t vocab) {
  check_sampling_args(p, u);
  forward_token(token, pos, logits);
  return sample_logits(logits, vocab, p, u);
}

void Backend::forward_batch_sample(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n,
                                   const SamplingParams* params, const double* u, float* logits, bool copy_logits,
                                   int64_t vocab, ArgmaxResult* out) {
  (void)copy_logits;  // the host draws need every row anyway
  for (int i = 0; i < n; ++i)
    if (params[i].temperature > 0) check_sampling_args(params[i], u[i]);
  forward_batch(tokens, slots, pos, n, logits, out);
  for (int i = 0; i < n; ++i)
    if (params[i].temperature > 0)
      out[i].token = static_cast<uint32_t>(sample_logits(logits + static_cast<size_t>(i) * vocab, vocab, params[i], u[i]));
}

int64_t sample_logits(const float* x, int64_t n, const SamplingParams& p, double u) {
  if (n < 1 || n > INT32_MAX) throw EngineError("sampling: expected 1 to 2^31 - 1 logits");
  check_sampling_args(p, u);
  const cpu::Isa isa = cpu::selected_isa();
  ArgmaxResult best;
  try {
    best = cpu::argmax_logits(isa, x, static_cast<int>(n));
  } catch (const NonFiniteLogits&) {
    throw NonFiniteLogits("sampling: every logit is NaN: nothing to sample");
  }
  if (best.value == INFINITY) return best.token;
  if (best.value == -INFINITY) throw NonFiniteLogits("sampling: every logit is NaN or -inf: nothing to sample");
  const float m = best.value, inv_t = static_cast<float>(1.0 / p.temperature);
  const bool top_k = p.top_k > 0 && p.top_k < n, top_p = p.top_p < 1.0;

  if (top_k) {
    std::vector<Cand> c = top_candidates(x, n, p.top_k);
    std::vector<float> v(c.size()), w(c.size());
    for (size_t j = 0; j < c.size(); ++j) v[j] = c[j].v;
    const double total = cpu::exp_weights(isa, v.data(), static_cast<int64_t>(v.size()), m, inv_t, w.data());
    auto weight = [&](size_t j) { return w[j]; };
    if (!top_p) return draw(c, weight, u * total);
    const Nucleus nu = nucleus(c, weight, total, p.top_p);
    c.resize(nu.keep);
    return draw(c, weight, u * nu.kept);
  }

  thread_local std::vector<float> w;
  w.resize(static_cast<size_t>(n));
  const double total = cpu::exp_weights(isa, x, n, m, inv_t, w.data());
  if (!top_p) {
    // In index order: whole chunks while the running weight stays at or below the target, then token by token (the
    // chunk sums are vectorised; a token-by-token walk of 262,144 weights took ~0.4 ms).
    constexpr int64_t kChunk = 256;
    const double target = u * total;
    double run = 0;
    int64_t i = 0;
    for (; i + kChunk <= n; i += kChunk) {
      double lanes[4] = {0, 0, 0, 0};
      for (int64_t j = 0; j < kChunk; j += 4)
        for (int l = 0; l < 4; ++l) lanes[l] += w[i + j + l];
      const double chunk = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
      if (run + chunk > target) break;
      run += chunk;
    }
    for (; i < n; ++i) {
      run += w[i];
      if (w[i] > 0.f && run > target) return i;
    }
    for (i = n - 1; w[i] <= 0.f; --i) {  // rounding left the sum at the target: the last token with weight
    }
    return i;
  }
  // top_p alone: among the largest logits, in their order; a flat row by buckets, in token-id order.
  std::vector<Cand> c = top_candidates(x, n, std::min(kNucleusProbe, n));
  auto weight = [&](size_t j) { return w[static_cast<size_t>(c[j].i)]; };
  const Nucleus nu = nucleus(c, weight, total, p.top_p);
  if (!nu.reached && static_cast<int64_t>(c.size()) < n)
    return draw_flat_nucleus(x, n, w.data(), total, m, inv_t, p.top_p, u);
  c.resize(nu.keep);
  return draw(c, weight, u * nu.kept);
}

LogProbs log_probs(const float* x, int64_t n, int64_t token, int64_t k) {
  if (n < 1 || n > INT32_MAX) throw EngineError("log_probs: expected 1 to 2^31 - 1 logits");
  if (token < 0 || token >= n || k < 0) throw EngineError("log_probs: token out of range or k < 0");
  const cpu::Isa isa = cpu::selected_isa();
  const float m = cpu::argmax_logits(isa, x, static_cast<int>(n)).value;  // every logit NaN throws
  double lse = m;
  if (std::isfinite(m)) {
    thread_local std::vector<float> w;
    w.resize(static_cast<size_t>(n));
    lse += std::log(cpu::exp_weights(isa, x, n, m, 1.f, w.data()));
  }
  LogProbs out;
  out.token = static_cast<double>(x[token]) - lse;
  if (k > 0)
    for (const Cand& c : top_candidates(x, n, std::min(k, n))) {
      out.top_ids.push_back(c.i);
      out.top.push_back(static_cast<double>(c.v) - lse);
    }
  return out;
}

}  // namespace metalattn
