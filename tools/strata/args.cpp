#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>

#include "cli.hpp"
#include "strata/options.hpp"

namespace strata::cli {

Result<Args> Args::parse(std::span<const std::string> argv, std::span<const FlagSpec> flags) {
  Args out;
  bool only_positionals = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (only_positionals || a.size() < 2 || a[0] != '-') {
      out.positionals_.push_back(a);
      continue;
    }
    if (a == "--") {
      only_positionals = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) return invalid_argument("unknown flag '" + a + "' (flags are spelled --name)");
    std::string name = a.substr(2);
    std::optional<std::string> inline_value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const FlagSpec* spec = nullptr;
    for (const auto& f : flags) {
      if (f.name == name) spec = &f;
    }
    if (spec == nullptr) return invalid_argument("unknown flag '--" + name + "'");
    if (out.values_.count(name) != 0) {
      return invalid_argument("flag '--" + name + "' is given twice (each flag may appear once)");
    }
    if (spec->value_name.empty()) {
      if (inline_value) return invalid_argument("flag '--" + name + "' takes no value");
      out.values_[name] = "true";
    } else if (inline_value) {
      out.values_[name] = *inline_value;
    } else {
      if (i + 1 >= argv.size()) {
        return invalid_argument("flag '--" + name + "' needs a value (" + std::string(spec->value_name) + ")");
      }
      out.values_[name] = argv[++i];
    }
  }
  return out;
}

std::optional<std::string> Args::get(std::string_view name) const {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

namespace {

std::string flag_text(std::string_view name) { return "flag '--" + std::string(name) + "'"; }

std::string number_text(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace

Result<std::int64_t> Args::get_int(std::string_view name, std::int64_t fallback, std::int64_t lo,
                                   std::int64_t hi) const {
  auto v = get(name);
  if (!v) return fallback;
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  std::int64_t x = 0;
  const char* first = v->data();
  const char* last = first + v->size();
  auto [end, ec] = std::from_chars(first, last, x);
  if (ec == std::errc::result_out_of_range && end == last) {
    return invalid_argument(flag_text(name) + " must be an integer in " + range + ", got " + *v +
                            " (beyond 64 bits)");
  }
  if (ec != std::errc() || end != last) {
    return invalid_argument(flag_text(name) + " expects an integer, got '" + *v + "' (allowed: " + range +
                            ")");
  }
  if (x < lo || x > hi) return invalid_argument(flag_text(name) + " must be in " + range + ", got " + *v);
  return x;
}

Result<double> Args::get_double(std::string_view name, double fallback, double lo, double hi) const {
  auto v = get(name);
  if (!v) return fallback;
  const std::string range = "[" + number_text(lo) + ", " + number_text(hi) + "]";
  char* end = nullptr;
  double x = std::strtod(v->c_str(), &end);
  if (v->empty() || *end != '\0') {
    return invalid_argument(flag_text(name) + " expects a number, got '" + *v + "' (allowed: " + range + ")");
  }
  if (!(x >= lo && x <= hi))
    return invalid_argument(flag_text(name) + " must be in " + range + ", got " + *v);
  return x;
}

Result<std::uint64_t> Args::get_bytes(std::string_view name, std::uint64_t fallback, std::uint64_t lo,
                                      std::uint64_t hi) const {
  auto v = get(name);
  if (!v) return fallback;
  auto b = parse_bytes(*v);
  if (!b.ok()) return b.status().with_context(flag_text(name));
  if (*b < lo) {
    return invalid_argument(flag_text(name) + " must be at least " + format_bytes(lo) + " (" +
                            std::to_string(lo) + " bytes), got '" + *v + "'");
  }
  if (*b > hi) {
    return invalid_argument(flag_text(name) + " must be at most " + format_bytes(hi) + " (" +
                            std::to_string(hi) + " bytes), got '" + *v + "' (" + std::to_string(*b) +
                            " bytes)");
  }
  return *b;
}

std::string format_flags(std::span<const FlagSpec> flags) {
  std::string out;
  for (const auto& f : flags) {
    std::string left = "  --" + std::string(f.name);
    if (!f.value_name.empty()) left += " " + std::string(f.value_name);
    if (left.size() < 28) left.resize(28, ' ');
    else left += "  ";
    out += left + std::string(f.help) + "\n";
  }
  return out;
}

std::vector<CommandEntry>& command_registry() {
  static std::vector<CommandEntry> registry;
  return registry;
}

std::vector<CommandEntry>& bench_registry() {
  static std::vector<CommandEntry> registry;
  return registry;
}

const CommandEntry* find_entry(const std::vector<CommandEntry>& registry, std::string_view name) {
  for (const auto& e : registry) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::string list_entries(std::vector<CommandEntry> registry) {
  std::sort(registry.begin(), registry.end(),
            [](const CommandEntry& a, const CommandEntry& b) { return a.name < b.name; });
  std::string out;
  for (const auto& e : registry) {
    std::string left = "  " + std::string(e.name);
    if (left.size() < 12) left.resize(12, ' ');
    else left += "  ";
    out += left + std::string(e.summary) + "\n";
  }
  return out;
}

int usage_error(std::string_view command, std::string_view message, std::string_view usage) {
  std::fprintf(stderr, "strata%s%s: %.*s\n\n%.*s", command.empty() ? "" : " ",
               std::string(command).c_str(), static_cast<int>(message.size()), message.data(),
               static_cast<int>(usage.size()), usage.data());
  return kExitUsage;
}

}  // namespace strata::cli
