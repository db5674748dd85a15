// strata estimate [flags]: bytes per tier (device, host, pinned host, NVMe) for parameters,
// gradients, optimizer state and activations under every offload placement and ZeRO stage, and
// which placements fit the given budgets. Every number is the engine's own plan
// (estimate_placements calls OffloadPlan::make), so what this prints is what strata train
// allocates. Exit 0 printed, 1 a config that does not load, 2 bad flags.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli.hpp"
#include "model_flags.hpp"
#include "settings.hpp"
#include "strata/config.hpp"
#include "strata/offload.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr FlagSpec kEstimateFlags[] = {
    {"device-memory", "BYTES", "device budget (e.g. 80GiB); placements above it are marked"},
    {"host-memory", "BYTES", "host budget, pinned included"},
    {"nvme-free", "BYTES", "free space of the NVMe directories (swap reserve included)"},
    {"vocab-size", "N",
     "vocabulary size (default 256: the byte tokenizer strata train uses without --vocab)"},
    {"ranks", "N",
     "data-parallel ranks (default 1): bytes per rank, each ZeRO stage sharding what it shards "
     "(docs/parallel.md)"},
    {"link-bandwidth", "GB/s",
     "with --ranks N: the ranks' link as bus bandwidth (strata bench comm's busbw; default 12.5, a 100 Gb/s "
     "port), for the data-parallel bytes and seconds per step"},
    {"link-latency-us", "US", "with --ranks N: fixed cost of one collective in microseconds (default 20)"},
    {"json", "", "print JSON"},
    {"help", "", "show this help"},
};

std::vector<FlagSpec> all_flags() {
  std::vector<FlagSpec> f(std::begin(kEstimateFlags), std::end(kEstimateFlags));
  for (const FlagSpec& flag : kSettingsFlags) {
    // Only what changes the bytes: the model, batch, sequence and the config's offload tuning.
    if (flag.name == "config" || flag.name == "strict" || flag.name == "batch" || flag.name == "seq-len" ||
        flag.name == "grad-accum")
      f.push_back(flag);
  }
  f.insert(f.end(), std::begin(kModelFlags), std::end(kModelFlags));
  return f;
}

std::string estimate_usage() {
  return "usage: strata estimate [flags]\n\n"
         "Bytes per tier for parameters, gradients, optimizer state and activations under every\n"
         "placement (offload_param x offload_optimizer: device | host | nvme) and ZeRO stage, from the\n"
         "engine's own memory plan, and whether each fits the budgets. With one process (the default)\n"
         "every stage of a placement needs the same bytes and the stage column lists the stages\n"
         "DeepSpeed allows; with --ranks N the bytes are per rank, each stage sharding over the N ranks\n"
         "what it shards (combinations the engine refuses are left out). A config's\n"
         "strata.tensor_parallel_size and pipeline_parallel_size (with pipeline_virtual_stages,\n"
         "sequence_parallel) make the bytes one rank's: its tensor-parallel shard of its pipeline\n"
         "stage, each placement shown at its largest stage; --ranks counts the data-parallel ranks\n"
         "beside them.\n\nflags:\n" +
         format_flags(all_flags());
}

std::string tier_name(Tier t) { return std::string(to_string(t)); }

Json tier_json(const TierBytes& t) {
  return Json{{"device", t.device}, {"host", t.host}, {"pinned", t.pinned}, {"nvme", t.nvme}};
}

std::string budget_text(std::uint64_t b) { return b == 0 ? "no limit" : format_bytes(b); }

int run_estimate(std::span<const std::string> argv) {
  const auto flags = all_flags();
  auto parsed = Args::parse(argv, flags);
  if (!parsed.ok()) return usage_error("estimate", parsed.status().message(), estimate_usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(estimate_usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("estimate", "unexpected argument '" + args.positionals()[0] + "'", estimate_usage());
  }
  RunSettings rs;
  if (Status s = load_settings(args, args.get("config").value_or(""), &rs); !s.ok()) {
    std::fprintf(stderr, "strata estimate: %s\n", s.message().c_str());
    return kExitFailure;
  }
  if (Status s = apply_settings_flags(args, &rs); !s.ok()) {
    return usage_error("estimate", s.message(), estimate_usage());
  }
  if (Status v = int_flag(args, "vocab-size", 1, 1 << 24, &rs.trainer.model.vocab_size); !v.ok()) {
    return usage_error("estimate", v.message(), estimate_usage());
  }
  EstimateBudgets budgets;
  constexpr std::uint64_t kMax = ~0ull;
  auto device = args.get_bytes("device-memory", 0, 1, kMax);
  auto host = args.get_bytes("host-memory", 0, 1, kMax);
  auto nvme = args.get_bytes("nvme-free", 0, 1, kMax);
  for (const auto* r : {&device, &host, &nvme}) {
    if (!r->ok()) return usage_error("estimate", r->status().message(), estimate_usage());
  }
  budgets = {*device, *host, *nvme};
  std::int64_t ranks = 1;
  if (Status r = int_flag(args, "ranks", 1, 1 << 20, &ranks); !r.ok()) {
    return usage_error("estimate", r.message(), estimate_usage());
  }
  rs.offload.dp_size = static_cast<int>(ranks);
  // The config's tensor and pipeline parallel layout: the bytes are one rank's (its tensor-parallel
  // shard of its pipeline stage's modules), --ranks the data-parallel ranks beside them.
  int pp = 1;
  if (Status g = apply_model_parallel(&rs, &pp); !g.ok()) {
    std::fprintf(stderr, "strata estimate: %s\n", g.message().c_str());
    return kExitFailure;
  }
  const int tp = rs.offload.tp_size;
  const bool model_parallel = tp > 1 || pp > 1;
  auto link = args.get_double("link-bandwidth", kDefaultDpBusBytesPerSecond / 1e9, 1e-6, 1e6);
  auto latency = args.get_double("link-latency-us", kDefaultDpCollectiveSeconds * 1e6, 0.0, 1e7);
  for (const auto* r : {&link, &latency}) {
    if (!r->ok()) return usage_error("estimate", r->status().message(), estimate_usage());
  }
  const double bus = *link * 1e9, per_collective = *latency * 1e-6;
  const bool cuda = args.get("device").value_or("") == "cuda";
  // With a pipeline every stage is planned (each places only its modules' state); a placement's
  // row is its largest stage's (the most device memory), and it fits only where every stage does.
  std::vector<std::vector<PlacementEstimate>> stage_rows;
  for (int st = 0; st < pp; ++st) {
    OffloadSettings stage = rs.offload;
    stage.pp_stage = st;
    auto r = estimate_placements(rs.trainer, stage, budgets, cuda);
    if (!r.ok()) {
      Status e = pp > 1 ? r.status().with_context("pipeline stage " + std::to_string(st)) : r.status();
      std::fprintf(stderr, "strata estimate: %s\n", e.message().c_str());
      return kExitFailure;
    }
    // Every stage takes the same placements (the refusals are the layout's, not a stage's).
    bool same = st == 0 || r->size() == stage_rows[0].size();
    for (std::size_t i = 0; same && st > 0 && i < r->size(); ++i) {
      const PlacementEstimate &a = (*r)[i], &b = stage_rows[0][i];
      same = a.zero_stage == b.zero_stage && a.params == b.params && a.optimizer == b.optimizer;
    }
    if (!same) {
      std::fprintf(stderr, "strata estimate: pipeline stage %d takes other placements than stage 0\n", st);
      return kExitFailure;
    }
    stage_rows.push_back(std::move(*r));
  }
  std::vector<PlacementEstimate> rows = stage_rows[0];
  std::vector<int> worst_stage(rows.size(), 0);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    for (int st = 1; st < pp; ++st) {
      if (fold_stage_estimate(rows[i], stage_rows[static_cast<std::size_t>(st)][i])) worst_stage[i] = st;
    }
  }
  const TrainerConfig& tc = rs.trainer;
  // The data-parallel collectives of each row's step (per rank; docs/performance.md's per-stage
  // bytes), and their time at the link if nothing overlapped them. With tensor parallelism the
  // rank's shard's; with a pipeline the shown stage's (dist.cost_grid checks both against the
  // engine's count).
  std::vector<DpTraffic> traffic;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const PlacementEstimate& e = rows[i];
    OffloadSettings s = rs.offload;
    s.pp_stage = worst_stage[i];
    s.params = e.params;
    s.optimizer = e.optimizer;
    s.zero_stage = e.zero_stage;
    if (s.optimizer != Tier::kNvme) s.gradients = Tier::kHost;  // gradients on NVMe need the NVMe optimizer
    if ((s.params == Tier::kNvme || s.optimizer == Tier::kNvme) && s.nvme_path.empty()) {
      s.nvme_path = {"nvme"};  // a name only, as estimate_placement: nothing touches the disk
      s.io.nvme_path = s.nvme_path;
    }
    // The row's settings as estimate_placement planned them (a split or a delayed update only
    // where the placement takes it).
    auto t = dp_traffic(tc, placement_settings(s), cuda);
    if (!t.ok()) {
      std::fprintf(stderr, "strata estimate: %s\n", t.status().message().c_str());
      return kExitFailure;
    }
    traffic.push_back(*t);
  }

  if (args.has("json")) {
    Json out;
    out["world_size"] = ranks * tp * pp;
    out["data_parallel_size"] = ranks;
    out["tensor_parallel_size"] = tp;
    out["pipeline_parallel_size"] = pp;
    out["note"] = model_parallel ? "bytes per rank: its tensor-parallel shard of its pipeline stage (each "
                                   "placement's largest stage, whose data-parallel collectives are shown)"
                  : ranks == 1   ? "one process: every stage of a placement has the same bytes"
                                 : "bytes per data-parallel rank";
    out["model"] = Json::parse(model_config_to_json(tc.model));
    out["micro_batch"] = tc.micro_batch;
    out["seq_len"] = tc.seq_len;
    out["budgets"] = {{"device", budgets.device}, {"host", budgets.host}, {"nvme", budgets.nvme}};
    out["link"] = {{"bus_bytes_per_s", bus}, {"collective_s", per_collective}};
    Json list = Json::array();
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const PlacementEstimate& e = rows[i];
      Json j;
      j["zero_stage"] = e.zero_stage;
      j["offload_param"] = tier_name(e.params);
      j["offload_optimizer"] = tier_name(e.optimizer);
      Json kinds;
      for (int k = 0; k < kStateKinds; ++k) {
        kinds[std::string(to_string(static_cast<StateKind>(k)))] =
            tier_json(e.by_kind[static_cast<std::size_t>(k)]);
      }
      j["bytes"] = std::move(kinds);
      j["total"] = {{"device", e.plan.device_bytes},
                    {"host", e.plan.host_bytes},
                    {"pinned", e.plan.pinned_bytes},
                    {"nvme", e.plan.nvme_bytes}};
      j["device_need"] = e.device_need;
      j["nvme_need"] = e.nvme_need;
      j["fits"] = {
          {"device", e.fits_device}, {"host", e.fits_host}, {"nvme", e.fits_nvme}, {"all", e.fits()}};
      if (pp > 1) {
        j["pipeline_stage"] = worst_stage[i];
        Json stages = Json::array();
        for (int st = 0; st < pp; ++st) {
          const PlacementEstimate& e2 = stage_rows[static_cast<std::size_t>(st)][i];
          stages.push_back({{"device", e2.plan.device_bytes},
                            {"host", e2.plan.host_bytes},
                            {"pinned", e2.plan.pinned_bytes},
                            {"nvme", e2.plan.nvme_bytes},
                            {"device_need", e2.device_need},
                            {"fits", e2.fits()}});
        }
        j["pipeline_stages"] = std::move(stages);
      }
      const DpTraffic& t = traffic[i];
      j["data_parallel"] = {{"stage_run", t.stage},
                            {"all_reduce_bytes", t.all_reduce_bytes},
                            {"reduce_scatter_bytes", t.reduce_scatter_bytes},
                            {"all_gather_bytes", t.all_gather_bytes},
                            {"buffer_bytes", t.buffer_bytes()},
                            {"wire_bytes", t.wire_bytes()},
                            {"collectives", t.collectives},
                            {"seconds", t.seconds(bus, per_collective)},
                            {"overlapped", t.overlapped}};
      list.push_back(std::move(j));
    }
    out["placements"] = std::move(list);
    std::printf("%s\n", out.dump(2).c_str());
    return kExitOk;
  }

  std::printf("model    %s: %lld layers, width %lld, %lld heads, context %lld, vocab %lld, %s%s\n",
              std::string(to_string(tc.model.kind)).c_str(), static_cast<long long>(tc.model.n_layer),
              static_cast<long long>(tc.model.n_embd), static_cast<long long>(tc.model.n_head),
              static_cast<long long>(tc.model.n_positions), static_cast<long long>(tc.model.vocab_size),
              std::string(to_string(tc.model.dtype)).c_str(),
              tc.model.activation_checkpointing ? ", activation checkpointing" : "");
  std::printf("batch    micro batch %lld x sequence %lld\n", static_cast<long long>(tc.micro_batch),
              static_cast<long long>(tc.seq_len));
  std::printf("budgets  device %s, host %s, nvme %s\n", budget_text(budgets.device).c_str(),
              budget_text(budgets.host).c_str(), budget_text(budgets.nvme).c_str());
  if (model_parallel) {
    std::printf("grid     tensor parallel %d x pipeline %d x data parallel %lld = %lld processes%s\n", tp, pp,
                static_cast<long long>(ranks), static_cast<long long>(ranks) * tp * pp,
                rs.offload.sequence_parallel ? ", sequence parallel" : "");
    std::printf("bytes per rank: its tensor-parallel shard%s%s.\n",
                pp > 1 ? " of its pipeline stage; each row is the placement's largest stage (pp stage), and fits "
                         "only where every stage fits"
                       : "",
                ranks > 1 ? "; dp/step: that rank's data-parallel collectives per step at the link (not overlapped)"
                          : "");
    std::printf("\n");
  } else if (ranks == 1) {
    std::printf("one process (world size 1): each ZeRO stage of a placement needs the same bytes (--ranks N: per rank "
        "of N).\n\n");
  } else {
    std::printf(
        "bytes per rank of %lld data-parallel ranks; dp/step: the collectives' buffers per step and\n"
        "dp s their time at a %.3g GB/s link (bus bandwidth; %.3g us per collective), not overlapped\n"
        "(stages 1-3 with the optimizer off the device overlap them: strata plan --ranks).\n\n",
        static_cast<long long>(ranks), bus / 1e9, per_collective * 1e6);
  }
  std::printf("%-5s %-6s %-9s | %10s %10s %10s %10s | %10s | %-10s", "stage", "params", "optimizer", "device",
              "host", "pinned", "nvme", "swap", "fits");
  const bool dp_columns = ranks > 1;
  if (dp_columns) std::printf(" | %10s %9s", "dp/step", "dp s");
  if (pp > 1) std::printf(" | %8s", "pp stage");
  std::printf("\n");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const PlacementEstimate& e = rows[i];
    std::string fits = e.fits() ? "yes" : "no (";
    if (!e.fits()) {
      std::string why;
      if (!e.fits_device) why += "device";
      if (!e.fits_host) why += std::string(why.empty() ? "" : ", ") + "host";
      if (!e.fits_nvme) why += std::string(why.empty() ? "" : ", ") + "nvme";
      fits += why + ")";
    }
    std::printf("%-5d %-6s %-9s | %10s %10s %10s %10s | %10s | %-10s", e.zero_stage,
                tier_name(e.params).c_str(), tier_name(e.optimizer).c_str(),
                format_bytes(e.device_need).c_str(), format_bytes(e.plan.host_bytes).c_str(),
                format_bytes(e.plan.pinned_bytes).c_str(), format_bytes(e.plan.nvme_bytes).c_str(),
                format_bytes(e.nvme_need).c_str(), fits.c_str());
    if (dp_columns) {
      std::printf(" | %10s %9.4f", format_bytes(traffic[i].buffer_bytes()).c_str(),
                  traffic[i].seconds(bus, per_collective));
    }
    if (pp > 1) std::printf(" | %8d", worst_stage[i]);
    std::printf("\n");
  }
  std::printf("\nby kind (device / host / pinned / nvme), one row per placement:\n");
  std::printf("%-6s %-9s | %-36s | %-36s | %-36s | %s\n", "params", "optimizer", "parameters", "gradients",
              "optimizer state", "activations");
  auto cell = [](const TierBytes& t) {
    return format_bytes(t.device) + " / " + format_bytes(t.host) + " / " + format_bytes(t.pinned) + " / " +
           format_bytes(t.nvme);
  };
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const PlacementEstimate& e = rows[i];
    if (ranks == 1 && i > 0 && rows[i - 1].params == e.params && rows[i - 1].optimizer == e.optimizer) continue;
    std::printf("%-6s %-9s | %-36s | %-36s | %-36s | %s\n", tier_name(e.params).c_str(),
                tier_name(e.optimizer).c_str(), cell(e.by_kind[0]).c_str(), cell(e.by_kind[1]).c_str(),
                cell(e.by_kind[2]).c_str(), format_bytes(e.by_kind[3].device).c_str());
  }
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(estimate, "bytes per tier for every placement and ZeRO stage, and which fit the budgets",
                   run_estimate);

}  // namespace strata::cli
