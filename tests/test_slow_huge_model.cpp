// A model whose training state is twice this machine's memory: a 3.1-billion-parameter LLaMA
// (25 blocks of width 3200, bf16 working weights) trains two steps on one batch with a 2 GiB
// device budget and at most 8 GiB of host memory (pinned included); parameters, fp32 master
// weights, Adam moments and gradients (~54 GB) live on NVMe. The second step must lower the loss
// of the batch. Prints the plan, traffic per link, peak RSS and each step's loss and time.
// Label `slow` (minutes, and ~62 GB free under $TMPDIR, else skipped with the reason):
//   scripts/test -L slow -R HugeModel --output-on-failure
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/statvfs.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "harness/harness.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

TEST(HugeModel, ThreeBillionParametersTrainOnNvmeWithTwoGibOfDeviceAndEightOfHost) {
  TrainerConfig c;
  c.model.kind = ModelKind::kLlama;
  c.model.n_layer = 25;
  c.model.n_embd = 3200;
  c.model.n_head = 32;
  c.model.ffn_hidden = 8640;
  c.model.n_positions = 32;
  c.model.vocab_size = 256;
  c.model.dtype = DType::kBF16;
  c.micro_batch = 1;
  c.grad_accum = 1;
  c.seq_len = 32;
  c.schedule.kind = LrScheduleKind::kConstant;
  c.schedule.lr = 1e-4;
  c.optimizer.lr = 1e-4;
  c.grad_clip = 1.0;

  TempDir swap("strata-huge");
  OffloadSettings s;
  s.params = Tier::kNvme;
  s.optimizer = Tier::kNvme;
  s.gradients = Tier::kNvme;
  s.nvme_path = {swap.path().string()};
  s.nvme_scratch = true;  // a run killed by its timeout leaves no 48 GB behind
  s.io.nvme_path = s.nvme_path;
  s.sub_group_size = 20'000'000;
  s.prefetch_modules = 1;
  s.pin_memory = true;
  s.host_memory_limit = 8ull << 30;

  auto plan = OffloadPlan::make(c, s);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  std::printf("%s", plan->to_string().c_str());
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  EXPECT_GE(layout->num_parameters(), 3'000'000'000);
  EXPECT_LE(plan->host_bytes + plan->pinned_bytes, 8ull << 30);
  struct statvfs fs {};
  ASSERT_EQ(::statvfs(swap.path().c_str(), &fs), 0);
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (free_bytes < plan->nvme_bytes + plan->nvme_bytes / 8 + (4ull << 30)) {
    GTEST_SKIP() << "needs " << (plan->nvme_bytes + plan->nvme_bytes / 8) / (1ull << 30) << " GiB free under "
                 << swap.path() << "; " << free_bytes / (1ull << 30) << " GiB are";
  }

  DeviceConfig dc;
  dc.kind = DeviceKind::kCpu;
  dc.memory_bytes = 2ull << 30;
  dc.pinned_bytes = plan->pinned_bytes + (64ull << 20);
  auto device = Device::create(dc);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  const auto t0 = std::chrono::steady_clock::now();
  auto engine = OffloadEngine::create(c, s, **device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  std::printf("engine ready in %.1f s (parameters initialised, state written to NVMe)\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  std::vector<std::int32_t> in(32), tg(32);
  std::mt19937 rng(7);
  for (int i = 0; i < 32; ++i) in[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(rng() % 256);
  for (int i = 0; i < 32; ++i) tg[static_cast<std::size_t>(i)] = in[static_cast<std::size_t>((i + 1) % 32)];
  std::vector<double> losses;
  for (int step = 0; step < 2; ++step) {
    auto m = (*engine)->step(in, tg);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    losses.push_back(m->loss);
    const OffloadStats st = (*engine)->stats();
    std::printf("step %d: loss %.4f, grad norm %.4f, %.1f s; h2d %.2f GB, d2h %.2f GB, NVMe read %.2f GB, "
                "written %.2f GB, prefetch hit rate %.3f\n",
                step + 1, m->loss, m->grad_norm, m->seconds, st.bytes_h2d / 1e9, st.bytes_d2h / 1e9,
                st.bytes_nvme_read / 1e9, st.bytes_nvme_written / 1e9, st.hit_rate());
  }
  ASSERT_TRUE((*engine)->synchronize().ok());
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  const double peak_gib = static_cast<double>(ru.ru_maxrss) / (1024.0 * 1024.0);
  std::printf("peak RSS %.2f GiB (device budget 2 GiB is host memory on the cpu backend)\n", peak_gib);
  EXPECT_LT(losses[1], losses[0]) << "the second step on the same batch must lower its loss";
  // Device (emulated in host memory here) + host tiers + the process itself.
  EXPECT_LT(peak_gib, 2.0 + 8.0 + 1.0);
  EXPECT_EQ((*engine)->stats().allocations_after_warmup, 0u);
}

}  // namespace
}  // namespace strata::testing
