// The CPU budget of a process: which cores the device's compute gets and which the host-side
// engines get, and the CPU time each engine spends.
//
// On the cpu backend the emulated accelerator's compute (stream workers and their OpenMP teams),
// its copy engines (memcpy, where a GPU has DMA engines), the NVMe I/O threads and the host
// optimizer all run on the same machine's cores. A CpuBudget splits the cores the process may
// run on (its sched_getaffinity set) into a compute set and a host set, and the threads pin
// themselves to their set, so a figure measured on the cpu backend says how the engines overlap
// rather than how the scheduler happened to interleave them. Tunables (options.hpp):
// `cpu_affinity` (pin or not), `compute_cpus` / `host_cpus` (the split), `compute_threads` /
// `host_threads` (the thread counts; default: the size of each set). docs/offload.md says how
// the split is chosen and how a cpu-backend figure maps to a GPU machine.
//
// A CpuAccount sums the CPU clocks (CLOCK_THREAD_CPUTIME_ID) of the threads that joined it:
// busy time, not wall time, so an engine blocked on a queue or an event costs nothing.
//
// Thread safety: CpuSet and CpuBudget are plain values. CpuAccount may be joined and read from
// any thread; copies share one account.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.hpp"

namespace strata {

class Options;

// A set of CPU ids, kept sorted and unique.
class CpuSet {
 public:
  CpuSet() = default;
  explicit CpuSet(std::vector<int> cpus);
  // `count` consecutive ids from `first`.
  static CpuSet range(int first, int count);
  // A Linux cpu list: "3", "0-3", "0,2,4-7". The error names `key` and the expected form.
  static Result<CpuSet> parse(std::string_view text, std::string_view key);

  const std::vector<int>& cpus() const { return cpus_; }
  int size() const { return static_cast<int>(cpus_.size()); }
  bool empty() const { return cpus_.empty(); }
  bool contains(int cpu) const;
  bool contains(const CpuSet& other) const;
  bool overlaps(const CpuSet& other) const;
  CpuSet minus(const CpuSet& other) const;
  // The first `count` ids (all of them when count >= size()).
  CpuSet first(int count) const;
  std::string to_string() const;  // "0-3,6"; "" when empty
  friend bool operator==(const CpuSet&, const CpuSet&) = default;

 private:
  std::vector<int> cpus_;
};

// The CPUs the process may run on: sched_getaffinity of its main thread (what taskset, cgroups'
// cpuset or mpirun's binding allow), never less than one CPU.
CpuSet process_cpus();
// The calling thread's affinity.
CpuSet current_thread_cpus();
// Restricts the calling thread to `cpus` (threads it creates later inherit the set, which is how
// an OpenMP team led by a pinned thread is pinned). Fails, naming the set, when the kernel
// refuses it.
Status pin_current_thread(const CpuSet& cpus);

// Names the calling thread (its first 15 bytes, the kernel's limit) as top, perf and
// /proc/self/task/*/comm show it; threads it creates later (an OpenMP team) inherit the name.
// Engine threads are named copy.h2d, copy.d2h, stream:<name>, io.<n> and host.optimizer.
void name_current_thread(std::string_view name);

// What the tunables ask for. "auto" lets make() choose.
struct CpuBudgetConfig {
  bool affinity = true;               // cpu_affinity: pin threads to their set
  std::string compute_cpus = "auto";  // compute_cpus: a cpu list, or auto
  std::string host_cpus = "auto";     // host_cpus: a cpu list, or auto
  int compute_threads = 0;            // compute_threads: 0 = the size of the compute set
  int host_threads = 0;               // host_threads: 0 = the size of the host set
  // Processes of one job on this machine that share the same allowed cpus (several ranks
  // launched unbound): with both sets auto, each takes its own slice of the cpus before the
  // split, so the ranks do not all pin their compute to the same core.
  int local_rank = 0;
  int local_size = 1;

  // From the tunables cpu_affinity, compute_cpus, host_cpus, compute_threads, host_threads, and
  // the launcher's local rank and size (OMPI_COMM_WORLD_LOCAL_RANK / _SIZE, else LOCAL_RANK /
  // LOCAL_WORLD_SIZE).
  static CpuBudgetConfig from_options(const Options& options);
};

// The split. compute and host are subsets of allowed, never empty (except compute on a device
// whose compute does not run on host cores); they overlap only when there are not enough cores
// to keep them apart, or when the tunables ask for it.
struct CpuBudget {
  CpuSet allowed;           // the cpus the split was made from (this process's slice of them)
  CpuSet compute;           // device compute: cpu-backend stream workers and their OpenMP teams
  CpuSet host;              // host work: copy engines, NVMe I/O threads, the host optimizer and its team
  int compute_threads = 0;  // OpenMP threads per cpu-backend stream (0 on a GPU)
  int host_threads = 1;     // threads of the host optimizer
  bool pin = true;          // threads pin themselves to their set (cpu_affinity)

  // True when compute and host share a core (one allowed cpu, or sets chosen to overlap): the
  // engines then compete for it and overlap figures measure time slicing, not parallelism.
  bool shared() const { return compute.overlaps(host); }

  // The pure split, from a given set of allowed cpus (tests pass their own).
  //  - compute_cpus and host_cpus given: each must be a non-empty subset of `allowed`.
  //  - one given: the other is the rest of `allowed` (all of it when nothing is left).
  //  - neither: with local_size > 1, `allowed` is first cut into local_size contiguous slices and
  //    this process keeps slice local_rank (cpu local_rank % n when there are fewer cpus than
  //    processes). Then on one cpu both share it; on n >= 2 compute gets the first k cpus with
  //    k = compute_threads when set (at most n), else max(1, n / 2), and host the rest (all of
  //    them when k = n).
  // `device_on_host` false (cuda): the device computes elsewhere, compute is empty, host is
  // `allowed` unless host_cpus says otherwise, and host_threads defaults to max(1, n - 1) (one
  // core for the thread driving the device). Errors name the key (compute_cpus, host_cpus,
  // compute_threads, host_threads) and the allowed set.
  static Result<CpuBudget> make(const CpuBudgetConfig& config, const CpuSet& allowed,
                                bool device_on_host = true);
  // make() over process_cpus().
  static Result<CpuBudget> for_process(const CpuBudgetConfig& config, bool device_on_host = true);

  // Pin the calling thread to the compute / host set; no-ops when !pin (or the set is empty).
  Status pin_compute() const;
  Status pin_host() const;

  // "compute cpus 0 (1 thread), host cpus 1 (1 thread), pinned" (", shared" when they overlap).
  std::string to_string() const;
};

namespace cpu_detail {
struct AccountState;
}

// Busy CPU seconds of a group of threads, from each member's thread CPU clock.
class CpuAccount {
 public:
  CpuAccount();

  // The calling thread counts toward this account from now on (from its start when
  // `since_start`: for threads that have done nothing else, such as an engine's own thread or a
  // pool thread of an OpenMP team its members lead), until it exits or joins another account;
  // its time so far stays with the account it leaves. Joining the account it is in is a no-op
  // (cheap: a thread-local compare).
  void join(bool since_start = false) const;
  // Joins every thread of the calling thread's OpenMP team of `threads` (one parallel region) to
  // this account since their start. Call it on a thread whose team works only for this account.
  void join_team(int threads) const;
  // The account the calling thread is in; an invalid one (valid() false) when none.
  static CpuAccount of_current_thread();

  bool valid() const { return state_ != nullptr; }
  // CPU seconds of every member so far, the exited ones included.
  double seconds() const;
  // Threads that have joined so far (exited ones included).
  int threads() const;

 private:
  explicit CpuAccount(std::shared_ptr<cpu_detail::AccountState> state) : state_(std::move(state)) {}
  std::shared_ptr<cpu_detail::AccountState> state_;
};

}  // namespace strata
