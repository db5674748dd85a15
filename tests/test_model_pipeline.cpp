// Pipeline-parallel building blocks in one process: the stage assignment (balanced by forward
// FLOPs), the schedules' order of work, and the model's activation slots and stage boundaries.
// The slot tests run micro-batches in 1F1B order, and through two stage models handing the
// boundary tensors over, against the same micro-batches run one after another: the gradients
// must be the same bits (each module computes the same thing and every parameter gradient
// accumulates in the same micro-batch order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/device.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"
#include "strata/pipeline_schedule.hpp"

namespace strata {
namespace {

ModelConfig small(ModelKind kind, int layers) {
  ModelConfig c;
  c.kind = kind;
  c.n_layer = layers;
  c.n_embd = 64;
  c.n_head = 4;
  c.n_kv_head = kind == ModelKind::kLlama ? 2 : 0;
  c.n_positions = 32;
  c.vocab_size = 97;
  return c;
}

// The largest stage's FLOPs of a split, and the best over every split (brute force).
double worst(const std::vector<double>& f, const std::vector<int>& b) {
  double w = 0;
  for (std::size_t s = 0; s + 1 < b.size(); ++s) {
    double c = 0;
    for (int m = b[s]; m < b[s + 1]; ++m) c += f[static_cast<std::size_t>(m)];
    w = std::max(w, c);
  }
  return w;
}
double best_split(const std::vector<double>& f, int stages, std::vector<int> b, int from) {
  if (static_cast<int>(b.size()) == stages) {
    b.push_back(static_cast<int>(f.size()));
    return worst(f, b);
  }
  double best = 1e300;
  for (int e = from + 1; e + (stages - static_cast<int>(b.size())) <= static_cast<int>(f.size()); ++e) {
    std::vector<int> nb = b;
    nb.push_back(e);
    best = std::min(best, best_split(f, stages, nb, e));
  }
  return best;
}

TEST(PipelineStages, BalancedByForwardFlopsAndContiguous) {
  for (ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    for (int layers : {1, 4, 7}) {
      const ModelConfig c = small(kind, layers);
      const std::vector<double> f = module_flops(c, 1, 32);
      ASSERT_EQ(f.size(), static_cast<std::size_t>(layers + 2));
      EXPECT_EQ(f.front(), 0.0);  // the embedding is a gather
      double sum = 0;
      for (double x : f) sum += x;
      EXPECT_NEAR(sum, model_flops(c, 1, 32, true), 1e-9 * sum);
      for (int p = 1; p <= layers + 2; ++p) {
        auto b = pipeline_stages(c, p, 32);
        ASSERT_TRUE(b.ok()) << b.status().to_string();
        ASSERT_EQ(b->size(), static_cast<std::size_t>(p + 1));
        EXPECT_EQ(b->front(), 0);
        EXPECT_EQ(b->back(), layers + 2);
        for (int s = 0; s < p; ++s)
          EXPECT_LT((*b)[static_cast<std::size_t>(s)], (*b)[static_cast<std::size_t>(s) + 1]);
        EXPECT_EQ(worst(f, *b), best_split(f, p, {0}, 0)) << "layers " << layers << ", stages " << p;
      }
      auto too_many = pipeline_stages(c, layers + 3, 32);
      ASSERT_FALSE(too_many.ok());
      EXPECT_NE(too_many.status().message().find("pipeline_parallel_size = " + std::to_string(layers + 3)),
                std::string::npos)
          << too_many.status().message();
    }
  }
  // 4 blocks and a head lighter than a block on 2 stages: [embedding, 2 blocks | 2 blocks, head].
  auto b = pipeline_stages(small(ModelKind::kGpt2, 4), 2, 32);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<int>{0, 3, 6}));
}

std::string ops_text(const std::vector<PipelineOp>& ops) {
  std::string s;
  for (const auto& o : ops) s += (o.forward ? "F" : "B") + std::to_string(o.micro) + " ";
  return s;
}

TEST(PipelineSchedule, OrdersAndSlots) {
  EXPECT_EQ(ops_text(pipeline_ops(PipelineSchedule::kGpipe, 3, 1, 3)), "F0 F1 F2 B0 B1 B2 ");
  EXPECT_EQ(ops_text(pipeline_ops(PipelineSchedule::kOneFOneB, 3, 0, 4)), "F0 F1 F2 B0 F3 B1 B2 B3 ");
  EXPECT_EQ(ops_text(pipeline_ops(PipelineSchedule::kOneFOneB, 3, 1, 4)), "F0 F1 B0 F2 B1 F3 B2 B3 ");
  EXPECT_EQ(ops_text(pipeline_ops(PipelineSchedule::kOneFOneB, 3, 2, 4)), "F0 B0 F1 B1 F2 B2 F3 B3 ");
  EXPECT_EQ(ops_text(pipeline_ops(PipelineSchedule::kOneFOneB, 3, 0, 1)), "F0 B0 ");
  EXPECT_EQ(ops_text(pipeline_ops(PipelineSchedule::kOneFOneB, 3, 0, 2)), "F0 F1 B0 B1 ");
  for (int p = 1; p <= 4; ++p) {
    for (int s = 0; s < p; ++s) {
      for (int m = 1; m <= 5; ++m) {
        EXPECT_EQ(pipeline_slots(PipelineSchedule::kGpipe, p, s, m), m);
        EXPECT_EQ(pipeline_slots(PipelineSchedule::kOneFOneB, p, s, m), std::min(p - s, m));
        for (auto sched : {PipelineSchedule::kGpipe, PipelineSchedule::kOneFOneB}) {
          const auto ops = pipeline_ops(sched, p, s, m);
          ASSERT_EQ(ops.size(), static_cast<std::size_t>(2 * m));
          int f = 0, bw = 0;
          for (const auto& o : ops) {  // each kind in micro-batch order, backward after its forward
            if (o.forward) {
              EXPECT_EQ(o.micro, f++);
            } else {
              EXPECT_EQ(o.micro, bw++);
              EXPECT_LT(o.micro, f);
            }
          }
        }
      }
    }
  }
  auto bad = parse_pipeline_schedule("interleaved");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'interleaved'"), std::string::npos);
  EXPECT_EQ(*parse_pipeline_schedule("gpipe"), PipelineSchedule::kGpipe);
  EXPECT_EQ(*parse_pipeline_schedule("1f1b"), PipelineSchedule::kOneFOneB);
}

std::string chunk_ops_text(const std::vector<ChunkOp>& ops) {
  std::string t;
  for (const ChunkOp& o : ops)
    t += std::string(o.forward ? "F" : "B") + std::to_string(o.micro) + "c" + std::to_string(o.chunk) + " ";
  return t;
}

// Runs the p processes' interleaved op lists against each other with sends that never block and
// ops that wait only for their own input (the engine's exchange): an op runs once its input
// exists (a forward needs the previous virtual stage's forward of that micro-batch, a backward
// the next virtual stage's backward). Ops take 1/v time units each (a chunk is 1/v of a stage), communication is
// free. Returns the makespan, or -1 when the processes deadlock (no op can run, work is left).
// Also checks the message order per (sender, receiver, direction): the receiver's ops must take
// the messages in the order the sender issues them, which MPI's matching per (pair, Comm) needs.
double simulate_interleaved(int p, int v, int m) {
  std::vector<std::vector<ChunkOp>> ops(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto o = interleaved_pipeline_ops(p, s, v, m);
    EXPECT_TRUE(o.ok()) << o.status().to_string();
    if (!o.ok()) return -1;
    ops[static_cast<std::size_t>(s)] = *o;
  }
  const int J = v * p;
  auto vstage = [&](int s, const ChunkOp& o) { return o.chunk * p + s; };
  // Message order: [direction][sender][receiver] -> the (micro, virtual stage) sequence.
  using Seq = std::vector<std::pair<int, int>>;
  std::vector<std::vector<std::vector<Seq>>> sent(2, std::vector<std::vector<Seq>>(p, std::vector<Seq>(p))),
      taken = sent;
  for (int s = 0; s < p; ++s) {
    for (const ChunkOp& o : ops[static_cast<std::size_t>(s)]) {
      const int j = vstage(s, o);
      if (o.forward) {
        if (j + 1 < J) sent[0][s][(j + 1) % p].push_back({o.micro, j + 1});
        if (j > 0) taken[0][(j - 1) % p][s].push_back({o.micro, j});
      } else {
        if (j > 0) sent[1][s][(j - 1) % p].push_back({o.micro, j - 1});
        if (j + 1 < J) taken[1][(j + 1) % p][s].push_back({o.micro, j});
      }
    }
  }
  EXPECT_EQ(sent, taken) << "p=" << p << " v=" << v << " m=" << m << ": messages taken out of order";
  // done time of F / B per (micro, virtual stage); -1 = not yet.
  std::vector<double> fdone(static_cast<std::size_t>(m * J), -1), bdone(static_cast<std::size_t>(m * J), -1);
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> clock(static_cast<std::size_t>(p), 0.0);
  const double t = 1.0 / v;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      auto& n = next[static_cast<std::size_t>(s)];
      if (n == ops[static_cast<std::size_t>(s)].size()) continue;
      const ChunkOp& o = ops[static_cast<std::size_t>(s)][n];
      const int j = vstage(s, o);
      const auto at = static_cast<std::size_t>(o.micro * J + j);
      double ready = clock[static_cast<std::size_t>(s)];
      if (o.forward) {
        if (j > 0) {
          const double d = fdone[at - 1];
          if (d < 0) continue;
          ready = std::max(ready, d);
        }
        fdone[at] = ready + t;
      } else {
        if (fdone[at] < 0) {
          ADD_FAILURE() << "p=" << p << " v=" << v << " m=" << m << ": backward before its forward";
          return -1;
        }
        if (j + 1 < J) {
          const double d = bdone[at + 1];
          if (d < 0) continue;
          ready = std::max(ready, d);
        }
        bdone[at] = ready + t;
      }
      clock[static_cast<std::size_t>(s)] = ready + t;
      ++n;
      progress = true;
    }
  }
  for (int s = 0; s < p; ++s)
    if (next[static_cast<std::size_t>(s)] != ops[static_cast<std::size_t>(s)].size()) return -1;
  return *std::max_element(clock.begin(), clock.end());
}

TEST(PipelineSchedule, InterleavedOrderDependenciesAndSlots) {
  // p = 2, v = 2, m = 4, worked out by hand from the rule in pipeline_schedule.hpp: forwards
  // a0c0 a1c0 a0c1 a1c1 a2c0 a3c0 a2c1 a3c1, backwards a0c1 a1c1 a0c0 a1c0 a2c1 a3c1 a2c0 a3c0;
  // warm-up 2·(p−s−1) + (v−1)·p = 4 on stage 0, 2 on stage 1.
  EXPECT_EQ(chunk_ops_text(*interleaved_pipeline_ops(2, 0, 2, 4)),
            "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0 ");
  EXPECT_EQ(chunk_ops_text(*interleaved_pipeline_ops(2, 1, 2, 4)),
            "F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0 ");
  EXPECT_EQ(*interleaved_pipeline_slots(2, 0, 2, 4), 5);
  EXPECT_EQ(*interleaved_pipeline_slots(2, 1, 2, 4), 3);
  // One slot per micro-batch in flight (every chunk of it): 0..3 on stage 0, at most 3 on stage 1.
  EXPECT_EQ(*interleaved_pipeline_micro_slots(2, 0, 2, 4), 4);
  EXPECT_EQ(*interleaved_pipeline_micro_slots(2, 1, 2, 4), 3);
  for (int p = 1; p <= 4; ++p) {
    for (int v = 1; v <= 3; ++v) {
      for (int g = 1; g <= 3; ++g) {
        const int m = g * p;
        for (int s = 0; s < p; ++s) {
          const auto ops = *interleaved_pipeline_ops(p, s, v, m);
          ASSERT_EQ(ops.size(), static_cast<std::size_t>(2 * m * v));
          // v = 1 is plain 1F1B.
          if (v == 1) {
            std::vector<ChunkOp> plain;
            for (const PipelineOp& o : pipeline_ops(PipelineSchedule::kOneFOneB, p, s, m)) plain.push_back({o.forward, o.micro, 0});
            EXPECT_EQ(ops, plain) << "p=" << p << " s=" << s << " m=" << m;
          }
          // Per chunk: forwards in micro-batch order, backwards in micro-batch order (the gradient
          // accumulation order of one process), each backward after its forward.
          std::vector<int> f(static_cast<std::size_t>(v), 0), b(static_cast<std::size_t>(v), 0);
          int live = 0, most = 0;
          for (const ChunkOp& o : ops) {
            ASSERT_GE(o.chunk, 0);
            ASSERT_LT(o.chunk, v);
            auto& cf = f[static_cast<std::size_t>(o.chunk)];
            auto& cb = b[static_cast<std::size_t>(o.chunk)];
            if (o.forward) {
              EXPECT_EQ(o.micro, cf++) << "p=" << p << " v=" << v << " m=" << m << " s=" << s;
            } else {
              EXPECT_EQ(o.micro, cb++) << "p=" << p << " v=" << v << " m=" << m << " s=" << s;
              EXPECT_LT(o.micro, cf) << "backward before its forward";
            }
            live += o.forward ? 1 : -1;
            most = std::max(most, live);
          }
          for (int c = 0; c < v; ++c) {
            EXPECT_EQ(f[static_cast<std::size_t>(c)], m);
            EXPECT_EQ(b[static_cast<std::size_t>(c)], m);
          }
          EXPECT_EQ(*interleaved_pipeline_slots(p, s, v, m), most);
          // The engine's slots (one per micro-batch, holding every chunk of it): micro-batch a in
          // flight from its chunk-0 forward to its chunk-0 backward uses slot a % k, so no two in
          // flight at once may share it, and k is the most in flight.
          const int k = *interleaved_pipeline_micro_slots(p, s, v, m);
          std::vector<int> holder(static_cast<std::size_t>(k), -1);
          int in_flight = 0, most_micro = 0;
          for (const ChunkOp& o : ops) {
            if (o.chunk != 0) continue;
            int& h = holder[static_cast<std::size_t>(o.micro % k)];
            if (o.forward) {
              EXPECT_EQ(h, -1) << "slot " << o.micro % k << " still holds micro-batch " << h << " when "
                               << o.micro << " starts: p=" << p << " v=" << v << " m=" << m << " s=" << s;
              h = o.micro;
              most_micro = std::max(most_micro, ++in_flight);
            } else {
              EXPECT_EQ(h, o.micro);
              h = -1;
              --in_flight;
            }
          }
          EXPECT_EQ(k, std::max(most_micro, 1)) << "p=" << p << " v=" << v << " m=" << m << " s=" << s;
        }
        // No deadlock, messages matched in order, and the bubble (equal chunks, free
        // communication) is 1F1B's divided by v: makespan 2m + 2(p−1)/v with t_f = t_b.
        const double makespan = simulate_interleaved(p, v, m);
        ASSERT_GT(makespan, 0) << "deadlock: p=" << p << " v=" << v << " m=" << m;
        const double bubble = 1.0 - 2.0 * m / makespan;
        const double theory = interleaved_bubble_theory(p, v, m);
        std::printf("p=%d v=%d m=%d simulated bubble %.4f theory %.4f\n", p, v, m, bubble, theory);
        EXPECT_NEAR(bubble, theory, 1e-9) << "p=" << p << " v=" << v << " m=" << m;
      }
    }
  }
  // Chunks: process s owns virtual stages s, s+p, ...; embedding on 0, head on p−1.
  const ModelConfig c = small(ModelKind::kGpt2, 6);
  const std::vector<int> bounds = *pipeline_stages(c, 4, 0);  // 2 processes x 2 chunks
  auto r0 = *interleaved_stage_ranges(bounds, 2, 0, 2), r1 = *interleaved_stage_ranges(bounds, 2, 1, 2);
  ASSERT_EQ(r0.size(), 2u);
  EXPECT_EQ(r0[0], std::make_pair(0, bounds[1]));
  EXPECT_EQ(r1[0], std::make_pair(bounds[1], bounds[2]));
  EXPECT_EQ(r0[1], std::make_pair(bounds[2], bounds[3]));
  EXPECT_EQ(r1[1], std::make_pair(bounds[3], 8));  // the head (module L + 1 = 7) on the last process
  // Errors name the value and what was expected.
  auto odd = interleaved_pipeline_ops(2, 0, 2, 3);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("3 micro-batches is not a multiple of the 2 stages"), std::string::npos);
  auto none = interleaved_pipeline_ops(2, 0, 0, 2);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("0 virtual stages"), std::string::npos);
  EXPECT_TRUE(interleaved_pipeline_ops(2, 0, 1, 3).ok());  // v = 1: plain 1F1B, any m
  auto short_bounds = interleaved_stage_ranges({0, 3, 8}, 2, 0, 2);
  ASSERT_FALSE(short_bounds.ok());
  EXPECT_NE(short_bounds.status().message().find("expected 5"), std::string::npos);
}

// Activation slots carved per (micro-batch, chunk): as many slots as the schedule's peak of live
// chunk forwards (interleaved_pipeline_slots), no slot holding two live pairs, each slot listing
// the chunks it holds. p = 2, v = 2, m = 4 on stage 0: 5 slots of one chunk each, where slots
// per micro-batch needed 4 of both chunks (8 chunk sets).
TEST(PipelineSchedule, InterleavedSlotsPerChunk) {
  const InterleavedSlots two = *interleaved_slot_assignment(2, 0, 2, 4);
  EXPECT_EQ(two.slot_chunks.size(), 5u);
  std::size_t sets = 0;
  for (const auto& held : two.slot_chunks) sets += held.size();
  EXPECT_LT(sets, 2u * static_cast<std::size_t>(*interleaved_pipeline_micro_slots(2, 0, 2, 4)));
  for (int p = 1; p <= 4; ++p) {
    for (int v = 1; v <= 3; ++v) {
      for (int g = 1; g <= 3; ++g) {
        const int m = g * p;
        for (int s = 0; s < p; ++s) {
          const std::string at = "p=" + std::to_string(p) + " v=" + std::to_string(v) +
                                 " m=" + std::to_string(m) + " s=" + std::to_string(s);
          const InterleavedSlots a = *interleaved_slot_assignment(p, s, v, m);
          EXPECT_EQ(static_cast<int>(a.slot_chunks.size()), *interleaved_pipeline_slots(p, s, v, m)) << at;
          std::vector<std::pair<int, int>> holder(a.slot_chunks.size(), {-1, -1});
          const std::vector<ChunkOp> ops = *interleaved_pipeline_ops(p, s, v, m);
          for (const ChunkOp& o : ops) {
            const int k = a.slot(o.micro, o.chunk, v);
            ASSERT_GE(k, 0) << at;
            ASSERT_LT(k, static_cast<int>(a.slot_chunks.size())) << at;
            const auto& held = a.slot_chunks[static_cast<std::size_t>(k)];
            EXPECT_NE(std::find(held.begin(), held.end(), o.chunk), held.end())
                << at << ": slot " << k << " is not listed for chunk " << o.chunk;
            auto& h = holder[static_cast<std::size_t>(k)];
            if (o.forward) {
              EXPECT_EQ(h.first, -1) << at << ": slot " << k << " still holds micro-batch " << h.first
                                     << " chunk " << h.second;
              h = {o.micro, o.chunk};
            } else {
              EXPECT_EQ(h, std::make_pair(o.micro, o.chunk)) << at;
              h = {-1, -1};
            }
          }
        }
      }
    }
  }
  EXPECT_FALSE(interleaved_slot_assignment(2, 0, 2, 3).ok());
}

// With sequence parallelism a stage's plan counts each boundary tensor as this tp rank's rows
// (docs/parallel.md "Sequence parallel across pipeline stages and with activation offload"): the
// send and receive buffers are half of tp 2 without it, and so are the activation-offload copies
// (the pinned line: (L + 1) residuals per slot plus its 4 KiB of slack; the ring: R per slot,
// each padded by 256 bytes).
TEST(PipelineSchedule, SequenceParallelPlanCountsTheRanksRows) {
  TrainerConfig config;
  config.model = small(ModelKind::kLlama, 6);
  config.model.activation_checkpointing = true;
  config.micro_batch = 2;
  config.seq_len = 16;
  config.grad_accum = 2;
  auto line_bytes = [&](bool sp, const std::string& prefix) -> std::uint64_t {
    OffloadSettings settings;
    settings.tp_size = 2;
    settings.sequence_parallel = sp;
    settings.offload_activations = true;
    settings.pipeline_bounds = *pipeline_stages(config.model, 2, config.seq_len);
    settings.pp_stage = 0;
    auto plan = OffloadPlan::make(config, settings);
    EXPECT_TRUE(plan.ok()) << plan.status().to_string();
    if (!plan.ok()) return 0;
    for (const PlanLine& line : plan->lines)
      if (line.what.rfind(prefix, 0) == 0) return line.bytes;
    ADD_FAILURE() << "no plan line '" << prefix << "'";
    return 0;
  };
  const std::uint64_t residual = 2 * 16 * 64 * 4;  // B·T·C fp32
  const std::uint64_t buffers = line_bytes(false, "pipeline: send and receive buffers");
  EXPECT_GT(buffers, 0u);
  EXPECT_EQ(2 * line_bytes(true, "pipeline: send and receive buffers"), buffers);
  const std::uint64_t pinned = line_bytes(false, "activation offload: checkpointed block inputs");
  const std::uint64_t pinned_sp = line_bytes(true, "activation offload: checkpointed block inputs");
  EXPECT_EQ(2 * (pinned_sp - 4096), pinned - 4096);
  const std::uint64_t ring = line_bytes(false, "activation offload: device ring");
  const std::uint64_t ring_sp = line_bytes(true, "activation offload: device ring");
  // Per slot R buffers of (rows·C + 256) bytes: the difference is slots·R half residuals.
  const auto slots = static_cast<std::uint64_t>(pipeline_slots(PipelineSchedule::kOneFOneB, 2, 0, 2));
  EXPECT_GT(ring_sp, 0u);
  EXPECT_EQ(ring - ring_sp, slots * Model::kActivationRing * (residual / 2));
}

// The plan of an interleaved stage states the per-chunk slots: one line whose count is the
// schedule's peak of live chunk forwards and whose bytes are, per slot, the largest chunk it
// holds (activation_slot_estimate); less than slots per micro-batch holding every chunk once
// the schedule has a steady state (m > p).
TEST(PipelineSchedule, InterleavedPlanCountsChunkSlots) {
  TrainerConfig config;
  config.model = small(ModelKind::kLlama, 6);
  config.micro_batch = 2;
  config.seq_len = 16;
  const int p = 2, v = 2;
  for (std::int64_t m : {2, 4, 6}) {
    config.grad_accum = m;
    for (int s = 0; s < p; ++s) {
      OffloadSettings settings;
      settings.pipeline_virtual_stages = v;
      settings.pipeline_bounds = *pipeline_stages(config.model, p * v, config.seq_len);
      settings.pp_stage = s;
      auto plan = OffloadPlan::make(config, settings);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      const InterleavedSlots a = *interleaved_slot_assignment(p, s, v, static_cast<int>(m));
      const auto ranges = offload_detail::stage_ranges(settings.pipeline_bounds, v, s);
      std::uint64_t want = 0, every_chunk = 0;
      for (const auto& held : a.slot_chunks) {
        std::uint64_t most = 0;
        for (int c : held) {
          const auto [b, e] = ranges[static_cast<std::size_t>(c)];
          most = std::max(most, offload_detail::activation_slot_estimate(config, b, e));
        }
        want += most;
      }
      for (const auto& [b, e] : ranges) every_chunk += offload_detail::activation_slot_estimate(config, b, e);
      const int peak = *interleaved_pipeline_slots(p, s, v, static_cast<int>(m));
      const std::string at = "m=" + std::to_string(m) + " stage " + std::to_string(s);
      int found = 0;
      for (const PlanLine& line : plan->lines) {
        EXPECT_EQ(line.what.find("more activation slots"), std::string::npos) << at;
        if (line.what.rfind("pipeline: activation slots (", 0) != 0) continue;
        ++found;
        EXPECT_NE(line.what.find("(" + std::to_string(peak) + " carved per (micro-batch, chunk)"),
                  std::string::npos)
            << at << ": " << line.what;
        EXPECT_EQ(line.bytes, want) << at;
        // One group (m = p: every forward first) keeps every pair live at once: equal there.
        const std::uint64_t per_micro =
            static_cast<std::uint64_t>(*interleaved_pipeline_micro_slots(p, s, v, static_cast<int>(m))) *
            every_chunk;
        if (m > p) {
          EXPECT_LT(line.bytes, per_micro) << at;
        } else {
          EXPECT_LE(line.bytes, per_micro) << at;
        }
      }
      EXPECT_EQ(found, 1) << at << "\n" << plan->to_string();
    }
  }
}

struct Batches {
  std::vector<std::vector<std::int32_t>> in, tg;
};
Batches make_batches(const ModelConfig& c, int micro, std::int64_t n) {
  Batches b;
  std::mt19937 rng(7);
  for (int a = 0; a < micro; ++a) {
    std::vector<std::int32_t> in(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      in[static_cast<std::size_t>(i)] =
          static_cast<std::int32_t>(rng() % static_cast<unsigned>(c.vocab_size));
      tg[static_cast<std::size_t>(i)] =
          i % 5 == 2 ? -1 : static_cast<std::int32_t>(rng() % static_cast<unsigned>(c.vocab_size));
    }
    b.in.push_back(in);
    b.tg.push_back(tg);
  }
  return b;
}

std::unique_ptr<Model> make_model(Device& device, Stream& stream, const ModelConfig& c, int slots, int first,
                                  int end, bool plan) {
  auto layout = describe_model(c);
  EXPECT_TRUE(layout.ok());
  Model::Options o;
  o.max_batch = 2;
  o.max_seq_len = 16;
  o.activation_slots = slots;
  o.first_module = first;
  o.end_module = end;
  o.plan_arena = plan;
  o.loss_slots = 4;
  auto m = Model::create(*layout, device, stream, o);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  EXPECT_TRUE((*m)->initialize(42).ok());
  return std::move(*m);
}

std::vector<std::vector<float>> grads_of(Model& m, int first, int end) {
  std::vector<std::vector<float>> g;
  const ModelLayout& L = m.layout();
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    const ParamDesc& p = L.params[i];
    if (!p.owns_storage() || p.module < first || p.module >= end) continue;
    auto r = m.download_grad(static_cast<int>(i));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    g.push_back(r.ok() ? *r : std::vector<float>{});
  }
  return g;
}

constexpr int kMicro = 4;
constexpr float kDloss = 1.0f / 100.0f;

// The micro-batches one after another (the reference): gradients and losses.
std::vector<std::vector<float>> sequential(const ModelConfig& c, const Batches& b,
                                           std::vector<double>& losses) {
  auto device = testing::make_device();
  auto stream = device->create_stream("compute");
  auto model = make_model(*device, **stream, c, 1, 0, -1, true);
  for (int a = 0; a < kMicro; ++a) {
    EXPECT_TRUE(model->set_batch(b.in[a], b.tg[a], 2, 16).ok());
    EXPECT_TRUE(model->forward(true).ok());
    EXPECT_TRUE(model->copy_losses(a).ok());
    EXPECT_TRUE(model->backward(kDloss).ok());
  }
  EXPECT_TRUE((*stream)->synchronize().ok());
  for (int a = 0; a < kMicro; ++a) losses.push_back(model->loss_sum(a).sum);
  return grads_of(*model, 0, model->num_modules());
}

// With activation checkpointing each slot keeps only its block inputs and recomputes a block
// into its own shared set before the block's backward: the same bits too.
TEST(ModelSlots, OneFOneBOrderGivesTheSequentialGradients) {
  for (const auto& [kind, checkpointing] :
       {std::pair{ModelKind::kGpt2, false}, std::pair{ModelKind::kLlama, false},
        std::pair{ModelKind::kGpt2, true}, std::pair{ModelKind::kLlama, true}}) {
    ModelConfig c = small(kind, 3);
    c.activation_checkpointing = checkpointing;
    const Batches b = make_batches(c, kMicro, 32);
    std::vector<double> ref_losses;
    const auto ref = sequential(c, b, ref_losses);

    auto device = testing::make_device();
    auto stream = device->create_stream("compute");
    const int slots = pipeline_slots(PipelineSchedule::kOneFOneB, 3, 0, kMicro);
    ASSERT_EQ(slots, 3);
    auto model = make_model(*device, **stream, c, slots, 0, -1, true);
    for (const PipelineOp& op : pipeline_ops(PipelineSchedule::kOneFOneB, 3, 0, kMicro)) {
      ASSERT_TRUE(model->select_slot(op.micro % slots).ok());
      if (op.forward) {
        ASSERT_TRUE(model->set_batch(b.in[op.micro], b.tg[op.micro], 2, 16).ok());
        ASSERT_TRUE(model->forward(true).ok());
        ASSERT_TRUE(model->copy_losses(op.micro).ok());
      } else {
        ASSERT_TRUE(model->backward(kDloss).ok());
      }
    }
    ASSERT_TRUE((*stream)->synchronize().ok());
    const auto got = grads_of(*model, 0, model->num_modules());
    ASSERT_EQ(got.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i)
      EXPECT_TRUE(testing::bitwise_equal(ref[i], got[i])) << "param " << i;
    for (int a = 0; a < kMicro; ++a)
      EXPECT_EQ(model->loss_sum(a).sum, ref_losses[static_cast<std::size_t>(a)]);
    // A slot that does not exist, and a backward on a slot without a forward, are errors.
    EXPECT_FALSE(model->select_slot(slots).ok());
    ASSERT_TRUE(model->select_slot(0).ok());
    EXPECT_FALSE(model->backward(kDloss).ok());
  }
}

// Slots carved per chunk (Options::slot_ranges, what interleaved 1F1B's engine uses): each slot
// carves only the ranges it lists, aliased, so the model is smaller than with slots holding every
// range; select_range refuses a range the selected slot was not carved for; share_batch carries a
// batch (tokens, targets, target count) into the slot of the batch's next chunk.
TEST(ModelSlots, PerChunkSlotsCarveTheirRangesOnly) {
  const ModelConfig c = small(ModelKind::kLlama, 3);  // modules: embedding, 3 blocks, head
  auto layout = describe_model(c);
  ASSERT_TRUE(layout.ok());
  Model::Options o;
  o.max_batch = 2;
  o.max_seq_len = 16;
  o.activation_slots = 2;
  o.module_ranges = {{0, 2}, {3, 5}};  // a stage's two chunks: embedding + block 0, block 2 + head
  auto every_device = testing::make_device();
  auto every_stream = every_device->create_stream("compute");
  auto every = Model::create(*layout, *every_device, **every_stream, o);
  ASSERT_TRUE(every.ok()) << every.status().to_string();
  auto device = testing::make_device();
  auto stream = device->create_stream("compute");
  Model::Options per = o;
  per.slot_ranges = {{0}, {1}};
  auto chunked = Model::create(*layout, *device, **stream, per);
  ASSERT_TRUE(chunked.ok()) << chunked.status().to_string();
  EXPECT_LT((*chunked)->activation_bytes(), (*every)->activation_bytes());
  Model& m = **chunked;
  ASSERT_TRUE(m.initialize(42).ok());
  const Batches b = make_batches(c, 1, 32);
  ASSERT_TRUE(m.select_slot(0).ok());
  ASSERT_TRUE(m.select_range(0).ok());
  auto wrong = m.select_range(1);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("slot 0 is not carved for module range 1"), std::string::npos)
      << wrong.to_string();
  ASSERT_TRUE(m.set_batch(b.in[0], b.tg[0], 2, 16).ok());
  ASSERT_TRUE(m.forward(true).ok());
  // The second chunk in slot 1: the batch comes from slot 0 (the head reads the targets).
  ASSERT_TRUE(m.select_slot(1).ok());
  ASSERT_FALSE(m.select_range(0).ok());
  ASSERT_TRUE(m.select_range(1).ok());
  EXPECT_FALSE(m.copy_losses(0).ok()) << "slot 1 holds no batch yet";
  EXPECT_FALSE(m.share_batch(2).ok());
  ASSERT_TRUE(m.share_batch(0).ok());
  ASSERT_TRUE(m.forward(true).ok());
  ASSERT_TRUE(m.copy_losses(0).ok());
  ASSERT_TRUE((*stream)->synchronize().ok());
  const auto targets = std::count_if(b.tg[0].begin(), b.tg[0].end(), [](std::int32_t t) { return t >= 0; });
  EXPECT_EQ(m.loss_sum(0).count, targets);
  EXPECT_TRUE(std::isfinite(m.loss_sum(0).sum));
  // Bad slot lists.
  Model::Options bad = per;
  bad.plan_arena = false;  // the arena is planned for the model above
  bad.slot_ranges = {{0}};
  auto short_list = Model::create(*layout, *device, **stream, bad);
  ASSERT_FALSE(short_list.ok());
  EXPECT_NE(short_list.status().message().find("one entry per activation slot (2)"), std::string::npos);
  bad.slot_ranges = {{0}, {2}};
  auto no_range = Model::create(*layout, *device, **stream, bad);
  ASSERT_FALSE(no_range.ok());
  EXPECT_NE(no_range.status().message().find("slot_ranges[1]"), std::string::npos);
}

// Two stage models (each with all parameters, initialised alike), the boundary tensors copied
// between them through the host, in 1F1B order on both: each stage's gradients are the
// reference's bits. GPT-2's tied wte: the stages hold the embedding's and the head's parts,
// whose sum is the reference only within rounding when several micro-batches accumulate.
// A stream's failure belongs to the pass that reported it (docs/offload.md "Faults"): set_batch
// records its token copies on the model's stream, and on a failed stream that record completes
// carrying the error. Once the stream's synchronize() has reported it, the next set_batch (the
// step run again) goes through, and so does the pass after it.
TEST(ModelStream, SetBatchAfterAReportedStreamFailureGoesThrough) {
  const ModelConfig c = small(ModelKind::kGpt2, 2);
  auto layout = describe_model(c);
  ASSERT_TRUE(layout.ok());
  Model::Options o;
  o.max_batch = 2;
  o.max_seq_len = 16;
  auto device = testing::make_device();
  auto stream = device->create_stream("compute");
  ASSERT_TRUE(stream.ok());
  auto model = Model::create(*layout, *device, **stream, o);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  Model& m = **model;
  ASSERT_TRUE(m.initialize(42).ok());
  const Batches b = make_batches(c, 2, 32);
  ASSERT_TRUE(
      (*stream)->host_fn("injected", [] { return internal_error("injected: the stream failed"); }).ok());
  ASSERT_TRUE(m.set_batch(b.in[0], b.tg[0], 2, 16).ok());  // its copies recorded after the failure
  const Status failed = (*stream)->synchronize();
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("injected: the stream failed"), std::string::npos) << failed.to_string();
  const Status again = m.set_batch(b.in[1], b.tg[1], 2, 16);
  ASSERT_TRUE(again.ok()) << again.to_string();
  ASSERT_TRUE(m.forward(true).ok());
  ASSERT_TRUE(m.copy_losses(0).ok());
  ASSERT_TRUE((*stream)->synchronize().ok());
  const auto targets = std::count_if(b.tg[1].begin(), b.tg[1].end(), [](std::int32_t t) { return t >= 0; });
  EXPECT_EQ(m.loss_sum(0).count, targets);
  EXPECT_TRUE(std::isfinite(m.loss_sum(0).sum));
}

TEST(ModelSlots, TwoStagesHandingOverBoundaries) {
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    const ModelConfig c = small(kind, 3);
    const Batches b = make_batches(c, kMicro, 32);
    std::vector<double> ref_losses;
    const auto ref = sequential(c, b, ref_losses);
    auto bounds = pipeline_stages(c, 2, 16);
    ASSERT_TRUE(bounds.ok());
    const int cut = (*bounds)[1], M = static_cast<int>(c.n_layer) + 2;

    auto device = testing::make_device();
    auto s0 = device->create_stream("stage0");
    auto s1 = device->create_stream("stage1");
    const int k0 = pipeline_slots(PipelineSchedule::kOneFOneB, 2, 0, kMicro);
    const int k1 = pipeline_slots(PipelineSchedule::kOneFOneB, 2, 1, kMicro);
    auto layout = describe_model(c);
    ASSERT_TRUE(layout.ok());
    // Each model carves regions named model.*: give each its own device instead.
    auto device1 = testing::make_device();
    auto s1b = device1->create_stream("stage1");
    auto m0 = make_model(*device, **s0, c, k0, 0, cut, true);
    auto m1 = make_model(*device1, **s1b, c, k1, cut, M, true);
    ASSERT_TRUE(m0 && m1);
    // The schedule of each stage, run as a dependency-respecting interleaving in one thread.
    const auto ops0 = pipeline_ops(PipelineSchedule::kOneFOneB, 2, 0, kMicro);
    const auto ops1 = pipeline_ops(PipelineSchedule::kOneFOneB, 2, 1, kMicro);
    std::vector<std::vector<char>> acts(kMicro), dgrads(kMicro);
    std::vector<char> have_act(kMicro, 0), have_grad(kMicro, 0);
    std::size_t i0 = 0, i1 = 0;
    while (i0 < ops0.size() || i1 < ops1.size()) {
      bool progressed = false;
      if (i0 < ops0.size()) {
        const PipelineOp op = ops0[i0];
        if (op.forward || have_grad[op.micro]) {
          ASSERT_TRUE(m0->select_slot(op.micro % k0).ok());
          if (op.forward) {
            ASSERT_TRUE(m0->set_batch(b.in[op.micro], b.tg[op.micro], 2, 16).ok());
            ASSERT_TRUE(m0->forward(true).ok());
            auto& out = acts[op.micro];
            out.resize(m0->boundary_bytes());
            ASSERT_TRUE((*s0)
                            ->copy_async(out.data(), m0->boundary_activation(cut), out.size(),
                                         CopyKind::kDeviceToHost)
                            .ok());
            ASSERT_TRUE((*s0)->synchronize().ok());
            have_act[op.micro] = 1;
          } else {
            ASSERT_TRUE((*s0)
                            ->copy_async(m0->activation_grad(), dgrads[op.micro].data(),
                                         dgrads[op.micro].size(), CopyKind::kHostToDevice)
                            .ok());
            ASSERT_TRUE(m0->backward(kDloss).ok());
          }
          ++i0;
          progressed = true;
        }
      }
      if (i1 < ops1.size()) {
        const PipelineOp op = ops1[i1];
        if (!op.forward || have_act[op.micro]) {
          ASSERT_TRUE(m1->select_slot(op.micro % k1).ok());
          if (op.forward) {
            ASSERT_TRUE(m1->set_batch(b.in[op.micro], b.tg[op.micro], 2, 16).ok());
            ASSERT_TRUE((*s1b)
                            ->copy_async(m1->boundary_activation(cut), acts[op.micro].data(),
                                         acts[op.micro].size(), CopyKind::kHostToDevice)
                            .ok());
            ASSERT_TRUE(m1->forward(true).ok());
            ASSERT_TRUE(m1->copy_losses(op.micro).ok());
          } else {
            ASSERT_TRUE(m1->backward(kDloss).ok());
            auto& out = dgrads[op.micro];
            out.resize(m1->boundary_bytes());
            ASSERT_TRUE(
                (*s1b)
                    ->copy_async(out.data(), m1->activation_grad(), out.size(), CopyKind::kDeviceToHost)
                    .ok());
            ASSERT_TRUE((*s1b)->synchronize().ok());
            have_grad[op.micro] = 1;
          }
          ++i1;
          progressed = true;
        }
      }
      ASSERT_TRUE(progressed) << "the two schedules wait for each other";
    }
    ASSERT_TRUE((*s0)->synchronize().ok());
    ASSERT_TRUE((*s1b)->synchronize().ok());
    for (int a = 0; a < kMicro; ++a) EXPECT_EQ(m1->loss_sum(a).sum, ref_losses[static_cast<std::size_t>(a)]);
    // Reference gradients per owning parameter, in layout order; the stages' in the same order.
    const auto g0 = grads_of(*m0, 0, cut), g1 = grads_of(*m1, cut, M);
    ASSERT_EQ(g0.size() + g1.size(), ref.size());
    const ModelLayout& L = m0->layout();
    const int wte = L.find(kind == ModelKind::kGpt2 ? "wte.weight" : "model.embed_tokens.weight");
    const bool tied = L.find("lm_head.weight") >= 0 &&
                      !L.params[static_cast<std::size_t>(L.find("lm_head.weight"))].owns_storage();
    std::size_t k = 0;
    for (std::size_t i = 0; i < L.params.size(); ++i) {
      if (!L.params[i].owns_storage()) continue;
      const auto& got = k < g0.size() ? g0[k] : g1[k - g0.size()];
      if (tied && static_cast<int>(i) == wte) {
        // Stage 1's copy of the head holds the head's part: stage 0's + stage 1's = the reference.
        auto head_part = m1->download_grad(static_cast<int>(i));
        ASSERT_TRUE(head_part.ok());
        double worst_diff = 0, scale = 0;
        for (std::size_t e = 0; e < got.size(); ++e) {
          worst_diff =
              std::max(worst_diff, static_cast<double>(std::abs(got[e] + (*head_part)[e] - ref[k][e])));
          scale = std::max(scale, static_cast<double>(std::abs(ref[k][e])));
        }
        EXPECT_LE(worst_diff, 1e-6 * scale) << "tied wte";
      } else {
        EXPECT_TRUE(testing::bitwise_equal(ref[k], got)) << L.params[i].name;
      }
      ++k;
    }
  }
}

}  // namespace
}  // namespace strata
