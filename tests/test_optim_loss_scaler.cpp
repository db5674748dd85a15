// The DeepSpeed loss scaler: state machine transitions (hysteresis, window, floor, static scale),
// its settings from the config's fp16 section, and checkpoint state; optimizer hyperparameters
// from the config's optimizer section.
#include <cmath>
#include <vector>

#include "harness/harness.hpp"
#include "strata/config.hpp"
#include "strata/optim.hpp"

namespace strata {
namespace {

LossScaler make(const LossScalerConfig& c) {
  auto r = LossScaler::create(c);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

LossScalerConfig small_window() {
  LossScalerConfig c;
  c.loss_scale = 0;
  c.initial_scale_power = 16;
  c.loss_scale_window = 4;
  c.hysteresis = 2;
  c.min_loss_scale = 1;
  return c;
}

struct Expect {
  bool overflow;
  bool applied;
  double scale_after;
  int hysteresis_after;
};

void run(LossScaler& s, const std::vector<Expect>& seq) {
  for (std::size_t k = 0; k < seq.size(); ++k) {
    auto r = s.update(seq[k].overflow);
    ASSERT_TRUE(r.ok()) << "step " << k << ": " << r.status().to_string();
    EXPECT_EQ(*r, seq[k].applied) << "step " << k;
    EXPECT_EQ(s.scale(), seq[k].scale_after) << "step " << k;
    EXPECT_EQ(s.state().hysteresis_left, seq[k].hysteresis_after) << "step " << k;
  }
}

TEST(LossScaler, StartsAtTwoToTheInitialPower) {
  LossScaler s = make(small_window());
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.inv_scale(), 1.0f / 65536.0f);
  EXPECT_EQ(s.state().hysteresis_left, 2);
}

TEST(LossScaler, WindowHysteresisAndHalving) {
  LossScaler s = make(small_window());
  run(s, {
             {false, true, 65536, 2},
             {false, true, 65536, 2},
             {false, true, 65536, 2},
             {false, true, 131072, 2},  // 4 good steps since the start: double
             {true, false, 131072, 1},  // first overflow spends hysteresis, scale kept
             {true, false, 65536, 1},   // second overflow halves
             {false, true, 65536, 1},   // hysteresis is not refilled by good steps...
             {true, false, 32768, 1},   // ...so the next overflow halves at once
             {false, true, 32768, 1},
             {false, true, 32768, 1},
             {false, true, 32768, 1},
             {false, true, 65536, 2},  // 4 good steps since the last overflow: double, refill
         });
  EXPECT_EQ(s.state().iteration, 12);
  EXPECT_EQ(s.state().last_overflow_iteration, 7);
  EXPECT_EQ(s.state().overflows, 3);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryGoodStep) {
  LossScalerConfig c = small_window();
  c.consecutive_hysteresis = true;
  LossScaler s = make(c);
  run(s, {
             {true, false, 65536, 1},
             {false, true, 65536, 2},  // refilled
             {true, false, 65536, 1},  // so this overflow is absorbed too
             {true, false, 32768, 1},
         });
}

TEST(LossScaler, FloorAndErrorAtMinimum) {
  LossScalerConfig c = small_window();
  c.initial_scale_power = 2;
  c.hysteresis = 1;
  c.min_loss_scale = 2;
  LossScaler s = make(c);
  run(s, {{true, false, 2, 1}});
  // At the floor with no hysteresis left: DeepSpeed raises; so do we, without changing state.
  const LossScalerState before = s.state();
  STRATA_EXPECT_ERROR(s.update(true), kFailedPrecondition, "fp16.min_loss_scale");
  EXPECT_EQ(s.state().iteration, before.iteration);
  c.raise_error_at_min_scale = false;
  LossScaler quiet = make(c);
  run(quiet, {{true, false, 2, 1}, {true, false, 2, 1}, {false, true, 2, 1}});
}

TEST(LossScaler, HalvingStopsAtMinimumEvenFromAnOddScale) {
  LossScalerConfig c = small_window();
  c.initial_scale_power = 3;  // 8
  c.hysteresis = 1;
  c.min_loss_scale = 3;
  LossScaler s = make(c);
  run(s, {{true, false, 4, 1}, {true, false, 3, 1}});
}

TEST(LossScaler, StaticScaleNeverMovesButStillSkipsOverflow) {
  LossScalerConfig c;
  c.loss_scale = 128;
  LossScaler s = make(c);
  EXPECT_FALSE(s.dynamic());
  for (int k = 0; k < 3000; ++k) {
    auto r = s.update(k % 7 == 3);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, k % 7 != 3);
    ASSERT_EQ(s.scale(), 128.0);
  }
}

TEST(LossScaler, ComesFromTheConfigsFp16Section) {
  auto cfg = parse_config(R"({"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
      "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": true, "min_loss_scale": 0.5}})",
                          "test.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  const LossScalerConfig c = LossScalerConfig::from_config(cfg->fp16);
  EXPECT_TRUE(c.enabled);
  EXPECT_EQ(c.loss_scale, 0.0);
  EXPECT_EQ(c.initial_scale_power, 12);
  EXPECT_EQ(c.loss_scale_window, 500);
  EXPECT_EQ(c.hysteresis, 3);
  EXPECT_TRUE(c.consecutive_hysteresis);
  EXPECT_EQ(c.min_loss_scale, 0.5);
  EXPECT_EQ(make(c).scale(), 4096.0);
  // DeepSpeed's defaults when the section is absent.
  auto d = parse_config("{}", "empty.json");
  ASSERT_TRUE(d.ok());
  const LossScalerConfig dc = LossScalerConfig::from_config(d->fp16);
  EXPECT_EQ(dc.loss_scale_window, 1000);
  EXPECT_EQ(dc.hysteresis, 2);
  EXPECT_EQ(make(dc).scale(), 65536.0);
}

TEST(LossScaler, RejectsBadSettings) {
  auto with = [](auto edit) {
    LossScalerConfig c;
    edit(c);
    return LossScaler::create(c);
  };
  STRATA_EXPECT_ERROR(with([](LossScalerConfig& c) { c.hysteresis = 0; }), kInvalidArgument,
                      "fp16.hysteresis");
  STRATA_EXPECT_ERROR(with([](LossScalerConfig& c) { c.loss_scale = -1; }), kInvalidArgument,
                      "fp16.loss_scale");
  STRATA_EXPECT_ERROR(with([](LossScalerConfig& c) { c.loss_scale_window = 0; }), kInvalidArgument,
                      "fp16.loss_scale_window");
  STRATA_EXPECT_ERROR(with([](LossScalerConfig& c) { c.initial_scale_power = 200; }), kInvalidArgument,
                      "fp16.initial_scale_power");
  STRATA_EXPECT_ERROR(with([](LossScalerConfig& c) { c.min_loss_scale = 0; }), kInvalidArgument,
                      "fp16.min_loss_scale");
  STRATA_EXPECT_ERROR(with([](LossScalerConfig& c) {
                        c.initial_scale_power = 0;
                        c.min_loss_scale = 4;
                      }),
                      kInvalidArgument, "starts below");
}

TEST(OptimizerHyperFromConfig, MapsDeepSpeedOptimizerSections) {
  auto adam = parse_config(R"({"optimizer": {"type": "Adam", "params": {"lr": 0.002, "betas": [0.8, 0.99],
      "eps": 1e-6, "weight_decay": 0.1}}})",
                           "a.json");
  ASSERT_TRUE(adam.ok()) << adam.status().to_string();
  const OptimizerHyper h = OptimizerHyper::from_config(adam->optimizer);
  EXPECT_EQ(h.kind, OptimizerKind::kAdamW);  // adam_w_mode defaults to true, as in DeepSpeed
  EXPECT_EQ(h.lr, 0.002);
  EXPECT_EQ(h.beta1, 0.8);
  EXPECT_EQ(h.beta2, 0.99);
  EXPECT_EQ(h.eps, 1e-6);
  EXPECT_EQ(h.weight_decay, 0.1);
  auto l2 = parse_config(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})", "b.json");
  ASSERT_TRUE(l2.ok()) << l2.status().to_string();
  EXPECT_EQ(OptimizerHyper::from_config(l2->optimizer).kind, OptimizerKind::kAdam);
  auto lion = parse_config(R"({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})", "c.json");
  ASSERT_TRUE(lion.ok()) << lion.status().to_string();
  EXPECT_EQ(OptimizerHyper::from_config(lion->optimizer).kind, OptimizerKind::kLion);
  STRATA_EXPECT_OK(OptimizerHyper::from_config(lion->optimizer).validate());
  auto ada = parse_config(R"({"optimizer": {"type": "Adagrad"}})", "d.json");
  ASSERT_TRUE(ada.ok()) << ada.status().to_string();
  const OptimizerHyper a = OptimizerHyper::from_config(ada->optimizer);
  EXPECT_EQ(a.kind, OptimizerKind::kAdagrad);
  EXPECT_EQ(a.lr, 1e-2);
  EXPECT_EQ(a.eps, 1e-10);
}

TEST(LossScaler, StateRoundTripsAndRestoreValidates) {
  LossScaler a = make(small_window());
  for (bool o : {false, true, false, false, true, true, false}) ASSERT_TRUE(a.update(o).ok());
  LossScaler b = make(small_window());
  STRATA_ASSERT_OK(b.restore(a.state()));
  for (bool o : {false, false, false, false, true, false, true, true}) {
    auto ra = a.update(o);
    auto rb = b.update(o);
    ASSERT_TRUE(ra.ok() && rb.ok());
    EXPECT_EQ(*ra, *rb);
    EXPECT_EQ(a.scale(), b.scale());
    EXPECT_EQ(a.state().hysteresis_left, b.state().hysteresis_left);
  }
  LossScalerState bad = a.state();
  bad.scale = 0.5;  // below min_loss_scale
  STRATA_EXPECT_ERROR(b.restore(bad), kInvalidArgument, "min_loss_scale");
  bad = a.state();
  bad.hysteresis_left = 3;
  STRATA_EXPECT_ERROR(b.restore(bad), kInvalidArgument, "hysteresis left");
  bad = a.state();
  bad.last_overflow_iteration = bad.iteration;
  STRATA_EXPECT_ERROR(b.restore(bad), kInvalidArgument, "last overflow iteration");
  LossScalerConfig st;
  st.loss_scale = 8;
  LossScaler s = make(st);
  LossScalerState other = s.state();
  other.scale = 16;
  STRATA_EXPECT_ERROR(s.restore(other), kInvalidArgument, "static fp16.loss_scale");
}

}  // namespace
}  // namespace strata
