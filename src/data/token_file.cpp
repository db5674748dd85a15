// Token files: TokenDataset (memory-mapped reading), TokenWriter, the FILE.json sidecar and the
// path lists of data.hpp.
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "strata/data.hpp"

namespace strata {

static_assert(std::endian::native == std::endian::little, "token files are read as little-endian in place");

std::string_view to_string(TokenDType t) { return t == TokenDType::kU16 ? "u16" : "u32"; }

Result<TokenDType> parse_token_dtype(std::string_view s) {
  if (s == "u16" || s == "uint16") return TokenDType::kU16;
  if (s == "u32" || s == "uint32") return TokenDType::kU32;
  return invalid_argument("token dtype '" + std::string(s) + "' is not u16 or u32");
}

std::string token_meta_path(const std::string& token_file) { return token_file + ".json"; }

namespace {

using Json = nlohmann::json;

std::string errno_text() { return std::strerror(errno); }

Status write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    out << text;
    out.flush();
    if (!out) return io_error("cannot write '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return io_error("cannot rename '" + tmp + "' to '" + path + "': " + errno_text());
  return ok_status();
}

// An llm.c header, if the file starts with one of the two known magics.
struct LlmcHeader {
  TokenDType dtype;
  std::int64_t tokens;
};
std::optional<LlmcHeader> llmc_header(const unsigned char* head, std::size_t size) {
  if (size < kLlmcHeaderBytes) return std::nullopt;
  std::int32_t h[3];
  std::memcpy(h, head, sizeof h);
  if (h[0] == kLlmcMagicU16 && h[1] == kLlmcVersionU16) return LlmcHeader{TokenDType::kU16, h[2]};
  if (h[0] == kLlmcMagicU32 && h[1] == kLlmcVersionU32) return LlmcHeader{TokenDType::kU32, h[2]};
  return std::nullopt;
}

}  // namespace

Result<std::optional<TokenFileMeta>> read_token_meta(const std::string& token_file) {
  const std::string path = token_meta_path(token_file);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::optional<TokenFileMeta>();
  std::ifstream in(path);
  if (!in) return not_found("token file sidecar '" + path + "' cannot be opened");
  Json j;
  try {
    j = Json::parse(in);
  } catch (const Json::exception& e) {
    return invalid_argument("token file sidecar '" + path + "' is not valid JSON: " + e.what());
  }
  auto bad = [&](const std::string& key, const std::string& want) {
    return invalid_argument("token file sidecar '" + path + "': \"" + key + "\" is " +
                            (j.is_object() && j.contains(key) ? j[key].dump() : std::string("missing")) +
                            ", expected " + want);
  };
  if (!j.is_object()) return invalid_argument("token file sidecar '" + path + "': expected a JSON object");
  TokenFileMeta m;
  if (!j.contains("dtype") || !j["dtype"].is_string() ||
      !parse_token_dtype(j["dtype"].get<std::string>()).ok())
    return bad("dtype", "\"u16\" or \"u32\"");
  m.dtype = *parse_token_dtype(j["dtype"].get<std::string>());
  if (!j.contains("tokens") || !j["tokens"].is_number_unsigned()) return bad("tokens", "a token count");
  m.tokens = j["tokens"].get<std::uint64_t>();
  if (j.contains("tokenizer") && !j["tokenizer"].is_string()) return bad("tokenizer", "a string");
  if (j.contains("tokenizer")) m.tokenizer = j["tokenizer"].get<std::string>();
  auto id = [&](const char* key, std::int32_t lo, std::int32_t* out) -> Status {
    if (!j.contains(key)) return ok_status();
    if (!j[key].is_number_integer() || j[key].get<std::int64_t>() < lo ||
        j[key].get<std::int64_t>() >= (1ll << 31))
      return bad(key, "an integer >= " + std::to_string(lo));
    *out = static_cast<std::int32_t>(j[key].get<std::int64_t>());
    return ok_status();
  };
  STRATA_RETURN_IF_ERROR(id("vocab_size", 1, &m.vocab_size));
  STRATA_RETURN_IF_ERROR(id("bos_id", -1, &m.bos_id));
  STRATA_RETURN_IF_ERROR(id("eos_id", -1, &m.eos_id));
  return std::optional<TokenFileMeta>(m);
}

Result<std::vector<std::string>> expand_token_paths(std::string_view spec) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', start), spec.size());
    const std::string entry(spec.substr(start, comma - start));
    start = comma + 1;
    if (entry.empty())
      return invalid_argument("token file list '" + std::string(spec) + "' has an empty entry");
    if (entry.find_first_of("*?[") == std::string::npos) {
      out.push_back(entry);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(entry.c_str(), GLOB_ERR, nullptr, &g);
    if (rc == GLOB_NOMATCH) {
      globfree(&g);
      return not_found("token file pattern '" + entry + "' matches no file");
    }
    if (rc != 0) {
      globfree(&g);
      return io_error("token file pattern '" + entry + "' cannot be expanded (a directory cannot be read)");
    }
    for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);  // sorted by glob
    globfree(&g);
  }
  return out;
}

// ---- TokenDataset -----------------------------------------------------------------------------------

struct TokenDataset::Impl {
  struct File {
    TokenFileInfo info;
    const unsigned char* map = nullptr;  // the whole file, read-only
    std::size_t map_bytes = 0;
    std::uint64_t first = 0;  // index of its first token in the stream
  };
  std::vector<File> files;
  std::vector<TokenFileInfo> infos;
  std::uint64_t size = 0;
  std::int64_t vocab_limit = 0;

  ~Impl() {
    for (File& f : files) {
      if (f.map != nullptr) ::munmap(const_cast<unsigned char*>(f.map), f.map_bytes);
    }
  }

  Status add(const std::string& path, const TokenDatasetOptions& options);
};

Status TokenDataset::Impl::add(const std::string& path, const TokenDatasetOptions& options) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found("token file '" + path + "' cannot be opened: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("token file '" + path + "' is not a regular file");
  }
  const auto bytes = static_cast<std::size_t>(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    return invalid_argument("token file '" + path + "' is empty");
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file
  if (map == MAP_FAILED) return io_error("token file '" + path + "' cannot be mapped: " + errno_text());
  // Windows are read at random places: no read-ahead beyond the pages a window touches.
  ::madvise(map, bytes, MADV_RANDOM);
  File f;
  f.map = static_cast<const unsigned char*>(map);
  f.map_bytes = bytes;
  f.first = size;
  files.push_back(f);  // unmapped by ~Impl from here on
  TokenFileInfo& info = files.back().info;
  info.path = path;
  if (auto h = llmc_header(f.map, bytes)) {
    info.format = TokenFormat::kLlmc;
    info.dtype = h->dtype;
    info.header_bytes = kLlmcHeaderBytes;
    if (options.dtype && *options.dtype != h->dtype) {
      return invalid_argument("token file '" + path + "' has an llm.c header of " +
                              std::string(to_string(h->dtype)) + " tokens, but " +
                              std::string(to_string(*options.dtype)) + " was asked for");
    }
    const std::uint64_t want =
        kLlmcHeaderBytes + static_cast<std::uint64_t>(h->tokens) * token_bytes(h->dtype);
    if (h->tokens <= 0 || want != bytes) {
      return data_loss("token file '" + path + "': its llm.c header counts " + std::to_string(h->tokens) +
                       " tokens (" + std::to_string(want) + " bytes with the header), but the file has " +
                       std::to_string(bytes) + " bytes (truncated or not an llm.c file)");
    }
    info.tokens = static_cast<std::uint64_t>(h->tokens);
  } else {
    STRATA_ASSIGN_OR_RETURN(std::optional<TokenFileMeta> meta, read_token_meta(path));
    info.format = TokenFormat::kFlat;
    info.dtype = options.dtype ? *options.dtype : meta ? meta->dtype : TokenDType::kU16;
    if (meta && meta->dtype != info.dtype) {
      return invalid_argument("token file '" + path + "' holds " + std::string(to_string(meta->dtype)) +
                              " tokens by its sidecar '" + token_meta_path(path) + "', but " +
                              std::string(to_string(info.dtype)) + " was asked for");
    }
    const std::size_t w = token_bytes(info.dtype);
    if (bytes % w != 0) {
      return invalid_argument("token file '" + path + "' has " + std::to_string(bytes) +
                              " bytes, not a multiple of " + std::to_string(w) + " (" +
                              std::string(to_string(info.dtype)) + " tokens)");
    }
    info.tokens = bytes / w;
    if (meta && meta->tokens != info.tokens) {
      return data_loss("token file '" + path + "' holds " + std::to_string(info.tokens) +
                       " tokens, but its sidecar '" + token_meta_path(path) + "' counts " +
                       std::to_string(meta->tokens) + " (truncated?)");
    }
  }
  size += info.tokens;
  infos.push_back(info);
  return ok_status();
}

TokenDataset::TokenDataset(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TokenDataset::TokenDataset(TokenDataset&&) noexcept = default;
TokenDataset& TokenDataset::operator=(TokenDataset&&) noexcept = default;
TokenDataset::~TokenDataset() = default;

Result<TokenDataset> TokenDataset::open(const std::vector<std::string>& paths,
                                        const TokenDatasetOptions& options) {
  if (paths.empty()) return invalid_argument("no token files given");
  auto impl = std::make_unique<Impl>();
  impl->vocab_limit = options.vocab_limit;
  for (const std::string& p : paths) STRATA_RETURN_IF_ERROR(impl->add(p, options));
  return TokenDataset(std::move(impl));
}

std::uint64_t TokenDataset::size() const { return impl_->size; }
const std::vector<TokenFileInfo>& TokenDataset::files() const { return impl_->infos; }
std::int64_t TokenDataset::vocab_limit() const { return impl_->vocab_limit; }
void TokenDataset::set_vocab_limit(std::int64_t limit) { impl_->vocab_limit = limit; }

std::string TokenDataset::describe() const {
  const auto& f = impl_->infos;
  return f.front().path + (f.size() > 1 ? " (+" + std::to_string(f.size() - 1) + " more)" : std::string());
}

Status TokenDataset::read(std::uint64_t begin, std::span<std::int32_t> out) const {
  const Impl& d = *impl_;
  if (begin > d.size || out.size() > d.size - begin) {
    return invalid_argument("token dataset " + describe() + ": tokens [" + std::to_string(begin) + ", " +
                            std::to_string(begin + out.size()) + ") lie past its end (" +
                            std::to_string(d.size) + " tokens)");
  }
  // The file holding `begin`: the last whose first token is <= begin.
  auto it = std::upper_bound(d.files.begin(), d.files.end(), begin,
                             [](std::uint64_t v, const Impl::File& f) { return v < f.first; });
  std::size_t fi = static_cast<std::size_t>(it - d.files.begin()) - 1;
  std::size_t done = 0;
  while (done < out.size()) {
    const Impl::File& f = d.files[fi];
    const std::uint64_t local = begin + done - f.first;
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(out.size() - done, f.info.tokens - local));
    const unsigned char* src = f.map + f.info.header_bytes + local * token_bytes(f.info.dtype);
    std::int32_t* dst = out.data() + done;
    std::uint32_t max = 0;
    if (f.info.dtype == TokenDType::kU16) {
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        dst[i] = v;
        max = std::max<std::uint32_t>(max, v);
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        std::uint32_t v;
        std::memcpy(&v, src + 4 * i, 4);
        dst[i] = static_cast<std::int32_t>(v);
        max = std::max(max, v);
      }
    }
    // Ids are int32 to the model: without a vocabulary, 2^31 is the limit.
    const std::uint64_t limit = d.vocab_limit > 0 ? static_cast<std::uint64_t>(d.vocab_limit) : (1ull << 31);
    if (max >= limit) {
      std::size_t i = 0;
      while (static_cast<std::uint32_t>(dst[i]) < limit) ++i;
      const std::uint64_t index = local + i;
      return invalid_argument(
          "token file '" + f.info.path + "': token " + std::to_string(index) + " (byte offset " +
          std::to_string(f.info.header_bytes + index * token_bytes(f.info.dtype)) + ") is " +
          std::to_string(static_cast<std::uint32_t>(dst[i])) + ", outside the model's vocabulary of " +
          std::to_string(d.vocab_limit) + " tokens");
    }
    done += n;
    ++fi;
  }
  return ok_status();
}

// ---- TokenWriter --------------------------------------------------------------------------------------

struct TokenWriter::Impl {
  std::string path, tmp;
  TokenDType dtype = TokenDType::kU16;
  TokenFormat format = TokenFormat::kFlat;
  std::FILE* file = nullptr;
  std::uint64_t tokens = 0;
  bool finished = false;
  std::vector<unsigned char> buffer;

  ~Impl() {
    if (file != nullptr) std::fclose(file);
    if (!finished) std::remove(tmp.c_str());
  }
};

TokenWriter::TokenWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TokenWriter::TokenWriter(TokenWriter&&) noexcept = default;
TokenWriter& TokenWriter::operator=(TokenWriter&&) noexcept = default;
TokenWriter::~TokenWriter() = default;

Result<TokenWriter> TokenWriter::create(const std::string& path, TokenDType dtype, TokenFormat format) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->tmp = path + ".tmp";
  impl->dtype = dtype;
  impl->format = format;
  impl->file = std::fopen(impl->tmp.c_str(), "wb");
  if (impl->file == nullptr) return io_error("cannot create '" + impl->tmp + "': " + errno_text());
  if (format == TokenFormat::kLlmc) {
    const std::vector<unsigned char> header(kLlmcHeaderBytes, 0);  // filled in by finish()
    if (std::fwrite(header.data(), 1, header.size(), impl->file) != header.size())
      return io_error("cannot write '" + impl->tmp + "': " + errno_text());
  }
  return TokenWriter(std::move(impl));
}

std::uint64_t TokenWriter::tokens() const { return impl_->tokens; }

Status TokenWriter::append(std::span<const std::int32_t> ids) {
  Impl& w = *impl_;
  const std::size_t width = token_bytes(w.dtype);
  const std::int64_t max = w.dtype == TokenDType::kU16 ? 0xFFFF : 0x7FFFFFFF;
  w.buffer.resize(ids.size() * width);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > max) {
      return invalid_argument("token " + std::to_string(w.tokens + i) + " of '" + w.path + "' is " +
                              std::to_string(ids[i]) + ", which does not fit " +
                              std::string(to_string(w.dtype)) +
                              (w.dtype == TokenDType::kU16 ? " (use u32 for vocabularies over 65,536)" : ""));
    }
    const auto v = static_cast<std::uint32_t>(ids[i]);
    std::memcpy(w.buffer.data() + i * width, &v, width);  // little-endian: the low bytes first
  }
  if (!w.buffer.empty() && std::fwrite(w.buffer.data(), 1, w.buffer.size(), w.file) != w.buffer.size())
    return io_error("cannot write '" + w.tmp + "': " + errno_text());
  w.tokens += ids.size();
  return ok_status();
}

Status TokenWriter::finish(TokenFileMeta meta) {
  Impl& w = *impl_;
  if (w.format == TokenFormat::kLlmc) {
    if (w.tokens >= (1ull << 31))
      return invalid_argument("'" + w.path + "': " + std::to_string(w.tokens) +
                              " tokens do not fit llm.c's int32 count");
    std::int32_t h[3] = {w.dtype == TokenDType::kU16 ? kLlmcMagicU16 : kLlmcMagicU32,
                         w.dtype == TokenDType::kU16 ? kLlmcVersionU16 : kLlmcVersionU32,
                         static_cast<std::int32_t>(w.tokens)};
    if (std::fseek(w.file, 0, SEEK_SET) != 0 || std::fwrite(h, 1, sizeof h, w.file) != sizeof h)
      return io_error("cannot write the header of '" + w.tmp + "': " + errno_text());
  }
  if (std::fflush(w.file) != 0 || ::fsync(::fileno(w.file)) != 0)
    return io_error("cannot write '" + w.tmp + "': " + errno_text());
  std::fclose(w.file);
  w.file = nullptr;
  // The sidecar first: a crash before the rename leaves a sidecar whose count disagrees with
  // the old file (refused on reading), never a new file read at the wrong width.
  Json j;
  j["format"] = w.format == TokenFormat::kLlmc ? "llm.c" : "flat";
  j["dtype"] = std::string(to_string(w.dtype));
  j["tokens"] = w.tokens;
  if (!meta.tokenizer.empty()) j["tokenizer"] = meta.tokenizer;
  if (meta.vocab_size > 0) j["vocab_size"] = meta.vocab_size;
  j["bos_id"] = meta.bos_id;
  j["eos_id"] = meta.eos_id;
  STRATA_RETURN_IF_ERROR(write_text_atomically(token_meta_path(w.path), j.dump(2) + "\n"));
  if (std::rename(w.tmp.c_str(), w.path.c_str()) != 0)
    return io_error("cannot rename '" + w.tmp + "' to '" + w.path + "': " + errno_text());
  w.finished = true;
  return ok_status();
}

}  // namespace strata
