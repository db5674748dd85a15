// libFuzzer target: the token-file reader (TokenDataset, its sidecar, WindowSampler) on arbitrary
// files. Input: one option byte, then the bytes of one or two token files and an optional
// sidecar. Option bits: 0-1 the asked width (none, u16, u32), 2 a vocabulary limit of 300, 3 the
// input splits into two shards at a point the next byte picks, 4 the part after the first NUL
// (from the end) is FILE.json for the first file. A dataset that opens must account for every
// byte of its files (header + count x width), read each token once in chunks, refuse reads past
// its end, and return only ids below the limit (2^31 without one); every error must name a file.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "strata/data.hpp"

namespace {

std::string scratch(const char* name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/strata-fuzz-tokens-" +
         std::to_string(::getpid()) + "-" + name;
}

void write(const std::string& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

bool names_a_file(const strata::Status& s, const std::vector<std::string>& paths) {
  for (const std::string& p : paths) {
    if (s.message().find(p) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::uint8_t opt = data[0];
  std::string_view rest(reinterpret_cast<const char*>(data) + 2, size - 2);
  static const std::string a = scratch("a.bin"), b = scratch("b.bin");
  std::remove((a + ".json").c_str());
  if (opt & 16) {
    const std::size_t nul = rest.rfind('\0');
    if (nul != std::string_view::npos) {
      write(a + ".json", rest.substr(nul + 1));
      rest = rest.substr(0, nul);
    }
  }
  std::vector<std::string> paths = {a};
  const std::size_t cut = opt & 8 ? data[1] % (rest.size() + 1) : rest.size();
  write(a, rest.substr(0, cut));
  if (opt & 8) {
    write(b, rest.substr(cut));
    paths.push_back(b);
  }
  strata::TokenDatasetOptions options;
  if ((opt & 3) == 1) options.dtype = strata::TokenDType::kU16;
  if ((opt & 3) == 2) options.dtype = strata::TokenDType::kU32;
  if (opt & 4) options.vocab_limit = 300;
  auto d = strata::TokenDataset::open(paths, options);
  if (!d.ok()) {
    if (!names_a_file(d.status(), paths)) std::abort();
    return 0;
  }
  std::uint64_t total = 0;
  for (const strata::TokenFileInfo& f : d->files()) {
    const std::uint64_t bytes = f.path == a ? cut : rest.size() - cut;
    if (f.header_bytes + f.tokens * strata::token_bytes(f.dtype) != bytes) std::abort();
    total += f.tokens;
  }
  if (total != d->size()) std::abort();
  std::vector<std::int32_t> chunk;
  for (std::uint64_t at = 0; at < d->size();) {
    const std::uint64_t n = std::min<std::uint64_t>(d->size() - at, 1 + (at * 7919 + opt) % 97);
    chunk.resize(n);
    const strata::Status s = d->read(at, chunk);
    if (!s.ok()) {
      if (!names_a_file(s, paths)) std::abort();  // a bad id, named with its file
      return 0;
    }
    for (std::int32_t id : chunk) {
      if (id < 0 || (options.vocab_limit > 0 && id >= options.vocab_limit)) std::abort();
    }
    at += n;
  }
  chunk.resize(1);
  if (d->read(d->size(), chunk).ok()) std::abort();  // past the end
  auto sampler = strata::WindowSampler::create(*d, 3, opt);
  if (sampler.ok()) {
    std::vector<std::int32_t> in, tg;
    for (std::uint64_t w = 0; w < 8; ++w) {
      if (sampler->window_start(w) + 3 >= d->size()) std::abort();  // the last target lies in the data
      const strata::Status s = sampler->batch(w, 2, in, tg);
      if (!s.ok() && !names_a_file(s, paths)) std::abort();
    }
  }
  return 0;
}
