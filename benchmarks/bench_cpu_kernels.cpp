// Micro-benchmark of the CPU kernels: memory bandwidth, thread-pool overhead, matvec GB/s (cache-hot and
// streaming from DRAM), matmul GOP/s, and the matvec/matmul-only ceilings of a SmolLM2-135M decode/prefill and of
// Gemma 3 270M / Qwen2.5-Coder-0.5B Q4_K_M decodes (their real per-layer weight types), and the logits' argmax and
// sampling draw.
// Usage: bench_cpu_kernels [n_threads] [sections] [types]
//   sections: comma-separated subset of bandwidth,pool,matvec,matmul,smollm2,decode,sample (default: all)
//   types:    comma-separated weight types for the matvec/matmul tables, e.g. Q5_0,Q4_K (default: all timed)
// METALATTN_CPU_ISA picks the ISA (default: the best one). BENCH_CPU_TIME=1 times by CPU time (see now_s).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <strings.h>
#include <time.h>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/thread_pool.h"
#include "engine/sampling.h"

using namespace metalattn;
using namespace metalattn::cpu;

namespace {

// BENCH_CPU_TIME=1: time by this process's CPU time instead of the wall clock. With 1 thread that excludes the time
// the OS gave other processes, the one robust timing on a shared machine (with more threads it counts spinning).
double now_s() {
  static const bool cpu_time = std::getenv("BENCH_CPU_TIME") != nullptr && std::getenv("BENCH_CPU_TIME")[0] == '1';
  if (cpu_time) {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best of `reps` timings of fn(): the dev machine is shared, and interference only ever adds time.
template <class F>
double time_best(int reps, F&& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    fn();
    best = std::min(best, now_s() - t0);
  }
  return best;
}

// Random but valid blocks: fp16 scales in [0.5, 1), random nibbles/bytes.
std::vector<uint8_t> random_weights(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<uint8_t> bytes(row_bytes(type, cols) * rows);
  std::mt19937 rng(seed);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  // The fp16 scale fields of each block (d, and the min / dmin where the type has one) set to 0.5 .. 1.
  size_t fields[2] = {0, 2};
  int n_fields = type == GgmlType::Q4_1 || type == GgmlType::Q5_1 || type == GgmlType::Q4_K || type == GgmlType::Q5_K ? 2 : 1;
  if (type == GgmlType::Q6_K) fields[0] = offsetof(block_q6_K, d);
  if (is_quantized(type)) {
    const size_t bs = block_bytes(type);
    for (size_t off = 0; off < bytes.size(); off += bs)
      for (int f = 0; f < n_fields; ++f) {
        const uint16_t half = 0x3800 | (rng() & 0x3ff);  // 0.5 .. 1
        std::memcpy(&bytes[off + fields[f]], &half, 2);
      }
  }
  return bytes;
}

struct MatvecJob {
  Isa isa;
  const WeightView* w;
  const float* x;
  const block_q16_act* xq;
  float* y;
};

void run_matvec(ThreadPool& pool, MatvecJob& job) {
  pool.run(
      [](void* c, int i, int n) {
        auto* j = static_cast<MatvecJob*>(c);
        int64_t r0, r1;
        split_range(j->w->rows, i, n, 16, &r0, &r1);
        matvec(j->isa, *j->w, j->x, j->xq, j->y, r0, r1);
      },
      &job);
}

struct MatmulJob {
  Isa isa;
  const WeightView* w;
  const float* X;
  const block_q16_act* Xq;
  int n_tok;
  float* Y;
};

void run_matmul(ThreadPool& pool, MatmulJob& job) {
  pool.run(
      [](void* c, int i, int n) {
        auto* j = static_cast<MatmulJob*>(c);
        int64_t r0, r1;
        split_range(j->w->rows, i, n, 16, &r0, &r1);
        matmul(j->isa, *j->w, j->X, j->Xq, j->n_tok, j->Y, j->w->rows, r0, r1);
      },
      &job);
}

struct Shape {
  const char* name;
  int64_t rows, cols;
};

// Whether `name` is in the comma-separated list (an empty list selects everything).
bool selected(const char* list, const char* name) {
  if (list == nullptr || list[0] == '\0') return true;
  const size_t n = std::strlen(name);
  for (const char* p = list; *p;) {
    const char* end = std::strchr(p, ',');
    const size_t len = end ? static_cast<size_t>(end - p) : std::strlen(p);
    if (len == n && strncasecmp(p, name, n) == 0) return true;
    if (!end) break;
    p = end + 1;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const int n_threads = argc > 1 ? std::atoi(argv[1]) : 0;
  const char* sections = argc > 2 ? argv[2] : "";
  const char* types = argc > 3 ? argv[3] : "";
  ThreadPool pool(n_threads);
  const Isa isa = selected_isa();
  std::printf("isa %s, %d threads (physical cores %d)\n\n", isa_name(isa), pool.size(), ThreadPool::physical_cores());

  // ---- memory read bandwidth: a streaming sum over 1 GiB, split across the pool
  if (selected(sections, "bandwidth")) {
    const size_t n = (size_t(1) << 30) / 8;
    std::vector<uint64_t> buf(n);
    for (size_t i = 0; i < n; ++i) buf[i] = i * 2654435761u;
    std::vector<uint64_t> partial(pool.size());
    struct Ctx { const uint64_t* p; size_t n; uint64_t* out; bool prefetch; } ctx{buf.data(), n, partial.data(), false};
    auto sum_task = [](void* c, int i, int nt) {
      auto* x = static_cast<Ctx*>(c);
      int64_t b, e;
      split_range(static_cast<int64_t>(x->n), i, nt, 64, &b, &e);
      uint64_t s[8] = {};  // independent lanes: the loop must be bound by memory, not by add latency
      for (int64_t k = b; k < e; k += 8) {
        if (x->prefetch) __builtin_prefetch(x->p + k + 1024);  // 8 KiB ahead, as the kernels do
        for (int j = 0; j < 8; ++j) s[j] += x->p[k + j];
      }
      x->out[i] = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
    };
    for (bool prefetch : {false, true}) {
      ctx.prefetch = prefetch;
      const double t = time_best(5, [&] { pool.run(sum_task, &ctx); });
      const double t1 = time_best(3, [&] { sum_task(&ctx, 0, 1); });
      std::printf("memory read bandwidth (streaming sum over 1 GiB%s): %.1f GB/s with %d threads, %.1f GB/s with 1\n",
                  prefetch ? ", software prefetch" : "", n * 8 / t / 1e9, pool.size(), n * 8 / t1 / 1e9);
    }
  }

  // ---- thread pool overhead
  if (selected(sections, "pool")) {
    const int runs = 20000;
    const double t = time_best(10, [&] {
      for (int i = 0; i < runs; ++i) pool.run([](void*, int, int) {}, nullptr);
    });
    std::printf("thread pool: %.2f us per empty run\n\n", t / runs * 1e6);
  }

  // ---- matvec: GB/s of weights. "hot": one matrix, cache-resident after the first call. "stream": enough
  // distinct copies (>= 256 MiB) that every call reads its weights from DRAM, as a decode step does.
  // SmolLM2-135M's gate/up and lm_head; Gemma 3 270M's gate/up (Q5_0), attn_output (Q4_K), ffn_down (Q6_K) and
  // lm_head (Q8_0); Qwen2.5-0.5B's gate/up (Q5_0) and ffn_down (Q4_K / Q6_K).
  const GgmlType all_types[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F16, GgmlType::Q5_0,
                                GgmlType::Q5_1, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K};
  if (selected(sections, "matvec")) {
    const Shape mv_shapes[] = {{"1536x576", 1536, 576}, {"49152x576", 49152, 576}, {"2048x640", 2048, 640},
                               {"640x1024", 640, 1024}, {"640x2048", 640, 2048}, {"4864x896", 4864, 896},
                               {"896x4864", 896, 4864}, {"65536x640", 65536, 640}};
    std::printf("%-6s %-10s %10s %10s\n", "type", "matvec", "hot GB/s", "stream GB/s");
    for (GgmlType type : all_types) {
      if (!selected(types, type_name(type))) continue;
      for (const Shape& s : mv_shapes) {
        if (s.cols % block_elems(type) != 0) continue;
        const size_t bytes = row_bytes(type, s.cols) * s.rows;
        const int copies = static_cast<int>(std::max<size_t>(1, (size_t(256) << 20) / bytes + 1));
        std::vector<std::vector<uint8_t>> store;
        std::vector<WeightView> views;
        for (int c = 0; c < copies; ++c) store.push_back(random_weights(type, s.rows, s.cols, 1 + c));
        for (int c = 0; c < copies; ++c) views.push_back(WeightView{type, store[c].data(), s.rows, s.cols});
        std::vector<float> x(s.cols), y(s.rows);
        std::mt19937 rng(9);
        std::normal_distribution<float> nd;
        for (float& v : x) v = nd(rng);
        std::vector<block_q16_act> xq(s.cols / 32);
        quantize_acts(isa, x.data(), s.cols, xq.data());
        MatvecJob job{isa, &views[0], x.data(), xq.data(), y.data()};
        const int reps = std::max(20, static_cast<int>(2e9 / bytes / 10));
        for (int i = 0; i < 3; ++i) run_matvec(pool, job);
        const double hot = time_best(reps, [&] { run_matvec(pool, job); });
        const double stream = time_best(3, [&] {
                                for (int c = 0; c < copies; ++c) {
                                  job.w = &views[c];
                                  run_matvec(pool, job);
                                }
                              }) /
                              copies;
        std::printf("%-6s %-10s %10.1f %10.1f\n", type_name(type), s.name, bytes / hot / 1e9, bytes / stream / 1e9);
      }
    }
  }

  // ---- matmul at n_tok = 512: GOP/s (2 ops per multiply-add)
  const int n_tok = 512;
  if (selected(sections, "matmul")) {
    const Shape mm_shapes[] = {{"576x576", 576, 576}, {"1536x576", 1536, 576}, {"576x1536", 576, 1536},
                               {"2048x640", 2048, 640}, {"640x2048", 640, 2048}};
    std::printf("\n%-6s %-10s %10s   (matmul, n_tok=%d)\n", "type", "shape", "GOP/s", n_tok);
    for (GgmlType type : all_types) {
      if (!selected(types, type_name(type))) continue;
      for (const Shape& s : mm_shapes) {
        if (s.cols % block_elems(type) != 0) continue;
        std::vector<uint8_t> wb = random_weights(type, s.rows, s.cols, 5);
        WeightView w{type, wb.data(), s.rows, s.cols};
        std::vector<float> X(n_tok * s.cols), Y(n_tok * s.rows);
        std::mt19937 rng(3);
        std::normal_distribution<float> nd;
        for (float& v : X) v = nd(rng);
        std::vector<block_q16_act> Xq(n_tok * s.cols / 32);
        quantize_acts(isa, X.data(), n_tok * s.cols, Xq.data());
        MatmulJob job{isa, &w, X.data(), Xq.data(), n_tok, Y.data()};
        run_matmul(pool, job);
        const double t = time_best(5, [&] { run_matmul(pool, job); });
        std::printf("%-6s %-10s %10.1f\n", type_name(type), s.name, 2.0 * s.rows * s.cols * n_tok / t / 1e9);
      }
    }
  }

  // ---- SmolLM2-135M ceilings: only the matvecs/matmuls of one token (30 layers + lm_head), distinct weights per
  // layer (layers in the given type, lm_head Q8_0 as in the GGUF), 2 threads; activation quantization included.
  if (selected(sections, "smollm2")) {
    std::printf("\nSmolLM2-135M matvec/matmul-only ceilings (no attention, norms, rope):\n");
    const Shape layer[] = {{"wq", 576, 576}, {"wk", 192, 576}, {"wv", 192, 576}, {"wo", 576, 576},
                           {"gate", 1536, 576}, {"up", 1536, 576}, {"down", 576, 1536}};
    for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1}) {
      std::vector<std::vector<uint8_t>> store;
      std::vector<WeightView> views;
      for (int l = 0; l < 30; ++l)
        for (const Shape& s : layer) store.push_back(random_weights(type, s.rows, s.cols, l * 10 + 1));
      store.push_back(random_weights(GgmlType::Q8_0, 49152, 576, 77));
      size_t total = 0;
      for (int l = 0, k = 0; l < 30; ++l)
        for (const Shape& s : layer) {
          views.push_back(WeightView{type, store[k++].data(), s.rows, s.cols});
          total += row_bytes(type, s.cols) * s.rows;
        }
      views.push_back(WeightView{GgmlType::Q8_0, store.back().data(), 49152, 576});
      total += row_bytes(GgmlType::Q8_0, 576) * 49152;

      std::vector<float> x(1536 * n_tok), y(49152);
      std::mt19937 rng(1);
      std::normal_distribution<float> nd;
      for (float& v : x) v = nd(rng);
      std::vector<block_q16_act> xq(1536 / 32 * n_tok);
      auto decode_token = [&] {
        for (size_t k = 0; k < views.size(); ++k) {
          quantize_acts(isa, x.data(), views[k].cols, xq.data());
          MatvecJob job{isa, &views[k], x.data(), xq.data(), y.data()};
          run_matvec(pool, job);
        }
      };
      for (int i = 0; i < 3; ++i) decode_token();
      const int tokens = 16;
      const double per_token = time_best(4, [&] {
                                 for (int i = 0; i < tokens; ++i) decode_token();
                               }) /
                               tokens;
      std::printf("  %s decode: %.0f tok/s (%.1f MB of weights per token, %.1f GB/s)\n", type_name(type),
                  1 / per_token, total / 1e6, total / per_token / 1e9);
      if (lane_rows_supported(isa, type)) {  // the decode path's repacked layer rows (kernels.h), lm_head as above
        std::vector<std::vector<uint8_t>> packed;
        std::vector<WeightView> pviews;
        for (size_t k = 0; k + 1 < views.size(); ++k) {
          packed.emplace_back(views[k].rows * views[k].row_stride());
          pack_lane_rows(isa, views[k], packed.back().data());
          pviews.push_back(WeightView{type, packed.back().data(), views[k].rows, views[k].cols});
        }
        std::vector<uint8_t> acts_buf(lane_acts_bytes(1536) + 32);
        void* acts = acts_buf.data() + (32 - reinterpret_cast<uintptr_t>(acts_buf.data()) % 32) % 32;
        struct LaneJob { Isa isa; const WeightView* w; const void* acts; float* y; };
        auto lane_token = [&] {
          for (size_t k = 0; k < pviews.size(); ++k) {
            quantize_acts(isa, x.data(), pviews[k].cols, xq.data());
            pack_lane_acts(isa, xq.data(), pviews[k].cols, acts);
            LaneJob job{isa, &pviews[k], acts, y.data()};
            pool.run(
                [](void* c, int i, int n) {
                  auto* j = static_cast<LaneJob*>(c);
                  int64_t r0, r1;
                  split_range(j->w->rows, i, n, 16, &r0, &r1);
                  matvec_lane_rows(j->isa, *j->w, j->acts, j->y, r0, r1);
                },
                &job);
          }
          quantize_acts(isa, x.data(), views.back().cols, xq.data());
          MatvecJob job{isa, &views.back(), x.data(), xq.data(), y.data()};
          run_matvec(pool, job);
        };
        for (int i = 0; i < 3; ++i) lane_token();
        const double lane_per_token = time_best(4, [&] {
                                        for (int i = 0; i < tokens; ++i) lane_token();
                                      }) /
                                      tokens;
        std::printf("  %s decode, lane rows: %.0f tok/s (%.1f GB/s)\n", type_name(type), 1 / lane_per_token,
                    total / lane_per_token / 1e9);
      }

      std::vector<float> Y(static_cast<size_t>(1536) * n_tok);
      auto prefill = [&] {  // lm_head only for the last token, as forward_prompt does
        for (size_t k = 0; k + 1 < views.size(); ++k) {
          quantize_acts(isa, x.data(), views[k].cols * n_tok, xq.data());
          MatmulJob job{isa, &views[k], x.data(), xq.data(), n_tok, Y.data()};
          run_matmul(pool, job);
        }
      };
      prefill();
      const double tp = time_best(3, prefill);
      std::printf("  %s prefill pp%d: %.0f tok/s\n", type_name(type), n_tok, n_tok / tp);
    }
  }

  // ---- Gemma 3 270M and Qwen2.5-Coder-0.5B Q4_K_M decode ceilings: every matvec of one token with the real
  // files' shapes and per-layer types (read from the GGUFs: llama.cpp's Q4_K_M gives some layers' attn_v Q8_0 and
  // ffn_down Q6_K, the others Q5_0 / Q4_K), distinct weights per layer so each token streams them from DRAM, the
  // tied / separate lm_head included; activation quantization included; no attention, norms or rope. Compare with
  // llama-bench tg128 on the same machine: its whole decode must fit in the same time.
  if (selected(sections, "decode")) {
    struct ModelDecode {
      const char* name;
      int n_layers;
      int64_t d_model, q_dim, kv_dim, d_ff, vocab;
      GgmlType q, k, o, gate_up, output;
      const char* v_types;     // per layer: '8' Q8_0, '5' Q5_0
      const char* down_types;  // per layer: '6' Q6_K, '4' Q4_K
    };
    const ModelDecode models[] = {
        {"Gemma 3 270M Q4_K_M", 18, 640, 1024, 256, 2048, 262144, GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q4_K,
         GgmlType::Q5_0, GgmlType::Q8_0, "885585585585585888", "664464464464464666"},
        {"Qwen2.5-Coder-0.5B Q4_K_M", 24, 896, 896, 128, 4864, 151936, GgmlType::Q5_0, GgmlType::Q5_0,
         GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q8_0, "885855888885585585585855", "664644666664464464464644"}};
    std::printf("\nReal-model decode, matvecs only (weights streamed from DRAM, lm_head included):\n");
    for (const ModelDecode& md : models) {
      struct Mat {
        WeightView w;
        std::vector<uint8_t> bytes;
      };
      std::vector<Mat> mats;
      auto add = [&](GgmlType t, int64_t rows, int64_t cols) {
        mats.push_back(Mat{{}, random_weights(t, rows, cols, static_cast<uint32_t>(mats.size() + 1))});
        mats.back().w = WeightView{t, nullptr, rows, cols};
      };
      for (int l = 0; l < md.n_layers; ++l) {
        add(md.q, md.q_dim, md.d_model);
        add(md.k, md.kv_dim, md.d_model);
        add(md.v_types[l] == '8' ? GgmlType::Q8_0 : GgmlType::Q5_0, md.kv_dim, md.d_model);
        add(md.o, md.d_model, md.q_dim);
        add(md.gate_up, md.d_ff, md.d_model);
        add(md.gate_up, md.d_ff, md.d_model);
        add(md.down_types[l] == '6' ? GgmlType::Q6_K : GgmlType::Q4_K, md.d_model, md.d_ff);
      }
      add(md.output, md.vocab, md.d_model);
      size_t total = 0;
      for (Mat& m : mats) {
        m.w.data = m.bytes.data();
        total += m.bytes.size();
      }
      std::vector<float> x(md.d_ff), y(md.vocab);
      std::mt19937 rng(1);
      std::normal_distribution<float> nd;
      for (float& v : x) v = nd(rng);
      std::vector<block_q16_act> xq(md.d_ff / 32);
      for (int threads : {1, pool.size()}) {
        std::unique_ptr<ThreadPool> single = threads == pool.size() ? nullptr : std::make_unique<ThreadPool>(1);
        ThreadPool& p = single ? *single : pool;
        // Seconds per token spent in each weight type (the sum is the whole decode).
        double by_type[32] = {};
        auto decode_token = [&](bool timed) {
          for (Mat& m : mats) {
            const double t0 = timed ? now_s() : 0.0;
            quantize_acts(isa, x.data(), m.w.cols, xq.data());
            MatvecJob job{isa, &m.w, x.data(), xq.data(), y.data()};
            run_matvec(p, job);
            if (timed) by_type[static_cast<int>(m.w.type)] += now_s() - t0;
          }
        };
        for (int i = 0; i < 2; ++i) decode_token(false);
        const int tokens = 8;
        const double per_token = time_best(3, [&] {
                                   for (int i = 0; i < tokens; ++i) decode_token(false);
                                 }) /
                                 tokens;
        for (int i = 0; i < tokens; ++i) decode_token(true);
        std::printf("  %-26s %d thread%s: %6.1f tok/s (%.1f MB of weights per token, %.1f GB/s)", md.name, threads,
                    threads == 1 ? " " : "s", 1 / per_token, total / 1e6, total / per_token / 1e9);
        std::printf("   by type (GB/s):");
        for (GgmlType t : all_types) {
          size_t bytes = 0;
          for (const Mat& m : mats)
            if (m.w.type == t) bytes += m.bytes.size();
          if (bytes) std::printf(" %s %.1f", type_name(t), bytes * tokens / by_type[static_cast<int>(t)] / 1e9);
        }
        std::printf("\n");
      }
    }
  }

  // The host-side steps of a token that leave the matvecs: greedy's argmax and sampling's draw (engine/sampling.h) over
  // the three real models' vocabularies, one thread, logits ~ N(0, 3^2).
  if (selected(sections, "sample")) {
    std::printf("\nLogits, one thread (us a call, best of 5 x 50):\n  %-8s %8s %11s %8s %10s %11s %18s\n", "vocab",
                "argmax", "exp_weights", "T 0.8", "top_k 40", "top_p 0.9", "top_k 64 top_p .95");
    for (int n : {49152, 151936, 262144}) {
      std::vector<float> logits(n), w(n);
      std::mt19937 rng(3);
      std::normal_distribution<float> nd(0.f, 3.f);
      for (float& v : logits) v = nd(rng);
      volatile double sink = 0;
      auto us = [&](auto&& f) { return 1e6 * time_best(5, [&] { for (int r = 0; r < 50; ++r) f(); }) / 50; };
      auto draw = [&](SamplingParams sp) { return us([&] { sink = sample_logits(logits.data(), n, sp, 0.5); }); };
      std::printf("  %-8d %8.1f %11.1f %8.1f %10.1f %11.1f %18.1f\n", n,
                  us([&] { sink = argmax_logits(isa, logits.data(), n).value; }),
                  us([&] { sink = exp_weights(isa, logits.data(), n, 10.f, 1.25f, w.data()); }),
                  draw({0.8, 0, 1.0}), draw({0.8, 40, 1.0}), draw({0.8, 0, 0.9}), draw({1.0, 64, 0.95}));
    }
  }
  return 0;
}
