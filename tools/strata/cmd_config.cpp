// strata config FILE [--json] [--data-parallel-size N]: validates a config file and prints the
// resolved settings (every default filled in, `strata` options with where their value came from),
// or every error in the file. Exit 0 valid, 1 invalid or unreadable file, 2 bad usage.
#include <algorithm>
#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "cli.hpp"
#include "strata/config.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::array<FlagSpec, 3> kFlags = {{
    {"json", "", "print the resolved config as JSON (a valid config file itself)"},
    {"data-parallel-size", "N", "also derive the batch sizes for N data-parallel ranks"},
    {"help", "", "show this help"},
}};

std::string config_usage() {
  return "usage: strata config FILE [flags]\n\n"
         "Validates FILE (DeepSpeed config keys plus Strata's own; see docs/config.md) and prints the\n"
         "resolved settings with every default filled in, or every error found. STRATA_<NAME>\n"
         "environment variables override the file's \"strata\" section.\n\nflags:\n" +
         format_flags(kFlags);
}

void flatten(const Json& j, const std::string& path, std::vector<std::pair<std::string, std::string>>* out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& item : j.items())
      flatten(item.value(), path.empty() ? item.key() : path + "." + item.key(), out);
    return;
  }
  out->emplace_back(path, j.dump(-1, ' ', false, Json::error_handler_t::replace));
}

void print_human(const Config& config, const Json& resolved) {
  std::vector<std::pair<std::string, std::string>> rows;
  flatten(resolved, "", &rows);
  // Annotate the strata options: byte sizes in readable units, and the source when not the default.
  for (auto& [key, value] : rows) {
    if (value == "null") {
      value = key.rfind("scheduler", 0) == 0 ? "none" : "(derived from the data-parallel size at launch)";
    }
    if (key.rfind("strata.", 0) != 0) continue;
    const Option id = Options::find(key.substr(7));
    if (id == Option::kCount) continue;
    if (describe(id).kind == OptionKind::kBytes)
      value += " (" + format_bytes(config.strata.get_bytes(id)) + ")";
    if (const std::string& source = config.strata.source(id); source != "default")
      value += "  [" + source + "]";
  }
  std::size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  std::printf("%s: valid\n\n", config.source.c_str());
  for (const auto& [key, value] : rows) {
    std::printf("%-*s  %s\n", static_cast<int>(width), key.c_str(), value.c_str());
  }
}

int run_config(std::span<const std::string> argv) {
  auto args = Args::parse(argv, kFlags);
  if (!args.ok()) return usage_error("config", args.status().message(), config_usage());
  if (args->has("help")) {
    std::fputs(config_usage().c_str(), stdout);
    return kExitOk;
  }
  if (args->positionals().empty()) return usage_error("config", "no config FILE given", config_usage());
  if (args->positionals().size() > 1) {
    return usage_error("config",
                       "expected one config FILE, got " + std::to_string(args->positionals().size()),
                       config_usage());
  }
  auto dp = args->get_int("data-parallel-size", 0, 1, 1 << 20);
  if (!dp.ok()) return usage_error("config", dp.status().message(), config_usage());

  auto config = load_config_file(args->positionals()[0]);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().message().c_str());
    return kExitFailure;
  }
  Json resolved = Json::parse(to_json(*config));
  if (*dp > 0) {
    auto sizes = resolve_batch_sizes(*config, *dp);
    if (!sizes.ok()) {
      std::fprintf(stderr, "%s: %s\n", config->source.c_str(), sizes.status().message().c_str());
      return kExitFailure;
    }
    resolved["train_batch_size"] = sizes->train_batch_size;
    resolved["train_micro_batch_size_per_gpu"] = sizes->train_micro_batch_size_per_gpu;
    resolved["gradient_accumulation_steps"] = sizes->gradient_accumulation_steps;
  }
  if (args->has("json")) {
    std::printf("%s\n", resolved.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
  } else {
    print_human(*config, resolved);
  }
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(config, "validate a config file and print the resolved settings", run_config);

}  // namespace strata::cli
