// strata bench alloc: replays the allocation trace of transformer training steps through the
// Strata device arena and through the system allocator used the same way, and reports the
// footprint of each relative to the peak of live bytes, plus allocations that reach the OS
// after warm-up.
//
// Footprint: for the arena, the device budget it holds (`reserved_bytes`, the capacity mapped
// up front; a cuda device would cudaMalloc all of it), sized by a dry run of the same trace;
// `high_water_bytes` is the part ever used. For malloc, the largest heap footprint (mallinfo2).
// OS allocations after warm-up: for the arena, backend allocator calls plus growths of the
// device arena's and pinned pool's high-water marks (pages the lazily mapped budget has not
// had yet); for malloc, allocations after which the heap footprint grew.
//
// The trace (deterministic from --seed): parameters and gradients are long-lived; each step
// runs forward over L layers, saving activations until that layer's backward and allocating
// short-lived workspace (attention scores, matmul scratch) in between; the loss allocates the
// logits; backward frees saved activations in reverse while allocating activation gradients;
// a few small buffers (metrics, loss-scale state) outlive their step. Staging slots (parameter
// prefetch, gradient buckets) live in a planned slot region and are all in flight. Sequence length varies
// from step to step, so block sizes never repeat exactly — the pattern that fragments a
// general-purpose heap.
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cli.hpp"
#include "strata/alloc.hpp"
#include "strata/device.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

struct TraceOp {
  bool alloc = true;
  std::uint32_t id = 0;
  std::uint64_t bytes = 0;
  Lifetime lifetime = Lifetime::kFixed;
  bool step_boundary = false;  // marks the end of a training step
};

struct TraceShape {
  int layers = 24;
  int width = 1024;
  int heads = 16;
  int batch = 4;
  int vocab = 50304;
  int steps = 40;
  int warmup_steps = 2;
  std::uint64_t param_bytes = 0;  // computed
};

constexpr std::uint64_t kMaxSeqLen = 1024;

class TraceBuilder {
 public:
  TraceBuilder(const TraceShape& shape, std::uint32_t seed) : shape_(shape), rng_(seed) {}

  std::vector<TraceOp> build() {
    std::vector<std::uint32_t> carried;  // small buffers that outlive their step
    for (int step = 0; step < shape_.steps; ++step) {
      // Sequence lengths vary step to step (packed batches of documents).
      // Warm-up steps run at the longest sequence, as a runtime's warm-up does, so that the
      // steady state runs within the footprint warm-up established.
      const std::uint64_t drawn = 256 + 64 * (rng_() % 13);  // 256 .. 1024
      const std::uint64_t t = step < shape_.warmup_steps ? kMaxSeqLen : drawn;
      const std::uint64_t b = shape_.batch, c = shape_.width, h = shape_.heads;
      const std::uint64_t act = b * t * c * 2;  // bf16 (B, T, C)
      std::vector<std::vector<std::uint32_t>> saved(shape_.layers);
      std::uint32_t emb = alloc(act, Lifetime::kRelocatable);
      for (int l = 0; l < shape_.layers; ++l) {
        auto& s = saved[l];
        s.push_back(alloc(act, Lifetime::kRelocatable));            // ln_1 out
        s.push_back(alloc(3 * act, Lifetime::kRelocatable));        // qkv
        std::uint32_t scores = alloc(b * h * t * t * 2, Lifetime::kFixed);  // attention scores (workspace)
        s.push_back(alloc(b * h * t * 4, Lifetime::kRelocatable));  // logsumexp (fp32)
        s.push_back(alloc(act, Lifetime::kRelocatable));            // attention out
        free(scores);
        std::uint32_t scratch = alloc(jitter(4 << 20), Lifetime::kFixed);  // GEMM workspace
        s.push_back(alloc(act, Lifetime::kRelocatable));            // residual 1
        s.push_back(alloc(act, Lifetime::kRelocatable));            // ln_2 out
        s.push_back(alloc(4 * act, Lifetime::kRelocatable));        // fc out
        s.push_back(alloc(4 * act, Lifetime::kRelocatable));        // gelu out
        free(scratch);
        s.push_back(alloc(act, Lifetime::kRelocatable));            // residual 2
      }
      std::uint32_t logits = alloc(b * t * shape_.vocab * 2, Lifetime::kFixed);
      std::uint32_t losses = alloc(b * t * 4, Lifetime::kFixed);
      std::uint32_t dlogits = alloc(b * t * shape_.vocab * 2, Lifetime::kFixed);
      free(logits);
      std::uint32_t dx = alloc(act, Lifetime::kFixed);
      free(dlogits);
      for (int l = shape_.layers - 1; l >= 0; --l) {
        std::uint32_t dfc = alloc(4 * act, Lifetime::kFixed);
        std::uint32_t scratch = alloc(jitter(4 << 20), Lifetime::kFixed);
        std::uint32_t dln = alloc(act, Lifetime::kFixed);
        free(scratch);
        free(dfc);
        std::uint32_t dscores = alloc(b * h * t * t * 2, Lifetime::kFixed);
        std::uint32_t dqkv = alloc(3 * act, Lifetime::kFixed);
        free(dscores);
        free(dqkv);
        // Saved activations die in an order that is not the reverse of their birth.
        auto& s = saved[l];
        std::shuffle(s.begin(), s.end(), rng_);
        for (auto id : s) free(id);
        std::uint32_t ndx = alloc(act, Lifetime::kFixed);
        free(dx);
        free(dln);
        dx = ndx;
      }
      free(dx);
      free(emb);
      free(losses);
      // Metrics and loss-scale state survive into the next step; the previous ones die now.
      for (auto id : carried) free(id);
      carried.clear();
      carried.push_back(alloc(jitter(64 << 10), Lifetime::kFixed));
      carried.push_back(alloc(jitter(256 << 10), Lifetime::kFixed));
      TraceOp boundary;
      boundary.step_boundary = true;
      ops_.push_back(boundary);
    }
    for (auto id : carried) free(id);
    return std::move(ops_);
  }

  std::uint32_t ids() const { return next_id_; }

 private:
  std::uint64_t jitter(std::uint64_t base) { return base / 2 + rng_() % base; }
  std::uint32_t alloc(std::uint64_t bytes, Lifetime lifetime) {
    TraceOp op;
    op.alloc = true;
    op.id = next_id_++;
    op.bytes = bytes;
    op.lifetime = lifetime;
    ops_.push_back(op);
    return op.id;
  }
  void free(std::uint32_t id) {
    TraceOp op;
    op.alloc = false;
    op.id = id;
    ops_.push_back(op);
  }

  TraceShape shape_;
  std::mt19937_64 rng_;
  std::vector<TraceOp> ops_;
  std::uint32_t next_id_ = 0;
};

struct ReplayResult {
  std::uint64_t peak_live = 0;
  std::uint64_t reserved = 0;    // arena: the capacity held (the device budget); malloc: peak footprint
  std::uint64_t high_water = 0;  // arena: planned regions + dynamic high-water mark
  std::uint64_t os_allocs_after_warmup = 0;
  // arena: the parts of os_allocs_after_warmup (see replay_arena)
  std::uint64_t backend_allocs_after_warmup = 0;
  std::uint64_t growths_after_warmup = 0;
  std::uint64_t pinned_growths_after_warmup = 0;
  std::uint64_t compactions = 0;
  std::uint64_t bytes_moved = 0;
  Status status;
};

// The Strata path: a real cpu device whose arena holds parameters and gradients in planned
// regions, gradient buckets in a slot region, and everything else in the dynamic part.
ReplayResult replay_arena(const std::vector<TraceOp>& ops, std::uint32_t ids, const TraceShape& shape,
                          std::uint64_t budget, bool compact_between_steps, bool compact_on_demand) {
  ReplayResult r;
  DeviceConfig cfg;
  cfg.memory_bytes = budget;
  cfg.pinned_bytes = 1 << 20;
  auto dev = Device::create(cfg);
  if (!dev.ok()) {
    r.status = dev.status();
    return r;
  }
  Arena& arena = (*dev)->memory();
  arena.set_compact_on_demand(compact_on_demand);
  const std::uint64_t bucket = 25ull << 20;
  r.status = arena.plan({{.name = "params", .bytes = shape.param_bytes},
                         {.name = "grads", .bytes = shape.param_bytes},
                         {.name = "staging", .slot_bytes = bucket, .slot_count = 4}});
  if (!r.status.ok()) return r;
  // Per-layer parameter tensors, carved from the persistent regions.
  const std::uint64_t c = shape.width;
  for (int l = 0; l < shape.layers; ++l) {
    for (std::uint64_t bytes : {3 * c * c * 2, c * c * 2, 4 * c * c * 2, 4 * c * c * 2, 10 * c * 2}) {
      for (const char* region : {"params", "grads"}) {
        auto off = arena.allocate_persistent(region, bytes);
        if (!off.ok()) {
          r.status = off.status();
          return r;
        }
      }
    }
  }
  std::vector<ArenaHandle> handles(ids);
  int step = 0;
  // Allocations that get memory from the OS, counted from the end of warm-up: calls into the
  // backend's allocator (mmap / cudaMalloc, DeviceStats::raw_allocs), and growths of the device
  // arena's and the pinned pool's high-water marks (ArenaStats::growths): on the cpu backend the
  // budget is mapped lazily, so bytes above the mark are pages the OS has yet to provide.
  std::uint64_t raw_at_warmup = 0, growths_at_warmup = 0, pinned_at_warmup = 0;
  // The staging slots (parameter prefetch and gradient buckets) are all in flight in the
  // steady state of a pipelined step: the prefetcher refills a slot as soon as it is released.
  for (int k = 0; k < 4; ++k) {
    auto slot = arena.acquire_slot("staging");
    if (!slot.ok()) {
      r.status = slot.status();
      return r;
    }
  }
  for (const auto& op : ops) {
    if (op.step_boundary) {
      if (compact_between_steps) r.status = (*dev)->compact();
      if (!r.status.ok()) return r;
      if (++step == shape.warmup_steps) {
        raw_at_warmup = (*dev)->stats().raw_allocs;
        growths_at_warmup = arena.stats().growths;
        pinned_at_warmup = (*dev)->pinned().stats().growths;
      }
      continue;
    }
    if (op.alloc) {
      auto h = arena.allocate(op.bytes, op.lifetime, "trace");
      if (!h.ok()) {
        r.status = h.status();
        return r;
      }
      handles[op.id] = *h;
    } else {
      r.status = arena.free(handles[op.id]);
      if (!r.status.ok()) return r;
    }
  }
  r.status = arena.is_valid();
  auto st = arena.stats();
  r.peak_live = st.peak_live_bytes;
  r.reserved = st.capacity;
  r.high_water = st.reserved_bytes;
  r.backend_allocs_after_warmup = (*dev)->stats().raw_allocs - raw_at_warmup;
  r.growths_after_warmup = st.growths - growths_at_warmup;
  r.pinned_growths_after_warmup = (*dev)->pinned().stats().growths - pinned_at_warmup;
  r.os_allocs_after_warmup =
      r.backend_allocs_after_warmup + r.growths_after_warmup + r.pinned_growths_after_warmup;
  r.compactions = st.compactions;
  r.bytes_moved = st.bytes_moved;
  return r;
}

// The reference: the same trace through malloc/free (parameters and gradients too), measuring
// the heap's footprint (mallinfo2: sbrk arena + mmapped chunks) at its worst, and counting
// allocations that had to get new memory from the OS. Runs in a forked child so that nothing
// else in this process touches the heap it measures.
ReplayResult replay_system(const std::vector<TraceOp>& ops, std::uint32_t ids, const TraceShape& shape) {
  ReplayResult r;
  int fds[2];
  if (::pipe(fds) != 0) {
    r.status = internal_error("pipe failed");
    return r;
  }
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::vector<void*> ptrs(ids, nullptr);
    std::vector<std::uint64_t> sizes(ids, 0);
    std::vector<void*> persistent;
    std::uint64_t live = 0, peak_live = 0, peak_reserved = 0, os_allocs = 0;
    int step = 0;
    auto footprint = [] {
      struct mallinfo2 mi = ::mallinfo2();
      return static_cast<std::uint64_t>(mi.arena + mi.hblkhd);
    };
    const std::uint64_t c = shape.width;
    for (int l = 0; l < shape.layers; ++l) {
      for (std::uint64_t bytes : {3 * c * c * 2, c * c * 2, 4 * c * c * 2, 4 * c * c * 2, 10 * c * 2}) {
        for (int k = 0; k < 2; ++k) {
          persistent.push_back(std::malloc(bytes));
          live += bytes;
        }
      }
    }
    for (int k = 0; k < 4; ++k) {
      persistent.push_back(std::malloc(25ull << 20));
      live += 25ull << 20;
    }
    std::uint64_t fp = footprint();
    for (const auto& op : ops) {
      if (op.step_boundary) {
        ++step;
        continue;
      }
      if (op.alloc) {
        ptrs[op.id] = std::malloc(op.bytes);
        sizes[op.id] = op.bytes;
        live += op.bytes;
        peak_live = std::max(peak_live, live);
        std::uint64_t now = footprint();
        if (now > fp && step >= shape.warmup_steps) ++os_allocs;  // the heap had to grow
        fp = now;
        peak_reserved = std::max(peak_reserved, now);
      } else {
        std::free(ptrs[op.id]);
        live -= sizes[op.id];
        fp = footprint();
      }
    }
    for (void* p : persistent) std::free(p);
    std::uint64_t out[3] = {peak_live, peak_reserved, os_allocs};
    [[maybe_unused]] auto n = ::write(fds[1], out, sizeof out);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::uint64_t in[3] = {0, 0, 0};
  auto n = ::read(fds[0], in, sizeof in);
  ::close(fds[0]);
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  if (n != static_cast<ssize_t>(sizeof in)) {
    r.status = internal_error("system allocator replay (child process) failed");
    return r;
  }
  r.peak_live = in[0];
  r.reserved = in[1];
  r.os_allocs_after_warmup = in[2];
  return r;
}

constexpr FlagSpec kFlags[] = {
    {"json", "", "print one JSON object (the default output)"},
    {"steps", "N", "training steps to replay, 3..10000 (default 40)"},
    {"layers", "N", "transformer layers, 1..1024 (default 24)"},
    {"width", "N", "model width, a multiple of 64 up to 16384 (default 1024)"},
    {"batch", "N", "micro-batch size, 1..1024 (default 4)"},
    {"seed", "N", "trace seed, 0..4294967295 (default 1)"},
    {"compact", "MODE",
     "arena compaction: none, step (between steps) or demand (when an allocation would otherwise raise the "
     "high-water mark); default none"},
    {"help", "", "show this help"},
};

std::string usage() {
  return "usage: strata bench alloc [--json] [flags]\n\nReplays a transformer training step's allocations "
         "through the Strata arena and through malloc.\n\nflags:\n" +
         format_flags(kFlags);
}

int bench_alloc(std::span<const std::string> argv) {
  auto args = Args::parse(argv, kFlags);
  if (!args.ok()) return usage_error("bench alloc", args.status().message(), usage());
  if (args->has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  TraceShape shape;
  auto steps = args->get_int("steps", shape.steps, 3, 10000);
  auto layers = args->get_int("layers", shape.layers, 1, 1024);
  auto width = args->get_int("width", shape.width, 64, 16384);
  auto batch = args->get_int("batch", shape.batch, 1, 1024);
  auto seed = args->get_int("seed", 1, 0, UINT32_MAX);
  for (const auto* r : {&steps, &layers, &width, &batch, &seed}) {
    if (!r->ok()) return usage_error("bench alloc", r->status().message(), usage());
  }
  if (*width % 64 != 0) {
    return usage_error("bench alloc",
                       "flag '--width' must be a multiple of 64, got " + std::to_string(*width), usage());
  }
  shape.steps = static_cast<int>(*steps);
  shape.layers = static_cast<int>(*layers);
  shape.width = static_cast<int>(*width);
  shape.batch = static_cast<int>(*batch);
  const std::uint64_t c = shape.width;
  shape.param_bytes = shape.layers * (12 * c * c * 2 + 10 * c * 2 + 4096);

  TraceBuilder builder(shape, static_cast<std::uint32_t>(*seed));
  auto ops = builder.build();

  std::string compact = args->get("compact").value_or("none");
  if (compact != "none" && compact != "step" && compact != "demand") {
    return usage_error("bench alloc", "--compact expects none, step or demand, got '" + compact + "'", usage());
  }
  // The budget is planned, the way the runtime sizes its arena from a plan rather than guessing:
  // a dry run of the same trace in an oversized arena (mapped, never touched) measures the
  // footprint the run needs (planned regions + high-water mark), and the measured run gets
  // exactly that, rounded up to 1 MiB. What it holds is what reserved_bytes reports.
  const std::uint64_t max_t = kMaxSeqLen;
  const std::uint64_t step_bytes =
      shape.layers * (shape.batch * max_t * c * 2 * 15 + shape.batch * shape.heads * max_t * max_t * 2) +
      2 * shape.batch * max_t * shape.vocab * 2;
  const std::uint64_t dry_budget =
      align_up(2 * shape.param_bytes + 100ull * (1 << 20) + 2 * step_bytes, 1 << 20);
  ReplayResult dry =
      replay_arena(ops, builder.ids(), shape, dry_budget, compact == "step", compact == "demand");
  if (!dry.status.ok()) {
    std::fprintf(stderr, "strata bench alloc: planning run: %s\n", dry.status.to_string().c_str());
    return kExitFailure;
  }
  const std::uint64_t budget = align_up(dry.high_water, 1 << 20);
  ReplayResult arena = replay_arena(ops, builder.ids(), shape, budget, compact == "step", compact == "demand");
  if (!arena.status.ok()) {
    std::fprintf(stderr, "strata bench alloc: %s\n", arena.status.to_string().c_str());
    return kExitFailure;
  }
  ReplayResult sys = replay_system(ops, builder.ids(), shape);
  if (!sys.status.ok()) {
    std::fprintf(stderr, "strata bench alloc: %s\n", sys.status.to_string().c_str());
    return kExitFailure;
  }
  std::size_t allocs = 0;
  for (const auto& op : ops) allocs += op.alloc && !op.step_boundary ? 1 : 0;
  nlohmann::json out = {
      {"benchmark", "alloc"},
      {"steps", shape.steps},
      {"layers", shape.layers},
      {"width", shape.width},
      {"allocations", allocs},
      {"peak_live_bytes", arena.peak_live},
      {"reserved_bytes", arena.reserved},
      {"reserved_over_peak_live", static_cast<double>(arena.reserved) / static_cast<double>(arena.peak_live)},
      {"high_water_bytes", arena.high_water},
      {"high_water_over_peak_live",
       static_cast<double>(arena.high_water) / static_cast<double>(arena.peak_live)},
      {"os_allocs_after_warmup", arena.os_allocs_after_warmup},
      {"backend_allocs_after_warmup", arena.backend_allocs_after_warmup},
      {"arena_growths_after_warmup", arena.growths_after_warmup},
      {"pinned_growths_after_warmup", arena.pinned_growths_after_warmup},
      {"compaction", compact},
      {"compactions", arena.compactions},
      {"bytes_moved", arena.bytes_moved},
      {"baseline_peak_live_bytes", sys.peak_live},
      {"baseline_reserved_bytes", sys.reserved},
      {"baseline_reserved_over_peak_live",
       sys.reserved > 0 ? static_cast<double>(sys.reserved) / static_cast<double>(sys.peak_live) : 0.0},
      {"baseline_os_allocs_after_warmup", sys.os_allocs_after_warmup},
      // mallinfo2 reports nothing when malloc is replaced (sanitizers, preloaded allocators).
      {"baseline_measured", sys.reserved > 0},
  };
  std::printf("%s\n", out.dump(2).c_str());
  return kExitOk;
}

}  // namespace

STRATA_CLI_BENCH(alloc, "replay a training step's allocations through the arena and malloc", bench_alloc);

}  // namespace strata::cli
