// The mpi backend: host buffers, the MPI library's non-blocking collectives, polled on the
// Comm's queue thread so that a deadline can be enforced (a blocking MPI call cannot be
// interrupted). all_gather, all_reduce and reduce_scatter are built from non-blocking
// point-to-point messages instead in groups of up to 16 ranks (gather_direct, reduce_direct;
// docs/parallel.md "Small messages and all_gather", "Reductions from point-to-point messages,
// chunked"): OpenMPI's non-blocking schedules for them are several times slower than its
// blocking algorithms. The reductions stream through a receive buffer of at most
// kMpiReduceBufferBytes (mpi_comm.hpp) whatever the message size.
//
// bf16 reductions travel as bf16 and are folded in fp32 (each value widened exactly, the result
// rounded to bf16 once), so they move half the bytes of fp32 and need no buffer beyond the
// bounded one. Above 16 ranks (OpenMPI's non-blocking calls) they are staged through fp32
// scratch buffers instead, which grow to the largest call and are then reused. Moves without
// arithmetic (all_gather, broadcast, send/recv) carry bf16 as 16-bit integers.
#include "strata/build_config.hpp"

#if STRATA_HAVE_MPI

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <thread>
#include <type_traits>

#include "parallel/internal.hpp"
#include "parallel/mpi_comm.hpp"

namespace strata::detail {
namespace {

MPI_Datatype wire_type(DType dtype) { return dtype == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T; }
template <typename T>
MPI_Datatype wire_type() {
  return wire_type(std::is_same_v<T, float> ? DType::kF32 : DType::kBF16);
}

// What an operation is, for its error messages: "all_reduce(sum) of 4097 x f32", "send of 1 x
// bf16 to group rank 1 (world rank 3)". Kept as its parts and formatted only when an error is
// reported: building the string for every call cost several allocations, a noticeable part of a
// small message's time.
struct OpName {
  enum class Tail { kNone, kPerRank, kFrom, kTo };
  const char* verb = "";
  std::string_view op;  // the reduction's name, for a reduction
  bool has_count = false;
  std::size_t count = 0;
  DType dtype = DType::kF32;
  Tail tail = Tail::kNone;
  int peer = -1;  // kFrom, kTo: the peer's group rank and world rank
  int peer_world = -1;

  std::string str() const {
    std::string out = verb;
    if (!op.empty()) out += "(" + std::string(op) + ")";
    if (has_count) out += " of " + describe_count(count, dtype);
    switch (tail) {
      case Tail::kNone:
        break;
      case Tail::kPerRank:
        out += " per rank";
        break;
      case Tail::kFrom:
      case Tail::kTo:
        out += std::string(tail == Tail::kFrom ? " from" : " to") + " group rank " + std::to_string(peer) +
               " (world rank " + std::to_string(peer_world) + ")";
        break;
    }
    return out;
  }
};

class MpiComm final : public Comm {
 public:
  MpiComm(CommContext::Impl& context, MPI_Comm comm, std::string name)
      : context_(context),
        comm_(comm),
        name_(std::move(name)),
        world_ranks_(world_ranks_of(comm)),
        label_(describe_group(name_, world_ranks_)),
        queue_(label_, [&context](const Status& s) { context.report_failure(s); }) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  ~MpiComm() override {
    Status s = queue_.drain();
    // A failed Comm may still have an operation posted inside MPI; freeing the communicator
    // under it is undefined, and the job is being aborted anyway (context.cpp).
    if (s.ok() && !queue_.broken()) MPI_Comm_free(&comm_);
  }

  CommBackend backend() const override { return CommBackend::kMpi; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  // mpi_reduce_buffer_bytes (mpi_comm.hpp).
  std::size_t reduce_buffer_bytes() const { return peer_blocks_.capacity(); }

  CommWork all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override {
    if (Status s = check_count(count, dtype, "all_reduce"); !s.ok())
      return finished_work(s.with_context(label_));
    const OpName what{"all_reduce", to_string(op), true, count, dtype};
    return queue_.submit([=, this]() -> Status {
      if (reduces_direct()) {
        return dtype == DType::kF32 ? all_reduce_direct(static_cast<const float*>(send), static_cast<float*>(recv),
                                                        count, op, what)
                                    : all_reduce_direct(static_cast<const bf16*>(send), static_cast<bf16*>(recv),
                                                        count, op, what);
      }
      if (dtype == DType::kF32) {
        STRATA_RETURN_IF_ERROR(
            all_reduce_nbc(static_cast<const float*>(send), static_cast<float*>(recv), count, op, what));
        if (op == ReduceOp::kAvg) divide(static_cast<float*>(recv), count);
        return ok_status();
      }
      float* wide = widen(static_cast<const bf16*>(send), count, scratch_);
      STRATA_RETURN_IF_ERROR(all_reduce_nbc(wide, wide, count, op, what));
      if (op == ReduceOp::kAvg) divide(wide, count);
      convert(wide, static_cast<bf16*>(recv), count);
      return ok_status();
    });
  }

  CommWork reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                          ReduceOp op) override {
    if (Status s = check_count(recv_count * static_cast<std::size_t>(size_), dtype, "reduce_scatter");
        !s.ok()) {
      return finished_work(s.with_context(label_));
    }
    const OpName what{"reduce_scatter", to_string(op), true, recv_count, dtype, OpName::Tail::kPerRank};
    return queue_.submit([=, this]() -> Status {
      const std::size_t total = recv_count * static_cast<std::size_t>(size_);
      if (reduces_direct()) {
        return dtype == DType::kF32
                   ? reduce_direct(static_cast<const float*>(send), static_cast<float*>(recv), total,
                                   /*scatter=*/true, op, what)
                   : reduce_direct(static_cast<const bf16*>(send), static_cast<bf16*>(recv), total,
                                   /*scatter=*/true, op, what);
      }
      if (dtype == DType::kF32) {
        STRATA_RETURN_IF_ERROR(reduce_scatter_nbc(static_cast<const float*>(send), static_cast<float*>(recv),
                                                  recv_count, op, what));
        if (op == ReduceOp::kAvg) divide(static_cast<float*>(recv), recv_count);
        return ok_status();
      }
      float* wide = widen(static_cast<const bf16*>(send), total, scratch_);
      if (scratch_out_.size() < recv_count) scratch_out_.resize(recv_count);
      STRATA_RETURN_IF_ERROR(reduce_scatter_nbc(wide, scratch_out_.data(), recv_count, op, what));
      if (op == ReduceOp::kAvg) divide(scratch_out_.data(), recv_count);
      convert(scratch_out_.data(), static_cast<bf16*>(recv), recv_count);
      return ok_status();
    });
  }

  CommWork all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) override {
    if (Status s = check_count(send_count * static_cast<std::size_t>(size_), dtype, "all_gather"); !s.ok()) {
      return finished_work(s.with_context(label_));
    }
    const OpName what{"all_gather", {}, true, send_count, dtype, OpName::Tail::kPerRank};
    return queue_.submit([=, this]() -> Status {
      const int n = static_cast<int>(send_count);
      if (size_ > kMaxDirectGatherRanks) {
        // In place (send is this rank's block of recv) is MPI_IN_PLACE to MPI: aliased buffers
        // are erroneous there.
        const void* src = send == static_cast<const unsigned char*>(recv) +
                                      static_cast<std::size_t>(rank_) * send_count * dtype_size(dtype)
                              ? MPI_IN_PLACE
                              : send;
        MPI_Request req;
        STRATA_RETURN_IF_ERROR(
            start(MPI_Iallgather(src, n, wire_type(dtype), recv, n, wire_type(dtype), comm_, &req), what));
        return finish(&req, 1, what);
      }
      return gather_direct(send, recv, send_count, dtype, what);
    });
  }

  CommWork broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    if (Status s = check_count(count, dtype, "broadcast"); !s.ok())
      return finished_work(s.with_context(label_));
    if (root < 0 || root >= size_) return finished_work(bad_rank("broadcast", "root", root));
    const OpName what{"broadcast", {}, true, count, dtype, OpName::Tail::kFrom, root, world_ranks_[root]};
    return queue_.submit([=, this]() -> Status {
      if (size_ <= kMaxDirectGatherRanks) return broadcast_direct(buf, count, dtype, root, what);
      MPI_Request req;
      STRATA_RETURN_IF_ERROR(
          start(MPI_Ibcast(buf, static_cast<int>(count), wire_type(dtype), root, comm_, &req), what));
      return finish(req, what);
    });
  }

  CommWork send(const void* buf, std::size_t count, DType dtype, int peer) override {
    if (Status s = check_count(count, dtype, "send"); !s.ok()) return finished_work(s.with_context(label_));
    if (peer < 0 || peer >= size_ || peer == rank_) return finished_work(bad_rank("send", "peer", peer));
    const OpName what{"send", {}, true, count, dtype, OpName::Tail::kTo, peer, world_ranks_[peer]};
    return queue_.submit_async([=, this]() -> Result<CommQueue::Poll> {
      MPI_Request req;
      STRATA_RETURN_IF_ERROR(
          start(MPI_Isend(buf, static_cast<int>(count), wire_type(dtype), peer, kTag, comm_, &req), what));
      return poll_of(req, what, -1, dtype);
    });
  }

  CommWork recv(void* buf, std::size_t count, DType dtype, int peer) override {
    if (Status s = check_count(count, dtype, "recv"); !s.ok()) return finished_work(s.with_context(label_));
    if (peer < 0 || peer >= size_ || peer == rank_) return finished_work(bad_rank("recv", "peer", peer));
    const OpName what{"recv", {}, true, count, dtype, OpName::Tail::kFrom, peer, world_ranks_[peer]};
    return queue_.submit_async([=, this]() -> Result<CommQueue::Poll> {
      MPI_Request req;
      STRATA_RETURN_IF_ERROR(
          start(MPI_Irecv(buf, static_cast<int>(count), wire_type(dtype), peer, kTag, comm_, &req), what));
      return poll_of(req, what, static_cast<long long>(count), dtype);
    });
  }

  CommWork barrier() override {
    return queue_.submit([this]() -> Status {
      MPI_Request req;
      OpName what;
      what.verb = "barrier";
      STRATA_RETURN_IF_ERROR(start(MPI_Ibarrier(comm_, &req), what));
      return finish(req, what);
    });
  }

  Result<std::unique_ptr<Comm>> split(int color, int key, std::string_view name) override {
    if (color < 0)
      return invalid_argument("split of " + label_ + ": color " + std::to_string(color) + " < 0");
    // MPI_Comm_split is blocking and collective: run it on the queue, in order with the rest.
    MPI_Comm child = MPI_COMM_NULL;
    const std::string what = "split into '" + std::string(name) + "'";
    STRATA_RETURN_IF_ERROR(queue_
                               .submit([&]() -> Status {
                                 int rc = MPI_Comm_split(comm_, color, key, &child);
                                 return rc == MPI_SUCCESS ? ok_status()
                                                          : mpi_status(rc, what + " on " + label_);
                               })
                               .wait());
    MPI_Comm_set_errhandler(child, MPI_ERRORS_RETURN);
    return make_mpi_comm(context_, child, std::string(name));
  }

 private:
  static constexpr int kTag = 7;
  // A posted send or recv's poll reads the clock for its deadline every this many polls.
  static constexpr unsigned kDeadlineEvery = 16;
  // The collectives this backend builds from point-to-point messages (gather_direct) use a tag of
  // their own, so a peer's send/recv can never match one of their receives.
  static constexpr int kGatherTag = 8;
  // gather_direct posts 2 (n - 1) requests per call; above this group size MPI_Iallgather's
  // logarithmic schedules are left to the library.
  static constexpr int kMaxDirectGatherRanks = 16;
  // reduce_direct's peer ranges use this tag (all_reduce's folded chunks, kGatherTag).
  static constexpr int kReduceTag = 9;
  // all_reduce up to this many bytes (fp32) is one exchange of whole buffers (reduce_whole)
  // rather than reduce_direct's two rounds; its receive buffer, (n - 1) of these per group of at
  // most kMaxDirectGatherRanks, stays far below kMpiReduceBufferBytes.
  static constexpr std::size_t kWholeReduceBytes = std::size_t{16} << 10;
  static_assert((kMaxDirectGatherRanks - 1) * kWholeReduceBytes <= kMpiReduceBufferBytes);
  // reduce_whole sends a buffer of up to kPiecedWholeBytes as messages of kWholePieceBytes. The
  // shared-memory transport sends a message up to its eager limit at once (4 KiB with its header
  // on OpenMPI's vader) and a larger one by a rendezvous, a round trip more: a 4 KiB all_reduce
  // measured 0.6-0.7 of MPI's time as one message per peer and 1.05-1.09 as two pieces, while 16
  // KiB is fastest whole (2.9 against 1.5 as eight pieces; docs/parallel.md).
  static constexpr std::size_t kWholePieceBytes = std::size_t{2} << 10;
  static constexpr std::size_t kPiecedWholeBytes = std::size_t{4} << 10;
  // broadcast_direct's messages.
  static constexpr int kBcastTag = 10;
  // broadcast_direct: up to this many bytes the root sends to every peer itself; above, a
  // binomial tree spreads the sends over the ranks that already hold the data.
  static constexpr std::size_t kFlatBcastBytes = std::size_t{64} << 10;
  // The copy rate a wait assumes of its own operation's transfer (transfer_time), in bytes per
  // ns: 4 GB/s, below the ~7 GB/s each rank of the 2-core VM copies at while both copy (memcpy
  // and the shared-memory transport's single copy alike; 10 GB/s ended the window before a
  // 64 MiB all_gather's). Faster links finish inside the window; on slower ones the pacing
  // starts before the transfer ends, as without it.
  static constexpr std::size_t kCopyBytesPerNs = 4;
  // fold's tile (elements): its accumulator stays in L1.
  static constexpr std::size_t kFoldTile = 256;

  static MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

  Status bad_rank(const char* what, const char* role, int r) const {
    return invalid_argument(std::string(what) + " on " + label_ + ": " + role + " " + std::to_string(r) +
                            " is not another rank of this group of " + std::to_string(size_));
  }

  Status start(int rc, const OpName& what) const {
    return rc == MPI_SUCCESS ? ok_status() : mpi_status(rc, what.str() + " on " + label_);
  }

  Status timeout_error(const OpName& what) const {
    const double secs = std::chrono::duration<double>(context_.config.timeout).count();
    return unavailable("comm timeout: " + what.str() + " on " + label_ + ", this is group rank " +
                       std::to_string(rank_) + " (world rank " + std::to_string(context_.rank) +
                       "), did not complete within " + std::to_string(secs) +
                       " s (comm_timeout / STRATA_COMM_TIMEOUT): a peer died, hangs, or called a "
                       "different operation");
  }

  // Polls `req` until it completes or the deadline passes, paced by PollPacer (internal.hpp):
  // yielding at first, which keeps an oversubscribed machine (more ranks than cores) moving, then
  // short sleeps, so a rank waiting for a slow peer does not burn a core. Runs on the queue
  // thread or, through run_inline, on the waiting caller's.
  // `count` requests, done when all are.
  Status finish(MPI_Request* reqs, int count, const OpName& what,
                std::chrono::nanoseconds expected = std::chrono::nanoseconds(0)) const {
    return finish(reqs, count, what, std::chrono::steady_clock::now() + context_.config.timeout, expected);
  }
  // The same against an operation's deadline set when it started (a chunked reduction waits
  // several times).
  // `expected`: the operation's own transfer time through this rank (transfer_time), polled
  // through without pacing (PollPacer::expect).
  Status finish(MPI_Request* reqs, int count, const OpName& what, std::chrono::steady_clock::time_point deadline,
                std::chrono::nanoseconds expected = std::chrono::nanoseconds(0)) const {
    PollPacer pacer;
    pacer.expect(expected);
    for (;;) {
      int flag = 0;
      const int rc = MPI_Testall(count, reqs, &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return mpi_status(rc, what.str() + " on " + label_);
      if (flag) return ok_status();
      if (pacer.skip_clock()) continue;
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline) return timeout_error(what);
      pacer.pause_at(now);
    }
  }
  Status finish(MPI_Request& req, const OpName& what) const { return finish(&req, 1, what); }

  // How long moving `bytes` through this rank's memory takes at kCopyBytesPerNs: how long a wait
  // for an operation that moves them is its own doing, not a late peer's.
  static std::chrono::nanoseconds transfer_time(std::size_t bytes) {
    return std::chrono::nanoseconds(static_cast<std::int64_t>(bytes / kCopyBytesPerNs));
  }

  // all_gather as one message from every rank to every other (docs/parallel.md "all_gather from
  // point-to-point messages"): OpenMPI serves MPI_Iallgather with libnbc, whose schedule took
  // 1.7-5.4x the blocking MPI_Allgather's time at 64 KiB-1 MiB here, while these messages go
  // straight to the point-to-point transport (the same one the blocking call's algorithm uses)
  // and stay non-blocking, so the deadline and the paced poll hold. Receives are posted first;
  // each rank sends to rank+1, rank+2, ... so the ranks do not all send to rank 0 first. Two
  // all_gathers in a row cannot mix: MPI keeps the messages of one sender and tag in order, and
  // each rank posts its receives in the order of its operations on the queue.
  Status gather_direct(const void* send, void* recv, std::size_t count, DType dtype, const OpName& what) {
    const std::size_t block = count * dtype_size(dtype);
    const int n = static_cast<int>(count);
    auto* out = static_cast<unsigned char*>(recv);
    requests_.assign(static_cast<std::size_t>(2 * (size_ - 1)), MPI_REQUEST_NULL);
    int k = 0;
    for (int step = 1; step < size_; ++step) {
      const int from = (rank_ + size_ - step) % size_;
      STRATA_RETURN_IF_ERROR(start(MPI_Irecv(out + static_cast<std::size_t>(from) * block, n,
                                             wire_type(dtype), from, kGatherTag, comm_, &requests_[k++]),
                                   what));
    }
    for (int step = 1; step < size_; ++step) {
      const int to = (rank_ + step) % size_;
      STRATA_RETURN_IF_ERROR(
          start(MPI_Isend(send, n, wire_type(dtype), to, kGatherTag, comm_, &requests_[k++]), what));
    }
    unsigned char* mine = out + static_cast<std::size_t>(rank_) * block;
    if (send != mine) std::memcpy(mine, send, block);
    return finish(requests_.data(), k, what, transfer_time(2 * static_cast<std::size_t>(size_ - 1) * block));
  }

  // broadcast as point-to-point messages (docs/parallel.md "Broadcast from point-to-point
  // messages"): every rank but the root receives the whole buffer from its parent, then sends it
  // to its children. Small buffers: the root is every other rank's parent (one message each, no
  // relay). Larger: a binomial tree over the ranks numbered from the root (v = rank - root mod
  // n): v's parent is v with its lowest set bit cleared, its children v + 2^k for every 2^k below
  // that bit, so the root's sends halve at each level and a tree of n ranks is ceil(log2 n)
  // levels deep. Bytes are moved as they are (no arithmetic), so every rank gets the root's bits;
  // two broadcasts in a row cannot mix (one sender's messages of one tag stay in order, and each
  // completes before the queue starts the next).
  Status broadcast_direct(void* buf, std::size_t count, DType dtype, int root, const OpName& what) {
    const auto deadline = std::chrono::steady_clock::now() + context_.config.timeout;
    const int n = static_cast<int>(count);
    const int v = (rank_ - root + size_) % size_;
    const std::size_t bytes = count * dtype_size(dtype);
    const bool flat = bytes <= kFlatBcastBytes;
    // The lowest set bit of v (the root: above every rank).
    int low = 1;
    while (low < size_ && (v & low) == 0) low <<= 1;
    if (v != 0) {
      const int parent = flat ? root : (v - low + root) % size_;
      MPI_Request req;
      STRATA_RETURN_IF_ERROR(
          start(MPI_Irecv(buf, n, wire_type(dtype), parent, kBcastTag, comm_, &req), what));
      STRATA_RETURN_IF_ERROR(finish(&req, 1, what, deadline, transfer_time(bytes)));
      if (flat) return ok_status();
    }
    requests_.clear();
    const auto send_to = [&](int w) {
      return start(MPI_Isend(buf, n, wire_type(dtype), (w + root) % size_, kBcastTag, comm_,
                             &requests_.emplace_back()),
                   what);
    };
    if (flat) {
      for (int w = 1; w < size_; ++w) STRATA_RETURN_IF_ERROR(send_to(w));
    } else {
      for (int k = low >> 1; k > 0; k >>= 1) {
        if (v + k < size_) STRATA_RETURN_IF_ERROR(send_to(v + k));
      }
    }
    return finish(requests_.data(), static_cast<int>(requests_.size()), what, deadline,
                  transfer_time(requests_.size() * bytes));
  }

  // The poll of a posted send or recv; a recv (expect >= 0) also checks the received count.
  CommQueue::Poll poll_of(MPI_Request req, OpName what, long long expect, DType dtype) const {
    using Clock = std::chrono::steady_clock;
    return [this, req, what, expect, dtype, deadline = Clock::time_point::max(), idle = 0u]() mutable
           -> Result<bool> {
      int flag = 0;
      MPI_Status st;
      const int rc = MPI_Test(&req, &flag, &st);
      if (rc != MPI_SUCCESS) return mpi_status(rc, what.str() + " on " + label_);
      if (!flag) {
        // The clock every kDeadlineEvery polls (a read costs about what a poll does, and most
        // sends and recvs complete within that many), the first read setting the deadline: the
        // polls between take microseconds, or paced sleeps of at most PollPacer::kMaxSleep.
        if (++idle % kDeadlineEvery == 0) {
          const auto now = Clock::now();
          if (deadline == Clock::time_point::max()) {
            deadline = now + context_.config.timeout;
          } else if (now > deadline) {
            return timeout_error(what);
          }
        }
        return false;
      }
      if (expect >= 0) {
        int got = 0;
        MPI_Get_count(&st, wire_type(dtype), &got);
        if (got != expect) {
          return invalid_argument(what.str() + " on " + label_ + ": the peer sent " + std::to_string(got) +
                                  " elements, expected " + std::to_string(expect));
        }
      }
      return true;
    };
  }

  // Groups of up to kMaxDirectGatherRanks: all_reduce from point-to-point messages, in either
  // dtype as it is (bf16 travels as 16 bits and is folded in fp32, see fold). src == dst allowed.
  template <typename T>
  Status all_reduce_direct(const T* src, T* dst, std::size_t count, ReduceOp op, const OpName& what) {
    if (count * sizeof(T) <= kWholeReduceBytes) return reduce_whole(src, dst, count, op, what);
    return reduce_direct(src, dst, count, /*scatter=*/false, op, what);
  }
  // Larger groups: OpenMPI's non-blocking calls on fp32 (bf16 widened first). src == dst
  // allowed for all_reduce.
  Status all_reduce_nbc(const float* src, float* dst, std::size_t count, ReduceOp op, const OpName& what) {
    MPI_Request req;
    const void* in = src == dst ? MPI_IN_PLACE : src;
    STRATA_RETURN_IF_ERROR(
        start(MPI_Iallreduce(in, dst, static_cast<int>(count), MPI_FLOAT, mpi_op(op), comm_, &req), what));
    return finish(req, what);
  }
  Status reduce_scatter_nbc(const float* src, float* dst, std::size_t recv_count, ReduceOp op,
                            const OpName& what) {
    MPI_Request req;
    STRATA_RETURN_IF_ERROR(start(
        MPI_Ireduce_scatter_block(src, dst, static_cast<int>(recv_count), MPI_FLOAT, mpi_op(op), comm_, &req),
        what));
    return finish(req, what);
  }

  // Above kMaxDirectGatherRanks the 4 (n - 1) requests per chunk are left to libnbc's
  // logarithmic schedules.
  bool reduces_direct() const { return size_ <= kMaxDirectGatherRanks; }

  // all_reduce (scatter false: dst gets all `total` elements; src == dst allowed) or
  // reduce_scatter (true: dst gets this rank's block of total / size) of fp32 as point-to-point
  // messages (docs/parallel.md "Reductions from point-to-point messages, chunked"). Element range
  // q of `total` (begin(q) .. begin(q + 1)) is reduced by rank q: it receives range q of every
  // peer's src and folds the size values of each element in rank order (0, 1, ..., size - 1), so
  // the result does not depend on which rank computes it, on message timing or on the chunking,
  // and every rank gets the same bits. Each range is cut into chunks of
  // mpi_reduce_chunk_elements(size) elements; chunk j of every range travels in step j, received
  // into half j % 2 of peer_blocks_, which therefore never exceeds kMpiReduceBufferBytes whatever
  // the message size. Step j posts chunk j + 1's messages before it waits for chunk j's and
  // folds them, so the transport moves the next chunk while this one is reduced. all_reduce
  // then sends its whole folded range to every peer (tag kGatherTag), received straight into
  // dst: one message per peer (sending each chunk as soon as it was folded measured 5-7x slower
  // at 4 MiB, docs/parallel.md). Bytes per rank as a ring: (n - 1) / n of the buffer out and in
  // per half, in one step per chunk instead of n - 1.
  template <typename T>
  Status reduce_direct(const T* src, T* dst, std::size_t total, bool scatter, ReduceOp op, const OpName& what) {
    const auto deadline = std::chrono::steady_clock::now() + context_.config.timeout;
    const auto n = static_cast<std::size_t>(size_);
    const auto begin = [&](int q) { return total * static_cast<std::size_t>(q) / n; };
    const std::size_t lo = begin(rank_);
    const std::size_t len = begin(rank_ + 1) - lo;
    const std::size_t chunk = mpi_reduce_chunk_elements(size_);
    const std::size_t longest = (total + n - 1) / n;  // the longest range sets the number of steps
    const std::size_t steps = longest == 0 ? 1 : (longest - 1) / chunk + 1;
    // Elements of chunk j of rank q's range (0 past its end: ranges differ by one element).
    const auto piece = [&](int q, std::size_t j) {
      const std::size_t r = begin(q + 1) - begin(q);
      return j * chunk >= r ? std::size_t{0} : std::min(chunk, r - j * chunk);
    };
    // One chunk of peer q lands in slot (rank - q) mod size, minus one, of a half; a message
    // of one chunk needs only one half, holding this rank's whole range.
    const std::size_t width = steps == 1 ? len : chunk;
    const std::size_t half = (n - 1) * width;
    const std::size_t need = steps == 1 ? half : 2 * half;
    T* const blocks = peer_buffer<T>(need);
    const auto slot = [&](int q, std::size_t j) {
      return blocks + (j % 2) * half +
             static_cast<std::size_t>((rank_ - q + size_) % size_ - 1) * width;
    };
    // Chunk j's receives and sends, in request set j % 2.
    const auto post = [&](std::size_t j) -> Status {
      std::vector<MPI_Request>& reqs = chunk_requests_[j % 2];
      reqs.clear();
      if (const std::size_t m = piece(rank_, j); m > 0) {
        for (int step = 1; step < size_; ++step) {
          const int from = (rank_ + size_ - step) % size_;
          STRATA_RETURN_IF_ERROR(start(MPI_Irecv(slot(from, j), static_cast<int>(m), wire_type<T>(), from,
                                                 kReduceTag, comm_, &reqs.emplace_back()),
                                       what));
        }
      }
      for (int step = 1; step < size_; ++step) {
        const int to = (rank_ + step) % size_;
        if (const std::size_t m = piece(to, j); m > 0) {
          STRATA_RETURN_IF_ERROR(start(MPI_Isend(src + begin(to) + j * chunk, static_cast<int>(m),
                                                 wire_type<T>(), to, kReduceTag, comm_, &reqs.emplace_back()),
                                       what));
        }
      }
      return ok_status();
    };
    T* out = scatter ? dst : dst + lo;
    STRATA_RETURN_IF_ERROR(post(0));
    for (std::size_t j = 0; j < steps; ++j) {
      if (j + 1 < steps) STRATA_RETURN_IF_ERROR(post(j + 1));
      std::vector<MPI_Request>& reqs = chunk_requests_[j % 2];
      STRATA_RETURN_IF_ERROR(finish(reqs.data(), static_cast<int>(reqs.size()), what, deadline));
      const std::size_t m = piece(rank_, j);
      fold(
          src + lo + j * chunk, [&](int q) { return slot(q, j); }, out + j * chunk, m, op);
    }
    if (scatter) return ok_status();
    // The gather: every rank's folded range to every peer, received straight into dst. In place,
    // each peer's range of dst was the source of this rank's sends to it, all completed above.
    requests_.clear();
    for (int step = 1; step < size_; ++step) {
      const int from = (rank_ + size_ - step) % size_;
      STRATA_RETURN_IF_ERROR(
          start(MPI_Irecv(dst + begin(from), static_cast<int>(begin(from + 1) - begin(from)), wire_type<T>(),
                          from, kGatherTag, comm_, &requests_.emplace_back()),
                what));
    }
    for (int step = 1; step < size_; ++step) {
      STRATA_RETURN_IF_ERROR(start(MPI_Isend(out, static_cast<int>(len), wire_type<T>(), (rank_ + step) % size_,
                                             kGatherTag, comm_, &requests_.emplace_back()),
                                   what));
    }
    return finish(requests_.data(), static_cast<int>(requests_.size()), what, deadline);
  }

  // A small all_reduce in one round of messages (docs/parallel.md "Small messages without
  // hand-offs"): every rank sends its whole buffer to every peer (tag kReduceTag) and folds all n
  // buffers itself, element by element in rank order 0, 1, ..., n - 1, as reduce_direct's owner
  // of each element does: the same bits on every rank and the same as reduce_direct's, with one
  // message latency instead of two (reduce, then gather) for (n - 1) times the bytes, which
  // below kWholeReduceBytes cost less than a message's fixed latency (up to kPiecedWholeBytes
  // in pieces that each travel at once, see there). src == dst allowed: the fold runs after
  // every send has completed. One sender's pieces of one tag arrive in order.
  template <typename T>
  Status reduce_whole(const T* src, T* dst, std::size_t count, ReduceOp op, const OpName& what) {
    T* const blocks = peer_buffer<T>(static_cast<std::size_t>(size_ - 1) * count);
    const auto slot = [&](int q) {
      return blocks + static_cast<std::size_t>((rank_ - q + size_) % size_ - 1) * count;
    };
    const std::size_t piece = count * sizeof(T) <= kPiecedWholeBytes ? kWholePieceBytes / sizeof(T) : count;
    requests_.clear();
    for (std::size_t b = 0; b < count; b += piece) {
      const int n = static_cast<int>(std::min(piece, count - b));
      for (int step = 1; step < size_; ++step) {
        const int from = (rank_ + size_ - step) % size_;
        STRATA_RETURN_IF_ERROR(start(
            MPI_Irecv(slot(from) + b, n, wire_type<T>(), from, kReduceTag, comm_, &requests_.emplace_back()),
            what));
      }
      for (int step = 1; step < size_; ++step) {
        STRATA_RETURN_IF_ERROR(start(MPI_Isend(src + b, n, wire_type<T>(), (rank_ + step) % size_, kReduceTag,
                                               comm_, &requests_.emplace_back()),
                                     what));
      }
    }
    STRATA_RETURN_IF_ERROR(finish(requests_.data(), static_cast<int>(requests_.size()), what));
    fold(src, slot, dst, count, op);
    return ok_status();
  }

  // out[i] = the fold over ranks 0, 1, ..., size - 1 of element i (mine for this rank, peer(q)[i]
  // for the others), left to right in fp32, divided by the group's size for kAvg, stored as T
  // (bf16: widened exactly, rounded once at the end, as widening the whole buffer first did). out
  // may be mine (in place): each tile is read before it is written.
  template <typename T, typename Peer>
  void fold(const T* mine, Peer peer, T* out, std::size_t count, ReduceOp op) const {
    const auto at = [&](int q, std::size_t t) -> const T* { return q == rank_ ? mine + t : peer(q) + t; };
    std::size_t t = 0;
    // Whole tiles with a constant trip count, which the compiler vectorizes at -O2 (gcc's cheap
    // cost model takes no loop that needs a scalar remainder): the scalar fold took most of a
    // 1 MiB reduction's own time. Each element still sees the same operations in the same
    // order, so the bits are those of the element-wise loop.
    for (; t + kFoldTile <= count; t += kFoldTile) {
      fold_tile(at, t, std::integral_constant<std::size_t, kFoldTile>{}, out, op);
    }
    if (t < count) fold_tile(at, t, count - t, out, op);
  }
  // One tile of fold: `m` (at most kFoldTile) elements from offset t.
  template <typename T, typename At, typename Count>
  void fold_tile(const At& at, std::size_t t, Count m, T* out, ReduceOp op) const {
    float wide[2][kFoldTile];  // bf16 values widened (fp32 is read in place)
    const auto load = [&](int q, float* buf) -> const float* {
      if constexpr (std::is_same_v<T, float>) {
        return at(q, t);
      } else {
        convert(at(q, t), buf, m);
        return buf;
      }
    };
    float acc[kFoldTile];
    const float* first = load(0, wide[0]);
    if (size_ == 1) {
      std::copy(first, first + m, acc);
    } else {
      const bool max = op == ReduceOp::kMax;
      const float* second = load(1, wide[1]);
      if (max) {
        for (std::size_t i = 0; i < m; ++i) acc[i] = std::max(first[i], second[i]);
      } else {
        for (std::size_t i = 0; i < m; ++i) acc[i] = first[i] + second[i];
      }
      for (int q = 2; q < size_; ++q) {
        const float* v = load(q, wide[0]);
        if (max) {
          for (std::size_t i = 0; i < m; ++i) acc[i] = std::max(acc[i], v[i]);
        } else {
          for (std::size_t i = 0; i < m; ++i) acc[i] = acc[i] + v[i];
        }
      }
    }
    if (op == ReduceOp::kAvg) {
      const float d = static_cast<float>(size_);
      for (std::size_t i = 0; i < m; ++i) acc[i] = acc[i] / d;
    }
    if constexpr (std::is_same_v<T, float>) {
      std::copy(acc, acc + m, out + t);
    } else {
      convert(acc, out + t, m);
    }
  }

  // peer_blocks_ as `elements` values of T: a fresh buffer of exactly the bytes needed when it
  // is too small (a resize could round the capacity up past the bound, and would copy contents
  // nobody reads).
  template <typename T>
  T* peer_buffer(std::size_t elements) {
    const std::size_t bytes = elements * sizeof(T);
    if (peer_blocks_.size() < bytes) peer_blocks_ = std::vector<std::byte>(bytes);
    return reinterpret_cast<T*>(peer_blocks_.data());
  }

  static float* widen(const bf16* src, std::size_t n, std::vector<float>& scratch) {
    if (scratch.size() < n) scratch.resize(n);
    convert(src, scratch.data(), n);
    return scratch.data();
  }

  void divide(float* x, std::size_t n) const {
    const float d = static_cast<float>(size_);
    for (std::size_t i = 0; i < n; ++i) x[i] /= d;
  }

  CommContext::Impl& context_;
  MPI_Comm comm_;
  std::string name_;
  std::vector<int> world_ranks_;
  std::string label_;
  int rank_ = 0;
  int size_ = 1;
  // fp32 staging for bf16 reductions above kMaxDirectGatherRanks; touched only by the thread
  // running the operation.
  std::vector<float> scratch_;
  std::vector<float> scratch_out_;
  // The requests of gather_direct and reduce_direct (all_reduce's gather), and of reduce_direct's
  // two chunks in flight; touched only by the thread running the operation.
  std::vector<MPI_Request> requests_;
  std::vector<MPI_Request> chunk_requests_[2];
  // reduce_direct's receive buffer: one or two chunks of the peers' ranges of this rank's
  // elements, at most kMpiReduceBufferBytes (mpi_comm.hpp).
  std::vector<std::byte> peer_blocks_;
  CommQueue queue_;  // last: its thread uses the members above, and stops first
};

}  // namespace

std::size_t mpi_reduce_buffer_bytes(const Comm& comm) {
  const auto* mpi = dynamic_cast<const MpiComm*>(&comm);
  return mpi == nullptr ? 0 : mpi->reduce_buffer_bytes();
}

std::unique_ptr<Comm> make_mpi_comm(CommContext::Impl& context, MPI_Comm comm, std::string name) {
  return std::make_unique<MpiComm>(context, comm, std::move(name));
}

}  // namespace strata::detail

#endif  // STRATA_HAVE_MPI
