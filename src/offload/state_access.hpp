// State access (docs/checkpoints.md): a unit's whole state — working parameters and
// [master | m | v] in the fp32 layout — read and written wherever the placement keeps it, for
// initialisation, set_param and the getters, the weights file and checkpoints. Not on the hot
// path: every entry point first settles the engine (settle: every update done and published, the
// streams idle) and then talks to the homes and optimizers directly.
//
// With several processes the reads are collective: a stage-3 unit and sharded state are gathered
// on the caller's Comms, and where a read can fail on one rank alone (state_reads_can_fail) the
// ranks first agree on it (parallel::agree_on_read), so every rank returns the same error at once.
// The weights file is written by every rank (save_weights_parallel); checkpoints by the first
// rank of each stage (save_checkpoint_pp) or of the tensor group (save_checkpoint_tp).
//
// Threads: the caller only, with the optimizer thread drained or idle.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "offload/device_optimizer.hpp"
#include "offload/engine_core.hpp"
#include "offload/fetcher.hpp"
#include "offload/host_optimizer.hpp"
#include "offload/param_homes.hpp"
#include "strata/checkpoint.hpp"
#include "strata/safetensors.hpp"

namespace strata::offload_detail {

class StateAccess : public EnginePart {
 public:
  StateAccess(EngineCore& core, ParamHomes& homes, Fetcher& fetcher, HostOptimizer& host,
              DeviceOptimizer& devopt)
      : EnginePart(core), homes_(homes), fetcher_(fetcher), host_(host), devopt_(devopt) {}

  // What the engine does before state access (wait_all_updates); set by the engine.
  std::function<Status()> settle_;
  // Bytes of checkpoint files this rank wrote (write_checkpoint_file) and writes it issued into
  // weights files (save_weights_parallel): OffloadStats. Caller thread.
  std::uint64_t checkpoint_bytes = 0;
  std::uint64_t weights_writes = 0;

  // Every unit's parameters from config.seed, its master from them, its moments zero.
  Status initialize();
  // [master | m | v], host/nvme tiers. `before`: the outcome of this rank's reads so far for the
  // unit (its parameters): sharded, the ranks exchange it with their own reads' before the gather
  // (every tier), so a failure anywhere fails the unit on every rank instead of stalling the gather.
  Status read_unit_optim(int u, std::vector<float>& blob, const Status& before = Status());
  Status write_unit_optim(int u, const std::vector<float>& blob);
  Status write_values(int index, std::span<const float> values, bool master_too);
  Result<std::vector<float>> read_state(int index, int which);  // 0 working, 1 master, 2 m, 3 v
  // A unit's working parameters and [master | m | v] (fp32 layout) for every placement.
  Status read_unit_state(int u, std::vector<char>& pbytes, std::vector<float>& blob);
  Status write_unit_state(int u, const std::vector<char>& pbytes, const std::vector<float>& blob);
  // State `which` (read_state) of the full parameter: with tensor parallelism this rank's shard
  // gathered over the group (collective).
  Result<std::vector<float>> read_full(int index, int which);
  Status write_full(int index, std::span<const float> values);

  // Every rank writes the part of the weights file it holds (docs/checkpoints.md "Who writes the
  // weights file"); collective over every group. True once written; false when not every rank
  // sees the file the first rank created (no file system shared at the path) and there is no
  // pipeline: the caller takes the gather path.
  Result<bool> save_weights_parallel(const std::string& path, WeightFormat format);
  // Collective over the tensor and data-parallel groups: every rank gathers every full
  // parameter's state, then the first rank of both writes the single-process checkpoint; the
  // outcome is broadcast back.
  Result<std::string> save_checkpoint_tp(const std::string& root, const CheckpointManifest& manifest,
                                         int keep);
  // A pipeline's checkpoint: each stage's first rank writes its units' files (checkpoint_io.cpp).
  Result<std::string> save_checkpoint_pp(const std::string& root, const CheckpointManifest& manifest,
                                         int keep);
  // A checkpoint file written (SafetensorsWriter::write: temporary name, fsync, rename) and its
  // bytes added to checkpoint_bytes.
  Status write_checkpoint_file(const SafetensorsWriter& w, const std::string& path);

 private:
  // Step 3 of save_weights_parallel: this rank's elements of the parameters it writes, encoded and
  // pwritten into the temporary file, fsync'd. Errors start with rank_name().
  Status write_weights_part(const std::string& path, WeightFormat format, const ModelLayout& full,
                            const SafetensorsHeader& header);
  // The parameters written where they live, after any fetched copy of them is forgotten.
  Status write_unit_params(int u, const std::vector<char>& bytes) {
    if (bytes.empty()) return ok_status();
    // An early fetch of the unit (prefetch_next_step) holds the version this replaces. The caller
    // waited for every update and the h2d stream (wait_all_updates) or dropped the pass.
    STRATA_RETURN_IF_ERROR(fetcher_.forget_fetched(u));
    return homes_.write_unit_params(u, bytes);
  }
  // Collective over the caller's data-parallel Comm: every rank's slice of unit u's
  // [master | m | v] (`mine`, 3 x chunk) all-gathered into `all` and laid out in `blob` (the
  // unit's [master | m | v]; the master left as it is unless `with_master`).
  Status gather_state_slices(int u, const std::vector<float>& mine, std::vector<float>& all,
                             std::vector<float>& blob, bool with_master);
  // The data-parallel leg of a broadcast over the caller's Comm, timed.
  Status dp_caller_wait(CommWork w, const char* what, std::uint64_t bytes) {
    return dp_wait(dp_tracks[0], std::move(w), what, -1, bytes);
  }

  ParamHomes& homes_;
  Fetcher& fetcher_;
  HostOptimizer& host_;
  DeviceOptimizer& devopt_;
};

}  // namespace strata::offload_detail
