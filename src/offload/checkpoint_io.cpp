// Checkpoints (docs/checkpoints.md): one process's files written by one rank, by a tensor group's
// first rank (save_checkpoint_tp) or by each pipeline stage's (save_checkpoint_pp); loading
// verifies every tensor before any state changes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>

#include "device/backends.hpp"
#include "model/evaluate.hpp"
#include "offload/engine_impl.hpp"
#include "offload/internal.hpp"
#include "offload/regions.hpp"
#include "optim/grad_norm_cuda.hpp"
#include "parallel/agreement.hpp"
#include "strata/checkpoint.hpp"
#include "strata/log.hpp"
#include "strata/pipeline_schedule.hpp"
#include "strata/safetensors.hpp"

namespace strata {

namespace {

// The safetensors dtype of the working parameters.
std::string working_tensor_dtype(DType d) {
  return d == DType::kBF16 ? "BF16" : d == DType::kF16 ? "F16" : "F32";
}

// fp16: the loss scaler's state rides in the checkpoint as one small F64 tensor, so a resumed
// run continues with the same scale, window position and hysteresis (and so the same bits).
constexpr const char* kScalerFile = "loss-scaler.safetensors";
constexpr const char* kScalerTensor =
    "loss_scaler";  // [scale, iteration, last overflow, hysteresis left, overflows]
constexpr std::int64_t kScalerFields = 5;

std::array<double, kScalerFields> scaler_fields(const LossScalerState& s) {
  return {s.scale, static_cast<double>(s.iteration), static_cast<double>(s.last_overflow_iteration),
          static_cast<double>(s.hysteresis_left), static_cast<double>(s.overflows)};
}

LossScalerState scaler_state(const std::array<double, kScalerFields>& f) {
  LossScalerState s;
  s.scale = f[0];
  s.iteration = static_cast<std::int64_t>(f[1]);
  s.last_overflow_iteration = static_cast<std::int64_t>(f[2]);
  s.hysteresis_left = static_cast<int>(f[3]);
  s.overflows = static_cast<std::int64_t>(f[4]);
  return s;
}

std::string module_file(int u) {
  char name[40];
  std::snprintf(name, sizeof name, "module-%04d.safetensors", u);
  return name;
}

// The first key whose value differs between two model configs, as "key: a vs b".
std::string config_difference(const std::string& saved, const std::string& current) {
  const auto a = nlohmann::json::parse(saved, nullptr, false);
  const auto b = nlohmann::json::parse(current, nullptr, false);
  if (a.is_discarded() || b.is_discarded() || !a.is_object() || !b.is_object()) return "unreadable config";
  for (auto it = b.begin(); it != b.end(); ++it) {
    if (!a.contains(it.key())) return it.key() + ": missing in the checkpoint";
    if (a[it.key()] != it.value())
      return it.key() + ": checkpoint " + a[it.key()].dump() + ", this run " + it.value().dump();
  }
  for (auto it = a.begin(); it != a.end(); ++it) {
    if (!b.contains(it.key())) return it.key() + ": only in the checkpoint";
  }
  return "";
}

}  // namespace

Result<std::string> offload_detail::StateAccess::save_checkpoint_tp(const std::string& root,
                                                                    const CheckpointManifest& manifest,
                                                                    int keep) {
  STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(config.model));
  struct State {
    std::vector<char> param;  // working dtype
    std::vector<float> master, m, v;
  };
  std::vector<State> state(full.params.size());
  Status read = [&]() -> Status {
    for (int u = 0; u < M; ++u) {
      for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
        const int index = owned[static_cast<std::size_t>(k)].index;
        State& st = state[static_cast<std::size_t>(index)];
        STRATA_ASSIGN_OR_RETURN(std::vector<float> working, read_full(index, 0));
        st.param.resize(working.size() * dtype_size(wdtype));
        STRATA_RETURN_IF_ERROR(convert(working.data(), DType::kF32, st.param.data(), wdtype, working.size()));
        STRATA_ASSIGN_OR_RETURN(st.master, read_full(index, 1));
        STRATA_ASSIGN_OR_RETURN(st.m, read_full(index, 2));
        STRATA_ASSIGN_OR_RETURN(st.v, read_full(index, 3));
      }
    }
    return ok_status();
  }();
  // read_full failed the same parameter on every rank of the tensor-parallel group; the other
  // data-parallel groups learn it here (each group's reads are collective only within it, but for
  // stage 3's, which fail together), so every rank returns the same error and none waits for the
  // outcome of a save that will not happen.
  if (dp_size > 1)
    read = parallel::agree_on_read(*comms.dp_caller, read, "its part of the checkpoint", "data-parallel");
  if (!read.ok()) return read.with_context("checkpoint under '" + root + "'");
  const bool writer = tp_rank == 0 && dp_rank == 0;
  const std::string working = wdtype == DType::kBF16 ? "BF16" : wdtype == DType::kF16 ? "F16" : "F32";
  Result<std::string> published = std::string();
  if (writer) {
    published = publish_checkpoint(
        root, manifest, keep, [&](const std::string& dir, std::vector<std::string>* names) {
          for (int u = 0; u < M; ++u) {
            const auto& mine = owned_of_unit[static_cast<std::size_t>(u)];
            if (mine.empty()) continue;
            SafetensorsWriter w;
            for (int k : mine) {
              const ParamDesc& p =
                  full.params[static_cast<std::size_t>(owned[static_cast<std::size_t>(k)].index)];
              const State& st = state[static_cast<std::size_t>(owned[static_cast<std::size_t>(k)].index)];
              STRATA_RETURN_IF_ERROR(
                  w.add("param/" + p.name, working, p.shape, st.param.data(), st.param.size()));
              STRATA_RETURN_IF_ERROR(
                  w.add("master/" + p.name, "F32", p.shape, st.master.data(), st.master.size() * 4));
              STRATA_RETURN_IF_ERROR(
                  w.add("exp_avg/" + p.name, "F32", p.shape, st.m.data(), st.m.size() * 4));
              STRATA_RETURN_IF_ERROR(
                  w.add("exp_avg_sq/" + p.name, "F32", p.shape, st.v.data(), st.v.size() * 4));
            }
            w.set_metadata("module", full.modules[static_cast<std::size_t>(u)].name);
            char name[40];
            std::snprintf(name, sizeof name, "module-%04d.safetensors", u);
            STRATA_RETURN_IF_ERROR(write_checkpoint_file(w, dir + "/" + name));
            names->push_back(name);
          }
          if (core.scaler)
            return failed_precondition("fp16 is not trained tensor-parallel");  // refused at create
          return ok_status();
        });
  }
  // The outcome, as 4-byte words: from the writer over its tensor-parallel group, then from each
  // data-parallel rank 0 (which now has it) over its data-parallel group.
  constexpr std::size_t kWords = 1 + 256;
  std::array<std::uint32_t, kWords> word{};
  if (writer && published.ok() && published->size() < 4 * (kWords - 1)) {
    word[0] = 1;
    std::memcpy(word.data() + 1, published->data(), published->size());
  }
  STRATA_RETURN_IF_ERROR(comms.tp_step->broadcast(word.data(), kWords, DType::kF32, 0).wait());
  if (dp_size > 1) {
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[0],
                                   comms.dp_caller->broadcast(word.data(), kWords, DType::kF32, 0),
                                   "checkpoint outcome", -1, 4 * kWords));
  }
  if (writer) return published;
  if (word[0] != 1) {
    return io_error("checkpoint under '" + root +
                    "': the first rank, which writes it, failed (its log says why)");
  }
  return std::string(reinterpret_cast<const char*>(word.data() + 1));
}

// One function on purpose: every rank walks the same sequence of collectives (gathers per unit,
// the directory's broadcast, the agreement, the outcome) whatever failed before, and keeping that
// sequence in one place is what makes it checkable.
//
// A checkpoint of a pipeline (docs/parallel.md "Saving and loading a pipeline"): the single
// process's files, each stage writing its own. The first stage's first rank (the writer) opens
// the checkpoint's temporary directory (publish_checkpoint) and broadcasts its path over its
// pipeline group, whose members are the stages' first ranks (the stage writers). Every stage then
// reads, in module order, the full state of the units it holds (collective over the stage's
// tensor- and data-parallel groups) and its first rank writes each unit's file (temporary name,
// fsync, rename) into that directory; the stage writers then agree (an all-gather over the
// pipeline group) that every stage's files are durable, or on the lowest failing stage's error.
// Only then does the writer checksum the files from disk and write the manifest, last; `latest`
// moves after that (publish_checkpoint), so a rank that dies mid-save leaves the previous
// checkpoint current (the writer's agreement fails, or the writer is gone and nothing is
// published). Every rank takes part in every collective even after a failure (no peer waits
// forever); the outcome is then broadcast to every rank.
Result<std::string> offload_detail::StateAccess::save_checkpoint_pp(const std::string& root,
                                                                    const CheckpointManifest& manifest,
                                                                    int keep) {
  STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(config.model));
  const bool stage_writer = tp_rank == 0 && dp_rank == 0;
  const bool writer = stage_writer && pp_rank == 0;
  const std::uint64_t wsize = dtype_size(wdtype);
  const std::string working = working_tensor_dtype(wdtype);
  // Per unit, its owning parameters in table order: the order one process writes them in.
  std::vector<std::vector<int>> params_of(static_cast<std::size_t>(M));
  for (std::size_t i = 0; i < full.params.size(); ++i) {
    if (full.params[i].owns_storage())
      params_of[static_cast<std::size_t>(full.params[i].module)].push_back(static_cast<int>(i));
  }
  // A unit is gathered as, per parameter, [working copy | master | exp_avg | exp_avg_sq] of the
  // full parameter.
  auto unit_bytes = [&](int u) {
    std::uint64_t b = 0;
    for (int i : params_of[static_cast<std::size_t>(u)])
      b += static_cast<std::uint64_t>(full.params[static_cast<std::size_t>(i)].numel()) * (wsize + 12);
    return b;
  };
  std::vector<char> buf, pbytes;
  std::vector<float> blob;
  auto gather = [&](int u) -> Status {
    buf.assign(unit_bytes(u), 0);
    char* out = buf.data();
    if (tp_size == 1) {  // this rank's layout is the full one: owned_of_unit is params_of's order
      STRATA_RETURN_IF_ERROR(read_unit_state(u, pbytes, blob));
      const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
      for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
        const OwnedParam& o = owned[static_cast<std::size_t>(k)];
        std::memcpy(out, pbytes.data() + o.param_in_unit, o.n * wsize);
        out += o.n * wsize;
        for (std::size_t kind = 0; kind < 3; ++kind) {
          std::memcpy(out, blob.data() + kind * n + o.grad_in_unit / 4, o.n * 4);
          out += o.n * 4;
        }
      }
    } else {
      for (int i : params_of[static_cast<std::size_t>(u)]) {
        STRATA_ASSIGN_OR_RETURN(std::vector<float> v, read_full(i, 0));
        STRATA_RETURN_IF_ERROR(convert(v.data(), DType::kF32, out, wdtype, v.size()));
        out += v.size() * wsize;
        for (int which = 1; which <= 3; ++which) {
          STRATA_ASSIGN_OR_RETURN(v, read_full(i, which));
          std::memcpy(out, v.data(), v.size() * 4);
          out += v.size() * 4;
        }
      }
    }
    if (out != buf.data() + buf.size()) return internal_error("pipeline checkpoint: unit size");
    return ok_status();
  };
  const std::string stage_name = "pipeline stage " + std::to_string(pp_rank);
  // Every rank: its stage's units in module order, each gathered over the stage's groups
  // (collective, so every unit even after a failure: no peer waits for a rank that stopped); the
  // stage's first rank writes each unit's file into `dir` (empty: the save already failed, only
  // the gathers run). The first rank of the first stage also writes the loss scaler's file.
  // Returns this rank's first failure, naming the stage.
  auto write_stage = [&](const std::string& dir) -> Status {
    Status first;
    for (int u = 0; u < M; ++u) {
      const auto& mine = params_of[static_cast<std::size_t>(u)];
      if (mine.empty() || core.holder(u) != pp_rank) continue;
      Status g = gather(u);
      if (!g.ok()) {
        if (first.ok()) {
          first = Status(g.code(), stage_name + " could not read module " + std::to_string(u) +
                                       "'s state: " + g.message());
        }
        continue;
      }
      if (!stage_writer || dir.empty() || !first.ok()) continue;
      SafetensorsWriter w;  // points into buf until written
      const char* in = buf.data();
      for (int i : mine) {
        const ParamDesc& p = full.params[static_cast<std::size_t>(i)];
        const auto n = static_cast<std::uint64_t>(p.numel());
        Status added = w.add("param/" + p.name, working, p.shape, in, n * wsize);
        in += n * wsize;
        for (const char* kind : {"master/", "exp_avg/", "exp_avg_sq/"}) {
          if (added.ok()) added = w.add(kind + p.name, "F32", p.shape, in, n * 4);
          in += n * 4;
        }
        if (!added.ok()) first = added;
      }
      w.set_metadata("module", full.modules[static_cast<std::size_t>(u)].name);
      if (first.ok()) first = write_checkpoint_file(w, dir + "/" + module_file(u));
      if (!first.ok())
        first = Status(first.code(), stage_name + " could not write its part: " + first.message());
    }
    if (writer && core.scaler && first.ok() && !dir.empty()) {  // every stage holds the same scaler state
      const std::array<double, kScalerFields> fields = scaler_fields(core.scaler->state());
      SafetensorsWriter w;
      first = w.add(kScalerTensor, "F64", {kScalerFields}, fields.data(), sizeof fields);
      if (first.ok()) first = write_checkpoint_file(w, dir + "/" + kScalerFile);
    }
    return first;
  };
  // Stage writers (the pp group of world rank 0): the writer's temporary directory, as 4-byte
  // words (1 and the path; 0: no directory, the save failed before its files).
  constexpr std::size_t kWords = 1 + 256;
  auto share_dir = [&](const std::string& dir) -> Result<std::string> {
    std::array<std::uint32_t, kWords> word{};
    if (writer && !dir.empty() && dir.size() < 4 * (kWords - 1)) {
      word[0] = 1;
      std::memcpy(word.data() + 1, dir.data(), dir.size());
    }
    STRATA_RETURN_IF_ERROR(comms.pp_caller->broadcast(word.data(), kWords, DType::kF32, 0)
                               .wait()
                               .with_context("checkpoint: sharing the temporary directory"));
    if (word[0] != 1) return std::string();
    return std::string(reinterpret_cast<const char*>(word.data() + 1));
  };
  // Stage writers: the agreement that every stage's files are durable (each file was fsync'd and
  // renamed into place before its writer got here), or the lowest failing stage's error on all.
  auto agree = [&](const Status& mine) {
    return parallel::agree_on_read(*comms.pp_caller, mine, "its part of the checkpoint", "pipeline stage",
                                   "write");
  };
  Status local;  // this rank's first failure in its part
  Result<std::string> published = std::string();
  if (writer) {
    bool shared = false;
    published = publish_checkpoint(
        root, manifest, keep, [&](const std::string& dir, std::vector<std::string>* names) {
          shared = true;
          Result<std::string> got = share_dir(dir);
          local = write_stage(got.ok() ? *got : std::string());
          Status all = agree(got.ok() ? local : got.status());
          if (got.ok() && got->empty()) {
            return invalid_argument("checkpoint: the temporary directory's path '" + dir +
                                    "' is longer than " + std::to_string(4 * (kWords - 1) - 1) + " bytes");
          }
          STRATA_RETURN_IF_ERROR(got.status());
          STRATA_RETURN_IF_ERROR(all);
          // The names one process lists, in its order: modules, then the scaler.
          for (int u = 0; u < M; ++u) {
            if (!params_of[static_cast<std::size_t>(u)].empty()) names->push_back(module_file(u));
          }
          if (core.scaler) names->push_back(kScalerFile);
          return ok_status();
        });
    if (!shared) {  // publishing failed before the files: the stages still meet in every collective
      Result<std::string> got = share_dir(std::string());
      local = write_stage(std::string());
      (void)agree(got.ok() ? local : got.status());
    }
  } else if (stage_writer) {
    Result<std::string> got = share_dir(std::string());
    local = write_stage(got.ok() ? *got : std::string());
    Status all = agree(got.ok() ? local : got.status());
    if (local.ok()) local = got.ok() ? ok_status() : got.status();
    (void)all;  // another stage's failure reaches this rank in the outcome below
  } else {
    local = write_stage(std::string());
  }
  // The outcome, as 4-byte words: 1 and the published directory, or 0, the status code and the
  // first bytes of the writer's error (so every rank returns the same error, naming the stage
  // that failed); from the writer over its tensor-parallel group, then over the first stage's
  // data-parallel groups, then from the first stage over every pipeline group.
  std::array<std::uint32_t, kWords> word{};
  if (writer && published.ok() && published->size() < 4 * (kWords - 1)) {
    word[0] = 1;
    std::memcpy(word.data() + 1, published->data(), published->size());
  } else if (writer && !published.ok()) {
    const std::string& m = published.status().message();
    word[1] = static_cast<std::uint32_t>(published.status().code());
    std::memcpy(word.data() + 2, m.data(), std::min<std::size_t>(m.size(), 4 * (kWords - 2) - 1));
  }
  Status b;
  if (tp_size > 1) b = comms.tp_step->broadcast(word.data(), kWords, DType::kF32, 0).wait();
  if (b.ok() && dp_size > 1) {
    b = dp_wait(dp_tracks[0], comms.dp_caller->broadcast(word.data(), kWords, DType::kF32, 0),
                "checkpoint outcome", -1, 4 * kWords);
  }
  if (b.ok()) b = comms.pp_caller->broadcast(word.data(), kWords, DType::kF32, 0).wait();
  if (writer) return published;
  STRATA_RETURN_IF_ERROR(b.with_context("checkpoint: broadcast of the outcome"));
  if (word[0] != 1) {
    const char* text = reinterpret_cast<const char*>(word.data() + 2);
    const std::string why(text, strnlen(text, 4 * (kWords - 2)));
    if (why.empty()) {
      STRATA_RETURN_IF_ERROR(local);
      return io_error(
          "checkpoint under '" + root +
          "': the first rank of the first pipeline stage, which publishes it, failed (its log says why)");
    }
    const auto code = word[1] == 0 || word[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(word[1]);
    return Status(code, why);
  }
  STRATA_RETURN_IF_ERROR(local);
  return std::string(reinterpret_cast<const char*>(word.data() + 1));
}

Status offload_detail::StateAccess::write_checkpoint_file(const SafetensorsWriter& w,
                                                          const std::string& path) {
  STRATA_RETURN_IF_ERROR(w.write(path));
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  if (!ec) checkpoint_bytes += bytes;
  return ok_status();
}

Result<std::string> OffloadEngine::save_checkpoint(const std::string& root, const std::string& client_state,
                                                   int keep) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.host.recover());
  STRATA_RETURN_IF_ERROR(t.wait_all_updates());
  CheckpointManifest manifest;
  manifest.step = t.now.steps;
  manifest.model_config = hf_config_json(t.config.model);
  manifest.placement = "parameters on " + std::string(to_string(t.settings.params)) +
                       ", optimizer state on " + std::string(to_string(t.settings.optimizer));
  manifest.client_state = client_state;
  const ModelLayout& L = t.layout();
  const std::string working = working_tensor_dtype(t.wdtype);
  const std::uint64_t wsize = dtype_size(t.wdtype);
  if (t.comms.pp_size > 1) return t.state.save_checkpoint_pp(root, manifest, keep);
  if (t.comms.tp_size > 1) return t.state.save_checkpoint_tp(root, manifest, keep);
  // Data parallel: rank 0 writes the checkpoint; sharded state is gathered unit by unit (every
  // rank takes part, in unit order, even after rank 0 failed to write), then rank 0 broadcasts
  // the outcome and the published directory.
  int gathered_through = 0;  // units whose state every rank has gathered
  std::vector<char> pbytes;
  std::vector<float> blob;
  auto gather_rest = [&]() {  // the collective part of read_unit_state, for the units not yet read
    for (; gathered_through < t.M; ++gathered_through) {
      if ((t.placement.sharding.host_state_sharded || t.placement.sharding.device_state_sharded) &&
          !t.owned_of_unit[static_cast<std::size_t>(gathered_through)].empty()) {
        (void)t.state.read_unit_state(gathered_through, pbytes, blob);
      }
    }
  };
  Result<std::string> published = std::string();
  if (t.comms.dp_rank == 0) {
    published = publish_checkpoint(
        root, manifest, keep, [&](const std::string& dir, std::vector<std::string>* names) {
          for (int u = 0; u < t.M; ++u) {
            gathered_through = u;
            const auto& mine = t.owned_of_unit[static_cast<std::size_t>(u)];
            if (mine.empty()) continue;
            Status read = t.state.read_unit_state(u, pbytes, blob);
            // Read or not, every rank has been through the unit's collectives: a failed read is
            // exchanged (agree_on_read) and fails the unit on every rank.
            gathered_through = u + 1;
            STRATA_RETURN_IF_ERROR(read);
            const std::size_t n = t.placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
            SafetensorsWriter w;
            for (int k : mine) {
              const OwnedParam& o = t.owned[static_cast<std::size_t>(k)];
              const ParamDesc& p = L.params[static_cast<std::size_t>(o.index)];
              const float* master = blob.data() + o.grad_in_unit / 4;
              STRATA_RETURN_IF_ERROR(
                  w.add("param/" + p.name, working, p.shape, pbytes.data() + o.param_in_unit, o.n * wsize));
              STRATA_RETURN_IF_ERROR(w.add("master/" + p.name, "F32", p.shape, master, o.n * 4));
              STRATA_RETURN_IF_ERROR(w.add("exp_avg/" + p.name, "F32", p.shape, master + n, o.n * 4));
              STRATA_RETURN_IF_ERROR(w.add("exp_avg_sq/" + p.name, "F32", p.shape, master + 2 * n, o.n * 4));
            }
            w.set_metadata("module", L.modules[static_cast<std::size_t>(u)].name);
            const std::string name = module_file(u);
            STRATA_RETURN_IF_ERROR(t.state.write_checkpoint_file(w, dir + "/" + name));
            names->push_back(name);
          }
          gathered_through = t.M;
          if (t.scaler) {
            const std::array<double, kScalerFields> fields = scaler_fields(t.scaler->state());
            SafetensorsWriter w;
            STRATA_RETURN_IF_ERROR(
                w.add(kScalerTensor, "F64", {kScalerFields}, fields.data(), sizeof fields));
            STRATA_RETURN_IF_ERROR(t.state.write_checkpoint_file(w, dir + "/" + kScalerFile));
            names->push_back(kScalerFile);
          }
          return ok_status();
        });
  }
  if (t.comms.dp_size == 1) return published;
  gather_rest();
  // The outcome, as 4-byte words from rank 0: 1 and the directory, or 0, the status code and the
  // first bytes of rank 0's error (so every rank returns the same error, e.g. the rank that could
  // not read its slice).
  constexpr std::size_t kWords = 1 + 256;
  std::array<std::uint32_t, kWords> word{};
  if (t.comms.dp_rank == 0 && published.ok() && published->size() < 4 * (kWords - 1)) {
    word[0] = 1;
    std::memcpy(word.data() + 1, published->data(), published->size());
  } else if (t.comms.dp_rank == 0 && !published.ok()) {
    const std::string& m = published.status().message();
    word[1] = static_cast<std::uint32_t>(published.status().code());
    std::memcpy(word.data() + 2, m.data(), std::min<std::size_t>(m.size(), 4 * (kWords - 2) - 1));
  }
  STRATA_RETURN_IF_ERROR(t.dp_wait(t.dp_tracks[0],
                                   t.comms.dp_caller->broadcast(word.data(), kWords, DType::kF32, 0),
                                   "checkpoint outcome", -1, 4 * kWords));
  if (t.comms.dp_rank == 0) return published;
  if (word[0] != 1) {
    const char* text = reinterpret_cast<const char*>(word.data() + 2);
    const std::string why(text, strnlen(text, 4 * (kWords - 2)));
    if (why.empty()) {
      return io_error("checkpoint under '" + root +
                      "': data-parallel rank 0, which writes it, failed (its log says why)");
    }
    const auto code = word[1] == 0 || word[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(word[1]);
    return Status(code, why);
  }
  return std::string(reinterpret_cast<const char*>(word.data() + 1));
}

Result<CheckpointManifest> OffloadEngine::load_checkpoint(const std::string& path) {
  Impl& t = *impl_;
  // Allowed after a failed step (the way to recover from one): the error stays until the
  // checkpoint is verified and loaded.
  STRATA_ASSIGN_OR_RETURN(std::string dir, resolve_checkpoint(path));
  STRATA_ASSIGN_OR_RETURN(CheckpointManifest manifest, read_checkpoint_manifest(dir, true));
  const std::string diff = config_difference(manifest.model_config, hf_config_json(t.config.model));
  if (!diff.empty()) {
    return failed_precondition("checkpoint '" + dir + "' is of another model (" + diff +
                               "); a checkpoint loads only into the model it was saved from");
  }
  // Every tensor located and checked before any state changes.
  std::vector<SafetensorsFile> files;
  files.reserve(manifest.files.size());
  std::map<std::string, std::size_t> where;
  for (const auto& f : manifest.files) {
    STRATA_ASSIGN_OR_RETURN(SafetensorsFile sf, SafetensorsFile::open(dir + "/" + f.name));
    files.push_back(std::move(sf));
    for (const auto& e : files.back().entries()) where[e.name] = files.size() - 1;
  }
  const ModelLayout& L = t.layout();
  const std::string working = working_tensor_dtype(t.wdtype);
  std::size_t expected = 0;
  for (const OwnedParam& o : t.owned) {
    const ParamDesc& p = L.params[static_cast<std::size_t>(o.index)];
    for (const char* kind : {"param/", "master/", "exp_avg/", "exp_avg_sq/"}) {
      const std::string name = kind + p.name;
      auto it = where.find(name);
      if (it == where.end()) return data_loss("checkpoint '" + dir + "' has no tensor '" + name + "'");
      const SafetensorsEntry* e = files[it->second].find(name);
      const std::string dtype = std::string(kind) == "param/" ? working : "F32";
      if (e->dtype != dtype || e->shape != p.shard.full_shape) {  // tensor parallel: the full parameter
        return data_loss("checkpoint file '" + files[it->second].path() + "': tensor '" + name + "' is " +
                         e->dtype + " of another shape or dtype than this model's " + dtype + " parameter");
      }
      ++expected;
    }
  }
  std::optional<LossScaler> scaler = t.scaler;
  if (scaler) {
    auto it = where.find(kScalerTensor);
    if (it == where.end()) {
      return data_loss("checkpoint '" + dir + "' has no tensor '" + kScalerTensor +
                       "' (the fp16 loss scaler's state, in " + kScalerFile + ")");
    }
    const SafetensorsEntry* e = files[it->second].find(kScalerTensor);
    if (e->dtype != "F64" || e->shape != std::vector<std::int64_t>{kScalerFields}) {
      return data_loss("checkpoint file '" + files[it->second].path() + "': tensor '" + kScalerTensor +
                       "' is " + e->dtype + " of another shape than F64 (" + std::to_string(kScalerFields) +
                       ")");
    }
    std::array<double, kScalerFields> fields{};
    STRATA_RETURN_IF_ERROR(files[it->second].read(kScalerTensor, fields.data(), sizeof fields));
    Status rs = scaler->restore(scaler_state(fields));
    if (!rs.ok()) return data_loss("checkpoint file '" + files[it->second].path() + "': " + rs.message());
    ++expected;
  }
  if (t.comms.pp_size > 1) {
    // A pipeline stage checked the tensors of its own parameters; the checkpoint holds the whole
    // model's (any pipeline shape, or one process, wrote the same files).
    STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(t.config.model));
    expected = scaler ? 1 : 0;
    for (const ParamDesc& p : full.params) expected += p.owns_storage() ? 4 : 0;
  }
  if (where.size() != expected) {
    return data_loss("checkpoint '" + dir + "' holds " + std::to_string(where.size()) +
                     " tensors; this model has " + std::to_string(expected));
  }
  t.ledger.drain();
  (void)t.abandon_pass(ok_status());
  {
    std::lock_guard<std::mutex> lock(t.ledger.mu);
    t.ledger.worker_error = ok_status();
    t.ledger.failed = offload_detail::FailedUpdate{};
  }
  t.homes.pending_publish = 0;  // the checkpoint's parameters replace the delayed update's
  t.homes.publish_before_rerun = false;
  std::fill(t.homes.next_fresh.begin(), t.homes.next_fresh.end(), 0);
  const std::uint64_t wsize = dtype_size(t.wdtype);
  std::vector<char> pbytes;
  std::vector<float> blob;
  for (int u = 0; u < t.M; ++u) {
    const std::size_t uu = static_cast<std::size_t>(u);
    const auto& mine = t.owned_of_unit[uu];
    if (mine.empty()) continue;
    const std::size_t n = t.placement.units[uu].grad_bytes / 4;
    pbytes.assign(t.placement.units[uu].param_bytes, 0);
    blob.assign(3 * n, 0.0f);
    for (int k : mine) {
      const OwnedParam& o = t.owned[static_cast<std::size_t>(k)];
      const std::string& pname = L.params[static_cast<std::size_t>(o.index)].name;
      float* master = blob.data() + o.grad_in_unit / 4;
      const ParamDesc& pd = L.params[static_cast<std::size_t>(o.index)];
      std::vector<char> full_bytes;
      std::vector<float> full_values, shard_values;
      auto read = [&](const std::string& name, void* dst, std::uint64_t bytes) -> Status {
        if (pd.shard.kind == ShardKind::kReplicated) return files[where[name]].read(name, dst, bytes);
        // Tensor parallel: the file holds the full parameter; keep this rank's shard of it (the
        // values pass through fp32 exactly, whatever the stored dtype).
        const bool param = name.rfind("param/", 0) == 0;
        const DType dt = param ? t.wdtype : DType::kF32;
        const auto full_n = static_cast<std::size_t>(pd.shard.full_numel());
        full_bytes.resize(full_n * dtype_size(dt));
        STRATA_RETURN_IF_ERROR(files[where[name]].read(name, full_bytes.data(), full_bytes.size()));
        full_values.resize(full_n);
        STRATA_RETURN_IF_ERROR(convert(full_bytes.data(), dt, full_values.data(), DType::kF32, full_n));
        shard_values.resize(o.n);
        shard_from_full(pd, full_values.data(), shard_values.data());
        if (bytes != o.n * dtype_size(dt))
          return internal_error("load_checkpoint: shard size of '" + name + "'");
        return convert(shard_values.data(), DType::kF32, dst, dt, o.n);
      };
      STRATA_RETURN_IF_ERROR(read("param/" + pname, pbytes.data() + o.param_in_unit, o.n * wsize));
      STRATA_RETURN_IF_ERROR(read("master/" + pname, master, o.n * 4));
      STRATA_RETURN_IF_ERROR(read("exp_avg/" + pname, master + n, o.n * 4));
      STRATA_RETURN_IF_ERROR(read("exp_avg_sq/" + pname, master + 2 * n, o.n * 4));
    }
    STRATA_RETURN_IF_ERROR(t.state.write_unit_state(u, pbytes, blob));
  }
  STRATA_RETURN_IF_ERROR(t.compute->synchronize());
  {
    std::lock_guard<std::mutex> lock(t.ledger.mu);
    t.now.steps = manifest.step;
    std::fill(t.ledger.updated_step.begin(), t.ledger.updated_step.end(), manifest.step);
    std::fill(t.ledger.stage_done.begin(), t.ledger.stage_done.end(), manifest.step);
    t.ledger.norm_step = manifest.step;
    // The worker is drained: the checkpoint's state holds no later step anywhere.
    std::fill(t.host.host_opt_step.begin(), t.host.host_opt_step.end(), manifest.step);
    for (auto& g : t.host.nvme.group_step) std::fill(g.begin(), g.end(), manifest.step);
    t.host.applied_step = manifest.step;
  }
  t.scaler = scaler;
  t.grad_norm = 0.0;
  return manifest;
}

}  // namespace strata
