// A bare-MPI probe of what one collective call costs, behind docs/parallel.md "Small messages and
// all_gather": each blocking call against its non-blocking form polled back to back (and with
// MPI_Wait, and with a yield between polls), and all_gather as point-to-point messages (what the
// mpi backend's gather_direct does). Not part of the build; run it on the machine being measured:
//
//   mpicxx -O2 -std=c++20 bench/comm_probe.cpp -o /tmp/comm_probe
//   mpirun --oversubscribe -np 2 /tmp/comm_probe
//
// Each figure is the 20th percentile of 100 single calls, each started after a barrier, the
// slowest rank's: the cost of the call itself with as little of the machine's scheduling noise as
// a loaded machine allows (the yielding rows show that noise on purpose).
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

namespace {

MPI_Comm g_comm;

void poll(int count, MPI_Request* reqs, bool yield) {
  int flag = 0;
  for (;;) {
    MPI_Testall(count, reqs, &flag, MPI_STATUSES_IGNORE);
    if (flag) return;
    if (yield) sched_yield();
  }
}

double p20_us(const std::function<void()>& call, int iters) {
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(g_comm);
    const auto t0 = std::chrono::steady_clock::now();
    call();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6);
  }
  std::sort(t.begin(), t.end());
  double x = t[t.size() / 5];
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, g_comm);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_dup(MPI_COMM_WORLD, &g_comm);
  int me = 0;
  int n = 1;
  MPI_Comm_rank(g_comm, &me);
  MPI_Comm_size(g_comm, &n);
  for (std::size_t bytes :
       {std::size_t{4} << 10, std::size_t{64} << 10, std::size_t{256} << 10, std::size_t{1} << 20}) {
    const std::size_t count = bytes / 4;
    const std::size_t block = count / static_cast<std::size_t>(n);
    std::vector<float> a(count * 2, 1.0f);
    std::vector<float> b(count * 2, 0.0f);
    const int ic = static_cast<int>(count);
    const int ib = static_cast<int>(block);
    auto iallgather = [&](bool yield, bool wait) {
      MPI_Request r;
      MPI_Iallgather(a.data(), ib, MPI_FLOAT, b.data(), ib, MPI_FLOAT, g_comm, &r);
      if (wait) {
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      } else {
        poll(1, &r, yield);
      }
    };
    auto direct_allgather = [&] {
      std::vector<MPI_Request> r;
      r.reserve(static_cast<std::size_t>(2 * n));
      for (int step = 1; step < n; ++step) {
        const int from = (me + n - step) % n;
        r.emplace_back();
        MPI_Irecv(b.data() + static_cast<std::size_t>(from) * block, ib, MPI_FLOAT, from, 8, g_comm,
                  &r.back());
      }
      for (int step = 1; step < n; ++step) {
        r.emplace_back();
        MPI_Isend(a.data(), ib, MPI_FLOAT, (me + step) % n, 8, g_comm, &r.back());
      }
      std::copy(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(block),
                b.begin() + static_cast<std::ptrdiff_t>(me * block));
      poll(static_cast<int>(r.size()), r.data(), false);
    };
    auto nb = [&](auto post) {
      return [&, post] {
        MPI_Request r;
        post(&r);
        poll(1, &r, false);
      };
    };
    struct Row {
      const char* name;
      std::function<void()> call;
    };
    const Row rows[] = {
        {"MPI_Allgather", [&] { MPI_Allgather(a.data(), ib, MPI_FLOAT, b.data(), ib, MPI_FLOAT, g_comm); }},
        {"MPI_Iallgather+test", [&] { iallgather(false, false); }},
        {"MPI_Iallgather+wait", [&] { iallgather(false, true); }},
        {"MPI_Iallgather+test+yield", [&] { iallgather(true, false); }},
        {"direct all_gather+testall", direct_allgather},
        {"MPI_Allreduce", [&] { MPI_Allreduce(a.data(), b.data(), ic, MPI_FLOAT, MPI_SUM, g_comm); }},
        {"MPI_Iallreduce+test",
         nb([&](MPI_Request* r) { MPI_Iallreduce(a.data(), b.data(), ic, MPI_FLOAT, MPI_SUM, g_comm, r); })},
        {"MPI_Reduce_scatter_block",
         [&] { MPI_Reduce_scatter_block(a.data(), b.data(), ib, MPI_FLOAT, MPI_SUM, g_comm); }},
        {"MPI_Ireduce_scatter_block+test", nb([&](MPI_Request* r) {
           MPI_Ireduce_scatter_block(a.data(), b.data(), ib, MPI_FLOAT, MPI_SUM, g_comm, r);
         })},
        {"MPI_Bcast", [&] { MPI_Bcast(a.data(), ic, MPI_FLOAT, 0, g_comm); }},
        {"MPI_Ibcast+test", nb([&](MPI_Request* r) { MPI_Ibcast(a.data(), ic, MPI_FLOAT, 0, g_comm, r); })},
    };
    for (const Row& row : rows) {
      p20_us(row.call, 10);  // warm-up
      const double us = p20_us(row.call, 100);
      if (me == 0) std::printf("%8zu B  %-32s %10.1f us\n", bytes, row.name, us);
    }
  }
  MPI_Comm_free(&g_comm);
  MPI_Finalize();
  return 0;
}
