// save_checkpoint with data parallelism alone: the ranks writing the module files in turn (the
// default, docs/checkpoints.md "Who writes a checkpoint") against rank 0 writing every file (the
// last rank told it does not see the directory: offload_detail::EngineFaults::hide_shared_files,
// the path taken without a shared file system), alternated in the same run on the same engine.
// Not part of the build; run it on the machine being measured, from the repository root after a
// build:
//
//   g++ -O2 -std=c++20 -Iinclude -Isrc -Ibuild/generated bench/checkpoint_save.cpp -Lbuild/lib -lstrata \
//       -Wl,-rpath,$PWD/build/lib -o /tmp/checkpoint_save
//   mpirun --oversubscribe -np 2 /tmp/checkpoint_save [stage] [n_embd] [n_layer] [dir]
//
// GPT-2 with a 50257-token vocabulary, fp32, parameters and optimizer state on the host, ZeRO
// `stage` (default 1). Prints each save's time (the slowest rank's, each after a barrier), the
// median of 5 of each and the ratio alone / split.
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
  std::fprintf(stderr, "checkpoint_save: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const int stage = argc > 1 ? std::atoi(argv[1]) : 1;
  const std::int64_t embd = argc > 2 ? std::atoll(argv[2]) : 768;
  const std::int64_t layers = argc > 3 ? std::atoll(argv[3]) : 2;
  const std::string dir = argc > 4 ? argv[4] : "/tmp";
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
  config.model.dtype = DType::kF32;
  config.micro_batch = 1;
  config.seq_len = 16;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.params = Tier::kHost;
  s.zero_stage = stage;
  s.persistence_threshold = 0;
  DeviceConfig dc;
  dc.kind = DeviceKind::kCpu;
  dc.memory_bytes = 2ull << 30;
  dc.pinned_bytes = 2ull << 30;
  dc.compute_threads = 1;
  auto device = Device::create(dc);
  if (!device.ok()) return fail(device.status());
  auto engine = OffloadEngine::create(config, s, **device, nullptr, &comm);
  if (!engine.ok()) return fail(engine.status());
  const std::string root = dir + "/strata-checkpoint-save-bench";
  auto timed = [&](bool alone) -> double {
    const bool hides = alone && rank == P - 1;
    if (hides) offload_detail::EngineFaults::hide_shared_files(**engine, true);
    (void)comm.barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    auto saved = (*engine)->save_checkpoint(root, "{}", 1);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (hides) offload_detail::EngineFaults::hide_shared_files(**engine, false);
    if (!saved.ok()) {
      fail(saved.status());
      std::exit(1);
    }
    std::vector<double> all(static_cast<std::size_t>(P));
    (void)comm.all_gather(&t, all.data(), 2, DType::kF32).wait();
    return *std::max_element(all.begin(), all.end());
  };
  std::vector<double> split, alone;
  timed(false);  // warm
  for (int i = 0; i < 5; ++i) {
    split.push_back(timed(false));
    alone.push_back(timed(true));
  }
  if (rank == 0) {
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    for (std::size_t i = 0; i < split.size(); ++i) std::printf("split %.3f s  alone %.3f s\n", split[i], alone[i]);
    std::printf("stage %d, %d ranks, gpt2 n_embd %lld n_layer %lld f32: split %.3f s, rank 0 alone %.3f s, "
                "alone/split %.2f\n",
                stage, P, static_cast<long long>(embd), static_cast<long long>(layers), median(split), median(alone),
                median(alone) / median(split));
    std::filesystem::remove_all(root);
  }
  return 0;
}
