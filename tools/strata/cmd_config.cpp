// strata config FILE [flags]: validates a config file and prints the resolved settings (every
// default filled in, `strata` options with where their value came from, "auto" values resolved
// from the flags or Strata's defaults as strata train would), the memory plan of the placement it
// asks for, and the keys it sets that Strata ignores, each once with the reason; or every error in
// the file. strata config --keys prints the key table (docs/config.md).
// Exit 0 valid, 1 invalid or unreadable file, 2 bad usage.
#include <algorithm>
#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "cli.hpp"
#include "model_flags.hpp"
#include "settings.hpp"
#include "strata/config.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr FlagSpec kConfigFlags[] = {
    {"json", "", "print the resolved config as JSON (a valid config file itself)"},
    {"data-parallel-size", "N", "also derive the batch sizes for N data-parallel ranks"},
    {"keys", "", "print the table of DeepSpeed keys and what Strata does with each (Markdown); no FILE"},
    {"help", "", "show this help"},
};

// Everything but --config (the FILE is the config) and the training-only flags.
std::vector<FlagSpec> all_flags() {
  std::vector<FlagSpec> f(std::begin(kConfigFlags), std::end(kConfigFlags));
  for (const FlagSpec& flag : kSettingsFlags) {
    if (flag.name != "config" && flag.name != "seed") f.push_back(flag);
  }
  f.insert(f.end(), std::begin(kModelFlags), std::end(kModelFlags));
  return f;
}

std::string config_usage() {
  return "usage: strata config FILE [flags]\n       strata config --keys\n\n"
         "Validates FILE (DeepSpeed config keys plus Strata's own; see docs/config.md) and prints the\n"
         "resolved settings with every default filled in, the \"auto\" values resolved from the flags\n"
         "(as strata train takes them) or Strata's defaults, the memory plan, and the keys Strata\n"
         "ignores; or every error found. STRATA_<NAME> environment variables override the file's\n"
         "\"strata\" section.\n\nflags:\n" +
         format_flags(all_flags());
}

// Sets `path` ("a.b.c") in `j` when it is there already.
void set_existing(Json* j, const std::string& path, const Json& value) {
  Json* at = j;
  std::size_t pos = 0;
  while (true) {
    const std::size_t dot = path.find('.', pos);
    const std::string key = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (!at->is_object() || !at->contains(key)) return;
    at = &(*at)[key];
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  *at = value;
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
  const auto flags = all_flags();
  auto args = Args::parse(argv, flags);
  if (!args.ok()) return usage_error("config", args.status().message(), config_usage());
  if (args->has("help")) {
    std::fputs(config_usage().c_str(), stdout);
    return kExitOk;
  }
  if (args->has("keys")) {
    if (!args->positionals().empty()) return usage_error("config", "--keys takes no FILE", config_usage());
    std::fputs(config_keys_markdown().c_str(), stdout);
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

  RunSettings rs;
  if (Status s = load_settings(*args, args->positionals()[0], &rs); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    return kExitFailure;
  }
  if (Status s = apply_settings_flags(*args, &rs); !s.ok()) {
    return usage_error("config", s.message(), config_usage());
  }
  const Config& config = *rs.config;
  const std::vector<AutoValue> autos = auto_resolution(rs, *args);
  Json resolved = Json::parse(to_json(config));
  for (const AutoValue& a : autos) {
    std::string path = a.path;
    if (path.rfind("bfloat16.", 0) == 0) path = "bf16." + path.substr(9);
    set_existing(&resolved, path, Json::parse(a.value));
  }
  if (*dp > 0) {
    auto sizes = resolve_batch_sizes(config, *dp);
    if (!sizes.ok()) {
      std::fprintf(stderr, "%s: %s\n", config.source.c_str(), sizes.status().message().c_str());
      return kExitFailure;
    }
    resolved["train_batch_size"] = sizes->train_batch_size;
    resolved["train_micro_batch_size_per_gpu"] = sizes->train_micro_batch_size_per_gpu;
    resolved["gradient_accumulation_steps"] = sizes->gradient_accumulation_steps;
  }
  if (args->has("json")) {
    std::printf("%s\n", resolved.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
    return kExitOk;
  }
  print_human(config, resolved);

  if (!autos.empty()) {
    std::printf("\n\"auto\" values:\n");
    for (const AutoValue& a : autos) std::printf("  %s\n", a.line().c_str());
  }
  const TrainerConfig& tc = rs.trainer;
  std::printf(
      "\ntraining: micro batch %lld x accumulation %lld x sequence %lld, %lld steps, %s lr %g (betas %g, %g; "
      "eps %g; weight decay %g), clip %g, %s\n",
      static_cast<long long>(tc.micro_batch), static_cast<long long>(tc.grad_accum),
      static_cast<long long>(tc.seq_len), static_cast<long long>(rs.steps),
      tc.optimizer.decoupled ? "AdamW" : "Adam (L2)", tc.schedule.lr, tc.optimizer.beta1, tc.optimizer.beta2,
      tc.optimizer.eps, tc.optimizer.weight_decay, tc.grad_clip,
      std::string(to_string(tc.model.dtype)).c_str());
  OffloadSettings placement = rs.offload;
  const bool uses_nvme = placement.params == Tier::kNvme || placement.optimizer == Tier::kNvme;
  if (uses_nvme && placement.nvme_path.empty()) {
    // strata train would make a fresh directory; the plan only needs a name.
    placement.nvme_path = {"$TMPDIR/strata-swap-XXXXXX"};
    placement.io.nvme_path = placement.nvme_path;
  }
  std::printf(
      "placement: parameters on %s, optimizer state on %s (zero_optimization.stage %d; one process)\n",
      std::string(to_string(placement.params)).c_str(), std::string(to_string(placement.optimizer)).c_str(),
      config.zero_optimization.stage);
  auto plan = OffloadPlan::make(tc, placement);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s: %s\n", config.source.c_str(), plan.status().message().c_str());
    return kExitFailure;
  }
  std::printf("%s", plan->to_string().c_str());
  if (config.ignored.empty()) {
    std::printf("\nignored keys: none\n");
  } else {
    std::printf("\nignored keys (accepted, no effect in Strata; --strict refuses them):\n");
    for (const IgnoredKey& k : config.ignored) std::printf("  %s: %s\n", k.path.c_str(), k.reason.c_str());
  }
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(config, "validate a config file and print the resolved settings, plan and ignored keys",
                   run_config);

}  // namespace strata::cli
