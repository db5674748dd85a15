// The engine's timeline: spans on named tracks (one per stream, copy engine, the host optimizer
// thread, NVMe lanes, the engine's caller), written as Chrome/Perfetto trace JSON, and the
// per-counter busy/stall seconds that OffloadStats reports.
//
// Two switches, both off by default:
//   timing - stream-side spans are measured: a host function on the stream before and after the
//            work (cheap on the cpu backend; on cuda each one is a cudaLaunchHostFunc). Host-side
//            spans (optimizer, NVMe waits, stalls of the caller) are always timed: two clock reads.
//   spans  - every span is also buffered for write_json().
// With both off a stream span costs one branch and enqueues nothing.
//
// Threads: add_span() and the stream callbacks may run on any thread; each track has its own
// mutex, taken by the one thread that normally feeds that track, so it is uncontended. A track
// is written by one in-order source (a stream's worker, the optimizer thread, the caller), so
// its spans nest or follow each other; stream spans are paired LIFO, which keeps them nested
// even when two threads enqueue on the same stream.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "strata/status.hpp"

namespace strata {
class Stream;
}

namespace strata::detail {

// What a span's duration is added to (OffloadStats's busy and stall seconds).
enum class TraceCounter : std::uint8_t {
  kNone,
  kCompute,      // module forward/backward and the device optimizer, on the compute stream
  kFetchStall,   // the compute stream idle until a parameter fetch landed
  kH2D,          // host-to-device copies
  kD2H,          // device-to-host copies
  kNvmeRead,     // NVMe reads, from issue until the engine saw them complete
  kNvmeWrite,    // NVMe writes, likewise
  kOptimizer,    // host optimizer thread: gradient scans and updates (wall)
  kUpdateStall,  // the engine's caller blocked on the host optimizer
  kComm,         // data-parallel collectives, from enqueue until complete (the thread waits)
  kCount
};

struct TraceSpan {
  const char* what = "";      // a static string: "forward", "fetch", "adam", ...
  int unit = -1;              // the module it concerns, -1 none
  std::uint64_t bytes = 0;    // bytes it moved, 0 none
  std::int64_t begin_ns = 0;  // since the tracer's epoch
  std::int64_t end_ns = 0;
};

class Tracer {
 public:
  Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Tracks are added before any span (setup); the id is an index into the track table.
  int add_track(std::string name);

  // Flip between steps; a span already enqueued completes either way.
  void set_timing(bool on) { timing_.store(on || spans_.load()); }
  // Buffering implies timing. At most `max_spans` are kept (later ones are counted as dropped).
  void set_spans(bool on, std::size_t max_spans = 4'000'000);
  bool timing() const { return timing_.load(std::memory_order_relaxed); }
  bool spans() const { return spans_.load(std::memory_order_relaxed); }

  std::int64_t now_ns() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - epoch_)
        .count();
  }

  // A host-side span that ended now. Always counted; buffered when spans are on.
  void add_span(int track, TraceCounter counter, const char* what, int unit, std::uint64_t bytes,
                std::int64_t begin_ns);

  // Stream spans: begin enqueues a timestamp on `stream`, end enqueues the span's completion.
  // No-ops unless timing is on. Pairs are matched last-in first-out per track.
  Status stream_begin(Stream& stream, int track);
  Status stream_end(Stream& stream, int track, TraceCounter counter, const char* what, int unit,
                    std::uint64_t bytes = 0);

  // Seconds accumulated per counter since construction.
  double seconds(TraceCounter counter) const;

  // Chrome/Perfetto trace JSON: one thread per track (in add_track order) of process
  // `process_name`; a span is named "<what> <unit name>" with args module/bytes.
  Status write_json(const std::string& path, const std::string& process_name,
                    const std::function<std::string(int)>& unit_name) const;
  std::size_t span_count() const;

 private:
  struct Track {
    std::string name;
    mutable std::mutex mu;
    std::vector<TraceSpan> spans;
    std::vector<std::int64_t> open;  // stream spans begun and not yet ended
  };
  void record(Track& t, TraceCounter counter, const TraceSpan& span);

  std::chrono::steady_clock::time_point epoch_;
  std::atomic<bool> timing_{false};
  std::atomic<bool> spans_{false};
  std::size_t max_spans_ = 0;
  std::atomic<std::size_t> kept_{0};
  std::atomic<std::uint64_t> dropped_{0};
  std::deque<Track> tracks_;  // deque: tracks never move once added
  std::array<std::atomic<std::int64_t>, static_cast<std::size_t>(TraceCounter::kCount)> counter_ns_{};
};

// Times a host-side scope: add_span() at destruction.
class HostSpan {
 public:
  HostSpan(Tracer& tracer, int track, TraceCounter counter, const char* what, int unit = -1,
           std::uint64_t bytes = 0)
      : tracer_(tracer),
        track_(track),
        counter_(counter),
        what_(what),
        unit_(unit),
        bytes_(bytes),
        begin_(tracer.now_ns()) {}
  ~HostSpan() { tracer_.add_span(track_, counter_, what_, unit_, bytes_, begin_); }
  HostSpan(const HostSpan&) = delete;
  HostSpan& operator=(const HostSpan&) = delete;

 private:
  Tracer& tracer_;
  int track_;
  TraceCounter counter_;
  const char* what_;
  int unit_;
  std::uint64_t bytes_;
  std::int64_t begin_;
};

}  // namespace strata::detail
