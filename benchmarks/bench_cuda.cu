// CUDA backend benchmark on a random SmolLM2-135M-shaped model (layers Q4_0, token_embd Q8_0 tied), as in
// benchmarks/RESULTS.md: decode tg128 after a 32-token prompt, prefill pp512, time to first token of a 32-token
// prompt, and the time of each decode kernel (each captured 200 times in a graph and replayed, without PDL).
//   bench_cuda [n_ctx=2048]
// Environment: METALATTN_CUDA_PDL=0 turns off Programmatic Dependent Launch in the decode graph,
// `bench_cuda <n_ctx> kernels` runs only the per-kernel section (for profilers); `bench_cuda <n_ctx> trace` (a
// -DMETALATTN_TRACE build, see benchmarks/device/trace.sh) shows where a decode step's time goes inside the kernel
// chain. `bench_cuda <n_ctx> q4_k_m` runs the whole benchmark on the same shapes with the tensor types of the real
// SmolLM2-135M Q4_K_M file (q, k, o, gate, up Q5_0; v Q8_0 / Q5_0 and down Q6_K / Q4_K alternating by layer;
// token_embd Q8_0); `bench_cuda <n_ctx> types` times one matvec per weight type at Llama 3.2 1B's shapes (graph
// replay, effective GB/s of the GPU layout's bytes); `bench_cuda <n_ctx> decode` stops after the decode tg128 and
// sampled lines; `bench_cuda <n_ctx> sample` times the device draw of sampled decoding alone (bench_sample).
// METALATTN_BENCH_SHAPE=qwen takes Qwen2.5-0.5B's shape instead (24 layers, d 896, ffn 4864, 14/2 heads, vocab
// 151,936) with its Q4_K_M file's types, Q/K/V biases and NeoX RoPE (the paths the real file takes: the fused decode
// kernels with their bias and pair gathering, the plain path's prompt kernels; before session 31 the shape had no
// biases and interleaved pairs, so older qwen figures are not comparable); METALATTN_BENCH_SHAPE=1.7b takes
// SmolLM2-1.7B's (24 layers, d 2048, ffn 8192, 32/32 heads, vocab 49,152) with the 135M's types; =360m SmolLM2-360M's
// (32 layers, d 960, ffn 2560, 15/5 heads); =gemma Gemma 3 270M's (18 layers, d 640, ffn 2048, 4/1 heads of 256,
// vocab 262,144, QK-norm, post-norms, GELU, five 512-position sliding-window layers to one global) with its Q4_K_M
// file's types: the general path (cuda_general.cu), whose attention and norm+matvec kernels the trace names; its
// whole table (decode, first token, prompt lengths) runs too.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <string>
#include <memory>
#include <random>
#include <vector>

#include "cpu/reference.h"
#include "engine/sampling.h"
#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "trace.cuh"
#include "metalattn/backend.h"

using namespace metalattn;
using namespace metalattn::cuda;
using Clock = std::chrono::steady_clock;

namespace {

std::mt19937 g_rng(12345);

uint16_t to_fp16(float f) {
  __half_raw r = __half(__float2half(f));
  return r.x;
}

struct Storage {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::vector<float>> floats;
};

WeightView random_q(Storage& st, GgmlType t, int64_t rows, int64_t cols, float sigma) {
  const size_t rb = row_bytes(t, cols);
  st.bytes.emplace_back(rb * rows);
  uint8_t* p = st.bytes.back().data();
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  if (t != GgmlType::Q4_0 && t != GgmlType::Q8_0) {
    // The other quantized types: random bytes, then each block's fp16 scale fields set so that the weights have a
    // standard deviation of about sigma (the same recipe as the GoogleTests' random_matrix).
    for (auto& b : st.bytes.back()) b = static_cast<uint8_t>(byte(g_rng));
    const int64_t n_blocks = rows * (cols / block_elems(t));
    for (int64_t k = 0; k < n_blocks; ++k) {
      uint8_t* b = p + k * block_bytes(t);
      const float v = u(g_rng);
      auto set = [&](size_t off, float f) {
        const uint16_t h = to_fp16(f);
        std::memcpy(b + off, &h, 2);
      };
      switch (t) {
        case GgmlType::Q5_0: set(0, sigma / 9.2f * v); break;
        case GgmlType::Q5_1: set(0, sigma / 9.2f * v); set(2, -15.5f * sigma / 9.2f * v); break;
        case GgmlType::Q4_K: set(0, sigma / 350.f * v); set(2, 7.5f * sigma / 350.f * v); break;
        case GgmlType::Q5_K: set(0, sigma / 700.f * v); set(2, 15.5f * sigma / 700.f * v); break;
        case GgmlType::Q6_K: set(offsetof(block_q6_K, d), sigma / 1400.f * v); break;
        case GgmlType::Q3_K: set(offsetof(block_q3_K, d), sigma / 47.f * v); break;
        case GgmlType::Q2_K:
          set(offsetof(block_q2_K, d), sigma / 17.f * v);
          set(offsetof(block_q2_K, dmin), 1.5f * sigma / 17.f * v);
          break;
        default: std::fprintf(stderr, "random_q: no generator for %s\n", type_name(t)); std::exit(1);
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols / 32; ++k) {
        if (t == GgmlType::Q4_0) {
          auto* b = reinterpret_cast<block_q4_0*>(p + r * rb) + k;
          b->d = to_fp16(sigma / 4.6f * u(g_rng));
          for (auto& q : b->qs) q = static_cast<uint8_t>(byte(g_rng));
        } else {
          auto* b = reinterpret_cast<block_q8_0*>(p + r * rb) + k;
          b->d = to_fp16(sigma / 73.f * u(g_rng));
          for (auto& q : b->qs) q = static_cast<int8_t>(byte(g_rng) - 128);
        }
      }
  }
  WeightView w;
  w.type = t;
  w.data = p;
  w.rows = rows;
  w.cols = cols;
  return w;
}

// n floats uniform in [lo, hi), kept in st.
const float* random_floats(Storage& st, int n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  st.floats.emplace_back(n);
  for (float& x : st.floats.back()) x = u(g_rng);
  return st.floats.back().data();
}
const float* random_norm(Storage& st, int n) { return random_floats(st, n, 0.6f, 1.4f); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Median time of one launch of `body`, captured `reps` times into a graph and replayed.
template <typename F>
double graph_time_us(cudaStream_t s, F body, int reps = 200) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < reps; ++i) body();
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int it = 0; it < 7; ++it) {
    CUDA_CHECK(cudaEventRecord(a, s));
    CUDA_CHECK(cudaGraphLaunch(ge, s));
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (it > 0) t.push_back(ms * 1000.0 / reps);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return median(t);
}

// Per kernel kind: median time from the previous kernel's exit to this kernel's release from its programmatic
// wait (the chain hand-over), and from release to exit (the work after the wait), over several decode steps.
void print_decode_trace(Backend& be, const std::vector<int32_t>& prompt, int n_layers, int n_ctx) {
  const char* names[kTraceKinds] = {"norm+gate/up", "norm+qkv", "matvec+residual", "attention", "lm_head+argmax",
                                    "down+residual", "norm+matvec", "matvec->tmp"};
  // Positions past 1000 only where the context holds them and the 24 steps after (bench_cuda 8192 trace: the
  // depth of issue 13's 8,000-position target).
  for (int pos : {32, 160, 1000, 4000, 8000}) {
    if (pos + 24 > n_ctx || pos > static_cast<int>(prompt.size())) continue;
    ArgmaxResult r = be.forward_prompt(prompt.data(), pos, 0, nullptr, nullptr);
    for (int i = 0; i < 3; ++i) r = be.forward_token_greedy(static_cast<int32_t>(r.token), pos + i);  // warm-up
    std::vector<std::vector<double>> handover(kTraceKinds), work(kTraceKinds), enter_early(kTraceKinds),
        span(kTraceKinds);
    std::vector<double> step;
    std::vector<std::vector<std::vector<double>>> marks(kTraceKinds, std::vector<std::vector<double>>(kTraceMarks));
    for (int rep = 0; rep < 20; ++rep) {
      if (!trace_reset()) {
        std::printf("trace: this build has no METALATTN_TRACE\n");
        return;
      }
      be.forward_prompt(prompt.data(), pos, 0, nullptr, nullptr);
      be.forward_token_greedy(static_cast<int32_t>(r.token), pos);
      (void)trace_reset();
      be.forward_token_greedy(static_cast<int32_t>(r.token), pos);
      const std::vector<TraceRecord> t = trace_read();
      // METALATTN_TRACE_BLOCKS=<prefix>: every block of the last traced step at this position, as CSV
      // (<prefix>.pos<pos>.csv: kind, block, sm, enter, released, exit in ns from the step's first stamp).
      if (const char* prefix = std::getenv("METALATTN_TRACE_BLOCKS"); prefix != nullptr && rep == 19) {
        const std::vector<TraceBlock> bl = trace_read_blocks();
        const std::string path = std::string(prefix) + ".pos" + std::to_string(pos) + ".csv";
        if (FILE* f = std::fopen(path.c_str(), "w"); f != nullptr && !bl.empty()) {
          unsigned long long t0 = bl[0].enter;
          for (const TraceBlock& b : bl) t0 = std::min(t0, b.enter);
          std::fprintf(f, "kind,block,sm,enter,released,exit\n");
          for (const TraceBlock& b : bl)
            std::fprintf(f, "%s,%d,%d,%lld,%lld,%lld\n", names[b.kind], b.block, b.sm,
                         static_cast<long long>(b.enter - t0), static_cast<long long>(b.released - t0),
                         static_cast<long long>(b.exit - t0));
          std::fclose(f);
        }
      }
      unsigned blocks[kTraceKinds], late[kTraceKinds];
      trace_block_counts(blocks, late);
      if (rep == 0) {
        std::printf("pos %d, blocks released < 1 us after entering / all blocks:", pos);
        for (int k = 0; k < kTraceKinds; ++k)
          if (blocks[k] > 0) std::printf(" %s %u/%u", names[k], late[k], blocks[k]);
        std::printf("\n");
      }
      if (t.size() < static_cast<size_t>(2 * n_layers + 1)) {
        std::printf("trace: %zu records, expected at least %d\n", t.size(), 2 * n_layers + 1);
        return;
      }
      step.push_back((t.back().exit - t.front().enter) * 1e-3);
      for (size_t k = 1; k < t.size(); ++k) {
        handover[t[k].kind].push_back((static_cast<double>(t[k].released) - t[k - 1].exit) * 1e-3);
        work[t[k].kind].push_back((t[k].exit - t[k].released) * 1e-3);
        enter_early[t[k].kind].push_back((static_cast<double>(t[k - 1].exit) - t[k].enter) * 1e-3);
        // The kernel's whole share of the chain: its release to the next kernel's release (its slowest block and
        // the hand-over included).
        if (k + 1 < t.size())
          span[t[k].kind].push_back((static_cast<double>(t[k + 1].released) - t[k].released) * 1e-3);
        for (int i = 0; i < kTraceMarks; ++i)
          if (t[k].mark[i] != 0) marks[t[k].kind][i].push_back((static_cast<double>(t[k].mark[i]) - t[k].released) * 1e-3);
      }
    }
    std::printf("decode step at pos %d: %.1f us from the first kernel's entry to the last one's exit (median of %zu)\n",
                pos, median(step), step.size());
    std::printf("  %-16s %6s %14s %12s %16s %22s\n", "kernel", "count", "hand-over us", "work us", "entered early us",
                "release to next us");
    for (int k = 0; k < kTraceKinds; ++k)
      if (!work[k].empty())
      {
        std::printf("  %-16s %6zu %14.2f %12.2f %16.2f %22.2f", names[k], work[k].size() / step.size(),
                    median(handover[k]), median(work[k]), median(enter_early[k]),
                    span[k].empty() ? 0.0 : median(span[k]));
        for (int i = 0; i < kTraceMarks; ++i)
          if (!marks[k][i].empty()) std::printf("  mark%d +%.2f", i, median(marks[k][i]));
        std::printf("\n");
      }
  }
}


// One DevMatrix on the device (freed by the caller through bufs).
DevMatrix upload_matrix(const std::vector<const WeightView*>& parts, std::vector<void*>& bufs) {
  const PackedMatrix p = pack_matrix(parts, common_exact_type(parts));
  DevMatrix m;
  m.type = p.type;
  m.rows = p.rows;
  m.cols = p.cols;
  m.nb = p.nb;
  auto put = [&](const void* src, size_t bytes) -> void* {
    if (bytes == 0) return nullptr;
    void* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, bytes));
    CUDA_CHECK(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
    bufs.push_back(d);
    return d;
  };
  m.payload = static_cast<const uint8_t*>(put(p.payload.data(), p.payload.size()));
  m.scales = static_cast<const uint16_t*>(put(p.scales.data(), p.scales.size() * 2));
  m.aux = static_cast<const uint32_t*>(put(p.aux.data(), p.aux.size() * 4));
  m.mma_scales = static_cast<const float2*>(put(p.mma_scales.data(), p.mma_scales.size() * 4));
  return m;
}

// bench_cuda <n_ctx> types: norm+matvec (QKV-like), norm+gate/up+SiLU and matvec+residual (down) per weight type at
// Llama 3.2 1B's shapes, each replayed 200x in a graph; GB/s counts the GPU layout's bytes (kernels.cuh).
int bench_types() {
  cudaStream_t sm;
  CUDA_CHECK(cudaStreamCreateWithFlags(&sm, cudaStreamNonBlocking));
  const int d = 2048, d_ff = 8192, qkv_rows = 3072;
  std::vector<void*> bufs;
  auto dalloc = [&](size_t bytes) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    CUDA_CHECK(cudaMemset(p, 0, bytes));
    bufs.push_back(p);
    return static_cast<float*>(p);
  };
  float* x = dalloc(d_ff * 4);
  float* y = dalloc(2 * d_ff * 4);
  float* nw = dalloc(d * 4);
  {
    std::vector<float> ones(d_ff, 0.5f);
    CUDA_CHECK(cudaMemcpy(x, ones.data(), d_ff * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(nw, ones.data(), d * 4, cudaMemcpyHostToDevice));
  }
  std::printf("%-22s %-7s %12s %12s %12s   (us per launch, GB/s of the GPU layout)\n", "type", "GPU", "qkv 3072x2048",
              "gate/up 16384x2048", "down 2048x8192");
  struct Row {
    const char* name;
    GgmlType a, b;  // b != a: a QKV / gate-up stack of a (q, k / gate) and b (v / up)
  };
  const Row rows[] = {{"Q4_0", GgmlType::Q4_0, GgmlType::Q4_0}, {"Q8_0", GgmlType::Q8_0, GgmlType::Q8_0},
                      {"Q5_0", GgmlType::Q5_0, GgmlType::Q5_0}, {"Q5_1", GgmlType::Q5_1, GgmlType::Q5_1},
                      {"Q4_K", GgmlType::Q4_K, GgmlType::Q4_K}, {"Q5_K", GgmlType::Q5_K, GgmlType::Q5_K},
                      {"Q6_K", GgmlType::Q6_K, GgmlType::Q6_K}, {"Q4_K+Q6_K (wide)", GgmlType::Q4_K, GgmlType::Q6_K},
                      {"Q3_K (wide)", GgmlType::Q3_K, GgmlType::Q3_K}};
  for (const Row& r : rows) {
    Storage st;
    const float sd = 1.f / std::sqrt(static_cast<float>(d));
    const WeightView qa = random_q(st, r.a, qkv_rows - 1024, d, sd), qb = random_q(st, r.b, 1024, d, sd);
    const WeightView ga = random_q(st, r.a, d_ff, d, sd), gb = random_q(st, r.b, d_ff, d, sd);
    const WeightView dn = random_q(st, r.a, d, d_ff, sd);
    const DevMatrix qkv = upload_matrix({&qa, &qb}, bufs), gu = upload_matrix({&ga, &gb}, bufs),
                    down = upload_matrix({&dn}, bufs);
    const double t_qkv = graph_time_us(sm, [&] { launch_norm_matvec(qkv, x, nw, 1e-5f, y, sm); });
    const double t_gu = graph_time_us(sm, [&] { launch_norm_matvec_silu_glu(gu, x, nw, 1e-5f, y, sm); });
    const double t_dn = graph_time_us(sm, [&] { launch_matvec_residual(down, x, y, sm); });
    auto gbs = [](const DevMatrix& m, double us) {
      return static_cast<double>(m.rows) * m.nb * gpu_block_bytes(m.type) / (us * 1e3);
    };
    std::printf("%-22s %-7s %7.2f %4.0f %7.2f %4.0f %7.2f %4.0f\n", r.name, gpu_type_name(qkv.type), t_qkv,
                gbs(qkv, t_qkv), t_gu, gbs(gu, t_gu), t_dn, gbs(down, t_dn));
    for (void* p : bufs) cudaFree(p);
    bufs.clear();
    x = dalloc(d_ff * 4);
    y = dalloc(2 * d_ff * 4);
    nw = dalloc(d * 4);
    std::vector<float> ones(d_ff, 0.5f);
    CUDA_CHECK(cudaMemcpy(x, ones.data(), d_ff * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(nw, ones.data(), d * 4, cudaMemcpyHostToDevice));
  }
  for (void* p : bufs) cudaFree(p);
  cudaStreamDestroy(sm);
  return 0;
}

// bench_cuda <n_ctx> sample: sampled decoding's draw on the device (launch_sample after launch_argmax, as a sampled
// step runs them after the lm_head, reading and writing memory as the engine's do) per vocabulary, row and
// filter, replayed 200x in a graph: us a draw, the argmax's own time first. Rows: LLM-like (eight dominant logits
// over a normal body of sd 2.5), sd4 (normal, sd 4: as the realshapes Qwen2.5 file's decode rows, whose top_p 0.95
// nuclei hold 700-1,900 tokens), flat (uniform in +-0.01: the largest candidate lists and top_p nuclei, the
// token-id-order draw) and narrow (uniform in [4, 4.5): every logit in one bin of pass1's histogram, so its atomics
// all fall on one address).
int bench_sample() {
  cudaStream_t sm;
  CUDA_CHECK(cudaStreamCreateWithFlags(&sm, cudaStreamNonBlocking));
  ArgmaxScratch am;
  am.capacity = kArgmaxMaxBlocks;
  CUDA_CHECK(cudaMalloc(&am.partials, kArgmaxMaxBlocks * sizeof(ArgmaxPartial)));
  CUDA_CHECK(cudaMalloc(&am.counter, sizeof(unsigned int)));
  CUDA_CHECK(cudaMemset(am.counter, 0, sizeof(unsigned int)));
  CUDA_CHECK(cudaMalloc(&am.last, sizeof(ArgmaxResult)));
  // As the engine keeps them: the argmax's result and the draw's in mapped host memory (the host reads them without
  // a copy), the draw reading the argmax's device copy (am.last).
  ArgmaxResult* best_host = nullptr;
  SampleResult* out_host = nullptr;
  ArgmaxResult* best = nullptr;
  SampleResult* out = nullptr;
  void* work = nullptr;
  float* x = nullptr;
  CUDA_CHECK(cudaHostAlloc(&best_host, sizeof(ArgmaxResult), cudaHostAllocMapped));
  CUDA_CHECK(cudaHostAlloc(&out_host, sizeof(SampleResult), cudaHostAllocMapped));
  CUDA_CHECK(cudaHostGetDevicePointer(&best, best_host, 0));
  CUDA_CHECK(cudaHostGetDevicePointer(&out, out_host, 0));
  CUDA_CHECK(cudaMalloc(&work, sample_work_bytes()));
  CUDA_CHECK(cudaMemset(work, 0, sample_work_bytes()));
  CUDA_CHECK(cudaMalloc(&x, 262144 * sizeof(float)));
  struct Mode {
    const char* name;
    float temperature;
    int top_k;
    double top_p;
  };
  const Mode modes[] = {{"T 1", 1.f, 0, 1.0},
                        {"top_k 40", 1.f, 40, 1.0},
                        {"top_p 0.95", 1.f, 0, 0.95},
                        {"top_k 40 top_p 0.9", 1.f, 40, 0.9},
                        {"T 1.5 top_p 0.95", 1.5f, 0, 0.95}};
  std::printf("%-8s %-6s %8s", "vocab", "row", "argmax");
  for (const Mode& m : modes) std::printf(" %20s", m.name);
  std::printf("   (us a draw, argmax included)\n");
  std::mt19937 g(5);
  for (const int n : {49152, 151936, 262144})
    for (const std::string kind : {"llm", "sd4", "flat", "narrow"}) {
      const bool llm = kind == "llm";
      std::vector<float> row(n);
      std::normal_distribution<float> body(0.f, 2.5f), sd4(0.f, 4.f);
      std::uniform_real_distribution<float> uni(-0.01f, 0.01f), narrow(4.f, 4.5f);
      for (float& v : row) v = llm ? body(g) : kind == "sd4" ? sd4(g) : kind == "flat" ? uni(g) : narrow(g);
      if (llm)
        for (int j = 0; j < 8; ++j) row[std::uniform_int_distribution<int>(0, n - 1)(g)] = 9.f + j * 0.6f;
      CUDA_CHECK(cudaMemcpy(x, row.data(), n * sizeof(float), cudaMemcpyHostToDevice));
      std::printf("%-8d %-6s %8.2f", n, kind.c_str(),
                  graph_time_us(sm, [&] { launch_argmax(x, n, am, best, nullptr, sm); }));
      for (const Mode& m : modes) {
        SampleArgs a;
        a.inv_t = 1.f / m.temperature;
        a.top_k = m.top_k;
        a.top_p = m.top_p;
        a.u = 0.61;
        std::printf(" %20.2f", graph_time_us(sm, [&] {
                      launch_argmax(x, n, am, best, nullptr, sm);
                      launch_sample(x, n, am.last, a, work, out, nullptr, sm);
                    }));
      }
      std::printf("\n");
    }
  cudaFree(x);
  cudaFree(work);
  cudaFreeHost(out_host);
  cudaFreeHost(best_host);
  cudaFree(am.partials);
  cudaFree(am.counter);
  cudaFree(am.last);
  cudaStreamDestroy(sm);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // bench_cuda <n_ctx> kernels: only the per-kernel section (for profilers).
    const bool kernels_only = argc > 2 && std::strcmp(argv[2], "kernels") == 0;
    if (cuda_device_count() == 0) {
      std::printf("no CUDA device\n");
      return 0;
    }
    // METALATTN_BENCH_SHAPE=qwen: Qwen2.5-0.5B's shape (Qwen 2 layers: biases, NeoX) with its Q4_K_M file's types;
    // 1.7b: SmolLM2-1.7B's with Q4_0 layers; 360m: SmolLM2-360M's likewise; unset or 135m: SmolLM2-135M's.
    const char* shape = std::getenv("METALATTN_BENCH_SHAPE");
    const bool qwen = shape != nullptr && std::strcmp(shape, "qwen") == 0;
    const bool big = shape != nullptr && std::strcmp(shape, "1.7b") == 0;
    const bool mid = shape != nullptr && std::strcmp(shape, "360m") == 0;
    const bool gemma = shape != nullptr && std::strcmp(shape, "gemma") == 0;
    if (shape != nullptr && *shape != '\0' && !qwen && !big && !mid && !gemma && std::strcmp(shape, "135m") != 0) {
      std::fprintf(stderr, "bench_cuda: METALATTN_BENCH_SHAPE=%s: expected 135m, 360m, 1.7b, qwen or gemma\n", shape);
      return 2;
    }
    struct Shape {
      int layers, d, ff, heads, kv_heads, vocab;
      float rope_base, eps;
    };
    const Shape sh = qwen    ? Shape{24, 896, 4864, 14, 2, 151936, 1e6f, 1e-6f}
                     : gemma ? Shape{18, 640, 2048, 4, 1, 262144, 1e6f, 1e-6f}
                     : big ? Shape{24, 2048, 8192, 32, 32, 49152, 1.3e5f, 1e-5f}
                     : mid ? Shape{32, 960, 2560, 15, 5, 49152, 1e5f, 1e-5f}
                           : Shape{30, 576, 1536, 9, 3, 49152, 1e5f, 1e-5f};
    ModelSpec s;
    s.n_layers = sh.layers;
    s.d_model = sh.d;
    s.d_ff = sh.ff;
    s.n_heads = sh.heads;
    s.n_kv_heads = sh.kv_heads;
    s.head_dim = gemma ? 256 : 64;
    s.vocab = sh.vocab;
    s.n_ctx = argc > 1 ? std::atoi(argv[1]) : 2048;
    s.rope_base = sh.rope_base;
    s.rms_eps = sh.eps;
    if (qwen) {  // as the Python loader reads a Qwen 2 file
      s.rope_style = RopeStyle::Neox;
      s.attn_bias = true;
    }
    if (gemma) {  // as the Python loader reads a Gemma 3 file (gguf_model.py): local layers at base 10,000
      s.rope_style = RopeStyle::Neox;
      s.activation = Activation::GeluTanh;
      s.embed_scale = std::sqrt(static_cast<float>(s.d_model));
      s.qk_norm = true;
      s.post_norms = true;
      for (int l = 0; l < s.n_layers; ++l)
        s.layers.push_back(l % 6 == 5 ? LayerSpec{1e6f, 1.f, 0} : LayerSpec{10000.f, 1.f, 512});
    }
    Storage st;
    ModelWeights w;
    const float sd = 1.f / std::sqrt(static_cast<float>(s.d_model)), sf = 1.f / std::sqrt(static_cast<float>(s.d_ff));
    const std::string mode = argc > 2 ? argv[2] : "";
    if (mode == "types") return bench_types();
    if (mode == "sample") return bench_sample();
    // The other modes time the fused path's kernels. (The whole table's per-kernel part stops itself for every shape
    // but the 135M's.)
    if (gemma && !mode.empty() && mode != "decode" && mode != "trace" && mode != "depth") {
      std::fprintf(stderr, "bench_cuda: METALATTN_BENCH_SHAPE=gemma runs the whole table, decode, depth and trace "
                           "modes only\n");
      return 2;
    }
    // The Q4_K_M mix of the real SmolLM2-135M file (its 576-wide rows take Q5_0 / Q8_0 where Q4_K_M asks for
    // Q4_K / Q6_K; the 1536-wide down projection is a K-quant), or Q4_0 layers.
    const bool q4_k_m = mode == "q4_k_m" || qwen || gemma;
    const GgmlType lt = q4_k_m ? GgmlType::Q5_0 : GgmlType::Q4_0;
    w.tok_embd = random_q(st, qwen ? GgmlType::Q5_0 : GgmlType::Q8_0, s.vocab, s.d_model, 1.f);
    w.output = qwen ? random_q(st, GgmlType::Q8_0, s.vocab, s.d_model, sd) : w.tok_embd;
    w.output_norm = random_norm(st, s.d_model);
    for (int l = 0; l < s.n_layers; ++l) {
      LayerWeights L;
      L.attn_norm = random_norm(st, s.d_model);
      L.ffn_norm = random_norm(st, s.d_model);
      const GgmlType vt = q4_k_m ? (l % 2 == 0 ? GgmlType::Q8_0 : GgmlType::Q5_0) : lt;
      const GgmlType dt = q4_k_m ? (l % 2 == 0 ? GgmlType::Q6_K : GgmlType::Q4_K) : lt;
      if (qwen) {  // Q/K/V biases
        L.bq = random_floats(st, s.q_dim(), -0.5f, 0.5f);
        L.bk = random_floats(st, s.kv_dim(), -0.5f, 0.5f);
        L.bv = random_floats(st, s.kv_dim(), -0.5f, 0.5f);
      }
      if (gemma) {
        L.q_norm = random_norm(st, s.head_dim);
        L.k_norm = random_norm(st, s.head_dim);
        L.post_attn_norm = random_norm(st, s.d_model);
        L.post_ffn_norm = random_norm(st, s.d_model);
      }
      L.wq = random_q(st, lt, s.q_dim(), s.d_model, 2 * sd);
      L.wk = random_q(st, lt, s.kv_dim(), s.d_model, 2 * sd);
      L.wv = random_q(st, vt, s.kv_dim(), s.d_model, sd);
      L.wo = random_q(st, gemma ? GgmlType::Q4_K : lt, s.d_model, s.q_dim(), 0.5f * sd);
      L.w_gate = random_q(st, lt, s.d_ff, s.d_model, sd);
      L.w_up = random_q(st, lt, s.d_ff, s.d_model, sd);
      L.w_down = random_q(st, dt, s.d_model, s.d_ff, 0.5f * sf);
      w.layers.push_back(L);
    }
    if (qwen)
      std::printf("weights: Qwen2.5-0.5B shape, Q4_K_M mix (Q5_0, Q8_0 / Q5_0 v, Q6_K / Q4_K down, Q8_0 output), "
                  "Q/K/V biases, NeoX RoPE\n");
    else if (gemma) std::printf("weights: Gemma 3 270M shape, Q4_K_M mix (Q5_0, Q8_0 / Q5_0 v, Q4_K o, Q6_K / Q4_K down, Q8_0 tied output)\n");
    else if (q4_k_m) std::printf("weights: SmolLM2-135M Q4_K_M mix (Q5_0, Q8_0 / Q5_0 v, Q6_K / Q4_K down)\n");
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const char* pdl = std::getenv("METALATTN_CUDA_PDL");
    std::printf("device %s, %d SMs | n_ctx %d | PDL %s\n", prop.name, prop.multiProcessorCount, s.n_ctx,
                pdl ? pdl : "1 (default)");

    auto t_create = Clock::now();
    auto be = make_cuda_backend(s, w, false);
    const MemoryInfo mi = be->memory_info();
    std::printf("create %.1f ms | memory: weights %.1f MiB, kv %.1f MiB, scratch %.1f MiB\n",
                seconds_since(t_create) * 1e3, mi.weights / 1048576.0, mi.kv_cache / 1048576.0,
                mi.scratch / 1048576.0);

    std::uniform_int_distribution<int> tok(0, s.vocab - 1);
    std::vector<int32_t> prompt(std::max(2048, s.n_ctx - 32));
    for (auto& t : prompt) t = tok(g_rng);

    // bench_cuda <n_ctx> trace (a -DMETALATTN_TRACE build): where one decode step's time goes in the kernel chain.
    if (argc > 2 && std::strcmp(argv[2], "trace") == 0) {
      print_decode_trace(*be, prompt, s.n_layers, s.n_ctx);
      return 0;
    }

    // bench_cuda <n_ctx> depth: decode at depth (issue 13's depth target), us a token at depths 32, 1,024, 4,096 and
    // 8,000 where the context holds them and 64 steps after: the prompt is prefilled to the depth, then 64 greedy
    // steps are timed one by one: the median of the 192 step times of 3 runs after one warm-up run.
    // METALATTN_BENCH_DEPTHS=<d,d,...> measures those depths instead (the first is the ratios' base).
    if (mode == "depth") {
      std::vector<double> us;
      std::vector<int> depths{32, 1024, 4096, 8000};
      if (const char* e = std::getenv("METALATTN_BENCH_DEPTHS"); e != nullptr && *e != '\0') {
        depths.clear();
        for (const char* p = e; *p != '\0';) {
          char* end = nullptr;
          const long v = std::strtol(p, &end, 10);
          if (end == p || v < 1) {
            std::fprintf(stderr, "bench_cuda: METALATTN_BENCH_DEPTHS takes positive integers separated by commas\n");
            return 2;
          }
          depths.push_back(static_cast<int>(v));
          p = *end == ',' ? end + 1 : end;
        }
      }
      for (int depth : depths) {
        if (depth + 64 > s.n_ctx) continue;
        std::vector<double> tt;
        for (int run = 0; run < 4; ++run) {
          ArgmaxResult r = be->forward_prompt(prompt.data(), depth, 0, nullptr, nullptr);
          for (int i = 0; i < 64; ++i) {
            const auto ti = Clock::now();
            r = be->forward_token_greedy(static_cast<int32_t>(r.token), depth + i);
            if (run > 0) tt.push_back(seconds_since(ti) * 1e6);
          }
        }
        us.push_back(median(tt));
        std::printf("decode at depth %d: median %.1f us/token (%.2fx depth 32)\n", depth, us.back(),
                    us.back() / us.front());
      }
      return 0;
    }

    // Decode tg128 after a 32-token prompt (3 runs; per-token median and whole-run rate).
    std::vector<double> run_rates, per_token;
    if (!kernels_only) {
    for (int run = 0; run < 4; ++run) {
      ArgmaxResult r = be->forward_prompt(prompt.data(), 32, 0, nullptr, nullptr);
      const auto t0 = Clock::now();
      for (int i = 0; i < 128; ++i) {
        const auto ti = Clock::now();
        r = be->forward_token_greedy(static_cast<int32_t>(r.token), 32 + i);
        if (run > 0) per_token.push_back(seconds_since(ti) * 1e6);
      }
      if (run > 0) run_rates.push_back(128.0 / seconds_since(t0));
    }
    std::printf("decode tg128 (after pp32): %.0f tok/s, median %.1f us/token\n", median(run_rates), median(per_token));
    // The same 128 steps run ahead (forward_tokens_greedy, 2 x 64 steps enqueued before each wait), same tokens.
    {
      std::vector<int32_t> one_by_one, ahead;
      ArgmaxResult r = be->forward_prompt(prompt.data(), 32, 0, nullptr, nullptr);
      for (int i = 0; i < 128; ++i) {
        r = be->forward_token_greedy(static_cast<int32_t>(r.token), 32 + i);
        one_by_one.push_back(static_cast<int32_t>(r.token));
      }
      std::vector<double> ahead_rates;
      std::vector<ArgmaxResult> out(Backend::kMaxGreedyRun);
      for (int run = 0; run < 4; ++run) {
        ahead.clear();
        r = be->forward_prompt(prompt.data(), 32, 0, nullptr, nullptr);
        const auto t0 = Clock::now();
        for (int c = 0; c < 128 / Backend::kMaxGreedyRun; ++c) {
          be->forward_tokens_greedy(static_cast<int32_t>(r.token), 32 + c * Backend::kMaxGreedyRun,
                                    Backend::kMaxGreedyRun, out.data());
          for (const ArgmaxResult& o : out) ahead.push_back(static_cast<int32_t>(o.token));
          r = out.back();
        }
        if (run > 0) ahead_rates.push_back(128.0 / seconds_since(t0));
      }
      std::printf("decode tg128 run ahead (forward_tokens_greedy, %d steps a call): %.0f tok/s, %.1f us/token, "
                  "tokens %s\n", Backend::kMaxGreedyRun, median(ahead_rates), 1e6 / median(ahead_rates),
                  ahead == one_by_one ? "identical" : "DIFFER");
    }
    // Sampled decoding, T 1: drawn on the device (forward_token_sample, 8 bytes back; a flat row's top_p goes back
    // to the host), and as the host draws (forward_token's logits copy, then sample_logits), with top_p 0.95, top_k 40
    // and no filter (the server's default, top_p 1).
    struct SampledCase {
      const char* name;
      int64_t top_k;
      double top_p;
    };
    for (const SampledCase sc : {SampledCase{"top_p 0.95", 0, 0.95}, SampledCase{"top_k 40", 40, 1.0},
                                 SampledCase{"no filter", 0, 1.0}})
      for (const bool on_device : {true, false}) {
        std::vector<float> logits(static_cast<size_t>(s.vocab));
        std::vector<double> rates;
        std::mt19937_64 rng(7);
        std::uniform_real_distribution<double> uni(0.0, 1.0);
        SamplingParams sp;
        sp.top_k = sc.top_k;
        sp.top_p = sc.top_p;
        for (int run = 0; run < 3; ++run) {
          int64_t tok = be->forward_prompt(prompt.data(), 32, 0, nullptr, nullptr).token;
          const auto t0 = Clock::now();
          for (int i = 0; i < 128; ++i) {
            if (on_device) {
              tok = be->forward_token_sample(static_cast<int32_t>(tok), 32 + i, sp, uni(rng), logits.data(),
                                             static_cast<int64_t>(logits.size()));
            } else {
              be->forward_token(static_cast<int32_t>(tok), 32 + i, logits.data());
              tok = sample_logits(logits.data(), static_cast<int64_t>(logits.size()), sp, uni(rng));
            }
          }
          if (run > 0) rates.push_back(128.0 / seconds_since(t0));
        }
        std::printf("decode tg128 sampled %s (%s): %.0f tok/s, %.1f us/token\n", sc.name,
                    on_device ? "on the device" : "host: logits copy + sample_logits", median(rates),
                    1e6 / median(rates));
        if (!on_device) continue;
        // The same steps run ahead (forward_tokens_sample, 2 x 64 steps queued before each wait).
        rates.clear();
        std::vector<int64_t> out(Backend::kMaxGreedyRun);
        std::vector<double> us(Backend::kMaxGreedyRun);
        for (int run = 0; run < 3; ++run) {
          int64_t tok = be->forward_prompt(prompt.data(), 32, 0, nullptr, nullptr).token;
          const auto t0 = Clock::now();
          for (int pos = 32; pos < 32 + 128;) {
            for (double& v : us) v = uni(rng);
            const int done = be->forward_tokens_sample(static_cast<int32_t>(tok), pos, Backend::kMaxGreedyRun, sp,
                                                       us.data(), logits.data(), static_cast<int64_t>(logits.size()),
                                                       out.data());
            tok = out[done - 1];
            pos += done;
          }
          if (run > 0) rates.push_back(128.0 / seconds_since(t0));
        }
        std::printf("decode tg128 sampled %s (run ahead, %d steps a call): %.0f tok/s, %.1f us/token\n", sc.name,
                    Backend::kMaxGreedyRun, median(rates), 1e6 / median(rates));
      }
    if (mode == "decode") return 0;
    // Time to first token as `metalattn bench` counts it: a 32-token prompt at position 0 right after a decode
    // run, against the same prompt right after another prompt, and after an idle pause (alternating, so clocks
    // and caches see the same history).
    {
      auto pp32 = [&] {
        const auto t0 = Clock::now();
        be->forward_prompt(prompt.data(), 32, 0, nullptr, nullptr);
        return seconds_since(t0) * 1e3;
      };
      std::vector<double> after_decode, after_prompt, after_idle, after_one_token;
      for (int it = 0; it < 12; ++it) {
        ArgmaxResult r = be->forward_prompt(prompt.data(), 32, 0, nullptr, nullptr);
        for (int i = 0; i < 128; ++i) r = be->forward_token_greedy(static_cast<int32_t>(r.token), 32 + i);
        const double a = pp32();
        const double b = pp32();
        const auto idle0 = Clock::now();
        while (seconds_since(idle0) < 2e-3) {
        }
        const double c = pp32();
        be->forward_token_greedy(static_cast<int32_t>(r.token), 32);
        const double d = pp32();
        if (it > 1) {
          after_decode.push_back(a);
          after_prompt.push_back(b);
          after_idle.push_back(c);
          after_one_token.push_back(d);
        }
      }
      std::printf("pp32 ms right after: 128 decode steps %.3f | a prompt %.3f | 2 ms idle %.3f | one decode step %.3f\n",
                  median(after_decode), median(after_prompt), median(after_idle), median(after_one_token));
    }
    // Decode deep into the context.
    {
      be->forward_prompt(prompt.data(), std::min(1900, s.n_ctx - 130), 0, nullptr, nullptr);
      std::vector<double> tt;
      ArgmaxResult r{1, 0.f};
      const int p0 = std::min(1900, s.n_ctx - 130);
      for (int i = 0; i < 128; ++i) {
        const auto ti = Clock::now();
        r = be->forward_token_greedy(static_cast<int32_t>(r.token), p0 + i);
        tt.push_back(seconds_since(ti) * 1e6);
      }
      std::printf("decode at pos ~%d: median %.1f us/token\n", p0, median(tt));
    }
    // Prefill pp512 and time to first token of a 32-token prompt (and of shorter ones: the few-token path's cost
    // by prompt length).
    for (int n : {1, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 2048}) {
      if (n > s.n_ctx) continue;
      std::vector<double> t;
      for (int it = 0; it < 8; ++it) {
        const auto t0 = Clock::now();
        be->forward_prompt(prompt.data(), n, 0, nullptr, nullptr);
        if (it > 1) t.push_back(seconds_since(t0));
      }
      std::printf("prefill pp%-5d: %8.3f ms  %9.0f tok/s\n", n, median(t) * 1e3, n / median(t));
    }
    }  // !kernels_only

    // Per-kernel times (one layer's shapes; each kernel replayed 200x in a graph). Its buffers and launches are
    // written for the SmolLM2-135M shape (576 wide, 9 / 3 heads); other shapes stop here.
    if (qwen || big || mid || gemma) {
      std::printf("per-kernel times: measured for the 135M shape only (METALATTN_BENCH_SHAPE=135m)\n");
      return 0;
    }
    {
      cudaStream_t sm;
      CUDA_CHECK(cudaStreamCreateWithFlags(&sm, cudaStreamNonBlocking));
      std::vector<std::vector<float>> keep;
      auto upload = [&](const std::vector<const WeightView*>& parts, std::vector<void*>& bufs) {
        PackedMatrix p = pack_matrix(parts, common_exact_type(parts));
        DevMatrix m;
        m.type = p.type;
        m.rows = p.rows;
        m.cols = p.cols;
        m.nb = p.nb;
        void* a = nullptr;
        CUDA_CHECK(cudaMalloc(&a, p.payload.size()));
        CUDA_CHECK(cudaMemcpy(a, p.payload.data(), p.payload.size(), cudaMemcpyHostToDevice));
        bufs.push_back(a);
        m.payload = static_cast<uint8_t*>(a);
        void* b = nullptr;
        CUDA_CHECK(cudaMalloc(&b, p.scales.size() * 2));
        CUDA_CHECK(cudaMemcpy(b, p.scales.data(), p.scales.size() * 2, cudaMemcpyHostToDevice));
        bufs.push_back(b);
        m.scales = static_cast<uint16_t*>(b);
        if (!p.aux.empty()) {
          void* c = nullptr;
          CUDA_CHECK(cudaMalloc(&c, p.aux.size() * 4));
          CUDA_CHECK(cudaMemcpy(c, p.aux.data(), p.aux.size() * 4, cudaMemcpyHostToDevice));
          bufs.push_back(c);
          m.aux = static_cast<uint32_t*>(c);
        }
        if (!p.mma_scales.empty()) {
          void* c = nullptr;
          CUDA_CHECK(cudaMalloc(&c, p.mma_scales.size() * 4));
          CUDA_CHECK(cudaMemcpy(c, p.mma_scales.data(), p.mma_scales.size() * 4, cudaMemcpyHostToDevice));
          bufs.push_back(c);
          m.mma_scales = static_cast<float2*>(c);
        }
        return m;
      };
      std::vector<void*> bufs;
      auto dalloc = [&](size_t bytes) {
        void* p = nullptr;
        CUDA_CHECK(cudaMalloc(&p, bytes));
        CUDA_CHECK(cudaMemset(p, 0, bytes));
        bufs.push_back(p);
        return p;
      };
      const LayerWeights& L = w.layers[0];
      DevMatrix qkv = upload({&L.wq, &L.wk, &L.wv}, bufs), o = upload({&L.wo}, bufs),
                gu = upload({&L.w_gate, &L.w_up}, bufs), down = upload({&L.w_down}, bufs),
                lm = upload({&w.tok_embd}, bufs);
      std::vector<float> xs(576);
      for (float& x : xs) x = std::uniform_real_distribution<float>(-1, 1)(g_rng);
      float* x = static_cast<float*>(dalloc(576 * 4));
      CUDA_CHECK(cudaMemcpy(x, xs.data(), 576 * 4, cudaMemcpyHostToDevice));
      float* nw = static_cast<float*>(dalloc(576 * 4));
      CUDA_CHECK(cudaMemcpy(nw, w.layers[0].attn_norm, 576 * 4, cudaMemcpyHostToDevice));
      float* q = static_cast<float*>(dalloc(576 * 4));
      float* gate_up = static_cast<float*>(dalloc(3072 * 4));
      float* logits = static_cast<float*>(dalloc(49152 * 4));
      __half* kc = static_cast<__half*>(dalloc(static_cast<size_t>(s.n_ctx) * 192 * sizeof(__half)));
      __half* vc = static_cast<__half*>(dalloc(static_cast<size_t>(s.n_ctx) * 192 * sizeof(__half)));
      float2* rope = static_cast<float2*>(dalloc(static_cast<size_t>(s.n_ctx) * 32 * 8));
      AttnScratch ap;
      ap.max_splits = attn_max_splits(s.n_ctx, 3, prop.multiProcessorCount);
      ap.o = static_cast<float*>(dalloc(9 * ap.max_splits * 64 * 4));
      ap.ml = static_cast<float*>(dalloc(9 * ap.max_splits * 2 * 4));
      ap.counters = static_cast<unsigned*>(dalloc(9 * 4));
      float* attn_out = static_cast<float*>(dalloc(576 * 4));
      ArgmaxScratch am;
      am.capacity = argmax_partials_needed(lm);
      am.partials = static_cast<ArgmaxPartial*>(dalloc(am.capacity * sizeof(ArgmaxPartial)));
      am.counter = static_cast<unsigned*>(dalloc(4));
      ArgmaxResult* res = static_cast<ArgmaxResult*>(dalloc(8));
      DecodeIO* io = static_cast<DecodeIO*>(dalloc(8));
      const QkvTargets tg = qkv_targets(rope, io, 576, 192, 64, q, kc, vc);
      auto set_pos = [&](int pos) {
        DecodeIO h{1, pos};
        CUDA_CHECK(cudaMemcpy(io, &h, 8, cudaMemcpyHostToDevice));
      };
      float* x0 = static_cast<float*>(dalloc(576 * 4));
      set_pos(160);
      const double t_embqkv = graph_time_us(sm, [&] { launch_embed_norm_matvec_qkv(lm, x0, qkv, nw, 1e-5f, tg, sm); });
      const double t_qkv = graph_time_us(sm, [&] { launch_norm_matvec_qkv(qkv, x, nw, 1e-5f, tg, sm); });
      const double t_att = graph_time_us(sm, [&] { launch_attention_decode(q, kc, vc, io, 9, 3, 64, s.n_ctx, ap, attn_out, sm); });
      const double t_att_short = graph_time_us(sm, [&] {
        launch_attention_decode_short(q, kc, vc, io, 9, 3, 64, std::min(s.n_ctx, kShortAttnMaxPos), attn_out, sm);
      });
      const double t_o = graph_time_us(sm, [&] { launch_matvec_residual(o, attn_out, q, sm); });
      const double t_gu = graph_time_us(sm, [&] { launch_norm_matvec_silu_glu(gu, x, nw, 1e-5f, gate_up, sm); });
      const double t_down = graph_time_us(sm, [&] { launch_matvec_residual(down, gate_up, q, sm); });
      const double t_lm = graph_time_us(sm, [&] { launch_norm_matvec_argmax(lm, x, nw, 1e-5f, logits, am, res, nullptr, sm); });
      // One block per KV head (3 query heads each), the layout before one block per query head.
      const double t_att_kv = graph_time_us(sm, [&] { launch_attention_decode(q, kc, vc, io, 9, 3, 64, s.n_ctx, ap, attn_out, sm, 3); });
      set_pos(300);
      const double t_att_300 = graph_time_us(sm, [&] { launch_attention_decode(q, kc, vc, io, 9, 3, 64, s.n_ctx, ap, attn_out, sm); });
      set_pos(s.n_ctx - 1);
      const double t_att_long = graph_time_us(sm, [&] { launch_attention_decode(q, kc, vc, io, 9, 3, 64, s.n_ctx, ap, attn_out, sm); });
      std::printf("per-kernel (graph replay, us): embed+qkv %.2f | qkv %.2f | attn@160 short %.2f, split-capable %.2f"
                  " (@300 %.2f, @%d %.2f; block per KV head @160 %.2f) | O %.2f | norm+gate/up+silu %.2f | down %.2f |"
                  " lm_head+argmax %.2f\n",
                  t_embqkv, t_qkv, t_att_short, t_att, t_att_300, s.n_ctx - 1, t_att_long, t_att_kv, t_o, t_gu, t_down,
                  t_lm);
      const double layer = t_qkv + t_att_short + t_o + t_gu + t_down;
      std::printf("sum for one token at pos 160: %.1f us (layer %.2f x 30 + %.2f); kernels per token: %d\n",
                  30 * layer + (t_embqkv - t_qkv) + t_lm, layer, (t_embqkv - t_qkv) + t_lm, be->kernels_per_token());
      for (void* p : bufs) cudaFree(p);
      cudaStreamDestroy(sm);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
}
