// The one-step delayed update's convergence against the ordinary step: `strata train` trains the
// default model (GPT-2, 4 blocks of width 256, 8 x 128 tokens of the built-in corpus, lr 3e-3 with
// warmup-cosine, clipping 1.0, beta2 0.95) for 200 steps with the parameters on the device and the
// optimizer on the host, once ordinarily and once with --delayed-update (warm-up 1 step), on the
// same batches, and prints both curves (every 20th step) and the last 20 steps' mean.
//
// The delayed run's gradients are one update stale. On this small model at these learning rates it
// trains clearly worse: measured on 2 cpus (compute 1 thread, host 1), the mean training loss of
// the last 20 steps was 1.852 ordinary vs 2.439 delayed (+31.7%), validation 1.862 vs 2.423
// (+30.1%); the ordinary run's loss spikes (gradient norm x20 for a step) are answered one step
// late and take longer to recover from. (Lower learning rates did not close the gap: lr 1e-3 gave
// 1.314 vs 2.179, lr 3e-4 1.740 vs 1.957; a 40-step warm-up at lr 3e-3 2.158.) So the test holds
// the delayed run to what was measured, with room for another machine's thread counts: it must
// train (validation below 0.8 x the unigram baseline of the corpus, 3.23 nats/token) and stay
// within 40% of the ordinary run. The bit-exact semantics are tested in
// test_offload_delayed_update.cpp; this test only watches the trade-off.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/harness.hpp"

namespace strata {
namespace {

using testing::read_jsonl;
using testing::run_cli;
using testing::TempDir;

struct Curve {
  std::vector<double> loss;
  double val_loss = 0;
};

Curve train(const std::string& flags, const TempDir& dir, const std::string& name) {
  const std::string metrics = (dir / (name + ".jsonl")).string();
  auto t = run_cli(
      "train --steps 200 --offload-param none --offload-optimizer cpu --quiet --val-every 0 --metrics " +
      metrics + " " + flags);
  EXPECT_EQ(t.exit_code, 0) << t.output;
  Curve c;
  for (const auto& m : read_jsonl(metrics)) {
    if (m.contains("loss")) c.loss.push_back(m["loss"].get<double>());
    if (m.contains("val_loss")) c.val_loss = m["val_loss"].get<double>();
  }
  return c;
}

double tail_mean(const std::vector<double>& v, std::size_t n) {
  double s = 0;
  for (std::size_t i = v.size() - n; i < v.size(); ++i) s += v[i];
  return s / static_cast<double>(n);
}

TEST(DelayedUpdateConvergence, TrainsWithinFortyPercentOfTheOrdinaryStep) {
  TempDir dir("strata-dpu-convergence");
  const Curve ordinary = train("", dir, "ordinary");
  const Curve delayed = train("--delayed-update", dir, "delayed");
  ASSERT_EQ(ordinary.loss.size(), 200u);
  ASSERT_EQ(delayed.loss.size(), 200u);
  ASSERT_GT(ordinary.val_loss, 0.0);
  ASSERT_GT(delayed.val_loss, 0.0);
  std::printf("step  ordinary  delayed\n");
  for (std::size_t i = 0; i < 200; i += 20)
    std::printf("%4zu  %8.4f  %8.4f\n", i + 1, ordinary.loss[i], delayed.loss[i]);
  std::printf("%4d  %8.4f  %8.4f\n", 200, ordinary.loss.back(), delayed.loss.back());
  const double a = tail_mean(ordinary.loss, 20), b = tail_mean(delayed.loss, 20);
  std::printf("mean of the last 20 steps: ordinary %.4f, delayed %.4f (%+.2f%%)\n", a, b,
              100.0 * (b - a) / a);
  std::printf("validation loss: ordinary %.4f, delayed %.4f (%+.2f%%)\n", ordinary.val_loss, delayed.val_loss,
              100.0 * (delayed.val_loss - ordinary.val_loss) / ordinary.val_loss);
  // Both trained (far below the first step's loss and the unigram baseline), the delayed run
  // within the stated margin of the ordinary one.
  constexpr double kUnigram = 3.2315;
  EXPECT_LT(a, 0.7 * ordinary.loss.front());
  EXPECT_LT(delayed.val_loss, 0.8 * kUnigram);
  EXPECT_LE(std::fabs(b - a), 0.40 * a);
  EXPECT_LE(std::fabs(delayed.val_loss - ordinary.val_loss), 0.40 * ordinary.val_loss);
}

}  // namespace
}  // namespace strata
