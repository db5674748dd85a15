// libFuzzer target: the swap store's journal replay (decode_journal) on an arbitrary file image.
// Any image must give the intact records plus a damage report, or an error; never a crash or a
// read past the image. What it returns must be consistent with the image it came from.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "nvme/swap_internal.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string image(reinterpret_cast<const char*>(data), size);
  auto contents = strata::nvme_detail::decode_journal(image, "fuzz.journal");
  if (!contents.ok()) {
    if (contents.status().message().find("fuzz.journal") == std::string::npos) std::abort();  // names the file
    return 0;
  }
  if (contents->file_bytes != size || contents->valid_bytes > size) std::abort();
  if (contents->record_offsets.size() != contents->records.size()) std::abort();
  for (std::uint64_t offset : contents->record_offsets) {
    if (offset >= size) std::abort();
  }
  return 0;
}
