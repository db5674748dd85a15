// Logging filtered by subsystem and level.
//
//   STRATA_LOG(kWarn, kNvme) << "O_DIRECT refused on " << path << ", falling back to psync";
//
// The filter comes from the tunables STRATA_LOG_LEVEL (error|warn|info|debug|trace, default warn)
// and STRATA_LOG_SUBSYS (comma-separated subsystem names, "all" by default, "^NAME" excludes).
// A disabled statement costs one relaxed atomic load; its stream arguments are not evaluated.
// Lines go to stderr, one write(2) each, so lines from concurrent threads do not interleave.
#pragma once

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string_view>

#include "strata/status.hpp"

namespace strata {

enum class LogLevel : std::uint8_t { kError = 0, kWarn, kInfo, kDebug, kTrace };

enum class Subsys : std::uint8_t {
  kCore = 0, kAlloc, kDevice, kNvme, kOptim, kOffload, kPartition, kParallel, kModel, kRuntime,
  kCli, kCount
};

std::string_view to_string(LogLevel level);
std::string_view to_string(Subsys subsys);

// Parses "warn", "debug", ... Errors name the value and list the accepted ones.
Result<LogLevel> parse_log_level(std::string_view text);

// Sets the filter. `subsystems` is "all", or a comma-separated list of names (ALLOC,NVME,...),
// or a list of exclusions ("^ALLOC,^DEVICE"). Thread-safe; takes effect for later statements.
Status set_log_filter(LogLevel level, std::string_view subsystems);

// Reads STRATA_LOG_LEVEL / STRATA_LOG_SUBSYS. Called once automatically before the first line;
// call again after changing the environment. Bad values are reported and leave the filter as is.
Status load_log_filter_from_env();

bool log_enabled(LogLevel level, Subsys subsys);

class LogLine {
 public:
  LogLine(LogLevel level, Subsys subsys) : level_(level), subsys_(subsys) {}
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  ~LogLine();
  std::ostringstream& stream() { return out_; }

 private:
  LogLevel level_;
  Subsys subsys_;
  std::ostringstream out_;
};

}  // namespace strata

// Use braces around a STRATA_LOG under an `if`: the macro ends in an if/else.
#define STRATA_LOG(level, subsys)                                                       \
    if (!::strata::log_enabled(::strata::LogLevel::level, ::strata::Subsys::subsys)) {  \
    } else                                                                              \
      ::strata::LogLine(::strata::LogLevel::level, ::strata::Subsys::subsys).stream()

// Logs at most once per call site for the life of the process (fallback reasons and the like).
#define STRATA_LOG_ONCE(level, subsys)                                                  \
  if (static std::atomic<bool> strata_logged_once_{false};                              \
      !::strata::log_enabled(::strata::LogLevel::level, ::strata::Subsys::subsys) ||    \
      strata_logged_once_.exchange(true)) {                                             \
  } else                                                                                \
    ::strata::LogLine(::strata::LogLevel::level, ::strata::Subsys::subsys).stream()
