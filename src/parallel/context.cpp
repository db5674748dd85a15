// CommContext: MPI's initialisation for this process, and the watchdog that turns a failed
// communication into the end of the whole job.
//
// Why abort: a collective that timed out is still posted inside MPI (the standard has no way to
// cancel one), the peers may be dead or stuck, and MPI_Finalize would wait for them. Leaving the
// job alive means every other rank hangs until its own timeout at best. So after the first
// failure the watchdog waits `abort_grace` (the caller gets the error on its handle and may log
// and unwind) and then calls MPI_Abort, which makes mpirun kill every rank. Destroying the
// context after a failure waits for that abort.
#include <algorithm>
#include <cstdlib>

#include "parallel/internal.hpp"
#include "strata/log.hpp"

namespace strata {

Result<CommConfig> CommConfig::from_options(const Options& options) {
  const double seconds = options.get_float(Option::kCommTimeout);
  if (!(seconds > 0) || seconds > 1e7) {
    return invalid_argument(options.source(Option::kCommTimeout) + ": comm_timeout " +
                            std::to_string(seconds) + " is not a time in seconds in (0, 1e7]");
  }
  CommConfig c;
  c.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
  if (c.timeout.count() < 1) c.timeout = std::chrono::milliseconds(1);
  return c;
}

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr && std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
}

int mpirun_world_size() {
  if (!launched_by_mpirun()) return 1;
  return std::max(1, std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")));
}

void CommContext::Impl::report_failure(const Status& status) {
  {
    std::lock_guard lock(mu);
    if (!failure.ok()) return;
    failure = status;
  }
  STRATA_LOG(kError, kParallel) << "rank " << rank << "/" << size << ": " << status.to_string();
  cv.notify_all();
}

void CommContext::Impl::abort_job(const char* why) const {
  STRATA_LOG(kError, kParallel) << "rank " << rank << "/" << size << ": ending the job (" << why
                                << "): " << failure.to_string();
#if STRATA_HAVE_MPI
  MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::_Exit(1);  // MPI_Abort does not return; without MPI there is nothing to wait for
}

void CommContext::Impl::watch() {
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return closing || !failure.ok(); });
  if (closing) return;
  // Only the grace period runs from here: closing no longer saves the job (see ~CommContext).
  cv.wait_for(lock, config.abort_grace, [] { return false; });
  abort_job("a communication failed; the grace period for reporting it is over");
}

CommContext::CommContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CommContext::~CommContext() {
  if (!failure().ok()) {
    // Let the watchdog end the job at failure + grace rather than at once, so that the peers,
    // whose operations time out a little later, get to report their own errors too.
    impl_->watchdog.join();  // does not return: it calls abort_job
  }
  {
    std::lock_guard lock(impl_->mu);
    impl_->closing = true;
  }
  impl_->cv.notify_all();
  if (impl_->watchdog.joinable()) impl_->watchdog.join();
#if STRATA_HAVE_MPI
  if (impl_->owns_mpi) MPI_Finalize();
#endif
}

int CommContext::world_rank() const { return impl_->rank; }
int CommContext::world_size() const { return impl_->size; }
const CommConfig& CommContext::config() const { return impl_->config; }

Status CommContext::failure() const {
  std::lock_guard lock(impl_->mu);
  return impl_->failure;
}

#if STRATA_HAVE_MPI

namespace detail {

Status mpi_status(int rc, const std::string& what) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return unavailable(what + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

std::vector<int> world_ranks_of(MPI_Comm comm) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  MPI_Group world_group;
  MPI_Group group;
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Comm_group(comm, &group);
  std::vector<int> mine(static_cast<std::size_t>(n));
  std::vector<int> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) mine[static_cast<std::size_t>(i)] = i;
  MPI_Group_translate_ranks(group, n, mine.data(), world_group, out.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  return out;
}

}  // namespace detail

Result<std::unique_ptr<CommContext>> CommContext::create(const CommConfig& config) {
  if (config.timeout.count() <= 0 || config.abort_grace.count() < 0) {
    return invalid_argument("comm config: timeout must be positive and abort_grace not negative");
  }
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    return failed_precondition(
        "MPI was already finalized in this process and cannot start again: keep one CommContext for the "
        "life of the program");
  }
  int provided = 0;
  if (!initialized) {
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return detail::mpi_status(rc, "MPI_Init_thread");
    impl->owns_mpi = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    // Each Comm's queue thread calls MPI concurrently with the others.
    if (impl->owns_mpi) MPI_Finalize();
    return unavailable("the MPI library provides thread level " + std::to_string(provided) +
                       ", but Strata's comm queues need MPI_THREAD_MULTIPLE (" +
                       std::to_string(MPI_THREAD_MULTIPLE) + ")");
  }
  // Errors come back as return codes (turned into Status values), not as MPI's default abort.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &impl->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &impl->size);
  Impl* raw = impl.get();
  impl->watchdog = std::thread([raw] { raw->watch(); });
  STRATA_LOG(kInfo, kParallel) << "rank " << impl->rank << "/" << impl->size << ": MPI up"
                               << (launched_by_mpirun() ? " (mpirun)" : " (single process)")
                               << ", comm timeout " << config.timeout.count() << " ms";
  return std::unique_ptr<CommContext>(new CommContext(std::move(impl)));
}

Result<std::unique_ptr<Comm>> CommContext::world(CommBackend backend) {
  MPI_Comm dup = MPI_COMM_NULL;
  const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  if (rc != MPI_SUCCESS) return detail::mpi_status(rc, "MPI_Comm_dup of the world");
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  if (backend == CommBackend::kNccl) return detail::make_nccl_comm(*impl_, dup, "world");
  return detail::make_mpi_comm(*impl_, dup, "world");
}

#else  // !STRATA_HAVE_MPI

Result<std::unique_ptr<CommContext>> CommContext::create(const CommConfig&) {
  return unavailable(
      "this build of Strata has no MPI: install OpenMPI (scripts/setup) and configure with "
      "-DSTRATA_ENABLE_MPI=ON");
}

Result<std::unique_ptr<Comm>> CommContext::world(CommBackend) {
  return unavailable("this build of Strata has no MPI");
}

#endif

}  // namespace strata
