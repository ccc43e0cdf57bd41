// Decode kernels (matvec.cu, lm_head.cu, decode_attention.cu, kernels.cu) against metalattn::ref, on fresh random data
// with poisoned outputs. Tolerances: single kernels and fused kernels vs the composition of the unfused reference ops:
// max abs error <= 1e-4 on outputs of magnitude ~1 (float accumulation in another order; seen ~1e-6). Every test
// skips when no CUDA device is present.
#include <cstring>

#include "cuda_test_util.h"

// ------------------------------------------------------------------ matvec family

TEST(CudaMatvec, PlainFusedNormAndResidualAtEveryShape) {
  REQUIRE_GPU();
  for (GgmlType t : kAllTypes) {
    for (Shape s : kShapes) {
      SCOPED_TRACE(std::string(type_name(t)) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols));
      auto hm = random_matrix(t, s.rows, s.cols, 1.f / std::sqrt(static_cast<float>(s.cols)));
      GpuMatrix g = to_gpu({&hm->view});
      check_decode_matvecs(*hm, g, s.rows, s.cols);
    }
  }
}

TEST(CudaMatvec, FloatRowsNotMultipleOf32AndMixedTypeStacks) {
  REQUIRE_GPU();
  for (GgmlType t : {GgmlType::F16, GgmlType::BF16, GgmlType::F32}) {
    auto hm = random_matrix(t, 70, 100, 0.1f);
    GpuMatrix g = to_gpu({&hm->view});
    const std::vector<float> x = random_vec(100);
    DevBuf<float> dx(x), dy(70);
    dy.poison();
    launch_norm_matvec(g.m, dx.p, nullptr, kEps, dy.p, nullptr);
    EXPECT_LE(max_abs_diff(dy.download(), ref_matvec(hm->view, x)), kTol) << type_name(t);
  }
  // A Q4_0 + Q8_0 stack is widened to Q8_0 exactly; a Q4_0 + Q4_1 stack to the wide int8 type, one with F16 to F32.
  for (GgmlType other : {GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::F16}) {
    auto a = random_matrix(GgmlType::Q4_0, 64, 576, 0.04f), b = random_matrix(other, 32, 576, 0.04f);
    GpuMatrix g = to_gpu({&a->view, &b->view});
    EXPECT_EQ(g.m.type, other == GgmlType::Q8_0 ? GgmlType::Q8_0 : other == GgmlType::Q4_1 ? kWide8 : GgmlType::F32);
    const std::vector<float> x = random_vec(576);
    DevBuf<float> dx(x), dy(96);
    dy.poison();
    launch_norm_matvec(g.m, dx.p, nullptr, kEps, dy.p, nullptr);
    std::vector<float> expect = ref_matvec(a->view, x), tail = ref_matvec(b->view, x);
    expect.insert(expect.end(), tail.begin(), tail.end());
    EXPECT_LE(max_abs_diff(dy.download(), expect), kTol);
  }
}

TEST(CudaFused, NormQkvRopeAndCacheAppend) {
  REQUIRE_GPU();
  // SmolLM2-135M's heads, and head_dim 128 with 6 query heads per KV head (Qwen2.5-1.5B's layer).
  struct Shape {
    int d, n_heads, n_kv, hd;
  };
  for (const Shape sh : {Shape{576, 9, 3, 64}, Shape{1536, 12, 2, 128}}) {
    const int d = sh.d, n_heads = sh.n_heads, n_kv = sh.n_kv, hd = sh.hd, q_dim = n_heads * hd, kv_dim = n_kv * hd;
    const int n_ctx = 1024;
    const float base = 100000.f;
    std::vector<float2> table(static_cast<size_t>(n_ctx) * hd / 2);
    for (int i = 0; i < hd / 2; ++i)
      for (int p = 0; p < n_ctx; ++p) {
        const double th = p * std::pow(static_cast<double>(base), -2.0 * i / hd);
        table[static_cast<size_t>(p) * hd / 2 + i] =
            make_float2(static_cast<float>(std::cos(th)), static_cast<float>(std::sin(th)));
      }
    DevBuf<float2> dtab(table);
    // NeoX RoPE pairs (i, i + hd/2) with Q/K/V biases (Qwen 2's layer), or the plain interleaved layer; rows of each
    // type the fused kernel reads, plus Qwen 2's real ones (Q5_0 q/k, Q8_0 v).
    struct Variant {
      bool neox, bias;
    };
    for (const Variant var : {Variant{false, false}, Variant{true, true}})
    for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0}) {
      if (t == GgmlType::Q5_0 && !var.neox) continue;
      for (int pos : {0, 1, 77, n_ctx - 1}) {
        SCOPED_TRACE("head_dim " + std::to_string(hd) + (var.neox ? " neox+bias " : " interleaved ") + type_name(t) +
                     " pos " + std::to_string(pos));
        auto wq = random_matrix(t, q_dim, d, 0.04f), wk = random_matrix(t, kv_dim, d, 0.04f),
             wv = random_matrix(t, kv_dim, d, 0.04f);
        GpuMatrix g = to_gpu({&wq->view, &wk->view, &wv->view});
        const std::vector<float> x = random_vec(d, -3.f, 3.f), nw = random_vec(d, 0.5f, 1.5f);
        DevBuf<float> dx(x), dnw(nw), dq(q_dim);
        DevCache dk(static_cast<size_t>(n_ctx) * kv_dim), dv(static_cast<size_t>(n_ctx) * kv_dim);
        DevBuf<DecodeIO> io(std::vector<DecodeIO>{{5, pos}});
        dq.poison();
        dk.poison();
        dv.poison();
        QkvTargets tg = qkv_targets(dtab, io, q_dim, kv_dim, hd, dq, dk, dv);
        const std::vector<float> bias = random_vec(q_dim + 2 * kv_dim, -0.5f, 0.5f);
        DevBuf<float> dbias(bias);
        tg.bias = var.bias ? dbias.p : nullptr;
        tg.neox = var.neox;
        launch_norm_matvec_qkv(g.m, dx.p, dnw.p, kEps, tg, nullptr);

        const std::vector<float> h = ref_rmsnorm(x, nw, kEps);
        std::vector<float> q = ref_matvec(wq->view, h), k = ref_matvec(wk->view, h), v = ref_matvec(wv->view, h);
        if (var.bias) {
          for (int i = 0; i < q_dim; ++i) q[i] += bias[i];
          for (int i = 0; i < kv_dim; ++i) k[i] += bias[q_dim + i], v[i] += bias[q_dim + kv_dim + i];
        }
        if (var.neox) {  // pair i of each head: (i, i + hd/2), turned by the table's row
          for (auto [vec, heads] : {std::pair<float*, int>{q.data(), n_heads}, std::pair<float*, int>{k.data(), n_kv}})
            for (int hh = 0; hh < heads; ++hh)
              for (int i = 0; i < hd / 2; ++i) {
                float* a0 = vec + hh * hd + i;
                const float2 cs = table[static_cast<size_t>(pos) * hd / 2 + i];
                const float x0 = a0[0], x1 = a0[hd / 2];
                a0[0] = x0 * cs.x - x1 * cs.y;
                a0[hd / 2] = x0 * cs.y + x1 * cs.x;
              }
        } else {
          ref::rope(q.data(), n_heads, hd, pos, base);
          ref::rope(k.data(), n_kv, hd, pos, base);
        }
        EXPECT_LE(max_abs_diff(dq.download(), q), kTol) << "q";
        const std::vector<float> kc = dk.download_floats(), vc = dv.download_floats();
        std::vector<float> krow(kc.begin() + pos * kv_dim, kc.begin() + (pos + 1) * kv_dim);
        std::vector<float> vrow(vc.begin() + pos * kv_dim, vc.begin() + (pos + 1) * kv_dim);
        EXPECT_LE(max_kv_diff(krow, k), kTol) << "k cache row";
        EXPECT_LE(max_kv_diff(vrow, v), kTol) << "v cache row";
        size_t touched = 0;
        for (size_t i = 0; i < kc.size(); ++i) touched += !is_poison(kc[i]) + !is_poison(vc[i]);
        EXPECT_EQ(touched, 2u * kv_dim) << "only row pos of each cache is written";
      }
    }
  }
}

// Decode attention at positions that take one pass (n_pos <= kAttnSinglePassMax) and that split the context into
// every split count up to the capacity (incl. the switch-over and the last position of the context), for several
// split capacities, head groupings and query heads per block (one split capacity leaves a long chunk whose V rows
// only partly fit in shared memory). The output buffer is poisoned each time; the split done-counters must re-arm
// themselves. METALATTN_TEST_QUICK=1 (for the slow race checker) keeps SmolLM2's heads and a few cases.
TEST(CudaFused, DecodeAttentionSinglePassAndSplit) {
  REQUIRE_GPU();
  const bool quick = quick_mode();
  struct Shape {
    int n_heads, n_kv, hd, n_ctx;
  };
  // Head counts a block: group 3 (1, 3), 4 (1, 2, 4), 8 (1, 2, 4, 8) and 6 (6 runs the 3-head instantiation). The
  // group of 8 has a context of 4,096: one split of 8,192 positions for 8 heads is more scores than shared memory
  // holds (the launcher refuses it, below).
  const std::vector<Shape> shapes =
      quick ? std::vector<Shape>{{9, 3, 64, 8192}}
            : std::vector<Shape>{{9, 3, 64, 8192}, {8, 2, 128, 8192}, {8, 1, 32, 4096}, {12, 2, 96, 8192}};
  // Most splits first: their launches need the least shared memory, and a launch that needs the 48 KiB opt-in only
  // through its static shared memory must not ride on a limit an earlier, larger launch raised.
  const std::vector<int> split_caps = quick ? std::vector<int>{kMaxAttnSplits, 1} : std::vector<int>{kMaxAttnSplits, 7, 1};
  const std::vector<int> positions =
      quick ? std::vector<int>{2, 129, kAttnSinglePassMax + 1, 4097}
            : std::vector<int>{1, 2, 63, 64, 65, 129, kAttnSinglePassMax, kAttnSinglePassMax + 1, 1000, 2048, 4097,
                               8191, 8192};
  for (const Shape sh : shapes) {
    const int n_heads = sh.n_heads, n_kv = sh.n_kv, hd = sh.hd, q_dim = n_heads * hd, kv_dim = n_kv * hd;
    const int n_ctx = sh.n_ctx, group = n_heads / n_kv;
    const std::vector<float> kc = random_cache(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f);
    const std::vector<float> vc = random_cache(static_cast<size_t>(n_ctx) * kv_dim);
    DevCache dk(kc), dv(vc);
    DevBuf<float> out(q_dim);
    DevBuf<unsigned> counters(std::vector<unsigned>(n_heads, 0u));
    for (int heads_per_block = 0; heads_per_block <= group; ++heads_per_block) {
      if (heads_per_block > 0 && group % heads_per_block != 0) continue;
      for (int max_splits : split_caps) {
        AttnScratch p;
        p.max_splits = max_splits;
        DevBuf<float> po(static_cast<size_t>(n_heads) * max_splits * hd),
            pml(static_cast<size_t>(n_heads) * max_splits * 2);
        p.o = po.p;
        p.ml = pml.p;
        p.counters = counters.p;
        for (int n_pos : positions) {
          if (n_pos > n_ctx) continue;
          SCOPED_TRACE("heads " + std::to_string(n_heads) + "/" + std::to_string(n_kv) + " hd " + std::to_string(hd) +
                       " heads per block " + std::to_string(heads_per_block) + " max splits " +
                       std::to_string(max_splits) + " n_pos " + std::to_string(n_pos) + " splits " +
                       std::to_string(attn_splits(n_pos, max_splits)));
          const std::vector<float> q = random_vec(q_dim, -1.5f, 1.5f);
          DevBuf<float> dq(q);
          DevBuf<DecodeIO> io(std::vector<DecodeIO>{{0, n_pos - 1}});
          po.poison();
          pml.poison();
          out.poison();
          launch_attention_decode(dq.p, dk.p, dv.p, io.p, n_heads, n_kv, hd, n_ctx, p, out.p, nullptr,
                                  heads_per_block);
          std::vector<float> expect(q_dim);
          ref::attention(q.data(), kc.data(), vc.data(), n_heads, n_kv, hd, n_pos, expect.data());
          EXPECT_LE(max_abs_diff(out.download(), expect), kTol) << "attention output";
          EXPECT_EQ(counters.download(), std::vector<unsigned>(n_heads, 0u)) << "done-counters re-armed";
        }
      }
    }
    EXPECT_THROW(launch_attention_decode(out.p, dk.p, dv.p, nullptr, n_heads, n_kv, hd, n_ctx, AttnScratch{}, out.p,
                                         nullptr, group + 1),
                 EngineError)
        << "heads per block must divide the group";
    if (group == 8) {
      AttnScratch one_split;
      one_split.max_splits = 1;
      EXPECT_THROW(launch_attention_decode(out.p, dk.p, dv.p, nullptr, n_heads, n_kv, hd, 8192, one_split, out.p,
                                           nullptr, group),
                   EngineError)
          << "8 heads' scores of one 8,192-position split do not fit in shared memory";
    }
  }
  // The split rule itself: one pass up to kAttnSinglePassMax, then chunks of kAttnMinChunk up to the capacity.
  EXPECT_EQ(attn_splits(1, 32), 1);
  EXPECT_EQ(attn_splits(kAttnSinglePassMax, 32), 1);
  EXPECT_EQ(attn_splits(kAttnSinglePassMax + 1, 32), (kAttnSinglePassMax + kAttnMinChunk) / kAttnMinChunk);
  EXPECT_EQ(attn_splits(8192, 32), 32);
  for (int n_ctx : {1, 100, 256, 257, 2048, 8192, 100000})
    for (int n_pos = 1; n_pos <= n_ctx; n_pos += std::max(1, n_ctx / 97))
      ASSERT_LE(attn_chunk(n_pos, attn_splits(n_pos, attn_max_splits(n_ctx, 3, 132))),
                attn_chunk_cap(n_ctx, attn_max_splits(n_ctx, 3, 132)))
          << n_ctx << " " << n_pos;
}

// The split decode attention on tensor cores against the reference, for the groups the models use (SmolLM2 9/3,
// Qwen2.5 14/2, Llama 3.2 32/8, SmolLM2-1.7B 32/32) and every other instantiated group (15/3, 12/2, 8/4 and 8/1:
// groups past 4 need more than the first 256 threads' heads, a bug the first GPU run found), contexts and split capacities whose chunks fit its 256
// positions (one split up to 256 positions; 8 and 32 splits), positions around its 16-key tiles and the split
// boundaries; partials poisoned first, done-counters re-armed after. Contexts whose chunks do not fit are refused.
TEST(CudaFused, DecodeAttentionTensorCoresSplit) {
  REQUIRE_GPU();
  const bool quick = quick_mode();
  struct Shape {
    int n_heads, n_kv;
  };
  struct Ctx {
    int n_ctx, max_splits;
  };
  const int hd = 64;
  const std::vector<Shape> shapes = quick ? std::vector<Shape>{{9, 3}}
                                          : std::vector<Shape>{{9, 3}, {14, 2}, {32, 8}, {32, 32}, {15, 3},
                                                               {12, 2}, {8, 4}, {8, 1}};
  const std::vector<Ctx> ctxs = quick ? std::vector<Ctx>{{8192, 32}} : std::vector<Ctx>{{200, 1}, {2048, 8}, {8192, 32}};
  const std::vector<int> positions = {1, 2, 15, 16, 17, 63, 64, 65, 129, 200, 256, 257, 1000, 2048, 4097, 8191, 8192};
  for (const Shape sh : shapes) {
    const int n_heads = sh.n_heads, n_kv = sh.n_kv, q_dim = n_heads * hd, kv_dim = n_kv * hd;
    for (const Ctx cx : ctxs) {
      ASSERT_TRUE(tc_decode_attention_fits(n_heads, n_kv, hd, cx.n_ctx, cx.max_splits));
      const std::vector<float> kc = random_cache(static_cast<size_t>(cx.n_ctx) * kv_dim, -2.f, 2.f);
      const std::vector<float> vc = random_cache(static_cast<size_t>(cx.n_ctx) * kv_dim);
      DevCache dk(kc), dv(vc);
      DevBuf<float> out(q_dim);
      DevBuf<unsigned> counters(std::vector<unsigned>(n_heads, 0u));
      AttnScratch p;
      p.max_splits = cx.max_splits;
      DevBuf<float> po(static_cast<size_t>(n_heads) * cx.max_splits * hd), pml(static_cast<size_t>(n_heads) * cx.max_splits * 2);
      p.o = po.p;
      p.ml = pml.p;
      p.counters = counters.p;
      for (int n_pos : positions) {
        if (n_pos > cx.n_ctx) continue;
        SCOPED_TRACE("heads " + std::to_string(n_heads) + "/" + std::to_string(n_kv) + " n_ctx " +
                     std::to_string(cx.n_ctx) + " max splits " + std::to_string(cx.max_splits) + " n_pos " +
                     std::to_string(n_pos) + " splits " + std::to_string(attn_splits(n_pos, cx.max_splits)));
        const std::vector<float> q = random_vec(q_dim, -1.5f, 1.5f);
        DevBuf<float> dq(q);
        DevBuf<DecodeIO> io(std::vector<DecodeIO>{{0, n_pos - 1}});
        po.poison();
        pml.poison();
        out.poison();
        launch_attention_decode_tc(dq.p, dk.p, dv.p, io.p, n_heads, n_kv, hd, cx.n_ctx, p, out.p, nullptr);
        std::vector<float> expect(q_dim);
        ref::attention(q.data(), kc.data(), vc.data(), n_heads, n_kv, hd, n_pos, expect.data());
        EXPECT_LE(max_abs_diff(out.download(), expect), kTol) << "attention output";
        EXPECT_EQ(counters.download(), std::vector<unsigned>(n_heads, 0u)) << "done-counters re-armed";
      }
    }
  }
  EXPECT_FALSE(tc_decode_attention_fits(9, 3, 64, 32768, kMaxAttnSplits)) << "chunks of 1,024 positions";
  EXPECT_FALSE(tc_decode_attention_fits(9, 3, 128, 8192, kMaxAttnSplits)) << "head_dim 128";
  EXPECT_FALSE(tc_decode_attention_fits(16, 1, 64, 8192, kMaxAttnSplits)) << "16 query heads per KV head";
  AttnScratch none;
  none.max_splits = kMaxAttnSplits;
  DevBuf<float> o(9 * 64);
  EXPECT_THROW(launch_attention_decode_tc(o.p, nullptr, nullptr, nullptr, 9, 3, 64, 32768, none, o.p, nullptr),
               EngineError);
}

// The short-context decode attention (head_dim 64, every K/V row in shared memory) against the reference at every
// position of its range, for SmolLM2's 9/3 heads and a 4/4 (no GQA) layout, a cache filled with random rows.
TEST(CudaFused, DecodeAttentionShortContextEveryPosition) {
  REQUIRE_GPU();
  struct Shape {
    int n_heads, n_kv;
  };
  const int hd = 64;
  for (const Shape sh : {Shape{9, 3}, Shape{4, 4}}) {
    for (int cap : {kShortAttnMaxPos, 37}) {  // 37: a capacity that is not a multiple of 4
      const int q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd;
      const std::vector<float> kc = random_cache(static_cast<size_t>(cap) * kv_dim, -2.f, 2.f);
      const std::vector<float> vc = random_cache(static_cast<size_t>(cap) * kv_dim);
      DevCache dk(kc), dv(vc);
      DevBuf<float> out(q_dim);
      for (int n_pos = 1; n_pos <= cap; ++n_pos) {
        SCOPED_TRACE("heads " + std::to_string(sh.n_heads) + "/" + std::to_string(sh.n_kv) + " capacity " +
                     std::to_string(cap) + " n_pos " + std::to_string(n_pos));
        const std::vector<float> q = random_vec(q_dim, -1.5f, 1.5f);
        DevBuf<float> dq(q);
        DevBuf<DecodeIO> io(std::vector<DecodeIO>{{0, n_pos - 1}});
        out.poison();
        launch_attention_decode_short(dq.p, dk.p, dv.p, io.p, sh.n_heads, sh.n_kv, hd, cap, out.p, nullptr);
        std::vector<float> expect(q_dim);
        ref::attention(q.data(), kc.data(), vc.data(), sh.n_heads, sh.n_kv, hd, n_pos, expect.data());
        ASSERT_LE(max_abs_diff(out.download(), expect), kTol) << "attention output";
      }
    }
  }
  DevBuf<float> dummy(64);
  DevCache dummy_cache(64);
  EXPECT_THROW(launch_attention_decode_short(dummy.p, dummy_cache.p, dummy_cache.p, nullptr, 9, 3, 128, 256, dummy.p,
                                             nullptr),
               EngineError)
      << "head_dim 64 only";
  EXPECT_THROW(launch_attention_decode_short(dummy.p, dummy_cache.p, dummy_cache.p, nullptr, 9, 3, 64,
                                             kShortAttnMaxPos + 1, dummy.p, nullptr),
               EngineError)
      << "capacity beyond the single-pass range";
}

// Layer 0's QKV kernel gathers the embedding row itself: same q / cache rows as embed then norm+QKV, and the row
// lands in x for the residual stream.
TEST(CudaFused, EmbeddingFoldedIntoFirstQkv) {
  REQUIRE_GPU();
  const int d = 576, n_heads = 9, n_kv = 3, hd = 64, q_dim = n_heads * hd, kv_dim = n_kv * hd, n_ctx = 64;
  std::vector<float2> table(static_cast<size_t>(n_ctx) * hd / 2);
  for (auto& c : table) c = make_float2(uniform(-1.f, 1.f), uniform(-1.f, 1.f));
  DevBuf<float2> dtab(table);
  for (GgmlType et : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F16}) {
    SCOPED_TRACE(type_name(et));
    auto emb = random_matrix(et, 1000, d, 0.5f);
    auto wq = random_matrix(GgmlType::Q4_0, q_dim, d, 0.04f), wk = random_matrix(GgmlType::Q4_0, kv_dim, d, 0.04f),
         wv = random_matrix(GgmlType::Q4_0, kv_dim, d, 0.04f);
    GpuMatrix ge = to_gpu({&emb->view}), g = to_gpu({&wq->view, &wk->view, &wv->view});
    const int token = std::uniform_int_distribution<int>(0, 999)(rng()), pos = 37;
    const std::vector<float> nw = random_vec(d, 0.5f, 1.5f);
    DevBuf<float> dnw(nw), x(d), dq(q_dim);
    DevCache dk(static_cast<size_t>(n_ctx) * kv_dim), dv(static_cast<size_t>(n_ctx) * kv_dim);
    DevBuf<float> x2(d), dq2(q_dim);
    DevCache dk2(dk.n), dv2(dv.n);
    for (auto* b : {&x, &dq, &x2, &dq2}) b->poison();
    for (auto* b : {&dk, &dv, &dk2, &dv2}) b->poison();
    DevBuf<DecodeIO> io(std::vector<DecodeIO>{{token, pos}});
    QkvTargets tg = qkv_targets(dtab, io, q_dim, kv_dim, hd, dq, dk, dv);
    launch_embed_norm_matvec_qkv(ge.m, x.p, g.m, dnw.p, kEps, tg, nullptr);
    QkvTargets tg2 = tg;
    tg2.q_out = dq2.p;
    tg2.k_cache = dk2.p;
    tg2.v_cache = dv2.p;
    launch_embed(ge.m, io.p, x2.p, nullptr);
    launch_norm_matvec_qkv(g.m, x2.p, dnw.p, kEps, tg2, nullptr);
    std::vector<float> row(d);
    ref::dequantize_row(et, emb->view.row(token), row.data(), d);
    EXPECT_EQ(x.download(), row) << "embedding row in x";
    EXPECT_LE(max_abs_diff(dq.download(), dq2.download()), kTol) << "q";
    const std::vector<float> k1 = dk.download_floats(), k2 = dk2.download_floats(), v1 = dv.download_floats(),
                             v2 = dv2.download_floats();
    auto row_at = [&](const std::vector<float>& c) {
      return std::vector<float>(c.begin() + pos * kv_dim, c.begin() + (pos + 1) * kv_dim);
    };
    EXPECT_LE(max_kv_pair_diff(row_at(k1), row_at(k2)), kTol) << "k cache row";
    EXPECT_LE(max_kv_pair_diff(row_at(v1), row_at(v2)), kTol) << "v cache row";
    size_t touched = 0;
    for (size_t i = 0; i < k1.size(); ++i) touched += !is_poison(k1[i]) + !is_poison(v1[i]);
    EXPECT_EQ(touched, 2u * kv_dim) << "only row pos of each cache is written";
  }
}

// The FFN as decode runs it: norm + gate/up with silu(gate) * up in the same kernel (each block owns the same units
// of both halves), then down + residual over the finished activations. Checked stage by stage against the
// reference, at SmolLM2's widths and at an odd unit count (a block with fewer units than it has room for).
TEST(CudaFused, NormGateUpSiluThenDownResidual) {
  REQUIRE_GPU();
  const int d = 576;
  // d_ff 1501: the last block holds one unit; float types only (quantized rows come in 32-column blocks).
  const std::pair<GgmlType, int> cases[] = {{GgmlType::Q4_0, 1536}, {GgmlType::Q4_1, 1536}, {GgmlType::Q8_0, 1536},
                                            {GgmlType::F16, 1536},  {GgmlType::F32, 1536},  {GgmlType::F16, 1501},
                                            {GgmlType::F32, 1501}};
  for (const auto& [t, ff] : cases) {
    {
      SCOPED_TRACE(std::string(type_name(t)) + " d_ff " + std::to_string(ff));
      auto wg = random_matrix(t, ff, d, 0.05f), wu = random_matrix(t, ff, d, 0.05f), wd = random_matrix(t, d, ff, 0.03f);
      GpuMatrix gu = to_gpu({&wg->view, &wu->view}), gd = to_gpu({&wd->view});
      const std::vector<float> x = random_vec(d, -3.f, 3.f), nw = random_vec(d, 0.5f, 1.5f);
      DevBuf<float> dx(x), dnw(nw), dact(ff + 64);
      dact.poison();
      launch_norm_matvec_silu_glu(gu.m, dx.p, dnw.p, kEps, dact.p, nullptr);
      const std::vector<float> act_gpu = dact.download();

      const std::vector<float> h = ref_rmsnorm(x, nw, kEps);
      const std::vector<float> g = ref_matvec(wg->view, h), u = ref_matvec(wu->view, h);
      std::vector<float> a(ff);
      for (int i = 0; i < ff; ++i) a[i] = ref::silu(g[i]) * u[i];
      EXPECT_LE(max_abs_diff(std::vector<float>(act_gpu.begin(), act_gpu.begin() + ff), a), kTol) << "activations";
      for (int i = ff; i < ff + 64; ++i) EXPECT_TRUE(is_poison(act_gpu[i])) << "written past d_ff at " << i;

      launch_matvec_residual(gd.m, dact.p, dx.p, nullptr);
      std::vector<float> expect = ref_matvec(wd->view, a);
      for (int i = 0; i < d; ++i) expect[i] += x[i];
      EXPECT_LE(max_abs_diff(dx.download(), expect), kTol) << "down + residual";
    }
  }
}

// ------------------------------------------------------------------ embedding, dequant, argmax

TEST(CudaKernels, EmbeddingRowsAreExact) {
  REQUIRE_GPU();
  for (GgmlType t : kAllTypes) {
    auto e = random_matrix(t, 4096, 576, 0.5f);
    GpuMatrix g = to_gpu({&e->view});
    const int token = std::uniform_int_distribution<int>(0, 4095)(rng());
    DevBuf<DecodeIO> io(std::vector<DecodeIO>{{token, 3}});
    DevBuf<float> x(576);
    x.poison();
    launch_embed(g.m, io.p, x.p, nullptr);
    std::vector<float> expect(576);
    ref::dequantize_row(t, e->view.row(token), expect.data(), 576);
    EXPECT_EQ(x.download(), expect) << type_name(t);

    const std::vector<int32_t> toks = {token, 0, 4095, 17};
    DevBuf<int32_t> dt(toks);
    DevBuf<float> xs(4 * 576);
    xs.poison();
    launch_embed_rows(g.m, dt.p, 4, xs.p, nullptr);
    const std::vector<float> got = xs.download();
    for (int i = 0; i < 4; ++i) {
      ref::dequantize_row(t, e->view.row(toks[i]), expect.data(), 576);
      EXPECT_TRUE(std::equal(expect.begin(), expect.end(), got.begin() + i * 576)) << type_name(t) << " row " << i;
    }
  }
}

namespace {
ArgmaxResult gpu_argmax(const std::vector<float>& v, DecodeIO* io_after = nullptr) {
  DevBuf<float> dx(v);
  DevBuf<ArgmaxPartial> parts(kArgmaxMaxBlocks);
  DevBuf<unsigned> counter(std::vector<unsigned>{0u});
  DevBuf<ArgmaxResult> res(1), last(1);
  DevBuf<DecodeIO> io(std::vector<DecodeIO>{{-1, 41}});
  res.poison();
  last.poison();
  ArgmaxScratch sc{parts.p, counter.p, kArgmaxMaxBlocks, last.p};
  launch_argmax(dx.p, static_cast<int>(v.size()), sc, res.p, io.p, nullptr);
  const ArgmaxResult r = res.download()[0], l = last.download()[0];
  EXPECT_EQ(counter.download()[0], 0u) << "counter re-armed";
  EXPECT_TRUE(std::memcmp(&r, &l, sizeof r) == 0) << "the device copy (ArgmaxScratch::last) is the result";
  if (io_after != nullptr) *io_after = io.download()[0];
  return r;
}
}  // namespace

TEST(CudaKernels, ArgmaxMatchesReferenceOnEdgeCases) {
  REQUIRE_GPU();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> cases;
  cases.push_back(random_vec(49152, -30.f, 30.f));
  for (int n : {1, 2, 31, 33, 1000, 1025, 70000, 3000000}) cases.push_back(random_vec(n, -5.f, 5.f));
  {
    std::vector<float> v = random_vec(49152);
    for (int i = 0; i < 49152; i += 3) v[i] = nan;
    cases.push_back(v);
  }
  {
    std::vector<float> v = random_vec(49152);
    v[40000] = 7.f;
    v[123] = 7.f;
    v[30000] = 7.f;  // ties: lowest index wins
    cases.push_back(v);
  }
  {
    std::vector<float> v = random_vec(49152);
    v[9] = nan;
    v[48000] = inf;
    v[48001] = inf;
    v[100] = 1e30f;
    cases.push_back(v);
  }
  cases.push_back(std::vector<float>(49152, -inf));
  {
    std::vector<float> v(49152, -inf);
    for (int i = 0; i < 100; ++i) v[i] = nan;
    cases.push_back(v);  // first -inf after NaNs
  }
  {
    std::vector<float> v(5000, nan);
    v[4999] = -3.f;
    cases.push_back(v);
  }
  for (size_t c = 0; c < cases.size(); ++c) {
    DecodeIO io{};
    const ArgmaxResult got = gpu_argmax(cases[c], &io);
    const ArgmaxResult want = ref::argmax(cases[c].data(), static_cast<int>(cases[c].size()));
    EXPECT_EQ(got.token, want.token) << "case " << c;
    EXPECT_EQ(std::memcmp(&got.value, &want.value, 4), 0) << "case " << c;
    EXPECT_EQ(io.token, static_cast<int32_t>(want.token)) << "case " << c;
    EXPECT_EQ(io.pos, 42) << "case " << c;
  }
  const ArgmaxResult none = gpu_argmax(std::vector<float>(49152, nan));
  EXPECT_EQ(none.token, kNoIndex);
  EXPECT_TRUE(std::isnan(none.value));
}

// Every lane geometry of the lm_head kernel (lm_head_geometry): Q8_0 rows of 16 blocks (8 lanes x 3), 18 (the
// SmolLM2-135M's), 28 (Qwen2.5-0.5B's: 16 lanes x 2), 48 (16 x 3), 64 (SmolLM2-1.7B's: 32 x 2) and 128 (32 x 3 and
// a block more after the dots begin), and Q4_0 / F16.
TEST(CudaFused, FinalNormLmHeadArgmax) {
  REQUIRE_GPU();
  struct Case {
    GgmlType t;
    int vocab, d;
  };
  for (const Case c : {Case{GgmlType::Q8_0, 49152, 576}, Case{GgmlType::Q4_0, 49152, 576},
                       Case{GgmlType::F16, 49152, 576}, Case{GgmlType::Q8_0, 151936, 896},
                       Case{GgmlType::Q8_0, 49152, 2048}, Case{GgmlType::Q8_0, 8192, 512},
                       Case{GgmlType::Q8_0, 8192, 1536}, Case{GgmlType::Q8_0, 4096, 4096}}) {
    SCOPED_TRACE(std::string(type_name(c.t)) + " " + std::to_string(c.vocab) + "x" + std::to_string(c.d));
    auto w = random_matrix(c.t, c.vocab, c.d, 1.f / std::sqrt(static_cast<float>(c.d)));
    GpuMatrix g = to_gpu({&w->view});
    DevBuf<ArgmaxPartial> parts(argmax_partials_needed(g.m));
    DevBuf<unsigned> counter(std::vector<unsigned>{0u});
    DevBuf<ArgmaxResult> res(1);
    DevBuf<DecodeIO> io(std::vector<DecodeIO>{{3, 9}});
    ArgmaxScratch sc{parts.p, counter.p, static_cast<int>(parts.n)};
    for (int rep = 0; rep < 2; ++rep) {  // twice: the done-counter must re-arm itself
      const std::vector<float> x = random_vec(c.d, -3.f, 3.f), nw = random_vec(c.d, 0.5f, 1.5f);
      DevBuf<float> dx(x), dnw(nw), logits(c.vocab);
      logits.poison();
      res.poison();
      launch_norm_matvec_argmax(g.m, dx.p, dnw.p, kEps, logits.p, sc, res.p, io.p, nullptr);
      const std::vector<float> got = logits.download();
      EXPECT_LE(max_abs_diff(got, ref_matvec(w->view, ref_rmsnorm(x, nw, kEps))), kTol);
      const ArgmaxResult want = ref::argmax(got.data(), c.vocab);
      const ArgmaxResult r = res.download()[0];
      EXPECT_EQ(r.token, want.token);
      EXPECT_EQ(r.value, want.value);
      const DecodeIO after = io.download()[0];
      EXPECT_EQ(after.token, static_cast<int32_t>(want.token));
      EXPECT_EQ(after.pos, 10 + rep);
    }
  }
}
