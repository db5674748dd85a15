// Learning-rate schedules with DeepSpeed's meaning (LrSchedule, strata/training.hpp): the rate of
// each update number, and the checks of a schedule's numbers.
#include <algorithm>
#include <cmath>
#include <string>

#include "strata/training.hpp"

namespace strata {

double LrSchedule::at(std::int64_t step) const {
  const double s = static_cast<double>(step);
  const double warm = static_cast<double>(warmup_steps);
  // DeepSpeed's warmup fraction: linear s/W, or log(s+1)/log(W).
  auto warmup_fraction = [&]() {
    if (log_warmup) return warmup_steps > 1 ? std::log(s + 1.0) / std::log(warm) : 1.0;
    return s / warm;
  };
  switch (kind) {
    case LrScheduleKind::kConstant:
      return lr;
    case LrScheduleKind::kWarmupLR: {
      const double gamma = step < warmup_steps ? warmup_fraction() : 1.0;
      return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma;
    }
    case LrScheduleKind::kWarmupDecay: {
      if (step < warmup_steps) return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * warmup_fraction();
      const double left = static_cast<double>(total_steps - step) /
                          std::max(1.0, static_cast<double>(total_steps - warmup_steps));
      return warmup_max_lr * std::max(0.0, left);
    }
    case LrScheduleKind::kWarmupCosine: {
      if (step < warmup_steps) return lr * (warmup_min_ratio + warmup_fraction() * (1.0 - warmup_min_ratio));
      const double real_step = static_cast<double>(step - warmup_steps + 1);
      const double real_total = static_cast<double>(std::max<std::int64_t>(total_steps - warmup_steps, 1));
      const double cosine =
          (1.0 + std::cos(3.14159265358979323846 * std::min(1.0, real_step / real_total))) / 2.0;
      return lr * std::max(0.0, min_ratio + (1.0 - min_ratio) * cosine);
    }
  }
  return lr;
}

Status LrSchedule::validate() const {
  auto bad = [](const std::string& what) { return invalid_argument("learning-rate schedule: " + what); };
  if (!(lr >= 0.0) || !std::isfinite(lr))
    return bad("lr = " + std::to_string(lr) + " must be a non-negative number");
  if (warmup_steps < 0)
    return bad("warmup steps = " + std::to_string(warmup_steps) + " must not be negative");
  if ((kind == LrScheduleKind::kWarmupCosine || kind == LrScheduleKind::kWarmupDecay) && total_steps < 1) {
    return bad("total steps = " + std::to_string(total_steps) + " must be at least 1");
  }
  if (!(min_ratio >= 0.0 && min_ratio <= 1.0))
    return bad("cos_min_ratio = " + std::to_string(min_ratio) + " is not in [0, 1]");
  if (!(warmup_min_ratio >= 0.0 && warmup_min_ratio <= 1.0)) {
    return bad("warmup_min_ratio = " + std::to_string(warmup_min_ratio) + " is not in [0, 1]");
  }
  if (!(warmup_min_lr >= 0.0) || !(warmup_max_lr >= 0.0))
    return bad("warmup_min_lr and warmup_max_lr must be non-negative");
  return ok_status();
}

}  // namespace strata
