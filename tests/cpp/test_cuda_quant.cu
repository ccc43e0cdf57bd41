// The quant types of real Q4_K_M files (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, mixed stacks) in the decode
// matvecs, the prompt projections and whole models, against the scalar CPU reference.
#include "arch.cuh"
#include "cuda_test_util.h"

// ------------------------------------------------------------------ the quant types of real Q4_K_M files
// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K in their own GPU layouts; Q2_K, Q3_K and mixed stacks as kWide8 (kernels.cuh,
// DevMatrix). Every check compares with the scalar CPU reference (ref::dequantize_row / ref::dot_row); failure
// messages name the GGUF type, the GPU layout it was packed into and the shape.

namespace {

const GgmlType kNewTypes[] = {GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4_K, GgmlType::Q5_K,
                              GgmlType::Q6_K, GgmlType::Q3_K, GgmlType::Q2_K};

// rows x cols of the real models' matrices. The 32-weight types: SmolLM2 (576 / 1536), Gemma 3 270M (640 / 2048),
// Qwen2.5-0.5B (896 / 4864: its down projection takes the two-warps-per-row path), 960 and 2048 wide rows, and a
// ragged row count. K-quants only where the row length is a multiple of 256: Llama 3.2 1B (2048 / 8192),
// Qwen2.5-1.5B (1536 / 8960), Qwen2.5-0.5B's down projection (4864).
std::vector<Shape> quant_shapes(GgmlType t) {
  if (is_k_quant(t))
    return {{3072, 2048}, {2048, 2048}, {128, 2048}, {1536, 1536}, {256, 1536}, {896, 4864}, {4864, 1536},
            {2048, 8192}, {1536, 8960}, {640, 1024}, {640, 2048}, {99, 2048}};  // {640, *}: Gemma 3 270M's O, down
  return {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {640, 640}, {2048, 640}, {1152, 896},
          {4864, 896}, {896, 4864}, {128, 960}, {2048, 2048}, {99, 2080}};
}

std::string layout_trace(const std::vector<GgmlType>& parts, const GpuMatrix& g, int rows, int cols) {
  std::string s;
  for (GgmlType t : parts) s += std::string(s.empty() ? "" : "+") + type_name(t);
  return s + " as GPU " + gpu_type_name(g.m.type) + ", " + std::to_string(rows) + "x" + std::to_string(cols);
}

// The reference's rows of several stacked parts, concatenated.
std::vector<float> ref_stack_matvec(const std::vector<const WeightView*>& parts, const std::vector<float>& x) {
  std::vector<float> y;
  for (const WeightView* p : parts) {
    const std::vector<float> part = ref_matvec(*p, x);
    y.insert(y.end(), part.begin(), part.end());
  }
  return y;
}
std::vector<float> ref_stack_row(const std::vector<const WeightView*>& parts, int64_t r) {
  for (const WeightView* p : parts) {
    if (r < p->rows) {
      std::vector<float> row(p->cols);
      ref::dequantize_row(p->type, p->row(r), row.data(), p->cols);
      return row;
    }
    r -= p->rows;
  }
  return {};
}

// Index and values of the first difference of two float vectors (bitwise; -0 and +0 differ), for messages.
std::string first_bit_difference(const std::vector<float>& got, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &want[i], 4);
    if (a != b) return "first at " + std::to_string(i) + ": GPU " + std::to_string(got[i]) + " reference " + std::to_string(want[i]);
  }
  return "none";
}

}  // namespace

TEST(CudaQuant, CommonExactTypeOfMixedStacks) {
  // No GPU needed: the type choice is host code.
  struct Case {
    std::vector<GgmlType> parts;
    GgmlType want;
  };
  const Case cases[] = {
      {{GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q8_0}, GgmlType::Q8_0},  // SmolLM2 / Qwen2.5 Q4_K_M QKV
      {{GgmlType::Q4_0, GgmlType::Q5_0}, GgmlType::Q8_0},
      {{GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K}, kWide8},          // Llama 3.2 Q4_K_M QKV
      {{GgmlType::Q5_K, GgmlType::Q6_K}, kWide8},
      {{GgmlType::Q5_1, GgmlType::Q8_0}, kWide8},
      {{GgmlType::Q4_K, GgmlType::Q8_0}, kWide8},
      {{GgmlType::Q4_K, GgmlType::F16}, GgmlType::F32},
      {{GgmlType::Q4_K, GgmlType::Q4_K}, GgmlType::Q4_K},
      {{GgmlType::Q5_0}, GgmlType::Q5_0},
      {{GgmlType::Q5_1}, GgmlType::Q5_1},
      {{GgmlType::Q5_K}, GgmlType::Q5_K},
      {{GgmlType::Q6_K, GgmlType::Q6_K}, GgmlType::Q6_K},
      {{GgmlType::Q3_K}, kWide8},
      {{GgmlType::Q2_K, GgmlType::Q2_K}, kWide8},
  };
  for (const Case& c : cases) {
    std::vector<WeightView> views(c.parts.size());
    std::vector<const WeightView*> ptrs;
    std::string name;
    for (size_t i = 0; i < c.parts.size(); ++i) {
      views[i].type = c.parts[i];
      views[i].rows = 1;
      views[i].cols = 256;
      ptrs.push_back(&views[i]);
      name += std::string(i ? "+" : "") + type_name(c.parts[i]);
    }
    EXPECT_EQ(gpu_type_name(common_exact_type(ptrs)), std::string(gpu_type_name(c.want))) << name;
  }
  // GPU bytes per 32 weights (kernels.cuh): the file's for all but Q6_K (+1.75 B) and kWide8.
  EXPECT_EQ(gpu_block_bytes(GgmlType::Q5_0), 22);
  EXPECT_EQ(gpu_block_bytes(GgmlType::Q5_1), 24);
  EXPECT_EQ(gpu_block_bytes(GgmlType::Q4_K), 18);
  EXPECT_EQ(gpu_block_bytes(GgmlType::Q5_K), 22);
  EXPECT_EQ(gpu_block_bytes(GgmlType::Q6_K), 28);
  EXPECT_EQ(gpu_block_bytes(kWide8), 48);
}

// Plain matvec, norm + matvec and matvec + residual (the O / down projections' kernel, both its one-warp and
// two-warp-per-row variants) for each new type at the real models' shapes.
TEST(CudaQuant, MatvecNormAndResidualAtRealShapes) {
  REQUIRE_GPU();
  for (GgmlType t : kNewTypes) {
    for (Shape s : quant_shapes(t)) {
      auto hm = random_matrix(t, s.rows, s.cols, 1.f / std::sqrt(static_cast<float>(s.cols)));
      GpuMatrix g = to_gpu({&hm->view});
      SCOPED_TRACE(layout_trace({t}, g, s.rows, s.cols));
      check_decode_matvecs(*hm, g, s.rows, s.cols);
    }
  }
}

// Stacks of mixed types (the backend's QKV and gate/up) in the type common_exact_type picks: every row decodes bit
// for bit as the reference (through the embedding kernels, which write the decoded floats), and the matvecs agree.
TEST(CudaQuant, MixedStacksDecodeExactlyAndMultiply) {
  REQUIRE_GPU();
  struct Case {
    std::vector<GgmlType> parts;
    int cols;
  };
  const Case cases[] = {
      {{GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q8_0}, 576},
      {{GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0}, 896},
      {{GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K}, 2048},
      {{GgmlType::Q5_K, GgmlType::Q5_K, GgmlType::Q6_K}, 1536},
      {{GgmlType::Q5_1, GgmlType::Q8_0}, 640},
      {{GgmlType::Q4_1, GgmlType::Q5_0}, 576},
      {{GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q5_0}, 2048},
      {{GgmlType::Q3_K, GgmlType::Q2_K}, 1536},
      {{GgmlType::Q4_K, GgmlType::F16}, 512},
  };
  for (const Case& c : cases) {
    std::vector<std::unique_ptr<HostMatrix>> mats;
    std::vector<const WeightView*> parts;
    int rows = 0;
    for (size_t i = 0; i < c.parts.size(); ++i) {
      const int r = i == 0 ? 96 : 32 + 16 * static_cast<int>(i);
      mats.push_back(random_matrix(c.parts[i], r, c.cols, 1.f / std::sqrt(static_cast<float>(c.cols))));
      parts.push_back(&mats.back()->view);
      rows += r;
    }
    GpuMatrix g = to_gpu(parts);
    SCOPED_TRACE(layout_trace(c.parts, g, rows, c.cols));
    std::vector<int32_t> toks(rows);
    for (int r = 0; r < rows; ++r) toks[r] = r;
    DevBuf<int32_t> dt(toks);
    DevBuf<float> xs(static_cast<size_t>(rows) * c.cols);
    xs.poison();
    launch_embed_rows(g.m, dt.p, rows, xs.p, nullptr);
    const std::vector<float> got = xs.download();
    int bad_rows = 0;
    for (int r = 0; r < rows; ++r) {
      const std::vector<float> want = ref_stack_row(parts, r);
      const std::vector<float> row(got.begin() + static_cast<size_t>(r) * c.cols, got.begin() + static_cast<size_t>(r + 1) * c.cols);
      if (row != want && bad_rows++ < 3)
        ADD_FAILURE() << "row " << r << " differs from ref::dequantize_row: " << first_bit_difference(row, want);
    }
    EXPECT_EQ(bad_rows, 0) << "rows not decoded bit for bit";

    const std::vector<float> x = random_vec(c.cols, -2.f, 2.f), nw = random_vec(c.cols, 0.5f, 1.5f);
    DevBuf<float> dx(x), dnw(nw), dy(rows);
    dy.poison();
    launch_norm_matvec(g.m, dx.p, dnw.p, kEps, dy.p, nullptr);
    EXPECT_LE(max_abs_diff(dy.download(), ref_stack_matvec(parts, ref_rmsnorm(x, nw, kEps))), kTol) << "norm+matvec";
  }
}

// Each new type's rows decode bit for bit as ref::dequantize_row (embedding gather: one row by DecodeIO, many by
// token list).
TEST(CudaQuant, EmbeddingRowsMatchReference) {
  REQUIRE_GPU();
  for (GgmlType t : kNewTypes) {
    const int rows = 200, cols = is_k_quant(t) ? 1536 : 896;
    auto w = random_matrix(t, rows, cols, 0.5f);
    GpuMatrix g = to_gpu({&w->view});
    SCOPED_TRACE(layout_trace({t}, g, rows, cols));
    std::vector<std::vector<float>> ref_rows(rows, std::vector<float>(cols));
    for (int r = 0; r < rows; ++r) ref::dequantize_row(t, w->view.row(r), ref_rows[r].data(), cols);

    // Embedding rows.
    {
      const int token = std::uniform_int_distribution<int>(0, rows - 1)(rng());
      DevBuf<DecodeIO> io(std::vector<DecodeIO>{{token, 3}});
      DevBuf<float> x(cols);
      x.poison();
      launch_embed(g.m, io.p, x.p, nullptr);
      const std::vector<float> got = x.download();
      EXPECT_EQ(got, ref_rows[token]) << "embedding row " << token << ": " << first_bit_difference(got, ref_rows[token]);
      std::vector<int32_t> toks(rows);
      for (int r = 0; r < rows; ++r) toks[r] = rows - 1 - r;
      DevBuf<int32_t> dt(toks);
      DevBuf<float> xs(static_cast<size_t>(rows) * cols);
      xs.poison();
      launch_embed_rows(g.m, dt.p, rows, xs.p, nullptr);
      const std::vector<float> all = xs.download();
      int bad = 0;
      for (int i = 0; i < rows; ++i) {
        const std::vector<float> row(all.begin() + static_cast<size_t>(i) * cols, all.begin() + static_cast<size_t>(i + 1) * cols);
        if (row != ref_rows[toks[i]] && bad++ < 3)
          ADD_FAILURE() << "embedding rows: token " << toks[i] << " " << first_bit_difference(row, ref_rows[toks[i]]);
      }
      EXPECT_EQ(bad, 0) << "embedding rows not bit for bit";
    }
  }
}

// The fused decode kernels the backend runs on these types, at the real models' shapes and type mixes:
// norm + QKV (RoPE, K/V cache append), the same with the embedding gathered in (layer 0), norm + gate/up + SiLU then
// down + residual, and the final norm + lm_head + argmax.
TEST(CudaQuant, FusedQkvFfnAndLmHeadAtRealShapes) {
  REQUIRE_GPU();
  const int hd = 64, n_ctx = 64, pos = 37;
  const float base = 100000.f;
  const std::vector<float2> table = rope_table(n_ctx, hd);
  DevBuf<float2> dtab(table);
  struct QkvCase {
    GgmlType q, k, v, embd;
    int d, n_heads, n_kv;
  };
  const QkvCase qkv_cases[] = {
      {GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q8_0, 576, 9, 3},   // SmolLM2-135M Q4_K_M
      {GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q5_0, 896, 14, 2},  // Qwen2.5-0.5B
      {GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q6_K, 2048, 32, 8}, // Llama 3.2 1B
      {GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q4_K, 1536, 24, 4},
      {GgmlType::Q5_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_K, 2048, 32, 8},
      {GgmlType::Q6_K, GgmlType::Q6_K, GgmlType::Q6_K, GgmlType::Q3_K, 1536, 24, 4},
      {GgmlType::Q5_1, GgmlType::Q5_1, GgmlType::Q5_1, GgmlType::Q5_1, 640, 10, 2},
      // SmolLM2-1.7B (6144 rows: more row groups than the GPU holds blocks at once)
      {GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0, 2048, 32, 32},
  };
  for (const QkvCase& c : qkv_cases) {
    const int q_dim = c.n_heads * hd, kv_dim = c.n_kv * hd;
    auto wq = random_matrix(c.q, q_dim, c.d, 2.f / std::sqrt(static_cast<float>(c.d)));
    auto wk = random_matrix(c.k, kv_dim, c.d, 2.f / std::sqrt(static_cast<float>(c.d)));
    auto wv = random_matrix(c.v, kv_dim, c.d, 1.f / std::sqrt(static_cast<float>(c.d)));
    auto emb = random_matrix(c.embd, 300, c.d, 1.f);
    GpuMatrix g = to_gpu({&wq->view, &wk->view, &wv->view}), ge = to_gpu({&emb->view});
    SCOPED_TRACE("QKV " + layout_trace({c.q, c.k, c.v}, g, q_dim + 2 * kv_dim, c.d) + ", embedding " +
                 gpu_type_name(ge.m.type));
    const int token = std::uniform_int_distribution<int>(0, 299)(rng());
    const std::vector<float> x_in = random_vec(c.d, -3.f, 3.f), nw = random_vec(c.d, 0.5f, 1.5f);
    for (bool embed : {false, true}) {
      SCOPED_TRACE(embed ? "embedding folded in" : "x given");
      std::vector<float> x = x_in;
      if (embed) ref::dequantize_row(c.embd, emb->view.row(token), x.data(), c.d);
      DevBuf<float> dx(x_in), dnw(nw), dq(q_dim);
      DevCache dk(static_cast<size_t>(n_ctx) * kv_dim), dv(dk.n);
      DevBuf<DecodeIO> io(std::vector<DecodeIO>{{token, pos}});
      dq.poison();
      dk.poison();
      dv.poison();
      if (embed) dx.poison();
      QkvTargets tg = qkv_targets(dtab, io, q_dim, kv_dim, hd, dq, dk, dv);
      if (embed) launch_embed_norm_matvec_qkv(ge.m, dx.p, g.m, dnw.p, kEps, tg, nullptr);
      else launch_norm_matvec_qkv(g.m, dx.p, dnw.p, kEps, tg, nullptr);
      if (embed) EXPECT_EQ(dx.download(), x) << "embedding row written to x";
      const std::vector<float> h = ref_rmsnorm(x, nw, kEps);
      std::vector<float> q = ref_matvec(wq->view, h), k = ref_matvec(wk->view, h), v = ref_matvec(wv->view, h);
      ref::rope(q.data(), c.n_heads, hd, pos, base);
      ref::rope(k.data(), c.n_kv, hd, pos, base);
      EXPECT_LE(max_abs_diff(dq.download(), q), kTol) << "q";
      const std::vector<float> kc = dk.download_floats(), vc = dv.download_floats();
      EXPECT_LE(max_kv_diff(std::vector<float>(kc.begin() + pos * kv_dim, kc.begin() + (pos + 1) * kv_dim), k), kTol)
          << "k cache row";
      EXPECT_LE(max_kv_diff(std::vector<float>(vc.begin() + pos * kv_dim, vc.begin() + (pos + 1) * kv_dim), v), kTol)
          << "v cache row";
      size_t touched = 0;
      for (size_t i = 0; i < kc.size(); ++i) touched += !is_poison(kc[i]) + !is_poison(vc[i]);
      EXPECT_EQ(touched, 2u * kv_dim) << "only row pos of each cache is written";
    }
  }

  struct FfnCase {
    GgmlType gate, up, down;
    int d, d_ff;
  };
  const FfnCase ffn_cases[] = {
      {GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q4_K, 576, 1536},   // SmolLM2-135M Q4_K_M
      {GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q6_K, 576, 1536},
      {GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q8_0, 896, 4864},   // Qwen2.5-0.5B (gate/up: one wave at 5 blocks a SM)
      {GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q6_K, 896, 4864},   // ... its down projections: 3 blocks a lane
      {GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q4_K, 896, 4864},
      {GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K, 2048, 8192},  // Llama 3.2 1B
      {GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q4_K, 1536, 8960},  // Qwen2.5-1.5B
      {GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_K, 2048, 1536},  // mixed gate/up: kWide8
      {GgmlType::Q5_1, GgmlType::Q5_1, GgmlType::Q5_1, 640, 2048},
      {GgmlType::Q2_K, GgmlType::Q2_K, GgmlType::Q3_K, 1536, 4864},
      {GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q4_0, 2048, 8192},  // SmolLM2-1.7B
  };
  for (const FfnCase& c : ffn_cases) {
    const float sd = 1.f / std::sqrt(static_cast<float>(c.d)), sf = 1.f / std::sqrt(static_cast<float>(c.d_ff));
    auto wg = random_matrix(c.gate, c.d_ff, c.d, sd), wu = random_matrix(c.up, c.d_ff, c.d, sd),
         wd = random_matrix(c.down, c.d, c.d_ff, sf);
    GpuMatrix gu = to_gpu({&wg->view, &wu->view}), gd = to_gpu({&wd->view});
    SCOPED_TRACE("gate/up " + layout_trace({c.gate, c.up}, gu, 2 * c.d_ff, c.d) + ", down " +
                 layout_trace({c.down}, gd, c.d, c.d_ff));
    const std::vector<float> x = random_vec(c.d, -3.f, 3.f), nw = random_vec(c.d, 0.5f, 1.5f);
    DevBuf<float> dx(x), dnw(nw), dact(c.d_ff + 64);
    dact.poison();
    launch_norm_matvec_silu_glu(gu.m, dx.p, dnw.p, kEps, dact.p, nullptr);
    const std::vector<float> act_gpu = dact.download();
    const std::vector<float> h = ref_rmsnorm(x, nw, kEps);
    const std::vector<float> gg = ref_matvec(wg->view, h), uu = ref_matvec(wu->view, h);
    std::vector<float> a(c.d_ff);
    for (int i = 0; i < c.d_ff; ++i) a[i] = ref::silu(gg[i]) * uu[i];
    EXPECT_LE(max_abs_diff(std::vector<float>(act_gpu.begin(), act_gpu.begin() + c.d_ff), a), kTol) << "silu(gate)*up";
    for (int i = c.d_ff; i < c.d_ff + 64; ++i) EXPECT_TRUE(is_poison(act_gpu[i])) << "written past d_ff at " << i;
    launch_matvec_residual(gd.m, dact.p, dx.p, nullptr);
    std::vector<float> expect = ref_matvec(wd->view, a);
    for (int i = 0; i < c.d; ++i) expect[i] += x[i];
    EXPECT_LE(max_abs_diff(dx.download(), expect), kTol) << "down + residual";
  }

  struct HeadCase {
    GgmlType t;
    int vocab, d;
  };
  const HeadCase head_cases[] = {{GgmlType::Q6_K, 32768, 2048},  // Llama 3.2's tied Q6_K embedding (fewer rows)
                                 {GgmlType::Q5_0, 49152, 576},
                                 {GgmlType::Q4_K, 16384, 1536},
                                 {GgmlType::Q5_K, 8192, 2048},
                                 {GgmlType::Q5_1, 8192, 896},
                                 {GgmlType::Q3_K, 8192, 1536}};
  for (const HeadCase& c : head_cases) {
    auto w = random_matrix(c.t, c.vocab, c.d, 1.f / std::sqrt(static_cast<float>(c.d)));
    GpuMatrix g = to_gpu({&w->view});
    SCOPED_TRACE("lm_head " + layout_trace({c.t}, g, c.vocab, c.d));
    DevBuf<ArgmaxPartial> parts(argmax_partials_needed(g.m));
    DevBuf<unsigned> counter(std::vector<unsigned>{0u});
    DevBuf<ArgmaxResult> res(1);
    DevBuf<DecodeIO> io(std::vector<DecodeIO>{{3, 9}});
    ArgmaxScratch sc{parts.p, counter.p, static_cast<int>(parts.n)};
    const std::vector<float> x = random_vec(c.d, -3.f, 3.f), nw = random_vec(c.d, 0.5f, 1.5f);
    DevBuf<float> dx(x), dnw(nw), logits(c.vocab);
    logits.poison();
    res.poison();
    launch_norm_matvec_argmax(g.m, dx.p, dnw.p, kEps, logits.p, sc, res.p, io.p, nullptr);
    const std::vector<float> got = logits.download();
    EXPECT_LE(max_abs_diff(got, ref_matvec(w->view, ref_rmsnorm(x, nw, kEps))), kTol) << "logits";
    const ArgmaxResult want = ref::argmax(got.data(), c.vocab);
    const ArgmaxResult r = res.download()[0];
    EXPECT_EQ(r.token, want.token) << "argmax";
    EXPECT_EQ(io.download()[0].pos, 10) << "io advanced";
  }
}

// The few-token prompt projections (prompt_mma.cu) on each new type and on mixed stacks (kWide8), every output kind,
// fp32 rmsnorm'ed input and slot input, at the real models' widths and every token-tile count.
namespace {

// The random stacked matrix of the projection tests: one part per type, rows / types.size() rows each, K columns,
// sigma 1 / sqrt(K).
struct RandomStack {
  std::vector<std::unique_ptr<HostMatrix>> mats;
  std::vector<const WeightView*> parts;
  RandomStack(const std::vector<GgmlType>& types, int rows, int K) {
    for (GgmlType t : types) {
      const int part_rows = rows / static_cast<int>(types.size());
      mats.push_back(random_matrix(t, part_rows, K, 1.f / std::sqrt(static_cast<float>(K))));
      parts.push_back(&mats.back()->view);
    }
  }
};

}  // namespace

TEST(CudaQuant, PromptMmaProjectionsAtRealShapes) {
  REQUIRE_GPU();
  struct Case {
    std::vector<GgmlType> parts;  // stacked (equal row counts)
    int rows, cols;               // of the stack (SiluHalf: gate and up, rows = 2 * d_ff)
    PromptMmaOut out;
    bool normed;
  };
  const Case cases[] = {
      {{GgmlType::Q5_0}, 960, 576, PromptMmaOut::Store, true},
      {{GgmlType::Q5_0}, 576, 576, PromptMmaOut::AddResidual, false},
      {{GgmlType::Q5_0, GgmlType::Q5_0}, 3072, 576, PromptMmaOut::SiluHalf, true},
      {{GgmlType::Q4_K}, 576, 1536, PromptMmaOut::AddResidual, false},
      {{GgmlType::Q6_K}, 576, 1536, PromptMmaOut::AddResidual, false},
      {{GgmlType::Q5_1}, 640, 640, PromptMmaOut::Store, true},
      {{GgmlType::Q5_K, GgmlType::Q5_K}, 2048, 512, PromptMmaOut::SiluHalf, true},
      {{GgmlType::Q4_K}, 1536, 1536, PromptMmaOut::Store, true},
      // K staged in chunks of 1536 columns (X of 32 tokens does not fit in shared memory): SmolLM2-1.7B's QKV, gate/up
      // and down widths, Qwen2.5's down width, and a last chunk of 4 blocks (fewer than the block's 8 warps).
      {{GgmlType::Q4_0}, 384, 2048, PromptMmaOut::Store, true},
      {{GgmlType::Q4_0, GgmlType::Q4_0}, 1024, 2048, PromptMmaOut::SiluHalf, true},
      {{GgmlType::Q4_0}, 256, 8192, PromptMmaOut::AddResidual, false},
      {{GgmlType::Q4_K}, 256, 2048, PromptMmaOut::Store, true},
      {{GgmlType::Q6_K}, 128, 4864, PromptMmaOut::AddResidual, false},
      {{GgmlType::Q4_1}, 160, 3200, PromptMmaOut::AddResidual, false},
      {{GgmlType::Q4_1}, 160, 3200, PromptMmaOut::Store, true},
      {{GgmlType::Q6_K}, 256, 1536, PromptMmaOut::Store, false},
      {{GgmlType::Q4_K, GgmlType::Q6_K}, 1024, 512, PromptMmaOut::Store, true},      // kWide8 (Llama 3.2 QKV mix)
      {{GgmlType::Q4_K, GgmlType::Q6_K}, 2048, 512, PromptMmaOut::SiluHalf, true},   // kWide8 gate/up
      {{GgmlType::Q3_K}, 512, 1536, PromptMmaOut::AddResidual, false},               // kWide8
      {{GgmlType::Q5_0, GgmlType::Q8_0}, 896, 896, PromptMmaOut::Store, true},      // widened to Q8_0
      // More row tiles than SMs, so several tiles a block (row_tiles_per_block; on a 132-SM GPU): Qwen2.5-0.5B's
      // gate/up (608 tiles: 5 a block, 3 warps a tile, one warp left over), SmolLM2-1.7B's QKV (384: 3 a block, 5
      // warps a tile) and gate/up (1,024: 8 a block, 2 warps a tile), and 2,000 tiles (16 a block, one warp a tile).
      {{GgmlType::Q5_0, GgmlType::Q5_0}, 9728, 896, PromptMmaOut::SiluHalf, true},
      {{GgmlType::Q4_0}, 6144, 2048, PromptMmaOut::Store, true},
      {{GgmlType::Q4_0, GgmlType::Q4_0}, 16384, 2048, PromptMmaOut::SiluHalf, true},
      {{GgmlType::Q8_0}, 32000, 576, PromptMmaOut::Store, true},
      // The same several-tiles-a-block geometry (a normed X converted once a block) for the types with a min or a
      // scale per 16: Llama 3.2 1B's gate/up (Q4_K, 1,024 tiles) and QKV widths (3,072 rows at Q6_K, 2 a block), and
      // Q4_1 at 160 tiles.
      {{GgmlType::Q4_K, GgmlType::Q4_K}, 16384, 2048, PromptMmaOut::SiluHalf, true},
      {{GgmlType::Q6_K}, 3072, 2048, PromptMmaOut::Store, true},
      {{GgmlType::Q4_1}, 2560, 576, PromptMmaOut::Store, true},
  };
  for (const Case& cs : cases) {
    const int K = cs.cols, d_ff = cs.out == PromptMmaOut::SiluHalf ? cs.rows / 2 : 0;
    const RandomStack stack(cs.parts, cs.rows, K);
    const std::vector<const WeightView*>& parts = stack.parts;
    GpuMatrix g = to_gpu(parts);
    if (!prompt_mma_supported(g.m.type, K, d_ff)) {
      ADD_FAILURE() << "prompt_mma_supported refuses " << layout_trace(cs.parts, g, cs.rows, K);
      continue;
    }
    for (int n : {1, 7, 9, 17, 32}) {
      SCOPED_TRACE(layout_trace(cs.parts, g, cs.rows, K) + " out " + std::to_string(static_cast<int>(cs.out)) +
                   (cs.normed ? " normed" : " slots") + " n " + std::to_string(n));
      check_prompt_mma(g.m, n, K, cs.rows, cs.normed, cs.out,
                       [&](const std::vector<float>& row) { return ref_stack_matvec(parts, row); });
    }
  }
}

// The long-prompt projections (prompt_gemm.cu) for every weight type the GPU holds, at the real models' shapes (rows
// cut where the full matrix adds nothing but time), for token counts across the 64-token tiles, storing and adding
// into y (projections of few tiles take two warp groups per block, K split between them, others one); against the
// scalar reference on the same operand values. Outputs start poisoned: rows of y past n must stay so.
TEST(CudaQuant, PromptGemmAtRealShapes) {
  REQUIRE_GPU();
  struct Case {
    std::vector<GgmlType> parts;  // stacked (equal row counts)
    int rows, cols;
  };
  const Case cases[] = {
      {{GgmlType::Q4_0}, 960, 576},                    // SmolLM2-135M QKV
      {{GgmlType::Q4_0, GgmlType::Q4_0}, 3072, 576},   // its gate/up
      {{GgmlType::Q4_0}, 576, 1536},                   // its down
      {{GgmlType::Q4_1}, 576, 576},                    // SmolLM2-135M-Instruct Q4_1 O
      {{GgmlType::Q8_0}, 200, 576},
      {{GgmlType::Q5_0, GgmlType::Q8_0}, 1152, 896},   // Qwen2.5-0.5B QKV (a Q8_0 v: widened to Q8_0)
      {{GgmlType::Q5_0, GgmlType::Q5_0}, 2432, 896},   // its gate/up, rows cut
      {{GgmlType::Q4_K}, 896, 4864},                   // its down, Q4_K and Q6_K layers
      {{GgmlType::Q6_K}, 896, 4864},
      {{GgmlType::Q5_0}, 1536, 640},                   // Gemma 3 270M QKV
      {{GgmlType::Q4_K}, 640, 1024},                   // its O
      {{GgmlType::Q6_K}, 640, 2048},                   // its down
      {{GgmlType::Q5_1}, 130, 640},
      {{GgmlType::Q5_K}, 256, 1536},
      {{GgmlType::Q4_K, GgmlType::Q6_K}, 1024, 512},   // kWide8 (Llama 3.2 QKV mix)
      {{GgmlType::Q3_K}, 512, 1536},                   // kWide8
      {{GgmlType::Q4_0}, 384, 2048},                   // SmolLM2-1.7B widths, rows cut
      {{GgmlType::Q4_0}, 256, 8192},
      {{GgmlType::F16}, 960, 576},                     // float weights
      {{GgmlType::BF16}, 576, 576},
      {{GgmlType::F32}, 576, 1536},
      {{GgmlType::Q4_0}, 70, 608},                     // 19 blocks (a last chunk of one block), 70 rows
      {{GgmlType::F32}, 33, 96},
  };
  for (const Case& cs : cases) {
    const int K = cs.cols;
    const RandomStack stack(cs.parts, cs.rows, K);
    const std::vector<const WeightView*>& parts = stack.parts;
    GpuMatrix g = to_gpu(parts);
    EXPECT_TRUE(prompt_gemm_supported(g.m.type)) << gpu_type_name(g.m.type);
    for (int n : {1, 64, 65, 200}) {
      SCOPED_TRACE(layout_trace(cs.parts, g, cs.rows, K) + " n " + std::to_string(n));
      std::vector<float> in;
      const SlotRows slots = make_slot_rows(random_vec(static_cast<size_t>(n) * K, -3.f, 3.f), n, K, &in);
      DevBuf<__half> dxs(slots.h);
      std::vector<std::vector<float>> want(n);
      for (int t = 0; t < n; ++t)
        want[t] = ref_stack_matvec(parts, std::vector<float>(in.begin() + static_cast<size_t>(t) * K,
                                                             in.begin() + static_cast<size_t>(t + 1) * K));
      for (bool add : {false, true}) {
        const std::vector<float> y0 = random_vec(static_cast<size_t>(n) * cs.rows);
        DevBuf<float> dy(static_cast<size_t>(n + 1) * cs.rows);
        dy.poison();
        if (add) CUDA_CHECK(cudaMemcpy(dy.p, y0.data(), y0.size() * 4, cudaMemcpyHostToDevice));
        PromptGemmArgs a;
        a.W = g.m;
        a.n = n;
        a.x_slots = dxs.p;
        a.y = dy.p;
        a.accumulate = add;
        launch_prompt_gemm(a, nullptr);
        expect_projection_rows(dy.download(), want, y0, n, cs.rows, add);
      }
    }
  }
}

// ------------------------------------------------------------------ whole backend on mixed-type models

namespace {

struct TypedModelCase {
  const char* name;
  int d, d_ff, n_heads, n_kv;
  GgmlType embd;
  LayerTypes (*types)(int l);
};

const TypedModelCase kTypedModels[] = {
    // Llama 3.2 / Qwen2.5-1.5B Q4_K_M: Q4_K everywhere, Q6_K v and down in some layers (mixed QKV -> kWide8), tied
    // Q6_K embedding and lm_head.
    {"llama-q4_k_m", 512, 1536, 8, 2, GgmlType::Q6_K,
     [](int l) {
       const GgmlType v = l % 2 == 0 ? GgmlType::Q6_K : GgmlType::Q4_K, dn = l != 1 ? GgmlType::Q6_K : GgmlType::Q4_K;
       return LayerTypes{GgmlType::Q4_K, GgmlType::Q4_K, v, GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q4_K, dn};
     }},
    // SmolLM2-135M Q4_K_M (rows of 576: K-quants fall back to Q5_0 / Q8_0 except the 1536-wide down projection).
    {"smollm2-q4_k_m", 576, 1536, 9, 3, GgmlType::Q8_0,
     [](int l) {
       const GgmlType v = l % 2 == 0 ? GgmlType::Q8_0 : GgmlType::Q5_0, dn = l % 2 == 0 ? GgmlType::Q6_K : GgmlType::Q4_K;
       return LayerTypes{GgmlType::Q5_0, GgmlType::Q5_0, v, GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q5_0, dn};
     }},
    // Q5_K_M-like with Q5_1 and a mixed gate/up.
    {"q5_k_m-mixed", 512, 1024, 8, 4, GgmlType::Q5_K,
     [](int l) {
       const GgmlType gate = l == 0 ? GgmlType::Q5_1 : GgmlType::Q5_K;
       return LayerTypes{GgmlType::Q5_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_1, gate, GgmlType::Q5_K, GgmlType::Q6_K};
     }},
    // Q2_K / Q3_K (kWide8 on the GPU), a Q4_K embedding.
    {"q2_k-q3_k", 512, 1536, 8, 2, GgmlType::Q4_K,
     [](int l) {
       return LayerTypes{GgmlType::Q2_K, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q3_K, GgmlType::Q2_K, GgmlType::Q2_K,
                         l == 0 ? GgmlType::Q3_K : GgmlType::Q6_K};
     }},
};

}  // namespace

// Decode (graph, and the debug launches with every layer's residual stream) and prompts (the tensor-core few-token
// path up to 32 tokens, the long-prompt projections beyond) against the float reference forward.
TEST(CudaQuant, BackendOnMixedTypeModelsMatchesReference) {
  REQUIRE_GPU();
  for (const TypedModelCase& c : kTypedModels) {
    SCOPED_TRACE(c.name);
    auto m = make_typed_model(3, 4096, 160, c.d, c.d_ff, c.n_heads, c.n_kv, c.embd, c.types);
    auto be = make_cuda_backend(m->spec, m->w, false);
    auto dbg = make_cuda_backend(m->spec, m->w, true);
    const int V = m->spec.vocab, n = 80;
    RefForward ref_fwd(*m);
    const std::vector<int32_t> toks = random_tokens(n, V);
    std::vector<std::vector<float>> dec(n, std::vector<float>(V));
    // METALATTN_TEST_QUICK=1 (for the slow race checker): the backends decode the first 10 positions only; the
    // prompts below are then compared with the float64 reference (dec holds it past position 9).
    const int n_dec = quick_mode() ? 10 : n;
    double worst = 0;
    for (int p = 0; p < n; ++p) {
      SCOPED_TRACE("decode pos " + std::to_string(p));
      std::vector<float> ref_hidden;
      const std::vector<float> want = ref_fwd.forward(toks[p], p, &ref_hidden);
      if (p >= n_dec) {
        dec[p] = want;
        continue;
      }
      std::fill(dec[p].begin(), dec[p].end(), NAN);
      be->forward_token(toks[p], p, dec[p].data());
      expect_logits_close(dec[p], want, 1e-3, "decode logits vs reference");
      worst = std::max(worst, rel_l2(dec[p], want));
      if (p % 9 == 0) {
        std::vector<float> logits(V, NAN), hidden((m->spec.n_layers + 1) * m->spec.d_model, NAN);
        dbg->forward_token_debug(toks[p], p, hidden.data(), logits.data());
        // 2e-4 with the fp16 K/V cache (was 1e-4): see CudaBackend.DecodeMatchesReferenceSmallModelWithHiddenStates.
        EXPECT_LE(rel_l2(hidden, ref_hidden), 2e-4) << "residual stream after each layer (debug launches)";
        expect_logits_close(logits, want, 1e-3, "debug decode logits vs reference");
      } else {
        dbg->forward_token_greedy(toks[p], p);
      }
    }
    std::printf("[ %s: decode rel L2 vs reference, worst of %d positions %.2e ]\n", c.name, n_dec, worst);
    // Prompts of up to 32 tokens take the few-token projections (prompt_mma.cu), longer ones prompt_gemm.cu; the short
    // ones also against a backend with the tensor-core path off (METALATTN_CUDA_PROMPT_MMA=0), twice each (the
    // second use replays a captured graph).
    setenv("METALATTN_CUDA_PROMPT_MMA", "0", 1);
    auto gemm_be = make_cuda_backend(m->spec, m->w, false);
    unsetenv("METALATTN_CUDA_PROMPT_MMA");
    for (int len : {1, 9, 32, 9, 32, 33, 80}) {
      SCOPED_TRACE("prompt of " + std::to_string(len) + " at 0");
      std::vector<float> last(V, NAN), gemm_last(V, NAN);
      const ArgmaxResult r = be->forward_prompt(toks.data(), len, 0, last.data(), nullptr);
      expect_logits_close(last, dec[len - 1], 1e-3, "prompt last logits vs decode");
      EXPECT_EQ(r.token, ref::argmax(last.data(), V).token);
      if (len <= kPromptMmaMaxTokens) {
        gemm_be->forward_prompt(toks.data(), len, 0, gemm_last.data(), nullptr);
        expect_logits_close(last, gemm_last, 1e-3, "few-token prompt vs long-prompt path");
      }
    }
    {
      SCOPED_TRACE("prompt of 23 continuing at 9");
      be->forward_prompt(toks.data(), 9, 0, nullptr, nullptr);
      std::vector<float> last(V, NAN);
      be->forward_prompt(toks.data() + 9, 23, 9, last.data(), nullptr);
      expect_logits_close(last, dec[31], 1e-3, "continued few-token prompt vs decode");
    }
    {
      SCOPED_TRACE("prompt of 30 continuing at 50");
      be->forward_prompt(toks.data(), 50, 0, nullptr, nullptr);
      std::vector<float> last(V, NAN);
      be->forward_prompt(toks.data() + 50, 30, 50, last.data(), nullptr);
      expect_logits_close(last, dec[79], 1e-3, "continued prompt vs decode");
    }
  }
}
