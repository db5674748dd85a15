// The plain double-precision reference for the optimizer tests: the textbook formulas
// (torch.optim's), state kept in double, gradients taken exactly from their stored dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "strata/optim.hpp"

namespace strata::testing {

// Exact decodings, written independently of src/optim (from the format definitions).
inline double ref_bf16_to_double(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline double ref_f16_to_double(std::uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exponent == 0x1f) return mant ? std::nan("") : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(mant, -24);
  return sign * std::ldexp(1024 + mant, exponent - 25);
}

struct RefState {
  std::vector<double> p, m, v;
};

// One update of element-wise state with gradient g (already decoded), in double.
inline void ref_update(const OptimizerHyper& h, std::int64_t step, double grad_scale, double g_in, double& p,
                       double& m, double& v) {
  double g = g_in * grad_scale;
  const double t = static_cast<double>(step);
  switch (h.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      if (h.kind == OptimizerKind::kAdam) g += h.weight_decay * p;
      m = h.beta1 * m + (1 - h.beta1) * g;
      v = h.beta2 * v + (1 - h.beta2) * g * g;
      const double bc1 = h.bias_correction ? 1 - std::pow(h.beta1, t) : 1.0;
      const double bc2 = h.bias_correction ? 1 - std::pow(h.beta2, t) : 1.0;
      if (h.kind == OptimizerKind::kAdamW) p *= 1 - h.lr * h.weight_decay;
      p -= h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
      break;
    }
    case OptimizerKind::kLion: {
      const double c = h.beta1 * m + (1 - h.beta1) * g;
      p *= 1 - h.lr * h.weight_decay;
      p -= h.lr * (c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0));
      m = h.beta2 * m + (1 - h.beta2) * g;
      break;
    }
    case OptimizerKind::kAdagrad: {
      g += h.weight_decay * p;
      v += g * g;
      const double clr = h.lr / (1 + (t - 1) * h.lr_decay);
      p -= clr * g / (std::sqrt(v) + h.eps);
      break;
    }
  }
}

}  // namespace strata::testing
