// Private pieces of the comm layer: the operation handle's state, the in-order queue every Comm
// runs its operations on, and the context's shared state that backends report failures to.
//
// Life of an operation: the calling thread validates the arguments (a bad argument completes the
// handle with the error at once and leaves the Comm usable), then appends a closure to the
// Comm's CommQueue and returns the handle. The queue's thread runs closures one at a time in
// append order; a closure starts the backend's non-blocking operation and polls it until it
// completes or its deadline (start + CommConfig::timeout) passes. A waiting caller may run them
// itself instead (run_inline), and a send or recv submitted to an idle queue is posted by its
// submitter at once (submit_async); either does what the thread would, in the same order. The first failure (other than
// kInvalidArgument, a caller's mistake that leaves the peers in a known state) marks the
// queue broken: every later closure is not run and its handle gets kCancelled naming that
// failure, and the failure goes to the context (watchdog, see context.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/inline_function.hpp"
#include "parallel/work_state.hpp"
#include "parallel/poll_pacer.hpp"
#include "strata/build_config.hpp"
#include "strata/parallel.hpp"

#if STRATA_HAVE_MPI
// The C API only: the deprecated C++ bindings would come in with mpi.h otherwise.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace strata::detail {

class CommQueue;

// A handle that is already complete with `status` (argument errors, size-1 shortcuts).
CommWork finished_work(Status status);

class CommQueue {
 public:
  // A blocking operation: runs to completion (or failure) on the queue thread.
  using Op = InlineFunction<Status()>;
  // An operation that completes later: polled until it returns true (done) or an error (which
  // includes its own deadline passing).
  using Poll = InlineFunction<Result<bool>()>;
  // Starts an asynchronous operation (posts it to the library) and returns its poll.
  using Start = InlineFunction<Result<Poll>()>;
  using FailureSink = std::function<void(const Status&)>;

  // `label` names the Comm in cancellation messages; `on_failure` is told of the first failure.
  CommQueue(std::string label, FailureSink on_failure);
  // Runs what is queued, then stops the thread.
  ~CommQueue();
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  // Starts after every earlier operation has completed.
  CommWork submit(Op op);
  // Starts after every earlier blocking operation has completed, without waiting for earlier
  // asynchronous ones (point-to-point: a send and the matching recv may both be in flight).
  // When nothing is queued and nobody runs the queue, that is now: the submitting thread posts
  // it itself (`start` runs on it, under the queue's lock) and leaves it in flight, so the peer
  // can match it at once while the submitter goes on, and no queue thread has to wake up for it.
  CommWork submit_async(Start start);
  // Waits until everything submitted so far has completed; the first failure, if any.
  Status drain();
  // Called by a thread about to wait for `state`: when nobody runs the queue (the queue thread
  // is asleep, no other caller is in here) and `state` is in flight or among the first
  // kMaxInlineEntries pending operations, the calling thread takes everything in flight and the
  // pending operations up to and including `state`, in order, and runs them as the queue thread
  // would (asynchronous ones started at once, a blocking one after those before it completed),
  // polls until `state` completes, and hands whatever is still in flight to the queue thread
  // (true). It stops early, handing over, when another operation is submitted meanwhile.
  // Waking the queue thread and being woken back costs two scheduler hand-offs, which dominate
  // small messages; the MPI library's own blocking calls pay neither.
  bool run_inline(WorkState* state);
  // Called by a thread about to sleep on a handle (after run_inline) and when it is done: while
  // any thread sleeps so, the queue thread takes pending operations at once (see kDoze).
  void begin_wait();
  void end_wait();
  bool broken() const;

 private:
  struct Entry {
    std::shared_ptr<WorkState> state;
    Op op;        // blocking, or
    Start start;  // asynchronous
    std::chrono::steady_clock::time_point submitted;
  };
  struct InFlight {
    std::shared_ptr<WorkState> state;
    Poll poll;
  };

  // A waiting caller runs at most this many queued operations (a send/recv pair, a few sends
  // before a collective); further down a queue it leaves them to the queue thread.
  static constexpr std::size_t kMaxInlineEntries = 8;
  // After a submit the sleeping queue thread dozes for kDozeSpan: it waits kDoze at a time
  // instead of until woken, and a submit meanwhile does not wake it (the thread finds the
  // operation within kDoze plus the timer slack, unless a waiting caller ran it first). So an
  // operation submitted and then waited for costs no thread wake-up, and one that nobody waits
  // for starts at most ~kDoze late while operations keep coming, at once otherwise. For the same
  // reason the thread, with nothing in flight and nobody asleep on a handle, leaves an operation
  // to its submitter for kDoze after the submit: taking it at once made that submitter's wait
  // sleep on the handle and be woken back (two hand-offs), and a thread that was awake when the
  // next operations came took those too, the caller sleeping on every one (measured: a sixth of
  // 4 KiB send/recv pairs on one rank, docs/parallel.md).
  static constexpr std::chrono::microseconds kDoze{50};
  static constexpr std::chrono::microseconds kDozeSpan{2000};
  // While a caller runs operations itself (run_inline) the thread may take nothing, so a doze
  // that finds one running waits kPark instead of kDoze: each timed wake-up preempts a rank on a
  // machine whose cores the ranks fill (~10 us of the rank's core per tick here, and its peer
  // stalls meanwhile), which cost every operation of 16 KiB-4 MiB 5-10% at kPark 500 us
  // (docs/parallel.md "Sends and receives posted by their submitter; the doze's ticks").
  // run_inline wakes the thread when it leaves work behind; a collective submitted after it
  // returned and never waited for starts at most ~kPark late (sends and recvs are posted by their
  // submitter and do not wait for the thread). Equal to kDozeSpan: while callers run everything
  // the thread wakes about once per kDozeSpan. Measured on 2 ranks (same run, alternating): the
  // pipeline schedules' bubbles and step times the same at 500 us and 2 ms.
  static constexpr std::chrono::microseconds kPark{2000};
  // The doze's tick and how long a fresh operation is left to its submitter: kDoze at first,
  // doubled (up to kPark) each time a timed wake-up finds that the callers ran everything
  // themselves, back to kDoze when the thread had to start an operation nobody took (its
  // submitter does not wait for it) and after a quiet spell. Each wake-up preempts a rank on a
  // machine whose cores the ranks fill: at kDoze, a stream of 4 KiB send/recv pairs that the
  // callers ran themselves saw ten times the context switches of bare MPI and took 1.6x its
  // time (docs/parallel.md "Small messages without hand-offs"). Under mu_.
  std::chrono::microseconds tick_ = kDoze;

  // submit and submit_async: gives `e` its handle's state and appends it.
  CommWork enqueue(Entry e);
  void run();
  // Runs a dequeued blocking operation and completes its handle.
  void execute(Entry& e);
  // Starts a dequeued asynchronous operation into `list` (or completes it with its error, or
  // cancelled after an earlier failure).
  void start_async(Entry& e, std::vector<InFlight>& list);
  // Polls every operation of `list` once; completes and removes the finished. True if any did.
  bool poll_once(std::vector<InFlight>& list);
  // Polls every in-flight operation once (or until none is left, pacing the polls); completes
  // the finished ones. True when at least one completed.
  bool poll_in_flight(bool until_empty);
  void fail(const Status& s);
  static bool breaks_comm(const Status& s);
  Status earlier_failure() const;
  // The status of an operation not run because `earlier` failed the Comm.
  Status cancelled_by(const Status& earlier) const;

  std::string label_;
  FailureSink on_failure_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> pending_;
  bool stopping_ = false;
  bool worker_active_ = true;   // the queue thread is not asleep (it owns in_flight_ then)
  bool inline_active_ = false;  // a waiting thread is running an operation (run_inline)
  bool dozing_ = false;         // the queue thread is in a timed wait (kDoze): submit need not wake it
  int waiters_ = 0;             // threads asleep on a handle of this queue (begin_wait)
  // in_flight_ while nobody runs the queue: handed over by a caller's inline run (the thread
  // polls it at once) rather than posted directly by submitters (left to them for tick_ after
  // unclaimed_since_, when the first of them was posted).
  bool handed_over_ = false;
  std::chrono::steady_clock::time_point unclaimed_since_;
  std::chrono::steady_clock::time_point doze_until_;  // the last submit + kDozeSpan
  Status failure_;
  // failure_ is set: read without mu_ on every operation's start (the lock is taken only after).
  std::atomic<bool> broken_{false};
  // Operations submitted so far: run_inline's poll loop checks it, without mu_, for one
  // submitted meanwhile.
  std::atomic<std::uint64_t> submits_{0};
  // Started operations. The queue thread's while it is awake (worker_active_), run_inline's
  // (moved to inline_flight_) while a caller runs the queue; under mu_ while nobody does, when
  // submitters post asynchronous operations into it directly and run_inline hands its leftovers
  // over. Whoever runs the queue next takes all of it.
  std::vector<InFlight> in_flight_;
  PollPacer pacer_;  // queue thread only: paces the polls of in_flight_
  // run_inline's, used only while inline_active_ (by the one thread that set it).
  std::vector<Entry> inline_batch_;
  std::vector<InFlight> inline_flight_;
  std::thread thread_;  // last: started after every other member exists
};

// "group 'dp' (world ranks 0,2)".
std::string describe_group(const std::string& name, const std::vector<int>& world_ranks);
// "4097 x f32".
std::string describe_count(std::size_t count, DType dtype);
// Checks shared by every backend; `what` names the operation.
Status check_count(std::size_t count, DType dtype, const char* what);

}  // namespace strata::detail

namespace strata {

struct CommContext::Impl {
  CommConfig config;
  bool owns_mpi = false;  // this context called MPI_Init_thread
  int rank = 0;
  int size = 1;

  // The first failure of any Comm, and the watchdog that aborts the job after it.
  mutable std::mutex mu;
  std::condition_variable cv;
  Status failure;
  bool closing = false;
  std::thread watchdog;

  void report_failure(const Status& status);
  void watch();
  [[noreturn]] void abort_job(const char* why) const;
};

namespace detail {
#if STRATA_HAVE_MPI
// Takes ownership of `comm` (freed by the Comm unless it failed; see mpi_comm.cpp).
std::unique_ptr<Comm> make_mpi_comm(CommContext::Impl& context, MPI_Comm comm, std::string name);
// Fails when this build has no NCCL. `bootstrap` is owned as above; the unique id travels on it.
Result<std::unique_ptr<Comm>> make_nccl_comm(CommContext::Impl& context, MPI_Comm bootstrap,
                                             std::string name);
// The world ranks of `comm`'s members, in its rank order.
std::vector<int> world_ranks_of(MPI_Comm comm);
// "MPI_Allreduce failed: <MPI's error string>".
Status mpi_status(int rc, const std::string& what);
#endif
}  // namespace detail

}  // namespace strata
