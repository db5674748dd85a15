// This process's place in the tensor x pipeline x data-parallel grid and the communicators its
// threads use (docs/parallel.md). Each thread that talks has its own Comm, split once from its
// group, and uses it in the same order on every rank of the group; a collective of one thread
// never waits behind another thread's. Who uses which:
//
//   data parallel   dp_caller  the caller: losses, state access, checkpoints, weights, agreement
//                   dp_grads   the gradient stream: reduce-scatters of landed units (host tier)
//                   dp_params  the host optimizer thread: statistics, parameter all-gathers,
//                              per-unit agreement; or the compute stream's sharded device update
//                   dp_fetch   the h2d stream: stage 3's parameter all-gathers at each fetch
//                   dp_buckets the compute stream: the device optimizer's gradient buckets
//                   dp_device  the compute stream: a partial split's device units
//   tensor parallel tp_model   the compute stream: the model's collectives, the device norm
//                   tp_step    the caller: full parameters for state access, checkpoints
//                   tp_norm    the host optimizer thread: the norm, per-unit agreement
//   pipeline        pp_caller  the caller: losses, forward-only passes, checkpoints
//                   pp_norm    the thread that merges the norm (optimizer thread or compute)
//                   pp_stream  the compute stream: boundary activations (and gradients)
//                   pp_stream_grads  interleaved 1F1B: the boundary gradients
//                   pp_tied    the first and the last stage: the tied embedding's gradient
//
// A null group (or one of size 1) is a dimension this process does not split over.
#pragma once

#include <memory>
#include <string>

#include "strata/parallel.hpp"

namespace strata::parallel {

struct RankComms {
  Comm* dp = nullptr;
  int dp_size = 1, dp_rank = 0;
  Comm* tp = nullptr;
  int tp_size = 1, tp_rank = 0;
  Comm* pp = nullptr;
  int pp_size = 1, pp_rank = 0;

  std::unique_ptr<Comm> dp_caller, dp_grads, dp_params, dp_fetch, dp_buckets, dp_device;
  std::unique_ptr<Comm> tp_model, tp_step, tp_norm;
  std::unique_ptr<Comm> pp_caller, pp_norm, pp_stream, pp_stream_grads, pp_tied;

  // This rank in its groups, for errors: "pipeline stage 1, tensor-parallel rank 0 of 2".
  std::string rank_name() const;
};

}  // namespace strata::parallel
