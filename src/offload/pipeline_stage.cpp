// A pipeline stage's schedule (engine_impl.hpp, docs/parallel.md "Pipeline parallel").
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

#include "device/backends.hpp"
#include "offload/engine_impl.hpp"
#include "offload/regions.hpp"
#include "optim/grad_norm_cuda.hpp"

namespace strata {

// One function on purpose: the schedule's ops, their receive buffers and the exchange's lambdas
// share one set of per-step locals (the op list, the buffer each receive takes, what of an op's
// exchanges was enqueued before a caller error), and the order in which they are enqueued is the
// deadlock-freedom argument below; cut apart, that order would be spread over several places.
//
// One step's micro-batches through this stage in the schedule's order. Forwards and backwards
// each run in micro-batch order, so every unit's gradient accumulates in the single process's
// order. The whole step is one pass of the prefetch trace (recorded in the first step).
//
// The boundary exchange is in compute-stream order, so the caller never synchronizes the stream
// mid-step and compute overlaps the transfers. A receive is posted by a host function at the
// start of the op before the one that reads it (the step's first receive, if op 0 needs one, when
// the step starts), into one of two buffers per direction used alternately: the transfer
// proceeds while that op computes. Posting earlier would keep more receives in flight, and the
// comm queue thread polls while anything is in flight, which costs compute time when the
// stages share cores. The op then has the stream wait for its receive alone and copy it into the
// model's buffer (the slot's boundary activation, or the shared activation gradient), which
// stream order makes free: every earlier reader of it was enqueued before; the buffer it used is
// reposted two receives later, after that copy in stream order. A send copies the output into its
// micro-batch's send buffer and is issued by the next host function, so it leaves as soon as the
// output exists while the stream goes on. Per peer, receives are posted and sends issued in
// micro-batch order on both sides (one direction per peer: activations go to s+1, gradients to
// s-1), which is what MPI's matching per (pair, Comm) needs. A stage blocks only on receives
// whose matching sends its neighbour issues in its own stream order without waiting for anything
// of ours later in the schedule than the op it unblocks: the same dependency graph as a blocking
// exchange, so no (p, m) deadlocks.
Status OffloadEngine::Impl::run_pipeline(std::span<const std::int32_t> inputs,
                                         std::span<const std::int32_t> targets, std::int64_t micro,
                                         float dloss, std::int64_t step, double lr) {
  const std::int64_t B = config.micro_batch, T = config.seq_len;
  const auto per = static_cast<std::size_t>(B * T);
  const int k = model->activation_slots();
  const int v = chunks;
  const int prev = (comms.pp_rank + comms.pp_size - 1) % comms.pp_size,
            next = (comms.pp_rank + 1) % comms.pp_size;
  const DType wire = wire_dtype();
  const std::uint64_t bytes = boundary_bytes();
  const std::size_t count = bytes / dtype_size(wire);
  const auto started = std::chrono::steady_clock::now();
  Comm* const comm = comms.pp_stream.get();
  // Interleaved: the activation gradients go on a Comm of their own (pp_stream_grads).
  Comm* const grad_comm = v > 1 ? comms.pp_stream_grads.get() : comm;
  pipe.sends.clear();
  pipe.pp_stream_wait_seconds = 0.0;
  fetcher.cyclic = false;
  fetcher.begin_pass();
  // A stage with tensor or data parallelism: a caller error inside a module's work fails the
  // compute stream and the stage goes on issuing every later module's collectives and exchanges
  // (keep_module_place; the cpu backend, whose failed stream skips the kernels but runs those):
  // the model's work (its tensor collectives) and, with data parallelism, the gradient
  // reduce-scatters at each unit's last touch (reduce_after_failure). Not at stage 3 (its
  // parameter all-gathers are in the fetch, which that mode skips) nor with the optimizer on
  // the device (its buckets, and its tied sum after the pass). A stage without either keeps its
  // place through any caller error of the schedule (keep_place below).
  keep_modules = (comms.tp_size > 1 || comms.dp_size > 1) && settings.zero_stage < 3 &&
                 !placement.sharding.optimizer_on_device && !placement.sharding.optimizer_split &&
                 device->info().kind == DeviceKind::kCpu;
  pass_error = ok_status();
  struct EndKeep {
    Impl* t;
    ~EndKeep() {
      t->keep_modules = false;
      t->pass_error = ok_status();
      (void)t->model->set_failed_pass(false);
    }
  } end_keep{this};
  // The stage's ops as (forward, micro-batch, chunk): the schedule's with one chunk, the
  // interleaved order with several.
  std::vector<ChunkOp> ops;
  if (v == 1) {
    for (const PipelineOp& op :
         pipeline_ops(settings.pipeline_schedule, comms.pp_size, comms.pp_rank, static_cast<int>(micro)))
      ops.push_back(ChunkOp{op.forward, op.micro, 0});
  } else {
    STRATA_ASSIGN_OR_RETURN(
        ops, interleaved_pipeline_ops(comms.pp_size, comms.pp_rank, v, static_cast<int>(micro)));
  }
  // Whether an op receives its input (the first virtual stage's forward and the last one's
  // backward do not) and sends its output (the last virtual stage's forward, the first's backward
  // do not); virtual stage c·p + s is chunk c of stage s.
  auto receives = [&](const ChunkOp& op) {
    return op.forward ? !(comms.pp_rank == 0 && op.chunk == 0)
                      : !(comms.pp_rank + 1 == comms.pp_size && op.chunk + 1 == v);
  };
  auto sends_out = [&](const ChunkOp& op) {
    return op.forward ? !(comms.pp_rank + 1 == comms.pp_size && op.chunk + 1 == v)
                      : !(comms.pp_rank == 0 && op.chunk == 0);
  };
  // Per op, the receive buffer it uses: the n-th receive of its direction in the step takes
  // buffer n % kBuffers (with one chunk n is the micro-batch, as every op of a direction
  // receives).
  constexpr int kBuffers = partition::kPipelineRecvBuffers;
  std::vector<int> recv_buffer(ops.size(), -1);
  {
    int n_act = 0, n_grad = 0;
    for (std::size_t j = 0; j < ops.size(); ++j) {
      if (!receives(ops[j])) continue;
      recv_buffer[j] = (ops[j].forward ? n_act++ : n_grad++) % kBuffers;
    }
  }
  // Posts op j's receive, if it has one (in stream order, on the worker thread).
  auto post = [&](std::size_t j) -> Status {
    if (j >= ops.size()) return ok_status();
    const ChunkOp& op = ops[j];
    if (!receives(op)) return ok_status();
    const auto i = static_cast<std::size_t>(recv_buffer[j]);
    void* buf = op.forward ? pipe.act_recv[i].data() : pipe.grad_recv[i].data();
    CommWork* work = op.forward ? &pipe.act_recv_work[i] : &pipe.grad_recv_work[i];
    const int peer = op.forward ? prev : next;
    Comm* c = op.forward ? comm : grad_comm;
    return detail::host_fn_after_failure(*compute,
                                         "pipeline: post a receive from stage " + std::to_string(peer),
                                         [c, buf, work, count, wire, peer]() {
                                           *work = c->recv(buf, count, wire, peer);
                                           return ok_status();
                                         });
  };
  // The exchanges (posting a receive, waiting for it, issuing a send) run even after the stream
  // failed: a stage whose pass failed keeps its place in the schedule, so its neighbours' passes
  // go through and every stage reaches the step's agreement on the failure (docs/offload.md
  // "Faults", "A rank whose pass failed keeps its place"). What such a stage sends is whatever
  // its send buffer held; the step fails on every stage, so nothing reads it.
  // The stream waits for one receive (timed: the stage's idle time, its share of the bubble).
  auto wait_receive = [&](const std::vector<CommWork>& works, int buffer, std::string what) -> Status {
    const auto i = static_cast<std::size_t>(buffer);
    return detail::host_fn_after_failure(
        *compute, "pipeline: " + what, [this, w = &works[i], what]() -> Status {
          const auto t0 = std::chrono::steady_clock::now();
          Status st = w->wait();
          pipe.pp_stream_wait_seconds +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          return st.with_context("pipeline: " + what);
        });
  };
  // ... then copies it to where the model reads it.
  auto receive = [&](const std::vector<CommWork>& works, std::vector<ArenaBuffer>& bufs, int buffer,
                     void* dst, std::string what) -> Status {
    STRATA_RETURN_IF_ERROR(wait_receive(works, buffer, std::move(what)));
    return compute->copy_async(dst, bufs[static_cast<std::size_t>(buffer)].data(), bytes,
                               CopyKind::kDeviceToDevice);
  };
  // Issues the send of send buffer `index` (a·v + chunk) in stream order.
  auto issue_send = [&](std::vector<ArenaBuffer>& bufs, int index, int peer, Comm* c) -> Status {
    void* out = bufs[static_cast<std::size_t>(index)].data();
    pipe.pp_bytes += bytes;
    return detail::host_fn_after_failure(*compute, "pipeline: send to stage " + std::to_string(peer),
                                         [this, c, out, count, wire, peer]() {
                                           pipe.sends.push_back(c->send(out, count, wire, peer));
                                           return ok_status();
                                         });
  };
  // Copies an output to its send buffer and issues the send behind it.
  auto send = [&](std::vector<ArenaBuffer>& bufs, int index, const void* src, int peer, Comm* c) -> Status {
    STRATA_RETURN_IF_ERROR(compute->copy_async(bufs[static_cast<std::size_t>(index)].data(), src, bytes,
                                               CopyKind::kDeviceToDevice));
    return issue_send(bufs, index, peer, c);
  };
  auto chunk_name = [&](const ChunkOp& op) {
    return v == 1 ? std::string() : " (chunk " + std::to_string(op.chunk) + ")";
  };
  auto receive_name = [&](const ChunkOp& op) {
    return "receive of micro-batch " + std::to_string(op.micro) +
           (op.forward ? "'s activations" : "'s activation gradients") + chunk_name(op) + " from stage " +
           std::to_string(op.forward ? prev : next);
  };
  // Partial offload with data parallelism at stages 2-3: the device units reduced after each
  // micro-batch's backward op (interleaved: the units of the op's chunk).
  const bool reduce_each = placement.sharding.split_state_sharded && settings.zero_stage >= 2 && step > 0;
  // What of op j's exchanges was enqueued: a caller error inside the op leaves the rest to
  // finish_exchanges.
  struct Exchanged {
    bool posted = false, received = false, sent = false;
  };
  auto run_op = [&](std::size_t j, Exchanged& done) -> Status {
    const ChunkOp& op = ops[j];
    const int a = op.micro, c = op.chunk;
    const auto [first, end] = placement.stage.chunk_ranges[static_cast<std::size_t>(c)];
    STRATA_RETURN_IF_ERROR(post(j + 1));  // the next op's input arrives while this one computes
    done.posted = true;
    // Interleaved: each (micro-batch, chunk) has a slot of its own, which gets the batch
    // (the tokens for the embedding's chunk, the targets for the head's) at its forward.
    STRATA_RETURN_IF_ERROR(model->select_slot(v > 1 ? pipe.chunk_slots.slot(a, c, v) : a % k));
    if (v > 1) STRATA_RETURN_IF_ERROR(model->select_range(c));
    if (op.forward) {
      if (c == 0 || v > 1) {
        STRATA_RETURN_IF_ERROR(
            model->set_batch(inputs.subspan(a * per, per), targets.subspan(a * per, per), B, T));
      }
      if (model->boundary_bytes() != bytes) {
        return internal_error("pipeline: boundary tensor of " + std::to_string(model->boundary_bytes()) +
                              " bytes, expected " + std::to_string(bytes));
      }
      if (receives(op)) {
        done.received = true;
        STRATA_RETURN_IF_ERROR(receive(pipe.act_recv_work, pipe.act_recv, recv_buffer[j],
                                       model->boundary_activation(first), receive_name(op)));
      }
      STRATA_RETURN_IF_ERROR(run_forward(true, c));
      // The losses: the head's chunk (the last) computes them; a stage without the head copies zeros.
      if (c + 1 == v) STRATA_RETURN_IF_ERROR(model->copy_losses(a));
      if (sends_out(op)) {
        done.sent = true;
        STRATA_RETURN_IF_ERROR(send(pipe.act_send, a * v + c, model->boundary_activation(end), next, comm));
      }
    } else {
      if (receives(op)) {
        done.received = true;
        STRATA_RETURN_IF_ERROR(receive(pipe.grad_recv_work, pipe.grad_recv, recv_buffer[j],
                                       model->activation_grad(), receive_name(op)));
      }
      // Every unit is read by one chunk of this stage, whose backwards run in micro-batch
      // order: micro-batch 0 starts its gradient, micro-batch m − 1 completes it.
      STRATA_RETURN_IF_ERROR(run_backward(dloss, a == 0, a + 1 == micro, step, lr, c));
      if (sends_out(op)) {
        done.sent = true;
        STRATA_RETURN_IF_ERROR(send(pipe.grad_send, a * v + c, model->activation_grad(), prev, grad_comm));
      }
      if (reduce_each) {
        // Partial offload, pipeline x data parallel at stages 2-3: this micro-batch's gradients
        // of the device units chunk c reads are complete (the op ran every module of the chunk,
        // and no other chunk of this stage reads them), so they are reduce-scattered now, as
        // run_micro_batches does after each micro-batch, and added into offload.grad_slices;
        // then zeroed for the chunk's next backward op (the staging holds the copy the
        // collective reads). Per unit the micro-batches add in order (a chunk's backwards run
        // in micro-batch order): ratio 1's fp32 order. Behind the send in stream order: the
        // previous stage's backward does not wait for the collective.
        STRATA_RETURN_IF_ERROR(devopt.reduce_device_units(/*accumulate=*/a > 0, c));
        if (a + 1 < micro) STRATA_RETURN_IF_ERROR(devopt.zero_device_grads(c));
      }
    }
    return ok_status();
  };
  // After a caller error: op j's exchanges not yet enqueued, without its compute (the stream has
  // failed, so the copies around them would be skipped anyway).
  auto finish_exchanges = [&](std::size_t j, const Exchanged& done) -> Status {
    const ChunkOp& op = ops[j];
    if (!done.posted) STRATA_RETURN_IF_ERROR(post(j + 1));
    if (receives(op) && !done.received) {
      STRATA_RETURN_IF_ERROR(wait_receive(op.forward ? pipe.act_recv_work : pipe.grad_recv_work,
                                          recv_buffer[j], receive_name(op)));
    }
    if (sends_out(op) && !done.sent) {
      const int index = op.micro * v + op.chunk;
      STRATA_RETURN_IF_ERROR(op.forward ? issue_send(pipe.act_send, index, next, comm)
                                        : issue_send(pipe.grad_send, index, prev, grad_comm));
    }
    return ok_status();
  };
  // A caller error inside an op fails the compute stream (its later kernels are skipped) and the
  // stage keeps its place: the rest of the schedule's exchanges are still enqueued, then the tied
  // embedding's sum. Tensor or data parallelism inside the stage issue collectives of their own
  // in the skipped ops (they keep their place for an error inside a module's work through
  // keep_modules above), and the optimizer on the device (or partly there) sums the tied
  // embedding after the pass, so there a caller error still stops the pass (docs/offload.md
  // "Not built yet").
  const bool keep_place = comms.tp_size <= 1 && comms.dp_size <= 1 &&
                          !placement.sharding.optimizer_on_device && !placement.sharding.optimizer_split;
  auto schedule = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(post(0));
    Status failed;
    for (std::size_t j = 0; j < ops.size(); ++j) {
      Exchanged done;
      if (failed.ok()) {
        Status st = run_op(j, done);
        if (st.ok()) continue;
        if (!keep_place) return st;
        failed = st;
        STRATA_RETURN_IF_ERROR(compute->host_fn("pipeline: the stage's pass failed", [st]() { return st; }));
      }
      STRATA_RETURN_IF_ERROR(finish_exchanges(j, done));
    }
    return failed.ok() ? pass_error : failed;
  };
  Status s = schedule();
  // Always drained before returning, also after an error: the stream's host functions use
  // pp_stream and the handle vectors, which the caller must not touch while they run.
  Status sync = compute->synchronize();
  if (s.ok()) s = sync;
  for (const CommWork& w : pipe.sends) {
    Status ws = w.wait();
    if (s.ok() && !ws.ok()) s = ws.with_context("pipeline: send");
  }
  pipe.sends.clear();
  pipe.pp_wait_seconds += pipe.pp_stream_wait_seconds;
  pipe.pp_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!s.ok()) {
    // The tied embedding's sum is the step's last exchange between the first and the last stage,
    // and the other end's pass may have gone through: a stage that keeps its place joins it too,
    // on whatever its buffer holds (the step fails on every stage, so nothing reads the sum).
    grads.tied_landed.reset();
    if ((keep_place || keep_modules) && step > 0 && comms.pp_tied) {
      (void)gstream->synchronize();  // the gradient copies into the buffer have retired
      const std::size_t uu = static_cast<std::size_t>(placement.stage.tied_unit);
      auto [buf, n] = grads.unit_grads(placement.stage.tied_unit);
      if (grads_on_nvme)
        buf = grads.grad_staging.bytes(), n = placement.sharding.host_state_sharded
                                                  ? placement.units[uu].slice.len
                                                  : placement.units[uu].grad_bytes / 4;
      (void)reduce_tied_grads(reinterpret_cast<float*>(buf), n);
    }
    return s;
  }
  if (grads.tied_landed) {  // the host optimizer's tied unit: summed, then handed to the optimizer thread
    const Command c = *grads.tied_landed;
    grads.tied_landed.reset();
    STRATA_RETURN_IF_ERROR(gstream->synchronize());
    STRATA_RETURN_IF_ERROR(grads.sum_tied_landed(c));
    {
      std::lock_guard<std::mutex> lock(ledger.mu);
      ledger.commands.push_back(c);
    }
    ledger.cv.notify_all();
  }
  if (step > 0 && comms.pp_tied && placement.split_device(placement.stage.tied_unit) &&
      !placement.sharding.split_state_sharded) {
    // Partial offload, the tied unit among this stage's device units: its gradient accumulated
    // in offload.grads; summed with the other end's here, at the point where a host unit's is
    // (the other end's may be either, the all-reduce on the caller either way), before
    // scan_device_units reads it. The compute stream was synchronized above. With data
    // parallelism the reduced slice is summed instead (run_micro_batches).
    STRATA_RETURN_IF_ERROR(reduce_tied_grads(
        reinterpret_cast<float*>(reinterpret_cast<char*>(devopt.dgrads) +
                                 grad_begin(placement.stage.tied_unit)),
        placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].grad_bytes / 4));
  }
  return fetcher.end_pass();
}

// Forward only (loss, evaluate) of the batch set on the model, in slot 0. Every stage runs it
// for every batch, in the same order; the last stage's losses are the single process's (each
// module computes what it computes there, on the same bits of its input).
Status OffloadEngine::Impl::forward_stage() {
  const DType wire = wire_dtype();
  const std::uint64_t bytes = model->boundary_bytes();
  const std::size_t count = bytes / dtype_size(wire);
  // Interleaved: chunk c's input comes from the previous stage (stage 0's chunks c > 0: from the
  // last stage's chunk c − 1) and its output goes to the next (the last stage's: to stage 0).
  // The chunks form one chain through the processes, so the blocking exchange cannot cycle.
  const int prev = (comms.pp_rank + comms.pp_size - 1) % comms.pp_size,
            next = (comms.pp_rank + 1) % comms.pp_size;
  // Interleaved: each chunk runs in a slot carved for it (forward_slot), which takes the batch
  // from the slot it was set in.
  const int batch_slot = model->slot();
  for (int c = 0; c < chunks; ++c) {
    const auto [first, end] = placement.stage.chunk_ranges[static_cast<std::size_t>(c)];
    if (chunks > 1) {
      STRATA_RETURN_IF_ERROR(model->select_slot(pipe.forward_slot[static_cast<std::size_t>(c)]));
      STRATA_RETURN_IF_ERROR(model->share_batch(batch_slot));
      STRATA_RETURN_IF_ERROR(model->select_range(c));
    }
    if (comms.pp_rank > 0 || c > 0) {
      STRATA_RETURN_IF_ERROR(compute->synchronize());  // the input buffer's previous reader is done
      STRATA_RETURN_IF_ERROR(
          comms.pp_caller->recv(model->boundary_activation(first), count, wire, prev)
              .wait()
              .with_context("pipeline (forward only): receive of the activations from stage " +
                            std::to_string(prev)));
    }
    if (c == 0) fetcher.begin_pass();
    STRATA_RETURN_IF_ERROR(run_forward(false, c));
    if (c + 1 == chunks) STRATA_RETURN_IF_ERROR(fetcher.end_pass());
    if (comms.pp_rank + 1 < comms.pp_size || c + 1 < chunks) {
      STRATA_RETURN_IF_ERROR(compute->synchronize());
      STRATA_RETURN_IF_ERROR(comms.pp_caller->send(model->boundary_activation(end), count, wire, next)
                                 .wait()
                                 .with_context("pipeline (forward only): send of the activations to stage " +
                                               std::to_string(next)));
    }
  }
  return ok_status();
}

}  // namespace strata
