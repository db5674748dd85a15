#include "strata/tensor.hpp"

#include <cinttypes>
#include <cstdio>
#include <limits>

namespace strata {
namespace {

constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

std::string join(std::span<const std::int64_t> v) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(v[i]);
  }
  return out;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<std::uintptr_t>(p));
  return buf;
}

Status fail(std::string_view name, const std::string& what) {
  return invalid_argument(name.empty() ? "tensor view: " + what
                                       : "tensor '" + std::string(name) + "': " + what);
}

// Elements from the first to one past the furthest; 0 when empty, -1 on overflow.
std::int64_t span_elements(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides,
                           std::int64_t numel) {
  if (numel == 0) return 0;
  std::int64_t last = 0;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    std::int64_t step = 0;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &step) ||
        __builtin_add_overflow(last, step, &last)) {
      return -1;
    }
  }
  return last == kInt64Max ? -1 : last + 1;
}

// The location rules of tensor.hpp, given the bytes the view spans.
Status check_location(std::string_view name, DType dtype, const Location& loc, std::uint64_t storage_bytes) {
  switch (loc.tier) {
    case Tier::kDevice:
      if (loc.origin != MemoryOrigin::kDeviceArena) {
        return fail(name, "a device location must come from a device arena, not " +
                              std::string(to_string(loc.origin)));
      }
      break;
    case Tier::kHost:
      if (loc.origin == MemoryOrigin::kDeviceArena) {
        return fail(name, "a host location cannot come from a device arena");
      }
      break;
    case Tier::kNvme:
      if (loc.ptr != nullptr)
        return fail(name, "an nvme location has no pointer, but " + hex(loc.ptr) + " was given");
      if (loc.origin != MemoryOrigin::kSystem) {
        return fail(name, "an nvme location has no memory origin, but " + std::string(to_string(loc.origin)) +
                              " was given");
      }
      if (loc.extent.offset > static_cast<std::uint64_t>(kInt64Max) ||
          storage_bytes > static_cast<std::uint64_t>(kInt64Max) - loc.extent.offset) {
        return fail(name, "nvme extent of " + std::to_string(storage_bytes) + " bytes at offset " +
                              std::to_string(loc.extent.offset) + " of file " +
                              std::to_string(loc.extent.file) + " passes the largest file offset");
      }
      return ok_status();
    default:
      return fail(name, "tier value " + std::to_string(static_cast<int>(loc.tier)) + " is not a known tier");
  }
  if (storage_bytes == 0) return ok_status();
  if (loc.ptr == nullptr) {
    return fail(name, std::string(to_string(loc.tier)) + " pointer is null for " +
                          std::to_string(storage_bytes) + " bytes");
  }
  const auto address = reinterpret_cast<std::uintptr_t>(loc.ptr);
  if (address % dtype_size(dtype) != 0) {
    return fail(name, std::string(to_string(loc.tier)) + " pointer " + hex(loc.ptr) + " is not aligned to " +
                          std::to_string(dtype_size(dtype)) + " bytes (" + std::string(to_string(dtype)) +
                          ")");
  }
  if (storage_bytes > std::numeric_limits<std::uintptr_t>::max() - address) {
    return fail(name,
                std::to_string(storage_bytes) + " bytes at " + hex(loc.ptr) + " wrap the address space");
  }
  return ok_status();
}

}  // namespace

std::string_view to_string(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "unknown";
}

std::string to_string(const Location& location) {
  if (location.tier == Tier::kNvme) {
    return "nvme file " + std::to_string(location.extent.file) + " offset " +
           std::to_string(location.extent.offset);
  }
  return std::string(to_string(location.tier)) + " (" + std::string(to_string(location.origin)) + ") " +
         hex(location.ptr);
}

TensorView::TensorView() { strides_[0] = 1; }

std::uint64_t TensorView::storage_bytes() const {
  // Cannot overflow: make_view() and slice() checked it.
  return static_cast<std::uint64_t>(span_elements(shape(), strides(), numel_)) * dtype_size(dtype_);
}

bool TensorView::is_contiguous() const {
  if (numel_ == 0) return true;
  std::int64_t expected = 1;
  for (int i = rank_ - 1; i >= 0; --i) {
    if (dim(i) != 1 && stride(i) != expected) return false;
    expected *= dim(i);
  }
  return true;
}

Result<TensorView> TensorView::slice(std::int64_t begin, std::int64_t end, std::string_view name) const {
  if (rank_ == 0) return fail(name, "cannot slice " + to_string() + " along dimension 0: it has rank 0");
  if (begin < 0 || end < begin || end > dim(0)) {
    return fail(name, "rows [" + std::to_string(begin) + ", " + std::to_string(end) +
                          ") are not within [0, " + std::to_string(dim(0)) + ") of " + to_string());
  }
  TensorView v = *this;
  v.shape_[0] = end - begin;
  v.numel_ = end == begin ? 0 : numel_ / dim(0) * (end - begin);
  // begin < dim(0) keeps the advance inside the checked span; an empty slice at the end may
  // point one row past it, which is checked like any new location.
  std::int64_t advance_elems = 0;
  std::int64_t advance_bytes = 0;
  if (__builtin_mul_overflow(begin, stride(0), &advance_elems) ||
      __builtin_mul_overflow(advance_elems, static_cast<std::int64_t>(dtype_size(dtype_)), &advance_bytes)) {
    return fail(name, "rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " + to_string() +
                          " start beyond the addressable range");
  }
  if (v.location_.tier == Tier::kNvme) {
    v.location_.extent.offset += static_cast<std::uint64_t>(advance_bytes);
  } else if (advance_bytes != 0) {
    v.location_.ptr = static_cast<unsigned char*>(v.location_.ptr) + advance_bytes;
  }
  STRATA_RETURN_IF_ERROR(check_location(name, v.dtype_, v.location_, v.storage_bytes()));
  return v;
}

std::string TensorView::to_string() const {
  std::string s = std::string(strata::to_string(dtype_)) + "[" + join(shape()) + "]";
  if (!is_contiguous()) s += " strides [" + join(strides()) + "]";
  s += " ";
  s += strata::to_string(location_.tier);
  return s;
}

Result<TensorView> make_view(std::string_view name, DType dtype, const Dims& shape, const Location& location,
                             const Dims& strides) {
  if (dtype_size(dtype) == 0) {
    return fail(name, "dtype value " + std::to_string(static_cast<int>(dtype)) + " is not a known dtype");
  }
  if (shape.size > static_cast<std::size_t>(kMaxRank)) {
    return fail(
        name, "rank " + std::to_string(shape.size) + " exceeds the maximum rank " + std::to_string(kMaxRank));
  }
  const std::span<const std::int64_t> dims(shape.values.data(), shape.size);
  if (strides.size != 0 && strides.size != shape.size) {
    return fail(name, std::to_string(strides.size) + " strides given for the rank-" +
                          std::to_string(shape.size) + " shape [" + join(dims) + "]");
  }

  TensorView v;
  v.dtype_ = dtype;
  v.rank_ = static_cast<std::int8_t>(shape.size);
  v.shape_ = {};
  v.strides_ = {};
  bool empty = false;
  for (std::size_t i = 0; i < shape.size; ++i) {
    if (dims[i] < 0) {
      return fail(name, "dimension " + std::to_string(i) + " of shape [" + join(dims) + "] is negative");
    }
    v.shape_[i] = dims[i];
    empty = empty || dims[i] == 0;
  }
  std::int64_t numel = empty ? 0 : 1;  // a zero extent makes the view empty whatever the others are
  for (std::size_t i = 0; i < shape.size && !empty; ++i) {
    if (__builtin_mul_overflow(numel, dims[i], &numel)) {
      return fail(name, "shape [" + join(dims) + "] has more elements than int64 can count");
    }
  }

  if (strides.size == 0) {
    std::int64_t stride = 1;
    for (std::size_t i = shape.size; i-- > 0;) {
      v.strides_[i] = stride;
      // Extents of 0 would zero every outer stride; any stride works for an empty view, so
      // keep them as if the extent were 1.
      if (__builtin_mul_overflow(stride, dims[i] == 0 ? 1 : dims[i], &stride) && i > 0) {
        return fail(name, "shape [" + join(dims) + "] is too large for row-major strides");
      }
    }
  } else {
    for (std::size_t i = 0; i < shape.size; ++i) {
      if (strides.values[i] < 0) {
        return fail(name, "stride " + std::to_string(i) + " of [" +
                              join({strides.values.data(), strides.size}) + "] is negative");
      }
      v.strides_[i] = strides.values[i];
    }
  }
  v.numel_ = numel;
  v.location_ = location;

  const std::int64_t span = span_elements(v.shape(), v.strides(), numel);
  std::int64_t span_bytes = 0;
  if (span < 0 || __builtin_mul_overflow(span, static_cast<std::int64_t>(dtype_size(dtype)), &span_bytes)) {
    return fail(name, "shape [" + join(dims) + "] with strides [" + join(v.strides()) +
                          "] spans more bytes than int64 can count");
  }
  if (numel > kInt64Max / static_cast<std::int64_t>(dtype_size(dtype))) {
    return fail(name, "shape [" + join(dims) + "] holds more bytes than int64 can count");
  }
  STRATA_RETURN_IF_ERROR(check_location(name, dtype, location, static_cast<std::uint64_t>(span_bytes)));
  return v;
}

}  // namespace strata
