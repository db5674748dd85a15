// The engine's tracer (src/runtime/trace.hpp) on the cpu backend: off costs nothing on the
// stream, stream spans pair up last-in first-out and nest, counters add up the spans, and the
// JSON is the Chrome/Perfetto format.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "harness/harness.hpp"
#include "runtime/trace.hpp"
#include "strata/device.hpp"

namespace strata::testing {
namespace {

using detail::TraceCounter;
using detail::Tracer;

std::unique_ptr<Device> cpu_device() {
  DeviceConfig cfg;
  cfg.memory_bytes = 16u << 20;
  cfg.pinned_bytes = 4u << 20;
  cfg.compute_threads = 1;
  auto d = Device::create(cfg);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return std::move(*d);
}

TEST(Tracer, OffEnqueuesNothingOnTheStream) {
  auto dev = cpu_device();
  auto stream = dev->create_stream("s");
  ASSERT_TRUE(stream.ok());
  Tracer tracer;
  const int t = tracer.add_track("s");
  const std::uint64_t before = dev->stats().host_fns;
  for (int i = 0; i < 10; ++i) {
    STRATA_ASSERT_OK(tracer.stream_begin(**stream, t));
    STRATA_ASSERT_OK(tracer.stream_end(**stream, t, TraceCounter::kCompute, "work", i));
  }
  STRATA_ASSERT_OK((*stream)->synchronize());
  EXPECT_EQ(dev->stats().host_fns, before);
  EXPECT_EQ(tracer.span_count(), 0u);
  EXPECT_EQ(tracer.seconds(TraceCounter::kCompute), 0.0);
}

TEST(Tracer, StreamSpansNestAndCountersAddThemUp) {
  auto dev = cpu_device();
  auto stream = dev->create_stream("s");
  ASSERT_TRUE(stream.ok());
  Stream& s = **stream;
  Tracer tracer;
  const int outer_track = tracer.add_track("outer");
  const int t = tracer.add_track("stream s");
  tracer.set_spans(true);
  const std::uint64_t before = dev->stats().host_fns;
  volatile double sink = 0;
  auto busy = [&sink]() {
    for (int i = 0; i < 200000; ++i) sink = sink + 1e-9 * i;
    return ok_status();
  };
  {
    detail::HostSpan outer(tracer, outer_track, TraceCounter::kNone, "outer");
    STRATA_ASSERT_OK(tracer.stream_begin(s, t));  // "fetch" around two "copy"s
    for (int k = 0; k < 2; ++k) {
      STRATA_ASSERT_OK(tracer.stream_begin(s, t));
      STRATA_ASSERT_OK(s.host_fn("busy", busy));
      STRATA_ASSERT_OK(tracer.stream_end(s, t, TraceCounter::kH2D, "copy", 3, 1000 + k));
    }
    STRATA_ASSERT_OK(tracer.stream_end(s, t, TraceCounter::kNone, "fetch", 3, 2001));
    STRATA_ASSERT_OK(s.synchronize());
  }
  EXPECT_EQ(dev->stats().host_fns - before, 2u + 2u * 3u);  // begin/end pairs and the two busy fns
  EXPECT_EQ(tracer.span_count(), 4u);

  TempDir dir;
  const auto path = (dir / "t.json").string();
  STRATA_ASSERT_OK(tracer.write_json(path, "test", [](int u) { return "unit" + std::to_string(u); }));
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  std::vector<nlohmann::json> spans;
  std::map<int, std::string> names;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") names[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") spans.push_back(e);
  }
  EXPECT_EQ(names[1], "outer");
  EXPECT_EQ(names[2], "stream s");
  ASSERT_EQ(spans.size(), 4u);
  // The outer host span comes first (track 1); then the stream track by start time: fetch, copy, copy.
  EXPECT_EQ(spans[0]["name"], "outer");
  EXPECT_EQ(spans[1]["name"], "fetch unit3");
  EXPECT_EQ(spans[1]["args"]["bytes"], 2001);
  EXPECT_EQ(spans[2]["name"], "copy unit3");
  EXPECT_EQ(spans[2]["args"]["bytes"], 1000);
  EXPECT_EQ(spans[3]["args"]["bytes"], 1001);
  const double f0 = spans[1]["ts"], f1 = f0 + spans[1]["dur"].get<double>();
  double copies_us = 0;
  for (int k = 2; k < 4; ++k) {
    const double c0 = spans[k]["ts"], c1 = c0 + spans[k]["dur"].get<double>();
    EXPECT_GE(c0, f0);
    EXPECT_LE(c1, f1);
    EXPECT_GT(spans[k]["dur"].get<double>(), 0.0);
    copies_us += spans[k]["dur"].get<double>();
  }
  EXPECT_GE(spans[3]["ts"].get<double>(), spans[2]["ts"].get<double>() + spans[2]["dur"].get<double>());
  // The H2D counter is the two copies (the file rounds to nanoseconds).
  EXPECT_NEAR(tracer.seconds(TraceCounter::kH2D) * 1e6, copies_us, 0.01);
  EXPECT_EQ(tracer.seconds(TraceCounter::kNone), 0.0);
  // The host span holds the whole stream work (it ended after synchronize).
  EXPECT_LE(spans[0]["ts"].get<double>(), f0);
  EXPECT_GE(spans[0]["ts"].get<double>() + spans[0]["dur"].get<double>(), f1);
}

TEST(Tracer, KeepsAtMostMaxSpansAndSaysHowManyWereDropped) {
  Tracer tracer;
  const int t = tracer.add_track("host");
  tracer.set_spans(true, 3);
  for (int i = 0; i < 5; ++i) tracer.add_span(t, TraceCounter::kOptimizer, "adam", i, 0, tracer.now_ns());
  EXPECT_EQ(tracer.span_count(), 3u);
  TempDir dir;
  const auto path = (dir / "t.json").string();
  STRATA_ASSERT_OK(tracer.write_json(path, "test", [](int u) { return std::to_string(u); }));
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["otherData"]["dropped_spans"], 2);
}

TEST(Tracer, AnUnwritableFileIsAnErrorNamingIt) {
  Tracer tracer;
  Status s = tracer.write_json("/nonexistent-dir/t.json", "x", [](int u) { return std::to_string(u); });
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent-dir/t.json"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace strata::testing
