#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace vllm_metal::cpu {

namespace {

class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    for (int i = 1; i < n; ++i) {
      workers_.emplace_back([this] { work(); });
    }
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs chunks [0, num_chunks) on all threads, the caller included.
  void run(int64_t num_chunks, const std::function<void(int64_t)>& chunk) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &chunk;
      num_chunks_ = num_chunks;
      next_.store(0);
      pending_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    drain(chunk);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void drain(const std::function<void(int64_t)>& chunk) {
    for (int64_t i = next_.fetch_add(1); i < num_chunks_; i = next_.fetch_add(1)) {
      chunk(i);
    }
  }
  void work() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      drain(*job);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t num_chunks_ = 0;
  std::atomic<int64_t> next_{0};
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

std::mutex g_pool_mutex;  // held while a parallel_for uses the pool
std::unique_ptr<ThreadPool> g_pool;
std::atomic<int> g_requested{0};

int hardware_threads() {
  // glibc answers hardware_concurrency() by reading /sys on every call (~6 us)
  static const int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return n;
}

}  // namespace

int num_threads() {
  int n = g_requested.load();
  return n > 0 ? n : hardware_threads();
}

void set_num_threads(int n) {
  g_requested.store(std::max(0, n));
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  int threads = num_threads();
  int64_t max_chunks = (n + grain - 1) / grain;
  std::unique_lock<std::mutex> lock(g_pool_mutex, std::try_to_lock);
  if (threads <= 1 || max_chunks <= 1 || !lock.owns_lock()) {
    fn(0, n);
    return;
  }
  if (!g_pool || g_pool->size() != threads) {
    g_pool.reset();
    g_pool = std::make_unique<ThreadPool>(threads);
  }
  // A few chunks per thread balance uneven rows without much scheduling cost.
  int64_t num_chunks = std::min<int64_t>(max_chunks, int64_t(threads) * 4);
  int64_t step = (n + num_chunks - 1) / num_chunks;
  num_chunks = (n + step - 1) / step;
  g_pool->run(num_chunks, [&](int64_t c) {
    int64_t b = c * step;
    fn(b, std::min(n, b + step));
  });
}

}  // namespace vllm_metal::cpu
