// Interleaved 1F1B: one process's op order and chunks (include/strata/pipeline_schedule.hpp).
#include "strata/pipeline_schedule.hpp"

#include <algorithm>
#include <string>

namespace strata {

namespace {

Status check_counts(int stages, int stage, int chunks, int micro_batches) {
  if (stages < 1) return invalid_argument("interleaved pipeline: " + std::to_string(stages) + " stages; expected >= 1");
  if (stage < 0 || stage >= stages) {
    return invalid_argument("interleaved pipeline: stage " + std::to_string(stage) + " is not in [0, " +
                            std::to_string(stages) + ")");
  }
  if (chunks < 1) {
    return invalid_argument("interleaved pipeline: " + std::to_string(chunks) +
                            " virtual stages (chunks) per process; expected >= 1");
  }
  if (micro_batches < 1) {
    return invalid_argument("interleaved pipeline: " + std::to_string(micro_batches) +
                            " micro-batches; expected >= 1");
  }
  if (chunks > 1 && micro_batches % stages != 0) {
    return invalid_argument("interleaved pipeline: " + std::to_string(micro_batches) +
                            " micro-batches is not a multiple of the " + std::to_string(stages) +
                            " stages (interleaving moves whole groups of one micro-batch per stage through each chunk)");
  }
  return ok_status();
}

}  // namespace

Result<std::vector<ChunkOp>> interleaved_pipeline_ops(int stages, int stage, int chunks, int micro_batches) {
  STRATA_RETURN_IF_ERROR(check_counts(stages, stage, chunks, micro_batches));
  const int p = stages, v = chunks, m = micro_batches, total = m * v;
  // k-th forward / backward of this process -> (micro-batch, chunk).
  auto micro_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto forward = [&](int k) { return ChunkOp{true, micro_of(k), (k / p) % v}; };
  auto backward = [&](int k) { return ChunkOp{false, micro_of(k), v - 1 - (k / p) % v}; };
  int warm = 0;
  if (v == 1) {
    warm = std::min(p - stage - 1, m);  // plain 1F1B
  } else if (m == p) {
    warm = total;  // one group: every forward first (the steady state would have no slack)
  } else {
    warm = std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  }
  std::vector<ChunkOp> ops;
  ops.reserve(static_cast<std::size_t>(2 * total));
  for (int k = 0; k < warm; ++k) ops.push_back(forward(k));
  for (int k = 0; warm + k < total; ++k) {  // steady state: one forward, one backward
    ops.push_back(forward(warm + k));
    ops.push_back(backward(k));
  }
  for (int k = total - warm; k < total; ++k) ops.push_back(backward(k));  // cool-down
  return ops;
}

Result<int> interleaved_pipeline_slots(int stages, int stage, int chunks, int micro_batches) {
  STRATA_ASSIGN_OR_RETURN(std::vector<ChunkOp> ops, interleaved_pipeline_ops(stages, stage, chunks, micro_batches));
  int live = 0, most = 0;
  for (const ChunkOp& op : ops) {
    live += op.forward ? 1 : -1;
    most = std::max(most, live);
  }
  return std::max(most, 1);
}

Result<int> interleaved_pipeline_micro_slots(int stages, int stage, int chunks, int micro_batches) {
  STRATA_ASSIGN_OR_RETURN(std::vector<ChunkOp> ops,
                          interleaved_pipeline_ops(stages, stage, chunks, micro_batches));
  // Chunk 0's forwards and backwards each run in micro-batch order: in flight = started - finished.
  int started = 0, finished = 0, most = 1;
  for (const ChunkOp& op : ops) {
    if (op.chunk != 0) continue;
    (op.forward ? started : finished) += 1;
    most = std::max(most, started - finished);
  }
  return most;
}

Result<InterleavedSlots> interleaved_slot_assignment(int stages, int stage, int chunks, int micro_batches) {
  STRATA_ASSIGN_OR_RETURN(std::vector<ChunkOp> ops,
                          interleaved_pipeline_ops(stages, stage, chunks, micro_batches));
  InterleavedSlots out;
  out.slot_of.assign(static_cast<std::size_t>(micro_batches * chunks), -1);
  std::vector<char> live;  // per slot
  for (const ChunkOp& op : ops) {
    const auto key = static_cast<std::size_t>(op.micro * chunks + op.chunk);
    if (!op.forward) {
      live[static_cast<std::size_t>(out.slot_of[key])] = 0;
      continue;
    }
    // Prefer a slot already carved for this chunk: the slots' sizes stay their chunks' own.
    int pick = -1;
    for (std::size_t j = 0; j < live.size() && pick < 0; ++j) {
      const auto& held = out.slot_chunks[j];
      if (!live[j] && std::find(held.begin(), held.end(), op.chunk) != held.end()) pick = static_cast<int>(j);
    }
    for (std::size_t j = 0; j < live.size() && pick < 0; ++j) {
      if (!live[j]) pick = static_cast<int>(j);
    }
    if (pick < 0) {
      pick = static_cast<int>(live.size());
      live.push_back(0);
      out.slot_chunks.emplace_back();
    }
    auto& held = out.slot_chunks[static_cast<std::size_t>(pick)];
    if (std::find(held.begin(), held.end(), op.chunk) == held.end()) {
      held.insert(std::upper_bound(held.begin(), held.end(), op.chunk), op.chunk);
    }
    live[static_cast<std::size_t>(pick)] = 1;
    out.slot_of[key] = pick;
  }
  return out;
}

Result<std::vector<std::pair<int, int>>> interleaved_stage_ranges(const std::vector<int>& bounds, int stages,
                                                                  int stage, int chunks) {
  STRATA_RETURN_IF_ERROR(check_counts(stages, stage, chunks, stages));
  const std::size_t want = static_cast<std::size_t>(stages) * static_cast<std::size_t>(chunks) + 1;
  if (bounds.size() != want) {
    return invalid_argument("interleaved pipeline: " + std::to_string(bounds.size()) + " chunk bounds for " +
                            std::to_string(stages) + " stages x " + std::to_string(chunks) +
                            " chunks; expected " + std::to_string(want));
  }
  for (std::size_t i = 1; i < bounds.size(); ++i) {
    if (bounds[i] <= bounds[i - 1]) {
      return invalid_argument("interleaved pipeline: chunk bounds are not increasing at index " + std::to_string(i) +
                              " (" + std::to_string(bounds[i - 1]) + ", " + std::to_string(bounds[i]) + ")");
    }
  }
  std::vector<std::pair<int, int>> ranges;
  for (int c = 0; c < chunks; ++c) {
    const auto j = static_cast<std::size_t>(c * stages + stage);
    ranges.emplace_back(bounds[j], bounds[j + 1]);
  }
  return ranges;
}

double interleaved_bubble_theory(int stages, int chunks, int micro_batches) {
  return static_cast<double>(stages - 1) /
         (static_cast<double>(chunks) * static_cast<double>(micro_batches) + static_cast<double>(stages - 1));
}

}  // namespace strata
