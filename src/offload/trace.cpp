// The engine's timeline (trace.hpp).
#include "offload/trace.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "strata/device.hpp"

namespace strata::detail {

Tracer::Tracer() : epoch_(std::chrono::steady_clock::now()) {
  for (auto& c : counter_ns_) c.store(0, std::memory_order_relaxed);
}

int Tracer::add_track(std::string name) {
  tracks_.emplace_back();
  tracks_.back().name = std::move(name);
  return static_cast<int>(tracks_.size()) - 1;
}

void Tracer::set_spans(bool on, std::size_t max_spans) {
  max_spans_ = max_spans;
  spans_.store(on);
  if (on) timing_.store(true);
}

void Tracer::record(Track& t, TraceCounter counter, const TraceSpan& span) {
  if (counter != TraceCounter::kNone) {
    counter_ns_[static_cast<std::size_t>(counter)].fetch_add(
        std::max<std::int64_t>(0, span.end_ns - span.begin_ns), std::memory_order_relaxed);
  }
  if (!spans()) return;
  if (kept_.fetch_add(1, std::memory_order_relaxed) >= max_spans_) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::lock_guard<std::mutex> lock(t.mu);
  t.spans.push_back(span);
}

void Tracer::add_span(int track, TraceCounter counter, const char* what, int unit, std::uint64_t bytes,
                      std::int64_t begin_ns) {
  record(tracks_[static_cast<std::size_t>(track)], counter, TraceSpan{what, unit, bytes, begin_ns, now_ns()});
}

Status Tracer::stream_begin(Stream& stream, int track) {
  if (!timing()) return ok_status();
  Track* t = &tracks_[static_cast<std::size_t>(track)];
  return stream.host_fn("trace", [this, t]() {
    const std::int64_t now = now_ns();
    std::lock_guard<std::mutex> lock(t->mu);
    t->open.push_back(now);
    return ok_status();
  });
}

Status Tracer::stream_end(Stream& stream, int track, TraceCounter counter, const char* what, int unit,
                          std::uint64_t bytes) {
  if (!timing()) return ok_status();
  Track* t = &tracks_[static_cast<std::size_t>(track)];
  return stream.host_fn("trace", [this, t, counter, what, unit, bytes]() {
    const std::int64_t now = now_ns();
    std::int64_t begin = now;
    {
      std::lock_guard<std::mutex> lock(t->mu);
      // Empty only when the begin was skipped by an earlier failure of the stream.
      if (!t->open.empty()) {
        begin = t->open.back();
        t->open.pop_back();
      }
    }
    record(*t, counter, TraceSpan{what, unit, bytes, begin, now});
    return ok_status();
  });
}

double Tracer::seconds(TraceCounter counter) const {
  return 1e-9 *
         static_cast<double>(counter_ns_[static_cast<std::size_t>(counter)].load(std::memory_order_relaxed));
}

std::size_t Tracer::span_count() const {
  std::size_t n = 0;
  for (const Track& t : tracks_) {
    std::lock_guard<std::mutex> lock(t.mu);
    n += t.spans.size();
  }
  return n;
}

Status Tracer::write_json(const std::string& path, const std::string& process_name,
                          const std::function<std::string(int)>& unit_name) const {
  using Json = nlohmann::ordered_json;
  constexpr int kPid = 1;
  // One event per line: the file stays readable with grep and a partial write is easy to spot.
  std::ofstream out(path, std::ios::trunc);
  if (!out) return io_error("trace file '" + path + "' cannot be opened for writing");
  out << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"dropped_spans\":" << dropped_.load()
      << "},\n\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const Json& j) {
    if (!first) out << ",\n";
    first = false;
    out << j.dump();
  };
  emit(Json{
      {"ph", "M"}, {"name", "process_name"}, {"pid", kPid}, {"tid", 0}, {"args", {{"name", process_name}}}});
  for (std::size_t i = 0; i < tracks_.size(); ++i) {
    const int tid = static_cast<int>(i) + 1;
    emit(Json{{"ph", "M"},
              {"name", "thread_name"},
              {"pid", kPid},
              {"tid", tid},
              {"args", {{"name", tracks_[i].name}}}});
    emit(Json{{"ph", "M"},
              {"name", "thread_sort_index"},
              {"pid", kPid},
              {"tid", tid},
              {"args", {{"sort_index", tid}}}});
  }
  for (std::size_t i = 0; i < tracks_.size(); ++i) {
    std::vector<TraceSpan> spans;
    {
      std::lock_guard<std::mutex> lock(tracks_[i].mu);
      spans = tracks_[i].spans;
    }
    // Viewers want a track's spans by start time, the outer of two equal starts first.
    std::stable_sort(spans.begin(), spans.end(), [](const TraceSpan& a, const TraceSpan& b) {
      return a.begin_ns != b.begin_ns ? a.begin_ns < b.begin_ns : a.end_ns > b.end_ns;
    });
    for (const TraceSpan& s : spans) {
      Json j{{"ph", "X"}, {"pid", kPid}, {"tid", static_cast<int>(i) + 1}};
      std::string name = s.what;
      Json args = Json::object();
      if (s.unit >= 0) {
        const std::string un = unit_name(s.unit);
        name += " " + un;
        args["module"] = un;
        args["unit"] = s.unit;
      }
      if (s.bytes > 0) args["bytes"] = s.bytes;
      j["name"] = name;
      j["cat"] = tracks_[i].name;
      // Microseconds, as the format wants; nanosecond resolution kept in the fraction.
      j["ts"] = static_cast<double>(s.begin_ns) / 1e3;
      j["dur"] = static_cast<double>(std::max<std::int64_t>(0, s.end_ns - s.begin_ns)) / 1e3;
      j["args"] = args;
      emit(j);
    }
  }
  out << "\n]}\n";
  out.flush();
  if (!out) return io_error("trace file '" + path + "': write failed (disk full?)");
  return ok_status();
}

}  // namespace strata::detail
