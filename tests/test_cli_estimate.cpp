// `strata estimate` run as a user would: its JSON equals the plan the library computes for the same
// model, the budgets mark what does not fit, a config's offload tuning changes the numbers, and bad
// flags exit 2.
#include <nlohmann/json.hpp>
#include <string>

#include "harness/harness.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"

namespace strata {
namespace {

using testing::run_cli;

constexpr const char* kShape = "--model gpt2 --layers 2 --width 64 --heads 2 --seq-len 32 --batch 2";

TrainerConfig same_shape() {
  TrainerConfig t;
  t.model.kind = ModelKind::kGpt2;
  t.model.n_layer = 2;
  t.model.n_embd = 64;
  t.model.n_head = 2;
  t.model.n_positions = 32;
  t.model.vocab_size = 256;  // the byte tokenizer strata train uses by default
  t.seq_len = 32;
  t.micro_batch = 2;
  return t;
}

const nlohmann::json& row(const nlohmann::json& j, int stage, const char* params, const char* optimizer) {
  for (const auto& r : j["placements"]) {
    if (r["zero_stage"] == stage && r["offload_param"] == params && r["offload_optimizer"] == optimizer)
      return r;
  }
  ADD_FAILURE() << "no row " << stage << " " << params << " " << optimizer;
  return j;
}

TEST(CliEstimate, JsonMatchesTheLibraryPlanByteForByte) {
  auto r = run_cli(std::string("estimate --json ") + kShape);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["world_size"], 1);
  EXPECT_EQ(j["placements"].size(), 14u);
  for (const auto& [params, optimizer] :
       {std::pair{Tier::kDevice, Tier::kDevice}, std::pair{Tier::kDevice, Tier::kHost},
        std::pair{Tier::kNvme, Tier::kNvme}}) {
    OffloadSettings s;
    s.params = params;
    s.optimizer = optimizer;
    s.nvme_path = {"/x"};
    s.io.nvme_path = s.nvme_path;
    auto plan = OffloadPlan::make(same_shape(), s);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const std::string p(to_string(params)), o(to_string(optimizer));
    const auto& got = row(j, 3, p.c_str(), o.c_str());
    EXPECT_EQ(got["total"]["device"], plan->device_bytes) << p << "/" << o;
    EXPECT_EQ(got["total"]["host"], plan->host_bytes) << p << "/" << o;
    EXPECT_EQ(got["total"]["pinned"], plan->pinned_bytes) << p << "/" << o;
    EXPECT_EQ(got["total"]["nvme"], plan->nvme_bytes) << p << "/" << o;
  }
  // Stage 0 exists only for the all-device placement; parameter offload only at stage 3.
  EXPECT_EQ(row(j, 0, "device", "device")["total"], row(j, 3, "device", "device")["total"]);
  for (const auto& r2 : j["placements"]) {
    if (r2["offload_param"] != "device") {
      EXPECT_EQ(r2["zero_stage"], 3);
    }
  }
}

// --ranks N: per-rank bytes from the engine's data-parallel plan; the optimizer state shrinks to
// 1/N (on the host tiers, and in device memory for stages 1-3 with the optimizer on the device),
// stage 3 shards the offloaded parameters too; on cuda, sharding device state is left out.
TEST(CliEstimate, RanksGivePerRankBytesOfEachStage) {
  auto r = run_cli(std::string("estimate --json --ranks 4 ") + kShape);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["world_size"], 4);
  const auto dev0 = row(j, 0, "device", "device")["bytes"]["optimizer"]["device"].get<std::uint64_t>();
  for (int stage : {1, 2, 3}) {
    const auto dev = row(j, stage, "device", "device")["bytes"]["optimizer"]["device"].get<std::uint64_t>();
    EXPECT_LT(dev, dev0 / 3) << "device optimizer state per rank of 4, stage " << stage;
  }
  auto rc = run_cli(std::string("estimate --json --ranks 4 --device cuda ") + kShape);
  ASSERT_EQ(rc.exit_code, 0) << rc.output;                   // estimate only plans: no cuda device is needed
  const auto placements = nlohmann::json::parse(rc.output);  // the loop below must not outlive it
  for (const auto& r2 : placements["placements"]) {
    EXPECT_FALSE(r2["offload_optimizer"] == "device" && r2["zero_stage"] != 0) << r2.dump();
  }
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.params = Tier::kHost;
  s.zero_stage = 3;
  s.dp_size = 4;
  auto plan = OffloadPlan::make(same_shape(), s);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(row(j, 3, "host", "host")["total"]["host"], plan->host_bytes);
  auto one = run_cli(std::string("estimate --json ") + kShape);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto j1 = nlohmann::json::parse(one.output);
  const auto opt4 = row(j, 1, "device", "host")["bytes"]["optimizer"]["host"].get<std::uint64_t>();
  const auto opt1 = row(j1, 1, "device", "host")["bytes"]["optimizer"]["host"].get<std::uint64_t>();
  EXPECT_LT(opt4, opt1 / 3) << "optimizer state per rank of 4";
  // Modules above the persistence threshold (100k elements) move, and stage 3 shards them.
  const std::string big = "--model gpt2 --layers 8 --width 512 --heads 8 --seq-len 32 --batch 2";
  auto b4 = run_cli("estimate --json --ranks 4 " + big), b1 = run_cli("estimate --json " + big);
  ASSERT_EQ(b4.exit_code, 0) << b4.output;
  ASSERT_EQ(b1.exit_code, 0) << b1.output;
  const auto jb4 = nlohmann::json::parse(b4.output), jb1 = nlohmann::json::parse(b1.output);
  const auto par4 = row(jb4, 3, "host", "host")["bytes"]["parameters"]["host"].get<std::uint64_t>();
  const auto par1 = row(jb1, 3, "host", "host")["bytes"]["parameters"]["host"].get<std::uint64_t>();
  EXPECT_LT(par4, par1 / 2) << "stage 3 shards the offloaded parameters";
  EXPECT_EQ(run_cli(std::string("estimate --ranks 0 ") + kShape).exit_code, 2);
}

// --ranks N: each row's data-parallel collectives per step are the library's dp_traffic (the
// bytes docs/performance.md measured), their time at the given link; bad link flags exit 2.
TEST(CliEstimate, RanksGiveEachStagesCollectivesAtTheLink) {
  auto r =
      run_cli(std::string("estimate --json --ranks 2 --link-bandwidth 2 --link-latency-us 50 ") + kShape);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_DOUBLE_EQ(j["link"]["bus_bytes_per_s"].get<double>(), 2e9);
  EXPECT_DOUBLE_EQ(j["link"]["collective_s"].get<double>(), 50e-6);
  struct Want {
    int stage;
    const char *params, *optimizer;
    Tier p, o;
  };
  for (const Want& w : {Want{0, "device", "device", Tier::kDevice, Tier::kDevice},
                        Want{1, "device", "host", Tier::kDevice, Tier::kHost},
                        Want{2, "device", "host", Tier::kDevice, Tier::kHost},
                        Want{3, "host", "host", Tier::kHost, Tier::kHost}}) {
    OffloadSettings s;
    s.params = w.p;
    s.optimizer = w.o;
    s.zero_stage = w.stage;
    s.dp_size = 2;
    auto t = dp_traffic(same_shape(), s);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    const auto& dp = row(j, w.stage, w.params, w.optimizer)["data_parallel"];
    EXPECT_EQ(dp["buffer_bytes"].get<std::uint64_t>(), t->buffer_bytes()) << w.stage;
    EXPECT_GT(t->buffer_bytes(), 0u) << w.stage;
    EXPECT_EQ(dp["collectives"].get<std::uint64_t>(), t->collectives) << w.stage;
    EXPECT_DOUBLE_EQ(dp["seconds"].get<double>(), t->seconds(2e9, 50e-6)) << w.stage;
    EXPECT_EQ(dp["overlapped"].get<bool>(), w.o != Tier::kDevice) << w.stage;
  }
  // Stage 0 all-reduces the whole fp32 gradient once: 2 (N-1)/N of it on the wire.
  const auto& s0 = row(j, 0, "device", "device")["data_parallel"];
  EXPECT_EQ(s0["all_reduce_bytes"], s0["buffer_bytes"]);
  EXPECT_DOUBLE_EQ(s0["wire_bytes"].get<double>(), s0["all_reduce_bytes"].get<double>());
  for (const char* bad : {"--link-bandwidth 0", "--link-bandwidth fast", "--link-latency-us -1"}) {
    auto b = run_cli(std::string("estimate --ranks 2 ") + bad + " " + kShape);
    EXPECT_EQ(b.exit_code, 2) << bad << ": " << b.output;
    EXPECT_NE(b.output.find(std::string(bad).substr(2, std::string(bad).find(' ') - 2)), std::string::npos)
        << bad << ": " << b.output;
  }
}

TEST(CliEstimate, BudgetsMarkWhatDoesNotFit) {
  auto all = run_cli(std::string("estimate --json ") + kShape);
  ASSERT_EQ(all.exit_code, 0) << all.output;
  auto j = nlohmann::json::parse(all.output);
  const std::uint64_t dd = row(j, 0, "device", "device")["device_need"];
  const std::uint64_t dh = row(j, 1, "device", "host")["device_need"];
  ASSERT_LT(dh, dd);
  const std::string budget = std::to_string((dd + dh) / 2);
  auto r =
      run_cli(std::string("estimate --json ") + kShape + " --device-memory " + budget + " --nvme-free 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto b = nlohmann::json::parse(r.output);
  EXPECT_EQ(row(b, 0, "device", "device")["fits"]["device"], false);
  EXPECT_EQ(row(b, 1, "device", "host")["fits"]["all"], true);
  EXPECT_EQ(row(b, 3, "nvme", "nvme")["fits"]["nvme"], false);
  // The table says the same.
  auto text = run_cli(std::string("estimate ") + kShape + " --device-memory " + budget);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("world size 1"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("no (device)"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("| yes"), std::string::npos) << text.output;
}

TEST(CliEstimate, ConfigOffloadTuningChangesThePlan) {
  testing::TempDir dir("strata-cli-estimate");
  // Every module leaves the device (persistence 0), so the plan is the library's for that setting.
  const std::string file = testing::write_file(
      dir / "ds.json",
      R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"},
          "offload_optimizer": {"device": "cpu"}}, "wall_clock_breakdown": false})");
  auto base = run_cli(std::string("estimate --json ") + kShape);
  auto tuned = run_cli(std::string("estimate --json ") + kShape + " --config " + file);
  ASSERT_EQ(base.exit_code, 0) << base.output;
  ASSERT_EQ(tuned.exit_code, 0) << tuned.output;
  const std::uint64_t before = row(nlohmann::json::parse(base.output), 3, "host", "host")["total"]["device"];
  const std::uint64_t after = row(nlohmann::json::parse(tuned.output), 3, "host", "host")["total"]["device"];
  EXPECT_NE(after, before);
  OffloadSettings s;
  s.params = Tier::kHost;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  auto plan = OffloadPlan::make(same_shape(), s);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(after, plan->device_bytes);
  // --strict applies to the config here too.
  auto strict = run_cli(std::string("estimate ") + kShape + " --config " + file + " --strict");
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  EXPECT_NE(strict.output.find("wall_clock_breakdown: ignored by Strata"), std::string::npos)
      << strict.output;
}

// A config's partial optimizer split (offload_optimizer.ratio) with --ranks N: the rows that take
// it with several data-parallel ranks (the optimizer off the device: every stage and parameter
// placement) are the library's plan of the split on N ranks (what the engine carves,
// test_dist_offload_partial); the others (the optimizer on the device) are planned at ratio 1.
TEST(CliEstimate, RanksTakeAPartialOptimizerSplitWhereTheEngineDoes) {
  testing::TempDir dir("strata-cli-estimate");
  const std::string file = testing::write_file(
      dir / "ratio.json", R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})");
  auto r = run_cli(std::string("estimate --json --ranks 2 ") + kShape + " --config " + file);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  for (int stage : {1, 2}) {
    OffloadSettings s;
    s.optimizer = Tier::kHost;
    s.zero_stage = stage;
    s.dp_size = 2;
    s.optimizer_ratio = 0.5;
    auto split = OffloadPlan::make(same_shape(), s);
    ASSERT_TRUE(split.ok()) << split.status().to_string();
    s.optimizer_ratio = 1.0;
    auto whole = OffloadPlan::make(same_shape(), s);
    ASSERT_TRUE(whole.ok()) << whole.status().to_string();
    const auto& got = row(j, stage, "device", "host");
    EXPECT_EQ(got["total"]["device"], split->device_bytes) << "stage " << stage;
    EXPECT_EQ(got["total"]["host"], split->host_bytes) << "stage " << stage;
    EXPECT_EQ(got["total"]["pinned"], split->pinned_bytes) << "stage " << stage;
    EXPECT_GT(split->device_bytes, whole->device_bytes) << "the device keeps the first modules' slices";
    bool sliced = false;
    for (const PlanLine& l : split->lines)
      sliced = sliced || l.what.rfind("device region optim.exp_avg_sq (this rank's 1/2)", 0) == 0;
    EXPECT_TRUE(sliced) << "stage " << stage << ": the device state is this rank's slices";
  }
  // Stage 3 with the parameters off the device takes the split too (the device modules'
  // parameters resident, the others' slices at their home).
  OffloadSettings s3;
  s3.params = Tier::kHost;
  s3.optimizer = Tier::kHost;
  s3.zero_stage = 3;
  s3.dp_size = 2;
  s3.optimizer_ratio = 0.5;
  auto p3 = OffloadPlan::make(same_shape(), s3);
  ASSERT_TRUE(p3.ok()) << p3.status().to_string();
  s3.optimizer_ratio = 1.0;
  auto p3_whole = OffloadPlan::make(same_shape(), s3);
  ASSERT_TRUE(p3_whole.ok()) << p3_whole.status().to_string();
  EXPECT_GT(p3->device_bytes, p3_whole->device_bytes) << "stage 3: the device keeps the first modules";
  EXPECT_EQ(row(j, 3, "host", "host")["total"]["device"], p3->device_bytes);
}

// A config's tensor and pipeline parallel layout: every stage's bytes are the library's plan of
// one rank (its tensor-parallel shard of the stage's modules), a placement's row is its largest
// stage, and world_size counts every process of the grid. The data-parallel term is dp_traffic's
// for the shown stage's rank (dist.cost_grid checks it against the engine's count), and a layout
// the model cannot take is refused naming the key.
TEST(CliEstimate, ConfigGridGivesOneRanksShardOfItsStage) {
  testing::TempDir dir("strata-cli-estimate");
  const std::string tp_file =
      testing::write_file(dir / "tp.json", R"({"strata": {"tensor_parallel_size": 2}})");
  const std::string grid_file = testing::write_file(
      dir / "grid.json", R"({"strata": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})");
  auto one = run_cli(std::string("estimate --json ") + kShape);
  auto tp = run_cli(std::string("estimate --json ") + kShape + " --config " + tp_file);
  auto grid = run_cli(std::string("estimate --json --ranks 2 ") + kShape + " --config " + grid_file);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  ASSERT_EQ(grid.exit_code, 0) << grid.output;
  const auto j1 = nlohmann::json::parse(one.output), jt = nlohmann::json::parse(tp.output),
             jg = nlohmann::json::parse(grid.output);
  EXPECT_EQ(jt["world_size"], 2);
  EXPECT_EQ(jt["tensor_parallel_size"], 2);
  EXPECT_EQ(jg["world_size"], 8);
  EXPECT_EQ(jg["data_parallel_size"], 2);
  EXPECT_EQ(jg["pipeline_parallel_size"], 2);
  auto bounds = pipeline_stages(same_shape().model, 2, 32);
  ASSERT_TRUE(bounds.ok()) << bounds.status().to_string();
  for (const auto& [params, optimizer] :
       {std::pair{Tier::kDevice, Tier::kDevice}, std::pair{Tier::kDevice, Tier::kHost},
        std::pair{Tier::kNvme, Tier::kNvme}}) {
    const std::string p(to_string(params)), o(to_string(optimizer));
    SCOPED_TRACE(p + "/" + o);
    OffloadSettings s;
    s.params = params;
    s.optimizer = optimizer;
    s.zero_stage = 3;
    s.nvme_path = {"/x"};
    s.io.nvme_path = s.nvme_path;
    s.tp_size = 2;
    auto plan = OffloadPlan::make(same_shape(), s);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const auto& t = row(jt, 3, p.c_str(), o.c_str());
    EXPECT_EQ(t["total"]["device"], plan->device_bytes);
    EXPECT_EQ(t["total"]["host"], plan->host_bytes);
    EXPECT_EQ(t["total"]["nvme"], plan->nvme_bytes);
    EXPECT_EQ(t["data_parallel"]["buffer_bytes"], 0u);  // one data-parallel rank
    // The shard is smaller than the whole model's plan.
    EXPECT_LT(t["total"]["device"].get<std::uint64_t>(),
              row(j1, 3, p.c_str(), o.c_str())["total"]["device"].get<std::uint64_t>());
    // The grid: each stage is the library's plan of that stage on 2 data-parallel ranks.
    s.dp_size = 2;
    s.pipeline_bounds = *bounds;
    const auto& g = row(jg, 3, p.c_str(), o.c_str());
    ASSERT_EQ(g["pipeline_stages"].size(), 2u);
    std::uint64_t largest = 0;
    int largest_stage = -1;
    for (int st = 0; st < 2; ++st) {
      s.pp_stage = st;
      auto sp = OffloadPlan::make(same_shape(), s);
      ASSERT_TRUE(sp.ok()) << sp.status().to_string();
      const auto& gs = g["pipeline_stages"][static_cast<std::size_t>(st)];
      EXPECT_EQ(gs["device"], sp->device_bytes) << "stage " << st;
      EXPECT_EQ(gs["host"], sp->host_bytes) << "stage " << st;
      EXPECT_EQ(gs["pinned"], sp->pinned_bytes) << "stage " << st;
      EXPECT_EQ(gs["nvme"], sp->nvme_bytes) << "stage " << st;
      if (sp->device_bytes > largest) {
        largest = sp->device_bytes;
        largest_stage = st;
      }
    }
    EXPECT_EQ(g["pipeline_stage"], largest_stage);
    EXPECT_EQ(g["total"]["device"], largest);
    s.pp_stage = largest_stage;
    auto dp = dp_traffic(same_shape(), s);
    ASSERT_TRUE(dp.ok()) << dp.status().to_string();
    EXPECT_GT(dp->buffer_bytes(), 0u);
    EXPECT_EQ(g["data_parallel"]["buffer_bytes"], dp->buffer_bytes());
    EXPECT_EQ(g["data_parallel"]["collectives"], dp->collectives);
  }
  // A budget between the stages' needs: the row does not fit although one stage would.
  const auto& dd = row(jg, 3, "device", "device");
  const std::uint64_t small = std::min(dd["pipeline_stages"][0]["device_need"].get<std::uint64_t>(),
                                       dd["pipeline_stages"][1]["device_need"].get<std::uint64_t>());
  const std::uint64_t big = dd["total"]["device"].get<std::uint64_t>();
  if (small < big) {
    auto tight = run_cli(std::string("estimate --json --ranks 2 ") + kShape + " --config " + grid_file +
                         " --device-memory " + std::to_string(small));
    ASSERT_EQ(tight.exit_code, 0) << tight.output;
    EXPECT_FALSE(row(nlohmann::json::parse(tight.output), 3, "device", "device")["fits"]["device"].get<bool>());
  }
  // Text: the grid line and the stage column.
  auto text = run_cli(std::string("estimate --ranks 2 ") + kShape + " --config " + grid_file);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("tensor parallel 2 x pipeline 2 x data parallel 2 = 8 processes"), std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find("pp stage"), std::string::npos) << text.output;
  // Three tensor-parallel ranks cannot split 2 heads: refused naming the key.
  const std::string bad =
      testing::write_file(dir / "bad.json", R"({"strata": {"tensor_parallel_size": 3}})");
  auto refused = run_cli(std::string("estimate ") + kShape + " --config " + bad);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("strata.tensor_parallel_size = 3"), std::string::npos) << refused.output;
}

TEST(CliEstimate, VocabularySizeIsPartOfTheShape) {
  auto r = run_cli(std::string("estimate --json --vocab-size 50257 ") + kShape);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["model"]["vocab_size"], 50257);
  TrainerConfig t = same_shape();
  t.model.vocab_size = 50257;
  auto plan = OffloadPlan::make(t, OffloadSettings{});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(row(j, 0, "device", "device")["total"]["device"], plan->device_bytes);
  EXPECT_EQ(run_cli(std::string("estimate --vocab-size 0 ") + kShape).exit_code, 2);
}

TEST(CliEstimate, UsageErrorsExitTwo) {
  auto flag = run_cli("estimate --device-memory lots");
  EXPECT_EQ(flag.exit_code, 2) << flag.output;
  EXPECT_NE(flag.output.find("device-memory"), std::string::npos) << flag.output;
  auto shape = run_cli("estimate --width 65 --heads 2");
  EXPECT_EQ(shape.exit_code, 2) << shape.output;
  EXPECT_NE(shape.output.find("--width"), std::string::npos) << shape.output;
  auto extra = run_cli("estimate model.json");
  EXPECT_EQ(extra.exit_code, 2) << extra.output;
  auto help = run_cli("estimate --help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("--nvme-free"), std::string::npos) << help.output;
}

}  // namespace
}  // namespace strata
