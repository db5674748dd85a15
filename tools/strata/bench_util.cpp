#include "bench_util.hpp"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

namespace strata::cli {

std::uint64_t last_level_cache_bytes() {
  namespace fs = std::filesystem;
  // The highest cache level any CPU reports, and the distinct instances of it (an instance is
  // named by the list of CPUs sharing it).
  int top_level = 0;
  std::set<std::string> seen;
  std::uint64_t total = 0;
  std::error_code ec;
  for (const auto& cpu : fs::directory_iterator("/sys/devices/system/cpu", ec)) {
    const std::string name = cpu.path().filename().string();
    if (name.rfind("cpu", 0) != 0 || name.size() < 4 ||
        name.find_first_not_of("0123456789", 3) != std::string::npos)
      continue;
    std::error_code ec2;
    for (const auto& index : fs::directory_iterator(cpu.path() / "cache", ec2)) {
      std::ifstream level_in(index.path() / "level"), size_in(index.path() / "size"),
          shared_in(index.path() / "shared_cpu_list"), type_in(index.path() / "type");
      int level = 0;
      std::string size_text, shared, type;
      if (!(level_in >> level) || !(size_in >> size_text)) continue;
      type_in >> type;
      if (type == "Instruction") continue;
      std::getline(shared_in, shared);
      std::uint64_t bytes = std::strtoull(size_text.c_str(), nullptr, 10);  // "32768K"
      if (!size_text.empty() && (size_text.back() == 'K' || size_text.back() == 'k')) bytes <<= 10;
      if (!size_text.empty() && size_text.back() == 'M') bytes <<= 20;
      if (level > top_level) {
        top_level = level;
        seen.clear();
        total = 0;
      }
      if (level == top_level && seen.insert(shared).second) total += bytes;
    }
  }
  if (total > 0) return total;
  const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<std::uint64_t>(l3) : 0;
}

}  // namespace strata::cli
