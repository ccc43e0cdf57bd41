#include "thread_pool.h"

#ifdef __linux__
#include <sched.h>
#endif

#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MA_CPU_RELAX() _mm_pause()
#else
#define MA_CPU_RELAX() std::this_thread::yield()
#endif

namespace metalattn::cpu {

namespace {

// How long an idle worker waits for the next run before sleeping on the condition variable: long enough to
// cover the gaps between the ~300 operations of one token, short enough not to burn a core for long. Past
// kPureSpinTime it also yields, so that a thread descheduled on a busy (oversubscribed) machine gets the core.
constexpr auto kPureSpinTime = std::chrono::microseconds(30);
constexpr auto kSpinTime = std::chrono::microseconds(200);

#ifdef __linux__
// C stdio rather than iostreams: on a GPU machine the extension was seen to crash inside std::istream's locale
// facets (a libstdc++ linked into the module next to the interpreter's), and this runs at every model load.
bool read_int(const std::string& path, int* value) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return false;
  const bool ok = std::fscanf(f, "%d", value) == 1;
  std::fclose(f);
  return ok;
}
#endif

}  // namespace

int ThreadPool::physical_cores() {
  // Distinct (package, core) pairs among the CPUs this process may run on; SMT siblings share a pair.
  std::set<std::pair<int, int>> cores;
#ifdef __linux__
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &mask)) continue;
      const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
      int package = 0, core = 0;
      if (!read_int(dir + "physical_package_id", &package) || !read_int(dir + "core_id", &core)) {
        cores.clear();
        break;  // topology unreadable: fall back below
      }
      cores.insert({package, core});
    }
  }
#endif
  if (!cores.empty()) return static_cast<int>(cores.size());
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads > 0 ? n_threads : physical_cores()) {
  threads_.reserve(n_threads_ - 1);
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    epoch_.fetch_add(1);
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::run(Task fn, void* ctx) {
  if (n_threads_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  task_ = fn;
  ctx_ = ctx;
  error_ = nullptr;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    // Publishing under the mutex means a worker that is about to sleep cannot miss this epoch.
    // Uncontended, the lock and a notify with no sleepers cost well under a microsecond.
    std::lock_guard<std::mutex> lock(mu_);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();

  std::exception_ptr caller_error;
  try {
    fn(ctx, 0, n_threads_);
  } catch (...) {
    caller_error = std::current_exception();  // still wait: the workers are using ctx
  }
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 2000) {
      MA_CPU_RELAX();
    } else {
      std::this_thread::yield();  // a worker was descheduled (oversubscribed machine): let it run
    }
  }
  if (caller_error) std::rethrow_exception(caller_error);
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    // Spin on the epoch first: most runs follow the previous one within microseconds.
    const auto spin_start = std::chrono::steady_clock::now();
    uint64_t now_epoch = epoch_.load(std::memory_order_acquire);
    bool yielding = false;
    for (int i = 0; now_epoch == seen; ++i) {
      if (yielding) {
        std::this_thread::yield();
      } else {
        MA_CPU_RELAX();
      }
      if ((i & 63) == 63) {
        const auto spun = std::chrono::steady_clock::now() - spin_start;
        if (spun > kSpinTime) break;
        yielding = spun > kPureSpinTime;
      }
      now_epoch = epoch_.load(std::memory_order_acquire);
    }
    if (now_epoch == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
      now_epoch = epoch_.load(std::memory_order_acquire);
    }
    seen = now_epoch;
    if (stop_.load(std::memory_order_acquire)) return;
    try {
      task_(ctx_, index, n_threads_);
    } catch (...) {
      // Tasks should not throw; if one does, run() rethrows the first such exception in the caller.
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace metalattn::cpu
