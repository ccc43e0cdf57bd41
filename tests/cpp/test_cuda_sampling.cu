// Sampled decoding's draw on the GPU (shaders/cuda/sampling.cu) against the host's sample_logits (its reference) on the
// same rows and uniforms: the vocabularies of the real models, LLM-like, flat and narrow rows, ties, NaN and infinities.
#include "cuda_test_util.h"
#include "engine/sampling.h"

namespace {

struct Sampler {
  ArgmaxScratch am;
  DevBuf<ArgmaxPartial> partials{static_cast<size_t>(kArgmaxMaxBlocks)};
  DevBuf<unsigned int> counter{1};
  DevBuf<ArgmaxResult> best{1}, last{1};  // the argmax's result and its device copy, which the draw reads
  DevBuf<uint8_t> work{sample_work_bytes()};
  DevBuf<SampleResult> out{1};
  DevBuf<DecodeIO> io{1};
  Sampler() {
    CUDA_CHECK(cudaMemset(counter.p, 0, sizeof(unsigned int)));
    CUDA_CHECK(cudaMemset(work.p, 0, sample_work_bytes()));
    am.partials = partials.p;
    am.counter = counter.p;
    am.capacity = kArgmaxMaxBlocks;
    am.last = last.p;
  }
  // The row's argmax, then the draw; the result and the token left in io.
  SampleResult draw(const DevBuf<float>& x, const SamplingParams& p, double u, int32_t* io_token) {
    launch_argmax(x.p, static_cast<int>(x.n), am, best.p, nullptr, nullptr);
    const DecodeIO before{-7, 3};
    CUDA_CHECK(cudaMemcpy(io.p, &before, sizeof(DecodeIO), cudaMemcpyHostToDevice));
    SampleArgs a;
    a.inv_t = static_cast<float>(1.0 / p.temperature);
    a.top_k = static_cast<int>(p.top_k);
    a.top_p = p.top_p;
    a.u = u;
    launch_sample(x.p, static_cast<int>(x.n), am.last, a, work.p, out.p, io.p, nullptr);
    const DecodeIO after = io.download()[0];
    EXPECT_EQ(after.pos, 3) << "the draw changes only the token of io";
    *io_token = after.token;
    return out.download()[0];
  }
};

std::vector<float> llm_like_row(int n) {  // a few dominant logits over a normal body, as a trained model gives
  std::normal_distribution<float> body(0.f, 2.5f);
  std::vector<float> x(n);
  for (float& v : x) v = body(rng());
  for (int j = 0; j < 8; ++j) x[std::uniform_int_distribution<int>(0, n - 1)(rng())] = uniform(9.f, 14.f);
  return x;
}

// The host's weight of the 1,024 largest logits and of the whole row (top_p's probe in sample_logits).
std::pair<double, double> probe_mass(const std::vector<float>& x, double temperature) {
  std::vector<float> v;
  for (float f : x)
    if (!std::isnan(f)) v.push_back(f);
  std::sort(v.begin(), v.end(), std::greater<float>());
  double top = 0, all = 0;
  for (size_t j = 0; j < v.size(); ++j) {
    const double w = std::exp((static_cast<double>(v[j]) - v[0]) / temperature);
    all += w;
    if (j < 1024) top += w;
  }
  return {top, all};
}

TEST(CudaSampling, DrawsWhatTheHostDraws) {
  REQUIRE_GPU();
  Sampler s;
  struct RowCase {
    const char* kind;
    int n;
  };
  // narrow: every logit in one bin of the first histogram pass (one exponent, the same top mantissa bits), so that
  // whole warps count into one bin and the second pass refines it.
  const RowCase rows[] = {{"llm", 49152}, {"llm", 151936}, {"llm", 262144}, {"flat", 262144}, {"narrow", 151936},
                          {"ties", 49152}, {"llm", 1000}, {"nan-inf", 151936}, {"llm", 7}};
  const double temps[] = {1.0, 0.7, 1.6};
  const int64_t top_ks[] = {0, 1, 40, 1024};
  const double top_ps[] = {1.0, 0.9, 0.5};
  constexpr int kUniforms = 7;
  int draws = 0, near_boundary = 0, large_nucleus = 0;
  for (const RowCase& rc : rows) {
    std::vector<float> x;
    if (std::string(rc.kind) == "flat") {
      x = random_vec(rc.n, -0.01f, 0.01f);
    } else if (std::string(rc.kind) == "narrow") {
      x = random_vec(rc.n, 4.f, 4.5f);
    } else if (std::string(rc.kind) == "ties") {  // logits on a 1/4 grid: equal values at every cut
      x = llm_like_row(rc.n);
      for (float& v : x) v = std::round(v * 4.f) / 4.f;
    } else {
      x = llm_like_row(rc.n);
      if (std::string(rc.kind) == "nan-inf")
        for (int j = 0; j < rc.n; j += 97) x[j] = j % 2 ? NAN : -INFINITY;
    }
    DevBuf<float> dx(x);
    // Each token's place in the other order sample_logits draws in: larger logit first, the lower id among equal ones.
    std::vector<int64_t> by_logit(rc.n), rank(rc.n);
    for (int i = 0; i < rc.n; ++i) by_logit[i] = i;
    std::sort(by_logit.begin(), by_logit.end(), [&](int64_t a, int64_t b) {
      const float xa = std::isnan(x[a]) ? -INFINITY : x[a], xb = std::isnan(x[b]) ? -INFINITY : x[b];
      return xa > xb || (xa == xb && a < b);
    });
    for (int i = 0; i < rc.n; ++i) rank[by_logit[i]] = i;
    for (double t : temps)
      for (int64_t k : top_ks)
        for (double p : top_ps) {
          SamplingParams sp;
          sp.temperature = t;
          sp.top_k = k;
          sp.top_p = p;
          const auto [top_mass, all_mass] = probe_mass(x, t);
          for (int q = 0; q < kUniforms; ++q) {
            const double u = q == kUniforms - 1 ? 0.999999 : (q + 0.37 * (q % 3)) / kUniforms;
            SCOPED_TRACE(std::string(rc.kind) + " n " + std::to_string(rc.n) + " T " + std::to_string(t) + " top_k " +
                         std::to_string(k) + " top_p " + std::to_string(p) + " u " + std::to_string(u));
            int32_t io_token = 0;
            const SampleResult r = s.draw(dx, sp, u, &io_token);
            ASSERT_EQ(r.status, kSampleDrawn) << "only thousands of equal logits at the cut go back to the host";
            if ((k == 0 || k >= rc.n) && p < 1.0 && top_mass < p * all_mass) ++large_nucleus;
            EXPECT_EQ(io_token, r.token) << "io must carry the drawn token";
            const int64_t want = sample_logits(x.data(), rc.n, sp, u);
            ++draws;
            if (r.token == want) continue;
            // The weights' rounding differs (expf on the GPU, the host's vectorised exp) and so do the orders of
            // the sums: a different token is right only where a uniform and a top_p within 1e-6 draw it on the host,
            // i.e. it lies between the host's draws at (u, top_p) - 1e-6 and + 1e-6 in the order of the draw (token
            // ids without a filter, else larger logit first); both move the draw one way.
            ++near_boundary;
            SamplingParams sp_lo = sp, sp_hi = sp;
            if (p < 1.0) {
              sp_lo.top_p = p - 1e-6;
              sp_hi.top_p = std::min(1.0, p + 1e-6);
            }
            const int64_t lo = sample_logits(x.data(), rc.n, sp_lo, std::max(0.0, u - 1e-6));
            const int64_t hi = sample_logits(x.data(), rc.n, sp_hi, std::min(0.9999999, u + 1e-6));
            const bool by_id = (k == 0 || k >= rc.n) && p == 1.0;
            auto place = [&](int64_t tok) { return by_id ? tok : rank[tok]; };
            EXPECT_TRUE(place(lo) <= place(r.token) && place(r.token) <= place(hi))
                << "GPU drew " << r.token << ", the host " << want << " (" << lo << " / " << hi << " at u -/+ 1e-6)";
          }
        }
  }
  std::printf("[ %d draws, %d at a rounding boundary, %d of a top_p nucleus past the 1,024 largest logits ]\n", draws,
              near_boundary, large_nucleus);
  EXPECT_LE(near_boundary, draws / 20) << "more rounding-boundary draws than rounding explains";
  EXPECT_GT(large_nucleus, 100) << "the rows should take the token-id-order nucleus often";
}

TEST(CudaSampling, RowsInOneLaunchDrawAsOneByOne) {
  REQUIRE_GPU();
  // Ten rows of a 151,936-token vocabulary in one launch set (a grid row each, as a batch step draws them) against
  // each row drawn alone: the same kernels on the same data, so the same tokens; a row with inv_t 0 is not touched.
  constexpr int kRows = 10, n = 151936;
  std::vector<float> x;
  for (int y = 0; y < kRows; ++y) {
    std::vector<float> row = y % 3 == 1 ? random_vec(n, -0.01f, 0.01f) : llm_like_row(n);
    if (y % 3 == 2)
      for (float& v : row) v = std::round(v * 4.f) / 4.f;
    x.insert(x.end(), row.begin(), row.end());
  }
  DevBuf<float> dx(x);
  ArgmaxScratch am;
  DevBuf<ArgmaxPartial> partials(static_cast<size_t>(kArgmaxMaxBlocks));
  DevBuf<unsigned int> counter(1);
  CUDA_CHECK(cudaMemset(counter.p, 0, sizeof(unsigned int)));
  am.partials = partials.p;
  am.counter = counter.p;
  am.capacity = kArgmaxMaxBlocks;
  DevBuf<ArgmaxResult> best(kRows);
  for (int y = 0; y < kRows; ++y) launch_argmax(dx.p + static_cast<size_t>(y) * n, n, am, best.p + y, nullptr, nullptr);
  const SampleArgs cases[] = {{1.f, 0, 1.0, 0.3},  {1.f / 0.7f, 40, 1.0, 0.6}, {1.f, 0, 0.9, 0.2},
                              {1.f, 0, 0.95, 0.8}, {1.f / 1.3f, 5, 0.5, 0.9},  {0.f, 0, 1.0, 0.0},
                              {1.f, 1024, 1.0, 0.5}, {1.f / 1.6f, 0, 0.9, 0.45}, {1.f, 1, 1.0, 0.99},
                              {1.f, 40, 0.7, 0.05}};
  std::vector<SampleArgs> args(cases, cases + kRows);
  DevBuf<uint8_t> work(kRows * sample_work_bytes()), one_work(sample_work_bytes());
  CUDA_CHECK(cudaMemset(work.p, 0, kRows * sample_work_bytes()));
  CUDA_CHECK(cudaMemset(one_work.p, 0, sample_work_bytes()));
  DevBuf<SampleResult> rows_out(kRows), one_out(1);
  rows_out.poison();
  launch_sample_rows(dx.p, n, n, kRows, best.p, args.data(), work.p, rows_out.p, nullptr, nullptr);
  const std::vector<SampleResult> got = rows_out.download();
  for (int y = 0; y < kRows; ++y) {
    SCOPED_TRACE("row " + std::to_string(y));
    if (args[y].inv_t == 0.f) {
      EXPECT_EQ(got[y].token, -1) << "a skipped row's result must stay as it was";
      continue;
    }
    launch_sample(dx.p + static_cast<size_t>(y) * n, n, best.p + y, args[y], one_work.p, one_out.p, nullptr, nullptr);
    const SampleResult alone = one_out.download()[0];
    EXPECT_EQ(got[y].status, alone.status);
    EXPECT_EQ(got[y].token, alone.token);
    EXPECT_EQ(got[y].status, kSampleDrawn);
  }
  // Rows from a second launch set reuse the work areas as the first left them.
  launch_sample_rows(dx.p, n, n, kRows, best.p, args.data(), work.p, rows_out.p, nullptr, nullptr);
  const std::vector<SampleResult> again = rows_out.download();
  for (int y = 0; y < kRows; ++y)
    if (args[y].inv_t != 0.f) EXPECT_EQ(again[y].token, got[y].token) << "row " << y;
  EXPECT_THROW(launch_sample_rows(dx.p, n, n, kSampleMaxRows + 1, best.p, args.data(), work.p, rows_out.p, nullptr,
                                  nullptr),
               EngineError);
}

TEST(CudaSampling, SpecialRows) {
  REQUIRE_GPU();
  Sampler s;
  SamplingParams sp;
  int32_t io_token = 0;
  for (const int64_t k : {0, 40}) {
    sp.top_k = k;
    std::vector<float> x(5000, NAN);
    DevBuf<float> all_nan(x);
    EXPECT_EQ(s.draw(all_nan, sp, 0.5, &io_token).status, kSampleNoCandidate);
    for (size_t j = 0; j < x.size(); ++j) x[j] = j % 3 ? -INFINITY : NAN;
    DevBuf<float> nan_or_neg_inf(x);
    EXPECT_EQ(s.draw(nan_or_neg_inf, sp, 0.5, &io_token).status, kSampleNoCandidate);
    EXPECT_EQ(io_token, -7);
    x = random_vec(5000, -3.f, 3.f);
    x[1234] = INFINITY;
    x[4000] = INFINITY;
    DevBuf<float> pos_inf(x);
    const SampleResult r = s.draw(pos_inf, sp, 0.99, &io_token);
    EXPECT_EQ(r.status, kSampleDrawn);
    EXPECT_EQ(r.token, 1234) << "the first +inf logit takes all the mass";
    EXPECT_EQ(io_token, 1234);
    // A single finite logit among NaN and -inf: every draw takes it.
    for (size_t j = 0; j < x.size(); ++j) x[j] = j % 2 ? -INFINITY : NAN;
    x[4321] = -50.f;
    DevBuf<float> one(x);
    for (double u : {0.0, 0.5, 0.999999}) EXPECT_EQ(s.draw(one, sp, u, &io_token).token, 4321);
  }
  // Thousands of equal logits at the cut: top_k and top_p go back to the host (which orders them by id); without a
  // filter the device draws.
  {
    std::vector<float> x(262144, 1.f);
    x[100] = 2.f;
    DevBuf<float> flat(x);
    for (const auto& [k, p] : {std::pair<int64_t, double>{40, 1.0}, {0, 0.5}}) {
      sp.top_k = k;
      sp.top_p = p;
      const SampleResult r = s.draw(flat, sp, 0.3, &io_token);
      EXPECT_EQ(r.status, kSampleOnHost) << "top_k " << k << " top_p " << p;
      EXPECT_EQ(io_token, -7) << "io must keep its token when the host draws";
    }
    sp.top_k = 0;
    sp.top_p = 1.0;
    const SampleResult r = s.draw(flat, sp, 0.3, &io_token);
    EXPECT_EQ(r.status, kSampleDrawn);
    // (u 0.3 falls 0.003 of a token's weight from a boundary here: within rounding, either neighbour is right)
    EXPECT_LE(sample_logits(x.data(), static_cast<int64_t>(x.size()), sp, 0.3 - 1e-6), r.token);
    EXPECT_GE(sample_logits(x.data(), static_cast<int64_t>(x.size()), sp, 0.3 + 1e-6), r.token);
  }
  // top_k past kSampleMaxTopK is the host's.
  SampleArgs a;
  a.top_k = kSampleMaxTopK + 1;
  std::vector<float> x = random_vec(5000);
  DevBuf<float> dx(x);
  EXPECT_THROW(launch_sample(dx.p, 5000, s.best.p, a, s.work.p, s.out.p, nullptr, nullptr), EngineError);
}

}  // namespace
