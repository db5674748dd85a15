// Plain-loop float64 references for the kernels in kernels/, and the helpers the kernel tests
// share: typed test tensors (fp32, bf16 or fp16 storage filled from doubles), closeness checks with a
// stated tolerance, and directional finite differences.
//
// Tolerance model: a kernel value `got` matches the reference `want` when
//   |got - want| <= atol·scale + rtol·|want|,
// where scale is the RMS of the reference tensor, or 1 if it is all zero (so atol is relative to
// the tensor's size and cancellation near zero does not fail a correct kernel). The reference runs on exactly the
// values the kernel saw (bf16 inputs are rounded before both run).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.hpp"
#include "kernels/kernels.hpp"

namespace strata::kernels::ref {

using Vec = std::vector<double>;

struct Tolerance {
  double atol;  // relative to the RMS of the reference
  double rtol;
};

// fp32 kernels against float64: fp32 rounding of sums over up to a few thousand terms.
inline constexpr Tolerance kF32Tol{2e-5, 2e-5};
// bf16 storage (8 significant bits): one rounding of the output plus rounded intermediates.
inline constexpr Tolerance kBF16Tol{1.5e-2, 1.5e-2};
// fp16 storage (11 significant bits, 8x finer than bf16): a quarter of bf16's tolerance, since
// rounded intermediates (attention's rounded output in its backward) cost more than one rounding.
inline constexpr Tolerance kF16Tol{4e-3, 4e-3};
inline Tolerance tolerance_for(DType dt) {
  return dt == DType::kF32 ? kF32Tol : (dt == DType::kF16 ? kF16Tol : kBF16Tol);
}

// A host tensor with fp32, bf16 or fp16 storage.
class TestTensor {
 public:
  TestTensor() = default;
  TestTensor(DType dtype, std::size_t n) : dtype_(dtype), n_(n), bytes_(n * dtype_size(dtype) + 64, 0) {}
  static TestTensor from(DType dtype, const Vec& values) {
    TestTensor t(dtype, values.size());
    t.set(values);
    return t;
  }
  void set(const Vec& values) {
    for (std::size_t i = 0; i < n_ && i < values.size(); ++i) set(i, values[i]);
  }
  void set(std::size_t i, double v) {
    if (dtype_ == DType::kF32) {
      reinterpret_cast<float*>(bytes_.data())[i] = static_cast<float>(v);
    } else if (dtype_ == DType::kF16) {
      reinterpret_cast<std::uint16_t*>(bytes_.data())[i] = f32_to_f16_bits_rne(static_cast<float>(v));
    } else {
      reinterpret_cast<std::uint16_t*>(bytes_.data())[i] = f32_to_bf16_bits_rne(static_cast<float>(v));
    }
  }
  double get(std::size_t i) const {
    if (dtype_ == DType::kF32) return reinterpret_cast<const float*>(bytes_.data())[i];
    if (dtype_ == DType::kF16) return f16_bits_to_f32(reinterpret_cast<const std::uint16_t*>(bytes_.data())[i]);
    return bf16_bits_to_f32(reinterpret_cast<const std::uint16_t*>(bytes_.data())[i]);
  }
  Vec values() const {
    Vec v(n_);
    for (std::size_t i = 0; i < n_; ++i) v[i] = get(i);
    return v;
  }
  void fill(double v) {
    for (std::size_t i = 0; i < n_; ++i) set(i, v);
  }
  TensorArg arg() { return {bytes_.data(), dtype_}; }
  ConstTensorArg carg() const { return {bytes_.data(), dtype_}; }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }

 private:
  DType dtype_ = DType::kF32;
  std::size_t n_ = 0;
  std::vector<unsigned char> bytes_;
};

inline Vec random_vec(std::size_t n, std::uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  Vec v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Rounds every value the way storing it as `dtype` would.
inline Vec as_stored(DType dtype, const Vec& v) {
  if (dtype == DType::kF32) {
    Vec out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
    return out;
  }
  Vec out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    out[i] = dtype == DType::kF16 ? round_to_f16(static_cast<float>(v[i])) : round_to_bf16(static_cast<float>(v[i]));
  return out;
}

inline double rms(const Vec& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Expects got ≈ want elementwise under `tol`; reports the worst element.
inline void expect_close(const Vec& got, const Vec& want, Tolerance tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  // An all-zero reference has no scale of its own: atol is then absolute.
  const double scale = rms(want) > 0 ? rms(want) : 1.0;
  std::size_t worst = 0;
  double worst_excess = -1e300;
  std::size_t failures = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]);
    const double allowed = tol.atol * scale + tol.rtol * std::abs(want[i]);
    const double excess = std::isnan(got[i]) ? 1e300 : err - allowed;
    if (excess > 0) ++failures;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  EXPECT_EQ(failures, 0u) << what << ": " << failures << " of " << got.size() << " elements off; worst at "
                          << worst << ": got " << got[worst] << ", want " << want[worst] << " (rms " << scale
                          << ")";
}

// Σ a_i·b_i in double.
inline double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Directional finite-difference check of a backward kernel. `loss(x)` runs the forward kernel
// (fp32) and returns Σ out·R for a fixed R; `grad` is what the backward kernel gave for dL/dx
// with dout = R. For `dirs` random directions u, the central difference
// (L(x + εu) - L(x - εu)) / 2ε must match grad·u within `rtol` of |grad|·|u| (the scale of the
// directional derivative). With fp32 forward and ε ≈ 1e-2 the truncation (O(ε²)) and rounding
// (O(1e-7·|L|/ε)) errors stay well under 1e-3 relative.
inline void expect_fd_match(const std::function<double(const Vec&)>& loss, const Vec& x, const Vec& grad,
                            const std::string& what, int dirs = 3, double eps = 1e-2, double rtol = 2e-3,
                            std::uint32_t seed = 99) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  const double gnorm = std::sqrt(dot(grad, grad));
  for (int d = 0; d < dirs; ++d) {
    Vec u = random_vec(x.size(), seed + static_cast<std::uint32_t>(d));
    const double unorm = std::sqrt(dot(u, u));
    for (auto& e : u) e /= unorm;
    Vec xp = x, xm = x;
    for (std::size_t i = 0; i < x.size(); ++i) {
      xp[i] += eps * u[i];
      xm[i] -= eps * u[i];
    }
    const double fd = (loss(xp) - loss(xm)) / (2 * eps);
    const double an = dot(grad, u);
    EXPECT_NEAR(fd, an, rtol * gnorm + 1e-6) << what << ": direction " << d << " finite difference " << fd
                                             << " vs backward " << an << " (|grad| = " << gnorm << ")";
  }
}

// A cpu kernel context with its own KernelState.
struct CpuContext {
  std::unique_ptr<KernelState> state;
  KernelContext ctx;
  explicit CpuContext(int threads = 2) {
    auto created = KernelState::create(Backend::kCpu);
    EXPECT_TRUE(created.ok()) << created.status().to_string();
    if (created.ok()) state = std::move(created).value();
    ctx.backend = Backend::kCpu;
    ctx.cpu_threads = threads;
    ctx.state = state.get();
  }
};

// ---- references ----

// out (B,T,C) = wte[tok] + wpe[t]
inline Vec embedding_forward(const std::vector<std::int32_t>& tok, const Vec& wte, const Vec* wpe, int B,
                             int T, int C) {
  Vec out(static_cast<std::size_t>(B) * T * C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        out[(b * T + t) * C + c] = wte[tok[b * T + t] * C + c] + (wpe ? (*wpe)[t * C + c] : 0.0);
  return out;
}

inline void embedding_backward(Vec& dwte, Vec* dwpe, const Vec& dout, const std::vector<std::int32_t>& tok,
                               int B, int T, int C) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        dwte[tok[b * T + t] * C + c] += dout[(b * T + t) * C + c];
        if (dwpe) (*dwpe)[t * C + c] += dout[(b * T + t) * C + c];
      }
}

struct NormForward {
  Vec out, mean, rstd;
};

inline NormForward norm_forward(bool rms_norm, const Vec& x, const Vec& w, const Vec* bias, int rows, int C,
                                double eps) {
  NormForward f{Vec(x.size()), Vec(rows), Vec(rows)};
  for (int r = 0; r < rows; ++r) {
    double mu = 0;
    if (!rms_norm) {
      for (int c = 0; c < C; ++c) mu += x[r * C + c];
      mu /= C;
    }
    double var = 0;
    for (int c = 0; c < C; ++c) var += (x[r * C + c] - mu) * (x[r * C + c] - mu);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + eps);
    for (int c = 0; c < C; ++c)
      f.out[r * C + c] = (x[r * C + c] - mu) * rs * w[c] + (bias ? (*bias)[c] : 0.0);
    f.mean[r] = mu;
    f.rstd[r] = rs;
  }
  return f;
}

struct NormBackward {
  Vec dx, dw, db;
};

inline NormBackward norm_backward(bool rms_norm, const Vec& dy, const Vec& x, const Vec& w, int rows, int C,
                                  double eps) {
  const NormForward f = norm_forward(rms_norm, x, w, nullptr, rows, C, eps);
  NormBackward g{Vec(x.size()), Vec(C, 0.0), Vec(C, 0.0)};
  for (int r = 0; r < rows; ++r) {
    double gm = 0, gxm = 0;
    for (int c = 0; c < C; ++c) {
      const double xh = (x[r * C + c] - f.mean[r]) * f.rstd[r];
      const double gg = dy[r * C + c] * w[c];
      gm += gg;
      gxm += gg * xh;
      g.dw[c] += dy[r * C + c] * xh;
      g.db[c] += dy[r * C + c];
    }
    gm = rms_norm ? 0.0 : gm / C;
    gxm /= C;
    for (int c = 0; c < C; ++c) {
      const double xh = (x[r * C + c] - f.mean[r]) * f.rstd[r];
      g.dx[r * C + c] = f.rstd[r] * (dy[r * C + c] * w[c] - gm - xh * gxm);
    }
  }
  return g;
}

// c (M,N) = op(a)·op(b) + bias (+ c0)
inline Vec gemm(const Vec& a, const Vec& b, const Vec* bias, const Vec* c0, int M, int N, int K, bool ta,
                bool tb) {
  Vec c(static_cast<std::size_t>(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = bias ? (*bias)[n] : 0.0;
      if (c0) s += (*c0)[m * N + n];
      for (int k = 0; k < K; ++k)
        s += (ta ? a[k * M + m] : a[m * K + k]) * (tb ? b[n * K + k] : b[k * N + n]);
      c[m * N + n] = s;
    }
  return c;
}

struct AttnRefShape {
  int B, T, H, Hkv, D;
  int qs, ks, vs;  // row strides of q, k, v (elements)
  double scale;
};

struct AttnForward {
  Vec out, lse;
};

inline AttnForward attention_forward(const Vec& q, const Vec& k, const Vec& v, const AttnRefShape& s) {
  AttnForward f{Vec(static_cast<std::size_t>(s.B) * s.T * s.H * s.D, 0.0),
                Vec(static_cast<std::size_t>(s.B) * s.H * s.T)};
  const int group = s.H / s.Hkv;
  std::vector<double> sc(s.T);
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h)
      for (int i = 0; i < s.T; ++i) {
        const int kh = h / group;
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int e = 0; e < s.D; ++e)
            d += q[(b * s.T + i) * s.qs + h * s.D + e] * k[(b * s.T + j) * s.ks + kh * s.D + e];
          sc[j] = d * s.scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        const double lse = mx + std::log(sum);
        f.lse[(b * s.H + h) * s.T + i] = lse;
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(sc[j] - lse);
          for (int e = 0; e < s.D; ++e)
            f.out[((b * s.T + i) * s.H + h) * s.D + e] += p * v[(b * s.T + j) * s.vs + kh * s.D + e];
        }
      }
  return f;
}

struct AttnBackward {
  Vec dq, dk, dv;
};

// dq/dk/dv have the sizes and strides of q/k/v (untouched padding stays 0).
inline AttnBackward attention_backward(const Vec& dout, const Vec& q, const Vec& k, const Vec& v,
                                       const AttnRefShape& s) {
  const AttnForward f = attention_forward(q, k, v, s);
  AttnBackward g{Vec(q.size(), 0.0), Vec(k.size(), 0.0), Vec(v.size(), 0.0)};
  const int group = s.H / s.Hkv;
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h) {
      const int kh = h / group;
      for (int i = 0; i < s.T; ++i) {
        const std::size_t orow = ((b * s.T + i) * s.H + h) * s.D;
        double dvec = 0;
        for (int e = 0; e < s.D; ++e) dvec += dout[orow + e] * f.out[orow + e];
        const double lse = f.lse[(b * s.H + h) * s.T + i];
        for (int j = 0; j <= i; ++j) {
          const std::size_t qrow = (b * s.T + i) * s.qs + h * s.D;
          const std::size_t krow = (b * s.T + j) * s.ks + kh * s.D;
          const std::size_t vrow = (b * s.T + j) * s.vs + kh * s.D;
          double sc = 0, dp = 0;
          for (int e = 0; e < s.D; ++e) {
            sc += q[qrow + e] * k[krow + e];
            dp += dout[orow + e] * v[vrow + e];
          }
          const double p = std::exp(sc * s.scale - lse);
          const double ds = p * (dp - dvec) * s.scale;
          for (int e = 0; e < s.D; ++e) {
            g.dq[qrow + e] += ds * k[krow + e];
            g.dk[krow + e] += ds * q[qrow + e];
            g.dv[vrow + e] += p * dout[orow + e];
          }
        }
      }
    }
  return g;
}

inline double gelu(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}
inline double gelu_grad(double x) {
  const double s = std::sqrt(2.0 / M_PI);
  const double u = s * (x + 0.044715 * x * x * x);
  const double th = std::tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * s * (1.0 + 3.0 * 0.044715 * x * x);
}
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// out (rows,F) = silu(gate)·up from gate_up (rows, 2F)
inline Vec swiglu_forward(const Vec& gu, int rows, int F) {
  Vec out(static_cast<std::size_t>(rows) * F);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < F; ++i) {
      const double g = gu[r * 2 * F + i], u = gu[r * 2 * F + F + i];
      out[r * F + i] = g * sigmoid(g) * u;
    }
  return out;
}
inline Vec swiglu_backward(const Vec& dout, const Vec& gu, int rows, int F) {
  Vec d(gu.size());
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < F; ++i) {
      const double g = gu[r * 2 * F + i], u = gu[r * 2 * F + F + i], sg = sigmoid(g);
      d[r * 2 * F + i] = dout[r * F + i] * u * sg * (1.0 + g * (1.0 - sg));
      d[r * 2 * F + F + i] = dout[r * F + i] * g * sg;
    }
  return d;
}

// x (B,T,H,D) with row stride; rotate pairs (i, i+D/2) by ±t·θ^(-2i/D). Elements outside the
// H·D heads of each row are copied.
inline Vec rope(const Vec& x, int B, int T, int H, int D, int stride, double theta, bool inverse) {
  Vec y = x;
  const int half = D / 2;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < half; ++i) {
          const double a = t * std::pow(theta, -2.0 * i / D) * (inverse ? -1.0 : 1.0);
          const std::size_t o = static_cast<std::size_t>(b * T + t) * stride + h * D;
          const double x1 = x[o + i], x2 = x[o + i + half];
          y[o + i] = x1 * std::cos(a) - x2 * std::sin(a);
          y[o + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
        }
  return y;
}

struct CrossEntropy {
  Vec losses, lse, dlogits;
};

inline CrossEntropy cross_entropy(const Vec& logits, const std::vector<std::int32_t>& targets, double dloss,
                                  int N, int V, int Vp) {
  CrossEntropy ce{Vec(N), Vec(N), Vec(static_cast<std::size_t>(N) * Vp, 0.0)};
  for (int n = 0; n < N; ++n) {
    double mx = -1e300;
    for (int v = 0; v < V; ++v) mx = std::max(mx, logits[n * Vp + v]);
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(logits[n * Vp + v] - mx);
    ce.lse[n] = mx + std::log(sum);
    const int y = targets[n];
    ce.losses[n] = y < 0 ? 0.0 : ce.lse[n] - logits[n * Vp + y];
    if (y >= 0) {
      for (int v = 0; v < V; ++v) ce.dlogits[n * Vp + v] = std::exp(logits[n * Vp + v] - ce.lse[n]) * dloss;
      ce.dlogits[n * Vp + y] -= dloss;
    }
  }
  return ce;
}

}  // namespace strata::kernels::ref
