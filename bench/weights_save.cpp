// save_weights with every rank writing its part (the default, docs/checkpoints.md "Who writes
// the weights file") against the earlier path that gathers every parameter to the first rank
// (offload_detail::EngineFaults::gather_weights_on_save), alternated in the same run on the same engine. Not part of the
// build; run it on the machine being measured, from the repository root after a build:
//
//   g++ -O2 -std=c++20 -Iinclude -Isrc -Ibuild/generated bench/weights_save.cpp -Lbuild/lib -lstrata -Wl,-rpath,$PWD/build/lib \
//       -o /tmp/weights_save
//   mpirun --oversubscribe -np 2 /tmp/weights_save tp|dp|dp1 [n_embd] [n_layer] [dtype f32|bf16] [dir]
//
// tp: GPT-2 split over the ranks (its Conv1D shards are strided in the file: one write per stored
// column); dp: ZeRO stage 3, every module sliced; dp1: ZeRO stage 1, every rank a replica (each
// writes a contiguous 1/dp of every parameter). The model is GPT-2 with a 50257-token vocabulary
// (the embedding dominates, as in GPT-2 small). Prints each save's time (the slowest rank's, each
// after a barrier), the median of 5 of each, the ratio gather / parallel and each rank's writes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "offload/internal.hpp"
#include "strata/device.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"
#include "strata/parallel.hpp"

using namespace strata;

namespace {

int fail(const Status& s) {
  std::fprintf(stderr, "weights_save: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "tp";
  const std::int64_t embd = argc > 2 ? std::atoll(argv[2]) : 768;
  const std::int64_t layers = argc > 3 ? std::atoll(argv[3]) : 2;
  const std::string dtype = argc > 4 ? argv[4] : "f32";
  const std::string dir = argc > 5 ? argv[5] : "/tmp";
  Options options;
  if (Status s = options.load_env(); !s.ok()) return fail(s);
  auto cc = CommConfig::from_options(options);
  if (!cc.ok()) return fail(cc.status());
  auto ctx = CommContext::create(*cc);
  if (!ctx.ok()) return fail(ctx.status());
  auto world = (*ctx)->world(CommBackend::kMpi);
  if (!world.ok()) return fail(world.status());
  Comm& comm = **world;
  const int P = comm.size(), rank = comm.rank();

  TrainerConfig config;
  config.model.kind = ModelKind::kGpt2;
  config.model.n_layer = layers;
  config.model.n_embd = embd;
  config.model.n_head = 12;
  config.model.n_positions = 128;
  config.model.vocab_size = 50257;
  config.model.dtype = dtype == "bf16" ? DType::kBF16 : DType::kF32;
  config.micro_batch = 1;
  config.seq_len = 16;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  const bool dp = mode == "dp" || mode == "dp1";
  if (mode == "dp") {
    s.params = Tier::kHost;
    s.zero_stage = 3;
    s.persistence_threshold = 0;
  } else if (mode == "dp1") {
    s.params = Tier::kHost;
    s.zero_stage = 1;
  }
  DeviceConfig dc;
  dc.kind = DeviceKind::kCpu;
  dc.memory_bytes = (dp ? 2ull : 1ull) << 30;  // data parallelism keeps whole-model gradients on the device
  dc.pinned_bytes = 2ull << 30;
  dc.compute_threads = 1;
  auto device = Device::create(dc);
  if (!device.ok()) return fail(device.status());
  auto engine = dp ? OffloadEngine::create(config, s, **device, nullptr, &comm)
                             : OffloadEngine::create(config, s, **device, nullptr, nullptr, &comm);
  if (!engine.ok()) return fail(engine.status());
  const std::string path = dir + "/strata-weights-save-bench.safetensors";
  auto timed = [&](bool gather) -> double {
    offload_detail::EngineFaults::gather_weights_on_save(**engine, gather);
    (void)comm.barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    Status st = (*engine)->save_weights(path);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    offload_detail::EngineFaults::gather_weights_on_save(**engine, false);
    if (!st.ok()) {
      fail(st);
      std::exit(1);
    }
    std::vector<double> all(static_cast<std::size_t>(P));
    (void)comm.all_gather(&t, all.data(), 2, DType::kF32).wait();
    return *std::max_element(all.begin(), all.end());
  };
  std::vector<double> par, gat;
  const std::uint64_t w0 = (*engine)->stats().weights_file_writes;
  timed(false);  // warm: the page cache, the file's blocks
  for (int i = 0; i < 5; ++i) {
    par.push_back(timed(false));
    gat.push_back(timed(true));
  }
  const std::uint64_t writes = ((*engine)->stats().weights_file_writes - w0) / 6;
  std::vector<std::uint64_t> every(static_cast<std::size_t>(P));
  (void)comm.all_gather(&writes, every.data(), 2, DType::kF32).wait();
  if (rank == 0) {
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    for (std::size_t i = 0; i < par.size(); ++i) std::printf("parallel %.3f s  gather %.3f s\n", par[i], gat[i]);
    std::printf("%s %d ranks, gpt2 n_embd %lld n_layer %lld %s, %.1f MB file: parallel %.3f s, gather %.3f s, "
                "gather/parallel %.2f\n",
                mode.c_str(), P, static_cast<long long>(embd), static_cast<long long>(layers), dtype.c_str(),
                static_cast<double>(std::filesystem::file_size(path)) / 1e6, median(par), median(gat),
                median(gat) / median(par));
    for (int r = 0; r < P; ++r) std::printf("rank %d: %llu writes per save\n", r, static_cast<unsigned long long>(every[static_cast<std::size_t>(r)]));
    std::filesystem::remove(path);
  }
  return 0;
}
