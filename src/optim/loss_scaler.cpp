// DeepSpeed's loss scaler, as a state machine over (scale, iteration, last overflow iteration,
// hysteresis left). The meaning of each fp16 key is DeepSpeed's; docs/optim.md walks through
// the transitions.
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "strata/config.hpp"
#include "strata/optim.hpp"

namespace strata {

namespace {

std::string num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace

Status LossScalerConfig::validate() const {
  if (!std::isfinite(loss_scale) || loss_scale < 0) {
    return invalid_argument("fp16.loss_scale = " + num(loss_scale) +
                            " is not 0 (dynamic) or a positive number");
  }
  if (initial_scale_power < 0 || initial_scale_power > 126) {
    return invalid_argument("fp16.initial_scale_power = " + std::to_string(initial_scale_power) +
                            " is not in [0, 126]");
  }
  if (loss_scale_window < 1) {
    return invalid_argument("fp16.loss_scale_window = " + std::to_string(loss_scale_window) + " is not >= 1");
  }
  if (hysteresis < 1)
    return invalid_argument("fp16.hysteresis = " + std::to_string(hysteresis) + " is not >= 1");
  if (!std::isfinite(min_loss_scale) || min_loss_scale <= 0) {
    return invalid_argument("fp16.min_loss_scale = " + num(min_loss_scale) + " is not a positive number");
  }
  if (loss_scale == 0 && std::ldexp(1.0, initial_scale_power) < min_loss_scale) {
    return invalid_argument("fp16.initial_scale_power = " + std::to_string(initial_scale_power) +
                            " starts below fp16.min_loss_scale = " + num(min_loss_scale));
  }
  return ok_status();
}

LossScalerConfig LossScalerConfig::from_config(const Fp16Config& fp16) {
  LossScalerConfig c;
  c.enabled = fp16.enabled;
  c.loss_scale = fp16.loss_scale;
  c.initial_scale_power = fp16.initial_scale_power;
  c.loss_scale_window = fp16.loss_scale_window;
  c.hysteresis = fp16.hysteresis;
  c.consecutive_hysteresis = fp16.consecutive_hysteresis;
  c.min_loss_scale = fp16.min_loss_scale;
  return c;
}

Result<LossScaler> LossScaler::create(const LossScalerConfig& config) {
  STRATA_RETURN_IF_ERROR(config.validate());
  LossScalerState s;
  s.scale = config.loss_scale > 0 ? config.loss_scale : std::ldexp(1.0, config.initial_scale_power);
  s.hysteresis_left = config.hysteresis;
  return LossScaler(config, s);
}

Status LossScaler::restore(const LossScalerState& s) {
  if (!std::isfinite(s.scale) || s.scale <= 0)
    return invalid_argument("loss scaler state: scale " + num(s.scale) + " is not positive");
  if (dynamic() && s.scale < config_.min_loss_scale) {
    return invalid_argument("loss scaler state: scale " + num(s.scale) + " is below fp16.min_loss_scale " +
                            num(config_.min_loss_scale));
  }
  if (!dynamic() && s.scale != config_.loss_scale) {
    return invalid_argument("loss scaler state: scale " + num(s.scale) +
                            " differs from the static fp16.loss_scale " + num(config_.loss_scale));
  }
  if (s.iteration < 0 || s.last_overflow_iteration < -1 || s.last_overflow_iteration >= s.iteration) {
    return invalid_argument("loss scaler state: last overflow iteration " +
                            std::to_string(s.last_overflow_iteration) +
                            " is not in [-1, iteration = " + std::to_string(s.iteration) + ")");
  }
  if (s.hysteresis_left < 1 || s.hysteresis_left > config_.hysteresis) {
    return invalid_argument("loss scaler state: hysteresis left " + std::to_string(s.hysteresis_left) +
                            " is not in [1, fp16.hysteresis = " + std::to_string(config_.hysteresis) + "]");
  }
  if (s.overflows < 0) return invalid_argument("loss scaler state: negative overflow count");
  state_ = s;
  return ok_status();
}

Result<bool> LossScaler::update(bool overflow) {
  LossScalerState next = state_;
  if (overflow) {
    ++next.overflows;
    if (dynamic()) {
      if (next.hysteresis_left <= 1) {
        // Hysteresis exhausted: halve, but not below the floor. DeepSpeed raises when already there.
        if (next.scale <= config_.min_loss_scale && config_.raise_error_at_min_scale) {
          return failed_precondition(
              "loss scale is already at fp16.min_loss_scale = " + num(config_.min_loss_scale) +
              " and gradients still overflow (iteration " + std::to_string(state_.iteration) +
              "); lower fp16.min_loss_scale or check the model for inf/nan");
        }
        next.scale = std::max(next.scale / 2.0, config_.min_loss_scale);
      } else {
        --next.hysteresis_left;
      }
    }
    next.last_overflow_iteration = next.iteration;
  } else if (dynamic()) {
    if (config_.consecutive_hysteresis) next.hysteresis_left = config_.hysteresis;
    if ((next.iteration - next.last_overflow_iteration) % config_.loss_scale_window == 0) {
      if (!config_.consecutive_hysteresis) next.hysteresis_left = config_.hysteresis;
      next.scale *= 2.0;
    }
  }
  ++next.iteration;
  state_ = next;
  return !overflow;
}

}  // namespace strata
