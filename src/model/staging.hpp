// Moves bytes between host memory and device memory through one pinned staging buffer, in the
// stream's order. Used for parameter initialisation, weight loading and read-back, never in a
// training step. Private to src/model and src/runtime.
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "strata/alloc.hpp"
#include "strata/device.hpp"

namespace strata::detail {

class HostStager {
 public:
  static Result<std::unique_ptr<HostStager>> create(Device& device, Stream& stream, std::uint64_t bytes,
                                                    std::string_view tag) {
    auto s = std::unique_ptr<HostStager>(new HostStager(stream));
    s->bytes_ = align_up(std::max<std::uint64_t>(bytes, 4096), 4096);
    STRATA_ASSIGN_OR_RETURN(s->buffer_, device.pinned().allocate(s->bytes_, tag));
    STRATA_ASSIGN_OR_RETURN(s->free_, device.create_event());
    return s;
  }

  // Writes `bytes` at device address `dst`: `fill(chunk, offset, n)` produces bytes
  // [offset, offset + n) into the pinned chunk, which is then copied (enqueued). Returns once the
  // last chunk is enqueued; the source of `fill` may be reused then.
  Status upload(void* dst, std::uint64_t bytes,
                const std::function<void(void* chunk, std::uint64_t offset, std::uint64_t n)>& fill) {
    for (std::uint64_t done = 0; done < bytes; done += bytes_) {
      const std::uint64_t n = std::min(bytes_, bytes - done);
      STRATA_RETURN_IF_ERROR(free_->synchronize());  // the previous copy out of the buffer is done
      fill(buffer_.data(), done, n);
      STRATA_RETURN_IF_ERROR(
          stream_.copy_async(static_cast<char*>(dst) + done, buffer_.data(), n, CopyKind::kHostToDevice));
      STRATA_RETURN_IF_ERROR(stream_.record(*free_));
    }
    return ok_status();
  }

  Status upload(void* dst, const void* src, std::uint64_t bytes) {
    return upload(dst, bytes, [src](void* chunk, std::uint64_t offset, std::uint64_t n) {
      std::memcpy(chunk, static_cast<const char*>(src) + offset, n);
    });
  }

  // Synchronizes the stream, then copies `bytes` from device address `src` to host `dst`.
  Status download(void* dst, const void* src, std::uint64_t bytes) {
    if (!download_fault_.ok()) return download_fault_;
    STRATA_RETURN_IF_ERROR(stream_.synchronize());
    for (std::uint64_t done = 0; done < bytes; done += bytes_) {
      const std::uint64_t n = std::min(bytes_, bytes - done);
      STRATA_RETURN_IF_ERROR(stream_.copy_async(buffer_.data(), static_cast<const char*>(src) + done, n,
                                                CopyKind::kDeviceToHost));
      STRATA_RETURN_IF_ERROR(stream_.synchronize());
      std::memcpy(static_cast<char*>(dst) + done, buffer_.data(), n);
    }
    return ok_status();
  }

  // Tests only (offload_detail::EngineFaults): every download returns `s` until it is cleared
  // (ok), as a failing device copy would. Set while no download runs.
  void set_download_fault(Status s) { download_fault_ = std::move(s); }

  void* data() const { return buffer_.data(); }
  std::uint64_t bytes() const { return bytes_; }
  Event& free_event() { return *free_; }

 private:
  explicit HostStager(Stream& stream) : stream_(stream) {}
  Stream& stream_;
  std::uint64_t bytes_ = 0;
  ArenaBuffer buffer_;
  std::unique_ptr<Event> free_;
  Status download_fault_;
};

}  // namespace strata::detail
