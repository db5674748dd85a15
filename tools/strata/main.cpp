// strata: run, tune and inspect Strata training jobs.
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "cli.hpp"
#include <span>
#include "strata/build_config.hpp"

namespace {

std::string usage() {
  std::string u =
      "usage: strata <command> [flags]\n"
      "       strata --help | --version\n\n"
      "commands:\n";
  u += strata::cli::list_entries(strata::cli::command_registry());
  u += "\nRun 'strata <command> --help' for a command's flags.\n";
  return u;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return strata::cli::usage_error("", "no command given", usage());
  const std::string& first = args[0];
  if (first == "--help" || first == "-h" || first == "help") {
    std::fputs(usage().c_str(), stdout);
    return strata::cli::kExitOk;
  }
  if (first == "--version") {
    std::printf("strata %s (cuda %s, nccl %s, mpi %s)\n", STRATA_VERSION_STRING,
                STRATA_HAVE_CUDA ? "on" : "off", STRATA_HAVE_NCCL ? "on" : "off",
                STRATA_HAVE_MPI ? "on" : "off");
    return strata::cli::kExitOk;
  }
  if (first.rfind("-", 0) == 0) return strata::cli::usage_error("", "unknown flag '" + first + "'", usage());
  if (const auto* c = strata::cli::find_entry(strata::cli::command_registry(), first)) {
    return c->run(std::span<const std::string>(args).subspan(1));
  }
  return strata::cli::usage_error("", "unknown command '" + first + "'", usage());
}
