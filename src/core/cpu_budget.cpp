// CpuSet parsing, the split of the process's cpus between device compute and host work, thread
// pinning, and CpuAccount's bookkeeping of thread CPU clocks.
//
// CpuAccount: each thread holds (thread_local) at most one membership: the account it belongs to,
// its CPU clock id and the clock's reading when it joined. The account keeps the live members and
// the seconds of members that left (exited, or moved to another account). A thread leaves under
// the account's lock, while it is still alive, so a reader never reads the clock of a thread that
// is gone: seconds() = retired + sum over live members of (clock now - base).
#include "strata/cpu_budget.hpp"

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <optional>

#include "strata/options.hpp"

namespace strata {

// ---- CpuSet ---------------------------------------------------------------------------------

CpuSet::CpuSet(std::vector<int> cpus) : cpus_(std::move(cpus)) {
  std::sort(cpus_.begin(), cpus_.end());
  cpus_.erase(std::unique(cpus_.begin(), cpus_.end()), cpus_.end());
}

CpuSet CpuSet::range(int first, int count) {
  std::vector<int> v;
  for (int i = 0; i < count; ++i) v.push_back(first + i);
  return CpuSet(std::move(v));
}

Result<CpuSet> CpuSet::parse(std::string_view text, std::string_view key) {
  auto bad = [&](std::string_view why) {
    return invalid_argument(std::string(key) + ": '" + std::string(text) + "' is not a cpu list (" +
                            std::string(why) + "; expected e.g. 0, 0-3 or 0,2,4-7)");
  };
  auto number = [](std::string_view s, int* out) {
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    return ec == std::errc() && end == s.data() + s.size() && *out >= 0 && *out < CPU_SETSIZE;
  };
  std::vector<int> cpus;
  std::string_view rest = text;
  if (rest.empty()) return bad("empty");
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (item.empty()) return bad("an empty item");
    const size_t dash = item.find('-');
    int lo = 0, hi = 0;
    if (dash == std::string_view::npos) {
      if (!number(item, &lo))
        return bad("'" + std::string(item) + "' is not a cpu id below " + std::to_string(CPU_SETSIZE));
      hi = lo;
    } else {
      if (!number(item.substr(0, dash), &lo) || !number(item.substr(dash + 1), &hi)) {
        return bad("'" + std::string(item) + "' is not a range of cpu ids below " +
                   std::to_string(CPU_SETSIZE));
      }
      if (hi < lo) return bad("range '" + std::string(item) + "' runs backwards");
    }
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    if (comma != std::string_view::npos && rest.empty()) return bad("a trailing comma");
  }
  return CpuSet(std::move(cpus));
}

bool CpuSet::contains(int cpu) const { return std::binary_search(cpus_.begin(), cpus_.end(), cpu); }

bool CpuSet::contains(const CpuSet& other) const {
  return std::includes(cpus_.begin(), cpus_.end(), other.cpus_.begin(), other.cpus_.end());
}

bool CpuSet::overlaps(const CpuSet& other) const {
  return std::any_of(other.cpus_.begin(), other.cpus_.end(), [&](int c) { return contains(c); });
}

CpuSet CpuSet::minus(const CpuSet& other) const {
  std::vector<int> v;
  for (int c : cpus_) {
    if (!other.contains(c)) v.push_back(c);
  }
  return CpuSet(std::move(v));
}

CpuSet CpuSet::first(int count) const {
  const auto n = static_cast<size_t>(std::clamp(count, 0, size()));
  return CpuSet(std::vector<int>(cpus_.begin(), cpus_.begin() + static_cast<std::ptrdiff_t>(n)));
}

std::string CpuSet::to_string() const {
  std::string out;
  for (size_t i = 0; i < cpus_.size();) {
    size_t j = i;
    while (j + 1 < cpus_.size() && cpus_[j + 1] == cpus_[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus_[i]);
    if (j > i) out += '-' + std::to_string(cpus_[j]);
    i = j + 1;
  }
  return out;
}

// ---- Affinity ---------------------------------------------------------------------------------

namespace {

// LLVM's OpenMP runtime (libomp: clang's -fopenmp, the sanitizer builds) binds the threads of a
// team it creates to the process's full cpu mask unless told otherwise, undoing the pinning of
// the thread that starts the team; GCC's libgomp lets new threads inherit their creator's mask.
// So unless the user chose a KMP_AFFINITY, Strata asks libomp to leave affinity alone. This runs
// when libstrata is loaded, before any OpenMP call (libomp reads its environment lazily, at its
// first use). Harmless with libgomp, which ignores the variable.
[[maybe_unused]] const bool kOpenMpAffinityLeftToStrata = [] {
  (void)::setenv("KMP_AFFINITY", "disabled", /*overwrite=*/0);
  return true;
}();

CpuSet from_mask(const cpu_set_t& mask) {
  std::vector<int> v;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mask)) v.push_back(c);
  }
  return CpuSet(std::move(v));
}

CpuSet fallback_cpus() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return CpuSet::range(0, n > 0 ? static_cast<int>(n) : 1);
}

}  // namespace

CpuSet process_cpus() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  // pid = the process: the main thread's mask, which this runtime never changes.
  if (::sched_getaffinity(::getpid(), sizeof mask, &mask) != 0) return fallback_cpus();
  CpuSet s = from_mask(mask);
  return s.empty() ? fallback_cpus() : s;
}

CpuSet current_thread_cpus() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::pthread_getaffinity_np(::pthread_self(), sizeof mask, &mask) != 0) return {};
  return from_mask(mask);
}

Status pin_current_thread(const CpuSet& cpus) {
  if (cpus.empty()) return invalid_argument("pin_current_thread: empty cpu set");
  cpu_set_t mask;
  CPU_ZERO(&mask);
  for (int c : cpus.cpus()) CPU_SET(c, &mask);
  const int rc = ::pthread_setaffinity_np(::pthread_self(), sizeof mask, &mask);
  if (rc != 0) {
    return unavailable("cannot pin a thread to cpus " + cpus.to_string() + ": " + std::strerror(rc) +
                       " (set cpu_affinity / STRATA_CPU_AFFINITY=0 to run unpinned)");
  }
  return ok_status();
}

void name_current_thread(std::string_view name) {
  const std::string n(name.substr(0, 15));
  (void)::pthread_setname_np(::pthread_self(), n.c_str());
}

// ---- CpuBudget --------------------------------------------------------------------------------

CpuBudgetConfig CpuBudgetConfig::from_options(const Options& options) {
  CpuBudgetConfig c;
  c.affinity = options.get_bool(Option::kCpuAffinity);
  c.compute_cpus = options.get_string(Option::kComputeCpus);
  c.host_cpus = options.get_string(Option::kHostCpus);
  c.compute_threads = static_cast<int>(options.get_int(Option::kComputeThreads));
  c.host_threads = static_cast<int>(options.get_int(Option::kHostThreads));
  auto env_int = [](const char* a, const char* b, int fallback) {
    const char* v = std::getenv(a);
    if (v == nullptr) v = std::getenv(b);
    int x = fallback;
    if (v == nullptr) return fallback;
    auto [end, ec] = std::from_chars(v, v + std::strlen(v), x);
    return ec == std::errc() && *end == '\0' && x >= 0 ? x : fallback;
  };
  c.local_size = std::max(1, env_int("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", 1));
  c.local_rank = std::min(env_int("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", 0), c.local_size - 1);
  return c;
}

namespace {

Result<CpuSet> requested_set(const std::string& text, std::string_view key, const CpuSet& allowed) {
  STRATA_ASSIGN_OR_RETURN(CpuSet s, CpuSet::parse(text, key));
  const CpuSet outside = s.minus(allowed);
  if (!outside.empty()) {
    return invalid_argument(std::string(key) + ": cpus " + outside.to_string() +
                            " are not among the cpus this process may run on (" + allowed.to_string() + ")");
  }
  return s;
}

}  // namespace

Result<CpuBudget> CpuBudget::make(const CpuBudgetConfig& config, const CpuSet& allowed, bool device_on_host) {
  if (allowed.empty()) return invalid_argument("cpu budget: the process may run on no cpu");
  if (config.compute_threads < 0) {
    return invalid_argument("compute_threads: " + std::to_string(config.compute_threads) + " is not >= 0");
  }
  if (config.host_threads < 0) {
    return invalid_argument("host_threads: " + std::to_string(config.host_threads) + " is not >= 0");
  }
  const bool auto_compute = config.compute_cpus.empty() || config.compute_cpus == "auto";
  const bool auto_host = config.host_cpus.empty() || config.host_cpus == "auto";
  if (config.local_size < 1 || config.local_rank < 0 || config.local_rank >= config.local_size) {
    return invalid_argument("cpu budget: local rank " + std::to_string(config.local_rank) + " of " +
                            std::to_string(config.local_size) + " processes is out of range");
  }
  CpuBudget b;
  b.allowed = allowed;
  b.pin = config.affinity;
  if (auto_compute && auto_host && config.local_size > 1 && device_on_host) {
    const int total = allowed.size();
    const auto& v = allowed.cpus();
    if (total >= config.local_size) {
      const int lo = config.local_rank * total / config.local_size;
      const int hi = (config.local_rank + 1) * total / config.local_size;
      b.allowed = CpuSet(std::vector<int>(v.begin() + lo, v.begin() + hi));
    } else {
      b.allowed = CpuSet({v[static_cast<size_t>(config.local_rank % total)]});
    }
  }
  const int n = b.allowed.size();
  std::optional<CpuSet> compute, host;
  if (!auto_compute) {
    STRATA_ASSIGN_OR_RETURN(compute, requested_set(config.compute_cpus, "compute_cpus", allowed));
  }
  if (!auto_host) {
    STRATA_ASSIGN_OR_RETURN(host, requested_set(config.host_cpus, "host_cpus", allowed));
  }

  if (!device_on_host) {
    b.host = host ? *host : allowed;
    b.compute_threads = 0;
    b.host_threads =
        config.host_threads > 0 ? config.host_threads : std::max(1, b.host.size() - (host ? 0 : 1));
    return b;
  }
  if (compute && host) {
    b.compute = *compute;
    b.host = *host;
  } else if (compute) {
    b.compute = *compute;
    b.host = allowed.minus(*compute);
    if (b.host.empty()) b.host = allowed;
  } else if (host) {
    b.host = *host;
    b.compute = allowed.minus(*host);
    if (b.compute.empty()) b.compute = allowed;
  } else if (n == 1) {
    b.compute = b.allowed;
    b.host = b.allowed;
  } else {
    const int k = config.compute_threads > 0 ? std::min(config.compute_threads, n) : std::max(1, n / 2);
    b.compute = b.allowed.first(k);
    b.host = k == n ? b.allowed : b.allowed.minus(b.compute);
  }
  b.compute_threads = config.compute_threads > 0 ? config.compute_threads : b.compute.size();
  b.host_threads = config.host_threads > 0 ? config.host_threads : b.host.size();
  return b;
}

Result<CpuBudget> CpuBudget::for_process(const CpuBudgetConfig& config, bool device_on_host) {
  return make(config, process_cpus(), device_on_host);
}

Status CpuBudget::pin_compute() const {
  if (!pin || compute.empty()) return ok_status();
  return pin_current_thread(compute);
}

Status CpuBudget::pin_host() const {
  if (!pin || host.empty()) return ok_status();
  return pin_current_thread(host);
}

std::string CpuBudget::to_string() const {
  auto threads = [](int t) { return std::to_string(t) + (t == 1 ? " thread" : " threads"); };
  std::string out;
  if (!compute.empty())
    out += "compute cpus " + compute.to_string() + " (" + threads(compute_threads) + "), ";
  out += "host cpus " + host.to_string() + " (" + threads(host_threads) + "), ";
  out += pin ? "pinned" : "not pinned";
  if (shared()) out += ", shared";
  return out;
}

// ---- CpuAccount -------------------------------------------------------------------------------

namespace cpu_detail {

struct Member {
  clockid_t clock;
  double base;
};

struct AccountState {
  std::mutex mu;
  double retired = 0.0;
  int joined = 0;
  std::vector<Member*> live;
};

}  // namespace cpu_detail

namespace {

double clock_seconds(clockid_t clock) {
  timespec ts{};
  if (::clock_gettime(clock, &ts) != 0) return 0.0;
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The calling thread's membership; leaves its account when the thread exits.
struct Membership {
  std::shared_ptr<cpu_detail::AccountState> state;
  cpu_detail::Member member{};

  void leave() {
    if (!state) return;
    std::lock_guard lock(state->mu);
    state->retired += std::max(0.0, clock_seconds(member.clock) - member.base);
    state->live.erase(std::remove(state->live.begin(), state->live.end(), &member), state->live.end());
    state.reset();
  }
  ~Membership() { leave(); }
};

thread_local Membership t_membership;

}  // namespace

CpuAccount::CpuAccount() : state_(std::make_shared<cpu_detail::AccountState>()) {}

void CpuAccount::join(bool since_start) const {
  if (!state_ || t_membership.state == state_) return;
  t_membership.leave();
  clockid_t clock = CLOCK_THREAD_CPUTIME_ID;
  // The reader runs on another thread: it needs this thread's clock by id, not "the calling
  // thread's".
  if (::pthread_getcpuclockid(::pthread_self(), &clock) != 0) return;
  std::lock_guard lock(state_->mu);
  t_membership.state = state_;
  t_membership.member.clock = clock;
  t_membership.member.base = since_start ? 0.0 : clock_seconds(clock);
  state_->live.push_back(&t_membership.member);
  ++state_->joined;
}

void CpuAccount::join_team(int threads) const {
  if (threads <= 1) return;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() != 0) join(/*since_start=*/true);
  }
}

CpuAccount CpuAccount::of_current_thread() { return CpuAccount(t_membership.state); }

double CpuAccount::seconds() const {
  if (!state_) return 0.0;
  std::lock_guard lock(state_->mu);
  double s = state_->retired;
  for (const cpu_detail::Member* m : state_->live) s += std::max(0.0, clock_seconds(m->clock) - m->base);
  return s;
}

int CpuAccount::threads() const {
  if (!state_) return 0;
  std::lock_guard lock(state_->mu);
  return state_->joined;
}

}  // namespace strata
