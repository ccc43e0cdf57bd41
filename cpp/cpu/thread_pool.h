// A fixed pool for the ~300 small parallel operations of one token: workers spin briefly on an epoch counter
// before sleeping, because a sleep/wake round trip (tens of microseconds) would dwarf each operation.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace metalattn::cpu {

class ThreadPool {
 public:
  // n_threads <= 0: all physical cores.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(ctx, thread_index, n_threads) on every thread (the caller is thread 0); returns when all are done.
  // Tasks must not throw; if one does anyway, run() waits for all threads and rethrows the first exception.
  // One run at a time: run() must not be called concurrently or from inside a task.
  using Task = void (*)(void* ctx, int thread_index, int n_threads);
  void run(Task fn, void* ctx);

  // Convenience: any callable f(int thread_index, int n_threads).
  template <class F>
  void parallel(F&& f) {
    run([](void* c, int i, int n) { (*static_cast<F*>(c))(i, n); }, &f);
  }

  static int physical_cores();

 private:
  void worker(int index);
  int n_threads_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  std::exception_ptr error_;  // first exception a worker's task threw during the current run
  std::mutex mu_;
  std::condition_variable cv_;
};

// Splits [0, n) into n_parts near-equal chunks aligned to `align`; returns chunk `part` as [begin, end).
inline void split_range(int64_t n, int part, int n_parts, int64_t align, int64_t* begin, int64_t* end) {
  const int64_t units = (n + align - 1) / align;
  const int64_t b = units * part / n_parts, e = units * (part + 1) / n_parts;
  *begin = b * align < n ? b * align : n;
  *end = e * align < n ? e * align : n;
}

}  // namespace metalattn::cpu
