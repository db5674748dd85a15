// Causal attention (cpu, blocked with online softmax): forward (out, lse) and backward (dq, dk,
// dv) against a float64 full-softmax reference, with sequence lengths that cross the query and
// key tiles, head dims 16/32/64 (and an odd one), grouped-query heads, q/k/v as slices of one
// packed projection, finite differences, bf16 against fp32 and thread-count independence.
// Tolerances: fp32 within 5·ref::kF32Tol (exp and long dot products); bf16 within
// ref::kBF16Tol for out and 2·ref::kBF16Tol for the gradients (they reuse the rounded output).
#include <cmath>

#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

struct AttnCase {
  int B, T, H, Hkv, D;
  bool packed;  // q, k, v slices of one (B, T, (H + 2Hkv)·D) buffer; else padded separate rows
};

std::string name_of(const AttnCase& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" + std::to_string(c.H) + "_Hkv" +
         std::to_string(c.Hkv) + "_D" + std::to_string(c.D) + (c.packed ? "_packed" : "");
}

// The layout of one case: where q, k and v start in the input buffer and their row strides.
struct Layout {
  int qs, ks, vs;
  std::size_t q_off, k_off, v_off, total;
};

Layout layout_of(const AttnCase& c) {
  Layout l{};
  if (c.packed) {
    l.qs = l.ks = l.vs = (c.H + 2 * c.Hkv) * c.D;
    l.q_off = 0;
    l.k_off = static_cast<std::size_t>(c.H) * c.D;
    l.v_off = static_cast<std::size_t>(c.H + c.Hkv) * c.D;
    l.total = static_cast<std::size_t>(c.B) * c.T * l.qs;
  } else {  // three buffers back to back, each row padded by 3 elements
    l.qs = c.H * c.D + 3;
    l.ks = l.vs = c.Hkv * c.D + 3;
    const std::size_t rows = static_cast<std::size_t>(c.B) * c.T;
    l.q_off = 0;
    l.k_off = rows * l.qs;
    l.v_off = l.k_off + rows * l.ks;
    l.total = l.v_off + rows * l.vs;
  }
  return l;
}

// The (B,T,heads,D) elements of a strided slice, densely.
Vec gather(const Vec& buf, std::size_t off, int stride, const AttnCase& c, int heads) {
  Vec out;
  for (int bt = 0; bt < c.B * c.T; ++bt)
    for (int e = 0; e < heads * c.D; ++e) out.push_back(buf[off + static_cast<std::size_t>(bt) * stride + e]);
  return out;
}

struct AttnRun {
  Vec out, lse, dq, dk, dv;  // dense
};

AttnRun run_attention(ref::CpuContext& cpu, DType dt, const AttnCase& c, const Vec& qkv, const Vec& dout) {
  const Layout l = layout_of(c);
  const std::size_t esz = dtype_size(dt);
  TestTensor in = TestTensor::from(dt, qkv), grad(dt, l.total), out(dt, dout.size()),
             tdout = TestTensor::from(dt, dout);
  std::vector<float> lse(static_cast<std::size_t>(c.B) * c.H * c.T);
  AttentionShape s;
  s.batch = c.B;
  s.seq_len = c.T;
  s.n_head = c.H;
  s.n_kv_head = c.Hkv;
  s.head_dim = c.D;
  s.q_row_stride = l.qs;
  s.k_row_stride = l.ks;
  s.v_row_stride = l.vs;
  auto* base = static_cast<unsigned char*>(in.data());
  auto* gbase = static_cast<unsigned char*>(grad.data());
  const ConstTensorArg q{base + l.q_off * esz, dt}, k{base + l.k_off * esz, dt}, v{base + l.v_off * esz, dt};
  const TensorArg dq{gbase + l.q_off * esz, dt}, dk{gbase + l.k_off * esz, dt}, dv{gbase + l.v_off * esz, dt};
  EXPECT_TRUE(attention_forward(cpu.ctx, out.arg(), lse.data(), q, k, v, s).ok());
  EXPECT_TRUE(attention_backward(cpu.ctx, dq, dk, dv, tdout.carg(), q, k, v, out.carg(), lse.data(), s).ok());
  const Vec g = grad.values();
  return {out.values(), Vec(lse.begin(), lse.end()), gather(g, l.q_off, l.qs, c, c.H),
          gather(g, l.k_off, l.ks, c, c.Hkv), gather(g, l.v_off, l.vs, c, c.Hkv)};
}

struct AttnRef {
  Vec out, lse, dq, dk, dv;
};

AttnRef reference(const AttnCase& c, const Vec& qkv, const Vec& dout) {
  const Layout l = layout_of(c);
  const Vec q(qkv.begin() + l.q_off, qkv.end()), k(qkv.begin() + l.k_off, qkv.end()),
      v(qkv.begin() + l.v_off, qkv.end());
  const ref::AttnRefShape s{
      c.B, c.T, c.H, c.Hkv, c.D, l.qs, l.ks, l.vs, 1.0 / std::sqrt(static_cast<double>(c.D))};
  const ref::AttnForward f = ref::attention_forward(q, k, v, s);
  const ref::AttnBackward g = ref::attention_backward(dout, q, k, v, s);
  return {f.out, f.lse, gather(g.dq, 0, l.qs, c, c.H), gather(g.dk, 0, l.ks, c, c.Hkv),
          gather(g.dv, 0, l.vs, c, c.Hkv)};
}

class AttentionTest : public ::testing::TestWithParam<std::tuple<AttnCase, DType>> {};

TEST_P(AttentionTest, ForwardAndBackwardMatchReference) {
  const auto [c, dt] = GetParam();
  ref::CpuContext cpu;
  const Layout l = layout_of(c);
  const Vec qkv = ref::as_stored(dt, ref::random_vec(l.total, 7, 1.0));
  const Vec dout = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(c.B) * c.T * c.H * c.D, 8));
  const AttnRun got = run_attention(cpu, dt, c, qkv, dout);
  const AttnRef want = reference(c, qkv, dout);
  const ref::Tolerance base = ref::tolerance_for(dt);
  const ref::Tolerance out_tol = dt == DType::kF32 ? ref::Tolerance{5 * base.atol, 5 * base.rtol} : base;
  const ref::Tolerance grad_tol = dt == DType::kF32 ? out_tol : ref::Tolerance{2 * base.atol, 2 * base.rtol};
  const std::string what = name_of(c) + "_" + std::string(to_string(dt));
  ref::expect_close(got.out, want.out, out_tol, what + " out");
  ref::expect_close(got.lse, want.lse, {5 * ref::kF32Tol.atol, 5 * ref::kF32Tol.rtol}, what + " lse");
  ref::expect_close(got.dq, want.dq, grad_tol, what + " dq");
  ref::expect_close(got.dk, want.dk, grad_tol, what + " dk");
  ref::expect_close(got.dv, want.dv, grad_tol, what + " dv");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Combine(::testing::Values(AttnCase{1, 1, 1, 1, 16, false}, AttnCase{2, 17, 2, 2, 16, true},
                                         AttnCase{1, 70, 4, 2, 32, false}, AttnCase{2, 33, 2, 1, 64, true},
                                         AttnCase{1, 130, 2, 2, 64, true}, AttnCase{1, 45, 3, 3, 24, false}),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16)),
    [](const auto& info) {
      return name_of(std::get<0>(info.param)) + "_" + std::string(to_string(std::get<1>(info.param)));
    });

TEST(Attention, BackwardMatchesFiniteDifferences) {
  ref::CpuContext cpu;
  const AttnCase c{1, 6, 2, 1, 4, true};
  const Layout l = layout_of(c);
  const Vec qkv = ref::as_stored(DType::kF32, ref::random_vec(l.total, 3));
  const Vec r = ref::random_vec(static_cast<std::size_t>(c.B) * c.T * c.H * c.D, 4);
  auto loss = [&](const Vec& x) { return ref::dot(run_attention(cpu, DType::kF32, c, x, r).out, r); };
  // The gradient of the packed buffer: scatter dq, dk, dv back into the packed layout.
  const AttnRun got = run_attention(cpu, DType::kF32, c, qkv, r);
  Vec grad(l.total, 0.0);
  auto scatter = [&](const Vec& dense, std::size_t off, int heads) {
    std::size_t i = 0;
    for (int bt = 0; bt < c.B * c.T; ++bt)
      for (int e = 0; e < heads * c.D; ++e) grad[off + static_cast<std::size_t>(bt) * l.qs + e] = dense[i++];
  };
  scatter(got.dq, l.q_off, c.H);
  scatter(got.dk, l.k_off, c.Hkv);
  scatter(got.dv, l.v_off, c.Hkv);
  ref::expect_fd_match(loss, qkv, grad, "attention", 4, 1e-2, 3e-3);
}

TEST(Attention, Bf16AgreesWithFp32OnTheSameInputs) {
  ref::CpuContext cpu;
  const AttnCase c{1, 100, 2, 2, 64, true};
  const Layout l = layout_of(c);
  const Vec qkv = ref::as_stored(DType::kBF16, ref::random_vec(l.total, 5));
  const Vec dout =
      ref::as_stored(DType::kBF16, ref::random_vec(static_cast<std::size_t>(c.T) * c.H * c.D, 6));
  const AttnRun a = run_attention(cpu, DType::kF32, c, qkv, dout);
  const AttnRun b = run_attention(cpu, DType::kBF16, c, qkv, dout);
  ref::expect_close(b.out, a.out, ref::kBF16Tol, "out");
  ref::expect_close(b.dq, a.dq, {2 * ref::kBF16Tol.atol, 2 * ref::kBF16Tol.rtol}, "dq");
  ref::expect_close(b.dk, a.dk, {2 * ref::kBF16Tol.atol, 2 * ref::kBF16Tol.rtol}, "dk");
  ref::expect_close(b.dv, a.dv, {2 * ref::kBF16Tol.atol, 2 * ref::kBF16Tol.rtol}, "dv");
}

TEST(Attention, F16AgreesWithFp32OnTheSameInputs) {
  ref::CpuContext cpu;
  const AttnCase c{1, 100, 2, 2, 64, true};
  const Layout l = layout_of(c);
  const Vec qkv = ref::as_stored(DType::kF16, ref::random_vec(l.total, 5));
  const Vec dout = ref::as_stored(DType::kF16, ref::random_vec(static_cast<std::size_t>(c.T) * c.H * c.D, 6));
  const AttnRun a = run_attention(cpu, DType::kF32, c, qkv, dout);
  const AttnRun b = run_attention(cpu, DType::kF16, c, qkv, dout);
  ref::expect_close(b.out, a.out, ref::kF16Tol, "out");
  ref::expect_close(b.dq, a.dq, {2 * ref::kF16Tol.atol, 2 * ref::kF16Tol.rtol}, "dq");
  ref::expect_close(b.dk, a.dk, {2 * ref::kF16Tol.atol, 2 * ref::kF16Tol.rtol}, "dk");
  ref::expect_close(b.dv, a.dv, {2 * ref::kF16Tol.atol, 2 * ref::kF16Tol.rtol}, "dv");
}

TEST(Attention, ResultsDoNotDependOnTheThreadCount) {
  ref::CpuContext one(1), three(3);
  const AttnCase c{2, 97, 4, 2, 32, true};
  const Layout l = layout_of(c);
  const Vec qkv = ref::random_vec(l.total, 5);
  const Vec dout = ref::random_vec(static_cast<std::size_t>(c.B) * c.T * c.H * c.D, 6);
  const AttnRun a = run_attention(one, DType::kF32, c, qkv, dout);
  const AttnRun b = run_attention(three, DType::kF32, c, qkv, dout);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
}

TEST(Attention, BadShapesAreNamed) {
  ref::CpuContext cpu;
  float x = 0, lse = 0;
  AttentionShape s{1, 1, 3, 2, 4};
  STRATA_EXPECT_ERROR(attention_forward(cpu.ctx, f32(&x), &lse, f32(&x), f32(&x), f32(&x), s),
                      kInvalidArgument, "n_head = 3 is not a multiple of n_kv_head = 2");
  s = AttentionShape{1, 1, 2, 2, 4, 7};
  STRATA_EXPECT_ERROR(attention_forward(cpu.ctx, f32(&x), &lse, f32(&x), f32(&x), f32(&x), s),
                      kInvalidArgument, "q_row_stride = 7 is less than n_head*head_dim = 8");
  s = AttentionShape{1, 1, 2, 2, 0};
  STRATA_EXPECT_ERROR(attention_forward(cpu.ctx, f32(&x), &lse, f32(&x), f32(&x), f32(&x), s),
                      kInvalidArgument, "head_dim = 0");
  s = AttentionShape{1, 1, 1, 1, 4};
  STRATA_EXPECT_ERROR(attention_forward(cpu.ctx, f32(&x), nullptr, f32(&x), f32(&x), f32(&x), s),
                      kInvalidArgument, "'lse' is null");
  std::uint16_t h = 0;
  STRATA_EXPECT_ERROR(attention_forward(cpu.ctx, f32(&x), &lse, f32(&x), bf16(&h), f32(&x), s),
                      kInvalidArgument, "'q' is f32 but 'k' is bf16");
  STRATA_EXPECT_ERROR(attention_backward(cpu.ctx, f32(&x), f32(&x), bf16(&h), f32(&x), f32(&x), f32(&x),
                                         f32(&x), f32(&x), &lse, s),
                      kInvalidArgument, "'q' is f32 but 'dv' is bf16");
}

}  // namespace
}  // namespace strata::kernels
