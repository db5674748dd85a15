#include "strata/log.hpp"

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cctype>
#include <string>

namespace strata {
namespace {

constexpr std::array<std::string_view, static_cast<size_t>(Subsys::kCount)> kSubsysNames = {
    "CORE", "ALLOC", "DEVICE", "NVME", "OPTIM", "OFFLOAD", "PARTITION", "PARALLEL", "MODEL",
    "RUNTIME", "CLI"};
constexpr std::array<std::string_view, 5> kLevelNames = {"error", "warn", "info", "debug", "trace"};

// The filter is the one piece of process-wide state in the logger: a level and a subsystem mask.
std::atomic<int> g_level{static_cast<int>(LogLevel::kWarn)};
std::atomic<std::uint32_t> g_mask{~0u};
// Set by the first set_log_filter(); until then the first log_enabled() reads the environment.
std::atomic<bool> g_configured{false};

std::string upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

}  // namespace

std::string_view to_string(LogLevel level) { return kLevelNames[static_cast<size_t>(level)]; }
std::string_view to_string(Subsys subsys) { return kSubsysNames[static_cast<size_t>(subsys)]; }

Result<LogLevel> parse_log_level(std::string_view text) {
  std::string t = trim(text);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (size_t i = 0; i < kLevelNames.size(); ++i) {
    if (t == kLevelNames[i]) return static_cast<LogLevel>(i);
  }
  return invalid_argument("log level '" + std::string(text) +
                          "' is not one of error, warn, info, debug, trace");
}

Status set_log_filter(LogLevel level, std::string_view subsystems) {
  std::string spec = trim(subsystems);
  std::uint32_t mask = 0;
  if (spec.empty() || upper(spec) == "ALL") {
    mask = ~0u;
  } else {
    bool exclusions = spec[0] == '^';
    mask = exclusions ? ~0u : 0u;
    size_t pos = 0;
    while (pos <= spec.size()) {
      size_t comma = spec.find(',', pos);
      if (comma == std::string::npos) comma = spec.size();
      std::string item = upper(trim(std::string_view(spec).substr(pos, comma - pos)));
      pos = comma + 1;
      if (item.empty()) continue;
      bool exclude = item[0] == '^';
      if (exclude != exclusions) {
        return invalid_argument("log subsystem list '" + std::string(subsystems) +
                                "' mixes inclusions and ^exclusions");
      }
      if (exclude) item.erase(0, 1);
      size_t found = kSubsysNames.size();
      for (size_t i = 0; i < kSubsysNames.size(); ++i) {
        if (item == kSubsysNames[i]) found = i;
      }
      if (found == kSubsysNames.size()) {
        std::string names;
        for (auto n : kSubsysNames) names += (names.empty() ? "" : ", ") + std::string(n);
        return invalid_argument("log subsystem '" + item + "' is not one of " + names);
      }
      if (exclude) {
        mask &= ~(1u << found);
      } else {
        mask |= 1u << found;
      }
    }
  }
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
  g_mask.store(mask, std::memory_order_relaxed);
  g_configured.store(true, std::memory_order_release);
  return ok_status();
}

Status load_log_filter_from_env() {
  LogLevel level = static_cast<LogLevel>(g_level.load(std::memory_order_relaxed));
  if (const char* env = std::getenv("STRATA_LOG_LEVEL")) {
    auto parsed = parse_log_level(env);
    if (!parsed.ok()) return parsed.status().with_context("STRATA_LOG_LEVEL");
    level = *parsed;
  }
  const char* subsys = std::getenv("STRATA_LOG_SUBSYS");
  Status s = set_log_filter(level, subsys ? subsys : "all");
  return s.with_context("STRATA_LOG_SUBSYS");
}

bool log_enabled(LogLevel level, Subsys subsys) {
  if (!g_configured.load(std::memory_order_acquire)) {
    Status s = load_log_filter_from_env();
    if (!s.ok()) {
      g_configured.store(true, std::memory_order_release);
      std::string line = "[strata CORE warn] ignoring bad log filter: " + s.message() + "\n";
      [[maybe_unused]] auto n = ::write(2, line.data(), line.size());
    }
  }
  return static_cast<int>(level) <= g_level.load(std::memory_order_relaxed) &&
         (g_mask.load(std::memory_order_relaxed) >> static_cast<unsigned>(subsys) & 1u) != 0;
}

LogLine::~LogLine() {
  std::string line = "[strata ";
  line += to_string(subsys_);
  line += ' ';
  line += to_string(level_);
  line += "] ";
  line += out_.str();
  line += '\n';
  [[maybe_unused]] auto n = ::write(2, line.data(), line.size());
}

}  // namespace strata
