// `strata plan` run as a user would: on a tiny model it measures, ranks and writes a config that
// strata config validates and strata train runs; a tight device budget forces an offloaded
// placement that then trains within that budget; a budget nothing fits is refused naming the flag
// to change; fixed tiers are honoured; bad flags exit 2. (The accuracy of the prediction against
// measured steps is tests/test_slow_plan_accuracy.cpp.)
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "harness/harness.hpp"
#include "strata/config.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata {
namespace {

using testing::read_file;
using testing::run_cli;
using testing::TempDir;

constexpr const char* kShape = "--model gpt2 --layers 2 --width 64 --heads 2 --seq-len 32 --batch 2";
// Small measurements: the test is about the plumbing, not the figures.
constexpr const char* kQuick = "--measure-nvme 4MiB --measure-steps 1";

nlohmann::json plan_json(const std::string& flags) {
  auto r = run_cli("plan --json " + std::string(kShape) + " " + kQuick + " " + flags);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.output;
  return j;
}

TEST(CliPlan, WritesAConfigThatConfigAndTrainAccept) {
  TempDir dir("strata-plan");
  const std::string cfg = (dir / "plan.json").string();
  const auto j = plan_json("--nvme-path " + dir.path().string() + " --out " + cfg);
  ASSERT_TRUE(j.contains("chosen"));
  // Ranked: the best tuning of each placement, fastest first (ties within 1%).
  const auto& rows = j["placements"];
  ASSERT_EQ(rows.size(), 10u);  // every placement fits this model: 3 on device and host + 7 with NVMe
  for (std::size_t i = 1; i < rows.size(); ++i) {
    const double a = rows[i - 1]["predicted"]["step_s"], b = rows[i]["predicted"]["step_s"];
    EXPECT_LE(a, b * 1.01 + 1e-12) << i;
  }
  EXPECT_EQ(j["chosen"], rows[0]);
  for (const auto& r : rows) {
    EXPECT_GT(r["predicted"]["step_s"].get<double>(), 0.0);
    EXPECT_GE(r["predicted"]["step_s"].get<double>(),
              r["predicted"]["parts_s"]["compute"].get<double>() * 0.999);
  }
  EXPECT_GT(j["machine"]["h2d_bytes_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["machine"]["host_copy_bytes_per_s"].get<double>(), 0.0);
  EXPECT_TRUE(j["machine"]["nvme_measured"].get<bool>());
  // The file is the config printed, and the rest of the toolchain takes it.
  const auto written = nlohmann::json::parse(read_file(cfg));
  EXPECT_EQ(written, j["config"]);
  EXPECT_EQ(written["zero_optimization"]["offload_param"]["device"],
            j["chosen"]["offload_param"] == "device" ? "none"
            : j["chosen"]["offload_param"] == "host" ? "cpu"
                                                     : "nvme");
  EXPECT_EQ(written["strata"]["offload_prefetch_modules"], j["chosen"]["prefetch_modules"]);
  auto c = run_cli("config " + cfg + " --strict");
  EXPECT_EQ(c.exit_code, 0) << c.output;
  auto t = run_cli("train --config " + cfg + " --steps 1 --quiet --val-windows 1 " + kShape);
  EXPECT_EQ(t.exit_code, 0) << t.output;
}

// A config's partial optimizer split (offload_optimizer.ratio) is predicted for the placements
// that take it (parameters on the device, optimizer off it) and left out of the others, whose
// prediction is made without it; the chosen config trains.
TEST(CliPlan, APartialOptimizerSplitIsPlannedWhereItApplies) {
  TempDir dir("strata-plan-ratio");
  const std::string in = (dir / "ratio.json").string(), out = (dir / "plan.json").string();
  testing::write_file(
      in, R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})");
  const auto j = plan_json("--config " + in + " --out " + out);
  ASSERT_TRUE(j.contains("placements"));
  bool saw_split = false;
  for (const auto& r : j["placements"]) {
    EXPECT_GT(r["predicted"]["step_s"].get<double>(), 0.0);
    if (r["offload_param"] == "device" && r["offload_optimizer"] == "host") saw_split = true;
  }
  EXPECT_TRUE(saw_split);
  const auto written = nlohmann::json::parse(read_file(out));
  const bool split_applies =
      j["chosen"]["offload_param"] == "device" && j["chosen"]["offload_optimizer"] != "device";
  const auto& opt = written["zero_optimization"]["offload_optimizer"];
  EXPECT_EQ(opt.contains("ratio") && opt["ratio"].get<double>() < 1.0, split_applies) << written.dump();
  auto t = run_cli("train --config " + out + " --steps 1 --quiet --val-windows 1 " + kShape);
  EXPECT_EQ(t.exit_code, 0) << t.output;
  // Fixed to a placement that takes it, the split is written.
  const auto fixed =
      plan_json("--config " + in + " --offload-param none --offload-optimizer cpu --out " + out);
  const auto kept = nlohmann::json::parse(read_file(out));
  EXPECT_EQ(kept["zero_optimization"]["offload_optimizer"]["ratio"].get<double>(), 0.5) << kept.dump();
  EXPECT_GT(fixed["chosen"]["predicted"]["step_s"].get<double>(), 0.0);
}

TEST(CliPlan, EveryPlacementItWritesTrains) {
  // The NVMe placements' configs carry the directory and the Strata keys (gradients on NVMe).
  TempDir dir("strata-plan");
  const std::string cfg = (dir / "nvme.json").string();
  const auto j = plan_json("--nvme-path " + dir.path().string() + " --out " + cfg +
                           " --offload-param nvme --offload-optimizer nvme --offload-gradients nvme");
  EXPECT_EQ(j["chosen"]["offload_param"], "nvme");
  EXPECT_EQ(j["chosen"]["offload_gradients"], "nvme");
  EXPECT_EQ(j["placements"].size(), 1u);
  const auto written = nlohmann::json::parse(read_file(cfg));
  EXPECT_EQ(written["zero_optimization"]["offload_optimizer"]["nvme_path"], dir.path().string());
  EXPECT_EQ(written["strata"]["offload_gradients"], "nvme");
  EXPECT_EQ(written["zero_optimization"]["sub_group_size"], j["chosen"]["sub_group_size"]);
  auto c = run_cli("config " + cfg);
  EXPECT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("parameters on nvme, optimizer state on nvme"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("gradients (fp32)"), std::string::npos) << c.output;  // the NVMe gradient line
  auto t = run_cli("train --config " + cfg + " --steps 2 --quiet --val-windows 1 " + kShape);
  EXPECT_EQ(t.exit_code, 0) << t.output;
}

TEST(CliPlan, TightDeviceBudgetForcesOffloadThatFits) {
  auto e = run_cli(std::string("estimate --json ") + kShape);
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const auto est = nlohmann::json::parse(e.output);
  std::uint64_t all_device = 0, least_offloaded = ~0ull;
  for (const auto& r : est["placements"]) {
    const std::uint64_t need = r["device_need"];
    if (r["offload_param"] == "device" && r["offload_optimizer"] == "device") {
      all_device = need;
    } else if (r["offload_optimizer"] != "nvme" && r["offload_param"] != "nvme") {
      least_offloaded = std::min(least_offloaded, need);
    }
  }
  ASSERT_LT(least_offloaded, all_device);
  const std::uint64_t budget = (least_offloaded + all_device) / 2;
  TempDir dir("strata-plan");
  const std::string cfg = (dir / "tight.json").string();
  const auto j = plan_json("--device-memory " + std::to_string(budget) + " --out " + cfg);
  const auto& chosen = j["chosen"];
  EXPECT_FALSE(chosen["offload_param"] == "device" && chosen["offload_optimizer"] == "device")
      << chosen.dump();
  EXPECT_LE(chosen["bytes"]["device"].get<std::uint64_t>(), budget);
  for (const auto& r : j["placements"]) EXPECT_LE(r["bytes"]["device"].get<std::uint64_t>(), budget);
  bool refused_all_device = false;
  for (const auto& r : j["refused"]) {
    if (r["placement"] == "params device, optimizer device") {
      refused_all_device = true;
      EXPECT_NE(r["why"].get<std::string>().find("device needs"), std::string::npos) << r.dump();
    }
  }
  EXPECT_TRUE(refused_all_device) << j["refused"].dump();
  // The config carries the budget, and the engine, planning for itself, fits in it.
  const auto written = nlohmann::json::parse(read_file(cfg));
  EXPECT_EQ(written["strata"]["device_memory"], std::to_string(budget));
  auto t = run_cli("train --config " + cfg + " --steps 1 --quiet --val-windows 1 " + kShape);
  EXPECT_EQ(t.exit_code, 0) << t.output;
}

TEST(CliPlan, NothingFitsIsRefusedNamingWhatToChange) {
  auto r = run_cli("plan " + std::string(kShape) + " " + kQuick + " --device-memory 1MiB");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no placement fits the budgets"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("params device, optimizer device: device needs"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not considered without --nvme-path"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("raise --device-memory"), std::string::npos) << r.output;
}

TEST(CliPlan, TheStrataKeysItWritesReachTheOffloadSettings) {
  auto c =
      parse_config(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
                            "strata": {"offload_prefetch_modules": 3, "offload_gradients": "nvme"}})",
                   "plan.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  OffloadSettings s;
  STRATA_ASSERT_OK(s.apply(*c));
  EXPECT_EQ(s.prefetch_modules, 3);
  EXPECT_EQ(s.gradients, Tier::kNvme);
  auto bad = parse_config(R"({"strata": {"offload_gradients": "gpu"}})", "plan.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("offload_gradients"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("one of: cpu (host), nvme"), std::string::npos)
      << bad.status().message();
}

// --ranks N (no mpirun: it plans for N ranks): every candidate's data-parallel term is the one
// `strata estimate --ranks N` gives the same placement at the stage and gradient buckets plan
// writes for it (2 with the optimizer off the device, 3 with the parameters off it; all on the
// device each of stages 0-3, the cpu backend's device-sharded stages, as a candidate of its own,
// with its tuned reduce_bucket_size and overlap_comm, passed to estimate in a config): its buffer
// bytes per step (OffloadStats::bytes_dp's count) and the link's busy seconds for them at the
// given bandwidth and latency (plan's parts_s.data_parallel sums every collective's time,
// whichever thread waits for it: estimate's count x latency + wire bytes / bandwidth), and the
// all-device rows' device bytes. Both commands call the library's cost model; what is checked is
// that plan asks it about the placement, stage and buckets it writes, with --ranks and the link
// flags passed through.
TEST(CliPlan, RanksGiveTheDataParallelTermOfEstimate) {
  const std::string link = "--ranks 2 --link-bandwidth 2 --link-latency-us 50";
  const auto j = plan_json(link);
  ASSERT_TRUE(j.contains("placements")) << j.dump();
  EXPECT_EQ(j["machine"]["ranks"], 2);
  EXPECT_DOUBLE_EQ(j["machine"]["dp_bus_bytes_per_s"].get<double>(), 2e9);
  EXPECT_DOUBLE_EQ(j["machine"]["dp_collective_s"].get<double>(), 50e-6);
  TempDir dir("strata-plan-ranks");
  // strata estimate's rows with the gradient buckets of a plan row.
  // (The prefetch depth and budget too: stage 3's slots in device memory follow the depth plan
  // tuned, which depends on the measured rates.)
  std::map<std::tuple<std::int64_t, bool, int, std::int64_t>, nlohmann::json> estimates;
  auto estimate_for = [&](const nlohmann::json& row) -> const nlohmann::json& {
    const std::tuple<std::int64_t, bool, int, std::int64_t> key{
        row["reduce_bucket_size"].get<std::int64_t>(), row["overlap_comm"].get<bool>(),
        row["prefetch_modules"].get<int>(), row["prefetch_elements"].get<std::int64_t>()};
    auto it = estimates.find(key);
    if (it != estimates.end()) return it->second;
    const std::string cfg = (dir / ("buckets-" + std::to_string(estimates.size()) + ".json")).string();
    nlohmann::json c;
    c["zero_optimization"]["reduce_bucket_size"] = std::get<0>(key);
    c["zero_optimization"]["overlap_comm"] = std::get<1>(key);
    c["strata"]["offload_prefetch_modules"] = std::get<2>(key);
    c["zero_optimization"]["stage3_prefetch_bucket_size"] = std::get<3>(key);
    testing::write_file(cfg, c.dump());
    auto e = run_cli("estimate --json --config " + cfg + " " + link + " " + kShape);
    EXPECT_EQ(e.exit_code, 0) << e.output;
    return estimates[key] = nlohmann::json::parse(e.output, nullptr, false);
  };
  ASSERT_GT(j["placements"].size(), 0u);
  int checked_seconds = 0;
  std::map<int, int> device_stages;
  for (const auto& row : j["placements"]) {
    const std::string params = row["offload_param"], optimizer = row["offload_optimizer"];
    const int stage = row["zero_stage"];
    if (optimizer != "device") {
      EXPECT_EQ(stage, params != "device" ? 3 : 2) << row.dump();
    }
    const nlohmann::json& est = estimate_for(row);
    ASSERT_TRUE(est.contains("placements")) << est.dump();
    const nlohmann::json* match = nullptr;
    for (const auto& r : est["placements"]) {
      if (r["zero_stage"] == stage && r["offload_param"] == params && r["offload_optimizer"] == optimizer)
        match = &r;
    }
    ASSERT_NE(match, nullptr) << "no estimate row for " << row.dump();
    const auto& dp = (*match)["data_parallel"];
    const std::string what = row["placement"].get<std::string>();
    EXPECT_GT(dp["buffer_bytes"].get<std::uint64_t>(), 0u) << what;
    if (optimizer == "device") {
      ++device_stages[stage];
      EXPECT_EQ(row["bytes"]["device"].get<std::uint64_t>(), (*match)["device_need"].get<std::uint64_t>()) << what;
    }
    if (stage == 3) {
      // Stage 3's gathers per fetch follow the prefetch depth, which plan tunes per candidate:
      // at least the estimate's gathers after the update and reduce-scatters.
      EXPECT_GE(row["predicted"]["bytes_per_step"]["data_parallel"].get<std::uint64_t>(),
                dp["reduce_scatter_bytes"].get<std::uint64_t>())
          << what;
      continue;
    }
    EXPECT_EQ(row["predicted"]["bytes_per_step"]["data_parallel"].get<std::uint64_t>(),
              dp["buffer_bytes"].get<std::uint64_t>())
        << what;
    EXPECT_NEAR(row["predicted"]["parts_s"]["data_parallel"].get<double>(), dp["seconds"].get<double>(),
                1e-12 + 1e-9 * dp["seconds"].get<double>())
        << what;
    if (optimizer == "device") ++checked_seconds;
  }
  EXPECT_GT(checked_seconds, 0) << "no all-device candidate at stages 0-2";
  // All on the device: one row per stage; the config written carries the chosen row's stage and
  // buckets.
  EXPECT_EQ(device_stages, (std::map<int, int>{{0, 1}, {1, 1}, {2, 1}, {3, 1}})) << j["placements"].dump();
  EXPECT_EQ(j["config"]["zero_optimization"]["stage"], j["chosen"]["zero_stage"]);
  EXPECT_EQ(j["config"]["zero_optimization"]["reduce_bucket_size"], j["chosen"]["reduce_bucket_size"]);
  EXPECT_EQ(j["config"]["zero_optimization"]["overlap_comm"], j["chosen"]["overlap_comm"]);
  // One rank: no data-parallel term at all.
  const auto one = plan_json("");
  for (const auto& row : one["placements"]) {
    EXPECT_EQ(row["predicted"]["bytes_per_step"]["data_parallel"].get<std::uint64_t>(), 0u) << row.dump();
    EXPECT_EQ(row["predicted"]["parts_s"]["data_parallel"].get<double>(), 0.0) << row.dump();
  }
}

// A tensor-parallel or pipeline config is planned per rank: its shard of its stage, the
// tensor-parallel collectives in the step and the whole pipeline's schedule (docs/offload.md
// "Predicting the step"). The rows name the grid, the JSON fields are estimate's; what the engine
// would refuse is refused naming the key.
TEST(CliPlan, TensorAndPipelineParallelConfigsArePlannedPerRank) {
  TempDir dir("strata-plan-grid");
  auto config = [&](const std::string& name, const std::string& strata) {
    return testing::write_file(dir / (name + ".json"), R"({"strata": {)" + strata + "}}");
  };
  {
    const auto j = plan_json("--config " + config("tp", R"("tensor_parallel_size": 2)"));
    EXPECT_EQ(j["tensor_parallel_size"], 2);
    EXPECT_EQ(j["pipeline_parallel_size"], 1);
    EXPECT_EQ(j["sequence_parallel"], false);
    EXPECT_GT(j["machine"]["tp_bus_bytes_per_s"].get<double>(), 0.0);
    ASSERT_GE(j["placements"].size(), 3u) << j.dump();
    for (const auto& row : j["placements"]) {
      const auto& p = row["predicted"];
      EXPECT_GT(p["bytes_per_step"]["tensor_parallel"].get<std::uint64_t>(), 0u) << row.dump();
      EXPECT_GT(p["parts_s"]["tensor_parallel"].get<double>(), 0.0) << row.dump();
      EXPECT_EQ(p["bytes_per_step"]["pipeline"].get<std::uint64_t>(), 0u) << row.dump();
      EXPECT_FALSE(row.contains("pipeline_stage")) << row.dump();
      // The collectives block the compute stream: they are in the step.
      EXPECT_GE(p["step_s"].get<double>(),
                p["parts_s"]["compute"].get<double>() + p["parts_s"]["tensor_parallel"].get<double>() - 1e-9)
          << row.dump();
    }
    // Sequence parallelism swaps each all-reduce for an all-gather and a reduce-scatter of the same
    // bytes and adds the norms' gradients: more bytes per step.
    const auto sp =
        plan_json("--config " + config("sp", R"("tensor_parallel_size": 2, "sequence_parallel": true)"));
    EXPECT_EQ(sp["sequence_parallel"], true);
    EXPECT_GT(sp["chosen"]["predicted"]["bytes_per_step"]["tensor_parallel"].get<std::uint64_t>(),
              j["chosen"]["predicted"]["bytes_per_step"]["tensor_parallel"].get<std::uint64_t>());
  }
  {
    const std::string file = config("pp", R"("pipeline_parallel_size": 2)");
    const auto j = plan_json("--grad-accum 4 --config " + file);
    EXPECT_EQ(j["tensor_parallel_size"], 1);
    EXPECT_EQ(j["pipeline_parallel_size"], 2);
    EXPECT_EQ(j["pipeline_schedule"], "1f1b");
    ASSERT_GE(j["placements"].size(), 3u) << j.dump();
    for (const auto& row : j["placements"]) {
      const auto& p = row["predicted"];
      ASSERT_TRUE(row.contains("pipeline_stage")) << row.dump();
      EXPECT_TRUE(row["pipeline_stage"] == 0 || row["pipeline_stage"] == 1) << row.dump();
      // Four micro-batches' boundary tensors (2 x 32 rows of 64 fp32) one way.
      EXPECT_EQ(p["bytes_per_step"]["pipeline"].get<std::uint64_t>(), 4u * 2 * 32 * 64 * 4) << row.dump();
      EXPECT_EQ(p["bytes_per_step"]["tensor_parallel"].get<std::uint64_t>(), 0u) << row.dump();
      EXPECT_GT(p["parts_s"]["pipeline_bubble"].get<double>(), 0.0) << row.dump();
      EXPECT_GE(p["step_s"].get<double>(), p["parts_s"]["pipeline_schedule"].get<double>()) << row.dump();
    }
    // The table shows the grid's columns.
    auto r = run_cli("plan " + std::string(kShape) + " " + kQuick + " --grad-accum 4 --config " + file);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("bubble"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("1f1b over 2 stages"), std::string::npos) << r.output;
  }
  // Still refused, naming the key: what the engine refuses too.
  auto r = run_cli("plan " + std::string(kShape) + " " + kQuick + " --config " +
                   config("bad", R"("sequence_parallel": true)"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("sequence_parallel"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tensor_parallel_size"), std::string::npos) << r.output;
  // The engine runs neither on cuda yet: refused before anything is measured.
  for (const char* key : {"tensor_parallel_size", "pipeline_parallel_size"}) {
    r = run_cli("plan --device cuda " + std::string(kShape) + " " + kQuick + " --config " +
                config(key, std::string("\"") + key + "\": 2"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(std::string("strata.") + key + " = 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("--device cpu"), std::string::npos) << r.output;
  }
}

TEST(CliPlan, BadFlagsNameTheFlag) {
  struct Case {
    std::string flags;
    int exit_code;
    std::string expect;
  };
  const Case cases[] = {
      {"--device-memory lots", 2, "--device-memory"},
      {"--offload-param tape", 2, "--offload-param"},
      {"--measure-steps 0", 2, "--measure-steps"},
      {"--measure-nvme 12", 2, "--measure-nvme"},
      {"--frobnicate", 2, "--frobnicate"},
      {"--ranks 0", 2, "--ranks"},
      {"--ranks 2 --link-bandwidth 0", 2, "link-bandwidth"},
      {"extra", 2, "unexpected argument 'extra'"},
      {"--out /nonexistent-dir/plan.json", 1, "/nonexistent-dir"},
      {"--nvme-path /nonexistent-dir", 1, "--nvme-path '/nonexistent-dir'"},
      {"--offload-gradients nvme --offload-optimizer cpu", 2,
       "--offload-gradients nvme' needs the optimizer on NVMe"},
  };
  for (const Case& c : cases) {
    auto r = run_cli("plan " + std::string(kShape) + " " + kQuick + " " + c.flags);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.flags << "\n" << r.output;
  }
}

// --profile: the step of a machine that is not this one, from its datasheet figures. Nothing is
// measured (NVMe placements need no --nvme-path); compute is the model's FLOPs at the profiled
// GPU's rate; more NVMe drives shorten the NVMe optimizer's disk time in proportion; each row says
// how much of its step the GPU computes.
TEST(CliPlan, ProfilePredictsAnotherMachineWithoutMeasuring) {
  constexpr const char* kLlama =
      "plan --json --profile h100 --gpu-efficiency 0.5 --model llama --layers 4 --width 1024 --heads 16 "
      "--vocab-size 32000 --dtype bf16 --seq-len 512 --batch 2 --device-memory 1GiB --offload-gradients host";
  auto r1 = run_cli(std::string(kLlama));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  const auto one = nlohmann::json::parse(r1.output);
  auto r4 = run_cli(std::string(kLlama) + " --nvme-drives 4");
  ASSERT_EQ(r4.exit_code, 0) << r4.output;
  const auto four = nlohmann::json::parse(r4.output);
  EXPECT_EQ(one["machine"]["gpu"], "h100");
  EXPECT_EQ(one["machine"]["nvme_drives"], 1);
  EXPECT_DOUBLE_EQ(four["machine"]["nvme_read_bytes_per_s"].get<double>(),
                   4 * one["machine"]["nvme_read_bytes_per_s"].get<double>());
  ModelConfig m;
  m.kind = ModelKind::kLlama;
  m.n_layer = 4;
  m.n_embd = 1024;
  m.n_head = 16;
  m.vocab_size = 32000;
  m.dtype = DType::kBF16;
  m.n_positions = 512;
  // Forward and backward of the one micro-batch at half of 989 TFLOPS.
  const double fb = model_flops(m, 2, 512) / (0.5 * 989e12);
  std::map<std::string, double> nvme_one, nvme_four;
  bool any_nvme = false;
  for (const auto& row : one["placements"]) {
    const double step = row["predicted"]["step_s"], compute = row["predicted"]["parts_s"]["compute"];
    // Plus the fused Adam at HBM bandwidth when the optimizer is on the GPU.
    const double expect =
        fb + (row["offload_optimizer"] == "device" ? one["machine"]["device_update_s"].get<double>() : 0.0);
    EXPECT_NEAR(compute, expect, 1e-6 * expect) << row.dump();
    EXPECT_NEAR(row["gpu_utilization"].get<double>(), compute / step, 1e-9) << row.dump();
    EXPECT_GT(row["gpu_utilization"].get<double>(), 0.0);
    EXPECT_LE(row["gpu_utilization"].get<double>(), 1.0);
    EXPECT_LE(row["model_tflops"].get<double>(), 0.5 * 989) << row.dump();
    if (row["offload_optimizer"] == "nvme") {
      any_nvme = true;
      nvme_one[row["placement"]] = row["predicted"]["parts_s"]["nvme_read"].get<double>() +
                                   row["predicted"]["parts_s"]["nvme_write"].get<double>();
    }
  }
  EXPECT_TRUE(any_nvme) << "NVMe placements are planned without --nvme-path under a profile";
  for (const auto& row : four["placements"]) {
    if (row["offload_optimizer"] == "nvme")
      nvme_four[row["placement"]] = row["predicted"]["parts_s"]["nvme_read"].get<double>() +
                                    row["predicted"]["parts_s"]["nvme_write"].get<double>();
  }
  for (const auto& [name, t] : nvme_one) {
    ASSERT_TRUE(nvme_four.count(name)) << name;
    // Bytes over 4x the bandwidth; the fixed per-request cost does not scale.
    EXPECT_LT(nvme_four[name], 0.3 * t) << name;
  }
}

TEST(CliPlan, ProfileFlagsAreCheckedAndNamed) {
  auto r = run_cli("plan --profile x100 " + std::string(kShape));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'--profile'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("h100"), std::string::npos) << r.output;
  r = run_cli("plan --nvme-drives 4 " + std::string(kShape));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'--nvme-drives' needs --profile"), std::string::npos) << r.output;
  r = run_cli("plan --profile h200 --host-link pcie9 " + std::string(kShape));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("pcie3, pcie4 or pcie5"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata
