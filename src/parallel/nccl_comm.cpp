// The nccl backend: device buffers on the calling thread's current CUDA device, NCCL
// collectives on a stream the Comm owns. The NCCL unique id is made by group rank 0 and
// broadcast over an MPI communicator of the same members (the "bootstrap"), which the Comm keeps
// for split().
//
// Operations go through the same CommQueue as the mpi backend, so ordering, handles and
// failures behave alike: the queue thread enqueues the NCCL call, records an event and polls it
// (and ncclCommGetAsyncError), paced by PollPacer as the mpi backend's polls are, until it
// completes or the deadline passes; on timeout the NCCL
// communicator is aborted so that no kernel stays spinning on the device.
//
// Numerics differ from mpi in one place: bf16 reductions use NCCL's native bf16 arithmetic
// (ncclBfloat16), which rounds at every reduction step, instead of fp32 staging.
#include "strata/build_config.hpp"

#if STRATA_HAVE_MPI

#include "parallel/internal.hpp"

#if STRATA_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <thread>
#endif

namespace strata::detail {

#if STRATA_HAVE_NCCL
namespace {

Status nccl_status(ncclResult_t rc, const std::string& what) {
  return device_error(what + " failed: " + ncclGetErrorString(rc));
}

Status cuda_status(cudaError_t rc, const std::string& what) {
  return device_error(what + " failed: " + cudaGetErrorString(rc));
}

ncclDataType_t nccl_type(DType dtype) { return dtype == DType::kF32 ? ncclFloat32 : ncclBfloat16; }

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

class NcclComm final : public Comm {
 public:
  NcclComm(CommContext::Impl& context, MPI_Comm bootstrap, std::string name, int device, ncclComm_t comm,
           cudaStream_t stream, cudaEvent_t event)
      : context_(context),
        boot_(bootstrap),
        name_(std::move(name)),
        world_ranks_(world_ranks_of(bootstrap)),
        label_(describe_group(name_, world_ranks_)),
        device_(device),
        comm_(comm),
        stream_(stream),
        event_(event),
        queue_(label_, [&context](const Status& s) { context.report_failure(s); }) {
    MPI_Comm_rank(boot_, &rank_);
    MPI_Comm_size(boot_, &size_);
  }

  ~NcclComm() override {
    Status s = queue_.drain();
    if (s.ok() && !queue_.broken()) {
      ncclCommDestroy(comm_);
      MPI_Comm_free(&boot_);
    }
    if (barrier_word_ != nullptr) cudaFree(barrier_word_);
    cudaEventDestroy(event_);
    cudaStreamDestroy(stream_);
  }

  CommBackend backend() const override { return CommBackend::kNccl; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }

  CommWork all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override {
    if (Status s = check_count(count, dtype, "all_reduce"); !s.ok())
      return finished_work(s.with_context(label_));
    return run("all_reduce(" + std::string(to_string(op)) + ") of " + describe_count(count, dtype),
               [=, this] {
                 return ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, stream_);
               });
  }

  CommWork reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                          ReduceOp op) override {
    if (Status s = check_count(recv_count * static_cast<std::size_t>(size_), dtype, "reduce_scatter");
        !s.ok()) {
      return finished_work(s.with_context(label_));
    }
    return run("reduce_scatter of " + describe_count(recv_count, dtype) + " per rank", [=, this] {
      return ncclReduceScatter(send, recv, recv_count, nccl_type(dtype), nccl_op(op), comm_, stream_);
    });
  }

  CommWork all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) override {
    if (Status s = check_count(send_count * static_cast<std::size_t>(size_), dtype, "all_gather"); !s.ok()) {
      return finished_work(s.with_context(label_));
    }
    return run("all_gather of " + describe_count(send_count, dtype) + " per rank",
               [=, this] { return ncclAllGather(send, recv, send_count, nccl_type(dtype), comm_, stream_); });
  }

  CommWork broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    if (Status s = check_count(count, dtype, "broadcast"); !s.ok())
      return finished_work(s.with_context(label_));
    if (root < 0 || root >= size_)
      return finished_work(invalid_argument("broadcast on " + label_ + ": bad root"));
    return run("broadcast of " + describe_count(count, dtype) + " from group rank " + std::to_string(root),
               [=, this] { return ncclBroadcast(buf, buf, count, nccl_type(dtype), root, comm_, stream_); });
  }

  CommWork send(const void* buf, std::size_t count, DType dtype, int peer) override {
    if (Status s = check_count(count, dtype, "send"); !s.ok()) return finished_work(s.with_context(label_));
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return finished_work(invalid_argument("send on " + label_ + ": bad peer " + std::to_string(peer)));
    }
    return run("send of " + describe_count(count, dtype) + " to group rank " + std::to_string(peer),
               [=, this] { return ncclSend(buf, count, nccl_type(dtype), peer, comm_, stream_); });
  }

  CommWork recv(void* buf, std::size_t count, DType dtype, int peer) override {
    if (Status s = check_count(count, dtype, "recv"); !s.ok()) return finished_work(s.with_context(label_));
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return finished_work(invalid_argument("recv on " + label_ + ": bad peer " + std::to_string(peer)));
    }
    return run("recv of " + describe_count(count, dtype) + " from group rank " + std::to_string(peer),
               [=, this] { return ncclRecv(buf, count, nccl_type(dtype), peer, comm_, stream_); });
  }

  CommWork barrier() override {
    // NCCL has no barrier: an all_reduce of one float in device scratch has the same effect.
    return run("barrier", [this] {
      return ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, stream_);
    });
  }

  Result<std::unique_ptr<Comm>> split(int color, int key, std::string_view name) override {
    if (color < 0)
      return invalid_argument("split of " + label_ + ": color " + std::to_string(color) + " < 0");
    MPI_Comm child = MPI_COMM_NULL;
    STRATA_RETURN_IF_ERROR(queue_
                               .submit([&]() -> Status {
                                 int rc = MPI_Comm_split(boot_, color, key, &child);
                                 return rc == MPI_SUCCESS ? ok_status()
                                                          : mpi_status(rc, "split of " + label_);
                               })
                               .wait());
    MPI_Comm_set_errhandler(child, MPI_ERRORS_RETURN);
    return make_nccl_comm(context_, child, std::string(name));
  }

  Status init_scratch() {
    cudaError_t rc = cudaMalloc(&barrier_word_, sizeof(float));
    return rc == cudaSuccess ? ok_status() : cuda_status(rc, "cudaMalloc of the barrier word on " + label_);
  }

 private:
  template <typename Enqueue>
  CommWork run(std::string what, Enqueue enqueue) {
    return queue_.submit([this, what = std::move(what), enqueue]() -> Status {
      cudaSetDevice(device_);  // the current device is per thread
      if (ncclResult_t rc = enqueue(); rc != ncclSuccess) return nccl_status(rc, what + " on " + label_);
      if (cudaError_t rc = cudaEventRecord(event_, stream_); rc != cudaSuccess) {
        return cuda_status(rc, what + " on " + label_);
      }
      const auto deadline = std::chrono::steady_clock::now() + context_.config.timeout;
      // Paced as the mpi backend's polls (PollPacer): yields while a short collective is about
      // to finish, then short sleeps, so a rank waiting for a slow peer's kernel does not hold a
      // core the host optimizer and copies need.
      PollPacer pacer;
      for (;;) {
        cudaError_t q = cudaEventQuery(event_);
        if (q == cudaSuccess) return ok_status();
        if (q != cudaErrorNotReady) return cuda_status(q, what + " on " + label_);
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          ncclCommAbort(comm_);
          return nccl_status(async, what + " on " + label_);
        }
        if (std::chrono::steady_clock::now() > deadline) {
          ncclCommAbort(comm_);
          return unavailable("comm timeout: " + what + " on " + label_ + " did not complete within " +
                             std::to_string(std::chrono::duration<double>(context_.config.timeout).count()) +
                             " s (comm_timeout / STRATA_COMM_TIMEOUT)");
        }
        pacer.pause();
      }
    });
  }

  CommContext::Impl& context_;
  MPI_Comm boot_;
  std::string name_;
  std::vector<int> world_ranks_;
  std::string label_;
  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaEvent_t event_;
  float* barrier_word_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  CommQueue queue_;  // last: stops first
};

}  // namespace

Result<std::unique_ptr<Comm>> make_nccl_comm(CommContext::Impl& context, MPI_Comm bootstrap,
                                             std::string name) {
  int rank = 0;
  MPI_Comm_rank(bootstrap, &rank);
  ncclUniqueId id{};
  if (rank == 0) {
    if (ncclResult_t rc = ncclGetUniqueId(&id); rc != ncclSuccess) {
      // The other ranks wait in the broadcast below; they time out like any failed collective.
      return nccl_status(rc, "ncclGetUniqueId for group '" + name + "'");
    }
  }
  if (int rc = MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, bootstrap); rc != MPI_SUCCESS) {
    return mpi_status(rc, "broadcast of the NCCL unique id for group '" + name + "'");
  }
  int device = 0;
  if (cudaError_t rc = cudaGetDevice(&device); rc != cudaSuccess) return cuda_status(rc, "cudaGetDevice");
  int size = 0;
  MPI_Comm_size(bootstrap, &size);
  ncclComm_t comm = nullptr;
  if (ncclResult_t rc = ncclCommInitRank(&comm, size, id, rank); rc != ncclSuccess) {
    return nccl_status(rc, "ncclCommInitRank for group '" + name + "'");
  }
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  if (cudaError_t rc = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); rc != cudaSuccess) {
    ncclCommDestroy(comm);
    return cuda_status(rc, "cudaStreamCreate for group '" + name + "'");
  }
  if (cudaError_t rc = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); rc != cudaSuccess) {
    cudaStreamDestroy(stream);
    ncclCommDestroy(comm);
    return cuda_status(rc, "cudaEventCreate for group '" + name + "'");
  }
  auto c = std::make_unique<NcclComm>(context, bootstrap, std::move(name), device, comm, stream, event);
  STRATA_RETURN_IF_ERROR(c->init_scratch());
  return std::unique_ptr<Comm>(std::move(c));
}

#else  // !STRATA_HAVE_NCCL

Result<std::unique_ptr<Comm>> make_nccl_comm(CommContext::Impl&, MPI_Comm bootstrap, std::string name) {
  MPI_Comm_free(&bootstrap);
  return unavailable("comm backend nccl for group '" + name +
                     "': this build of Strata has no NCCL (it needs CUDA; configure with "
                     "-DSTRATA_ENABLE_CUDA=ON -DSTRATA_ENABLE_NCCL=ON)");
}

#endif  // STRATA_HAVE_NCCL

}  // namespace strata::detail

#endif  // STRATA_HAVE_MPI
