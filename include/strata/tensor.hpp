// Tensor views: a typed, shaped window onto bytes that live somewhere else.
//
// A TensorView owns nothing. It records the element type, the shape (rank 0..kMaxRank), the
// strides in elements, and where the first element is: in device memory, in host memory, or at
// an extent of an NVMe swap file. Whoever created the underlying buffer (an Arena, a PinnedPool,
// the swap store) owns it and must keep it alive while views of it are used.
//
// Views are only built by make_view() and slice(), which check them, so every view satisfies:
//   - 0 <= rank <= kMaxRank, every extent >= 0, every stride >= 0;
//   - numel() and the storage span (the bytes from the first element to one past the furthest
//     element) fit in int64 / uint64, so offset arithmetic never overflows;
//   - device views come from a device arena; host views from a pinned pool, an I/O buffer or
//     ordinary memory; a device or host view with bytes has a non-null pointer aligned to its
//     element size; an NVMe view has no pointer and its extent does not wrap the file offset.
// Views are plain values: copy them freely; they are safe to read from any thread.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "strata/alloc.hpp"
#include "strata/dtype.hpp"
#include "strata/status.hpp"

namespace strata {

inline constexpr int kMaxRank = 8;

// The three storage tiers of DESIGN.md.
enum class Tier : std::uint8_t { kDevice, kHost, kNvme };
std::string_view to_string(Tier tier);  // "device", "host", "nvme"

// Bytes in an NVMe swap file: which file of the swap store, and where in it.
struct NvmeExtent {
  std::uint32_t file = 0;
  std::uint64_t offset = 0;
  friend bool operator==(const NvmeExtent&, const NvmeExtent&) = default;
};

// Where a view's first element lives.
struct Location {
  Tier tier = Tier::kHost;
  void* ptr = nullptr;                          // device and host tiers
  NvmeExtent extent;                            // nvme tier
  MemoryOrigin origin = MemoryOrigin::kSystem;  // device and host tiers; kSystem for nvme

  static Location device(void* p, MemoryOrigin o = MemoryOrigin::kDeviceArena) {
    return {Tier::kDevice, p, {}, o};
  }
  static Location host(void* p, MemoryOrigin o = MemoryOrigin::kSystem) { return {Tier::kHost, p, {}, o}; }
  static Location nvme(std::uint32_t file, std::uint64_t offset) {
    return {Tier::kNvme, nullptr, {file, offset}, MemoryOrigin::kSystem};
  }
  friend bool operator==(const Location&, const Location&) = default;
};
// "device (device-arena) 0x7f..", "host (pinned-pool) 0x7f..", "nvme file 3 offset 8192".
std::string to_string(const Location& location);

// Up to kMaxRank extents or strides, as a value that never allocates. `size` is the length the
// caller gave, even beyond kMaxRank (only the first kMaxRank values are kept), so make_view can
// report an over-long shape instead of silently truncating it.
struct Dims {
  std::array<std::int64_t, kMaxRank> values{};
  std::size_t size = 0;

  Dims() = default;
  Dims(std::initializer_list<std::int64_t> list)
      : Dims(std::span<const std::int64_t>(list.begin(), list.size())) {}
  Dims(std::span<const std::int64_t> list) : size(list.size()) {  // NOLINT: implicit from a span
    for (std::size_t i = 0; i < list.size() && i < values.size(); ++i) values[i] = list[i];
  }
  // Any contiguous container of int64 (std::vector, std::array, a view's shape()).
  template <typename R>
  requires std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
      std::same_as<std::remove_cv_t<std::ranges::range_value_t<R>>, std::int64_t>
      Dims(const R& range)  // NOLINT: implicit by design
      : Dims(std::span<const std::int64_t>(std::ranges::data(range), std::ranges::size(range))) {}
};

class TensorView {
 public:
  // An empty view: f32[0] on the host, no memory.
  TensorView();

  DType dtype() const { return dtype_; }
  int rank() const { return rank_; }
  std::span<const std::int64_t> shape() const { return {shape_.data(), static_cast<std::size_t>(rank_)}; }
  std::span<const std::int64_t> strides() const { return {strides_.data(), static_cast<std::size_t>(rank_)}; }
  std::int64_t dim(int i) const { return shape_[static_cast<std::size_t>(i)]; }       // 0 <= i < rank()
  std::int64_t stride(int i) const { return strides_[static_cast<std::size_t>(i)]; }  // in elements
  const Location& location() const { return location_; }
  Tier tier() const { return location_.tier; }
  MemoryOrigin origin() const { return location_.origin; }
  // The first element; null for an NVMe view.
  void* data() const { return location_.ptr; }

  // Elements in the view (1 for rank 0).
  std::int64_t numel() const { return numel_; }
  // numel() * element size: the bytes a contiguous copy of the view occupies.
  std::uint64_t nbytes() const { return static_cast<std::uint64_t>(numel_) * dtype_size(dtype_); }
  // Bytes from the first element to one past the furthest one (0 when empty). Equals nbytes()
  // for a contiguous view; larger for a strided one.
  std::uint64_t storage_bytes() const;
  // Row-major and dense: stride[i] = product of the later extents, ignoring extents of 1 (whose
  // stride never matters). Views with no elements are contiguous.
  bool is_contiguous() const;

  // Rows [begin, end) along dimension 0, sharing the storage: the pointer (or NVMe offset)
  // advances by begin * stride(0) elements. Fails for rank 0 or a range outside [0, dim(0)];
  // `name` (optional) is named in the error.
  Result<TensorView> slice(std::int64_t begin, std::int64_t end, std::string_view name = {}) const;

  // "bf16[4, 1024] host"; a view that is not contiguous adds its strides:
  // "f32[4, 8] strides [16, 1] device".
  std::string to_string() const;

 private:
  friend Result<TensorView> make_view(std::string_view name, DType dtype, const Dims& shape,
                                      const Location& location, const Dims& strides);
  DType dtype_ = DType::kF32;
  std::int8_t rank_ = 1;
  std::array<std::int64_t, kMaxRank> shape_{};
  std::array<std::int64_t, kMaxRank> strides_{};
  std::int64_t numel_ = 0;
  Location location_;
};

// Builds a checked view. `strides` empty means row-major contiguous; otherwise it must have one
// stride per dimension. Errors (kInvalidArgument) name the tensor and the offending dimension,
// stride, pointer or location.
Result<TensorView> make_view(std::string_view name, DType dtype, const Dims& shape, const Location& location,
                             const Dims& strides = {});

}  // namespace strata
