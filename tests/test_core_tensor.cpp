// Tensor views: construction checks, sizes, contiguity, slicing along dim 0, printing.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "harness/harness.hpp"
#include "strata/tensor.hpp"

namespace strata {
namespace {

constexpr std::int64_t kBig = std::numeric_limits<std::int64_t>::max();

TEST(TensorView, DefaultIsAnEmptyHostView) {
  TensorView v;
  EXPECT_EQ(v.rank(), 1);
  EXPECT_EQ(v.numel(), 0);
  EXPECT_EQ(v.nbytes(), 0u);
  EXPECT_EQ(v.storage_bytes(), 0u);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.to_string(), "f32[0] host");
}

TEST(TensorView, RowMajorDefaultsAndSizes) {
  alignas(64) static std::uint16_t buf[4 * 1024];
  auto v = make_view("w", DType::kBF16, {4, 1024}, Location::host(buf, MemoryOrigin::kPinnedPool));
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(v->rank(), 2);
  EXPECT_EQ(v->dim(0), 4);
  EXPECT_EQ(v->dim(1), 1024);
  EXPECT_EQ(v->stride(0), 1024);
  EXPECT_EQ(v->stride(1), 1);
  EXPECT_EQ(v->numel(), 4096);
  EXPECT_EQ(v->nbytes(), 8192u);
  EXPECT_EQ(v->storage_bytes(), 8192u);
  EXPECT_TRUE(v->is_contiguous());
  EXPECT_EQ(v->data(), buf);
  EXPECT_EQ(v->tier(), Tier::kHost);
  EXPECT_EQ(v->origin(), MemoryOrigin::kPinnedPool);
  EXPECT_EQ(v->to_string(), "bf16[4, 1024] host");

  auto scalar = make_view("loss_scale", DType::kF32, {}, Location::host(buf));
  ASSERT_TRUE(scalar.ok()) << scalar.status().to_string();
  EXPECT_EQ(scalar->rank(), 0);
  EXPECT_EQ(scalar->numel(), 1);
  EXPECT_EQ(scalar->nbytes(), 4u);
  EXPECT_EQ(scalar->to_string(), "f32[] host");

  const std::vector<std::int64_t> shape = {2, 3, 4, 5, 1, 1, 2, 1};  // rank 8 from a vector
  auto r8 = make_view("r8", DType::kF16, shape, Location::host(buf));
  ASSERT_TRUE(r8.ok()) << r8.status().to_string();
  EXPECT_EQ(r8->numel(), 240);
  EXPECT_EQ(r8->stride(0), 120);
  EXPECT_EQ(r8->stride(7), 1);
  auto copy = make_view("copy", DType::kF16, r8->shape(), Location::host(buf), r8->strides());
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ(copy->to_string(), r8->to_string());
}

TEST(TensorView, ContiguityIgnoresUnitExtentsAndEmptyViews) {
  alignas(64) static float buf[256];
  const Location host = Location::host(buf);
  auto strided = make_view("s", DType::kF32, {4, 8}, host, {16, 1});
  ASSERT_TRUE(strided.ok()) << strided.status().to_string();
  EXPECT_FALSE(strided->is_contiguous());
  EXPECT_EQ(strided->nbytes(), 128u);
  EXPECT_EQ(strided->storage_bytes(), (3 * 16 + 7 + 1) * 4u);
  EXPECT_EQ(strided->to_string(), "f32[4, 8] strides [16, 1] host");

  auto transposed = make_view("t", DType::kF32, {8, 4}, host, {1, 8});
  ASSERT_TRUE(transposed.ok());
  EXPECT_FALSE(transposed->is_contiguous());
  EXPECT_EQ(transposed->storage_bytes(), 128u);

  // The stride of an extent-1 dimension never matters.
  auto unit = make_view("u", DType::kF32, {1, 8}, host, {999, 1});
  ASSERT_TRUE(unit.ok());
  EXPECT_TRUE(unit->is_contiguous());
  EXPECT_EQ(unit->storage_bytes(), 32u);

  auto broadcast = make_view("b", DType::kF32, {3, 4}, host, {0, 1});
  ASSERT_TRUE(broadcast.ok());
  EXPECT_FALSE(broadcast->is_contiguous());
  EXPECT_EQ(broadcast->nbytes(), 48u);
  EXPECT_EQ(broadcast->storage_bytes(), 16u);

  auto empty = make_view("e", DType::kF32, {0, 5}, Location::host(nullptr), {7, 3});
  ASSERT_TRUE(empty.ok()) << "an empty view needs no memory: " << empty.status().to_string();
  EXPECT_TRUE(empty->is_contiguous());
  EXPECT_EQ(empty->numel(), 0);
  EXPECT_EQ(empty->storage_bytes(), 0u);
  // A zero extent makes the element count 0 even when the others multiply past int64.
  auto huge_empty =
      make_view("he", DType::kF32, {1ll << 40, 0, 1ll << 40}, Location::host(nullptr), {1, 1, 1});
  ASSERT_TRUE(huge_empty.ok()) << huge_empty.status().to_string();
  EXPECT_EQ(huge_empty->numel(), 0);
}

TEST(TensorView, ShapeAndStrideErrorsNameTheTensor) {
  alignas(64) static float buf[64];
  const Location host = Location::host(buf);
  STRATA_EXPECT_ERROR(make_view("layers.3.attn.qkv", DType::kF32, {1, 1, 1, 1, 1, 1, 1, 1, 1}, host),
                      kInvalidArgument, "tensor 'layers.3.attn.qkv': rank 9 exceeds the maximum rank 8");
  STRATA_EXPECT_ERROR(make_view("w", DType::kF32, {4, -2}, host), kInvalidArgument,
                      "tensor 'w': dimension 1 of shape [4, -2] is negative");
  STRATA_EXPECT_ERROR(make_view("w", DType::kF32, {4, 2}, host, {2}), kInvalidArgument,
                      "1 strides given for the rank-2 shape [4, 2]");
  STRATA_EXPECT_ERROR(make_view("w", DType::kF32, {4, 2}, host, {2, -1}), kInvalidArgument,
                      "stride 1 of [2, -1] is negative");
  STRATA_EXPECT_ERROR(make_view("w", static_cast<DType>(42), {4}, host), kInvalidArgument,
                      "dtype value 42 is not a known dtype");
  STRATA_EXPECT_ERROR(make_view("big", DType::kF32, {1ll << 32, 1ll << 32}, host), kInvalidArgument,
                      "tensor 'big': shape [4294967296, 4294967296] has more elements than int64 can count");
  STRATA_EXPECT_ERROR(make_view("big", DType::kF32, {1ll << 62}, host), kInvalidArgument, "bytes than int64");
  STRATA_EXPECT_ERROR(make_view("far", DType::kF32, {2, 2}, host, {kBig / 2, 1}), kInvalidArgument,
                      "tensor 'far': shape [2, 2] with strides");
  STRATA_EXPECT_ERROR(
      make_view("zeros", DType::kF32, {1ll << 40, 1ll << 40, 0, 1ll << 40}, Location::host(nullptr)),
      kInvalidArgument, "too large for row-major strides");
  // Broadcast strides: few bytes spanned, but the element count still has to fit.
  STRATA_EXPECT_ERROR(make_view("bc", DType::kF32, {1ll << 61, 2}, host, {0, 0}), kInvalidArgument,
                      "holds more bytes than int64 can count");
}

TEST(TensorView, LocationRules) {
  alignas(64) static std::uint16_t buf[64];
  auto dev = make_view("p", DType::kBF16, {8}, Location::device(buf));
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  EXPECT_EQ(dev->tier(), Tier::kDevice);
  EXPECT_EQ(dev->origin(), MemoryOrigin::kDeviceArena);
  EXPECT_EQ(dev->to_string(), "bf16[8] device");

  STRATA_EXPECT_ERROR(make_view("p", DType::kBF16, {8}, Location::device(buf, MemoryOrigin::kPinnedPool)),
                      kInvalidArgument,
                      "tensor 'p': a device location must come from a device arena, not pinned-pool");
  STRATA_EXPECT_ERROR(make_view("p", DType::kBF16, {8}, Location::host(buf, MemoryOrigin::kDeviceArena)),
                      kInvalidArgument, "a host location cannot come from a device arena");
  STRATA_EXPECT_ERROR(make_view("p", DType::kBF16, {8}, Location::host(nullptr)), kInvalidArgument,
                      "tensor 'p': host pointer is null for 16 bytes");
  STRATA_EXPECT_ERROR(make_view("p", DType::kBF16, {8}, Location::device(nullptr)), kInvalidArgument,
                      "device pointer is null");
  auto* odd = reinterpret_cast<unsigned char*>(buf) + 1;
  STRATA_EXPECT_ERROR(make_view("p", DType::kBF16, {8}, Location::host(odd)), kInvalidArgument,
                      "is not aligned to 2 bytes (bf16)");
  STRATA_EXPECT_ERROR(make_view("p", DType::kF32, {8}, Location::host(buf + 1)), kInvalidArgument,
                      "is not aligned to 4 bytes (f32)");
  auto* top = reinterpret_cast<void*>(std::numeric_limits<std::uintptr_t>::max() - 63);
  STRATA_EXPECT_ERROR(make_view("p", DType::kF32, {32}, Location::host(top)), kInvalidArgument,
                      "wrap the address space");
  Location bad_tier = Location::host(buf);
  bad_tier.tier = static_cast<Tier>(7);
  STRATA_EXPECT_ERROR(make_view("p", DType::kBF16, {8}, bad_tier), kInvalidArgument, "tier value 7");

  auto nv = make_view("adam.m.7", DType::kF32, {1000}, Location::nvme(3, 1 << 20));
  ASSERT_TRUE(nv.ok()) << nv.status().to_string();
  EXPECT_EQ(nv->data(), nullptr);
  EXPECT_EQ(nv->location().extent, (NvmeExtent{3, 1 << 20}));
  EXPECT_EQ(nv->to_string(), "f32[1000] nvme");
  EXPECT_EQ(to_string(nv->location()), "nvme file 3 offset 1048576");

  Location with_ptr = Location::nvme(0, 0);
  with_ptr.ptr = buf;
  STRATA_EXPECT_ERROR(make_view("m", DType::kF32, {4}, with_ptr), kInvalidArgument,
                      "an nvme location has no pointer");
  Location with_origin = Location::nvme(0, 0);
  with_origin.origin = MemoryOrigin::kIoBuffer;
  STRATA_EXPECT_ERROR(make_view("m", DType::kF32, {4}, with_origin), kInvalidArgument,
                      "no memory origin, but io-buffer");
  STRATA_EXPECT_ERROR(
      make_view("m", DType::kF32, {4}, Location::nvme(2, static_cast<std::uint64_t>(kBig) - 8)),
      kInvalidArgument, "nvme extent of 16 bytes at offset 9223372036854775799 of file 2");

  const std::string host_text = to_string(Location::host(buf, MemoryOrigin::kIoBuffer));
  EXPECT_EQ(host_text.rfind("host (io-buffer) 0x", 0), 0u) << host_text;
  EXPECT_EQ(to_string(Tier::kDevice), "device");
}

TEST(TensorView, SliceAlongDimZeroSharesStorage) {
  alignas(64) static float buf[6 * 10];
  auto v = make_view("act", DType::kF32, {6, 4}, Location::host(buf), {10, 1});
  ASSERT_TRUE(v.ok());
  auto s = v->slice(2, 5);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->dim(0), 3);
  EXPECT_EQ(s->dim(1), 4);
  EXPECT_EQ(s->stride(0), 10);
  EXPECT_EQ(s->numel(), 12);
  EXPECT_EQ(s->data(), buf + 20);
  EXPECT_EQ(s->storage_bytes(), (2 * 10 + 3 + 1) * 4u);
  EXPECT_EQ(s->origin(), v->origin());

  auto all = v->slice(0, 6);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->data(), buf);
  EXPECT_EQ(all->numel(), v->numel());

  auto empty = v->slice(6, 6);
  ASSERT_TRUE(empty.ok()) << empty.status().to_string();
  EXPECT_EQ(empty->numel(), 0);
  EXPECT_EQ(empty->to_string(), "f32[0, 4] host");

  auto one = v->slice(5, 6);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->data(), buf + 50);
  // A contiguous view sliced along dim 0 stays contiguous.
  auto c = make_view("c", DType::kF32, {6, 10}, Location::host(buf));
  EXPECT_TRUE(c->slice(1, 4)->is_contiguous());

  STRATA_EXPECT_ERROR(v->slice(4, 7, "act"), kInvalidArgument,
                      "tensor 'act': rows [4, 7) are not within [0, 6) of f32[6, 4] strides [10, 1] host");
  STRATA_EXPECT_ERROR(v->slice(-1, 2), kInvalidArgument, "rows [-1, 2)");
  STRATA_EXPECT_ERROR(v->slice(3, 2), kInvalidArgument, "rows [3, 2)");
  auto scalar = make_view("x", DType::kF32, {}, Location::host(buf));
  STRATA_EXPECT_ERROR(scalar->slice(0, 0, "x"), kInvalidArgument, "tensor 'x': cannot slice f32[] host");
}

TEST(TensorView, SliceOfNvmeAndDeviceViewsMovesTheirLocation) {
  auto nv = make_view("v", DType::kBF16, {16, 512}, Location::nvme(1, 4096));
  ASSERT_TRUE(nv.ok());
  auto s = nv->slice(4, 8);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->location().extent, (NvmeExtent{1, 4096 + 4 * 512 * 2}));
  EXPECT_EQ(s->nbytes(), 4u * 512 * 2);
  EXPECT_EQ(s->tier(), Tier::kNvme);

  alignas(64) static std::uint16_t dev_buf[16 * 8];
  auto d = make_view("g", DType::kF16, {16, 8}, Location::device(dev_buf));
  ASSERT_TRUE(d.ok());
  auto ds = d->slice(15, 16);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(ds->data(), dev_buf + 15 * 8);
  EXPECT_EQ(ds->origin(), MemoryOrigin::kDeviceArena);

  // An empty slice at the end of a hugely strided view would start past any addressable byte.
  auto far = make_view("far", DType::kF32, {1, 4}, Location::nvme(0, 0), {kBig / 2, 1});
  ASSERT_TRUE(far.ok()) << far.status().to_string();
  STRATA_EXPECT_ERROR(far->slice(1, 1, "far"), kInvalidArgument, "tensor 'far': rows [1, 1)");
}

TEST(TensorView, DimsKeepsTheGivenLengthBeyondTheMaximum) {
  Dims d = {1, 2, 3};
  EXPECT_EQ(d.size, 3u);
  EXPECT_EQ(d.values[2], 3);
  const std::array<std::int64_t, 10> ten{};
  Dims long_dims = ten;
  EXPECT_EQ(long_dims.size, 10u);
  Dims none;
  EXPECT_EQ(none.size, 0u);
}

}  // namespace
}  // namespace strata
