// The windowed evaluation loop shared by the Trainer and the offload engine (evaluate.cpp): the
// caller supplies how a forward pass over the batch set on the model runs (the model's own
// forward(false), or the engine's module-by-module pass with parameter fetches). Private to src/.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "strata/training.hpp"

namespace strata::detail {

Result<EvalResult> evaluate_windows_with(Model& model, std::span<const std::int32_t> tokens, std::int64_t seq_len,
                                         std::int64_t batch, std::int64_t max_windows,
                                         const std::function<Status()>& forward);

}  // namespace strata::detail
