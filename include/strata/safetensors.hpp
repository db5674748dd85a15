// safetensors files: the weight format other tools load. Layout: an 8-byte little-endian header
// length N, N bytes of JSON mapping tensor names to {"dtype", "shape", "data_offsets": [begin,
// end]} (offsets relative to the data section, which follows the header) plus an optional
// "__metadata__" object of string values, then the data.
//
// Writing is atomic: the file is written to "<path>.tmp", fsync'd and renamed, so a crash never
// leaves a half-written file under the final name. Reading validates everything (header size,
// JSON, dtype names, shapes against byte spans, spans inside the file, no overlaps) and errors
// name the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "strata/status.hpp"

namespace strata {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;                // "F32", "BF16", "F16", "I32", "I64", "U8", ...
  std::vector<std::int64_t> shape;
  std::uint64_t data_begin = 0;     // relative to the data section
  std::uint64_t data_end = 0;
  std::uint64_t nbytes() const { return data_end - data_begin; }
};

// Bytes per element of a safetensors dtype name, or 0 for an unknown name.
std::uint64_t safetensors_dtype_size(const std::string& dtype);

class SafetensorsWriter {
 public:
  // Copies nothing: `data` must stay valid until write(). Fails on a duplicate name, an unknown
  // dtype or a byte count that does not match the shape.
  Status add(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape, const void* data,
             std::uint64_t nbytes);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  Status write(const std::string& path) const;

 private:
  struct Pending {
    SafetensorsEntry entry;
    const void* data;
  };
  std::vector<Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsFile {
 public:
  static Result<SafetensorsFile> open(const std::string& path);

  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(const std::string& name) const;
  // Reads a tensor's bytes into `dst` (exactly entry.nbytes()).
  Status read(const std::string& name, void* dst, std::uint64_t nbytes) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace strata
