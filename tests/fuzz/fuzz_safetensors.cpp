// libFuzzer target: the safetensors reader on an arbitrary file. Opening must give entries that
// lie inside the file, or an error naming the file; reading each listed tensor must succeed or
// fail cleanly. The reader takes a path, so each input is written to one scratch file.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "strata/safetensors.hpp"

namespace {

const std::string& scratch_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/strata-fuzz-safetensors-" +
           std::to_string(::getpid()) + ".safetensors";
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = scratch_path();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  auto file = strata::SafetensorsFile::open(path);
  if (!file.ok()) {
    if (file.status().message().find(path) == std::string::npos) std::abort();  // names the file
    return 0;
  }
  std::vector<unsigned char> buffer;
  for (const auto& entry : file->entries()) {
    const std::uint64_t bytes = entry.nbytes();
    if (bytes > size) std::abort();  // an entry the reader accepted must fit in the file
    // ... and hold exactly what its shape and dtype need, counted without wrapping.
    unsigned __int128 need = strata::safetensors_dtype_size(entry.dtype);
    for (std::int64_t d : entry.shape) {
      need *= static_cast<unsigned __int128>(d);
      if (need > UINT64_MAX) break;  // already too large; stop before 128 bits could wrap
    }
    if (need != bytes) std::abort();
    buffer.resize(bytes);
    const strata::Status s = file->read(entry.name, buffer.data(), bytes);
    if (!s.ok()) std::abort();  // a listed tensor of the listed size must read
  }
  return 0;
}
