// Memory read bandwidth as the CPU backend's threads see it: the yardstick for "fraction of the bandwidth floor".
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "cpu/bandwidth.h"
#include "cpu/thread_pool.h"

namespace metalattn::cpu {
namespace {

__attribute__((target_clones("avx512f", "avx2", "default")))
uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t lanes[8] = {0};
  for (size_t i = 0; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += p[i + j];
  uint64_t s = 0;
  for (int j = 0; j < 8; ++j) s += lanes[j];
  return s;
}

}  // namespace

double measure_read_bandwidth(int n_threads, size_t bytes, int repeats) {
  ThreadPool pool(n_threads);
  std::vector<uint64_t> buf(bytes / sizeof(uint64_t));
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = i;  // touch every page before timing
  std::vector<uint64_t> sink(pool.size());
  double best = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel([&](int ti, int nt) {
      int64_t b, e;
      split_range(static_cast<int64_t>(buf.size()), ti, nt, 8, &b, &e);
      sink[ti] += sum_words(buf.data() + b, static_cast<size_t>(e - b));
    });
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, dt);  // the first pass warms up the threads
  }
  volatile uint64_t keep = 0;
  for (uint64_t v : sink) keep += v;
  (void)keep;
  return static_cast<double>(buf.size() * sizeof(uint64_t)) / best;
}

}  // namespace metalattn::cpu
