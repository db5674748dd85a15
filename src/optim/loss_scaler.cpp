// DeepSpeed's loss scaler, as a state machine over (scale, iteration, last overflow iteration,
// hysteresis left). The meaning of each fp16 key is DeepSpeed's; docs/optim.md walks through
// the transitions.
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

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

Result<LossScalerConfig> LossScalerConfig::from_json(std::string_view fp16_object) {
  using nlohmann::json;
  json j = json::parse(fp16_object, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("fp16: not valid JSON");
  if (!j.is_object())
    return invalid_argument("fp16: expected a JSON object, got " + std::string(j.type_name()));
  LossScalerConfig c;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    auto want = [&](const char* what) {
      return invalid_argument("fp16." + key + ": expected " + what + ", got " + v.dump());
    };
    auto as_int = [&](int& out) -> Status {
      if (v.is_number_integer() || v.is_number_unsigned()) {
        const auto x = v.get<long long>();
        if (x < -(1LL << 30) || x > (1LL << 30)) return want("an integer of reasonable size");
        out = static_cast<int>(x);
        return ok_status();
      }
      if (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()) &&
          std::fabs(v.get<double>()) < 1e9) {
        out = static_cast<int>(v.get<double>());
        return ok_status();
      }
      return want("an integer");
    };
    if (key == "enabled") {
      if (!v.is_boolean()) return want("true or false");
      c.enabled = v.get<bool>();
    } else if (key == "auto_cast") {
      if (!v.is_boolean()) return want("true or false");  // the engine's concern, accepted here
    } else if (key == "loss_scale") {
      if (!v.is_number()) return want("a number");
      c.loss_scale = v.get<double>();
    } else if (key == "initial_scale_power") {
      STRATA_RETURN_IF_ERROR(as_int(c.initial_scale_power));
    } else if (key == "loss_scale_window") {
      STRATA_RETURN_IF_ERROR(as_int(c.loss_scale_window));
    } else if (key == "hysteresis") {
      STRATA_RETURN_IF_ERROR(as_int(c.hysteresis));
    } else if (key == "consecutive_hysteresis") {
      if (!v.is_boolean()) return want("true or false");
      c.consecutive_hysteresis = v.get<bool>();
    } else if (key == "min_loss_scale") {
      if (!v.is_number()) return want("a number");
      c.min_loss_scale = v.get<double>();
    } else {
      return invalid_argument("fp16." + key +
                              ": unknown key (known: enabled, auto_cast, loss_scale, initial_scale_power, "
                              "loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale)");
    }
  }
  STRATA_RETURN_IF_ERROR(c.validate());
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
