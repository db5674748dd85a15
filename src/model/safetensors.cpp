#include "strata/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

namespace strata {
namespace {

constexpr std::uint64_t kMaxHeader = 100ull << 20;

Status write_all(int fd, const void* data, std::uint64_t n, const std::string& path) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<std::uint64_t>(n, 1ull << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return io_error("writing '" + path + "': " + std::strerror(errno));
    }
    p += w;
    n -= static_cast<std::uint64_t>(w);
  }
  return ok_status();
}

Status read_exact(int fd, void* dst, std::uint64_t n, std::uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, std::min<std::uint64_t>(n, 1ull << 30), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_error("reading '" + path + "' at offset " + std::to_string(offset) + ": " + std::strerror(errno));
    }
    if (r == 0) return data_loss("'" + path + "' ends early at offset " + std::to_string(offset));
    p += r;
    n -= static_cast<std::uint64_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
  return ok_status();
}

}  // namespace

std::uint64_t safetensors_dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

Status SafetensorsHeader::add(const std::string& name, const std::string& dtype,
                              std::vector<std::int64_t> shape, std::uint64_t nbytes) {
  if (name.empty() || name == "__metadata__") return invalid_argument("safetensors: bad tensor name '" + name + "'");
  if (find(name) != nullptr) return invalid_argument("safetensors: tensor '" + name + "' added twice");
  std::uint64_t es = safetensors_dtype_size(dtype);
  if (es == 0) return invalid_argument("safetensors: tensor '" + name + "' has unknown dtype '" + dtype + "'");
  std::uint64_t numel = 1;
  for (auto d : shape) {
    if (d < 0) return invalid_argument("safetensors: tensor '" + name + "' has a negative dimension");
    numel *= static_cast<std::uint64_t>(d);
  }
  if (numel * es != nbytes) {
    return invalid_argument("safetensors: tensor '" + name + "' has " + std::to_string(nbytes) + " bytes but its shape needs " +
                            std::to_string(numel * es));
  }
  SafetensorsEntry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = std::move(shape);
  e.data_begin = data_bytes();
  e.data_end = e.data_begin + nbytes;
  entries_.push_back(std::move(e));
  return ok_status();
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::string SafetensorsHeader::encode() const {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  for (const auto& e : entries_) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.data_begin, e.data_end}}};
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';  // keeps the data section 8-byte aligned
  const std::uint64_t n = text.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + text;
}

Status SafetensorsWriter::add(const std::string& name, const std::string& dtype,
                              std::vector<std::int64_t> shape, const void* data, std::uint64_t nbytes) {
  STRATA_RETURN_IF_ERROR(header_.add(name, dtype, std::move(shape), nbytes));
  data_.push_back(data);
  return ok_status();
}

Status SafetensorsWriter::write(const std::string& path) const {
  Status s = SafetensorsPartWriter::create(path, header_);
  if (!s.ok()) return s;
  auto part = SafetensorsPartWriter::open(path, header_);
  s = part.status();
  for (std::size_t i = 0; s.ok() && i < data_.size(); ++i) {
    const SafetensorsEntry& e = header_.entries()[i];
    s = part->write(e.name, data_[i], e.nbytes());
  }
  if (part.ok()) {
    Status closed = part->close();
    if (s.ok()) s = closed;
  }
  if (s.ok()) s = SafetensorsPartWriter::publish(path);
  if (!s.ok()) SafetensorsPartWriter::discard(path);
  return s;
}

Status SafetensorsPartWriter::create(const std::string& path, const SafetensorsHeader& header) {
  const std::string tmp = temp_path(path);
  const std::string head = header.encode();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot create '" + tmp + "': " + std::strerror(errno));
  Status s = write_all(fd, head.data(), head.size(), tmp);
  // The final length now: every writer's range lies inside the file, and a reader of a published
  // file never sees it shorter than its header says.
  if (s.ok() && ::ftruncate(fd, static_cast<off_t>(head.size() + header.data_bytes())) != 0) {
    s = io_error("sizing '" + tmp + "' to " + std::to_string(head.size() + header.data_bytes()) +
                 " bytes: " + std::strerror(errno));
  }
  if (s.ok() && ::fsync(fd) != 0) s = io_error("fsync of '" + tmp + "': " + std::strerror(errno));
  if (::close(fd) != 0 && s.ok()) s = io_error("closing '" + tmp + "': " + std::strerror(errno));
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

Result<SafetensorsPartWriter> SafetensorsPartWriter::open(const std::string& path,
                                                          const SafetensorsHeader& header, WriteFault fault) {
  std::string tmp = temp_path(path);
  // No O_CREAT: the file is create()'s; a writer that finds none was not ordered after it.
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open '" + tmp + "' for writing: " + std::strerror(errno));
  return SafetensorsPartWriter(&header, std::move(tmp), fd, header.encode().size(), std::move(fault));
}

Status SafetensorsPartWriter::publish(const std::string& path) {
  const std::string tmp = temp_path(path);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return io_error("renaming '" + tmp + "' to '" + path + "': " + std::strerror(errno));
  }
  return ok_status();
}

void SafetensorsPartWriter::discard(const std::string& path) { ::unlink(temp_path(path).c_str()); }

SafetensorsPartWriter::SafetensorsPartWriter(const SafetensorsHeader* header, std::string tmp, int fd,
                                             std::uint64_t data_offset, WriteFault fault)
    : header_(header), tmp_(std::move(tmp)), fd_(fd), data_offset_(data_offset), fault_(std::move(fault)) {}

SafetensorsPartWriter::SafetensorsPartWriter(SafetensorsPartWriter&& other) noexcept
    : header_(other.header_),
      tmp_(std::move(other.tmp_)),
      fd_(std::exchange(other.fd_, -1)),
      data_offset_(other.data_offset_),
      fault_(std::move(other.fault_)),
      writes_(other.writes_) {}

SafetensorsPartWriter::~SafetensorsPartWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status SafetensorsPartWriter::write(const std::string& name, const void* data, std::uint64_t nbytes) {
  if (fd_ < 0) return internal_error("safetensors: writing '" + name + "' to '" + tmp_ + "' after close");
  const SafetensorsEntry* e = header_->find(name);
  if (e == nullptr)
    return invalid_argument("safetensors: '" + tmp_ + "' has no tensor '" + name + "' in its header");
  if (e->nbytes() != nbytes) {
    return invalid_argument("safetensors: tensor '" + name + "' of '" + tmp_ + "' has " +
                            std::to_string(e->nbytes()) + " bytes in the header, " + std::to_string(nbytes) +
                            " given");
  }
  return pwrite_at(name, data_offset_ + e->data_begin, static_cast<const char*>(data), nbytes);
}

Status SafetensorsPartWriter::write_range(const std::string& name, std::uint64_t offset, const void* data,
                                          std::uint64_t nbytes) {
  if (fd_ < 0) return internal_error("safetensors: writing '" + name + "' to '" + tmp_ + "' after close");
  const SafetensorsEntry* e = header_->find(name);
  if (e == nullptr)
    return invalid_argument("safetensors: '" + tmp_ + "' has no tensor '" + name + "' in its header");
  if (offset < e->data_begin || offset > e->data_end || nbytes > e->data_end - offset) {
    return invalid_argument("safetensors: bytes [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                            ") of the data section of '" + tmp_ + "' are not inside tensor '" + name + "' [" +
                            std::to_string(e->data_begin) + ", " + std::to_string(e->data_end) + ")");
  }
  return pwrite_at(name, data_offset_ + offset, static_cast<const char*>(data), nbytes);
}

Status SafetensorsPartWriter::pwrite_at(const std::string& name, std::uint64_t offset, const char* p,
                                        std::uint64_t nbytes) {
  ++writes_;
  if (fault_) {
    if (const int err = fault_(tmp_, offset, nbytes); err != 0) {
      return io_error("writing '" + name + "' to '" + tmp_ + "' at offset " + std::to_string(offset) + ": " +
                      std::strerror(err));
    }
  }
  while (nbytes > 0) {
    ssize_t w = ::pwrite(fd_, p, std::min<std::uint64_t>(nbytes, 1ull << 30), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return io_error("writing '" + name + "' to '" + tmp_ + "' at offset " + std::to_string(offset) + ": " +
                      std::strerror(errno));
    }
    p += w;
    nbytes -= static_cast<std::uint64_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
  return ok_status();
}

Status SafetensorsPartWriter::close() {
  if (fd_ < 0) return ok_status();
  const int fd = std::exchange(fd_, -1);
  Status s;
  if (::fsync(fd) != 0) s = io_error("fsync of '" + tmp_ + "': " + std::strerror(errno));
  if (::close(fd) != 0 && s.ok()) s = io_error("closing '" + tmp_ + "': " + std::strerror(errno));
  return s;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found("weights file '" + path + "' cannot be opened: " + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  auto fail = [&](const std::string& why) {
    ::close(fd);
    return invalid_argument("weights file '" + path + "' is not a valid safetensors file: " + why);
  };
  unsigned char len[8];
  if (file_size < 8 || !read_exact(fd, len, 8, 0, path).ok()) return fail("shorter than its 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(len[i]) << (8 * i);
  if (n > kMaxHeader || 8 + n > file_size) {
    return fail("header length " + std::to_string(n) + " exceeds the file (" + std::to_string(file_size) + " bytes)");
  }
  std::string text(n, '\0');
  if (!read_exact(fd, text.data(), n, 8, path).ok()) return fail("header cannot be read");
  ::close(fd);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    return invalid_argument("weights file '" + path + "': header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) return invalid_argument("weights file '" + path + "': header is not a JSON object");
  SafetensorsFile f;
  f.path_ = path;
  f.data_offset_ = 8 + n;
  const std::uint64_t data_size = file_size - f.data_offset_;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const auto& v = it.value();
    auto bad = [&](const std::string& why) {
      return invalid_argument("weights file '" + path + "': tensor '" + key + "': " + why);
    };
    if (key == "__metadata__") {
      if (!v.is_object()) return bad("__metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return bad("__metadata__." + m.key() + " must be a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      return bad("expected an object with dtype, shape and data_offsets");
    }
    SafetensorsEntry e;
    e.name = key;
    if (!v["dtype"].is_string()) return bad("dtype must be a string");
    e.dtype = v["dtype"].get<std::string>();
    std::uint64_t es = safetensors_dtype_size(e.dtype);
    if (es == 0) return bad("unknown dtype '" + e.dtype + "'");
    if (!v["shape"].is_array()) return bad("shape must be an array");
    std::uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<std::int64_t>() < 0) return bad("shape entries must be non-negative integers");
      e.shape.push_back(d.get<std::int64_t>());
      const auto dim = static_cast<std::uint64_t>(e.shape.back());
      // Checked, or a shape whose element count wraps to a small number would pass the size check.
      if (dim != 0 && numel > UINT64_MAX / es / dim) return bad("shape " + v["shape"].dump() + " has more bytes than 2^64");
      numel *= dim;
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return bad("data_offsets must be [begin, end]");
    }
    e.data_begin = off[0].get<std::uint64_t>();
    e.data_end = off[1].get<std::uint64_t>();
    if (e.data_end < e.data_begin || e.data_end > data_size) {
      return bad("data_offsets [" + std::to_string(e.data_begin) + ", " + std::to_string(e.data_end) +
                 "] fall outside the data section (" + std::to_string(data_size) + " bytes)");
    }
    if (e.nbytes() != numel * es) {
      return bad("shape needs " + std::to_string(numel * es) + " bytes but data_offsets span " + std::to_string(e.nbytes()));
    }
    f.entries_.push_back(std::move(e));
  }
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& e : f.entries_) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->data_begin < b->data_begin; });
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i]->data_begin < sorted[i - 1]->data_end) {
      return invalid_argument("weights file '" + path + "': tensors '" + sorted[i - 1]->name + "' and '" + sorted[i]->name +
                              "' overlap");
    }
  }
  return f;
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Status SafetensorsFile::read(const std::string& name, void* dst, std::uint64_t nbytes) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) return not_found("weights file '" + path_ + "' has no tensor '" + name + "'");
  if (e->nbytes() != nbytes) {
    return invalid_argument("weights file '" + path_ + "': tensor '" + name + "' has " + std::to_string(e->nbytes()) +
                            " bytes, " + std::to_string(nbytes) + " expected");
  }
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("weights file '" + path_ + "' cannot be opened: " + std::strerror(errno));
  Status s = read_exact(fd, dst, nbytes, data_offset_ + e->data_begin, path_);
  ::close(fd);
  return s;
}

}  // namespace strata
