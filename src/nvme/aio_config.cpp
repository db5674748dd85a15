// The `aio` config section: backend names and validation. Messages name the key as
// `aio.<key>` because that is what the user wrote.
#include <algorithm>
#include <set>

#include "strata/config.hpp"
#include "strata/nvme.hpp"
#include "strata/options.hpp"

namespace strata {

std::string_view to_string(IoBackendKind kind) {
  switch (kind) {
    case IoBackendKind::kAuto:
      return "auto";
    case IoBackendKind::kIoUring:
      return "io_uring";
    case IoBackendKind::kLibaio:
      return "libaio";
    case IoBackendKind::kPsync:
      return "psync";
  }
  return "unknown";
}

Result<IoBackendKind> parse_io_backend(std::string_view text) {
  if (text == "auto") return IoBackendKind::kAuto;
  if (text == "io_uring" || text == "uring") return IoBackendKind::kIoUring;
  if (text == "libaio" || text == "aio") return IoBackendKind::kLibaio;
  if (text == "psync" || text == "pread") return IoBackendKind::kPsync;
  return invalid_argument("aio.backend: '" + std::string(text) +
                          "' is not one of auto, io_uring, libaio, psync");
}

Status IoEngineConfig::validate() const {
  constexpr std::uint64_t kMaxBlock = 1ull << 30;  // one read(2) moves at most 2 GiB - 4 KiB
  if (block_size < 4096 || block_size % 4096 != 0 || block_size > kMaxBlock) {
    return invalid_argument("aio.block_size: " + std::to_string(block_size) +
                            " must be a multiple of 4096 between 4096 and " + std::to_string(kMaxBlock) +
                            " (O_DIRECT moves whole 4 KiB blocks)");
  }
  if (queue_depth < 1 || queue_depth > 32768) {
    return invalid_argument("aio.queue_depth: " + std::to_string(queue_depth) +
                            " must be between 1 and 32768");
  }
  if (intra_op_parallelism < 1 || intra_op_parallelism > 1024) {
    return invalid_argument("aio.intra_op_parallelism (alias aio.thread_count): " +
                            std::to_string(intra_op_parallelism) + " must be between 1 and 1024");
  }
  std::set<std::string> seen;
  for (std::size_t i = 0; i < nvme_path.size(); ++i) {
    const std::string& p = nvme_path[i];
    std::string key = "aio.nvme_path[" + std::to_string(i) + "]";
    if (p.empty()) return invalid_argument(key + ": empty path");
    std::string norm = p;
    while (norm.size() > 1 && norm.back() == '/') norm.pop_back();
    if (!seen.insert(norm).second) return invalid_argument(key + ": '" + p + "' is listed twice");
  }
  if (sq_poll) {
    if (backend == IoBackendKind::kLibaio || backend == IoBackendKind::kPsync) {
      return invalid_argument("aio.sq_poll needs the io_uring backend (aio.backend is " +
                              std::string(to_string(backend)) + ")");
    }
    if (sq_poll_idle_ms < 1 || sq_poll_idle_ms > 600000) {
      return invalid_argument("aio.sq_poll_idle_ms: " + std::to_string(sq_poll_idle_ms) +
                              " must be between 1 and 600000");
    }
  }
  return ok_status();
}

IoEngineConfig IoEngineConfig::from(const AioConfig& aio) {
  IoEngineConfig c;
  c.block_size = aio.block_size;
  // Negative counts from the loader become 0 here, which validate() rejects with the key named.
  c.queue_depth = static_cast<std::uint32_t>(std::max(aio.queue_depth, 0));
  c.intra_op_parallelism = static_cast<std::uint32_t>(std::max(aio.intra_op_parallelism, 0));
  c.single_submit = aio.single_submit;
  c.overlap_events = aio.overlap_events;
  c.nvme_path = aio.nvme_path;
  switch (aio.backend) {
    case AioBackend::kAuto:
      c.backend = IoBackendKind::kAuto;
      break;
    case AioBackend::kIoUring:
      c.backend = IoBackendKind::kIoUring;
      break;
    case AioBackend::kLibaio:
      c.backend = IoBackendKind::kLibaio;
      break;
    case AioBackend::kPsync:
      c.backend = IoBackendKind::kPsync;
      break;
  }
  return c;
}

}  // namespace strata
