// strata bench <name> [flags]: benchmarks that print one JSON object with their figures, each
// as a ratio against a reference measured in the same run (see docs/performance.md).
#include <cstdio>
#include <span>
#include <string>

#include "cli.hpp"

namespace strata::cli {
namespace {

std::string bench_usage() {
  return "usage: strata bench <benchmark> [flags]\n\nbenchmarks:\n" + list_entries(bench_registry()) +
         "\nRun 'strata bench <benchmark> --help' for its flags.\n";
}

int run_bench(std::span<const std::string> args) {
  if (args.empty()) return usage_error("bench", "no benchmark named", bench_usage());
  if (args[0] == "--help" || args[0] == "-h") {
    std::fputs(bench_usage().c_str(), stdout);
    return kExitOk;
  }
  const CommandEntry* b = find_entry(bench_registry(), args[0]);
  if (b == nullptr) return usage_error("bench", "unknown benchmark '" + args[0] + "'", bench_usage());
  return b->run(args.subspan(1));
}

}  // namespace

STRATA_CLI_COMMAND(bench, "run a benchmark and print its figures as JSON", run_bench);

}  // namespace strata::cli
