// The strata CLI: subcommand dispatch and a small argument parser shared by every command.
// Exit codes: 0 success, 1 the command ran and failed, 2 bad usage (unknown command or flag,
// malformed value) with the message and the usage on stderr.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.hpp"

namespace strata::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

struct FlagSpec {
  std::string_view name;         // without the leading "--"
  std::string_view value_name;   // empty for a boolean flag
  std::string_view help;
};

// Parses `--name value`, `--name=value`, boolean `--name`, and positionals. Unknown flags,
// missing values and a flag given twice are errors naming the flag.
class Args {
 public:
  static Result<Args> parse(std::span<const std::string> argv, std::span<const FlagSpec> flags);

  bool has(std::string_view name) const { return values_.count(std::string(name)) != 0; }
  std::optional<std::string> get(std::string_view name) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

  // Typed accessors with the flag's allowed range, [lo, hi]; `fallback` when the flag is absent
  // (it is not range-checked). A value that is malformed, does not fit 64 bits or lies outside
  // the range is an error naming the flag, the value as given and the range.
  // A decimal integer ("-3", "42"; no "+", hex, exponent or spaces).
  Result<std::int64_t> get_int(std::string_view name, std::int64_t fallback, std::int64_t lo,
                               std::int64_t hi) const;
  // A finite number (strtod's forms; nan and inf never pass the range).
  Result<double> get_double(std::string_view name, double fallback, double lo, double hi) const;
  // A byte size: 4096, 64KiB, 2GiB (parse_bytes).
  Result<std::uint64_t> get_bytes(std::string_view name, std::uint64_t fallback, std::uint64_t lo,
                                  std::uint64_t hi) const;

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positionals_;
};

std::string format_flags(std::span<const FlagSpec> flags);

// Prints "strata <cmd>: <message>" and the usage to stderr; returns kExitUsage.
int usage_error(std::string_view command, std::string_view message, std::string_view usage);

// Subcommands and benchmarks register themselves from their own source file, so adding one
// touches no shared list:
//
//   STRATA_CLI_COMMAND(train, "train a model", run_train);           // strata train ...
//   STRATA_CLI_BENCH(alloc, "replay a training step's allocations", bench_alloc);  // strata bench alloc
//
// Each function takes the arguments after its own name and returns an exit code.
using CommandFn = int (*)(std::span<const std::string> args);

struct CommandEntry {
  std::string_view name;
  std::string_view summary;
  CommandFn run;
};

std::vector<CommandEntry>& command_registry();
std::vector<CommandEntry>& bench_registry();

// Sorted by name; the first entry named `name` or nullptr.
const CommandEntry* find_entry(const std::vector<CommandEntry>& registry, std::string_view name);
std::string list_entries(std::vector<CommandEntry> registry);

struct Registration {
  Registration(std::vector<CommandEntry>& registry, CommandEntry entry) { registry.push_back(entry); }
};

}  // namespace strata::cli

#define STRATA_CLI_COMMAND(name, summary, fn)                                      \
  static const ::strata::cli::Registration strata_cli_command_##name{             \
      ::strata::cli::command_registry(), ::strata::cli::CommandEntry{#name, summary, fn}}
#define STRATA_CLI_BENCH(name, summary, fn)                                        \
  static const ::strata::cli::Registration strata_cli_bench_##name{               \
      ::strata::cli::bench_registry(), ::strata::cli::CommandEntry{#name, summary, fn}}
