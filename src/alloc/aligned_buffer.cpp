#include <cstdlib>
#include <cstring>

#include "strata/alloc.hpp"
#include "strata/options.hpp"

namespace strata {

std::string_view to_string(MemoryOrigin origin) {
  switch (origin) {
    case MemoryOrigin::kDeviceArena: return "device-arena";
    case MemoryOrigin::kPinnedPool: return "pinned-pool";
    case MemoryOrigin::kIoBuffer: return "io-buffer";
    case MemoryOrigin::kSystem: return "system";
  }
  return "unknown";
}

Result<AlignedBuffer> AlignedBuffer::allocate(std::uint64_t bytes) {
  AlignedBuffer b;
  b.size_ = align_up(bytes == 0 ? kAlignment : bytes, kAlignment);
  if (::posix_memalign(&b.data_, kAlignment, b.size_) != 0) {
    b.data_ = nullptr;
    return out_of_memory("cannot allocate a " + format_bytes(b.size_) + " aligned I/O buffer");
  }
  std::memset(b.data_, 0, b.size_);
  return b;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

}  // namespace strata
