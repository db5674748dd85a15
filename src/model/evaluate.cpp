// Evaluation over windows of a token stream (evaluate_windows, strata/training.hpp): the loop
// shared by the Trainer and the offload engine, which supply how a forward pass over the batch
// set on the model runs (the model's own forward(false), or the engine's module-by-module pass
// with parameter fetches).
#include "model/evaluate.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "strata/device.hpp"

namespace strata {

Result<EvalResult> evaluate_windows(Model& model, std::span<const std::int32_t> tokens, std::int64_t seq_len,
                                    std::int64_t batch, std::int64_t max_windows) {
  return detail::evaluate_windows_with(model, tokens, seq_len, batch, max_windows,
                                       [&model]() { return model.forward(false); });
}

Result<EvalResult> detail::evaluate_windows_with(Model& model, std::span<const std::int32_t> tokens,
                                                 std::int64_t seq_len, std::int64_t batch,
                                                 std::int64_t max_windows,
                                                 const std::function<Status()>& forward) {
  if (seq_len < 1 || batch < 1)
    return invalid_argument("evaluate: sequence length and batch must be at least 1");
  std::int64_t windows = static_cast<std::int64_t>(tokens.size()) / (seq_len + 1);
  if (windows == 0) {
    return invalid_argument("evaluate: the data has " + std::to_string(tokens.size()) +
                            " tokens; a window of seq_len + 1 = " + std::to_string(seq_len + 1) +
                            " needs more");
  }
  if (max_windows > 0) windows = std::min(windows, max_windows);
  std::vector<std::int32_t> inputs, targets;
  LossSum total;
  for (std::int64_t w0 = 0; w0 < windows; w0 += batch) {
    const std::int64_t rows = std::min(batch, windows - w0);
    inputs.resize(static_cast<std::size_t>(rows * seq_len));
    targets.resize(inputs.size());
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t* win = tokens.data() + (w0 + r) * (seq_len + 1);
      std::memcpy(inputs.data() + r * seq_len, win, static_cast<std::size_t>(seq_len) * 4);
      std::memcpy(targets.data() + r * seq_len, win + 1, static_cast<std::size_t>(seq_len) * 4);
    }
    STRATA_RETURN_IF_ERROR(model.set_batch(inputs, targets, rows, seq_len));
    STRATA_RETURN_IF_ERROR(forward());
    STRATA_RETURN_IF_ERROR(model.copy_losses(0));
    STRATA_RETURN_IF_ERROR(model.stream().synchronize());
    const LossSum s = model.loss_sum(0);
    total.sum += s.sum;
    total.count += s.count;
  }
  return EvalResult{total.sum / static_cast<double>(total.count), total.count};
}

}  // namespace strata
