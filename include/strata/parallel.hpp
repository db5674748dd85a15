// Communication between training processes: process groups over a TP x PP x DP rank grid, and
// the collectives that data, tensor and pipeline parallelism are built from.
//
// Processes are launched by `mpirun -np N ...` (a hostfile makes it multi-node). One CommContext
// per process initialises MPI (once: MPI cannot be re-initialised after finalize), owns the
// failure watchdog, and hands out communicators. A Comm is one process group on one backend:
//
//   mpi   host buffers; the collectives of the MPI library (OpenMPI), used by the cpu device.
//   nccl  device buffers on the CUDA device; NCCL, its unique id broadcast over MPI.
//
// Code above this header takes a Comm and never asks which backend it is.
//
// Ordering. Each Comm owns one in-order queue, like a device stream: an operation is enqueued by
// the call that names it and runs after every operation enqueued before it on the same Comm.
// Every call returns a CommWork handle at once; wait() returns the operation's Status. A
// collective (and barrier, split) starts once everything enqueued before it has completed; send
// and recv start in order but complete independently, so a ring exchange (send to the next rank,
// recv from the previous) needs no pairing. On nccl, send and recv also wait for each other
// (one stream): pair them (even ranks send first, odd ranks receive first). Different
// Comms (e.g. the data-parallel and the tensor-parallel group) progress independently, so two
// ranks must enqueue the operations of any one Comm in the same order, as with MPI collectives.
// Buffers belong to the caller and must stay valid and untouched (sends: unmodified; receives:
// unread) until the operation's handle reports completion.
//
// Failure. An operation that does not complete within the comm timeout (tunable comm_timeout,
// STRATA_COMM_TIMEOUT) fails with a Status naming the operation, the group and its ranks. A failed
// Comm cancels every later operation on it. A collective that timed out cannot be withdrawn from
// MPI, so the process cannot leave cleanly: the CommContext watchdog logs the error and ends the
// whole job with MPI_Abort once a grace period (CommConfig::abort_grace) has passed since the
// failure, which lets the caller, and the peers whose operations time out a little later, report
// their errors; destroying the context after a failure waits for that abort. (An argument error,
// kInvalidArgument, is only returned: it breaks nothing.) A rank that dies therefore ends the job on every
// rank within at most timeout + grace, whether or not the launcher notices the death first
// (OpenMPI's mpirun does, for a rank killed by a signal). docs/parallel.md has the details.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/dtype.hpp"
#include "strata/options.hpp"
#include "strata/status.hpp"

namespace strata {

enum class ReduceOp : std::uint8_t { kSum = 0, kAvg, kMax };
enum class CommBackend : std::uint8_t { kMpi = 0, kNccl };

std::string_view to_string(ReduceOp op);
std::string_view to_string(CommBackend backend);
// "mpi" | "nccl"; the error names the text and the accepted values.
Result<CommBackend> parse_comm_backend(std::string_view text);
// The backend that serves buffers of a device backend: cpu -> mpi, cuda -> nccl.
Result<CommBackend> comm_backend_for_device(std::string_view device);

// ---- The rank grid ------------------------------------------------------------------------
// world = TP * PP * DP ranks. Tensor parallel is innermost so that a TP group is a run of
// consecutive ranks (mpirun places consecutive ranks on the same node), then pipeline, then data:
//
//   rank = (dp * PP + pp) * TP + tp        tp in [0,TP), pp in [0,PP), dp in [0,DP)
//
// A group along one axis holds the ranks that differ only in that coordinate, ordered by it
// (the group rank of a process is its coordinate on the axis).
enum class GridAxis : std::uint8_t { kTensor = 0, kPipeline, kData };
std::string_view to_string(GridAxis axis);

struct GridCoord {
  int tp = 0;
  int pp = 0;
  int dp = 0;
  friend bool operator==(const GridCoord&, const GridCoord&) = default;
};

class RankGrid {
 public:
  RankGrid() = default;  // one rank: 1 x 1 x 1
  // DP = world_size / (tp * pp); an error when that does not divide or a size is < 1.
  static Result<RankGrid> create(int world_size, int tp, int pp);

  int world_size() const { return tp_ * pp_ * dp_; }
  int size(GridAxis axis) const;
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  int dp() const { return dp_; }

  int rank_of(GridCoord c) const { return (c.dp * pp_ + c.pp) * tp_ + c.tp; }
  GridCoord coord_of(int rank) const;
  // The world ranks of the group along `axis` that contains `rank`, in group-rank order.
  std::vector<int> group_ranks(GridAxis axis, int rank) const;
  // A number shared by exactly the ranks of one group along `axis` (0 .. world/size(axis)-1).
  int group_index(GridAxis axis, int rank) const;

  bool is_valid() const { return tp_ >= 1 && pp_ >= 1 && dp_ >= 1; }

 private:
  RankGrid(int tp, int pp, int dp) : tp_(tp), pp_(pp), dp_(dp) {}
  int tp_ = 1;
  int pp_ = 1;
  int dp_ = 1;
};

// ---- Operations and their handles -----------------------------------------------------------
namespace detail {
struct WorkState;
}

// The handle of one enqueued operation. Copyable; all copies observe the same operation.
// A default-constructed handle is complete and OK. Thread-safe. The Comm that issued it must
// outlive every wait() on it: a waiting thread may run the operation itself, with the ones
// queued before it, in order (when the Comm's queue thread is idle, which saves two thread
// hand-offs; the ordering rules of Comm are the same either way).
class CommWork {
 public:
  CommWork() = default;
  explicit CommWork(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  // Blocks until the operation completed, failed, timed out or was cancelled; its Status.
  // Bounded: the operation's own timeout limits it (plus the operations queued ahead of it).
  Status wait() const;
  // True once the operation finished (wait() then returns without blocking).
  bool test() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// One process group on one backend. Counts are elements of `dtype` (f32 or bf16) and at most
// INT32_MAX per call. Reductions of bf16 are staged through fp32 (each rank's contribution is
// widened exactly, the library reduces in fp32, the result is rounded to bf16 once), so a bf16
// sum is the correctly rounded fp32 sum. kAvg is the sum divided by size() (in fp32).
// Buffers: host memory for the mpi backend, device memory for nccl. Methods may be called from
// any one thread at a time per Comm (the enqueue order is the call order).
class Comm {
 public:
  virtual ~Comm() = default;
  Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  virtual CommBackend backend() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "world", "tp", "dp", ... plus the world ranks it holds: used in every error message.
  virtual const std::string& name() const = 0;
  virtual const std::vector<int>& world_ranks() const = 0;

  // recv[i] = op over ranks of send[i]; send == recv is allowed (in place).
  virtual CommWork all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) = 0;
  // send holds size() * recv_count elements; rank r receives the reduction of block r.
  virtual CommWork reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                                  ReduceOp op) = 0;
  // recv holds size() * send_count elements; block r is rank r's send. send may be this rank's
  // block of recv (in place).
  virtual CommWork all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) = 0;
  // buf of `root` is copied into buf of every rank.
  virtual CommWork broadcast(void* buf, std::size_t count, DType dtype, int root) = 0;
  // Point to point within the group (peer is a group rank). Matched in order per (pair, Comm).
  virtual CommWork send(const void* buf, std::size_t count, DType dtype, int peer) = 0;
  virtual CommWork recv(void* buf, std::size_t count, DType dtype, int peer) = 0;
  virtual CommWork barrier() = 0;

  // A sub-group: collective over this Comm (every rank calls it, in the same order relative to
  // this Comm's operations). Ranks passing the same `color` (>= 0) form one group, ordered by
  // `key` then by rank in this Comm. Same backend. Waits for this Comm's queued work first.
  virtual Result<std::unique_ptr<Comm>> split(int color, int key, std::string_view name) = 0;

 protected:
  Comm(Comm&&) = default;
};

// ---- The context ---------------------------------------------------------------------------
struct CommConfig {
  // An operation that has not completed this long after it started fails (comm_timeout).
  std::chrono::milliseconds timeout{300'000};
  // After a failure the job is aborted this long later unless the context is destroyed first.
  std::chrono::milliseconds abort_grace{5'000};

  // timeout from the comm_timeout tunable (seconds, > 0); the grace stays at its default.
  static Result<CommConfig> from_options(const Options& options);
};

// Whether this process was started by mpirun (OpenMPI's OMPI_COMM_WORLD_* environment).
bool launched_by_mpirun();
// The number of processes mpirun started (OMPI_COMM_WORLD_SIZE), known before MPI is
// initialised; 1 when not launched by mpirun.
int mpirun_world_size();

class CommContext {
 public:
  // Initialises MPI (MPI_THREAD_MULTIPLE) unless someone already did; a single process not
  // started by mpirun is a world of one. Errors: MPI absent from this build, or finalized earlier
  // in this process (keep one context for the life of the program).
  static Result<std::unique_ptr<CommContext>> create(const CommConfig& config);

  // Finalizes MPI if this context initialised it; after a failure it does not return: the job
  // ends (MPI_Abort) at failure + abort_grace.
  // Every Comm it handed out must be destroyed first.
  ~CommContext();
  CommContext(const CommContext&) = delete;
  CommContext& operator=(const CommContext&) = delete;

  int world_rank() const;
  int world_size() const;
  const CommConfig& config() const;

  // A new communicator over every process (its own queue; collective over the world).
  Result<std::unique_ptr<Comm>> world(CommBackend backend);

  // The first failure any Comm of this context reported (OK while none).
  Status failure() const;

  struct Impl;

 private:
  explicit CommContext(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The world and the three axis groups of a grid, for this process.
struct ProcessGroups {
  RankGrid grid;
  GridCoord coord;
  std::unique_ptr<Comm> world;
  std::unique_ptr<Comm> tp;
  std::unique_ptr<Comm> pp;
  std::unique_ptr<Comm> dp;

  Comm& group(GridAxis axis) const;
};

// Collective over the world: splits it along the grid (tp * pp must divide the world size).
Result<ProcessGroups> make_process_groups(CommContext& context, CommBackend backend, int tp, int pp);

}  // namespace strata
