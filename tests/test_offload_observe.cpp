// Observing the offload engine: stream timing and tracing change no result, are absent when off,
// and the trace holds the engine's spans only when asked for.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "harness/harness.hpp"
#include "strata/device.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

struct Observed {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  OffloadStats stats;
  std::size_t trace_spans = 0;
};

Observed train(const ObserveSettings* observe, const std::filesystem::path& trace) {
  DeviceConfig dc;
  dc.memory_bytes = 64ull << 20;
  dc.pinned_bytes = 32ull << 20;
  dc.compute_threads = 1;
  auto device = Device::create(dc);
  EXPECT_TRUE(device.ok()) << device.status().to_string();
  TrainerConfig c;
  c.model.n_layer = 2;
  c.model.n_embd = 32;
  c.model.n_head = 2;
  c.model.n_positions = 16;
  c.model.vocab_size = 61;
  c.micro_batch = 2;
  c.seq_len = 16;
  c.grad_accum = 2;
  c.schedule.kind = LrScheduleKind::kConstant;
  c.schedule.lr = 1e-2;
  OffloadSettings s;
  s.params = Tier::kHost;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;  // every module fetched: the h2d stream has work
  auto engine = OffloadEngine::create(c, s, **device);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  Observed out;
  if (!engine.ok()) return out;
  if (observe != nullptr) (*engine)->observe(*observe);
  const std::size_t n = static_cast<std::size_t>(c.grad_accum * c.micro_batch * c.seq_len);
  std::vector<std::int32_t> in(n), tg(n);
  std::mt19937 rng(7);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < n; ++i) {
      in[i] = static_cast<std::int32_t>(rng() % 61);
      tg[i] = (in[i] * 3 + 1) % 61;
    }
    auto m = (*engine)->step(in, tg);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return out;
    out.losses.push_back(m->loss);
  }
  STRATA_EXPECT_OK((*engine)->synchronize());
  out.stats = (*engine)->stats();
  const auto& params = (*engine)->model().layout().params;
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto p = (*engine)->get_param(static_cast<int>(i));
    EXPECT_TRUE(p.ok());
    if (p.ok()) out.params.push_back(*p);
  }
  STRATA_EXPECT_OK((*engine)->write_trace(trace.string()));
  std::ifstream f(trace);
  const auto j = nlohmann::json::parse(f);
  for (const auto& e : j["traceEvents"]) out.trace_spans += e["ph"] == "X" ? 1 : 0;
  return out;
}

TEST(OffloadObserve, TimingAndTracingChangeNoResultAndAreAbsentWhenOff) {
  TempDir dir;
  const Observed off = train(nullptr, dir / "off.json");
  ObserveSettings on;
  on.trace = true;
  const Observed traced = train(&on, dir / "on.json");
  ASSERT_EQ(off.params.size(), traced.params.size());
  EXPECT_EQ(off.losses, traced.losses);
  for (std::size_t i = 0; i < off.params.size(); ++i)
    EXPECT_EQ(off.params[i], traced.params[i]) << "param " << i;

  // Off: no stream-side seconds and no spans; host-side seconds are measured regardless.
  EXPECT_FALSE(off.stats.stream_times);
  EXPECT_EQ(off.stats.compute_seconds, 0.0);
  EXPECT_EQ(off.stats.h2d_seconds, 0.0);
  EXPECT_EQ(off.stats.d2h_seconds, 0.0);
  EXPECT_EQ(off.stats.fetch_stall_seconds, 0.0);
  EXPECT_GT(off.stats.optimizer_seconds, 0.0);
  EXPECT_EQ(off.trace_spans, 0u);

  EXPECT_TRUE(traced.stats.stream_times);
  EXPECT_GT(traced.stats.compute_seconds, 0.0);
  EXPECT_GT(traced.stats.h2d_seconds, 0.0);
  EXPECT_GT(traced.stats.d2h_seconds, 0.0);
  EXPECT_GT(traced.stats.optimizer_seconds, 0.0);
  EXPECT_GT(traced.stats.optimizer_cpu_seconds, 0.0);
  // The same traffic either way.
  EXPECT_EQ(off.stats.bytes_h2d, traced.stats.bytes_h2d);
  EXPECT_EQ(off.stats.bytes_d2h, traced.stats.bytes_d2h);
  // Spans per step: at least forward, backward and one wait per module per micro-batch.
  EXPECT_GT(traced.trace_spans, 3u * 2u * 3u * 4u);
}

}  // namespace
}  // namespace strata::testing
