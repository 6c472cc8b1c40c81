// Spreading a kernel's work items over XLA's intra-op thread pool (shared by the CPU kernels).
#ifndef JAXSERVE_PALLAS_KERNELS_CPU_PARALLEL_H_
#define JAXSERVE_PALLAS_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

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

// Runs job.run(i) for i in [0, n) on the calling thread and up to pool.num_threads() - 1 pool
// threads, each taking the next item from a shared counter; returns when all are done. The
// counters are owned jointly with the scheduled tasks, so a task the pool starts late (after
// this returned) finds no item left and never touches `job`.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, ParallelJob& job) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int32_t> active{0};
  };
  auto st = std::make_shared<Shared>();
  auto work = [n](Shared& s, ParallelJob* j) {
    s.active.fetch_add(1);
    int64_t i = s.next.fetch_add(1);
    if (i < n) {
      j->begin();
      for (; i < n; i = s.next.fetch_add(1)) j->run(i);
      j->end();
    }
    s.active.fetch_sub(1);
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n) - 1;
  ParallelJob* jp = &job;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([st, jp, work]() { work(*st, jp); });
  }
  work(*st, jp);
  while (st->active.load() != 0) std::this_thread::yield();
}

}  // namespace jaxserve

#endif  // JAXSERVE_PALLAS_KERNELS_CPU_PARALLEL_H_
