// WorkState: the shared state behind a CommWork handle. Its own header, free of MPI and CUDA
// (as poll_pacer.hpp), so the unit test of its completion protocol (tests/test_parallel_comm.cpp)
// needs neither.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>

#include "strata/status.hpp"

namespace strata::detail {

class CommQueue;

struct WorkState {
  // The queue it was submitted to (null for a handle finished at once). A Comm outlives every
  // wait on its handles, so this stays valid for as long as wait() can use it.
  CommQueue* queue = nullptr;
  // Completion without a lock unless somebody sleeps on the handle: complete() writes `status`,
  // then sets `done`, then takes mu and notifies only if `sleepers` is nonzero; a waiter counts
  // itself in `sleepers` before it checks `done` under mu. Both sides use sequentially consistent
  // order on the two flags, so either the waiter sees done or complete() sees the sleeper (and
  // its notify waits for the waiter to be in cv's wait, as it holds mu until then). `done` is
  // never cleared: a reader that sees it set may read `status` without the lock.
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> done{false};
  std::atomic<int> sleepers{0};
  Status status;

  void complete(Status s);
  bool finished() const { return done.load(std::memory_order_acquire); }
  // Blocks until complete() has run.
  void sleep_until_done();
};

}  // namespace strata::detail
