// safetensors files: the weight format other tools load. Layout: an 8-byte little-endian header
// length N, N bytes of JSON mapping tensor names to {"dtype", "shape", "data_offsets": [begin,
// end]} (offsets relative to the data section, which follows the header) plus an optional
// "__metadata__" object of string values, then the data.
//
// The header is a function of the tensors' names, dtypes and shapes and the order they were
// added (SafetensorsHeader): every tensor's byte range is known before any data exists. So one
// file can be filled by several writers, each writing its own tensors at their offsets
// (SafetensorsPartWriter; a pipeline's stages write one weights file this way), and it is byte
// for byte the file one writer (SafetensorsWriter) writes for the same adds.
//
// Writing is atomic: the file is written to "<path>.tmp", fsync'd and renamed, so a crash never
// leaves a half-written file under the final name. Reading validates everything (header size,
// JSON, dtype names, shapes against byte spans, spans inside the file, no overlaps) and errors
// name the file and the tensor.
#pragma once

#include <cstdint>
#include <functional>
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

// Names, dtypes, shapes and byte ranges of a file's tensors, and its metadata: everything before
// the data section. Each add() places its tensor right after the previous one.
class SafetensorsHeader {
 public:
  // Fails on a bad or duplicate name, an unknown dtype or a byte count that does not match the
  // shape.
  Status add(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape,
             std::uint64_t nbytes);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const;
  // The file's first bytes: the 8-byte length, then the JSON (keys sorted), padded with spaces
  // so that the data section starts 8-byte aligned.
  std::string encode() const;
  // The data section's size (the sum of the tensors' bytes).
  std::uint64_t data_bytes() const { return entries_.empty() ? 0 : entries_.back().data_end; }

 private:
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// One writer of the whole file.
class SafetensorsWriter {
 public:
  // Copies nothing: `data` must stay valid until write(). Fails as SafetensorsHeader::add.
  Status add(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape, const void* data,
             std::uint64_t nbytes);
  void set_metadata(const std::string& key, const std::string& value) { header_.set_metadata(key, value); }
  // Temporary name, fsync, rename (below); a failure leaves nothing under either name.
  Status write(const std::string& path) const;

 private:
  SafetensorsHeader header_;
  std::vector<const void*> data_;  // one per header_ entry
};

// Several writers filling one file, each with the byte ranges of its own tensors (processes on
// one machine or on a shared file system). The caller orders the steps (a pipeline's
// collectives do):
//   1. one writer: create(path, header) makes "<path>.tmp" (truncated), writes the header, sizes
//      the file to its final length and fsyncs it;
//   2. after 1, each writer: open(path, header), write() each of its tensors once, close()
//      (fsync); writers touch disjoint ranges, so they may run at the same time;
//   3. after every writer's close() succeeded, one writer: publish(path) renames the file into
//      place; after any failure: discard(path). The final name never holds a partial file, and a
//      file already there keeps its bytes until publish.
// Every writer computes the same header (the same adds in the same order), so the offsets agree.
// A writer object belongs to one thread.
class SafetensorsPartWriter {
 public:
  // Tests only: consulted before each tensor's write with the temporary file's path and the
  // tensor's file range; a non-zero errno fails that write as the disk would.
  using WriteFault = std::function<int(const std::string& file, std::uint64_t offset, std::uint64_t nbytes)>;

  static std::string temp_path(const std::string& path) { return path + ".tmp"; }
  static Status create(const std::string& path, const SafetensorsHeader& header);
  static Result<SafetensorsPartWriter> open(const std::string& path, const SafetensorsHeader& header,
                                            WriteFault fault = nullptr);
  static Status publish(const std::string& path);
  static void discard(const std::string& path);

  SafetensorsPartWriter(SafetensorsPartWriter&& other) noexcept;
  SafetensorsPartWriter& operator=(SafetensorsPartWriter&&) = delete;
  SafetensorsPartWriter(const SafetensorsPartWriter&) = delete;
  ~SafetensorsPartWriter();  // closes without fsync when close() was not called

  // Writes tensor `name`'s bytes (exactly its header size) at its offset.
  Status write(const std::string& name, const void* data, std::uint64_t nbytes);
  // Writes `nbytes` at `offset` from the data section's start, a range inside tensor `name` (a
  // writer holding part of a tensor: a tensor-parallel shard, a stage-3 slice).
  Status write_range(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t nbytes);
  // The writes (write, write_range) issued so far.
  std::uint64_t writes() const { return writes_; }
  // fsync and close: the writer's tensors are durable when it returns ok.
  Status close();

 private:
  SafetensorsPartWriter(const SafetensorsHeader* header, std::string tmp, int fd, std::uint64_t data_offset,
                        WriteFault fault);
  // `nbytes` at `offset` of the file (the data section's offset included), for tensor `name`.
  Status pwrite_at(const std::string& name, std::uint64_t offset, const char* data, std::uint64_t nbytes);
  const SafetensorsHeader* header_;  // the caller's; outlives the writer
  std::string tmp_;
  int fd_ = -1;
  std::uint64_t data_offset_ = 0;
  WriteFault fault_;
  std::uint64_t writes_ = 0;
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
  // The data section's file offset (8 + the header's length).
  std::uint64_t data_offset() const { return data_offset_; }

 private:
  std::string path_;
  std::uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace strata
