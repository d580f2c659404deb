// A spinning thread pool for the GGUF matmul (internal to src/cpp/cpu).
//
// A decode step runs a few hundred small matmuls (SmolLM2-135M: 211, most
// 10-50 us of work). cpu::parallel_for wakes its workers through a condition
// variable for every call and the caller waits until every worker has checked
// in: on these VMs a wake-up takes longer than the work, so two threads were
// slower than one. Here workers spin for a while (kSpinMicros) after each job
// before they sleep, so back-to-back calls find them awake; the caller claims
// chunks like the workers and waits only for chunks in flight, never for a
// worker to wake. Header-only because the arm64 cross-build compiles a fixed
// list of source files. cpu::parallel_for (every other kernel) runs on this pool too.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace gguf_pool_detail {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr int64_t kSpinMicros = 200;  // a worker's busy wait for the next job
constexpr int kYieldEvery = 32;       // pauses (~20 ns each) between yields while spinning

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs chunk(ctx, i) for i < num_chunks on the caller and the workers.
  void run(int64_t num_chunks, void (*chunk)(void*, int64_t), void* ctx) {
    job_ = chunk;
    ctx_ = ctx;
    num_chunks_.store(num_chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(gen << 32, std::memory_order_seq_cst);  // publishes the job
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    drain(gen);
    // chunks claimed by workers are running: wait for them, and yield the core now
    // and then in case a worker shares it (an oversubscribed machine)
    for (int spins = 1; done_.load(std::memory_order_acquire) < num_chunks; ++spins) {
      cpu_relax();
      if (spins % kYieldEvery == 0) std::this_thread::yield();
    }
    // Close the generation before the next job's fields are written: a worker that read
    // this ticket (gen, num_chunks) and then the next job's larger num_chunks_ must fail
    // its claim, or it would run a chunk that does not exist and count it as done.
    ticket_.store((gen << 32) | kClosed, std::memory_order_seq_cst);
  }

 private:
  // Claims and runs chunks of generation gen until none are left.
  void drain(uint64_t gen) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) != gen ||
          static_cast<int64_t>(t & 0xffffffffu) >= num_chunks_.load(std::memory_order_relaxed)) {
        return;
      }
      // a successful claim proves the job of `gen` is still the published one
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      job_(ctx_, static_cast<int64_t>(t & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_release);
    }
  }
  // job_ / ctx_ are read only after a successful claim, when the caller cannot be
  // publishing the next job; num_chunks_ is read before one: a value of the next job
  // can only make the claim fail (run() closed the ticket before writing it) or stop
  // a late worker.
  static constexpr uint64_t kClosed = 0xffffffffu;  // chunk index of a finished generation

  void work() {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      uint64_t gen = wait_for_job(seen);
      if (gen == 0) return;
      drain(gen);
      seen = gen;
    }
  }

  // The next generation after `seen`, spinning first, then sleeping; 0 on stop.
  uint64_t wait_for_job(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int i = 0;; ++i) {
      uint64_t gen = ticket_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) return gen;
      if (stop_.load(std::memory_order_relaxed)) return 0;
      cpu_relax();
      if (i % kYieldEvery == kYieldEvery - 1) {
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() > until) break;
      }
    }
    std::unique_lock<std::mutex> lock(mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t gen;
    wake_.wait(lock, [&] {
      gen = ticket_.load(std::memory_order_seq_cst) >> 32;
      return gen != seen || stop_.load();
    });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return stop_.load() ? 0 : gen;
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  // generation << 32 | next chunk to claim
  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  void (*job_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<int64_t> num_chunks_{0};
};

struct State {
  std::mutex use;  // held by the caller that runs a job on the pool
  std::unique_ptr<Pool> pool;
};

inline State& state() {
  static State s;
  return s;
}

}  // namespace gguf_pool_detail

// Calls fn(begin, end) over [0, n) in chunks of at least `grain` items, on
// cpu::num_threads() threads (the caller included). Nested or concurrent calls
// run inline.
template <class F>
void gguf_parallel_for(int64_t n, int64_t grain, const F& fn) {
  namespace d = gguf_pool_detail;
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int threads = num_threads();
  const int64_t max_chunks = (n + grain - 1) / grain;
  d::State& st = d::state();
  std::unique_lock<std::mutex> lock(st.use, std::try_to_lock);
  if (threads <= 1 || max_chunks <= 1 || !lock.owns_lock()) {
    fn(int64_t{0}, n);
    return;
  }
  if (!st.pool || st.pool->size() != threads) {
    st.pool.reset();
    st.pool = std::make_unique<d::Pool>(threads);
  }
  // a few chunks per thread balance uneven progress (a descheduled thread)
  int64_t num_chunks = std::min<int64_t>(max_chunks, int64_t{threads} * 4);
  const int64_t step = (n + num_chunks - 1) / num_chunks;
  num_chunks = (n + step - 1) / step;
  struct Ctx {
    const F* fn;
    int64_t n, step;
  } ctx{&fn, n, step};
  st.pool->run(num_chunks, [](void* p, int64_t c) {
    auto* x = static_cast<Ctx*>(p);
    const int64_t b = c * x->step;
    (*x->fn)(b, std::min(x->n, b + x->step));
  }, &ctx);
}

}  // namespace vllm_metal::cpu
