// Interleaved 1F1B (virtual pipeline stages): the order of one process's work and the module
// chunks it owns. docs/parallel.md "Pipeline parallel on the offload engine" (Schedules).
//
// The engine runs it with strata.pipeline_virtual_stages = v > 1 (OffloadSettings::
// pipeline_virtual_stages; engine.cpp run_pipeline iterates interleaved_pipeline_ops). Unit
// tested in tests/test_model_pipeline.cpp (op order, dependencies, deadlock freedom by simulation
// over p processes, message matching order, slot counts) and against one process in
// tests/test_dist_pipeline.cpp.
//
// The model is split into v·p FLOP-balanced chunks (pipeline_stages(config, v·p, seq_len));
// virtual stage j = c·p + s is chunk c of process s, so process s owns chunks s, s+p, ...,
// s+(v−1)p. The embedding (virtual stage 0) is on process 0 and the head (virtual stage v·p−1)
// on process p−1, as in plain 1F1B, so GPT-2's tied wte keeps its two ends where they were.
// A forward of micro-batch a through virtual stage j sends its output to process (j+1) mod p;
// process p−1 hands chunk c's output to process 0's chunk c+1.
#pragma once

#include <utility>
#include <vector>

#include "strata/status.hpp"

namespace strata {

// One op of the interleaved schedule: the forward (or backward) of micro-batch `micro` through
// this process's chunk `chunk` (0 .. v−1, i.e. virtual stage chunk·p + stage).
struct ChunkOp {
  bool forward = true;
  int micro = 0;
  int chunk = 0;
  friend bool operator==(const ChunkOp&, const ChunkOp&) = default;
};

// Process `stage`'s ops for p = `stages` processes, v = `chunks` chunks each and m micro-batches,
// in the standard (Megatron) interleaved order. The k-th forward (k = 0 .. m·v−1) is chunk
// (k / p) mod v of micro-batch (k / (p·v))·p + k mod p: groups of p micro-batches go through
// every chunk before the next group starts; the k-th backward takes the chunks in reverse,
// chunk v−1−(k / p) mod v, same micro-batch. Warm-up: (p − s − 1)·2 + (v − 1)·p forwards (all of
// them when m = p, capped at m·v), then one forward and one backward alternate, then the
// remaining backwards. So each chunk's forwards and backwards each run in micro-batch order (a
// unit's gradient accumulates in the single process's order) and a backward follows its forward.
// v = 1 gives the 1F1B order (pipeline_ops). Errors: stages < 1, stage outside [0, stages),
// chunks < 1, m < 1, or m not a multiple of p with v > 1 (the grouping needs whole groups); each
// message names the value and what was expected.
Result<std::vector<ChunkOp>> interleaved_pipeline_ops(int stages, int stage, int chunks, int micro_batches);

// The most (micro-batch, chunk) forwards in flight (forward done, backward not) at once on that
// process: the activation sets of its chunks it needs. Errors as interleaved_pipeline_ops.
Result<int> interleaved_pipeline_slots(int stages, int stage, int chunks, int micro_batches);

// The most micro-batches in flight at once on that process (a micro-batch is in flight from its
// first chunk's forward to its first chunk's backward; both run in micro-batch order, so the
// micro-batches in flight are consecutive and micro-batch a may use activation slot a mod this
// count). Slots holding every chunk of one micro-batch would need this many; the engine carves
// them per chunk instead (interleaved_slot_assignment). Errors as interleaved_pipeline_ops.
Result<int> interleaved_pipeline_micro_slots(int stages, int stage, int chunks, int micro_batches);

// Activation slots carved per (micro-batch, chunk): which slot each forward of the interleaved
// order keeps its activations in until its backward. Walking interleaved_pipeline_ops, a forward
// takes the lowest free slot that has held its chunk before, else the lowest free slot, else a
// new one; its backward frees it. So there are exactly interleaved_pipeline_slots slots (a new
// one opens only when every slot is live), no slot holds two live (micro-batch, chunk) pairs,
// and a slot mostly holds one chunk (it is carved for the largest chunk it ever holds: the
// chunks' activations alias each other in it, as they are never live in it at once).
struct InterleavedSlots {
  std::vector<int> slot_of;                   // index micro·chunks + chunk -> slot
  std::vector<std::vector<int>> slot_chunks;  // per slot, the chunks it holds, ascending
  int slot(int micro, int chunk, int chunks) const {
    return slot_of[static_cast<std::size_t>(micro * chunks + chunk)];
  }
};
// Errors as interleaved_pipeline_ops.
Result<InterleavedSlots> interleaved_slot_assignment(int stages, int stage, int chunks, int micro_batches);

// The module ranges process `stage` owns, in chunk order: [bounds[c·p + s], bounds[c·p + s + 1])
// for c = 0 .. v−1, from the v·p + 1 bounds of pipeline_stages(config, v·p, seq_len). Errors: the
// bounds are not v·p + 1 increasing values, or the stage is out of range.
Result<std::vector<std::pair<int, int>>> interleaved_stage_ranges(const std::vector<int>& bounds, int stages,
                                                                  int stage, int chunks);

// The ideal bubble fraction of interleaved 1F1B with equal chunks and free communication:
// 1F1B's bubble time (p − 1)·(t_f + t_b) divided by v, over the step (m·(t_f + t_b) of compute
// plus the bubble): (p − 1) / (v·m + p − 1). v = 1 is 1F1B's (p − 1) / (m + p − 1).
double interleaved_bubble_theory(int stages, int chunks, int micro_batches);

}  // namespace strata
