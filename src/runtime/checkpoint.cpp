#include "strata/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "strata/nvme.hpp"

namespace strata {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kManifest = "manifest.json";
constexpr const char* kLatest = "latest";
constexpr const char* kFormat = "strata-checkpoint";
constexpr int kVersion = 1;

Status fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open '" + path + "' to fsync it: " + std::strerror(errno));
  Status s;
  if (::fsync(fd) != 0) s = io_error("fsync of '" + path + "': " + std::strerror(errno));
  ::close(fd);
  return s;
}

// Temporary name, fsync, rename, fsync of the directory.
Status write_file_durably(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot create '" + tmp + "': " + std::strerror(errno));
  Status s;
  std::size_t done = 0;
  while (s.ok() && done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) s = io_error("writing '" + tmp + "': " + std::strerror(n < 0 ? errno : ENOSPC));
    else done += static_cast<std::size_t>(n);
  }
  if (s.ok() && ::fsync(fd) != 0) s = io_error("fsync of '" + tmp + "': " + std::strerror(errno));
  if (::close(fd) != 0 && s.ok()) s = io_error("closing '" + tmp + "': " + std::strerror(errno));
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = io_error("renaming '" + tmp + "' to '" + path + "': " + std::strerror(errno));
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return fsync_path(dir, true);
}

Result<std::string> read_small_file(const std::string& path, std::uint64_t limit) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) return not_found("'" + path + "' cannot be read: " + ec.message());
  if (size > limit) return data_loss("'" + path + "' is " + std::to_string(size) + " bytes; expected at most " +
                                     std::to_string(limit));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return not_found("'" + path + "' cannot be opened: " + std::strerror(errno));
  std::string text(size, '\0');
  const std::size_t got = text.empty() ? 0 : std::fread(text.data(), 1, text.size(), f);
  std::fclose(f);
  if (got != text.size()) return io_error("reading '" + path + "': short read");
  return text;
}

struct FileSum {
  std::uint64_t bytes = 0;
  std::uint32_t crc = 0;
};

Result<FileSum> checksum_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found("checkpoint file '" + path + "' cannot be opened: " + std::strerror(errno));
  std::vector<char> buf(4u << 20);
  FileSum sum;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      return io_error("reading checkpoint file '" + path + "': " + std::strerror(e));
    }
    if (n == 0) break;
    sum.crc = crc32c(buf.data(), static_cast<std::size_t>(n), sum.crc);
    sum.bytes += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  return sum;
}

std::string step_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

// Published checkpoints under root (directories with a manifest and no .tmp- in the name), by
// name; names sort by step because the step is zero-padded.
std::vector<std::string> published(const std::string& root) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.find(".tmp-") != std::string::npos) continue;
    if (fs::exists(e.path() / kManifest, ec)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string list_text(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

Result<std::string> publish_checkpoint(
    const std::string& root, CheckpointManifest manifest, int keep,
    const std::function<Status(const std::string& dir, std::vector<std::string>* names)>& write_files) {
  if (keep < 1) return invalid_argument("checkpoint: keep must be at least 1 (got " + std::to_string(keep) + ")");
  if (manifest.step < 0) return invalid_argument("checkpoint: negative step " + std::to_string(manifest.step));
  {
    Json check = Json::parse(manifest.client_state, nullptr, false);
    if (check.is_discarded() || !check.is_object()) {
      return invalid_argument("checkpoint: client state must be a JSON object");
    }
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec || !fs::is_directory(root)) {
    return io_error("checkpoint directory '" + root + "' cannot be created: " + ec.message());
  }
  // Leftovers of saves that never finished (a crash): never loadable, safe to remove.
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.path().filename().string().find(".tmp-") != std::string::npos) fs::remove_all(e.path(), ec);
  }
  const std::string base = step_name(manifest.step);
  const std::string tmp = root + "/" + base + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) {
    return io_error("cannot create '" + tmp + "': " + (ec ? ec.message() : std::string("it exists")));
  }
  auto abandon = [&](Status s) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    return s;
  };
  std::vector<std::string> names;
  Status s = write_files(tmp, &names);
  if (!s.ok()) return abandon(s);

  // Sizes and checksums come from the bytes on disk, not from memory: what the manifest vouches
  // for is what a later load will read.
  Json files = Json::array();
  for (const auto& name : names) {
    if (name.empty() || name.find('/') != std::string::npos || name == kManifest) {
      return abandon(internal_error("checkpoint: bad file name '" + name + "'"));
    }
    auto sum = checksum_file(tmp + "/" + name);
    if (!sum.ok()) return abandon(sum.status());
    files.push_back({{"name", name}, {"bytes", sum->bytes}, {"crc32c", sum->crc}});
  }
  Json m;
  m["format"] = kFormat;
  m["version"] = kVersion;
  m["step"] = manifest.step;
  m["model_config"] = Json::parse(manifest.model_config, nullptr, false);
  if (m["model_config"].is_discarded()) return abandon(internal_error("checkpoint: model config is not JSON"));
  m["placement"] = manifest.placement;
  m["client_state"] = Json::parse(manifest.client_state);
  m["files"] = std::move(files);
  s = write_file_durably(tmp, kManifest, m.dump(2) + "\n");
  if (!s.ok()) return abandon(s);

  // A second save of the same step (a resumed run re-saving) gets a name of its own: the
  // published one may be what `latest` names until the pointer moves.
  std::string name = base;
  for (int r = 1; fs::exists(root + "/" + name, ec); ++r) name = base + ".r" + std::to_string(r);
  const std::string dir = root + "/" + name;
  if (::rename(tmp.c_str(), dir.c_str()) != 0) {
    return abandon(io_error("renaming '" + tmp + "' to '" + dir + "': " + std::strerror(errno)));
  }
  s = fsync_path(root, true);
  if (s.ok()) s = write_file_durably(root, kLatest, name + "\n");
  if (!s.ok()) {
    fs::remove_all(dir, ec);
    return s;
  }

  // Prune: the newest `keep` by step (and the one `latest` names) stay.
  std::vector<std::pair<std::int64_t, std::string>> by_step;
  for (const auto& n : published(root)) {
    auto mm = read_checkpoint_manifest(root + "/" + n, false);
    by_step.emplace_back(mm.ok() ? mm->step : -1, n);
  }
  std::sort(by_step.begin(), by_step.end());
  const std::size_t drop = by_step.size() > static_cast<std::size_t>(keep) ? by_step.size() - keep : 0;
  for (std::size_t i = 0; i < drop; ++i) {
    if (by_step[i].second != name) fs::remove_all(root + "/" + by_step[i].second, ec);
  }
  return dir;
}

Result<std::string> resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    return not_found("checkpoint path '" + path + "' is not a directory");
  }
  if (fs::exists(path + "/" + kManifest, ec)) return path;
  const std::string latest = path + "/" + kLatest;
  if (!fs::exists(latest, ec)) {
    return not_found("'" + path + "' is neither a checkpoint (no " + kManifest + ") nor a checkpoint root (no '" +
                     kLatest + "' file); checkpoints in it: " + list_text(published(path)));
  }
  STRATA_ASSIGN_OR_RETURN(std::string text, read_small_file(latest, 4096));
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  if (text.empty() || text.find('/') != std::string::npos || text == "." || text == "..") {
    return data_loss("'" + latest + "' does not name a checkpoint (got '" + text + "')");
  }
  const std::string dir = path + "/" + text;
  if (!fs::exists(dir + "/" + kManifest, ec)) {
    return data_loss("'" + latest + "' names '" + text + "', which is not a complete checkpoint; checkpoints in '" +
                     path + "': " + list_text(published(path)));
  }
  return dir;
}

Result<CheckpointManifest> read_checkpoint_manifest(const std::string& dir, bool verify) {
  const std::string path = dir + "/" + kManifest;
  STRATA_ASSIGN_OR_RETURN(std::string text, read_small_file(path, 64u << 20));
  Json m = Json::parse(text, nullptr, false);
  auto bad = [&](const std::string& why) { return data_loss("checkpoint manifest '" + path + "': " + why); };
  if (m.is_discarded() || !m.is_object()) return bad("not a JSON object");
  if (m.value("format", std::string()) != kFormat) return bad("key 'format' is not \"" + std::string(kFormat) + "\"");
  if (!m.contains("version") || !m["version"].is_number_integer()) return bad("key 'version' missing");
  if (m["version"].get<int>() != kVersion) {
    return bad("version " + std::to_string(m["version"].get<int>()) + " is not supported (this build reads version " +
               std::to_string(kVersion) + ")");
  }
  CheckpointManifest out;
  out.dir = dir;
  if (!m.contains("step") || !m["step"].is_number_integer() || m["step"].get<std::int64_t>() < 0) {
    return bad("key 'step' must be a non-negative integer");
  }
  out.step = m["step"].get<std::int64_t>();
  if (!m.contains("model_config") || !m["model_config"].is_object()) return bad("key 'model_config' must be an object");
  out.model_config = m["model_config"].dump();
  out.placement = m.value("placement", std::string());
  if (!m.contains("client_state") || !m["client_state"].is_object()) return bad("key 'client_state' must be an object");
  out.client_state = m["client_state"].dump();
  if (!m.contains("files") || !m["files"].is_array()) return bad("key 'files' must be an array");
  for (const auto& f : m["files"]) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("bytes") ||
        !f["bytes"].is_number_unsigned() || !f.contains("crc32c") || !f["crc32c"].is_number_unsigned()) {
      return bad("each entry of 'files' needs name (string), bytes and crc32c (unsigned integers)");
    }
    CheckpointFile cf{f["name"].get<std::string>(), f["bytes"].get<std::uint64_t>(), f["crc32c"].get<std::uint32_t>()};
    if (cf.name.empty() || cf.name.find('/') != std::string::npos) return bad("file name '" + cf.name + "' is not plain");
    out.files.push_back(std::move(cf));
  }
  if (!verify) return out;
  for (const auto& f : out.files) {
    const std::string fp = dir + "/" + f.name;
    auto sum = checksum_file(fp);
    if (!sum.ok()) return data_loss("checkpoint file '" + fp + "' is missing: " + sum.status().message());
    if (sum->bytes != f.bytes) {
      return data_loss("checkpoint file '" + fp + "' is " + std::to_string(sum->bytes) + " bytes; the manifest says " +
                       std::to_string(f.bytes));
    }
    if (sum->crc != f.crc32c) {
      char msg[96];
      std::snprintf(msg, sizeof msg, " has crc32c %08x; the manifest says %08x", sum->crc, f.crc32c);
      return data_loss("checkpoint file '" + fp + "'" + msg + " (corrupt)");
    }
  }
  return out;
}

}  // namespace strata
