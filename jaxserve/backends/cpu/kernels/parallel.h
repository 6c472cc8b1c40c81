// Spreading a kernel's work items over the CPU cores (shared by the CPU kernels).
//
// A decode step makes about 150 kernel calls of tens to hundreds of microseconds, a few small
// XLA ops apart. Handing items to XLA's intra-op pool measured slower here (a 32-request step
// took 70-80 ms against 55-60 ms with this pool): its workers often wake after the calling
// thread has done most items alone. So the kernels use their own helper threads (one per
// extra core), which spin briefly after each job, yielding the core to anyone else who wants
// it, waiting for the next one, and then sleep on a condition variable.
#ifndef JAXSERVE_PALLAS_KERNELS_CPU_PARALLEL_H_
#define JAXSERVE_PALLAS_KERNELS_CPU_PARALLEL_H_

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

namespace jaxserve {

// The items of one kernel call. begin()/end() run once on each thread that takes items (for
// per-thread set-up such as AMX tile configuration); run(i) once per item.
class ParallelJob {
 public:
  virtual ~ParallelJob() = default;
  virtual void begin() {}
  virtual void run(int64_t item) = 0;
  virtual void end() {}
};

class HelperPool {
 public:
  // The process-wide pool (never destroyed: its threads are detached).
  static HelperPool& get() {
    static HelperPool* pool = new HelperPool();
    return *pool;
  }

  // Runs job.run(i) for i in [0, n) on the calling thread and the helpers, each taking the next
  // item from a shared counter; returns when all are done. One job at a time: a call made while
  // another is running (XLA may run two kernels at once) runs on its own thread alone.
  void run(int64_t n, ParallelJob& job) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || helpers_ == 0 || n < 2) {
      State solo;
      solo.job = &job;
      solo.n = n;
      work(solo);
      return;
    }
    auto st = std::make_shared<State>();
    st->job = &job;
    st->n = n;
    {
      std::lock_guard<std::mutex> lk(mu_);
      current_ = st;
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    work(*st);
    // Items are all taken; wait for helpers still running one. A helper that arrives later
    // finds no item left and never touches `job`.
    while (st->active.load() != 0) std::this_thread::yield();
  }

 private:
  struct State {
    ParallelJob* job = nullptr;
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int32_t> active{0};
  };

  HelperPool() {
    cpu_set_t set;
    unsigned cores = std::thread::hardware_concurrency();
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
    helpers_ = static_cast<int>(std::clamp(cores, 1u, 16u)) - 1;
    for (int i = 0; i < helpers_; ++i) {
      std::thread([this] {
        pthread_setname_np(pthread_self(), "jaxserve-kernel");
        loop();
      }).detach();
    }
  }

  static void work(State& s) {
    s.active.fetch_add(1);
    int64_t i = s.next.fetch_add(1);
    if (i < s.n) {
      s.job->begin();
      for (; i < s.n; i = s.next.fetch_add(1)) s.job->run(i);
      s.job->end();
    }
    s.active.fetch_sub(1);
  }

  void loop() {
    uint64_t seen = gen_.load();
    for (;;) {
      // Spin for a while (the next kernel call is usually microseconds away), then sleep.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while (gen_.load() == seen && std::chrono::steady_clock::now() < until) {
        for (int k = 0; k < 64 && gen_.load() == seen; ++k) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        }
        sched_yield();
      }
      std::shared_ptr<State> st;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load() != seen; });
        seen = gen_.load();
        st = current_;
      }
      if (st) work(*st);
    }
  }

  int helpers_ = 0;
  std::mutex run_mu_;  // held by the call whose job the helpers serve
  std::mutex mu_;      // guards current_; pairs with cv_
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::shared_ptr<State> current_;
};

// Runs job.run(i) for i in [0, n) across the cores (see HelperPool::run).
inline void parallel_for(int64_t n, ParallelJob& job) { HelperPool::get().run(n, job); }

}  // namespace jaxserve

#endif  // JAXSERVE_PALLAS_KERNELS_CPU_PARALLEL_H_
