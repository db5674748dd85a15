// The comm layer on real processes: run by tests/mpi_run.sh under `mpirun -np N` (N = 2, 3, 4;
// see tests/CMakeLists.txt). Every rank fills its buffers with values that depend on its rank and
// the element index, so every rank can compute the exact expected result of each collective
// (nccl-tests style); the values are chosen so that fp32 sums are exact in any order, and bf16
// results are the one correctly rounded value of the exact sum.
//
// The CommFailure tests are DISABLED_ here and run by their own ctest entries, which expect the
// job to end with an error (a skipped collective, a killed rank).
#include <gtest/gtest.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "comm_environment.hpp"
#include "parallel/mpi_comm.hpp"
#include "strata/parallel.hpp"

// The reference for all_gather is the MPI library itself (the C API only).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

namespace strata {
namespace {

using testing::world;

// Multiples of 1/64 with |x| < 64: exact in fp32, and any sum of a few of them is exact too.
float fill(int rank, std::size_t i) {
  const long k = static_cast<long>((i * 37 + static_cast<std::size_t>(rank) * 101 + 13) % 8191) - 4095;
  return static_cast<float>(k) / 64.0f;
}
// The same, rounded to bf16 (still multiples of 1/64, so their fp32 sums stay exact).
float fill_bf16(int rank, std::size_t i) { return static_cast<float>(bf16(fill(rank, i))); }

float reduce_ref(ReduceOp op, int n, const std::function<float(int)>& value) {
  float acc = value(0);
  for (int r = 1; r < n; ++r) acc = op == ReduceOp::kMax ? std::max(acc, value(r)) : acc + value(r);
  if (op == ReduceOp::kAvg) acc /= static_cast<float>(n);
  return acc;
}

// A typed buffer of f32 or bf16 elements, read and written as float.
struct Buf {
  DType dtype;
  std::vector<float> f;
  std::vector<bf16> h;
  Buf(DType d, std::size_t n) : dtype(d) {
    if (d == DType::kF32)
      f.assign(n, -777.0f);
    else
      h.assign(n, bf16(-777.0f));
  }
  void* data() { return dtype == DType::kF32 ? static_cast<void*>(f.data()) : static_cast<void*>(h.data()); }
  float get(std::size_t i) const { return dtype == DType::kF32 ? f[i] : static_cast<float>(h[i]); }
  void set(std::size_t i, float v) {
    if (dtype == DType::kF32)
      f[i] = v;
    else
      h[i] = bf16(v);
  }
};

float input(DType d, int rank, std::size_t i) {
  return d == DType::kF32 ? fill(rank, i) : fill_bf16(rank, i);
}
float round_to(DType d, float v) { return d == DType::kF32 ? v : static_cast<float>(bf16(v)); }

constexpr std::size_t kSizes[] = {1, 1025, 4097};
constexpr DType kDtypes[] = {DType::kF32, DType::kBF16};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

std::string where(DType d, std::size_t n, ReduceOp op) {
  return std::string(to_string(d)) + " n=" + std::to_string(n) + " op=" + std::string(to_string(op));
}

TEST(Comm, WorldMatchesMpirun) {
  ASSERT_TRUE(launched_by_mpirun());
  EXPECT_EQ(world().size(), testing::g_comm_env->context->world_size());
  EXPECT_EQ(world().rank(), testing::g_comm_env->context->world_rank());
  EXPECT_EQ(world().backend(), CommBackend::kMpi);
  ASSERT_EQ(world().world_ranks().size(), static_cast<std::size_t>(world().size()));
  for (int r = 0; r < world().size(); ++r) EXPECT_EQ(world().world_ranks()[r], r);
  EXPECT_GE(world().size(), 2);
}

TEST(Comm, AllReduceEveryOpDtypeAndSize) {
  Comm& c = world();
  for (DType d : kDtypes) {
    for (std::size_t n : kSizes) {
      for (ReduceOp op : kOps) {
        for (bool in_place : {false, true}) {
          Buf send(d, n);
          Buf recv(d, n);
          for (std::size_t i = 0; i < n; ++i) send.set(i, input(d, c.rank(), i));
          Buf& out = in_place ? send : recv;
          ASSERT_TRUE(c.all_reduce(send.data(), out.data(), n, d, op).wait().ok());
          for (std::size_t i = 0; i < n; ++i) {
            const float want = round_to(d, reduce_ref(op, c.size(), [&](int r) { return input(d, r, i); }));
            ASSERT_EQ(out.get(i), want) << where(d, n, op) << " in_place=" << in_place << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(Comm, ReduceScatterEveryOpDtypeAndSize) {
  Comm& c = world();
  const int p = c.size();
  for (DType d : kDtypes) {
    for (std::size_t n : kSizes) {
      for (ReduceOp op : kOps) {
        Buf send(d, n * p);
        Buf recv(d, n);
        for (std::size_t i = 0; i < n * p; ++i) send.set(i, input(d, c.rank(), i));
        ASSERT_TRUE(c.reduce_scatter(send.data(), recv.data(), n, d, op).wait().ok());
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t j = static_cast<std::size_t>(c.rank()) * n + i;  // this rank's block
          const float want = round_to(d, reduce_ref(op, p, [&](int r) { return input(d, r, j); }));
          ASSERT_EQ(recv.get(i), want) << where(d, n, op) << " i=" << i;
        }
      }
    }
  }
}

TEST(Comm, AllGatherBroadcastEveryDtypeAndSize) {
  Comm& c = world();
  const int p = c.size();
  for (DType d : kDtypes) {
    for (std::size_t n : kSizes) {
      Buf send(d, n);
      Buf recv(d, n * p);
      for (std::size_t i = 0; i < n; ++i) send.set(i, input(d, c.rank(), i));
      ASSERT_TRUE(c.all_gather(send.data(), recv.data(), n, d).wait().ok());
      for (int b = 0; b < p; ++b) {
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_EQ(recv.get(b * n + i), input(d, b, i)) << to_string(d) << " n=" << n << " block " << b;
        }
      }
      for (int root = 0; root < p; ++root) {
        Buf buf(d, n);
        if (c.rank() == root) {
          for (std::size_t i = 0; i < n; ++i) buf.set(i, input(d, root, i));
        }
        ASSERT_TRUE(c.broadcast(buf.data(), n, d, root).wait().ok());
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_EQ(buf.get(i), input(d, root, i)) << to_string(d) << " n=" << n << " root " << root;
        }
      }
    }
  }
}

TEST(Comm, SendRecvRingWithoutPairing) {
  // Every rank sends to the next and receives from the previous, both enqueued before either
  // is waited for: point-to-point operations complete independently, so this cannot deadlock.
  Comm& c = world();
  const int p = c.size();
  const int next = (c.rank() + 1) % p;
  const int prev = (c.rank() + p - 1) % p;
  for (DType d : kDtypes) {
    for (std::size_t n : {std::size_t{1}, std::size_t{4097}, std::size_t{1} << 20}) {
      Buf out(d, n);
      Buf in(d, n);
      for (std::size_t i = 0; i < n; ++i) out.set(i, input(d, c.rank(), i));
      CommWork s = c.send(out.data(), n, d, next);
      CommWork r = c.recv(in.data(), n, d, prev);
      ASSERT_TRUE(r.wait().ok());
      ASSERT_TRUE(s.wait().ok());
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(in.get(i), input(d, prev, i)) << "n=" << n << " i=" << i;
    }
  }
}

TEST(Comm, RecvOfTheWrongCountIsAnError) {
  Comm& c = world();
  std::vector<float> buf(8, 1.0f);
  if (c.rank() == 0) {
    ASSERT_TRUE(c.send(buf.data(), 4, DType::kF32, 1).wait().ok());
  } else if (c.rank() == 1) {
    Status s = c.recv(buf.data(), 8, DType::kF32, 0).wait();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("the peer sent 4 elements, expected 8"), std::string::npos) << s.to_string();
  }
  // A caller's mistake does not break the Comm.
  ASSERT_TRUE(c.barrier().wait().ok());
}

TEST(Comm, BadArgumentsAreErrorsNamingTheProblem) {
  Comm& c = world();
  float x = 0;
  Status s = c.all_reduce(&x, &x, 1, DType::kF16, ReduceOp::kSum).wait();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dtype f16"), std::string::npos) << s.to_string();
  s = c.send(&x, 1, DType::kF32, c.size()).wait();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("peer " + std::to_string(c.size())), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("group 'world'"), std::string::npos) << s.to_string();
  s = c.broadcast(&x, 1, DType::kF32, -1).wait();
  EXPECT_NE(s.message().find("root -1"), std::string::npos) << s.to_string();
  s = c.all_gather(&x, &x, std::size_t{1} << 31, DType::kF32).wait();
  EXPECT_NE(s.message().find("per-call limit"), std::string::npos) << s.to_string();
  // None of these touched the queue: the Comm still works.
  float y = 1.0f;
  ASSERT_TRUE(c.all_reduce(&y, &y, 1, DType::kF32, ReduceOp::kSum).wait().ok());
  EXPECT_EQ(y, static_cast<float>(c.size()));
}

// Enqueues a chain of operations before waiting for any: in-place reductions whose order
// matters (max then sum differs from sum then max on rank-dependent data), and out-of-place steps
// that read the previous step's output from buffers that start out holding other values. Only
// in-order execution gives the simulated result.
TEST(Comm, AsyncOperationsRunInEnqueueOrder) {
  Comm& c = world();
  const int p = c.size();
  const std::size_t n = 1025;
  std::vector<std::vector<float>> sim(p, std::vector<float>(n));
  for (int r = 0; r < p; ++r) {
    for (std::size_t i = 0; i < n; ++i) sim[r][i] = fill(r, i) / 8.0f;
  }
  std::vector<float> a = sim[c.rank()];
  std::vector<float> b(n, 1000.0f + static_cast<float>(c.rank()));
  std::vector<float> gathered(n * p, -1.0f);
  std::vector<CommWork> handles;
  auto all = [&](ReduceOp op) {
    for (std::size_t i = 0; i < n; ++i) {
      const float v = reduce_ref(op, p, [&](int r) { return sim[r][i]; });
      for (int r = 0; r < p; ++r) sim[r][i] = v;
    }
  };
  handles.push_back(c.all_reduce(a.data(), a.data(), n, DType::kF32, ReduceOp::kMax));
  all(ReduceOp::kMax);
  handles.push_back(c.all_reduce(a.data(), a.data(), n, DType::kF32, ReduceOp::kSum));
  all(ReduceOp::kSum);
  handles.push_back(c.all_reduce(a.data(), b.data(), n, DType::kF32, ReduceOp::kAvg));  // b = avg(a)
  all(ReduceOp::kAvg);
  handles.push_back(c.all_gather(b.data(), gathered.data(), n, DType::kF32));
  handles.push_back(c.all_reduce(b.data(), b.data(), n, DType::kF32, ReduceOp::kSum));
  std::vector<float> sim_gathered;
  for (int r = 0; r < p; ++r) sim_gathered.insert(sim_gathered.end(), sim[r].begin(), sim[r].end());
  all(ReduceOp::kSum);
  ASSERT_TRUE(handles.back().wait().ok());
  // Completion is in order too: once the last is done, so is every earlier one.
  for (const CommWork& h : handles) {
    EXPECT_TRUE(h.test());
    EXPECT_TRUE(h.wait().ok());
  }
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(b[i], sim[c.rank()][i]) << "i=" << i;
  EXPECT_EQ(gathered, sim_gathered);
}

// A waiting caller runs queued operations itself when the queue thread sleeps (CommQueue::
// run_inline): the pending ones up to the one it waits for, in order, sends and recvs started at
// once, a collective after those before it completed; what is still in flight when its
// operation completes goes to the queue thread. Queued and inline operations interleave here
// (1-element messages, so a send completes without its recv, as the queue's rules require for
// a send queued before a collective); the point-to-point messages must match in enqueue order
// and the collectives see their inputs in order. Last, a recv waited for while another thread
// submits the send the peer needs first: the waiting caller must hand over rather than keep the
// new send queued behind its wait (that would deadlock until the timeout).
TEST(Comm, InlineAndQueuedOperationsKeepTheirOrder) {
  Comm& c = world();
  const int p = c.size();
  const int me = c.rank();
  const int next = (me + 1) % p;
  const int prev = (me + p - 1) % p;
  auto v = [](int rank, int k) { return static_cast<float>(rank * 100 + k); };
  for (int round = 0; round < 20; ++round) {
    const std::string at = "round " + std::to_string(round);
    float out[5];
    float in[5] = {-1, -1, -1, -1, -1};
    for (int k = 0; k < 5; ++k) out[k] = v(me, k);
    // Two sends, two recvs, the second recv waited first: all four run in order.
    CommWork s0 = c.send(&out[0], 1, DType::kF32, next);
    CommWork s1 = c.send(&out[1], 1, DType::kF32, next);
    CommWork r0 = c.recv(&in[0], 1, DType::kF32, prev);
    CommWork r1 = c.recv(&in[1], 1, DType::kF32, prev);
    ASSERT_TRUE(r1.wait().ok()) << at;
    ASSERT_TRUE(r0.wait().ok()) << at;
    EXPECT_EQ(in[0], v(prev, 0)) << at;
    EXPECT_EQ(in[1], v(prev, 1)) << at;
    // A recv then a send, the send waited: the recv is left in flight for the queue thread.
    CommWork r2 = c.recv(&in[2], 1, DType::kF32, prev);
    CommWork s2 = c.send(&out[2], 1, DType::kF32, next);
    ASSERT_TRUE(s2.wait().ok()) << at;
    ASSERT_TRUE(r2.wait().ok()) << at;
    EXPECT_EQ(in[2], v(prev, 2)) << at;
    // A send, a collective that reads a buffer the send does not, a recv, and a second
    // collective whose input is the first one's output: waited from the last.
    float x = static_cast<float>(me + 1);
    float y = 0.0f;
    CommWork s3 = c.send(&out[3], 1, DType::kF32, next);
    CommWork a0 = c.all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kMax);
    CommWork r3 = c.recv(&in[3], 1, DType::kF32, prev);
    CommWork a1 = c.all_reduce(&x, &y, 1, DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(a1.wait().ok()) << at;
    for (const CommWork* h : {&s0, &s1, &s3, &a0, &r3}) EXPECT_TRUE(h->wait().ok()) << at;
    EXPECT_EQ(in[3], v(prev, 3)) << at;
    EXPECT_EQ(x, static_cast<float>(p)) << at;
    EXPECT_EQ(y, static_cast<float>(p * p)) << at;
    // Rank 0 waits for a recv from rank 1 while a second thread submits its send to rank 1;
    // rank 1 sends back only after receiving it.
    if (me == 0) {
      CommWork r4 = c.recv(&in[4], 1, DType::kF32, 1);
      CommWork s4;
      std::thread sender([&] { s4 = c.send(&out[4], 1, DType::kF32, 1); });
      Status rs = r4.wait();
      sender.join();
      ASSERT_TRUE(rs.ok()) << at << ": " << rs.to_string();
      ASSERT_TRUE(s4.wait().ok()) << at;
      EXPECT_EQ(in[4], v(1, 4) + v(0, 4)) << at;
    } else if (me == 1) {
      float got = 0.0f;
      ASSERT_TRUE(c.recv(&got, 1, DType::kF32, 0).wait().ok()) << at;
      out[4] += got;
      ASSERT_TRUE(c.send(&out[4], 1, DType::kF32, 0).wait().ok()) << at;
    }
  }
  ASSERT_TRUE(c.barrier().wait().ok());
}

// all_gather moves its blocks as point-to-point messages of its own (mpi_comm.cpp gather_direct)
// rather than through MPI_Iallgather. It moves bytes, so its result must equal the MPI library's
// blocking MPI_Allgather's bit for bit: both dtypes, arbitrary bit patterns (NaN payloads and
// denormals included), awkward sizes, out of place and in place, with a send and a recv of the
// same Comm enqueued around it (a message of one must never match a receive of the other: a
// 1-element send taken by the all_gather would fail its count, or leave the recv waiting).
TEST(Comm, AllGatherEqualsTheMpiLibrarysAllgatherBitForBit) {
  Comm& c = world();
  const int p = c.size();
  const int me = c.rank();
  MPI_Comm ref = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &ref), MPI_SUCCESS);
  for (DType d : kDtypes) {
    for (std::size_t n : {std::size_t{1}, std::size_t{1025}, std::size_t{4097}, std::size_t{65537}}) {
      const std::size_t block = n * dtype_size(d);
      const std::size_t total = block * static_cast<std::size_t>(p);
      std::vector<unsigned char> send(block);
      for (std::size_t i = 0; i < block; ++i) {
        send[i] = static_cast<unsigned char>((i * 131 + static_cast<std::size_t>(me) * 197 + 7) ^ (i >> 7));
      }
      std::vector<unsigned char> want(total, 0xCD);
      ASSERT_EQ(MPI_Allgather(send.data(), static_cast<int>(block), MPI_BYTE, want.data(),
                              static_cast<int>(block), MPI_BYTE, ref),
                MPI_SUCCESS);
      const std::string what = std::string(to_string(d)) + " n=" + std::to_string(n);

      std::vector<unsigned char> got(total, 0xAB);
      float token = static_cast<float>(me + 1);
      float token_in = -1.0f;
      CommWork s = c.send(&token, 1, DType::kF32, (me + 1) % p);
      CommWork g = c.all_gather(send.data(), got.data(), n, d);
      CommWork r = c.recv(&token_in, 1, DType::kF32, (me + p - 1) % p);
      Status gs = g.wait();
      ASSERT_TRUE(gs.ok()) << what << ": " << gs.to_string();
      ASSERT_TRUE(s.wait().ok()) << what;
      ASSERT_TRUE(r.wait().ok()) << what;
      EXPECT_TRUE(got == want) << what << ": differs from MPI_Allgather";
      EXPECT_EQ(token_in, static_cast<float>((me + p - 1) % p + 1)) << what;

      std::vector<unsigned char> in_place(total, 0xEE);
      std::copy(send.begin(), send.end(), in_place.begin() + static_cast<std::ptrdiff_t>(me * block));
      ASSERT_TRUE(c.all_gather(in_place.data() + me * block, in_place.data(), n, d).wait().ok()) << what;
      EXPECT_TRUE(in_place == want) << what << " in place: differs from MPI_Allgather";
    }
  }
  MPI_Comm_free(&ref);
}

// broadcast moves its buffer as point-to-point messages of its own (mpi_comm.cpp
// broadcast_direct: the root sends to every rank up to 64 KiB, a binomial tree above), so its
// result must equal MPI_Bcast's bit for bit: every root, both dtypes, arbitrary bit patterns,
// sizes on both sides of the 64 KiB switch (16384 f32 is exactly 64 KiB), with a send and a recv
// of the same Comm enqueued around it (a message of one must never match the other's receive),
// and two broadcasts from different roots enqueued before either is waited for.
TEST(Comm, BroadcastEqualsTheMpiLibrarysBcastBitForBit) {
  Comm& c = world();
  const int p = c.size();
  const int me = c.rank();
  MPI_Comm ref = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &ref), MPI_SUCCESS);
  const auto pattern = [](int root, std::size_t bytes, int salt) {
    std::vector<unsigned char> v(bytes);
    for (std::size_t i = 0; i < bytes; ++i) {
      v[i] = static_cast<unsigned char>((i * 151 + static_cast<std::size_t>(root) * 89 + salt) ^ (i >> 9));
    }
    return v;
  };
  for (DType d : kDtypes) {
    for (std::size_t n :
         {std::size_t{1}, std::size_t{1025}, std::size_t{16384}, std::size_t{16385}, std::size_t{65537}}) {
      const std::size_t bytes = n * dtype_size(d);
      for (int root = 0; root < p; ++root) {
        const std::string what =
            std::string(to_string(d)) + " n=" + std::to_string(n) + " root " + std::to_string(root);
        std::vector<unsigned char> want =
            me == root ? pattern(root, bytes, 3) : std::vector<unsigned char>(bytes, 0xCD);
        ASSERT_EQ(MPI_Bcast(want.data(), static_cast<int>(bytes), MPI_BYTE, root, ref), MPI_SUCCESS);
        std::vector<unsigned char> got =
            me == root ? pattern(root, bytes, 3) : std::vector<unsigned char>(bytes, 0xAB);
        // The second broadcast, from the next root, is enqueued before the first is waited for.
        const int root2 = (root + 1) % p;
        std::vector<unsigned char> want2 = pattern(root2, bytes, 5);
        std::vector<unsigned char> got2 = me == root2 ? want2 : std::vector<unsigned char>(bytes, 0x11);
        float token = static_cast<float>(me + 1);
        float token_in = -1.0f;
        CommWork s = c.send(&token, 1, DType::kF32, (me + 1) % p);
        CommWork b = c.broadcast(got.data(), n, d, root);
        CommWork b2 = c.broadcast(got2.data(), n, d, root2);
        CommWork r = c.recv(&token_in, 1, DType::kF32, (me + p - 1) % p);
        Status bs = b2.wait();
        ASSERT_TRUE(bs.ok()) << what << ": " << bs.to_string();
        ASSERT_TRUE(b.wait().ok()) << what;
        ASSERT_TRUE(s.wait().ok()) << what;
        ASSERT_TRUE(r.wait().ok()) << what;
        EXPECT_TRUE(got == want) << what << ": differs from MPI_Bcast";
        EXPECT_TRUE(got2 == want2) << what << ": the second broadcast (root " << root2 << ") differs";
        EXPECT_EQ(token_in, static_cast<float>((me + p - 1) % p + 1)) << what;
      }
    }
  }
  MPI_Comm_free(&ref);
}

// Operations nobody waits for must still start and complete. A submit right after other
// operations does not wake the queue thread, which dozes then (CommQueue::kDoze, tick_): it
// starts a queued collective within its tick; a send or recv is posted by its submitter at once
// (submit_async) and the thread polls it once it has been left unclaimed for a tick. Rank 0
// watches its handle with test() alone, which makes no MPI call, so nothing but the queue thread
// can move the operation on (a generous liveness bound, not a timing).
void expect_completes_unwaited(const CommWork& work, const std::string& at) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!work.test() && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  if (!work.test()) {
    ADD_FAILURE() << at << ": an operation nobody waited for did not complete within 20 s";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  ASSERT_TRUE(work.wait().ok()) << at;
}

// Rank 0 submits a collective right after another and does not wait for it: the queue thread
// must run it. Then a 1 MiB send and a 1 MiB recv (past the shared-memory transport's eager
// limit, so each needs rank 0's progress after it is posted: the send's completion, the recv's
// match), posted directly and never waited for: the thread must take them over.
TEST(Comm, AnOperationNobodyWaitsForStartsWhileTheQueueThreadDozes) {
  Comm& c = world();
  const int me = c.rank();
  const int p = c.size();
  const std::size_t big = std::size_t{1} << 18;
  std::vector<float> out(big);
  std::vector<float> in(big);
  for (int round = 0; round < 10; ++round) {
    const std::string at = "round " + std::to_string(round);
    float x = 1.0f;
    ASSERT_TRUE(c.all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum).wait().ok()) << at;
    float y = static_cast<float>(me + round);
    CommWork w = c.all_reduce(&y, &y, 1, DType::kF32, ReduceOp::kSum);
    if (me == 0) {
      expect_completes_unwaited(w, at + ", all_reduce");
    } else {
      ASSERT_TRUE(w.wait().ok()) << at;
    }
    EXPECT_EQ(y, static_cast<float>(p * (p - 1) / 2 + p * round)) << at;
    for (std::size_t i = 0; i < big; ++i) out[i] = static_cast<float>(round * 7 + me) + static_cast<float>(i % 97);
    std::fill(in.begin(), in.end(), -1.0f);
    if (me == 0) {
      expect_completes_unwaited(c.send(out.data(), big, DType::kF32, 1), at + ", send");
      expect_completes_unwaited(c.recv(in.data(), big, DType::kF32, 1), at + ", recv");
    } else if (me == 1) {
      ASSERT_TRUE(c.recv(in.data(), big, DType::kF32, 0).wait().ok()) << at;
      ASSERT_TRUE(c.send(out.data(), big, DType::kF32, 0).wait().ok()) << at;
    }
    if (me <= 1) {
      const int from = 1 - me;
      for (std::size_t i = 0; i < big; i += 4099)
        ASSERT_EQ(in[i], static_cast<float>(round * 7 + from) + static_cast<float>(i % 97)) << at << " i=" << i;
    }
  }
  ASSERT_TRUE(c.barrier().wait().ok());
}

// The same after an operation the caller ran itself for a while (rank 1 answers after 1 ms: past
// kDoze, within kDozeSpan, so the queue thread, finding the caller at work, waits kPark at a time
// instead): a collective submitted right after it and never waited for must still start, though
// the thread is in its longer wait and the submit does not wake it.
TEST(Comm, ACollectiveNobodyWaitsForStartsAfterTheCallerRanALongOperationItself) {
  Comm& c = world();
  const int me = c.rank();
  const int p = c.size();
  for (int round = 0; round < 5; ++round) {
    const std::string at = "round " + std::to_string(round);
    float slow = static_cast<float>(round);
    if (me == 0) {
      ASSERT_TRUE(c.recv(&slow, 1, DType::kF32, 1).wait().ok()) << at;
    } else if (me == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ASSERT_TRUE(c.send(&slow, 1, DType::kF32, 0).wait().ok()) << at;
    }
    EXPECT_EQ(slow, static_cast<float>(round)) << at;
    float y = static_cast<float>(me + round);
    CommWork w = c.all_reduce(&y, &y, 1, DType::kF32, ReduceOp::kSum);
    if (me == 0) {
      expect_completes_unwaited(w, at);
    } else {
      ASSERT_TRUE(w.wait().ok()) << at;
    }
    EXPECT_EQ(y, static_cast<float>(p * (p - 1) / 2 + p * round)) << at;
  }
  ASSERT_TRUE(c.barrier().wait().ok());
}

// Element i of `rank`'s buffer in the reduction-order tests: signs and exponents spread over
// 2^-20..2^20, so the fp32 sum over ranks depends on the order it is taken in.
float order_sensitive_value(int rank, std::size_t i) {
  const auto h = static_cast<std::uint32_t>(i * 2654435761u) ^ static_cast<std::uint32_t>(rank * 40503 + 1);
  const float mantissa = 0.5f + static_cast<float>(h % 1000003u) / 1000003.0f;
  return std::ldexp((h & 1u) ? -mantissa : mantissa, static_cast<int>(h % 41u) - 20);
}

// The left-to-right sum of element i over ranks 0, 1, ..., p - 1 (the order the layer folds in).
float rank_order_fold(int p, std::size_t i) {
  float acc = order_sensitive_value(0, i);
  for (int r = 1; r < p; ++r) acc += order_sensitive_value(r, i);
  return acc;
}

// all_reduce and reduce_scatter are point-to-point messages with each element folded in rank
// order by one rank (mpi_comm.cpp reduce_direct); these sizes fit in one chunk. With values whose fp32 sum
// depends on the order (signs and exponents spread over 2^-20..2^20), every rank's result must
// be the left-to-right sum over ranks 0, 1, ..., n-1 bit for bit, and so the same on every rank
// (on 2 ranks any order gives these bits; 3 and 4 ranks tell the orders apart).
TEST(Comm, SmallReductionsFoldInRankOrderBitForBit) {
  Comm& c = world();
  const int p = c.size();
  const int me = c.rank();
  auto value = order_sensitive_value;
  auto fold = [p](std::size_t i) { return rank_order_fold(p, i); };
  for (std::size_t n : {std::size_t{1}, std::size_t{1025}, std::size_t{4097}, std::size_t{65536}}) {
    std::vector<float> x(n);
    std::vector<float> got(n, -1.0f);
    for (std::size_t i = 0; i < n; ++i) x[i] = value(me, i);
    ASSERT_TRUE(c.all_reduce(x.data(), got.data(), n, DType::kF32, ReduceOp::kSum).wait().ok()) << "n=" << n;
    for (std::size_t i = 0; i < n; ++i) {
      const float want = fold(i);
      ASSERT_EQ(std::memcmp(&got[i], &want, sizeof(float)), 0)
          << "all_reduce n=" << n << " i=" << i << ": " << got[i] << " vs " << want;
    }
    // reduce_scatter of n per rank (the larger inputs: LargeReductionsStream... below).
    if (n * static_cast<std::size_t>(p) > 65536) continue;
    std::vector<float> all(n * static_cast<std::size_t>(p));
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = value(me, i);
    std::vector<float> part(n, -1.0f);
    ASSERT_TRUE(c.reduce_scatter(all.data(), part.data(), n, DType::kF32, ReduceOp::kSum).wait().ok())
        << "n=" << n;
    for (std::size_t i = 0; i < n; ++i) {
      const float want = fold(static_cast<std::size_t>(me) * n + i);
      ASSERT_EQ(std::memcmp(&part[i], &want, sizeof(float)), 0)
          << "reduce_scatter n=" << n << " i=" << i << ": " << part[i] << " vs " << want;
    }
  }
}

// Reductions of any size stream through a bounded receive buffer in chunks
// (mpi_reduce_chunk_elements per peer; mpi_comm.cpp reduce_direct). Sizes around the chunk
// boundaries (one chunk, exactly two, three with uneven ranges, in and out of place):
//  - every element is the left-to-right fp32 fold over ranks 0..n-1 bit for bit, so every rank
//    holds the same bits and the chunking changes nothing (on 3 and 4 ranks these values give
//    other bits in any other order: folding in arrival order, or pairwise, fails here);
//  - all_reduce agrees with the MPI library's MPI_Allreduce within the error bound of an fp32
//    sum of n terms in any order, 2 (n - 1) u sum |v_r| with u = 2^-24 (the library may add in
//    another order, so not bitwise);
//  - sum, avg and max of exactly representable values, f32 and bf16, equal the exact result;
//  - the buffer held afterwards is at most kMpiReduceBufferBytes, though the messages are several
//    times larger.
TEST(Comm, LargeReductionsStreamThroughTheBoundedBufferInRankOrder) {
  Comm& c = world();
  const int p = c.size();
  const int me = c.rank();
  const auto np = static_cast<std::size_t>(p);
  const std::size_t chunk = detail::mpi_reduce_chunk_elements(p);
  ASSERT_GT(chunk, 1000u);
  MPI_Comm ref = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &ref), MPI_SUCCESS);
  auto value = order_sensitive_value;
  auto fold = [p](std::size_t i) { return rank_order_fold(p, i); };
  auto check_buffer = [&](const std::string& what) {
    const std::size_t held = detail::mpi_reduce_buffer_bytes(c);
    EXPECT_GT(held, 0u) << what;
    EXPECT_LE(held, detail::kMpiReduceBufferBytes) << what << ": the reduction buffer grew past its capacity";
  };
  // Totals: one chunk per range, two exactly, three with ranges of unequal length.
  for (std::size_t total : {np * chunk, np * 2 * chunk, np * (2 * chunk + 1) + (np - 1)}) {
    const std::string at = "total=" + std::to_string(total) + " (chunk " + std::to_string(chunk) + ")";
    std::vector<float> x(total);
    for (std::size_t i = 0; i < total; ++i) x[i] = value(me, i);
    std::vector<float> got(total, -1.0f);
    ASSERT_TRUE(c.all_reduce(x.data(), got.data(), total, DType::kF32, ReduceOp::kSum).wait().ok()) << at;
    check_buffer("all_reduce " + at);
    std::vector<float> lib(total, -2.0f);
    ASSERT_EQ(MPI_Allreduce(x.data(), lib.data(), static_cast<int>(total), MPI_FLOAT, MPI_SUM, ref),
              MPI_SUCCESS);
    for (std::size_t i = 0; i < total; ++i) {
      const float want = fold(i);
      ASSERT_EQ(std::memcmp(&got[i], &want, sizeof(float)), 0)
          << "all_reduce " << at << " i=" << i << ": " << got[i] << " vs " << want;
      double magnitude = 0;
      for (int r = 0; r < p; ++r) magnitude += std::fabs(static_cast<double>(value(r, i)));
      ASSERT_LE(std::fabs(static_cast<double>(got[i]) - lib[i]), 2.0 * (p - 1) * std::ldexp(magnitude, -24))
          << "all_reduce " << at << " i=" << i << " against MPI_Allreduce";
    }
    // In place: the same bits.
    std::vector<float> y = x;
    ASSERT_TRUE(c.all_reduce(y.data(), y.data(), total, DType::kF32, ReduceOp::kSum).wait().ok()) << at;
    ASSERT_EQ(std::memcmp(y.data(), got.data(), total * sizeof(float)), 0) << "in-place all_reduce " << at;
    // reduce_scatter of total / n per rank (total rounded down to a multiple of n).
    const std::size_t block = total / np;
    std::vector<float> part(block, -1.0f);
    ASSERT_TRUE(c.reduce_scatter(x.data(), part.data(), block, DType::kF32, ReduceOp::kSum).wait().ok())
        << at;
    check_buffer("reduce_scatter " + at);
    for (std::size_t i = 0; i < block; ++i) {
      const float want = fold(static_cast<std::size_t>(me) * block + i);
      ASSERT_EQ(std::memcmp(&part[i], &want, sizeof(float)), 0)
          << "reduce_scatter " << at << " i=" << i << ": " << part[i] << " vs " << want;
    }
  }
  // Every op and dtype across chunk boundaries, against the exact results.
  const std::size_t total = np * (2 * chunk + 1) + 1;
  for (DType d : kDtypes) {
    for (ReduceOp op : kOps) {
      Buf send(d, total);
      Buf recv(d, total);
      for (std::size_t i = 0; i < total; ++i) send.set(i, input(d, me, i));
      ASSERT_TRUE(c.all_reduce(send.data(), recv.data(), total, d, op).wait().ok()) << where(d, total, op);
      for (std::size_t i = 0; i < total; ++i) {
        const float want = round_to(d, reduce_ref(op, p, [&](int r) { return input(d, r, i); }));
        ASSERT_EQ(recv.get(i), want) << where(d, total, op) << " i=" << i;
      }
      const std::size_t block = total / np;
      Buf part(d, block);
      ASSERT_TRUE(c.reduce_scatter(send.data(), part.data(), block, d, op).wait().ok())
          << where(d, block, op);
      for (std::size_t i = 0; i < block; ++i) {
        const std::size_t j = static_cast<std::size_t>(me) * block + i;
        const float want = round_to(d, reduce_ref(op, p, [&](int r) { return input(d, r, j); }));
        ASSERT_EQ(part.get(i), want) << where(d, block, op) << " reduce_scatter i=" << i;
      }
    }
  }
  check_buffer("every op");
  MPI_Comm_free(&ref);
}

// bf16 reductions travel as bf16 and are folded in fp32 (mpi_comm.cpp fold): every element must
// be what the simplest path gives, each rank's bf16 value widened exactly, the widened values
// added (or max'ed) left to right in rank order 0..n-1 in fp32, divided by n for avg, and rounded
// to bf16 once. The values' sum depends on the order and is rarely a bf16 value, so rounding
// after each addition (a mutation tried), or folding in another order, fails it on 3 and 4 ranks
// (2 ranks add once). Sizes: one whole message, one in pieces, and several chunks per range with
// unequal ranges; all_reduce in and out of place, reduce_scatter.
TEST(Comm, Bf16ReductionsFoldInFp32AndRoundOnceBitForBit) {
  Comm& c = world();
  const int p = c.size();
  const int me = c.rank();
  const auto np = static_cast<std::size_t>(p);
  const auto value = [](int r, std::size_t i) { return bf16(order_sensitive_value(r, i)); };
  const auto want = [&](ReduceOp op, std::size_t i) {
    float acc = static_cast<float>(value(0, i));
    for (int r = 1; r < p; ++r) {
      const float v = static_cast<float>(value(r, i));
      acc = op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
    }
    if (op == ReduceOp::kAvg) acc = acc / static_cast<float>(p);
    return bf16(acc).bits;
  };
  const std::size_t chunk = detail::mpi_reduce_chunk_elements(p);
  for (std::size_t total : {std::size_t{1000}, std::size_t{5000}, np * (2 * chunk + 1) + (np - 1)}) {
    std::vector<bf16> x(total);
    for (std::size_t i = 0; i < total; ++i) x[i] = value(me, i);
    for (ReduceOp op : kOps) {
      const std::string at = where(DType::kBF16, total, op);
      std::vector<bf16> got(total, bf16(-1.0f));
      ASSERT_TRUE(c.all_reduce(x.data(), got.data(), total, DType::kBF16, op).wait().ok()) << at;
      for (std::size_t i = 0; i < total; ++i) {
        ASSERT_EQ(got[i].bits, want(op, i)) << "all_reduce " << at << " i=" << i;
      }
      std::vector<bf16> y = x;
      ASSERT_TRUE(c.all_reduce(y.data(), y.data(), total, DType::kBF16, op).wait().ok()) << at;
      ASSERT_EQ(std::memcmp(y.data(), got.data(), total * sizeof(bf16)), 0) << "in-place all_reduce " << at;
      const std::size_t block = total / np;
      std::vector<bf16> part(block, bf16(-1.0f));
      ASSERT_TRUE(c.reduce_scatter(x.data(), part.data(), block, DType::kBF16, op).wait().ok()) << at;
      for (std::size_t i = 0; i < block; ++i) {
        ASSERT_EQ(part[i].bits, want(op, static_cast<std::size_t>(me) * block + i))
            << "reduce_scatter " << at << " i=" << i;
      }
    }
  }
  EXPECT_LE(detail::mpi_reduce_buffer_bytes(c), detail::kMpiReduceBufferBytes);
}

// Two Comms over the same ranks have separate queues: rank 0 waits on A before B, the others on
// B before A, and neither blocks the other.
TEST(Comm, SeparateCommsProgressIndependently) {
  auto second = testing::g_comm_env->context->world(CommBackend::kMpi);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  Comm& a = world();
  Comm& b = **second;
  float x = 1.0f;
  float y = 2.0f;
  if (a.rank() == 0) {
    CommWork wa = a.all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(wa.wait().ok());
    ASSERT_TRUE(b.all_reduce(&y, &y, 1, DType::kF32, ReduceOp::kSum).wait().ok());
  } else {
    CommWork wb = b.all_reduce(&y, &y, 1, DType::kF32, ReduceOp::kSum);
    CommWork wa = a.all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(wb.wait().ok());
    ASSERT_TRUE(wa.wait().ok());
  }
  EXPECT_EQ(x, static_cast<float>(a.size()));
  EXPECT_EQ(y, 2.0f * static_cast<float>(a.size()));
  ASSERT_TRUE(b.barrier().wait().ok());
}

// Every grid shape this world size allows: the groups have the members the formula says, and
// an all_reduce inside each group sums exactly its members' world ranks.
TEST(Comm, GridGroupsHoldTheRanksTheFormulaSays) {
  const int w = testing::g_comm_env->context->world_size();
  const int me = testing::g_comm_env->context->world_rank();
  for (int tp = 1; tp <= w; ++tp) {
    for (int pp = 1; tp * pp <= w; ++pp) {
      if (w % (tp * pp) != 0) continue;
      auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, tp, pp);
      ASSERT_TRUE(groups.ok()) << groups.status().to_string();
      const ProcessGroups& g = *groups;
      EXPECT_EQ(g.grid.rank_of(g.coord), me);
      for (GridAxis axis : {GridAxis::kTensor, GridAxis::kPipeline, GridAxis::kData}) {
        Comm& c = g.group(axis);
        const std::string at = "tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " axis " +
                               std::string(to_string(axis));
        EXPECT_EQ(c.name(), to_string(axis)) << at;
        EXPECT_EQ(c.world_ranks(), g.grid.group_ranks(axis, me)) << at;
        ASSERT_EQ(c.size(), g.grid.size(axis)) << at;
        const int coord = axis == GridAxis::kTensor     ? g.coord.tp
                          : axis == GridAxis::kPipeline ? g.coord.pp
                                                        : g.coord.dp;
        EXPECT_EQ(c.rank(), coord) << at;
        float v[2] = {static_cast<float>(me), 1.0f};
        ASSERT_TRUE(c.all_reduce(v, v, 2, DType::kF32, ReduceOp::kSum).wait().ok()) << at;
        float want = 0;
        for (int r : g.grid.group_ranks(axis, me)) want += static_cast<float>(r);
        EXPECT_EQ(v[0], want) << at;
        EXPECT_EQ(v[1], static_cast<float>(c.size())) << at;
      }
    }
  }
}

// 2 x 2 grid on four ranks (tp = 2, pp = 2): sub-groups of sub-groups, point-to-point along the
// pipeline, and a reduce_scatter inside the tensor group.
TEST(Comm, TwoByTwoGridSubGroups) {
  if (testing::g_comm_env->context->world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const ProcessGroups& g = *groups;
  const int me = testing::g_comm_env->context->world_rank();
  EXPECT_EQ(g.coord, (GridCoord{me % 2, me / 2, 0}));
  EXPECT_EQ(g.dp->size(), 1);
  // Pipeline: stage 0 sends its world rank + 0.5 to stage 1 of the same tp column.
  float msg = static_cast<float>(me) + 0.5f;
  if (g.coord.pp == 0) {
    ASSERT_TRUE(g.pp->send(&msg, 1, DType::kF32, 1).wait().ok());
  } else {
    float got = 0;
    ASSERT_TRUE(g.pp->recv(&got, 1, DType::kF32, 0).wait().ok());
    EXPECT_EQ(got, static_cast<float>(me - 2) + 0.5f);
  }
  // Tensor group: reduce_scatter of 2 x 4097, block b of rank t holds fill(world rank, ...).
  const std::size_t n = 4097;
  std::vector<float> send(2 * n);
  std::vector<float> recv(n);
  for (std::size_t i = 0; i < 2 * n; ++i) send[i] = fill(me, i);
  ASSERT_TRUE(g.tp->reduce_scatter(send.data(), recv.data(), n, DType::kF32, ReduceOp::kSum).wait().ok());
  const int partner = me ^ 1;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t j = static_cast<std::size_t>(g.coord.tp) * n + i;
    ASSERT_EQ(recv[i], fill(me, j) + fill(partner, j)) << "i=" << i;
  }
  // A split of a sub-group: the tp group split into singletons.
  auto single = g.tp->split(g.coord.tp, 0, "tp_single");
  ASSERT_TRUE(single.ok()) << single.status().to_string();
  EXPECT_EQ((*single)->size(), 1);
  EXPECT_EQ((*single)->world_ranks(), std::vector<int>{me});
}

// CPU time used so far by every thread of this process: the caller, each Comm's queue thread,
// the watchdog and the MPI library's own.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The last rank enters each exchange ~1 s late. The others wait for it without burning a core:
// polling is paced (PollPacer, src/parallel/internal.hpp), and the process's CPU time over the
// wait must stay well under the wait's wall time. A resource bound, not a timing one: it holds
// however slow or loaded the machine is (measured on 2 loaded cores: back-to-back polling
// 48-50%, paced 10-13%; docs/parallel.md "Waiting without burning a core").
// Three ways of waiting: a recv polled by the queue thread among its in-flight operations (the
// caller looks at test() once a millisecond instead of waiting, so it does not run the recv
// itself); a collective polled by the caller itself (run_inline); a recv and a collective queued
// behind it, waited for by the caller (run_inline polls the recv, then runs the collective).
TEST(Comm, WaitingForALatePeerCostsLittleCpu) {
  Comm& c = world();
  const int late = c.size() - 1;
  constexpr double kMaxCpuShare = 0.3;
  const char* kRounds[] = {"recv polled by the queue thread", "all_reduce run by the caller",
                           "all_reduce behind a recv"};
  for (int round = 0; round < 3; ++round) {
    const bool with_recv = round != 1;
    const bool with_all_reduce = round != 0;
    float x = static_cast<float>(c.rank() + 1);
    float got = 0.0f;
    ASSERT_TRUE(c.barrier().wait().ok());
    if (c.rank() == late) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));
      if (with_recv) {
        ASSERT_TRUE(c.send(&x, 1, DType::kF32, 0).wait().ok());
      }
      if (with_all_reduce) {
        ASSERT_TRUE(c.all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum).wait().ok());
      }
      continue;
    }
    if (c.rank() != 0 && !with_all_reduce) continue;  // only rank 0 takes part in the recv
    const double cpu0 = process_cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    CommWork r = with_recv && c.rank() == 0 ? c.recv(&got, 1, DType::kF32, late) : CommWork();
    CommWork a = with_all_reduce ? c.all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum) : CommWork();
    if (round == 0) {
      while (!r.test()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(r.wait().ok());
    ASSERT_TRUE(a.wait().ok());
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = process_cpu_seconds() - cpu0;
    std::printf("rank %d, %s: waited %.3f s, used %.3f s of CPU (%.1f%%)\n", c.rank(), kRounds[round], wall,
                cpu, 100.0 * cpu / wall);
    std::fflush(stdout);
    EXPECT_LT(cpu, kMaxCpuShare * wall) << kRounds[round] << ": waited " << wall << " s";
    // The exchange itself still happened.
    if (with_recv && c.rank() == 0) {
      EXPECT_EQ(got, static_cast<float>(late + 1));
    }
    if (with_all_reduce) {
      EXPECT_EQ(x, static_cast<float>(c.size() * (c.size() + 1) / 2));
    }
  }
  ASSERT_TRUE(c.barrier().wait().ok());
}

// ---- Failures (run by their own ctest entries; the job is expected to end with an error) ----

// Rank 1 skips an all_reduce on the world and waits on a barrier of a second Comm that nobody
// else joins: every rank's operation times out, every rank reports it, and the job ends.
TEST(CommFailure, DISABLED_SkippedCollectiveTimesOut) {
  auto second = testing::g_comm_env->context->world(CommBackend::kMpi);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(world().barrier().wait().ok());
  Status s;
  float x = 1.0f;
  if (world().rank() == 1) {
    s = (*second)->barrier().wait();
    EXPECT_NE(s.message().find("barrier on group 'world'"), std::string::npos) << s.to_string();
  } else {
    s = world().all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum).wait();
    EXPECT_NE(s.message().find("all_reduce(sum) of 1 x f32 on group 'world'"), std::string::npos)
        << s.to_string();
  }
  EXPECT_NE(s.message().find("comm timeout"), std::string::npos) << s.to_string();
  EXPECT_EQ(testing::g_comm_env->context->failure(), s);
  std::printf("rank %d observed the timeout: %s\n", world().rank(), s.to_string().c_str());
  std::fflush(stdout);
  // A later operation on the failed Comm is cancelled, naming the first failure.
  Comm& failed = world().rank() == 1 ? **second : world();
  Status later = failed.barrier().wait();
  EXPECT_EQ(later.code(), StatusCode::kCancelled) << later.to_string();
  EXPECT_NE(later.message().find("comm timeout"), std::string::npos) << later.to_string();
}

// The same for all_gather, whose point-to-point messages are polled against the deadline like
// any operation: ranks 0 and 2 exchange their blocks but never get rank 1's, and time out
// naming the all_gather. DISABLED_ like the other failure cases: it ends the job, so only its
// own ctest entry (dist.comm.timeout_skipped_all_gather) runs it.
TEST(CommFailure, DISABLED_SkippedAllGatherTimesOut) {
  auto second = testing::g_comm_env->context->world(CommBackend::kMpi);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(world().barrier().wait().ok());
  Status s;
  std::vector<float> x(4097, 1.0f);
  std::vector<float> all(x.size() * static_cast<std::size_t>(world().size()));
  if (world().rank() == 1) {
    s = (*second)->barrier().wait();
  } else {
    s = world().all_gather(x.data(), all.data(), x.size(), DType::kF32).wait();
    EXPECT_NE(s.message().find("all_gather of 4097 x f32 per rank on group 'world'"), std::string::npos)
        << s.to_string();
  }
  EXPECT_NE(s.message().find("comm timeout"), std::string::npos) << s.to_string();
  EXPECT_EQ(testing::g_comm_env->context->failure(), s);
  std::printf("rank %d observed the timeout: %s\n", world().rank(), s.to_string().c_str());
  std::fflush(stdout);
  Comm& failed = world().rank() == 1 ? **second : world();
  Status later = failed.all_gather(x.data(), all.data(), x.size(), DType::kF32).wait();
  EXPECT_EQ(later.code(), StatusCode::kCancelled) << later.to_string();
}

// Rank 1 kills itself with SIGKILL before an all_reduce. Either the launcher notices and ends
// the job, or (with mpirun told not to) the survivors time out and abort it themselves.
TEST(CommFailure, DISABLED_KilledRankEndsTheJob) {
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 1) ::kill(::getpid(), SIGKILL);
  float x = 1.0f;
  Status s = world().all_reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum).wait();
  std::printf("rank %d: %s\n", world().rank(), s.to_string().c_str());
  std::fflush(stdout);
  EXPECT_FALSE(s.ok());
}

}  // namespace
}  // namespace strata
