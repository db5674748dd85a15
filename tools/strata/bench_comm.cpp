// strata bench comm: the bus bandwidth of each collective through Strata's Comm (mpi backend)
// against the same collective called directly on the MPI library, on the same ranks and buffers
// in the same run (nccl-tests style). Run it under mpirun: `mpirun -np 2 strata bench comm`.
//
// One timed run is `iters` back-to-back operations, each waited for before the next (that is how
// the runtime uses them: it needs the result), bracketed by barriers; its time is the slowest
// rank's. Strata and MPI alternate which goes first in each rep so that drift hits both alike; the
// figure of merit is the median over reps of (MPI time / Strata time) within the rep.
// Bus bandwidth = bytes / time * factor, the factor making it comparable across rank counts:
// all_reduce 2(n-1)/n, reduce_scatter and all_gather (n-1)/n over the full n-block buffer,
// broadcast 1, and sendrecv (every rank sends to the next and receives from the previous) 1.
#include "strata/build_config.hpp"

#if STRATA_HAVE_MPI
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "cli.hpp"
#include "strata/options.hpp"
#include "strata/parallel.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"json", "", "print one JSON object (default: a table)"},
    {"min-bytes", "B", "smallest message (default 64KiB)"},
    {"max-bytes", "B", "largest message (default 64MiB); sizes step by 4x"},
    {"iters", "K", "operations per timed run (default: enough for ~256 MiB moved, 8..4000)"},
    {"reps", "R", "timed runs per size and side; the median ratio is reported (default 5)"},
    {"ops", "LIST", "comma-separated operations to run (default: all five)"},
    {"help", "", "show this help"},
};

constexpr std::string_view kOpNames[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "sendrecv"};

// The default iterations' cap: a timed run of small messages lasts ~2-20 ms, long against the
// barrier's skew between ranks and the machine's scheduling noise. With 50, a 1 KiB run was
// ~25 us and its ratio swung 0.3-1.5; with 400 (~0.2-1 ms) the 1-4 KiB ratios still read
// 0.1-0.3 above what runs ten times longer agree on (docs/performance.md, 2026-11-27).
constexpr std::uint64_t kMaxIters = 4000;
// And its floor: at 64 MiB ~256 MiB moved is 4 operations, one run ~40 ms, and the reps of such
// runs of all_gather spread over 0.75-1.05 of MPI, those of runs of 8 about a third as wide
// (docs/performance.md, 2026-11-27, third pass).
constexpr std::uint64_t kMinIters = 8;

std::string usage() {
  return "usage: strata bench comm [flags], under mpirun: mpirun -np N strata bench comm (N >= 2)\n\n"
         "Bus bandwidth of all_reduce, reduce_scatter, all_gather, broadcast and sendrecv (f32) through\n"
         "Strata's comm layer against the same calls made directly on MPI, and their ratio.\n\nflags:\n" +
         format_flags(kFlags);
}

// The flags, checked before MPI starts (a usage error needs no mpirun, in a build without MPI too).
struct Flags {
  std::uint64_t min_bytes = 0;
  std::uint64_t max_bytes = 0;
  std::int64_t iters = 0;  // 0: the default count per size
  std::int64_t reps = 0;
  std::set<std::string> ops;  // empty: all
  bool json = false;
};

Result<Flags> parse_flags(const Args& args) {
  Flags f;
  STRATA_ASSIGN_OR_RETURN(f.min_bytes, args.get_bytes("min-bytes", 64 << 10, 4, 1ull << 32));
  STRATA_ASSIGN_OR_RETURN(f.max_bytes, args.get_bytes("max-bytes", 64 << 20, 4, 1ull << 32));
  STRATA_ASSIGN_OR_RETURN(f.iters, args.get_int("iters", 0, 0, 100000));
  STRATA_ASSIGN_OR_RETURN(f.reps, args.get_int("reps", 5, 1, 1000));
  f.json = args.has("json");
  if (f.min_bytes > f.max_bytes) return invalid_argument("--min-bytes exceeds --max-bytes");
  if (auto list = args.get("ops")) {
    std::stringstream items(*list);
    std::string op;
    while (std::getline(items, op, ',')) {
      if (std::find(std::begin(kOpNames), std::end(kOpNames), op) == std::end(kOpNames)) {
        std::string expected;
        for (std::string_view name : kOpNames) expected += (expected.empty() ? "" : ", ") + std::string(name);
        return invalid_argument("--ops: unknown operation '" + op + "' (expected one of " + expected + ")");
      }
      f.ops.insert(op);
    }
  }
  return f;
}

#if STRATA_HAVE_MPI

struct Collective {
  const char* name;
  // Bus-bandwidth factor for n ranks.
  double (*factor)(int n);
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The slowest rank's time: a collective is as fast as its last participant.
double slowest(double t) {
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

Result<double> time_run(const std::function<Status()>& one, int iters) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < iters; ++k) STRATA_RETURN_IF_ERROR(one());
  const double t = seconds_since(t0);
  return slowest(t);
}

int run(const Flags& flags) {
  const auto wanted = [&](const std::string& name) { return flags.ops.empty() || flags.ops.count(name) > 0; };

  Options options;
  if (Status s = options.load_env(); !s.ok()) {
    std::fprintf(stderr, "strata bench comm: %s\n", s.message().c_str());
    return kExitFailure;
  }
  auto config = CommConfig::from_options(options);
  if (!config.ok()) {
    std::fprintf(stderr, "strata bench comm: %s\n", config.status().to_string().c_str());
    return kExitFailure;
  }
  auto ctx = CommContext::create(*config);
  if (!ctx.ok()) {
    std::fprintf(stderr, "strata bench comm: %s\n", ctx.status().to_string().c_str());
    return kExitFailure;
  }
  const int n = (*ctx)->world_size();
  const int me = (*ctx)->world_rank();
  if (n < 2) {
    std::fprintf(stderr,
                 "strata bench comm: needs at least 2 ranks (run it as mpirun -np 2 strata bench comm)\n");
    return kExitUsage;
  }
  auto world = (*ctx)->world(CommBackend::kMpi);
  if (!world.ok()) {
    std::fprintf(stderr, "strata bench comm: %s\n", world.status().to_string().c_str());
    return kExitFailure;
  }
  Comm& c = **world;
  // The reference runs on its own communicator over the same ranks, as Strata's does.
  MPI_Comm ref;
  MPI_Comm_dup(MPI_COMM_WORLD, &ref);
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;

  const Collective kCollectives[] = {
      {"all_reduce", [](int p) { return 2.0 * (p - 1) / p; }},
      {"reduce_scatter", [](int p) { return static_cast<double>(p - 1) / p; }},
      {"all_gather", [](int p) { return static_cast<double>(p - 1) / p; }},
      {"broadcast", [](int) { return 1.0; }},
      {"sendrecv", [](int) { return 1.0; }},
  };

  nlohmann::json out;
  out["benchmark"] = "comm";
  out["ranks"] = n;
  out["backend"] = "mpi";
  out["dtype"] = "f32";
  out["reps"] = flags.reps;
  out["results"] = nlohmann::json::array();
  double worst = 1e300;
  for (std::uint64_t bytes = flags.min_bytes; bytes <= flags.max_bytes; bytes *= 4) {
    // `bytes` is the full buffer: for reduce_scatter / all_gather the n blocks together.
    const std::size_t count = static_cast<std::size_t>(bytes / 4);
    const std::size_t block = std::max<std::size_t>(1, count / static_cast<std::size_t>(n));
    std::vector<float> a(count + block * n, 1.0f);
    std::vector<float> b(count + block * n, 0.0f);
    const int iters = flags.iters > 0
                          ? static_cast<int>(flags.iters)
                          : static_cast<int>(std::clamp<std::uint64_t>((256ull << 20) / bytes, kMinIters, kMaxIters));
    for (const Collective& col : kCollectives) {
      if (!wanted(col.name)) continue;
      const std::string name = col.name;
      std::function<Status()> strata_op;
      std::function<Status()> mpi_op;
      std::uint64_t moved = bytes;
      const int icount = static_cast<int>(count);
      const int iblock = static_cast<int>(block);
      auto mpi_ok = [](int rc) {
        return rc == MPI_SUCCESS ? ok_status() : internal_error("MPI call failed");
      };
      if (name == "all_reduce") {
        strata_op = [&] {
          return c.all_reduce(a.data(), b.data(), count, DType::kF32, ReduceOp::kSum).wait();
        };
        mpi_op = [&] { return mpi_ok(MPI_Allreduce(a.data(), b.data(), icount, MPI_FLOAT, MPI_SUM, ref)); };
      } else if (name == "reduce_scatter") {
        moved = block * static_cast<std::uint64_t>(n) * 4;
        strata_op = [&] {
          return c.reduce_scatter(a.data(), b.data(), block, DType::kF32, ReduceOp::kSum).wait();
        };
        mpi_op = [&] {
          return mpi_ok(MPI_Reduce_scatter_block(a.data(), b.data(), iblock, MPI_FLOAT, MPI_SUM, ref));
        };
      } else if (name == "all_gather") {
        moved = block * static_cast<std::uint64_t>(n) * 4;
        strata_op = [&] { return c.all_gather(a.data(), b.data(), block, DType::kF32).wait(); };
        mpi_op = [&] {
          return mpi_ok(MPI_Allgather(a.data(), iblock, MPI_FLOAT, b.data(), iblock, MPI_FLOAT, ref));
        };
      } else if (name == "broadcast") {
        strata_op = [&] { return c.broadcast(a.data(), count, DType::kF32, 0).wait(); };
        mpi_op = [&] { return mpi_ok(MPI_Bcast(a.data(), icount, MPI_FLOAT, 0, ref)); };
      } else {
        strata_op = [&] {
          CommWork s = c.send(a.data(), count, DType::kF32, next);
          Status r = c.recv(b.data(), count, DType::kF32, prev).wait();
          Status sw = s.wait();
          return r.ok() ? sw : r;
        };
        mpi_op = [&] {
          return mpi_ok(MPI_Sendrecv(a.data(), icount, MPI_FLOAT, next, 9, b.data(), icount, MPI_FLOAT, prev,
                                     9, ref, MPI_STATUS_IGNORE));
        };
      }
      std::vector<double> ts, tm, ratios;
      for (int r = 0; r <= flags.reps; ++r) {  // rep 0 warms up both
        double t_s = 0;
        double t_m = 0;
        for (int k = 0; k < 2; ++k) {
          const bool strata_turn = (k == 0) == (r % 2 == 0);
          auto t = time_run(strata_turn ? strata_op : mpi_op, iters);
          if (!t.ok()) {
            std::fprintf(stderr, "strata bench comm: %s of %llu B: %s\n", col.name,
                         static_cast<unsigned long long>(bytes), t.status().to_string().c_str());
            return kExitFailure;
          }
          (strata_turn ? t_s : t_m) = *t / iters;
        }
        if (r == 0) continue;
        ts.push_back(t_s);
        tm.push_back(t_m);
        ratios.push_back(t_m / t_s);
      }
      const double f = col.factor(n);
      nlohmann::json j;
      j["op"] = col.name;
      j["bytes"] = moved;
      j["iters"] = iters;
      j["strata_us"] = median(ts) * 1e6;
      j["mpi_us"] = median(tm) * 1e6;
      j["strata_busbw_gb_s"] = static_cast<double>(moved) / median(ts) * f / 1e9;
      j["mpi_busbw_gb_s"] = static_cast<double>(moved) / median(tm) * f / 1e9;
      j["ratio"] = median(ratios);
      j["ratio_min"] = *std::min_element(ratios.begin(), ratios.end());
      j["ratio_max"] = *std::max_element(ratios.begin(), ratios.end());
      worst = std::min(worst, median(ratios));
      out["results"].push_back(j);
    }
  }
  out["worst_median_ratio"] = worst;
  MPI_Comm_free(&ref);
  if (me == 0) {
    if (flags.json) {
      std::printf("%s\n", out.dump(2).c_str());
    } else {
      std::printf("comm bus bandwidth on %d ranks (f32, mpi backend), median of %lld reps\n", n,
                  static_cast<long long>(flags.reps));
      std::printf("%-15s %12s %6s %12s %12s %12s %12s %7s %15s\n", "op", "bytes", "iters", "strata us",
                  "mpi us", "strata GB/s", "mpi GB/s", "ratio", "ratio range");
      for (const auto& j : out["results"]) {
        std::printf("%-15s %12llu %6d %12.1f %12.1f %12.3f %12.3f %7.3f %7.3f..%-7.3f\n",
                    j["op"].get<std::string>().c_str(),
                    static_cast<unsigned long long>(j["bytes"].get<std::uint64_t>()), j["iters"].get<int>(),
                    j["strata_us"].get<double>(), j["mpi_us"].get<double>(),
                    j["strata_busbw_gb_s"].get<double>(), j["mpi_busbw_gb_s"].get<double>(),
                    j["ratio"].get<double>(), j["ratio_min"].get<double>(), j["ratio_max"].get<double>());
      }
      std::printf("worst median ratio: %.3f (target >= 0.9)\n", worst);
    }
    std::fflush(stdout);
  }
  world->reset();
  return kExitOk;
}

#endif  // STRATA_HAVE_MPI

int bench_comm(std::span<const std::string> argv) {
  auto parsed = Args::parse(argv, kFlags);
  if (!parsed.ok()) return usage_error("bench comm", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("bench comm", "unexpected argument '" + args.positionals()[0] + "'", usage());
  }
  auto flags = parse_flags(args);
  if (!flags.ok()) return usage_error("bench comm", flags.status().message(), usage());
#if STRATA_HAVE_MPI
  return run(*flags);
#else
  std::fprintf(
      stderr, "strata bench comm: this build of Strata has no MPI (configure with -DSTRATA_ENABLE_MPI=ON)\n");
  return kExitFailure;
#endif
}

}  // namespace

STRATA_CLI_BENCH(comm, "collectives' bus bandwidth through Strata's comm layer vs MPI directly", bench_comm);

}  // namespace strata::cli
