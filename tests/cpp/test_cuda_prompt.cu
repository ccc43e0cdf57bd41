// Prompt kernels (prefill.cu, prompt_mma.cu) against metalattn::ref on fresh random data: the prefill glue
// (norms, RoPE + K/V append, causal attention over prompt and cache) and the few-token projections.
#include "cuda_test_util.h"

// ------------------------------------------------------------------ prefill kernels

TEST(CudaPrefill, NormSiluAndRopeAppend) {
  REQUIRE_GPU();
  const int n = 37, d = 576, ff = 1536, n_heads = 9, n_kv = 3, hd = 64, q_dim = 576, kv_dim = 192, n_ctx = 256;
  const std::vector<float> x = random_vec(static_cast<size_t>(n) * d, -3.f, 3.f), nw = random_vec(d, 0.5f, 1.5f);
  const std::vector<float> gu = random_vec(static_cast<size_t>(n) * 2 * ff, -4.f, 4.f);
  DevBuf<float> dx(x), dnw(nw), dgu(gu);
  DevBuf<__half> out(static_cast<size_t>(n + 1) * 2 * ff);
  out.poison();
  launch_rmsnorm_to_half(dx.p, n, d, dnw.p, kEps, out.p, nullptr);
  {
    const SlotRows o{out.download(), d};
    double err = 0;
    for (int t = 0; t < n; ++t) {
      const std::vector<float> row(x.begin() + t * d, x.begin() + (t + 1) * d);
      const std::vector<float> want = ref_rmsnorm(row, nw, kEps);
      for (int i = 0; i < d; ++i) {
        const double e = std::fabs(o.value(t, i) - want[i]);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
      }
    }
    EXPECT_LE(err, 1e-5) << "rmsnorm hi+lo";
    EXPECT_EQ(o.bad_splits(n), 0) << "rmsnorm hi is the fp16 rounding";
    EXPECT_EQ(o.poisoned(n), 2 * d) << "row n written";
  }
  out.poison();
  launch_silu_to_half(dgu.p, n, ff, out.p, nullptr);
  {
    const SlotRows o{out.download(), ff};
    double err = 0;
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < ff; ++i) {
        const float want = ref::silu(gu[t * 2 * ff + i]) * gu[t * 2 * ff + ff + i];
        const double e = std::fabs(o.value(t, i) - want);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
      }
    EXPECT_LE(err, 1e-5) << "silu hi+lo";
    EXPECT_EQ(o.bad_splits(n), 0) << "silu hi is the fp16 rounding";
    EXPECT_EQ(o.poisoned(n), 2 * ff) << "row n written";
  }
  // RoPE + append for n tokens at positions pos0..
  const int pos0 = 100, rows = q_dim + 2 * kv_dim;
  DevBuf<float2> dtab(rope_table(n_ctx, hd));
  const std::vector<float> qkv = random_vec(static_cast<size_t>(n) * rows);
  DevBuf<float> dqkv(qkv), dq(static_cast<size_t>(n) * q_dim);
  DevCache dk(static_cast<size_t>(n_ctx) * kv_dim), dv(static_cast<size_t>(n_ctx) * kv_dim);
  dq.poison();
  dk.poison();
  dv.poison();
  launch_rope_append(dqkv.p, n, pos0, dtab.p, q_dim, kv_dim, hd, dq.p, dk.p, dv.p, nullptr);
  const std::vector<float> gq = dq.download(), gk = dk.download_floats(), gv = dv.download_floats();
  expect_rope_append(qkv, n, pos0, n_heads, n_kv, hd, gq, gk, gv, kTol, "rope + append");
}

TEST(CudaPrefill, CausalAttentionOverPromptAndCache) {
  REQUIRE_GPU();
  const int n_heads = 9, n_kv = 3, hd = 64, q_dim = 576, kv_dim = 192, n_ctx = 1024;
  const std::vector<float> kc = random_cache(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f);
  const std::vector<float> vc = random_cache(static_cast<size_t>(n_ctx) * kv_dim);
  DevCache dk(kc), dv(vc);
  for (int n : {1, 7, 33, 129, 300}) {
    for (int pos0 : {0, 50}) {
      SCOPED_TRACE("n " + std::to_string(n) + " pos0 " + std::to_string(pos0));
      const std::vector<float> q = random_vec(static_cast<size_t>(n) * q_dim, -1.5f, 1.5f);
      DevBuf<float> dq(q);
      DevBuf<__half> out(static_cast<size_t>(n) * 2 * q_dim);
      out.poison();
      launch_attention_prefill(dq.p, dk.p, dv.p, n, pos0, n_heads, n_kv, hd, out.p, nullptr);
      const SlotRows o{out.download(), q_dim};
      double err = 0;
      std::vector<float> want(q_dim);
      for (int t = 0; t < n; ++t) {
        ref::attention(q.data() + t * q_dim, kc.data(), vc.data(), n_heads, n_kv, hd, pos0 + t + 1, want.data());
        for (int i = 0; i < q_dim; ++i) {
          const double g = o.value(t, i);
          err = std::isnan(g) ? INFINITY : std::max(err, std::fabs(g - want[i]));
        }
      }
      EXPECT_LE(err, kTol);
      EXPECT_EQ(o.bad_splits(n), 0) << "hi is the fp16 rounding";
    }
  }
}

// The _at launches (start position read from device memory) at the SmolLM2 shape (head_dim 64: tensor cores) over
// long contexts and at a late start position, and at head_dim 128 / 32 (the fp32 fallback).
TEST(CudaPrefill, AttentionWithDevicePositionTensorCoresAndFallback) {
  REQUIRE_GPU();
  struct Shape {
    int n_heads, n_kv, hd;
  };
  const int n_ctx = 2048;
  for (const Shape sh : {Shape{9, 3, 64}, Shape{4, 2, 128}, Shape{6, 1, 32}}) {
    const int q_dim = sh.n_heads * sh.hd, kv_dim = sh.n_kv * sh.hd;
    const std::vector<float> kc = random_cache(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f);
    const std::vector<float> vc = random_cache(static_cast<size_t>(n_ctx) * kv_dim);
    DevCache dk(kc), dv(vc);
    for (const auto [n, pos0] : {std::pair<int, int>{520, 0}, {97, 1900}, {16, 1000}, {65, 63}}) {
      SCOPED_TRACE("head_dim " + std::to_string(sh.hd) + " n " + std::to_string(n) + " pos0 " + std::to_string(pos0));
      const std::vector<float> q = random_vec(static_cast<size_t>(n) * q_dim, -1.5f, 1.5f);
      DevBuf<float> dq(q);
      DevBuf<int32_t> dpos(std::vector<int32_t>{pos0});
      DevBuf<__half> out(static_cast<size_t>(n) * 2 * q_dim);
      out.poison();
      launch_attention_prefill_at(dq.p, dk.p, dv.p, n, dpos.p, sh.n_heads, sh.n_kv, sh.hd, out.p, nullptr);
      const SlotRows o{out.download(), q_dim};
      EXPECT_EQ(o.bad_splits(n), 0) << "hi is the fp16 rounding";
      double err = 0;
      std::vector<float> want(q_dim);
      for (int t = 0; t < n; ++t) {
        ref::attention(q.data() + static_cast<size_t>(t) * q_dim, kc.data(), vc.data(), sh.n_heads, sh.n_kv, sh.hd,
                       pos0 + t + 1, want.data());
        for (int i = 0; i < q_dim; ++i) {
          const double g = o.value(t, i);
          err = std::isnan(g) ? INFINITY : std::max(err, std::fabs(g - want[i]));
        }
      }
      EXPECT_LE(err, kTol);
    }
  }
}

// The fused chunk step from raw QKV rows: roped queries, K/V rows appended to the cache (only rows pos0..pos0+n-1
// change; rows past them stay poisoned and must not leak into the output), and causal attention over cache + chunk.
TEST(CudaPrefill, RopeAppendAttentionFromQkvRows) {
  REQUIRE_GPU();
  struct Shape {
    int n_heads, n_kv, hd;
  };
  const int n_ctx = 1024;
  for (const Shape sh : {Shape{9, 3, 64}, Shape{4, 2, 128}}) {
    const int q_dim = sh.n_heads * sh.hd, kv_dim = sh.n_kv * sh.hd, rows = q_dim + 2 * kv_dim;
    DevBuf<float2> dtab(rope_table(n_ctx, sh.hd));
    for (const auto [n, pos0] : {std::pair<int, int>{300, 0}, {70, 600}, {1, 5}, {129, 64}}) {
      SCOPED_TRACE("head_dim " + std::to_string(sh.hd) + " n " + std::to_string(n) + " pos0 " + std::to_string(pos0));
      // Host cache: random rows before pos0, NaN from pos0 on (the device copy is the same).
      std::vector<float> kc = random_cache(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f);
      std::vector<float> vc = random_cache(kc.size());
      std::fill(kc.begin() + static_cast<size_t>(pos0) * kv_dim, kc.end(), std::numeric_limits<float>::quiet_NaN());
      std::fill(vc.begin() + static_cast<size_t>(pos0) * kv_dim, vc.end(), std::numeric_limits<float>::quiet_NaN());
      DevCache dk(kc), dv(vc);
      const std::vector<float> qkv = random_vec(static_cast<size_t>(n) * rows, -1.5f, 1.5f);
      DevBuf<float> dqkv(qkv), dqs(static_cast<size_t>(n) * q_dim);
      DevBuf<int32_t> dpos(std::vector<int32_t>{pos0});
      DevBuf<__half> out(static_cast<size_t>(n) * 2 * q_dim);
      out.poison();
      launch_rope_attention_prefill(dqkv.p, n, dpos.p, dtab.p, sh.n_heads, sh.n_kv, sh.hd, dk.p, dv.p, dqs.p, out.p,
                                    nullptr);
      // Reference: rope and append on the host, then attention per query.
      std::vector<std::vector<float>> qs(n);
      for (int t = 0; t < n; ++t) {
        const float* row = qkv.data() + static_cast<size_t>(t) * rows;
        qs[t].assign(row, row + q_dim);
        ref::rope(qs[t].data(), sh.n_heads, sh.hd, pos0 + t, 100000.f);
        float* kdst = kc.data() + static_cast<size_t>(pos0 + t) * kv_dim;
        std::copy(row + q_dim, row + q_dim + kv_dim, kdst);
        ref::rope(kdst, sh.n_kv, sh.hd, pos0 + t, 100000.f);
        std::copy(row + q_dim + kv_dim, row + rows, vc.data() + static_cast<size_t>(pos0 + t) * kv_dim);
      }
      const std::vector<float> gk = dk.download_floats(), gv = dv.download_floats();
      double cache_err = 0;
      size_t cache_mismatch = 0;
      for (size_t i = 0; i < gk.size(); ++i) {
        if (std::isnan(kc[i]) || std::isnan(gk[i]) || std::isnan(vc[i]) || std::isnan(gv[i])) {
          cache_mismatch += std::isnan(kc[i]) != std::isnan(gk[i]) || std::isnan(vc[i]) != std::isnan(gv[i]);
          continue;
        }
        cache_err = std::max({cache_err, kv_excess(gk[i], kc[i]), kv_excess(gv[i], vc[i])});
      }
      EXPECT_EQ(cache_mismatch, 0u) << "cache rows written outside pos0..pos0+n-1, or missing";
      EXPECT_LE(cache_err, kTol) << "appended K/V rows";
      // The attention reads the cache as written (fp16, checked just above): the reference takes the same rows, so
      // a last-bit difference in a row's fp32 value before its rounding cannot move the outputs by a half ulp.
      kc = gk;
      vc = gv;
      const SlotRows o{out.download(), q_dim};
      EXPECT_EQ(o.bad_splits(n), 0) << "hi is the fp16 rounding";
      double err = 0;
      std::vector<float> want(q_dim);
      for (int t = 0; t < n; ++t) {
        ref::attention(qs[t].data(), kc.data(), vc.data(), sh.n_heads, sh.n_kv, sh.hd, pos0 + t + 1, want.data());
        for (int i = 0; i < q_dim; ++i) {
          const double g = o.value(t, i);
          err = std::isnan(g) ? INFINITY : std::max(err, std::fabs(g - want[i]));
        }
      }
      EXPECT_LE(err, kTol) << "attention output";
    }
  }
}

TEST(CudaPrefill, RopeAppendWithDevicePosition) {
  REQUIRE_GPU();
  const int n = 40, n_heads = 9, n_kv = 3, hd = 64, q_dim = 576, kv_dim = 192, n_ctx = 128, pos0 = 77;
  const int rows = q_dim + 2 * kv_dim;
  DevBuf<float2> dtab(rope_table(n_ctx, hd));
  const std::vector<float> qkv = random_vec(static_cast<size_t>(n) * rows);
  DevBuf<float> dqkv(qkv), dq(static_cast<size_t>(n) * q_dim);
  DevCache dk(static_cast<size_t>(n_ctx) * kv_dim), dv(static_cast<size_t>(n_ctx) * kv_dim);
  DevBuf<int32_t> dpos(std::vector<int32_t>{pos0});
  dq.poison();
  dk.poison();
  dv.poison();
  launch_rope_append_at(dqkv.p, n, dpos.p, dtab.p, q_dim, kv_dim, hd, dq.p, dk.p, dv.p, nullptr);
  const std::vector<float> gq = dq.download(), gk = dk.download_floats(), gv = dv.download_floats();
  expect_rope_append(qkv, n, pos0, n_heads, n_kv, hd, gq, gk, gv, kTol, "rope + append at a device-side position");
}

// ------------------------------------------------------------------ few-token prompt projections (prompt_mma.cu)

namespace {

}  // namespace

// Every projection a prompt of up to 32 tokens runs on tensor cores, at every SmolLM2 shape (plus ragged ones),
// for each weight type the kernel reads, against the scalar reference on the same inputs; outputs start poisoned.
TEST(CudaPrompt, MmaProjectionsMatchReferenceAtEveryShape) {
  REQUIRE_GPU();
  struct Case {
    int rows, cols;  // of W (SiluHalf: gate and up stacked, rows = 2 * d_ff)
    PromptMmaOut out;
    bool normed;     // rmsnorm'ed fp32 rows in, else fp16 operand rows
  };
  const Case cases[] = {{960, 576, PromptMmaOut::Store, true},        {576, 576, PromptMmaOut::AddResidual, false},
                        {3072, 576, PromptMmaOut::SiluHalf, true},    {576, 1536, PromptMmaOut::AddResidual, false},
                        {72, 96, PromptMmaOut::Store, true},          {80, 64, PromptMmaOut::SiluHalf, true},
                        {40, 160, PromptMmaOut::AddResidual, true}};
  // METALATTN_TEST_QUICK=1 (for the slow race checker): Q4_1 (the type with the most shared-memory traffic) and two
  // token counts.
  const bool quick = quick_mode();
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
    if (quick && type != GgmlType::Q4_1) continue;
    for (const Case& cs : cases) {
      for (int n : {1, 7, 8, 9, 17, 32}) {  // every token-tile count the kernel is compiled for (1..4 tiles of 8)
        if (quick && n != 9 && n != 32) continue;
        SCOPED_TRACE(std::string(type_name(type)) + " " + std::to_string(cs.rows) + "x" + std::to_string(cs.cols) +
                     " out " + std::to_string(static_cast<int>(cs.out)) + (cs.normed ? " normed" : " slots") +
                     " n " + std::to_string(n));
        const int K = cs.cols;
        auto hm = random_matrix(type, cs.rows, K, 1.f / std::sqrt(static_cast<float>(K)));
        GpuMatrix g = to_gpu({&hm->view});
        check_prompt_mma(g.m, n, K, cs.rows, cs.normed, cs.out,
                         [&](const std::vector<float>& row) { return ref_matvec(hm->view, row); });
      }
    }
  }
}

// Causal attention of a few-token prompt chunk at start positions inside and past the first key tile, against the
// scalar reference: the few-token kernel (also with Q/K/V biases and NeoX pairs, Qwen 2's layer, and each alone) and
// the tensor-core prefill kernel with slot output, from raw QKV rows. Both must append the chunk's roped k / plain v
// rows to the caches and leave every other cache row alone.
TEST(CudaPrompt, FewTokenAttentionMatchesReference) {
  REQUIRE_GPU();
  const int n_heads = 9, n_kv = 3, hd = 64, q_dim = 576, kv_dim = 192, rows = q_dim + 2 * kv_dim, n_ctx = 512;
  const std::vector<float2> tab = rope_table(n_ctx, hd);
  DevBuf<float2> dtab(tab);
  const std::vector<float> bias = random_vec(rows);
  DevBuf<float> dbias(bias);
  struct Variant {
    bool few, neox, bias;
  };
  for (int pos0 : {0, 37, 200, 300}) {
    for (int n : {1, 9, 32}) {
      for (const Variant va : {Variant{true, false, false}, Variant{false, false, false}, Variant{true, true, true},
                               Variant{true, true, false}, Variant{true, false, true}}) {
        const bool few = va.few;
        SCOPED_TRACE(std::string(few ? "few-token kernel" : "prefill kernel") + (va.neox ? ", NeoX pairs" : "") +
                     (va.bias ? ", biases" : "") + ", " + std::to_string(n) + " tokens at " + std::to_string(pos0));
        const std::vector<float> qkv = random_vec(static_cast<size_t>(n) * rows);
        std::vector<float> kc(static_cast<size_t>(n_ctx) * kv_dim), vc(kc.size());
        const std::vector<float> old_k = random_cache(static_cast<size_t>(pos0) * kv_dim),
                                 old_v = random_cache(old_k.size());
        DevBuf<float> dqkv(qkv);
        DevCache dk(kc.size()), dv(vc.size());
        dk.poison();
        dv.poison();
        if (pos0 > 0) {
          CUDA_CHECK(cudaMemcpy(dk.p, to_halves(old_k).data(), old_k.size() * 2, cudaMemcpyHostToDevice));
          CUDA_CHECK(cudaMemcpy(dv.p, to_halves(old_v).data(), old_v.size() * 2, cudaMemcpyHostToDevice));
        }
        DevBuf<int32_t> dpos(std::vector<int32_t>{pos0});
        DevBuf<__half> out(static_cast<size_t>(n) * 2 * q_dim);
        out.poison();
        if (few) {
          FewAttnArgs a;
          a.qkv = dqkv.p;
          a.bias = va.bias ? dbias.p : nullptr;
          a.neox = va.neox;
          a.n = n;
          a.pos0_dev = dpos.p;
          a.rope_table = dtab.p;
          a.k_cache = dk.p;
          a.v_cache = dv.p;
          a.n_heads = n_heads;
          a.n_kv_heads = n_kv;
          a.head_dim = hd;
          a.out_slots = out.p;
          launch_attention_prompt_few(a, nullptr);
        } else {
          launch_rope_attention_prefill(dqkv.p, n, dpos.p, dtab.p, n_heads, n_kv, hd, dk.p, dv.p, nullptr, out.p,
                                        nullptr);
        }
        const SlotRows got{out.download(), q_dim};
        const std::vector<float> gk = dk.download_floats(), gv = dv.download_floats();
        // Reference: the same cache, each token roped and appended; the appended rows checked against the device's
        // (within their fp16 rounding), then attention over 0..pos0 + t of the device's rows (what the kernel read:
        // a last-bit difference before the rounding cannot move the outputs by a half ulp).
        std::copy(old_k.begin(), old_k.end(), kc.begin());
        std::copy(old_v.begin(), old_v.end(), vc.begin());
        std::vector<std::vector<float>> qs(n);
        for (int t = 0; t < n; ++t) {
          const int p = pos0 + t;
          std::vector<float> row(qkv.begin() + t * rows, qkv.begin() + (t + 1) * rows);
          if (va.bias)
            for (int i = 0; i < rows; ++i) row[i] += bias[i];
          qs[t].assign(row.begin(), row.begin() + q_dim);
          std::copy(row.begin() + q_dim, row.begin() + q_dim + kv_dim, kc.begin() + p * kv_dim);
          std::copy(row.begin() + q_dim + kv_dim, row.end(), vc.begin() + p * kv_dim);
          const RopeStyle style = va.neox ? RopeStyle::Neox : RopeStyle::Interleaved;
          ref_rope_pairs(qs[t].data(), n_heads, hd, style, tab.data() + p * hd / 2);
          ref_rope_pairs(kc.data() + p * kv_dim, n_kv, hd, style, tab.data() + p * hd / 2);
        }
        double cache_err = 0;
        for (size_t i = 0; i < static_cast<size_t>(pos0 + n) * kv_dim; ++i)
          cache_err = std::max({cache_err, kv_excess(gk[i], kc[i]), kv_excess(gv[i], vc[i])});
        double err = 0;
        for (int t = 0; t < n; ++t) {
          std::vector<float> o(q_dim);
          ref::attention(qs[t].data(), gk.data(), gv.data(), n_heads, n_kv, hd, pos0 + t + 1, o.data());
          for (int j = 0; j < q_dim; ++j) {
            const double e = std::fabs(got.value(t, j) - o[j]);
            err = std::isnan(e) ? INFINITY : std::max(err, e);
          }
        }
        EXPECT_LE(err, kTol) << "attention output";
        EXPECT_LE(cache_err, kTol) << "cache rows 0 .. pos0 + n";
        int64_t beyond = 0;
        for (size_t i = static_cast<size_t>(pos0 + n) * kv_dim; i < gk.size(); ++i) beyond += !is_poison(gk[i]) + !is_poison(gv[i]);
        EXPECT_EQ(beyond, 0) << "cache rows past the chunk written";
      }
    }
  }
}
