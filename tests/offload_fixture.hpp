// Shared by the offload-engine and checkpoint tests: a small cpu device, tiny models, deterministic
// batches, and snapshots of the complete training state compared bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness/harness.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::testing {

inline std::unique_ptr<Device> make_device() {
  DeviceConfig dc;
  dc.kind = DeviceKind::kCpu;
  dc.memory_bytes = 256ull << 20;
  dc.pinned_bytes = 64ull << 20;
  dc.compute_threads = 1;
  auto d = Device::create(dc);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return std::move(d).value();
}

inline TrainerConfig tiny(ModelKind kind, DType dtype, std::int64_t accum, double clip) {
  TrainerConfig t;
  t.model.kind = kind;
  t.model.n_layer = 3;
  t.model.n_embd = 64;
  t.model.n_head = 4;
  t.model.n_kv_head = kind == ModelKind::kLlama ? 2 : 0;
  t.model.n_positions = 32;
  t.model.vocab_size = 97;  // padded to 128: padding rows must stay untouched everywhere
  t.model.dtype = dtype;
  t.micro_batch = 2;
  t.grad_accum = accum;
  t.seq_len = 16;
  t.schedule.kind = LrScheduleKind::kConstant;
  t.schedule.lr = 1e-2;
  t.optimizer.weight_decay = 0.1;
  t.grad_clip = clip;
  if (dtype == DType::kF16) {
    // A scale the tiny model's gradients fit under, raised every two good steps so that it soon
    // overflows again: the runs exercise both skipped and applied steps.
    t.loss_scaling.initial_scale_power = 10;
    t.loss_scaling.loss_scale_window = 2;
    t.loss_scaling.hysteresis = 1;
  }
  return t;
}

// Deterministic tokens for step `s`: inputs and next-token targets.
inline void batch(const TrainerConfig& c, int s, std::vector<std::int32_t>& in, std::vector<std::int32_t>& tg) {
  const std::size_t n = static_cast<std::size_t>(c.grad_accum * c.micro_batch * c.seq_len);
  in.resize(n);
  tg.resize(n);
  std::mt19937 rng(1000u + static_cast<unsigned>(s));
  for (std::size_t i = 0; i < n; ++i) {
    in[i] = static_cast<std::int32_t>(rng() % static_cast<unsigned>(c.model.vocab_size));
    tg[i] = i % 7 == 3 ? -1 : static_cast<std::int32_t>((in[i] * 5 + 3) % c.model.vocab_size);
  }
}

struct Snapshot {
  std::vector<double> losses, norms, scales;
  std::vector<int> skipped;
  std::vector<std::vector<float>> param, master, m, v;
};

// Steps [from, to) of the deterministic batches, appending losses and norms.
inline bool run_steps(OffloadEngine& engine, const TrainerConfig& c, int from, int to, Snapshot& out) {
  std::vector<std::int32_t> in, tg;
  for (int i = from; i < to; ++i) {
    batch(c, i, in, tg);
    auto m = engine.step(in, tg);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return false;
    out.losses.push_back(m->loss);
    out.norms.push_back(m->grad_norm);
    out.scales.push_back(m->loss_scale);
    out.skipped.push_back(m->skipped ? 1 : 0);
  }
  return true;
}

// Appends parameter `idx`'s working copy, master and moments to `out`; false (with a failure
// naming `what`) when any of them cannot be read.
inline bool append_state(OffloadEngine& engine, int idx, const std::string& what, Snapshot& out) {
  auto p = engine.get_param(idx);
  auto ma = engine.get_master(idx);
  auto mm = engine.get_exp_avg(idx);
  auto vv = engine.get_exp_avg_sq(idx);
  EXPECT_TRUE(p.ok() && ma.ok() && mm.ok() && vv.ok()) << what;
  if (!(p.ok() && ma.ok() && mm.ok() && vv.ok())) return false;
  out.param.push_back(*p);
  out.master.push_back(*ma);
  out.m.push_back(*mm);
  out.v.push_back(*vv);
  return true;
}

// The complete state of every parameter that owns storage.
inline bool capture_state(OffloadEngine& engine, Snapshot& out) {
  const ModelLayout& L = engine.model().layout();
  out.param.clear();
  out.master.clear();
  out.m.clear();
  out.v.clear();
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    if (!L.params[i].owns_storage()) continue;
    const int idx = static_cast<int>(i);
    if (!append_state(engine, idx, L.params[i].name, out)) return false;
  }
  return true;
}

inline Snapshot train(const TrainerConfig& c, const OffloadSettings& s, int steps) {
  Snapshot out;
  auto device = make_device();
  auto engine = OffloadEngine::create(c, s, *device);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  if (!run_steps(**engine, c, 0, steps, out)) return out;
  capture_state(**engine, out);
  return out;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

inline void expect_same(const Snapshot& ref, const Snapshot& got, const std::string& what) {
  ASSERT_EQ(ref.param.size(), got.param.size()) << what;
  ASSERT_FALSE(ref.param.empty()) << what;
  ASSERT_EQ(ref.losses.size(), got.losses.size()) << what;
  ASSERT_EQ(ref.norms.size(), ref.losses.size()) << what;
  ASSERT_EQ(got.norms.size(), got.losses.size()) << what;
  ASSERT_EQ(ref.scales.size(), ref.losses.size()) << what;
  ASSERT_EQ(got.scales.size(), got.losses.size()) << what;
  ASSERT_EQ(ref.skipped.size(), ref.losses.size()) << what;
  ASSERT_EQ(got.skipped.size(), got.losses.size()) << what;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_EQ(ref.losses[i], got.losses[i]) << what << ": loss of step " << i + 1;
    // An fp16 step that overflowed reports a non-finite norm (nan equals nan here).
    EXPECT_TRUE(ref.norms[i] == got.norms[i] || (std::isnan(ref.norms[i]) && std::isnan(got.norms[i])))
        << what << ": gradient norm of step " << i + 1 << ": " << ref.norms[i] << " vs " << got.norms[i];
    EXPECT_EQ(ref.scales[i], got.scales[i]) << what << ": loss scale of step " << i + 1;
    EXPECT_EQ(ref.skipped[i], got.skipped[i]) << what << ": skipped flag of step " << i + 1;
  }
  for (std::size_t i = 0; i < ref.param.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(ref.param[i], got.param[i])) << what << ": working parameter " << i;
    EXPECT_TRUE(bitwise_equal(ref.master[i], got.master[i])) << what << ": master " << i;
    EXPECT_TRUE(bitwise_equal(ref.m[i], got.m[i])) << what << ": exp_avg " << i;
    EXPECT_TRUE(bitwise_equal(ref.v[i], got.v[i])) << what << ": exp_avg_sq " << i;
  }
}

struct Placement {
  Tier params, optimizer;
};

inline const Placement kPlacements[] = {
    {Tier::kDevice, Tier::kHost}, {Tier::kDevice, Tier::kNvme}, {Tier::kHost, Tier::kHost},
    {Tier::kHost, Tier::kNvme},   {Tier::kNvme, Tier::kHost},   {Tier::kNvme, Tier::kNvme},
};

inline OffloadSettings settings_for(Placement p, const TempDir& dir) {
  OffloadSettings s;
  s.params = p.params;
  s.optimizer = p.optimizer;
  s.persistence_threshold = 0;  // every module moves
  s.nvme_path = {dir.path().string()};
  s.io.backend = IoBackendKind::kAuto;
  return s;
}

}  // namespace strata::testing
