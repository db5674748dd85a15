// The weights file (docs/checkpoints.md "Who writes the weights file"): every rank writing its
// part (StateAccess::save_weights_parallel), or the gather path, and loading.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <utility>

#include "device/backends.hpp"
#include "kernels/bf16.hpp"
#include "model/evaluate.hpp"
#include "offload/engine_impl.hpp"
#include "offload/internal.hpp"
#include "offload/regions.hpp"
#include "optim/grad_norm_cuda.hpp"
#include "parallel/agreement.hpp"
#include "strata/log.hpp"
#include "strata/pipeline_schedule.hpp"
#include "strata/safetensors.hpp"

namespace strata {

// Weights written by every rank into the one file (docs/checkpoints.md "Who writes the weights
// file"). The header is a function of the full layout (weights_header), so every rank knows where
// each of its elements goes without hearing from anyone:
//   1. the writer (tp 0, dp 0, stage 0) creates "<path>.tmp" with the header at its final size and
//      broadcasts whether it could (broadcast_from_writer);
//   2. every rank checks that it sees the file, agreed (agree_everywhere); where one does not, the
//      writer removes it and, without a pipeline, every rank returns false (the gather path);
//   3. every rank writes what it holds (write_weights_part): its tensor-parallel shard of each
//      parameter its stage holds (replicated ones: tp rank 0 only), a contiguous 1/dp of it on
//      each dp rank or, where stage 3 slices the unit, each dp rank its slice; no collective,
//      nothing gathered; then fsyncs;
//   4. the outcomes are agreed (agree_everywhere: every rank learns the same lowest failing rank's
//      error, which names it); the writer renames the file into place only when every rank's part
//      is durable, else removes it, so the final name never holds a partial file and a previous
//      file there keeps its bytes;
//   5. the outcome (success, or the writer's error: the code and the first bytes of its message)
//      is broadcast from the writer: every rank returns the same success or the same error.
Result<bool> offload_detail::StateAccess::save_weights_parallel(const std::string& path,
                                                                WeightFormat format) {
  const parallel::TimedWait wait_dp_caller = [this](CommWork w, const char* what, std::uint64_t bytes) {
    return dp_caller_wait(std::move(w), what, bytes);
  };
  STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(config.model));
  // The same on every rank (a function of the config): a failure here returns before any
  // collective, on every rank alike.
  auto header = weights_header(full, format, config.model.dtype);
  if (!header.ok()) return header.status().with_context("weights '" + path + "'");
  const bool writer = tp_rank == 0 && dp_rank == 0 && pp_rank == 0;
  // 1. The temporary file, then whether it exists.
  Status created;
  if (writer) created = SafetensorsPartWriter::create(path, *header);
  std::uint32_t have_file = created.ok() ? 1 : 0;
  Status mine = parallel::broadcast_from_writer(comms, &have_file, 1,
                                                "weights: whether the temporary file exists", wait_dp_caller);
  // 2. Whether every rank sees it: the ranks write into one file, so they must share a file
  // system at the path. Where one does not (node-local disks on several nodes), the writer removes
  // the file and, without a pipeline, every rank returns false for the gather path (the first
  // rank gathers the model and writes alone); a pipeline's stages must share it, so there it is
  // the error, naming the rank.
  if (mine.ok() && have_file == 1) {
    const std::string tmp = SafetensorsPartWriter::temp_path(path);
    Status sees;
    if (faults.hide_weights_file || !std::filesystem::exists(tmp)) {
      sees = failed_precondition(
          comms.rank_name() + " does not see '" + tmp +
          "', which the first rank created: the ranks do not share a file system at that path");
    }
    sees = parallel::agree_everywhere(comms, sees, "the weights file", "see");
    if (!sees.ok() && sees.code() == StatusCode::kFailedPrecondition && pp_size == 1) {
      if (writer) SafetensorsPartWriter::discard(path);
      return false;
    }
    mine = sees;
  }
  // 3. This rank's part.
  if (mine.ok() && have_file == 1) mine = write_weights_part(path, format, full, *header);
  // 4. Every rank's outcome agreed; the writer publishes or removes the file.
  const Status all = parallel::agree_everywhere(comms, mine, "its part of the weights", "write");
  Status written;  // the writer's outcome
  if (writer) {
    if (!created.ok()) {
      written = created.with_context("weights '" + path + "' not written");
    } else if (!all.ok()) {
      written = Status(
          all.code(),
          "weights '" + path + "' not written (a previous file at that path is unchanged): " + all.message());
    } else {
      written = SafetensorsPartWriter::publish(path).with_context("weights '" + path + "'");
    }
    if (!written.ok()) SafetensorsPartWriter::discard(path);
  }
  // 5. The outcome, as 4-byte words: 1, or 0, the status code and the first bytes of the
  // writer's error.
  constexpr std::size_t kWords = 1 + 256;
  std::array<std::uint32_t, kWords> word{};
  if (writer && written.ok()) {
    word[0] = 1;
  } else if (writer) {
    const std::string& m = written.message();
    word[1] = static_cast<std::uint32_t>(written.code());
    std::memcpy(word.data() + 2, m.data(), std::min<std::size_t>(m.size(), 4 * (kWords - 2) - 1));
  }
  Status b = parallel::broadcast_from_writer(comms, word.data(), kWords, "weights outcome", wait_dp_caller);
  if (writer) {
    STRATA_RETURN_IF_ERROR(written);
    return true;
  }
  if (!b.ok()) {
    if (!all.ok()) return all.with_context("weights '" + path + "' not written");
    return b.with_context("weights '" + path + "': broadcast of the outcome");
  }
  if (word[0] != 1) {
    const char* text = reinterpret_cast<const char*>(word.data() + 2);
    const std::string why(text, strnlen(text, 4 * (kWords - 2)));
    const auto code = word[1] == 0 || word[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(word[1]);
    return Status(code, why);
  }
  return true;
}

// Which ranks write a parameter's elements: the stage holding it (the lowest: GPT-2's tied
// embedding is the first stage's); of its tensor-parallel shards each its own, a replicated
// parameter tp rank 0 alone; of the data-parallel replicas each dp rank a contiguous 1/dp of the
// shard's elements (rank r: [n r / dp, n (r + 1) / dp)), or under stage 3 each rank the elements
// of its slice of the unit. The union is every element once. A shard's elements map
// onto the file by encode_weights_part: one pwrite per run of adjacent file bytes.
Status offload_detail::StateAccess::write_weights_part(const std::string& path, WeightFormat format,
                                                       const ModelLayout& full,
                                                       const SafetensorsHeader& header) {
  const std::string who = comms.rank_name();
  SafetensorsPartWriter::WriteFault fault;
  if (faults.io != nullptr) {
    fault = [f = faults.io](const std::string& file, std::uint64_t offset, std::uint64_t nbytes) {
      return f->error_for(IoOp::kWrite, file, offset, nbytes);
    };
  }
  auto part = SafetensorsPartWriter::open(path, header, std::move(fault));
  auto cannot_write = [&](const Status& s) {
    return Status(s.code(), who + " could not write its tensors: " + s.message());
  };
  if (!part.ok()) return cannot_write(part.status());
  if (placement.sharding.device_params_sliced)
    STRATA_RETURN_IF_ERROR(compute->synchronize());  // slices are read in place
  const std::uint64_t w = half ? 2 : 4;
  int unit = -1;
  std::vector<char> bytes;  // unit `unit`: its working parameters, or this rank's slice (stage 3)
  std::vector<float> values;
  std::vector<EncodedRange> ranges;
  Status s;
  for (std::size_t i = 0; i < full.params.size() && s.ok(); ++i) {
    if (!full.params[i].owns_storage() || core.holder(full.params[i].module) != pp_rank) continue;
    const ParamDesc& p = layout().params[i];  // this rank's shard
    if (p.shard.kind == ShardKind::kReplicated && tp_rank != 0) continue;
    const int k = owned_index(static_cast<int>(i));
    if (k < 0) return internal_error(who + " holds no parameter '" + p.name + "'");
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    const std::size_t uu = static_cast<std::size_t>(o.unit);
    const bool sliced = placement.units[uu].gathered_at_fetch;
    // This rank's elements [a, b) of the shard: of a replica, its contiguous 1/dp; under stage 3,
    // those its slice of the unit holds (below, once the slice is read).
    std::uint64_t a = 0, b = o.n;
    if (!sliced) {
      a = o.n * static_cast<std::uint64_t>(dp_rank) / static_cast<std::uint64_t>(dp_size);
      b = o.n * static_cast<std::uint64_t>(dp_rank + 1) / static_cast<std::uint64_t>(dp_size);
      if (a == b) continue;
    }
    if (o.unit != unit) {
      unit = o.unit;
      Status read;
      if (sliced) {
        bytes.resize(placement.units[uu].slice.len * w);
        read = homes_.read_param_slice(unit, bytes.data());
      } else {
        read = homes_.read_unit_params(unit, bytes);
      }
      if (!read.ok()) {
        const std::string what = sliced        ? "its slice of module '" + layout().modules[uu].name + "'"
                                 : tp_size > 1 ? "its shard of '" + p.name + "'"
                                               : "'" + p.name + "'";
        return Status(read.code(), who + " could not read " + what + ": " + read.message());
      }
    }
    const char* src = nullptr;  // element a of the shard
    if (sliced) {               // the slice holds the unit's elements [begin, begin + len) (its fp32 order)
      const std::uint64_t first = o.grad_in_unit / 4, begin = placement.units[uu].slice.begin,
                          end = begin + placement.units[uu].slice.len;
      a = std::max(first, begin) - first;
      b = std::min(first + o.n, end);
      if (b <= first + a) continue;
      b -= first;
      src = bytes.data() + (first + a - begin) * w;
    } else {
      src = bytes.data() + o.param_in_unit + a * w;
    }
    values.resize(b - a);
    STRATA_RETURN_IF_ERROR(convert(src, wdtype, values.data(), DType::kF32, b - a));
    const std::vector<ElementRun> runs =
        shard_runs(p, static_cast<std::int64_t>(a), static_cast<std::int64_t>(b));
    s = encode_weights_part(full, header, static_cast<int>(i), format, config.model.dtype, runs, values,
                            ranges);
    for (std::size_t r = 0; s.ok() && r < ranges.size(); ++r) {
      s = part->write_range(ranges[r].tensor, ranges[r].offset, ranges[r].bytes.data(),
                            ranges[r].bytes.size());
      if (faults.kill_after_weights_writes != 0 && part->writes() >= faults.kill_after_weights_writes)
        std::raise(SIGKILL);
    }
  }
  Status closed = part->close();
  weights_writes += part->writes();
  if (s.ok()) s = closed;
  return s.ok() ? s : cannot_write(s);
}

Status OffloadEngine::save_weights(const std::string& path, WeightFormat format) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.wait_all_updates());
  // Every rank writes its part, unless a test asked for the earlier path (the first rank
  // gathers everything and writes alone; EngineFaults::gather_weights_on_save, the reference of
  // the tests and of bench/weights_save.cpp).
  const bool gathered = t.faults.gather_weights_on_save && t.comms.pp_size == 1;
  if (!gathered && (t.comms.pp_size > 1 || t.comms.tp_size > 1 || t.comms.dp_size > 1)) {
    STRATA_ASSIGN_OR_RETURN(const bool written, t.state.save_weights_parallel(path, format));
    if (written) return ok_status();
    // Not every rank sees the file system at the path: the gather path below.
  }
  if (t.comms.tp_size > 1) {
    // Collective: every rank gathers every owning parameter in table order (over the tensor- and,
    // stage 3, the data-parallel group), then the first rank of both writes the full model, the
    // same file as one process saves.
    // A rank that cannot read a parameter takes part in read_full's exchange, so its group fails
    // that parameter together; the other data-parallel groups learn it in the exchange after the
    // reads: every rank returns the same error, none waits for a peer's gather until the timeout.
    STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(t.config.model));
    std::vector<std::vector<float>> values(full.params.size());
    Status read = [&]() -> Status {
      for (std::size_t i = 0; i < full.params.size(); ++i) {
        if (!full.params[i].owns_storage()) continue;
        STRATA_ASSIGN_OR_RETURN(values[i], t.state.read_full(static_cast<int>(i), 0));
      }
      return ok_status();
    }();
    if (t.comms.dp_size > 1)
      read = parallel::agree_on_read(*t.comms.dp_caller, read, "its part of the weights", "data-parallel");
    if (!read.ok()) return read.with_context("save_weights '" + path + "'");
    if (t.comms.tp_rank != 0 || t.comms.dp_rank != 0) return ok_status();
    return write_weights(full, path, format, t.config.model.dtype, [&](int index, std::vector<float>& out) {
      out = std::move(values[static_cast<std::size_t>(index)]);
      return ok_status();
    });
  }
  if (t.comms.dp_size == 1) {
    return write_weights(t.layout(), path, format, t.config.model.dtype,
                         [&](int index, std::vector<float>& values) {
                           STRATA_ASSIGN_OR_RETURN(values, t.state.read_state(index, 0));
                           return ok_status();
                         });
  }
  // Data parallel: collective, rank 0 writes. Sharded parameters (stage 3) are gathered unit by
  // unit on every rank first (the whole model's working parameters, as DeepSpeed's
  // stage3_gather_16bit_weights_on_model_save does).
  // A rank that cannot read its slice still joins the unit's exchange (read_unit_params), so every
  // rank returns the same error at that unit.
  std::vector<std::vector<char>> units(static_cast<std::size_t>(t.M));
  for (int u = 0; u < t.M; ++u) {
    if (t.placement.units[static_cast<std::size_t>(u)].gathered_at_fetch) {
      STRATA_RETURN_IF_ERROR(t.homes.read_unit_params(u, units[static_cast<std::size_t>(u)])
                                 .with_context("save_weights '" + path + "'"));
    }
  }
  if (t.comms.dp_rank != 0) return ok_status();
  return write_weights(
      t.layout(), path, format, t.config.model.dtype, [&](int index, std::vector<float>& values) {
        const int k = t.owned_index(index);
        if (k < 0) return invalid_argument("save_weights: no parameter with index " + std::to_string(index));
        const OwnedParam& o = t.owned[static_cast<std::size_t>(k)];
        if (!t.placement.units[static_cast<std::size_t>(o.unit)].gathered_at_fetch) {
          STRATA_ASSIGN_OR_RETURN(values, t.state.read_state(index, 0));
          return ok_status();
        }
        const char* p = units[static_cast<std::size_t>(o.unit)].data() + o.param_in_unit;
        values.resize(o.n);
        if (t.half) {
          const auto* in = reinterpret_cast<const std::uint16_t*>(p);
          const bool f16 = t.wdtype == DType::kF16;
          for (std::size_t i = 0; i < o.n; ++i)
            values[i] = f16 ? kernels::f16_bits_to_f32(in[i]) : kernels::bf16_bits_to_f32(in[i]);
        } else {
          std::memcpy(values.data(), p, o.n * 4);
        }
        return ok_status();
      });
}

Status OffloadEngine::load_weights(const std::string& path) {
  Impl& t = *impl_;
  // A pipeline stage keeps the parameters it holds (both ends of the tied embedding read it).
  auto here = [&t](int index) { return t.comms.pp_size == 1 || t.owned_index(index) >= 0; };
  if (t.comms.tp_size > 1) {
    // Every rank reads the full file and keeps its shard of each parameter.
    STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(t.config.model));
    return read_weights(full, path, [&](int index, std::span<const float> values) {
      return here(index) ? t.state.write_full(index, values) : ok_status();
    });
  }
  return read_weights(t.layout(), path, [&](int index, std::span<const float> values) {
    return here(index) ? t.state.write_values(index, values, true) : ok_status();
  });
}

}  // namespace strata
