// CUDA kernels and backend against metalattn::ref, on fresh random data with poisoned outputs.
// Tolerances: single kernels and fused kernels vs the composition of the unfused reference ops: max abs error
// <= 1e-4 on outputs of magnitude ~1 (float accumulation in another order; seen ~1e-6). Whole model: relative L2
// of the logits <= 1e-3 and the same argmax. Every test skips when no CUDA device is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/reference.h"
#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "metalattn/backend.h"

using namespace metalattn;
using namespace metalattn::cuda;

namespace {

bool gpu_available() {
  static const int n = cuda_device_count();
  return n > 0;
}
#define REQUIRE_GPU() \
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device present (cudaGetDeviceCount reports none)"

// METALATTN_TEST_QUICK=1 (set by benchmarks/device/sanitize.sh for the slow race checker): the tests that honour it
// run fewer cases or smaller models through the same kernels.
bool quick_mode() {
  const char* v = std::getenv("METALATTN_TEST_QUICK");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// Fresh random data every run; METALATTN_TEST_SEED=<the printed seed> replays a run's data (with the same
// --gtest_filter and --gtest_repeat, the draws come in the same order).
std::mt19937& rng() {
  static std::mt19937 g([] {
    const char* fixed = std::getenv("METALATTN_TEST_SEED");
    const unsigned seed = fixed != nullptr ? static_cast<unsigned>(std::strtoul(fixed, nullptr, 10)) : std::random_device{}();
    std::printf("[ random seed %u ]\n", seed);
    return seed;
  }());
  return g;
}
float uniform(float a, float b) { return std::uniform_real_distribution<float>(a, b)(rng()); }
std::vector<float> random_vec(size_t n, float a = -1.f, float b = 1.f) {
  std::vector<float> v(n);
  for (float& x : v) x = uniform(a, b);
  return v;
}

uint16_t to_fp16(float f) {
  __half_raw r = __half(__float2half(f));
  return r.x;
}
uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); }
  DevBuf(const std::vector<T>& h) : DevBuf(h.size()) { upload(h); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  void upload(const std::vector<T>& h) { CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { CUDA_CHECK(cudaMemset(p, 0xff, n * sizeof(T))); }  // NaN for floats
};

// A random host matrix of the given type, elements of standard deviation about `sigma`.
struct HostMatrix {
  WeightView view;
  std::vector<uint8_t> bytes;
};
std::unique_ptr<HostMatrix> random_matrix(GgmlType type, int64_t rows, int64_t cols, float sigma) {
  auto m = std::make_unique<HostMatrix>();
  const size_t rb = row_bytes(type, cols);
  m->bytes.resize(rb * rows);
  std::uniform_int_distribution<int> byte(0, 255);
  uint8_t* p = m->bytes.data();
  const int64_t nb = cols / 32;
  for (int64_t r = 0; r < rows; ++r, p += rb) {
    switch (type) {
      case GgmlType::Q4_0: {
        auto* b = reinterpret_cast<block_q4_0*>(p);
        for (int64_t k = 0; k < nb; ++k) {
          b[k].d = to_fp16(sigma / 4.6f * uniform(0.5f, 1.5f));
          for (auto& q : b[k].qs) q = static_cast<uint8_t>(byte(rng()));
        }
        break;
      }
      case GgmlType::Q4_1: {
        auto* b = reinterpret_cast<block_q4_1*>(p);
        for (int64_t k = 0; k < nb; ++k) {
          const float d = sigma / 4.6f * uniform(0.5f, 1.5f);
          b[k].d = to_fp16(d);
          b[k].m = to_fp16(-7.5f * d * uniform(0.8f, 1.2f));
          for (auto& q : b[k].qs) q = static_cast<uint8_t>(byte(rng()));
        }
        break;
      }
      case GgmlType::Q8_0: {
        auto* b = reinterpret_cast<block_q8_0*>(p);
        for (int64_t k = 0; k < nb; ++k) {
          b[k].d = to_fp16(sigma / 73.f * uniform(0.5f, 1.5f));
          for (auto& q : b[k].qs) q = static_cast<int8_t>(std::uniform_int_distribution<int>(-127, 127)(rng()));
        }
        break;
      }
      // The new types: every quant, high-bit and packed-scale byte random (all bit patterns), the fp16 super-scales
      // set so that the weights have a standard deviation of about sigma.
      case GgmlType::Q5_0: {
        auto* b = reinterpret_cast<block_q5_0*>(p);
        for (int64_t k = 0; k < nb; ++k) {
          b[k].d = to_fp16(sigma / 9.2f * uniform(0.5f, 1.5f));
          for (auto& q : b[k].qh) q = static_cast<uint8_t>(byte(rng()));
          for (auto& q : b[k].qs) q = static_cast<uint8_t>(byte(rng()));
        }
        break;
      }
      case GgmlType::Q5_1: {
        auto* b = reinterpret_cast<block_q5_1*>(p);
        for (int64_t k = 0; k < nb; ++k) {
          const float d = sigma / 9.2f * uniform(0.5f, 1.5f);
          b[k].d = to_fp16(d);
          b[k].m = to_fp16(-15.5f * d * uniform(0.8f, 1.2f));
          for (auto& q : b[k].qh) q = static_cast<uint8_t>(byte(rng()));
          for (auto& q : b[k].qs) q = static_cast<uint8_t>(byte(rng()));
        }
        break;
      }
      case GgmlType::Q4_K:
      case GgmlType::Q5_K:
      case GgmlType::Q6_K:
      case GgmlType::Q3_K:
      case GgmlType::Q2_K: {
        // Fill each super-block with random bytes, then set its fp16 fields.
        const size_t bs = block_bytes(type);
        for (int64_t k = 0; k < cols / kSuperBlock; ++k) {
          uint8_t* blk = p + k * bs;
          for (size_t i = 0; i < bs; ++i) blk[i] = static_cast<uint8_t>(byte(rng()));
          const float u = uniform(0.5f, 1.5f);
          switch (type) {
            case GgmlType::Q4_K: {
              auto* b = reinterpret_cast<block_q4_K*>(blk);
              b->d = to_fp16(sigma / 350.f * u);
              b->dmin = to_fp16(7.5f * sigma / 350.f * u);
              break;
            }
            case GgmlType::Q5_K: {
              auto* b = reinterpret_cast<block_q5_K*>(blk);
              b->d = to_fp16(sigma / 700.f * u);
              b->dmin = to_fp16(15.5f * sigma / 700.f * u);
              break;
            }
            case GgmlType::Q6_K: reinterpret_cast<block_q6_K*>(blk)->d = to_fp16(sigma / 1400.f * u); break;
            case GgmlType::Q3_K: reinterpret_cast<block_q3_K*>(blk)->d = to_fp16(sigma / 47.f * u); break;
            default: {
              auto* b = reinterpret_cast<block_q2_K*>(blk);
              b->d = to_fp16(sigma / 17.f * u);
              b->dmin = to_fp16(1.5f * sigma / 17.f * u);
            }
          }
        }
        break;
      }
      case GgmlType::F16:
        for (int64_t c = 0; c < cols; ++c) reinterpret_cast<uint16_t*>(p)[c] = to_fp16(uniform(-1.7f, 1.7f) * sigma);
        break;
      case GgmlType::BF16:
        for (int64_t c = 0; c < cols; ++c) reinterpret_cast<uint16_t*>(p)[c] = to_bf16(uniform(-1.7f, 1.7f) * sigma);
        break;
      case GgmlType::F32:
        for (int64_t c = 0; c < cols; ++c) reinterpret_cast<float*>(p)[c] = uniform(-1.7f, 1.7f) * sigma;
        break;
      default: ADD_FAILURE() << "random_matrix: no generator for " << type_name(type);
    }
  }
  m->view.type = type;
  m->view.data = m->bytes.data();
  m->view.rows = rows;
  m->view.cols = cols;
  return m;
}

// A DevMatrix with its device storage.
struct GpuMatrix {
  DevMatrix m;
  std::unique_ptr<DevBuf<uint8_t>> payload;
  std::unique_ptr<DevBuf<uint16_t>> scales;
  std::unique_ptr<DevBuf<uint32_t>> aux;
  std::unique_ptr<DevBuf<float>> mma_scales;
};
GpuMatrix to_gpu(const std::vector<const WeightView*>& parts) {
  const PackedMatrix p = pack_matrix(parts, common_exact_type(parts));
  GpuMatrix g;
  g.payload = std::make_unique<DevBuf<uint8_t>>(p.payload);
  g.m.type = p.type;
  g.m.rows = p.rows;
  g.m.cols = p.cols;
  g.m.nb = p.nb;
  g.m.payload = g.payload->p;
  if (!p.scales.empty()) {
    g.scales = std::make_unique<DevBuf<uint16_t>>(p.scales);
    g.m.scales = g.scales->p;
  }
  if (!p.aux.empty()) {
    g.aux = std::make_unique<DevBuf<uint32_t>>(p.aux);
    g.m.aux = g.aux->p;
  }
  if (!p.mma_scales.empty()) {
    g.mma_scales = std::make_unique<DevBuf<float>>(p.mma_scales);
    g.m.mma_scales = reinterpret_cast<const float2*>(g.mma_scales->p);
  }
  return g;
}

std::vector<float> ref_matvec(const WeightView& w, const std::vector<float>& x) {
  std::vector<float> y(w.rows);
  ref::matvec(w, x.data(), y.data(), 0, w.rows);
  return y;
}
std::vector<float> ref_rmsnorm(const std::vector<float>& x, const std::vector<float>& w, float eps) {
  std::vector<float> y(x.size());
  ref::rmsnorm(x.data(), w.data(), eps, static_cast<int>(x.size()), y.data());
  return y;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}
double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;
    num += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

bool is_poison(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b == 0xffffffffu;
}

// The RoPE angle table the backend uploads: [n_ctx][head_dim/2] (cos, sin), rope base 100000 as in SmolLM2.
std::vector<float2> rope_table(int n_ctx, int hd) {
  std::vector<float2> table(static_cast<size_t>(n_ctx) * hd / 2);
  for (int i = 0; i < hd / 2; ++i)
    for (int p = 0; p < n_ctx; ++p) {
      const double th = p * std::pow(100000.0, -2.0 * i / hd);
      table[static_cast<size_t>(p) * hd / 2 + i] = make_float2(static_cast<float>(std::cos(th)), static_cast<float>(std::sin(th)));
    }
  return table;
}

// Checks RoPE + KV append of n QKV rows at positions pos0..: q rotated into gq, k rotated into row pos0 + t of gk,
// v copied into row pos0 + t of gv, and no other cache row written (both caches start poisoned).
void expect_rope_append(const std::vector<float>& qkv, int n, int pos0, int n_heads, int n_kv, int hd,
                        const std::vector<float>& gq, const std::vector<float>& gk, const std::vector<float>& gv,
                        double tol, const char* what) {
  const int q_dim = n_heads * hd, kv_dim = n_kv * hd, rows = q_dim + 2 * kv_dim;
  double err = 0;
  for (int t = 0; t < n; ++t) {
    std::vector<float> q(qkv.begin() + t * rows, qkv.begin() + t * rows + q_dim);
    std::vector<float> k(qkv.begin() + t * rows + q_dim, qkv.begin() + t * rows + q_dim + kv_dim);
    ref::rope(q.data(), n_heads, hd, pos0 + t, 100000.f);
    ref::rope(k.data(), n_kv, hd, pos0 + t, 100000.f);
    for (int i = 0; i < q_dim; ++i) err = std::max(err, std::fabs(static_cast<double>(gq[t * q_dim + i]) - q[i]));
    for (int i = 0; i < kv_dim; ++i) {
      err = std::max(err, std::fabs(static_cast<double>(gk[(pos0 + t) * kv_dim + i]) - k[i]));
      err = std::max(err, std::fabs(static_cast<double>(gv[(pos0 + t) * kv_dim + i]) - qkv[t * rows + q_dim + kv_dim + i]));
    }
  }
  EXPECT_LE(err, tol) << what;
  size_t written_k = 0, written_v = 0;
  for (size_t i = 0; i < gk.size(); ++i) written_k += !is_poison(gk[i]);
  for (size_t i = 0; i < gv.size(); ++i) written_v += !is_poison(gv[i]);
  EXPECT_EQ(written_k, static_cast<size_t>(n) * kv_dim) << what;
  EXPECT_EQ(written_v, static_cast<size_t>(n) * kv_dim) << what;
}

constexpr float kTol = 1e-4f;
constexpr float kEps = 1e-5f;
const GgmlType kAllTypes[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0,
                              GgmlType::F16,  GgmlType::BF16, GgmlType::F32};

// SmolLM2-135M shapes: rows x cols of every matrix the model multiplies by.
struct Shape {
  int rows, cols;
};
// SmolLM2's QKV, O, gate/up, down and lm_head, plus a wide ragged one: 65 blocks per row take the two-warps-per-row
// residual kernel past its first block per lane, and 99 rows leave the last block part empty. 8191 x 2080: more
// two-warp row groups than the GPU holds blocks at once, the last one ragged.
const Shape kShapes[] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {49152, 576}, {99, 2080}, {8191, 2080}};

// The fused QKV kernel's targets: q into q, k and v rows of position io->pos into the caches k, v ([n_ctx][kv_dim]).
QkvTargets qkv_targets(const DevBuf<float2>& rope_table, const DevBuf<DecodeIO>& io, int q_dim, int kv_dim,
                       int head_dim, DevBuf<float>& q, DevBuf<float>& k, DevBuf<float>& v) {
  return metalattn::cuda::qkv_targets(rope_table.p, io.p, q_dim, kv_dim, head_dim, q.p, k.p, v.p);
}

}  // namespace

// ------------------------------------------------------------------ matvec family

TEST(CudaMatvec, PlainFusedNormAndResidualAtEveryShape) {
  REQUIRE_GPU();
  for (GgmlType t : kAllTypes) {
    for (Shape s : kShapes) {
      SCOPED_TRACE(std::string(type_name(t)) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols));
      auto hm = random_matrix(t, s.rows, s.cols, 1.f / std::sqrt(static_cast<float>(s.cols)));
      GpuMatrix g = to_gpu({&hm->view});
      const std::vector<float> x = random_vec(s.cols, -2.f, 2.f), nw = random_vec(s.cols, 0.5f, 1.5f);
      DevBuf<float> dx(x), dnw(nw), dy(s.rows);

      dy.poison();
      launch_norm_matvec(g.m, dx.p, nullptr, kEps, dy.p, nullptr);
      EXPECT_LE(max_abs_diff(dy.download(), ref_matvec(hm->view, x)), kTol) << "plain matvec";

      dy.poison();
      launch_norm_matvec(g.m, dx.p, dnw.p, kEps, dy.p, nullptr);
      EXPECT_LE(max_abs_diff(dy.download(), ref_matvec(hm->view, ref_rmsnorm(x, nw, kEps))), kTol) << "norm+matvec";

      const std::vector<float> y0 = random_vec(s.rows);
      dy.upload(y0);
      launch_matvec_residual(g.m, dx.p, dy.p, nullptr);
      std::vector<float> expect = ref_matvec(hm->view, x);
      for (int r = 0; r < s.rows; ++r) expect[r] += y0[r];
      EXPECT_LE(max_abs_diff(dy.download(), expect), kTol) << "matvec+residual";
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
        DevBuf<float> dx(x), dnw(nw), dq(q_dim), dk(static_cast<size_t>(n_ctx) * kv_dim),
            dv(static_cast<size_t>(n_ctx) * kv_dim);
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
        const std::vector<float> kc = dk.download(), vc = dv.download();
        std::vector<float> krow(kc.begin() + pos * kv_dim, kc.begin() + (pos + 1) * kv_dim);
        std::vector<float> vrow(vc.begin() + pos * kv_dim, vc.begin() + (pos + 1) * kv_dim);
        EXPECT_LE(max_abs_diff(krow, k), kTol) << "k cache row";
        EXPECT_LE(max_abs_diff(vrow, v), kTol) << "v cache row";
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
    int n_heads, n_kv, hd;
  };
  const std::vector<Shape> shapes = quick ? std::vector<Shape>{{9, 3, 64}} : std::vector<Shape>{{9, 3, 64}, {8, 2, 128}};
  const std::vector<int> split_caps = quick ? std::vector<int>{1, kMaxAttnSplits} : std::vector<int>{1, 7, kMaxAttnSplits};
  const std::vector<int> positions =
      quick ? std::vector<int>{2, 129, kAttnSinglePassMax + 1, 4097}
            : std::vector<int>{1, 2, 63, 64, 65, 129, kAttnSinglePassMax, kAttnSinglePassMax + 1, 1000, 2048, 4097,
                               8191, 8192};
  for (const Shape sh : shapes) {
    const int n_heads = sh.n_heads, n_kv = sh.n_kv, hd = sh.hd, q_dim = n_heads * hd, kv_dim = n_kv * hd;
    const int n_ctx = 8192, group = n_heads / n_kv;
    const std::vector<float> kc = random_vec(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f);
    const std::vector<float> vc = random_vec(static_cast<size_t>(n_ctx) * kv_dim);
    DevBuf<float> dk(kc), dv(vc), out(q_dim);
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
    EXPECT_THROW(launch_attention_decode(dk.p, dk.p, dv.p, nullptr, n_heads, n_kv, hd, n_ctx, AttnScratch{}, out.p,
                                         nullptr, group + 1),
                 EngineError)
        << "heads per block must divide the group";
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

// The short-context decode attention (head_dim 64, every K/V row in shared memory) against the reference at every
// position of its range, for SmolLM2's 9/3 heads and a 4/4 (no GQA) layout, a cache filled with random rows.
TEST(CudaFused, DecodeAttentionShortContextEveryPosition) {
  REQUIRE_GPU();
  struct Shape {
    int n_heads, n_kv;
  };
  const int hd = 64;
  for (const Shape sh : {Shape{9, 3}, Shape{4, 4}}) {
    for (int cap : {kAttnSinglePassMax, 37}) {  // 37: a capacity that is not a multiple of 4
      const int q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd;
      const std::vector<float> kc = random_vec(static_cast<size_t>(cap) * kv_dim, -2.f, 2.f);
      const std::vector<float> vc = random_vec(static_cast<size_t>(cap) * kv_dim);
      DevBuf<float> dk(kc), dv(vc), out(q_dim);
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
  EXPECT_THROW(launch_attention_decode_short(dummy.p, dummy.p, dummy.p, nullptr, 9, 3, 128, 256, dummy.p, nullptr),
               EngineError)
      << "head_dim 64 only";
  EXPECT_THROW(launch_attention_decode_short(dummy.p, dummy.p, dummy.p, nullptr, 9, 3, 64, kAttnSinglePassMax + 1,
                                             dummy.p, nullptr),
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
    DevBuf<float> dnw(nw), x(d), dq(q_dim), dk(static_cast<size_t>(n_ctx) * kv_dim), dv(static_cast<size_t>(n_ctx) * kv_dim);
    DevBuf<float> x2(d), dq2(q_dim), dk2(dk.n), dv2(dv.n);
    for (auto* b : {&x, &dq, &dk, &dv, &x2, &dq2, &dk2, &dv2}) b->poison();
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
    const std::vector<float> k1 = dk.download(), k2 = dk2.download(), v1 = dv.download(), v2 = dv2.download();
    auto row_at = [&](const std::vector<float>& c) {
      return std::vector<float>(c.begin() + pos * kv_dim, c.begin() + (pos + 1) * kv_dim);
    };
    EXPECT_LE(max_abs_diff(row_at(k1), row_at(k2)), kTol) << "k cache row";
    EXPECT_LE(max_abs_diff(row_at(v1), row_at(v2)), kTol) << "v cache row";
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
  DevBuf<ArgmaxResult> res(1);
  DevBuf<DecodeIO> io(std::vector<DecodeIO>{{-1, 41}});
  res.poison();
  ArgmaxScratch sc{parts.p, counter.p, kArgmaxMaxBlocks};
  launch_argmax(dx.p, static_cast<int>(v.size()), sc, res.p, io.p, nullptr);
  const ArgmaxResult r = res.download()[0];
  EXPECT_EQ(counter.download()[0], 0u) << "counter re-armed";
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

TEST(CudaFused, FinalNormLmHeadArgmax) {
  REQUIRE_GPU();
  for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F16}) {
    SCOPED_TRACE(type_name(t));
    auto w = random_matrix(t, 49152, 576, 0.04f);
    GpuMatrix g = to_gpu({&w->view});
    DevBuf<ArgmaxPartial> parts(argmax_partials_needed(g.m));
    DevBuf<unsigned> counter(std::vector<unsigned>{0u});
    DevBuf<ArgmaxResult> res(1);
    DevBuf<DecodeIO> io(std::vector<DecodeIO>{{3, 9}});
    ArgmaxScratch sc{parts.p, counter.p, static_cast<int>(parts.n)};
    for (int rep = 0; rep < 2; ++rep) {  // twice: the done-counter must re-arm itself
      const std::vector<float> x = random_vec(576, -3.f, 3.f), nw = random_vec(576, 0.5f, 1.5f);
      DevBuf<float> dx(x), dnw(nw), logits(49152);
      logits.poison();
      res.poison();
      launch_norm_matvec_argmax(g.m, dx.p, dnw.p, kEps, logits.p, sc, res.p, io.p, nullptr);
      const std::vector<float> got = logits.download();
      EXPECT_LE(max_abs_diff(got, ref_matvec(w->view, ref_rmsnorm(x, nw, kEps))), kTol);
      const ArgmaxResult want = ref::argmax(got.data(), 49152);
      const ArgmaxResult r = res.download()[0];
      EXPECT_EQ(r.token, want.token);
      EXPECT_EQ(r.value, want.value);
      const DecodeIO after = io.download()[0];
      EXPECT_EQ(after.token, static_cast<int32_t>(want.token));
      EXPECT_EQ(after.pos, 10 + rep);
    }
  }
}

// ------------------------------------------------------------------ prefill kernels

namespace {

// Operand rows of n x width values as the prompt kernels write them and the tensor-core projections read them
// (kernels.cuh, store_operand): per 4 values [hi x4 | lo x4] fp16; `value` is what they stand for (hi + lo).
struct SlotRows {
  std::vector<__half> h;
  int width;
  size_t at(int64_t t, int j) const { return static_cast<size_t>(t) * 2 * width + (j / 4) * 8 + (j % 4); }
  double hi(int64_t t, int j) const { return __half2float(h[at(t, j)]); }
  double value(int64_t t, int j) const { return hi(t, j) + __half2float(h[at(t, j) + 4]); }
  // Values of rows 0..n-1 whose hi is not a nearest fp16 of hi + lo (a lo beyond half an ulp of hi; a tie is fine).
  int64_t bad_splits(int n) const {
    int64_t bad = 0;
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < width; ++j) {
        const uint16_t bits = __half_raw(h[at(t, j)]).x;
        const double v = value(t, j), d = std::fabs(v - hi(t, j));
        for (int step : {-1, 1}) {
          __half_raw nb;
          nb.x = static_cast<uint16_t>(bits + step);
          const double other = __half2float(__half(nb));
          if (!std::isnan(other) && std::fabs(v - other) < d) ++bad;
        }
      }
    return bad;
  }
  // Halves of row t that still hold the 0xffff poison.
  int64_t poisoned(int64_t t) const {
    int64_t c = 0;
    for (int i = 0; i < 2 * width; ++i) c += __half_raw(h[static_cast<size_t>(t) * 2 * width + i]).x == 0xffff;
    return c;
  }
};
// Rows 0..n-1 of a projection's output y ([n + 1][rows], poisoned before the launch) against want[t] (+ y0 when the
// projection added into y), within kTol; row n must still hold the poison.
void expect_projection_rows(const std::vector<float>& got, const std::vector<std::vector<float>>& want,
                            const std::vector<float>& y0, int n, int rows, bool add) {
  double err = 0;
  for (int t = 0; t < n; ++t)
    for (int r = 0; r < rows; ++r) {
      const size_t i = static_cast<size_t>(t) * rows + r;
      const double e = std::fabs(got[i] - (want[t][r] + (add ? y0[i] : 0.f)));
      err = std::isnan(e) ? INFINITY : std::max(err, e);
    }
  EXPECT_LE(err, kTol) << (add ? "y += W.x" : "y = W.x");
  int64_t spare_written = 0;
  for (size_t i = static_cast<size_t>(n) * rows; i < got.size(); ++i) spare_written += !is_poison(got[i]);
  EXPECT_EQ(spare_written, 0) << "row n written";
}

SlotRows make_slot_rows(const std::vector<float>& v, int n, int width, std::vector<float>* values) {
  SlotRows o{std::vector<__half>(static_cast<size_t>(n) * 2 * width), width};
  values->resize(static_cast<size_t>(n) * width);
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < width; ++j) {
      const float x = v[static_cast<size_t>(t) * width + j];
      const __half hi = __float2half_rn(x), lo = __float2half_rn(x - __half2float(hi));
      const size_t i = static_cast<size_t>(t) * 2 * width + (j / 4) * 8 + (j % 4);
      o.h[i] = hi;
      o.h[i + 4] = lo;
      (*values)[static_cast<size_t>(t) * width + j] = __half2float(hi) + __half2float(lo);
    }
  return o;
}

}  // namespace

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
  DevBuf<float> dqkv(qkv), dq(static_cast<size_t>(n) * q_dim), dk(static_cast<size_t>(n_ctx) * kv_dim), dv(static_cast<size_t>(n_ctx) * kv_dim);
  dq.poison();
  dk.poison();
  dv.poison();
  launch_rope_append(dqkv.p, n, pos0, dtab.p, q_dim, kv_dim, hd, dq.p, dk.p, dv.p, nullptr);
  const std::vector<float> gq = dq.download(), gk = dk.download(), gv = dv.download();
  expect_rope_append(qkv, n, pos0, n_heads, n_kv, hd, gq, gk, gv, kTol, "rope + append");
}

TEST(CudaPrefill, CausalAttentionOverPromptAndCache) {
  REQUIRE_GPU();
  const int n_heads = 9, n_kv = 3, hd = 64, q_dim = 576, kv_dim = 192, n_ctx = 1024;
  const std::vector<float> kc = random_vec(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f);
  const std::vector<float> vc = random_vec(static_cast<size_t>(n_ctx) * kv_dim);
  DevBuf<float> dk(kc), dv(vc);
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
    const std::vector<float> kc = random_vec(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f);
    const std::vector<float> vc = random_vec(static_cast<size_t>(n_ctx) * kv_dim);
    DevBuf<float> dk(kc), dv(vc);
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
      std::vector<float> kc = random_vec(static_cast<size_t>(n_ctx) * kv_dim, -2.f, 2.f), vc = random_vec(kc.size());
      std::fill(kc.begin() + static_cast<size_t>(pos0) * kv_dim, kc.end(), std::numeric_limits<float>::quiet_NaN());
      std::fill(vc.begin() + static_cast<size_t>(pos0) * kv_dim, vc.end(), std::numeric_limits<float>::quiet_NaN());
      DevBuf<float> dk(kc), dv(vc);
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
      const std::vector<float> gk = dk.download(), gv = dv.download();
      double cache_err = 0;
      size_t cache_mismatch = 0;
      for (size_t i = 0; i < gk.size(); ++i) {
        if (std::isnan(kc[i]) || std::isnan(gk[i]) || std::isnan(vc[i]) || std::isnan(gv[i])) {
          cache_mismatch += std::isnan(kc[i]) != std::isnan(gk[i]) || std::isnan(vc[i]) != std::isnan(gv[i]);
          continue;
        }
        cache_err = std::max({cache_err, std::fabs(static_cast<double>(gk[i]) - kc[i]), std::fabs(static_cast<double>(gv[i]) - vc[i])});
      }
      EXPECT_EQ(cache_mismatch, 0u) << "cache rows written outside pos0..pos0+n-1, or missing";
      EXPECT_LE(cache_err, kTol) << "appended K/V rows";
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
  DevBuf<float> dqkv(qkv), dq(static_cast<size_t>(n) * q_dim), dk(static_cast<size_t>(n_ctx) * kv_dim),
      dv(static_cast<size_t>(n_ctx) * kv_dim);
  DevBuf<int32_t> dpos(std::vector<int32_t>{pos0});
  dq.poison();
  dk.poison();
  dv.poison();
  launch_rope_append_at(dqkv.p, n, dpos.p, dtab.p, q_dim, kv_dim, hd, dq.p, dk.p, dv.p, nullptr);
  const std::vector<float> gq = dq.download(), gk = dk.download(), gv = dv.download();
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
        const int K = cs.cols, d_ff = cs.out == PromptMmaOut::SiluHalf ? cs.rows / 2 : 0;
        auto hm = random_matrix(type, cs.rows, K, 1.f / std::sqrt(static_cast<float>(K)));
        GpuMatrix g = to_gpu({&hm->view});
        const std::vector<float> x = random_vec(static_cast<size_t>(n) * K, -3.f, 3.f);
        const std::vector<float> nw = random_vec(K, 0.5f, 1.5f);
        // The reference's input rows: rmsnorm(x_t), or the values the slot rows stand for.
        std::vector<float> in(x.size());
        SlotRows slots{{}, K};
        if (cs.normed) {
          for (int t = 0; t < n; ++t) {
            const std::vector<float> row(x.begin() + static_cast<size_t>(t) * K, x.begin() + static_cast<size_t>(t + 1) * K);
            const std::vector<float> h = ref_rmsnorm(row, nw, kEps);
            std::copy(h.begin(), h.end(), in.begin() + static_cast<size_t>(t) * K);
          }
        } else {
          slots = make_slot_rows(x, n, K, &in);
        }
        DevBuf<float> dx(x), dnw(nw);
        DevBuf<__half> dxs(slots.h.empty() ? std::vector<__half>(1) : slots.h);
        PromptMmaArgs a;
        a.W = g.m;
        a.n = n;
        if (cs.normed) {
          a.x = dx.p;
          a.norm_w = dnw.p;
          a.eps = kEps;
        } else {
          a.x_slots = dxs.p;
        }
        a.out_kind = cs.out;
        a.d_ff = d_ff;
        std::vector<std::vector<float>> want(n);
        for (int t = 0; t < n; ++t)
          want[t] = ref_matvec(hm->view, std::vector<float>(in.begin() + static_cast<size_t>(t) * K,
                                                            in.begin() + static_cast<size_t>(t + 1) * K));
        if (cs.out == PromptMmaOut::SiluHalf) {
          DevBuf<__half> out(static_cast<size_t>(n + 1) * 2 * d_ff);  // one spare row must stay untouched
          out.poison();
          a.out_slots = out.p;
          launch_prompt_mma(a, nullptr);
          const SlotRows got{out.download(), d_ff};
          double err = 0;
          for (int t = 0; t < n; ++t)
            for (int j = 0; j < d_ff; ++j) {
              const double e = std::fabs(got.value(t, j) - ref::silu(want[t][j]) * want[t][d_ff + j]);
              err = std::isnan(e) ? INFINITY : std::max(err, e);
            }
          EXPECT_LE(err, kTol) << "silu(gate) * up";
          EXPECT_EQ(got.poisoned(n), 2 * d_ff) << "row n written";
        } else {
          const bool add = cs.out == PromptMmaOut::AddResidual;
          const std::vector<float> y0 = random_vec(static_cast<size_t>(n) * cs.rows);
          DevBuf<float> dy(static_cast<size_t>(n + 1) * cs.rows);
          dy.poison();
          if (add) CUDA_CHECK(cudaMemcpy(dy.p, y0.data(), y0.size() * 4, cudaMemcpyHostToDevice));
          a.y = dy.p;
          launch_prompt_mma(a, nullptr);
          expect_projection_rows(dy.download(), want, y0, n, cs.rows, add);
        }
      }
    }
  }
}

// Causal attention of a few-token prompt chunk at start positions inside and past the first key tile, against the
// scalar reference: the few-token kernel and the tensor-core prefill kernel with slot output, from raw QKV rows.
// Both must append the chunk's roped k / plain v rows to the caches and leave every other cache row alone.
TEST(CudaPrompt, FewTokenAttentionMatchesReference) {
  REQUIRE_GPU();
  const int n_heads = 9, n_kv = 3, hd = 64, q_dim = 576, kv_dim = 192, rows = q_dim + 2 * kv_dim, n_ctx = 512;
  DevBuf<float2> dtab(rope_table(n_ctx, hd));
  for (int pos0 : {0, 37, 200, 300}) {
    for (int n : {1, 9, 32}) {
      for (bool few : {true, false}) {
        SCOPED_TRACE(std::string(few ? "few-token kernel" : "prefill kernel") + ", " + std::to_string(n) +
                     " tokens at " + std::to_string(pos0));
        const std::vector<float> qkv = random_vec(static_cast<size_t>(n) * rows);
        std::vector<float> kc(static_cast<size_t>(n_ctx) * kv_dim), vc(kc.size());
        const std::vector<float> old_k = random_vec(static_cast<size_t>(pos0) * kv_dim), old_v = random_vec(old_k.size());
        DevBuf<float> dqkv(qkv), dk(kc.size()), dv(vc.size());
        dk.poison();
        dv.poison();
        if (pos0 > 0) {
          CUDA_CHECK(cudaMemcpy(dk.p, old_k.data(), old_k.size() * 4, cudaMemcpyHostToDevice));
          CUDA_CHECK(cudaMemcpy(dv.p, old_v.data(), old_v.size() * 4, cudaMemcpyHostToDevice));
        }
        DevBuf<int32_t> dpos(std::vector<int32_t>{pos0});
        DevBuf<__half> out(static_cast<size_t>(n) * 2 * q_dim);
        out.poison();
        if (few) {
          FewAttnArgs a;
          a.qkv = dqkv.p;
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
        const std::vector<float> gk = dk.download(), gv = dv.download();
        // Reference: the same cache, each token roped and appended, then attention over 0..pos0 + t.
        std::copy(old_k.begin(), old_k.end(), kc.begin());
        std::copy(old_v.begin(), old_v.end(), vc.begin());
        double err = 0, cache_err = 0;
        for (int t = 0; t < n; ++t) {
          const int p = pos0 + t;
          std::vector<float> q(qkv.begin() + t * rows, qkv.begin() + t * rows + q_dim), o(q_dim);
          std::copy(qkv.begin() + t * rows + q_dim, qkv.begin() + t * rows + q_dim + kv_dim, kc.begin() + p * kv_dim);
          std::copy(qkv.begin() + t * rows + q_dim + kv_dim, qkv.begin() + (t + 1) * rows, vc.begin() + p * kv_dim);
          ref::rope(q.data(), n_heads, hd, p, 100000.f);
          ref::rope(kc.data() + p * kv_dim, n_kv, hd, p, 100000.f);
          ref::attention(q.data(), kc.data(), vc.data(), n_heads, n_kv, hd, p + 1, o.data());
          for (int j = 0; j < q_dim; ++j) {
            const double e = std::fabs(got.value(t, j) - o[j]);
            err = std::isnan(e) ? INFINITY : std::max(err, e);
          }
        }
        for (size_t i = 0; i < static_cast<size_t>(pos0 + n) * kv_dim; ++i) {
          const double e = std::max(std::fabs(static_cast<double>(gk[i]) - kc[i]), std::fabs(static_cast<double>(gv[i]) - vc[i]));
          cache_err = std::isnan(e) ? INFINITY : std::max(cache_err, e);
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

// ------------------------------------------------------------------ whole backend

namespace {

struct TestModel {
  ModelSpec spec;
  ModelWeights w;
  std::vector<std::unique_ptr<HostMatrix>> mats;
  std::vector<std::vector<float>> norms;

  const WeightView& add(GgmlType t, int64_t rows, int64_t cols, float sigma) {
    mats.push_back(random_matrix(t, rows, cols, sigma));
    return mats.back()->view;
  }
  const float* norm(int n) {
    norms.push_back(random_vec(n, 0.6f, 1.4f));
    return norms.back().data();
  }
};

std::unique_ptr<TestModel> make_model(int n_layers, int vocab, int n_ctx, GgmlType layer_type, GgmlType embd_type,
                                      int d = 576, int d_ff = 1536, int n_heads = 9, int n_kv = 3) {
  auto m = std::make_unique<TestModel>();
  ModelSpec& s = m->spec;
  s.n_layers = n_layers;
  s.d_model = d;
  s.d_ff = d_ff;
  s.n_heads = n_heads;
  s.n_kv_heads = n_kv;
  s.head_dim = d / n_heads;
  s.vocab = vocab;
  s.n_ctx = n_ctx;
  s.rope_base = 100000.f;
  s.rms_eps = 1e-5f;
  const float sd = 1.f / std::sqrt(static_cast<float>(d)), sf = 1.f / std::sqrt(static_cast<float>(d_ff));
  m->w.tok_embd = m->add(embd_type, vocab, d, 1.f);
  m->w.output = m->w.tok_embd;  // tied, as SmolLM2
  m->w.output_norm = m->norm(d);
  for (int l = 0; l < n_layers; ++l) {
    LayerWeights L;
    L.attn_norm = m->norm(d);
    L.wq = m->add(layer_type, s.q_dim(), d, 2.f * sd);
    L.wk = m->add(layer_type, s.kv_dim(), d, 2.f * sd);
    L.wv = m->add(layer_type, s.kv_dim(), d, sd);
    L.wo = m->add(layer_type, d, s.q_dim(), 0.5f * sd);
    L.ffn_norm = m->norm(d);
    L.w_gate = m->add(layer_type, d_ff, d, sd);
    L.w_up = m->add(layer_type, d_ff, d, sd);
    L.w_down = m->add(layer_type, d, d_ff, 0.5f * sf);
    m->w.layers.push_back(L);
  }
  return m;
}

// The model composed from the unfused scalar reference ops, float activations, with its own KV cache.
struct RefForward {
  const TestModel& m;
  std::vector<float> kc, vc;
  explicit RefForward(const TestModel& model)
      : m(model),
        kc(static_cast<size_t>(model.spec.n_layers) * model.spec.n_ctx * model.spec.kv_dim()),
        vc(kc.size()) {}

  std::vector<float> forward(int token, int pos, std::vector<float>* hidden = nullptr) {
    const ModelSpec& s = m.spec;
    const int d = s.d_model, kv = s.kv_dim();
    std::vector<float> x(d), h(d), q(s.q_dim()), att(s.q_dim()), o(d), g(s.d_ff), u(s.d_ff);
    ref::dequantize_row(m.w.tok_embd.type, m.w.tok_embd.row(token), x.data(), d);
    if (hidden) hidden->assign(x.begin(), x.end());
    for (int l = 0; l < s.n_layers; ++l) {
      const LayerWeights& L = m.w.layers[l];
      float* kl = kc.data() + static_cast<size_t>(l) * s.n_ctx * kv;
      float* vl = vc.data() + static_cast<size_t>(l) * s.n_ctx * kv;
      ref::rmsnorm(x.data(), L.attn_norm, s.rms_eps, d, h.data());
      ref::matvec(L.wq, h.data(), q.data(), 0, s.q_dim());
      ref::matvec(L.wk, h.data(), kl + static_cast<size_t>(pos) * kv, 0, kv);
      ref::matvec(L.wv, h.data(), vl + static_cast<size_t>(pos) * kv, 0, kv);
      ref::rope(q.data(), s.n_heads, s.head_dim, pos, s.rope_base);
      ref::rope(kl + static_cast<size_t>(pos) * kv, s.n_kv_heads, s.head_dim, pos, s.rope_base);
      ref::attention(q.data(), kl, vl, s.n_heads, s.n_kv_heads, s.head_dim, pos + 1, att.data());
      ref::matvec(L.wo, att.data(), o.data(), 0, d);
      for (int i = 0; i < d; ++i) x[i] += o[i];
      ref::rmsnorm(x.data(), L.ffn_norm, s.rms_eps, d, h.data());
      ref::matvec(L.w_gate, h.data(), g.data(), 0, s.d_ff);
      ref::matvec(L.w_up, h.data(), u.data(), 0, s.d_ff);
      for (int i = 0; i < s.d_ff; ++i) g[i] = ref::silu(g[i]) * u[i];
      ref::matvec(L.w_down, g.data(), o.data(), 0, d);
      for (int i = 0; i < d; ++i) x[i] += o[i];
      if (hidden) hidden->insert(hidden->end(), x.begin(), x.end());
    }
    ref::rmsnorm(x.data(), m.w.output_norm, s.rms_eps, d, h.data());
    std::vector<float> logits(s.vocab);
    ref::matvec(m.w.output, h.data(), logits.data(), 0, s.vocab);
    return logits;
  }
};

std::vector<int32_t> random_tokens(int n, int vocab) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = std::uniform_int_distribution<int>(0, vocab - 1)(rng());
  return t;
}

void expect_logits_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const char* what) {
  const double e = rel_l2(got, want);
  EXPECT_LE(e, tol) << what;
  EXPECT_EQ(ref::argmax(got.data(), static_cast<int>(got.size())).token,
            ref::argmax(want.data(), static_cast<int>(want.size())).token)
      << what << " (rel L2 " << e << ")";
}

// Decodes n random tokens on backends a and b side by side (and on the reference forward). At the positions where
// check(p) holds both return logits (poisoned first) and compare(logits_a, logits_b, reference) runs; elsewhere
// greedy steps just fill the caches. In quick mode (the race checker) one prompt on each backend fills the positions
// [fill.first, fill.second) instead of a decode step each: the kernels are the same, ~20x fewer launches.
template <typename Check, typename Compare>
void decode_side_by_side(const TestModel& m, Backend& a, Backend& b, int n, Check check, Compare compare,
                         std::pair<int, int> fill = {0, 0}) {
  RefForward ref_fwd(m);
  const std::vector<int32_t> toks = random_tokens(n, m.spec.vocab);
  std::vector<float> la(m.spec.vocab), lb(m.spec.vocab);
  if (!quick_mode()) fill = {0, 0};
  for (int p = 0; p < n; ++p) {
    const std::vector<float> want = ref_fwd.forward(toks[p], p);
    if (p >= fill.first && p < fill.second) {
      if (p == fill.first) {
        a.forward_prompt(toks.data() + p, fill.second - p, p, nullptr, nullptr);
        b.forward_prompt(toks.data() + p, fill.second - p, p, nullptr, nullptr);
      }
      continue;
    }
    if (!check(p)) {
      a.forward_token_greedy(toks[p], p);
      b.forward_token_greedy(toks[p], p);
      continue;
    }
    SCOPED_TRACE("pos " + std::to_string(p));
    std::fill(la.begin(), la.end(), NAN);
    std::fill(lb.begin(), lb.end(), NAN);
    a.forward_token(toks[p], p, la.data());
    b.forward_token(toks[p], p, lb.data());
    compare(la, lb, want);
  }
}

}  // namespace

TEST(CudaBackend, DecodeMatchesReferenceSmallModelWithHiddenStates) {
  REQUIRE_GPU();
  auto m = make_model(4, 2048, 256, GgmlType::Q4_1, GgmlType::Q8_0);
  auto be = make_cuda_backend(m->spec, m->w, false);
  RefForward ref_fwd(*m);
  const std::vector<int32_t> toks = random_tokens(8, m->spec.vocab);
  for (int p = 0; p < 8; ++p) {
    SCOPED_TRACE("pos " + std::to_string(p));
    std::vector<float> ref_hidden;
    const std::vector<float> want = ref_fwd.forward(toks[p], p, &ref_hidden);
    std::vector<float> logits(m->spec.vocab, NAN), hidden((m->spec.n_layers + 1) * m->spec.d_model, NAN);
    if (p % 2 == 0) {
      be->forward_token(toks[p], p, logits.data());
    } else {
      be->forward_token_debug(toks[p], p, hidden.data(), logits.data());
      EXPECT_LE(rel_l2(hidden, ref_hidden), 1e-4) << "residual stream after each layer";
    }
    expect_logits_close(logits, want, 1e-3, "decode logits");
  }
  const MemoryInfo mi = be->memory_info();
  EXPECT_EQ(mi.kv_cache, 2ull * 4 * 256 * 192 * sizeof(float));
  EXPECT_GT(mi.weights, 0u);
  EXPECT_GT(mi.scratch, 0u);
}

TEST(CudaBackend, DecodeMatchesReferenceFullSmolLM2Shape) {
  REQUIRE_GPU();
  auto m = make_model(30, 49152, 2048, GgmlType::Q4_0, GgmlType::Q8_0);
  auto be = make_cuda_backend(m->spec, m->w, false);
  RefForward ref_fwd(*m);
  const std::vector<int32_t> toks = random_tokens(3, m->spec.vocab);
  for (int p = 0; p < 3; ++p) {
    std::vector<float> logits(m->spec.vocab, NAN);
    be->forward_token(toks[p], p, logits.data());
    expect_logits_close(logits, ref_fwd.forward(toks[p], p), 1e-3, "full-shape decode logits");
  }
}

// One case per prompt length (the whole sweep is ~2,700 decode steps of the full SmolLM2 shape: as one test it ran
// past a 10-minute device call under every compute-sanitizer tool).
class CudaBackendPrompt : public ::testing::TestWithParam<int> {};

TEST_P(CudaBackendPrompt, MatchesTokenByTokenDecode) {
  REQUIRE_GPU();
  // METALATTN_TEST_QUICK=1 (for the slow race checker): 2 layers instead of 30 and a 4096-token vocabulary, and past
  // the first 8 positions the decode's cache is filled by a prompt up to the last position, which is decoded (the
  // kernels are the same; the layers only repeat them, the lm_head's rows only lengthen its loop, and the decode
  // steps skipped only repeat the ones kept).
  const bool quick = quick_mode();
  auto m = make_model(quick ? 2 : 30, quick ? 4096 : 49152, 2048, GgmlType::Q4_0, GgmlType::Q8_0);
  auto be = make_cuda_backend(m->spec, m->w, false);
  const int V = m->spec.vocab;
  {
    const int n = GetParam();
    SCOPED_TRACE("prompt length " + std::to_string(n));
    const std::vector<int32_t> toks = random_tokens(n, V);
    const bool check_all = n == 7 || n == 129;
    std::vector<float> dec_all(check_all ? static_cast<size_t>(n) * V : 0), dec_last(V);
    const int decoded = quick ? std::min(n, 8) : n;  // positions decoded one by one from 0
    for (int p = 0; p < n; ++p) {
      if (p >= decoded && p < n - 1) {
        if (p == decoded) be->forward_prompt(toks.data() + p, n - 1 - p, p, nullptr, nullptr);
        continue;
      }
      if (check_all) be->forward_token(toks[p], p, dec_all.data() + static_cast<size_t>(p) * V);
      else if (p == n - 1) be->forward_token(toks[p], p, dec_last.data());
      else be->forward_token_greedy(toks[p], p);
    }
    if (check_all) std::copy(dec_all.end() - V, dec_all.end(), dec_last.begin());
    std::vector<float> last(V, NAN), all(check_all ? static_cast<size_t>(n) * V : 0, NAN);
    const ArgmaxResult r = be->forward_prompt(toks.data(), n, 0, last.data(), check_all ? all.data() : nullptr);
    std::printf("[ prompt %4d: rel L2 of the last logits vs decode %.2e ]\n", n, rel_l2(last, dec_last));
    expect_logits_close(last, dec_last, 1e-3, "prompt last logits");
    EXPECT_EQ(r.token, ref::argmax(last.data(), V).token);
    if (check_all)
      for (int p = 0; p < n; p += (n > 7 ? 16 : 1)) {
        if (p >= decoded && p < n - 1) continue;
        const std::vector<float> a(all.begin() + static_cast<size_t>(p) * V, all.begin() + static_cast<size_t>(p + 1) * V);
        const std::vector<float> b(dec_all.begin() + static_cast<size_t>(p) * V, dec_all.begin() + static_cast<size_t>(p + 1) * V);
        expect_logits_close(a, b, 1e-3, "prompt all_logits row");
      }
    if (n == 129) {  // the same prompt in two pieces: the second continues from the cache at pos 50
      be->forward_prompt(toks.data(), 50, 0, nullptr, nullptr);
      std::vector<float> last2(V, NAN);
      be->forward_prompt(toks.data() + 50, n - 50, 50, last2.data(), nullptr);
      expect_logits_close(last2, dec_last, 1e-3, "prompt continued at pos 50");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, CudaBackendPrompt, ::testing::Values(1, 7, 32, 129, 512, 2048),
                         [](const ::testing::TestParamInfo<int>& i) { return "n" + std::to_string(i.param); });

// A prompt length runs eagerly on its first use, is captured on its second and replayed after that; the replay must
// follow the start position held in device memory.
TEST(CudaBackend, PromptGraphReplayAtNewStartPositions) {
  REQUIRE_GPU();
  auto m = make_model(4, 2048, 256, GgmlType::Q4_0, GgmlType::Q8_0);
  auto be = make_cuda_backend(m->spec, m->w, false);
  const int V = m->spec.vocab;
  const std::vector<int32_t> toks = random_tokens(104, V);
  RefForward ref_fwd(*m);
  std::vector<std::vector<float>> want(toks.size());
  for (size_t p = 0; p < toks.size(); ++p) want[p] = ref_fwd.forward(toks[p], static_cast<int>(p));
  // A one-off length first: 72 tokens at 0, past the 64 whose projections run on the few-token kernels, so on the
  // long-prompt path (prompt_gemm.cu), every row against the float reference. Then decode rewrites the whole cache and
  // the replays below compare with decode. On cuBLAS GEMMs this path missed the reference by up to 4.8e-3 on ~2% of
  // random models (NOTES, sessions 11-12). On our own projections (H100, session 15): 61 random models of a 40-token
  // prompt, worst rows 2.1e-6 (median) .. 2.9e-5; 30 of this 72-token prompt, 4.4e-6 (median) .. 2.3e-4, the outliers
  // not yet explained (the tensor-core attention is the next suspect). The bound stays the 1e-3 of every prompt test.
  {
    const int n_first = 72;
    std::vector<float> all(static_cast<size_t>(n_first) * V, NAN);
    be->forward_prompt(toks.data(), n_first, 0, nullptr, all.data());
    double worst = 0;
    for (int t = 0; t < n_first; ++t) {
      const std::vector<float> row(all.begin() + static_cast<size_t>(t) * V,
                                   all.begin() + static_cast<size_t>(t + 1) * V);
      worst = std::max(worst, rel_l2(row, want[t]));
      SCOPED_TRACE("72 tokens at 0 (long-prompt path), row " + std::to_string(t));
      expect_logits_close(row, want[t], 1e-3, "prompt vs reference (long-prompt path)");
    }
    std::printf("[ 72 at 0 (long-prompt path): worst row vs reference %.2e ]\n", worst);
  }
  std::vector<std::vector<float>> dec(toks.size(), std::vector<float>(V));
  for (size_t p = 0; p < toks.size(); ++p) {
    be->forward_token(toks[p], static_cast<int>(p), dec[p].data());
    SCOPED_TRACE("decode at " + std::to_string(p));
    expect_logits_close(dec[p], want[p], 1e-3, "decode vs reference");
  }
  // Then 32 tokens at 0 three times: eager, captured, replayed. Both sides against the float reference too, so a
  // failure says which side drifted.
  const std::vector<float>& want31 = want[31];
  for (int rep = 0; rep < 3; ++rep) {
    SCOPED_TRACE("32 tokens at 0, use " + std::to_string(rep));
    std::vector<float> last(V, NAN);
    be->forward_prompt(toks.data(), 32, 0, last.data(), nullptr);
    expect_logits_close(last, want31, 1e-3, "prompt at 0 vs reference");
    expect_logits_close(last, dec[31], 1e-3, "prompt at 0");
    if (rep == 0)
      std::printf("[ 32 at 0: rel L2 prompt vs decode %.2e, decode vs reference %.2e, prompt vs reference %.2e ]\n",
                  rel_l2(last, dec[31]), rel_l2(dec[31], want31), rel_l2(last, want31));
  }
  // Replays of the captured 32-token graph at 40 and 72: they see the cache the earlier calls left.
  for (int p0 : {40, 72}) {
    SCOPED_TRACE("32 tokens at " + std::to_string(p0));
    std::vector<float> last(V, NAN), all(static_cast<size_t>(32) * V, NAN);
    const ArgmaxResult r = be->forward_prompt(toks.data() + p0, 32, p0, last.data(), all.data());
    {
      char side[160];
      std::snprintf(side, sizeof side, "last logits: rel L2 vs reference %.2e, vs all_logits row 31 %.2e",
                    rel_l2(last, want[p0 + 31]),
                    rel_l2(last, std::vector<float>(all.end() - V, all.end())));
      SCOPED_TRACE(side);
      expect_logits_close(last, dec[p0 + 31], 1e-3, "replayed prompt, last logits");
    }
    EXPECT_EQ(r.token, ref::argmax(last.data(), V).token);
    double worst = 0;
    int worst_t = 0;
    for (int t = 0; t < 32; ++t) {  // every row: row 31 against `last` tells the lm_head launches from their input
      const std::vector<float> row(all.begin() + static_cast<size_t>(t) * V,
                                   all.begin() + static_cast<size_t>(t + 1) * V);
      const double e = rel_l2(row, dec[p0 + t]);
      if (e > worst) worst = e, worst_t = t;
      char side[160];
      std::snprintf(side, sizeof side, "all_logits row %d: rel L2 prompt vs reference %.2e, decode vs reference %.2e", t,
                    rel_l2(row, want[p0 + t]), rel_l2(dec[p0 + t], want[p0 + t]));
      SCOPED_TRACE(side);
      expect_logits_close(row, dec[p0 + t], 1e-3, "replayed prompt, all_logits row");
    }
    std::printf("[ replay at %d: rel L2 last %.2e, worst all_logits row %.2e (row %d) ]\n", p0,
                rel_l2(last, dec[p0 + 31]), worst, worst_t);
  }
}

// Replays of one 32-token prompt over the same cache are bit-identical, and so are repeated decode steps at one
// position: neither path has a data-dependent reduction order, so any difference is a race or a read of memory
// that nothing wrote. Each launch mode separately: graph with and without programmatic launch, and debug mode
// (eager launches). PromptGraphReplayAtNewStartPositions failed intermittently in one row of such a prompt.
TEST(CudaBackend, PromptAndDecodeReplaysAreBitIdentical) {
  REQUIRE_GPU();
  auto m = make_model(4, 2048, 256, GgmlType::Q4_0, GgmlType::Q8_0);
  const int V = m->spec.vocab, p0 = 72, n = 32;
  const std::vector<int32_t> toks = random_tokens(p0 + n, V);
  // METALATTN_TEST_QUICK=1 (for the slow race checker): 4 replays instead of 300, and a prompt fills the cache up to
  // p0 - 1 instead of decode steps.
  const bool quick = quick_mode();
  const int reps = quick ? 4 : 300;
  struct Mode {
    const char* name;
    bool debug;
    const char* pdl;
  };
  for (const Mode mode : {Mode{"graph, PDL", false, "1"}, Mode{"graph, no PDL", false, "0"},
                          Mode{"debug mode (eager)", true, "1"}}) {
    SCOPED_TRACE(mode.name);
    setenv("METALATTN_CUDA_PDL", mode.pdl, 1);
    auto be = make_cuda_backend(m->spec, m->w, mode.debug);
    unsetenv("METALATTN_CUDA_PDL");
    std::vector<float> dec_first(V), dec(V);
    if (quick) be->forward_prompt(toks.data(), p0 - 1, 0, nullptr, nullptr);
    for (int p = quick ? p0 - 1 : 0; p < p0; ++p) be->forward_token(toks[p], p, dec_first.data());
    const size_t all_n = static_cast<size_t>(n) * V;
    std::vector<float> first(all_n, NAN), all(all_n);
    be->forward_prompt(toks.data() + p0, n, p0, nullptr, first.data());
    int bad_prompts = 0, bad_decodes = 0;
    std::vector<int> bad_rows(n, 0);
    double worst = 0;
    for (int r = 0; r < reps; ++r) {
      std::fill(all.begin(), all.end(), NAN);
      be->forward_prompt(toks.data() + p0, n, p0, nullptr, all.data());
      bool bad = false;
      for (int t = 0; t < n; ++t) {
        const size_t o = static_cast<size_t>(t) * V;
        if (std::memcmp(all.data() + o, first.data() + o, V * sizeof(float)) == 0) continue;
        bad = true;
        ++bad_rows[t];
        worst = std::max(worst, rel_l2(std::vector<float>(all.begin() + o, all.begin() + o + V),
                                       std::vector<float>(first.begin() + o, first.begin() + o + V)));
      }
      bad_prompts += bad;
    }
    // Decode at p0 - 1 again and again (it rewrites that cache row with the same values).
    for (int r = 0; r < reps; ++r) {
      std::fill(dec.begin(), dec.end(), NAN);
      be->forward_token(toks[p0 - 1], p0 - 1, dec.data());
      bad_decodes += std::memcmp(dec.data(), dec_first.data(), V * sizeof(float)) != 0;
    }
    std::string rows;
    for (int t = 0; t < n; ++t)
      if (bad_rows[t] > 0) rows += " " + std::to_string(t) + "x" + std::to_string(bad_rows[t]);
    std::printf("[ %s: %d of %d prompt replays differ from the first (rows:%s; worst rel L2 %.2e), %d of %d decode steps ]\n",
                mode.name, bad_prompts, reps, rows.empty() ? " none" : rows.c_str(), worst, bad_decodes, reps);
    EXPECT_EQ(bad_prompts, 0) << "rows (row x times):" << rows << ", worst rel L2 " << worst;
    EXPECT_EQ(bad_decodes, 0);
  }
}

// Prompts of up to 32 tokens take the tensor-core projections (prompt_mma.cu), which read Q4_0, Q4_1 and Q8_0
// weights directly: for each type, prompts at the start and continuing from the cache agree with token-by-token
// decode and with the long-prompt path (METALATTN_CUDA_PROMPT_MMA=0), on first use (eager) and on replay (graph).
TEST(CudaBackend, FewTokenPromptsMatchDecodeForEachWeightType) {
  REQUIRE_GPU();
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
    SCOPED_TRACE(type_name(type));
    auto m = make_model(4, 2048, 256, type, GgmlType::Q8_0);
    auto be = make_cuda_backend(m->spec, m->w, false);
    setenv("METALATTN_CUDA_PROMPT_MMA", "0", 1);
    auto gemm_be = make_cuda_backend(m->spec, m->w, false);
    unsetenv("METALATTN_CUDA_PROMPT_MMA");
    const int V = m->spec.vocab;
    const std::vector<int32_t> toks = random_tokens(64, V);
    // METALATTN_TEST_QUICK=1 (for the slow race checker): the prompts are compared with the float64 reference
    // instead of 64 decode steps, and each piece runs once (the repeats replay captured graphs of the same kernels).
    const bool quick = quick_mode();
    std::vector<std::vector<float>> dec(toks.size(), std::vector<float>(V));
    RefForward ref_fwd(*m);
    for (size_t p = 0; p < toks.size(); ++p) {
      if (quick) dec[p] = ref_fwd.forward(toks[p], static_cast<int>(p));
      else be->forward_token(toks[p], static_cast<int>(p), dec[p].data());
    }
    struct Piece {
      int pos, n;
    };
    // (0, 9) then (9, 23) continues from the cache; the 32-token pieces run eagerly, then as a captured graph.
    std::vector<Piece> pieces = {Piece{0, 1},   Piece{0, 9},  Piece{9, 23}, Piece{0, 32},
                                 Piece{32, 32}, Piece{0, 32}, Piece{32, 32}};
    if (quick) pieces.resize(5);
    for (Piece pc : pieces) {
      SCOPED_TRACE("prompt of " + std::to_string(pc.n) + " at " + std::to_string(pc.pos));
      std::vector<float> last(V, NAN), ref_last(V, NAN);
      const ArgmaxResult r = be->forward_prompt(toks.data() + pc.pos, pc.n, pc.pos, last.data(), nullptr);
      gemm_be->forward_prompt(toks.data() + pc.pos, pc.n, pc.pos, ref_last.data(), nullptr);
      expect_logits_close(last, dec[pc.pos + pc.n - 1], 1e-3,
                          quick ? "tensor-core prompt vs reference" : "tensor-core prompt vs decode");
      expect_logits_close(last, ref_last, 1e-3, "few-token prompt vs long-prompt path");
      EXPECT_EQ(r.token, ref::argmax(last.data(), V).token);
      if (pc.n == 32 && pc.pos == 32)
        std::printf("[ %s 32 at 32: rel L2 vs decode %.2e, vs long-prompt path %.2e ]\n", type_name(type),
                    rel_l2(last, dec[63]), rel_l2(last, ref_last));
    }
  }
}

// Two chunks of the same length (the backend's chunk, 2048 tokens) share one graph; the repeats must each see their
// own tokens and position.
TEST(CudaBackend, PromptOfTwoEqualChunksRepeated) {
  REQUIRE_GPU();
  auto m = make_model(2, 2048, 4096, GgmlType::Q4_0, GgmlType::Q8_0);
  auto be = make_cuda_backend(m->spec, m->w, false);
  const int V = m->spec.vocab, n = 4096;
  const std::vector<int32_t> toks = random_tokens(n, V);
  std::vector<float> dec_last(V);
  // METALATTN_TEST_QUICK=1 (for the slow race checker): a prompt fills the cache up to the last position (chunks of
  // 2,048 and 2,047 tokens: the 2,048 runs eagerly) instead of 4,095 decode steps, and the 4,096-token prompt runs
  // once (its first chunk is the 2,048's second use, captured; its second chunk replays that graph).
  const bool quick = quick_mode();
  if (quick) be->forward_prompt(toks.data(), n - 1, 0, nullptr, nullptr);
  else
    for (int p = 0; p < n - 1; ++p) be->forward_token_greedy(toks[p], p);
  be->forward_token(toks[n - 1], n - 1, dec_last.data());
  for (int rep = 0; rep < (quick ? 1 : 3); ++rep) {
    SCOPED_TRACE("use " + std::to_string(rep));
    std::vector<float> last(V, NAN);
    be->forward_prompt(toks.data(), n, 0, last.data(), nullptr);
    expect_logits_close(last, dec_last, 1e-3, "4096-token prompt");
  }
}

TEST(CudaBackend, GreedyFeedbackDebugModeAndGraphAgree) {
  REQUIRE_GPU();
  auto m = make_model(3, 4096, 128, GgmlType::Q4_0, GgmlType::Q8_0);
  auto fast = make_cuda_backend(m->spec, m->w, false);
  auto dbg = make_cuda_backend(m->spec, m->w, true);
  int32_t tok_fast = 7, tok_dbg = 7;
  std::vector<float> lf(m->spec.vocab), ld(m->spec.vocab);
  for (int p = 0; p < 24; ++p) {
    // The fast backend is fed its own results (no host write needed); the debug one recomputes argmax on the host.
    const ArgmaxResult r = fast->forward_token_greedy(tok_fast, p);
    dbg->forward_token(tok_dbg, p, ld.data());
    const ArgmaxResult rd = ref::argmax(ld.data(), m->spec.vocab);
    EXPECT_EQ(r.token, rd.token) << "pos " << p;
    EXPECT_EQ(r.value, rd.value) << "pos " << p;
    tok_fast = static_cast<int32_t>(r.token);
    tok_dbg = static_cast<int32_t>(rd.token);
  }
  // After a greedy run, a call with a different token must still take effect.
  fast->forward_token(5, 24, lf.data());
  dbg->forward_token(5, 24, ld.data());
  EXPECT_EQ(lf, ld) << "graph replay and debug launches are the same kernels";
}

// A generation that crosses the switch-over from the short-context decode graph (one attention pass, all K/V rows
// in shared memory) to the long-context one (attention split over the context), and runs on past it: logits match
// the reference forward at positions on both sides, and the graph backend is bit-identical to the debug (eager) one.
TEST(CudaBackend, DecodeAcrossTheShortToLongAttentionSwitchOver) {
  REQUIRE_GPU();
  const int sw = kAttnSinglePassMax, n = sw + 24;
  auto m = make_model(3, 2048, n + 8, GgmlType::Q4_0, GgmlType::Q8_0);
  auto fast = make_cuda_backend(m->spec, m->w, false);
  auto dbg = make_cuda_backend(m->spec, m->w, true);
  EXPECT_EQ(fast->kernels_per_token(), 5 * 3 + 1);
  decode_side_by_side(
      *m, *fast, *dbg, n, [&](int p) { return p < 2 || (p >= sw - 3 && p <= sw + 2) || p == n - 1; },
      [](const std::vector<float>& lf, const std::vector<float>& ld, const std::vector<float>& want) {
        expect_logits_close(lf, want, 1e-3, "decode logits");
        EXPECT_EQ(lf, ld) << "graph replay and debug launches are the same kernels";
      },
      {2, sw - 3});
}

// The default decode (graphs, short then split attention) and the eager debug decode against the reference forward
// at SmolLM2's layer shapes for each legacy layer type, across the short-attention limit, and with a capacity (41)
// that is not a multiple of 4.
TEST(CudaBackend, DecodeMatchesReferenceForEachLayerTypeAndOddCapacity) {
  REQUIRE_GPU();
  struct Case {
    GgmlType t;
    int n_ctx;
  };
  // METALATTN_TEST_QUICK=1 (for the slow race checker): Q4_0 only (the other types' decode kernels run under it in
  // CudaMatvec and CudaFused), across the same attention switch-over and odd capacity.
  const bool quick = quick_mode();
  std::vector<Case> cases = {Case{GgmlType::Q4_0, 264}, Case{GgmlType::Q4_1, 264}, Case{GgmlType::Q8_0, 264},
                             Case{GgmlType::Q4_0, 41}};
  if (quick) cases = {Case{GgmlType::Q4_0, 264}, Case{GgmlType::Q4_0, 41}};
  for (const Case c : cases) {
    const int limit = std::min(c.n_ctx, kAttnSinglePassMax), n = std::min(c.n_ctx, limit + 6);
    SCOPED_TRACE(std::string("layer type ") + type_name(c.t) + ", n_ctx " + std::to_string(c.n_ctx));
    auto m = make_model(3, 2048, c.n_ctx, c.t, GgmlType::Q8_0);
    auto graph = make_cuda_backend(m->spec, m->w, false);
    auto eager = make_cuda_backend(m->spec, m->w, true);
    EXPECT_EQ(graph->kernels_per_token(), 5 * 3 + 1);
    decode_side_by_side(
        *m, *graph, *eager, n,
        [&](int p) { return p < 3 || p % 37 == 0 || (p >= limit - 2 && p <= limit + 1) || p == n - 1; },
        [](const std::vector<float>& lg, const std::vector<float>& le, const std::vector<float>& want) {
          expect_logits_close(lg, want, 1e-3, "graph decode logits vs reference");
          expect_logits_close(le, want, 1e-3, "eager decode logits vs reference");
        },
        {3, limit - 2});
  }
}

TEST(CudaBackend, RejectsBadInputsAndOutOfMemoryWithoutLeaking) {
  REQUIRE_GPU();
  auto m = make_model(2, 512, 64, GgmlType::Q8_0, GgmlType::Q8_0, 128, 256, 2, 1);
  {
    auto be = make_cuda_backend(m->spec, m->w, false);
    EXPECT_THROW(be->forward_token_greedy(0, 64), EngineError);
    EXPECT_THROW(be->forward_token_greedy(0, -1), EngineError);
    EXPECT_THROW(be->forward_token_greedy(512, 0), EngineError);
    EXPECT_THROW(be->forward_token_greedy(-3, 0), EngineError);
    const std::vector<int32_t> toks(10, 1);
    EXPECT_THROW(be->forward_prompt(toks.data(), 10, 60, nullptr, nullptr), EngineError);
    EXPECT_THROW(be->forward_prompt(toks.data(), 0, 0, nullptr, nullptr), EngineError);
    EXPECT_NO_THROW(be->forward_token_greedy(1, 63));
  }
  size_t free0 = 0, free1 = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  ModelSpec huge = m->spec;
  huge.n_ctx = 1 << 30;  // a KV cache of terabytes
  try {
    make_cuda_backend(huge, m->w, false);
    ADD_FAILURE() << "expected an out-of-memory EngineError";
  } catch (const EngineError& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  for (int i = 0; i < 100; ++i) {
    auto be = make_cuda_backend(m->spec, m->w, false);
    be->forward_token_greedy(i % 512, i % 64);
    const std::vector<int32_t> toks(5, 3);
    be->forward_prompt(toks.data(), 5, 0, nullptr, nullptr);
  }
  CUDA_CHECK(cudaMemGetInfo(&free1, &total));
  EXPECT_LE(free0 > free1 ? free0 - free1 : 0, 4u << 20) << "device memory lost over 100 create/destroy cycles";
}

// ================================================================== general architectures (arch.cuh)
// The kernels of the general path (biases, QK-norm, NeoX / interleaved RoPE from per-layer tables, sliding windows,
// attention scale, head_dim up to 256, post-norms, GELU, embedding scale) against host references at the real
// models' shapes, then whole models of each architecture against the CPU backend (scalar ISA: float activations).

#include "arch.cuh"

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
            {2048, 8192}, {1536, 8960}, {99, 2048}};
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
      const std::vector<float> x = random_vec(s.cols, -2.f, 2.f), nw = random_vec(s.cols, 0.5f, 1.5f);
      DevBuf<float> dx(x), dnw(nw), dy(s.rows);

      dy.poison();
      launch_norm_matvec(g.m, dx.p, nullptr, kEps, dy.p, nullptr);
      EXPECT_LE(max_abs_diff(dy.download(), ref_matvec(hm->view, x)), kTol) << "plain matvec";

      dy.poison();
      launch_norm_matvec(g.m, dx.p, dnw.p, kEps, dy.p, nullptr);
      EXPECT_LE(max_abs_diff(dy.download(), ref_matvec(hm->view, ref_rmsnorm(x, nw, kEps))), kTol) << "norm+matvec";

      const std::vector<float> y0 = random_vec(s.rows);
      dy.upload(y0);
      launch_matvec_residual(g.m, dx.p, dy.p, nullptr);
      std::vector<float> expect = ref_matvec(hm->view, x);
      for (int r = 0; r < s.rows; ++r) expect[r] += y0[r];
      EXPECT_LE(max_abs_diff(dy.download(), expect), kTol) << "matvec+residual";
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
      DevBuf<float> dx(x_in), dnw(nw), dq(q_dim), dk(static_cast<size_t>(n_ctx) * kv_dim), dv(dk.n);
      DevBuf<DecodeIO> io(std::vector<DecodeIO>{{token, pos}});
      for (auto* b : {&dq, &dk, &dv}) b->poison();
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
      const std::vector<float> kc = dk.download(), vc = dv.download();
      EXPECT_LE(max_abs_diff(std::vector<float>(kc.begin() + pos * kv_dim, kc.begin() + (pos + 1) * kv_dim), k), kTol)
          << "k cache row";
      EXPECT_LE(max_abs_diff(std::vector<float>(vc.begin() + pos * kv_dim, vc.begin() + (pos + 1) * kv_dim), v), kTol)
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
      const std::vector<float> x = random_vec(static_cast<size_t>(n) * K, -3.f, 3.f);
      const std::vector<float> nw = random_vec(K, 0.5f, 1.5f);
      std::vector<float> in(x.size());
      SlotRows slots{{}, K};
      if (cs.normed) {
        for (int t = 0; t < n; ++t) {
          const std::vector<float> row(x.begin() + static_cast<size_t>(t) * K, x.begin() + static_cast<size_t>(t + 1) * K);
          const std::vector<float> h = ref_rmsnorm(row, nw, kEps);
          std::copy(h.begin(), h.end(), in.begin() + static_cast<size_t>(t) * K);
        }
      } else {
        slots = make_slot_rows(x, n, K, &in);
      }
      DevBuf<float> dx(x), dnw(nw);
      DevBuf<__half> dxs(slots.h.empty() ? std::vector<__half>(1) : slots.h);
      PromptMmaArgs a;
      a.W = g.m;
      a.n = n;
      if (cs.normed) {
        a.x = dx.p;
        a.norm_w = dnw.p;
        a.eps = kEps;
      } else {
        a.x_slots = dxs.p;
      }
      a.out_kind = cs.out;
      a.d_ff = d_ff;
      std::vector<std::vector<float>> want(n);
      for (int t = 0; t < n; ++t)
        want[t] = ref_stack_matvec(parts, std::vector<float>(in.begin() + static_cast<size_t>(t) * K,
                                                             in.begin() + static_cast<size_t>(t + 1) * K));
      if (cs.out == PromptMmaOut::SiluHalf) {
        DevBuf<__half> out(static_cast<size_t>(n + 1) * 2 * d_ff);
        out.poison();
        a.out_slots = out.p;
        launch_prompt_mma(a, nullptr);
        const SlotRows got{out.download(), d_ff};
        double err = 0;
        for (int t = 0; t < n; ++t)
          for (int j = 0; j < d_ff; ++j) {
            const double e = std::fabs(got.value(t, j) - ref::silu(want[t][j]) * want[t][d_ff + j]);
            err = std::isnan(e) ? INFINITY : std::max(err, e);
          }
        EXPECT_LE(err, kTol) << "silu(gate) * up";
        EXPECT_EQ(got.poisoned(n), 2 * d_ff) << "row n written";
      } else {
        const bool add = cs.out == PromptMmaOut::AddResidual;
        const std::vector<float> y0 = random_vec(static_cast<size_t>(n) * cs.rows);
        DevBuf<float> dy(static_cast<size_t>(n + 1) * cs.rows);
        dy.poison();
        if (add) CUDA_CHECK(cudaMemcpy(dy.p, y0.data(), y0.size() * 4, cudaMemcpyHostToDevice));
        a.y = dy.p;
        launch_prompt_mma(a, nullptr);
        expect_projection_rows(dy.download(), want, y0, n, cs.rows, add);
      }
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

struct LayerTypes {
  GgmlType q, k, v, o, gate, up, down;
};

// A synthetic Llama (head_dim 64, tied embedding) whose layer l has the types types(l).
template <typename Types>
std::unique_ptr<TestModel> make_typed_model(int n_layers, int vocab, int n_ctx, int d, int d_ff, int n_heads,
                                            int n_kv, GgmlType embd_type, Types types) {
  auto m = std::make_unique<TestModel>();
  ModelSpec& s = m->spec;
  s.n_layers = n_layers;
  s.d_model = d;
  s.d_ff = d_ff;
  s.n_heads = n_heads;
  s.n_kv_heads = n_kv;
  s.head_dim = d / n_heads;
  s.vocab = vocab;
  s.n_ctx = n_ctx;
  s.rope_base = 100000.f;
  s.rms_eps = 1e-5f;
  const float sd = 1.f / std::sqrt(static_cast<float>(d)), sf = 1.f / std::sqrt(static_cast<float>(d_ff));
  m->w.tok_embd = m->add(embd_type, vocab, d, 1.f);
  m->w.output = m->w.tok_embd;
  m->w.output_norm = m->norm(d);
  for (int l = 0; l < n_layers; ++l) {
    const LayerTypes t = types(l);
    LayerWeights L;
    L.attn_norm = m->norm(d);
    L.wq = m->add(t.q, s.q_dim(), d, 2.f * sd);
    L.wk = m->add(t.k, s.kv_dim(), d, 2.f * sd);
    L.wv = m->add(t.v, s.kv_dim(), d, sd);
    L.wo = m->add(t.o, d, s.q_dim(), 0.5f * sd);
    L.ffn_norm = m->norm(d);
    L.w_gate = m->add(t.gate, d_ff, d, sd);
    L.w_up = m->add(t.up, d_ff, d, sd);
    L.w_down = m->add(t.down, d, d_ff, 0.5f * sf);
    m->w.layers.push_back(L);
  }
  return m;
}

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
        EXPECT_LE(rel_l2(hidden, ref_hidden), 1e-4) << "residual stream after each layer (debug launches)";
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

namespace {

// The real models' attention geometry.
struct ArchShape {
  const char* name;
  int d, d_ff, n_heads, n_kv, hd;
  bool bias, qk_norm;
  float base;
  int window;
};
const ArchShape kArchShapes[] = {
    {"gemma3-270m", 640, 2048, 4, 1, 256, false, true, 10000.f, 512},
    {"qwen2.5-0.5b", 896, 4864, 14, 2, 64, true, false, 1e6f, 0},
    {"qwen3-0.6b", 1024, 3072, 16, 8, 128, false, true, 1e6f, 0},
};

// The CPU backend's RoPE: pair i of each head, (2i, 2i+1) interleaved or (i, i + hd/2) NeoX, turned by row[i].
void ref_rope_pairs(float* v, int n_heads, int hd, RopeStyle style, const float2* row) {
  const int half = hd / 2;
  for (int h = 0; h < n_heads; ++h)
    for (int i = 0; i < half; ++i) {
      float* a = v + h * hd + (style == RopeStyle::Neox ? i : 2 * i);
      const int other = style == RopeStyle::Neox ? half : 1;
      const float x = a[0], y = a[other];
      a[0] = x * row[i].x - y * row[i].y;
      a[other] = x * row[i].y + y * row[i].x;
    }
}

// Attention of one query (all heads) at position pos over cache rows, in double: the positions
// [max(0, pos - window + 1), pos] (window 0: all up to pos), scores q.k * scale.
std::vector<float> ref_attention_window(const float* q, const float* kc, const float* vc, int n_heads, int n_kv,
                                        int hd, int pos, int window, float scale) {
  const int kv_dim = n_kv * hd, group = n_heads / n_kv;
  const int lo = window > 0 ? std::max(0, pos - window + 1) : 0;
  std::vector<float> out(static_cast<size_t>(n_heads) * hd);
  std::vector<double> s(pos + 1);
  for (int h = 0; h < n_heads; ++h) {
    const int kvh = h / group;
    double mx = -INFINITY;
    for (int p = lo; p <= pos; ++p) {
      double dot = 0;
      for (int j = 0; j < hd; ++j)
        dot += static_cast<double>(q[h * hd + j]) * kc[static_cast<size_t>(p) * kv_dim + kvh * hd + j];
      s[p] = dot * scale;
      mx = std::max(mx, s[p]);
    }
    double sum = 0;
    for (int p = lo; p <= pos; ++p) sum += (s[p] = std::exp(s[p] - mx));
    for (int j = 0; j < hd; ++j) {
      double o = 0;
      for (int p = lo; p <= pos; ++p) o += s[p] * vc[static_cast<size_t>(p) * kv_dim + kvh * hd + j];
      out[h * hd + j] = static_cast<float>(o / sum);
    }
  }
  return out;
}

// Row t of operand rows of `width` values (kernels.cuh, store_operand) back to floats: hi + lo.
std::vector<float> operand_row(const std::vector<__half>& op, int t, int width) {
  const SlotRows rows{op, width};
  std::vector<float> r(width);
  for (int j = 0; j < width; ++j) r[j] = static_cast<float>(rows.value(t, j));
  return r;
}

}  // namespace

// The table the backend uploads: at scale 1 without factors it turns exactly as ref::rope (interleaved); with a
// scale and factors, pair i turns by pos * scale * base^(-2i/hd) / factor[i].
TEST(CudaArch, RopeTableMatchesReferenceAngles) {
  const int n_ctx = 300, hd = 64;
  const auto plain = rope_table_host(n_ctx, hd, 10000.f, 1.f, nullptr);
  std::vector<float> v = random_vec(2 * hd), w = v;
  ref::rope(v.data(), 2, hd, 257, 10000.f);
  ref_rope_pairs(w.data(), 2, hd, RopeStyle::Interleaved, plain.data() + 257 * hd / 2);
  EXPECT_EQ(v, w);
  std::vector<float> factors(hd / 2);
  for (int i = 0; i < hd / 2; ++i) factors[i] = 1.f + 7.f * i / (hd / 2 - 1);
  const auto t = rope_table_host(n_ctx, hd, 500000.f, 0.25f, factors.data());
  for (int p : {0, 1, 77, 299})
    for (int i : {0, 5, 31}) {
      const double th = p * 0.25 * std::pow(500000.0, -2.0 * i / hd) / factors[i];
      EXPECT_EQ(t[static_cast<size_t>(p) * hd / 2 + i].x, static_cast<float>(std::cos(th)));
      EXPECT_EQ(t[static_cast<size_t>(p) * hd / 2 + i].y, static_cast<float>(std::sin(th)));
    }
}

TEST(CudaArch, QkvFinishBiasQkNormRopeAppendAtRealShapes) {
  REQUIRE_GPU();
  struct Variant {
    RopeStyle style;
    bool factors;
  };
  for (const ArchShape& sh : kArchShapes) {
    for (const Variant var : {Variant{RopeStyle::Neox, false}, Variant{RopeStyle::Interleaved, true}}) {
      const int n_ctx = 700, hd = sh.hd, q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd, rows = q_dim + 2 * kv_dim;
      std::vector<float> factors(hd / 2);
      for (int i = 0; i < hd / 2; ++i) factors[i] = 1.f + 3.f * i / (hd / 2);
      const auto table = rope_table_host(n_ctx, hd, sh.base, var.factors ? 0.5f : 1.f,
                                         var.factors ? factors.data() : nullptr);
      DevBuf<float2> table_d(table);
      const std::vector<float> bias = random_vec(rows, -0.5f, 0.5f), qn = random_vec(hd, 0.5f, 1.5f),
                               kn = random_vec(hd, 0.5f, 1.5f);
      DevBuf<float> bias_d(bias), qn_d(qn), kn_d(kn);
      for (int n : {1, 5}) {
        for (int pos0 : {0, 37, n_ctx - n}) {
          SCOPED_TRACE(std::string(sh.name) + (var.style == RopeStyle::Neox ? " neox" : " interleaved+factors") +
                       " n " + std::to_string(n) + " pos0 " + std::to_string(pos0));
          const std::vector<float> qkv = random_vec(static_cast<size_t>(n) * rows, -2.f, 2.f);
          DevBuf<float> qkv_d(qkv), q_d(static_cast<size_t>(n) * q_dim), kc_d(static_cast<size_t>(n_ctx) * kv_dim),
              vc_d(static_cast<size_t>(n_ctx) * kv_dim);
          DevBuf<int32_t> pos_d(std::vector<int32_t>{pos0});
          q_d.poison();
          kc_d.poison();
          vc_d.poison();
          QkvFinishArgs a;
          a.qkv = qkv_d.p;
          a.n = n;
          a.pos0 = pos_d.p;
          a.bias = sh.bias ? bias_d.p : nullptr;
          a.q_norm = sh.qk_norm ? qn_d.p : nullptr;
          a.k_norm = sh.qk_norm ? kn_d.p : nullptr;
          a.eps = 1e-6f;
          a.rope_table = table_d.p;
          a.style = var.style;
          a.n_heads = sh.n_heads;
          a.n_kv_heads = sh.n_kv;
          a.head_dim = hd;
          a.q_out = q_d.p;
          a.k_cache = kc_d.p;
          a.v_cache = vc_d.p;
          launch_qkv_finish(a, nullptr);
          CUDA_CHECK(cudaDeviceSynchronize());
          const auto gq = q_d.download(), gk = kc_d.download(), gv = vc_d.download();
          double err = 0;
          for (int t = 0; t < n; ++t) {
            std::vector<float> r(qkv.begin() + static_cast<size_t>(t) * rows, qkv.begin() + static_cast<size_t>(t + 1) * rows);
            if (sh.bias)
              for (int i = 0; i < rows; ++i) r[i] += bias[i];
            if (sh.qk_norm) {
              for (int h = 0; h < sh.n_heads; ++h) ref::rmsnorm(&r[h * hd], qn.data(), 1e-6f, hd, &r[h * hd]);
              for (int h = 0; h < sh.n_kv; ++h) ref::rmsnorm(&r[q_dim + h * hd], kn.data(), 1e-6f, hd, &r[q_dim + h * hd]);
            }
            const float2* row = table.data() + static_cast<size_t>(pos0 + t) * hd / 2;
            ref_rope_pairs(r.data(), sh.n_heads, hd, var.style, row);
            ref_rope_pairs(r.data() + q_dim, sh.n_kv, hd, var.style, row);
            for (int i = 0; i < q_dim; ++i) err = std::max(err, std::fabs(double(gq[t * q_dim + i]) - r[i]));
            for (int i = 0; i < kv_dim; ++i) {
              err = std::max(err, std::fabs(double(gk[static_cast<size_t>(pos0 + t) * kv_dim + i]) - r[q_dim + i]));
              err = std::max(err, std::fabs(double(gv[static_cast<size_t>(pos0 + t) * kv_dim + i]) - r[q_dim + kv_dim + i]));
            }
          }
          EXPECT_LE(err, 1e-5);
          size_t wk = 0, wv = 0;
          for (float f : gk) wk += !is_poison(f);
          for (float f : gv) wv += !is_poison(f);
          EXPECT_EQ(wk, static_cast<size_t>(n) * kv_dim) << "only the n new K rows are written";
          EXPECT_EQ(wv, static_cast<size_t>(n) * kv_dim) << "only the n new V rows are written";
        }
      }
    }
  }
}

// Decode attention (one query) at the real shapes, with and without a window, at positions across the split
// thresholds up to 8191, split and unsplit; each launch twice (the combining block must re-arm its counter).
TEST(CudaArch, AttentionDecodeWindowScaleSplitAtRealShapes) {
  REQUIRE_GPU();
  const int n_ctx = 8192;
  struct Case {
    int shape;
    int window;
    float scale;  // 0: 1/sqrt(hd)
  };
  for (const Case c : {Case{0, 512, 0.f}, Case{0, 0, 0.f}, Case{1, 0, 0.f}, Case{1, 100, 0.3f}, Case{2, 0, 0.f},
                       Case{2, 4096, 0.05f}}) {
    const ArchShape& sh = kArchShapes[c.shape];
    const int hd = sh.hd, q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd;
    const float scale = c.scale > 0.f ? c.scale : 1.f / std::sqrt(static_cast<float>(hd));
    const std::vector<float> kc = random_vec(static_cast<size_t>(n_ctx) * kv_dim),
                             vc = random_vec(static_cast<size_t>(n_ctx) * kv_dim);
    DevBuf<float> kc_d(kc), vc_d(vc), out_d(q_dim);
    const int max_splits = arch_attn_max_splits(n_ctx);
    DevBuf<float> part_o(static_cast<size_t>(sh.n_heads) * max_splits * hd), part_ml(static_cast<size_t>(sh.n_heads) * max_splits * 2);
    DevBuf<unsigned int> counters(std::vector<unsigned int>(sh.n_heads, 0u));
    for (int pos : {0, 1, 31, 32, 33, 63, 64, 65, 130, 511, 512, 513, 1000, 4097, 8191}) {
      const std::vector<float> q = random_vec(q_dim, -1.5f, 1.5f);
      DevBuf<float> q_d(q);
      DevBuf<int32_t> pos_d(std::vector<int32_t>{pos});
      const std::vector<float> want = ref_attention_window(q.data(), kc.data(), vc.data(), sh.n_heads, sh.n_kv, hd,
                                                           pos, c.window, scale);
      for (int splits : {1, max_splits}) {
        for (int rep = 0; rep < 2; ++rep) {
          SCOPED_TRACE(std::string(sh.name) + " window " + std::to_string(c.window) + " pos " + std::to_string(pos) +
                       " max_splits " + std::to_string(splits) + " rep " + std::to_string(rep));
          ArchAttnArgs a;
          a.q = q_d.p;
          a.k_cache = kc_d.p;
          a.v_cache = vc_d.p;
          a.pos0 = pos_d.p;
          a.n = 1;
          a.n_heads = sh.n_heads;
          a.n_kv_heads = sh.n_kv;
          a.head_dim = hd;
          a.window = c.window;
          a.scale = scale;
          a.max_splits = splits;
          a.part_o = part_o.p;
          a.part_ml = part_ml.p;
          a.counters = counters.p;
          a.out = out_d.p;
          out_d.poison();
          launch_arch_attention(a, nullptr);
          CUDA_CHECK(cudaDeviceSynchronize());
          EXPECT_LE(max_abs_diff(out_d.download(), want), kTol);
        }
      }
    }
    const auto cnt = counters.download();
    EXPECT_EQ(cnt, std::vector<unsigned int>(sh.n_heads, 0u)) << "counters re-armed";
  }
}

// Decode attention with the QKV finish fused in: from the raw projection row it finishes q, k, v (bias, QK-norm,
// RoPE in either style), attends over the cache with this position's k, v, and appends them (row pos only), for
// the real shapes, split and unsplit, windowed and not.
TEST(CudaArch, AttentionDecodeWithFusedQkvFinish) {
  REQUIRE_GPU();
  const int n_ctx = 4200;
  for (const ArchShape& sh : kArchShapes) {
    const int hd = sh.hd, q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd, rows = q_dim + 2 * kv_dim;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    const std::vector<float> kc0 = random_vec(static_cast<size_t>(n_ctx) * kv_dim),
                             vc0 = random_vec(static_cast<size_t>(n_ctx) * kv_dim);
    const std::vector<float> bias = random_vec(rows, -0.5f, 0.5f), qn = random_vec(hd, 0.5f, 1.5f),
                             kn = random_vec(hd, 0.5f, 1.5f);
    DevBuf<float> bias_d(bias), qn_d(qn), kn_d(kn), out_d(q_dim);
    const int max_splits = arch_attn_max_splits(n_ctx);
    DevBuf<float> part_o(static_cast<size_t>(sh.n_heads) * max_splits * hd), part_ml(static_cast<size_t>(sh.n_heads) * max_splits * 2);
    DevBuf<unsigned int> counters(std::vector<unsigned int>(sh.n_heads, 0u));
    for (const RopeStyle style : {RopeStyle::Neox, RopeStyle::Interleaved}) {
      const auto table = rope_table_host(n_ctx, hd, sh.base, 1.f, nullptr);
      DevBuf<float2> table_d(table);
      for (int pos : {0, 5, 600, 4100}) {
        for (int splits : {1, max_splits}) {
          SCOPED_TRACE(std::string(sh.name) + (style == RopeStyle::Neox ? " neox" : " interleaved") + " pos " +
                       std::to_string(pos) + " max_splits " + std::to_string(splits));
          const std::vector<float> raw = random_vec(rows, -2.f, 2.f);
          std::vector<float> r = raw;
          if (sh.bias)
            for (int i = 0; i < rows; ++i) r[i] += bias[i];
          if (sh.qk_norm) {
            for (int h = 0; h < sh.n_heads; ++h) ref::rmsnorm(&r[h * hd], qn.data(), 1e-6f, hd, &r[h * hd]);
            for (int h = 0; h < sh.n_kv; ++h) ref::rmsnorm(&r[q_dim + h * hd], kn.data(), 1e-6f, hd, &r[q_dim + h * hd]);
          }
          const float2* row = table.data() + static_cast<size_t>(pos) * hd / 2;
          ref_rope_pairs(r.data(), sh.n_heads, hd, style, row);
          ref_rope_pairs(r.data() + q_dim, sh.n_kv, hd, style, row);
          std::vector<float> kc = kc0, vc = vc0;
          std::copy(r.begin() + q_dim, r.begin() + q_dim + kv_dim, kc.begin() + static_cast<size_t>(pos) * kv_dim);
          std::copy(r.begin() + q_dim + kv_dim, r.end(), vc.begin() + static_cast<size_t>(pos) * kv_dim);
          const std::vector<float> want =
              ref_attention_window(r.data(), kc.data(), vc.data(), sh.n_heads, sh.n_kv, hd, pos, sh.window, scale);
          DevBuf<float> raw_d(raw), kc_d(kc0), vc_d(vc0);  // row pos holds stale values until the kernel appends
          DevBuf<int32_t> pos_d(std::vector<int32_t>{pos});
          QkvFinishArgs f;
          f.qkv = raw_d.p;
          f.pos0 = pos_d.p;
          f.bias = sh.bias ? bias_d.p : nullptr;
          f.q_norm = sh.qk_norm ? qn_d.p : nullptr;
          f.k_norm = sh.qk_norm ? kn_d.p : nullptr;
          f.eps = 1e-6f;
          f.rope_table = table_d.p;
          f.style = style;
          f.n_heads = sh.n_heads;
          f.n_kv_heads = sh.n_kv;
          f.head_dim = hd;
          f.k_cache = kc_d.p;
          f.v_cache = vc_d.p;
          ArchAttnArgs a;
          a.k_cache = kc_d.p;
          a.v_cache = vc_d.p;
          a.pos0 = pos_d.p;
          a.n = 1;
          a.n_heads = sh.n_heads;
          a.n_kv_heads = sh.n_kv;
          a.head_dim = hd;
          a.window = sh.window;
          a.scale = scale;
          a.max_splits = splits;
          a.part_o = part_o.p;
          a.part_ml = part_ml.p;
          a.counters = counters.p;
          a.out = out_d.p;
          a.fused_finish = true;
          a.finish = f;
          for (int rep = 0; rep < 2; ++rep) {
            out_d.poison();
            launch_arch_attention(a, nullptr);
            CUDA_CHECK(cudaDeviceSynchronize());
            EXPECT_LE(max_abs_diff(out_d.download(), want), kTol) << "rep " << rep;
          }
          const auto gk = kc_d.download(), gv = vc_d.download();
          EXPECT_LE(max_abs_diff(gk, kc), 1e-5) << "K cache: row pos appended, the rest untouched";
          EXPECT_LE(max_abs_diff(gv, vc), 1e-5) << "V cache: row pos appended, the rest untouched";
        }
      }
    }
    EXPECT_EQ(counters.download(), std::vector<unsigned int>(sh.n_heads, 0u)) << "counters re-armed";
  }
}

// Prompt attention: n queries at pos0.. over the cache (their own rows included), windows across the chunk, output as
// fp32 rows and as operand rows (fp16 hi + lo).
TEST(CudaArch, AttentionPromptCausalWindowAndOperandOutput) {
  REQUIRE_GPU();
  const int n_ctx = 1200;
  for (int shape = 0; shape < 3; ++shape) {
    const ArchShape& sh = kArchShapes[shape];
    const int hd = sh.hd, q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    const std::vector<float> kc = random_vec(static_cast<size_t>(n_ctx) * kv_dim),
                             vc = random_vec(static_cast<size_t>(n_ctx) * kv_dim);
    DevBuf<float> kc_d(kc), vc_d(vc);
    struct Case {
      int n, pos0, window;
    };
    for (const Case c : {Case{1, 0, 0}, Case{7, 0, 0}, Case{40, 100, 32}, Case{77, 600, 512}, Case{130, 1000, 0},
                         Case{9, 3, 4}}) {
      SCOPED_TRACE(std::string(sh.name) + " n " + std::to_string(c.n) + " pos0 " + std::to_string(c.pos0) +
                   " window " + std::to_string(c.window));
      const std::vector<float> q = random_vec(static_cast<size_t>(c.n) * q_dim, -1.5f, 1.5f);
      DevBuf<float> q_d(q), out_d(static_cast<size_t>(c.n) * q_dim);
      DevBuf<int32_t> pos_d(std::vector<int32_t>{c.pos0});
      DevBuf<__half> op_d(static_cast<size_t>(2) * c.n * q_dim);
      ArchAttnArgs a;
      a.q = q_d.p;
      a.k_cache = kc_d.p;
      a.v_cache = vc_d.p;
      a.pos0 = pos_d.p;
      a.n = c.n;
      a.n_heads = sh.n_heads;
      a.n_kv_heads = sh.n_kv;
      a.head_dim = hd;
      a.window = c.window;
      a.scale = scale;
      a.out = out_d.p;
      out_d.poison();
      launch_arch_attention(a, nullptr);
      const auto got = out_d.download();
      std::vector<std::vector<float>> want(c.n);
      double err = 0;
      for (int t = 0; t < c.n; ++t) {
        want[t] = ref_attention_window(q.data() + static_cast<size_t>(t) * q_dim, kc.data(), vc.data(), sh.n_heads,
                                       sh.n_kv, hd, c.pos0 + t, c.window, scale);
        for (int i = 0; i < q_dim; ++i) err = std::max(err, std::fabs(double(got[t * q_dim + i]) - want[t][i]));
      }
      EXPECT_LE(err, kTol) << "fp32 rows";
      a.out = nullptr;
      a.out_half = op_d.p;
      launch_arch_attention(a, nullptr);
      const auto op = op_d.download();
      double e = 0;
      for (int t = 0; t < c.n; ++t) {
        const auto r = operand_row(op, t, q_dim);
        for (int i = 0; i < q_dim; ++i) e = std::max(e, std::fabs(double(r[i]) - want[t][i]));
      }
      EXPECT_LE(e, kTol) << "operand rows";
    }
  }
}

// The post-norm + residual add folded into the next norm+matvec (PreAdd) and the GELU epilogue of the gate/up kernel,
// as the general decode path uses them (Gemma 3: 5 launches per layer instead of 8), against the unfused host
// composition: x_next = x + rmsnorm(y0, w0); then W . rmsnorm(x_next, nw), or gelu/silu(gate) * up of it.
TEST(CudaArch, NormMatvecFoldedPostNormAddAndGeluEpilogue) {
  REQUIRE_GPU();
  for (const ArchShape& sh : kArchShapes) {
    const int d = sh.d, ff = sh.d_ff;
    for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::F16}) {
      SCOPED_TRACE(std::string(sh.name) + " " + type_name(t));
      auto wg = random_matrix(t, ff, d, 0.05f), wu = random_matrix(t, ff, d, 0.05f);
      GpuMatrix gu = to_gpu({&wg->view, &wu->view}), g1 = to_gpu({&wg->view});
      const std::vector<float> x = random_vec(d, -3.f, 3.f), y0 = random_vec(d, -20.f, 20.f),
                               w0 = random_vec(d, 0.5f, 1.5f), nw = random_vec(d, 0.5f, 1.5f);
      std::vector<float> xn = y0;
      ref::rmsnorm(xn.data(), w0.data(), kEps, d, xn.data());
      for (int i = 0; i < d; ++i) xn[i] += x[i];
      const std::vector<float> h = ref_rmsnorm(xn, nw, kEps);
      const std::vector<float> g = ref_matvec(wg->view, h), u = ref_matvec(wu->view, h);

      DevBuf<float> dx(x), dy0(y0), dw0(w0), dnw(nw), dxn(d), dy(ff), dact(ff + 64);
      dxn.poison();
      dy.poison();
      launch_norm_matvec(g1.m, dx.p, dnw.p, kEps, dy.p, nullptr, PreAdd{dy0.p, dw0.p, kEps, dxn.p});
      EXPECT_LE(max_abs_diff(dxn.download(), xn), 1e-5) << "x_next";
      EXPECT_EQ(dx.download(), x) << "the input residual buffer must stay as it was";
      EXPECT_LE(max_abs_diff(dy.download(), g), kTol) << "plain rows after the folded add";

      for (Activation act : {Activation::GeluTanh, Activation::Silu}) {
        dxn.poison();
        dact.poison();
        launch_norm_matvec_silu_glu(gu.m, dx.p, dnw.p, kEps, dact.p, nullptr, act, PreAdd{dy0.p, dw0.p, kEps, dxn.p});
        std::vector<float> want(ff);
        for (int j = 0; j < ff; ++j) {
          const double gj = g[j];
          const double a = act == Activation::Silu ? gj / (1 + std::exp(-gj))
                                                   : 0.5 * gj * (1 + std::tanh(0.7978845608028654 * (gj + 0.044715 * gj * gj * gj)));
          want[j] = static_cast<float>(a * u[j]);
        }
        const std::vector<float> got = dact.download();
        EXPECT_LE(max_abs_diff(std::vector<float>(got.begin(), got.begin() + ff), want), kTol)
            << (act == Activation::Silu ? "silu" : "gelu") << " epilogue after the folded add";
        for (int i = ff; i < ff + 64; ++i) EXPECT_TRUE(is_poison(got[i])) << "written past d_ff at " << i;
        EXPECT_LE(max_abs_diff(dxn.download(), xn), 1e-5) << "x_next (gate/up)";
      }
      // The sum may not overwrite the buffer the other blocks are reading.
      EXPECT_THROW(launch_norm_matvec(g1.m, dx.p, dnw.p, kEps, dy.p, nullptr, PreAdd{dy0.p, dw0.p, kEps, dx.p}),
                   EngineError);
    }
  }
}

TEST(CudaArch, EmbedScaledAddNormedAndGlu) {
  REQUIRE_GPU();
  for (const ArchShape& sh : kArchShapes) {
    SCOPED_TRACE(sh.name);
    const int d = sh.d, ff = sh.d_ff, vocab = 1000;
    // Embedding rows times the scale: exact.
    auto emb = random_matrix(GgmlType::Q8_0, vocab, d, 1.f);
    GpuMatrix ge = to_gpu({&emb->view});
    const float scale = std::sqrt(static_cast<float>(d));
    const std::vector<int32_t> toks = {3, 999, 0, 512};
    DevBuf<int32_t> toks_d(toks);
    DevBuf<float> x_d(toks.size() * d);
    x_d.poison();
    launch_embed_scaled(ge.m, nullptr, toks_d.p, static_cast<int>(toks.size()), scale, x_d.p, nullptr);
    const auto x = x_d.download();
    std::vector<float> row(d);
    for (size_t t = 0; t < toks.size(); ++t) {
      ref::dequantize_row(GgmlType::Q8_0, emb->view.row(toks[t]), row.data(), d);
      for (int i = 0; i < d; ++i) ASSERT_EQ(x[t * d + i], row[i] * scale) << "token " << toks[t] << " col " << i;
    }
    DevBuf<DecodeIO> io_d(std::vector<DecodeIO>{DecodeIO{777, 5}});
    DevBuf<float> x1_d(d);
    launch_embed_scaled(ge.m, io_d.p, nullptr, 1, scale, x1_d.p, nullptr);
    const auto x1 = x1_d.download();
    ref::dequantize_row(GgmlType::Q8_0, emb->view.row(777), row.data(), d);
    for (int i = 0; i < d; ++i) ASSERT_EQ(x1[i], row[i] * scale);

    // Post-norm + residual, 1 and 3 rows, with and without a norm weight.
    for (int n : {1, 3}) {
      const std::vector<float> y = random_vec(static_cast<size_t>(n) * d, -3.f, 3.f), res = random_vec(static_cast<size_t>(n) * d),
                               w = random_vec(d, 0.5f, 1.5f);
      DevBuf<float> y_d(y), w_d(w);
      for (bool with_w : {true, false}) {
        DevBuf<float> r_d(res);
        launch_add_normed(y_d.p, with_w ? w_d.p : nullptr, 1e-6f, n, d, r_d.p, nullptr);
        const auto got = r_d.download();
        double e = 0;
        for (int t = 0; t < n; ++t) {
          std::vector<float> yt(y.begin() + t * d, y.begin() + (t + 1) * d);
          if (with_w) ref::rmsnorm(yt.data(), w.data(), 1e-6f, d, yt.data());
          for (int i = 0; i < d; ++i) e = std::max(e, std::fabs(double(got[t * d + i]) - (res[t * d + i] + yt[i])));
        }
        EXPECT_LE(e, 1e-5) << "add_normed n " << n << (with_w ? " with weight" : " plain");
      }
    }

    // GLU: SiLU and GELU(tanh), fp32 rows and fp16 operand rows.
    for (int n : {1, 4}) {
      const std::vector<float> gu = random_vec(static_cast<size_t>(n) * 2 * ff, -4.f, 4.f);
      DevBuf<float> gu_d(gu), out_d(static_cast<size_t>(n) * ff);
      DevBuf<__half> op_d(static_cast<size_t>(2) * n * ff);
      for (Activation act : {Activation::Silu, Activation::GeluTanh}) {
        std::vector<float> want(static_cast<size_t>(n) * ff);
        for (int t = 0; t < n; ++t)
          for (int j = 0; j < ff; ++j) {
            const double g = gu[static_cast<size_t>(t) * 2 * ff + j], u = gu[static_cast<size_t>(t) * 2 * ff + ff + j];
            const double a = act == Activation::Silu ? g / (1 + std::exp(-g))
                                                     : 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
            want[static_cast<size_t>(t) * ff + j] = static_cast<float>(a * u);
          }
        launch_glu(gu_d.p, n, ff, act, out_d.p, nullptr, nullptr);
        EXPECT_LE(max_abs_diff(out_d.download(), want), 1e-5) << "glu fp32, n " << n;
        launch_glu(gu_d.p, n, ff, act, nullptr, op_d.p, nullptr);
        const auto op = op_d.download();
        double e = 0;
        for (int t = 0; t < n; ++t) {
          const auto r = operand_row(op, t, ff);
          for (int j = 0; j < ff; ++j) e = std::max(e, std::fabs(double(r[j]) - want[static_cast<size_t>(t) * ff + j]));
        }
        EXPECT_LE(e, 2e-5) << "glu operand rows, n " << n;
      }
    }
  }
}

// ------------------------------------------------------------------ whole models: CUDA general path vs the CPU backend

namespace {

struct ArchModelCase {
  const char* name;
  int n_layers, d, d_ff, n_heads, n_kv, hd, vocab, n_ctx;
  RopeStyle style;
  Activation act;
  bool bias, qk_norm, post_norms, rope_freqs;
  float embed_scale, attn_scale, rope_base;
  std::vector<LayerSpec> layers;
  GgmlType type;
  bool plain_expected;  // ModelSpec::plain_llama() (the fused path) for this case
  bool tied = false;    // lm_head = the embedding (which then favours the input token), else its own matrix
};

std::vector<ArchModelCase> arch_model_cases() {
  const float r320 = std::sqrt(320.f);
  return {
      {"qwen2", 3, 256, 640, 7, 1, 64, 3000, 160, RopeStyle::Neox, Activation::Silu, true, false, false, false, 1.f,
       0.f, 1e6f, {}, GgmlType::Q8_0, false},
      {"qwen3", 3, 256, 512, 8, 4, 128, 3000, 160, RopeStyle::Neox, Activation::Silu, false, true, false, false, 1.f,
       0.f, 1e6f, {}, GgmlType::Q4_0, false, true},
      {"gemma3", 3, 320, 640, 4, 1, 256, 3000, 160, RopeStyle::Neox, Activation::GeluTanh, false, true, true, false,
       r320, 0.f, 1e6f, {{10000.f, 1.f, 16}, {10000.f, 1.f, 16}, {1e6f, 1.f, 0}}, GgmlType::Q8_0, false},
      {"llama3-linear-rope", 2, 256, 512, 4, 2, 64, 3000, 160, RopeStyle::Interleaved, Activation::Silu, false, false,
       false, true, 1.f, 0.f, 500000.f, {{500000.f, 0.5f, 0}, {500000.f, 0.5f, 0}}, GgmlType::Q4_1, false},
      // hd 96, a stated attention scale and a window on every layer.
      {"windowed-scaled-hd96", 2, 192, 384, 6, 3, 96, 3000, 160, RopeStyle::Interleaved, Activation::Silu, false,
       false, false, false, 1.f, 0.2f, 10000.f, {{10000.f, 1.f, 24}, {10000.f, 1.f, 24}}, GgmlType::Q8_0, false},
      // The plain Llama layer with Llama 3 RoPE factors: the fused path with the factors in its table.
      {"llama3-rope-freqs-plain", 2, 256, 512, 4, 2, 64, 3000, 160, RopeStyle::Interleaved, Activation::Silu, false,
       false, false, true, 1.f, 0.f, 500000.f, {}, GgmlType::Q4_0, true},
  };
}

std::unique_ptr<TestModel> make_arch_model(const ArchModelCase& c) {
  auto m = std::make_unique<TestModel>();
  ModelSpec& s = m->spec;
  s.n_layers = c.n_layers;
  s.d_model = c.d;
  s.d_ff = c.d_ff;
  s.n_heads = c.n_heads;
  s.n_kv_heads = c.n_kv;
  s.head_dim = c.hd;
  s.vocab = c.vocab;
  s.n_ctx = c.n_ctx;
  s.rope_base = c.rope_base;
  s.rms_eps = 1e-6f;
  s.rope_style = c.style;
  s.activation = c.act;
  s.embed_scale = c.embed_scale;
  s.attn_scale = c.attn_scale;
  s.attn_bias = c.bias;
  s.qk_norm = c.qk_norm;
  s.post_norms = c.post_norms;
  s.layers = c.layers;
  const float sd = 1.f / std::sqrt(static_cast<float>(c.d)), sf = 1.f / std::sqrt(static_cast<float>(c.d_ff)),
              sq = 1.f / std::sqrt(static_cast<float>(s.q_dim()));
  // Logits of std ~sqrt(d).
  m->w.tok_embd = m->add(GgmlType::Q8_0, c.vocab, c.d, 1.f);
  m->w.output = c.tied ? m->w.tok_embd : m->add(GgmlType::Q8_0, c.vocab, c.d, 1.f);
  m->w.output_norm = m->norm(c.d);
  if (c.rope_freqs) {
    m->norms.emplace_back(c.hd / 2);
    for (int i = 0; i < c.hd / 2; ++i) m->norms.back()[i] = 1.f + 7.f * i / (c.hd / 2 - 1);
    m->w.rope_freqs = m->norms.back().data();
  }
  auto vec = [&](int n, float lo, float hi) {
    m->norms.push_back(random_vec(n, lo, hi));
    return m->norms.back().data();
  };
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights L;
    L.attn_norm = m->norm(c.d);
    L.wq = m->add(c.type, s.q_dim(), c.d, 2.f * sd);
    L.wk = m->add(c.type, s.kv_dim(), c.d, 2.f * sd);
    L.wv = m->add(c.type, s.kv_dim(), c.d, sd);
    L.wo = m->add(c.type, c.d, s.q_dim(), 0.5f * sq);
    if (c.bias) {
      L.bq = vec(s.q_dim(), -0.5f, 0.5f);
      L.bk = vec(s.kv_dim(), -0.5f, 0.5f);
      L.bv = vec(s.kv_dim(), -0.5f, 0.5f);
    }
    if (c.qk_norm) {
      L.q_norm = vec(c.hd, 0.6f, 1.4f);
      L.k_norm = vec(c.hd, 0.6f, 1.4f);
    }
    if (c.post_norms) {
      L.post_attn_norm = vec(c.d, 1.f, 3.f);  // the layers' share of a residual stream that starts at embed_scale
      L.post_ffn_norm = vec(c.d, 1.f, 3.f);
    }
    L.ffn_norm = m->norm(c.d);
    L.w_gate = m->add(c.type, c.d_ff, c.d, sd);
    L.w_up = m->add(c.type, c.d_ff, c.d, sd);
    L.w_down = m->add(c.type, c.d, c.d_ff, 0.5f * sf);
    m->w.layers.push_back(L);
  }
  return m;
}

// The CPU backend on its scalar path (float activations: the reference every backend is held to).
std::unique_ptr<Backend> make_scalar_cpu_backend(const TestModel& m) {
  const char* prev = std::getenv("METALATTN_CPU_ISA");
  const std::string saved = prev != nullptr ? prev : "";
  setenv("METALATTN_CPU_ISA", "scalar", 1);
  auto be = make_cpu_backend(m.spec, m.w, 4);
  if (prev != nullptr) setenv("METALATTN_CPU_ISA", saved.c_str(), 1);
  else unsetenv("METALATTN_CPU_ISA");
  return be;
}

// Logits of every position of a decode of `toks` (token by token).
std::vector<float> decode_all(Backend& be, const std::vector<int32_t>& toks, int V) {
  std::vector<float> all(toks.size() * V, NAN);
  for (size_t p = 0; p < toks.size(); ++p) be.forward_token(toks[p], static_cast<int>(p), all.data() + p * V);
  return all;
}

std::vector<float> row_of(const std::vector<float>& all, int p, int V) {
  return std::vector<float>(all.begin() + static_cast<size_t>(p) * V, all.begin() + static_cast<size_t>(p + 1) * V);
}

// Relative L2 within tol, and the same argmax unless the reference's own top two are within 1e-4 of its rms (a tie
// that float rounding may break either way).
void expect_logits_close_or_tie(const std::vector<float>& got, const std::vector<float>& want, double tol,
                                const char* what) {
  const double e = rel_l2(got, want);
  EXPECT_LE(e, tol) << what;
  const uint32_t a = ref::argmax(got.data(), static_cast<int>(got.size())).token;
  const uint32_t b = ref::argmax(want.data(), static_cast<int>(want.size())).token;
  if (a == b) return;
  double ss = 0;
  for (float f : want) ss += static_cast<double>(f) * f;
  const double rms = std::sqrt(ss / want.size());
  EXPECT_LE(static_cast<double>(want[b]) - (a < want.size() ? want[a] : -INFINITY), 1e-4 * rms)
      << what << ": argmax " << a << " vs reference " << b << " (rel L2 " << e << ")";
}

}  // namespace

// Decode (graph and debug/eager), the residual stream after every layer, prompts (one chunk, and continued from the
// cache) and a 64-step greedy run of the CUDA backend against the CPU backend, for each architecture, with positions
// well past every sliding window.
TEST(CudaArch, WholeModelsMatchCpuBackend) {
  REQUIRE_GPU();
  for (const ArchModelCase& c : arch_model_cases()) {
    SCOPED_TRACE(c.name);
    auto m = make_arch_model(c);
    EXPECT_EQ(m->spec.plain_llama(), c.plain_expected);
    // Qwen 2's layer (biases, NeoX pairs) decodes on the fused kernels; its prompts take the general path.
    const bool fused_decode = c.plain_expected || std::string(c.name) == "qwen2";
    EXPECT_EQ(m->spec.llama_layer_up_to_qkv(), fused_decode);
    auto gpu = make_cuda_backend(m->spec, m->w, false);
    auto dbg = make_cuda_backend(m->spec, m->w, true);
    auto cpu = make_scalar_cpu_backend(*m);
    const ModelSpec& s = m->spec;
    const int V = s.vocab, n = 100;
    if (!fused_decode) {
      // Post-norm + residual adds fold into the next layer's kernels (PreAdd), the last layer's is one more launch.
      EXPECT_EQ(gpu->kernels_per_token(), 2 + 5 * s.n_layers + (s.post_norms ? 1 : 0));
    } else {
      EXPECT_EQ(gpu->kernels_per_token(), 5 * s.n_layers + 1);
    }
    const std::vector<int32_t> toks = random_tokens(n, V);
    // METALATTN_TEST_QUICK=1 (for the slow race checker): the GPU decodes the first 12 positions (not 100), the debug
    // backend's residual stream is read at position 8 (not 40) and the greedy run takes 8 steps (not 64). The prompts
    // are the same: every kernel still runs.
    const bool quick = quick_mode();
    const int n_dec = quick ? 12 : n, p_dbg = quick ? 8 : 40, n_greedy = quick ? 8 : 64;

    // Decode, every position.
    const std::vector<float> want = decode_all(*cpu, toks, V);
    const std::vector<float> got = decode_all(*gpu, std::vector<int32_t>(toks.begin(), toks.begin() + n_dec), V);
    double worst = 0;
    for (int p = 0; p < n_dec; ++p) {
      SCOPED_TRACE("decode pos " + std::to_string(p));
      const auto a = row_of(got, p, V), b = row_of(want, p, V);
      worst = std::max(worst, rel_l2(a, b));
      expect_logits_close_or_tie(a, b, 1e-3, "decode logits vs CPU");
    }
    std::printf("[ %s: decode rel L2 vs CPU, worst of %d positions: %.2e ]\n", c.name, n_dec, worst);

    // Debug (eager launches) with the residual stream: identical to the graph, hidden states near the CPU's.
    {
      std::vector<float> hid_g((s.n_layers + 1) * s.d_model, NAN), hid_c(hid_g.size(), NAN), lg(V, NAN), lc(V, NAN);
      for (int p = 0; p < p_dbg; ++p) dbg->forward_token_greedy(toks[p], p);
      dbg->forward_token_debug(toks[p_dbg], p_dbg, hid_g.data(), lg.data());
      cpu->forward_token_debug(toks[p_dbg], p_dbg, hid_c.data(), lc.data());
      EXPECT_LE(rel_l2(hid_g, hid_c), 1e-4) << "residual stream after each layer";
      EXPECT_EQ(lg, row_of(got, p_dbg, V)) << "eager launches and the graph are the same kernels";
    }

    // Prompts: all logits of one chunk, then the same tokens in two pieces (the second continuing from the cache).
    {
      std::vector<float> all(static_cast<size_t>(n) * V, NAN), last(V, NAN);
      const ArgmaxResult r = gpu->forward_prompt(toks.data(), n, 0, last.data(), all.data());
      double worst_p = 0;
      for (int p = 0; p < n; ++p) {
        SCOPED_TRACE("prompt pos " + std::to_string(p));
        const auto a = row_of(all, p, V), b = row_of(want, p, V);
        worst_p = std::max(worst_p, rel_l2(a, b));
        expect_logits_close_or_tie(a, b, 1e-3, "prompt logits vs CPU decode");
      }
      std::printf("[ %s: prompt rel L2 vs CPU, worst of %d positions: %.2e ]\n", c.name, n, worst_p);
      EXPECT_EQ(last, row_of(all, n - 1, V));
      EXPECT_EQ(r.token, ref::argmax(last.data(), V).token);
      gpu->forward_prompt(toks.data(), 37, 0, nullptr, nullptr);
      std::vector<float> last2(V, NAN);
      gpu->forward_prompt(toks.data() + 37, n - 37, 37, last2.data(), nullptr);
      expect_logits_close_or_tie(last2, row_of(want, n - 1, V), 1e-3, "prompt continued at pos 37");
      for (int len : {1, 2, 5}) {  // short prompts (a one-token prompt takes the split decode attention)
        std::vector<float> l(V, NAN);
        gpu->forward_prompt(toks.data(), len, 0, l.data(), nullptr);
        expect_logits_close_or_tie(l, row_of(want, len - 1, V), 1e-3, "short prompt");
      }
    }

    // Greedy: 8 prompt tokens, then 64 steps fed back on the device; the CPU, given the same tokens, must agree on
    // each choice unless its own top two logits are within 2e-3 of each other (logits are of std ~16).
    {
      gpu->forward_prompt(toks.data(), 8, 0, nullptr, nullptr);
      cpu->forward_prompt(toks.data(), 8, 0, nullptr, nullptr);
      int32_t tok = toks[8];
      std::vector<float> lc(V);
      int disagreements = 0;
      for (int p = 8; p < 8 + n_greedy; ++p) {
        const ArgmaxResult r = gpu->forward_token_greedy(tok, p);
        cpu->forward_token(tok, p, lc.data());
        const ArgmaxResult rc = ref::argmax(lc.data(), V);
        if (r.token != rc.token) {
          ++disagreements;
          EXPECT_LE(std::fabs(lc[rc.token] - lc[r.token]), 2e-3) << "greedy step at pos " << p;
        }
        tok = static_cast<int32_t>(r.token);
      }
      EXPECT_LE(disagreements, 1);
    }
  }
}

// A plain Llama model forced onto the general path (METALATTN_CUDA_GENERAL=1) against the fused path: the same
// model computed by different kernels agrees within the reference bound, prompts included.
TEST(CudaArch, GeneralPathOnPlainLlamaMatchesFusedPath) {
  REQUIRE_GPU();
  auto m = make_model(3, 2048, 300, GgmlType::Q4_0, GgmlType::Q8_0);
  const char* prev = std::getenv("METALATTN_CUDA_GENERAL");
  const std::string saved = prev != nullptr ? prev : "";
  setenv("METALATTN_CUDA_GENERAL", "1", 1);
  auto general = make_cuda_backend(m->spec, m->w, false);
  setenv("METALATTN_CUDA_GENERAL", "0", 1);
  auto fused = make_cuda_backend(m->spec, m->w, false);
  if (prev != nullptr) setenv("METALATTN_CUDA_GENERAL", saved.c_str(), 1);
  else unsetenv("METALATTN_CUDA_GENERAL");
  EXPECT_EQ(general->kernels_per_token(), 2 + 5 * 3);
  EXPECT_EQ(fused->kernels_per_token(), 5 * 3 + 1);
  decode_side_by_side(
      *m, *general, *fused, 280, [](int p) { return p < 3 || p % 31 == 0 || p >= 270; },
      [](const std::vector<float>& lg, const std::vector<float>& lf, const std::vector<float>& want) {
        expect_logits_close(lg, want, 1e-3, "general path vs reference");
        expect_logits_close(lg, lf, 1e-3, "general path vs fused path");
      },
      {3, 270});
  const std::vector<int32_t> toks = random_tokens(200, m->spec.vocab);
  std::vector<float> a(m->spec.vocab), b(m->spec.vocab);
  general->forward_prompt(toks.data(), 200, 0, a.data(), nullptr);
  fused->forward_prompt(toks.data(), 200, 0, b.data(), nullptr);
  expect_logits_close(a, b, 1e-3, "prompt: general path vs fused path");
}

// What the general path still refuses: head_dim above 256 or not a multiple of 32 (BackendUnsupported, so that
// device="auto" falls back to the CPU).
TEST(CudaArch, RefusesHeadDimBeyondTheKernels) {
  REQUIRE_GPU();
  for (int hd : {320, 80}) {
    ArchModelCase c = arch_model_cases()[1];
    c.hd = hd;
    c.n_heads = 2;
    c.n_kv = 1;
    auto m = make_arch_model(c);
    EXPECT_THROW(make_cuda_backend(m->spec, m->w, false), BackendUnsupported) << "head_dim " << hd;
  }
}

// Batched decode (forward_batch) against the scalar CPU backend's, on the plain Llama path (tensor-core projections,
// 40 slots: five parallel chains of 8 rows, the last joining late) and the general path (Qwen 2 biases, Gemma 3 windows and post-norms):
// sequences of different lengths in their own slots, rows in an order that is not the slots', a row joining late,
// and each batch shape run several times (graph capture from a shape's second use). Slot-0 decode afterwards still
// matches: the batch left it alone.
TEST(CudaBatch, RowsMatchCpuBatchAcrossSlotsAndPaths) {
  REQUIRE_GPU();
  struct Case {
    std::string name;
    std::unique_ptr<TestModel> m;
  };
  std::vector<Case> cases;
  cases.push_back({"plain-smollm2-shape", make_model(3, 3000, 96, GgmlType::Q4_0, GgmlType::Q8_0)});
  for (const ArchModelCase& c : arch_model_cases())
    if (std::string(c.name) == "qwen2" || std::string(c.name) == "gemma3") cases.push_back({c.name, make_arch_model(c)});
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    ModelSpec& s = c.m->spec;
    s.n_seq = c.name == "plain-smollm2-shape" ? 40 : 5;
    s.n_ctx = 96;
    auto gpu = make_cuda_backend(s, c.m->w, false);
    auto cpu = make_scalar_cpu_backend(*c.m);
    const int V = s.vocab, S = s.n_seq;
    std::vector<int> pos(S);
    std::mt19937 gen(7);
    for (int slot = 0; slot < S - 1; ++slot) {  // the last slot stays empty until it joins
      const int len = 1 + static_cast<int>(gen() % 40);
      const std::vector<int32_t> p = random_tokens(len, V);
      gpu->forward_prompt(p.data(), len, 0, nullptr, nullptr, slot);
      cpu->forward_prompt(p.data(), len, 0, nullptr, nullptr, slot);
      pos[slot] = len;
    }
    for (int step = 0; step < 4; ++step) {
      std::vector<int32_t> slots;
      for (int slot = S - 1; slot >= 0; --slot)
        if (slot != S - 1 || step >= 2) slots.push_back(slot);
      const int n = static_cast<int>(slots.size());
      const std::vector<int32_t> toks = random_tokens(n, V);
      std::vector<int32_t> ps(n);
      for (int i = 0; i < n; ++i) ps[i] = pos[slots[i]];
      std::vector<float> lg(static_cast<size_t>(n) * V, NAN), lc(lg.size(), NAN);
      std::vector<ArgmaxResult> rg(n), rc(n);
      gpu->forward_batch(toks.data(), slots.data(), ps.data(), n, lg.data(), rg.data());
      cpu->forward_batch(toks.data(), slots.data(), ps.data(), n, lc.data(), rc.data());
      for (int i = 0; i < n; ++i) {
        SCOPED_TRACE("step " + std::to_string(step) + " row " + std::to_string(i) + " slot " + std::to_string(slots[i]));
        const auto a = row_of(lg, i, V), b = row_of(lc, i, V);
        expect_logits_close_or_tie(a, b, 1e-3, "batch row vs CPU");
        EXPECT_EQ(rg[i].token, ref::argmax(a.data(), V).token);
      }
      for (int i = 0; i < n; ++i) ++pos[slots[i]];
    }
    // Slot 0 continues by single-sequence decode from where the batch left it.
    std::vector<float> a(V, NAN), b(V, NAN);
    gpu->forward_token(5, pos[0], a.data());
    cpu->forward_token(5, pos[0], b.data());
    expect_logits_close_or_tie(a, b, 1e-3, "slot-0 decode after batches");
    const int32_t one = 1, bad_slot = S, zero = 0;
    ArgmaxResult r{};
    EXPECT_THROW(gpu->forward_batch(&one, &bad_slot, &zero, 1, nullptr, &r), EngineError);
  }
}

// launch_rows_argmax against ref::argmax: random rows at the vocabularies the models use, NaN sprinkled in, ties
// (the lower index wins), a row of -inf, and a row of nothing but NaN (kNoIndex), from a NaN-poisoned result buffer.
TEST(CudaArch, RowsArgmaxMatchesReference) {
  REQUIRE_GPU();
  for (int vocab : {3000, 49152, 151936, 262144}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const int n = 6;
    std::vector<float> h = random_vec(static_cast<size_t>(n) * vocab, -20.f, 20.f);
    float* r1 = h.data() + vocab;
    for (int i = 0; i < vocab; i += 7) r1[i] = NAN;
    float* r2 = h.data() + 2 * vocab;  // a tie at the maximum: the lower index wins
    r2[vocab / 3] = 50.f;
    r2[vocab - 5] = 50.f;
    r2[vocab / 2] = NAN;
    float* r3 = h.data() + 3 * vocab;
    std::fill(r3, r3 + vocab, -INFINITY);
    float* r4 = h.data() + 4 * vocab;
    std::fill(r4, r4 + vocab, NAN);
    float* r5 = h.data() + 5 * vocab;
    r5[vocab - 1] = INFINITY;
    DevBuf<float> logits(h);
    DevBuf<ArgmaxResult> out(n);
    out.poison();
    launch_rows_argmax(logits.p, n, vocab, out.p, nullptr);
    CUDA_CHECK(cudaGetLastError());
    const std::vector<ArgmaxResult> got = out.download();
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE("row " + std::to_string(r));
      if (r == 4) {
        EXPECT_EQ(got[r].token, kNoIndex);
        continue;
      }
      const ArgmaxResult want = ref::argmax(h.data() + static_cast<size_t>(r) * vocab, vocab);
      EXPECT_EQ(got[r].token, want.token);
      EXPECT_EQ(got[r].value, want.value);
    }
    EXPECT_EQ(got[2].token, static_cast<uint32_t>(vocab / 3));
    EXPECT_EQ(got[3].token, 0u);
  }
}
