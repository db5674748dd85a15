#include "core/config_reader.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <unordered_set>

#include "strata/config.hpp"
#include "strata/options.hpp"

namespace strata::config_detail {
namespace {

char lower_char(char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); }

std::string abbreviate(std::string text) {
  constexpr std::size_t kMax = 48;
  if (text.size() > kMax) text = text.substr(0, kMax - 3) + "...";
  return text;
}

std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace

bool json_to_integer(const Json& v, std::int64_t* out) {
  if (v.is_number_unsigned()) {
    auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return false;
    *out = static_cast<std::int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    *out = v.get<std::int64_t>();
    return true;
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) >= 9.2e18) return false;
    *out = static_cast<std::int64_t>(d);
    return true;
  }
  return false;
}

namespace {

// The range to state for `found`: a bound that is only the type's limit is mentioned only when
// `found` exceeds it.
std::string int_range(std::int64_t min, std::int64_t max, std::int64_t found) {
  const bool type_limit =
      max == std::numeric_limits<std::int64_t>::max() || max == std::numeric_limits<int>::max();
  if (type_limit && found < min) {
    return "an integer >= " + std::to_string(min);
  }
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

std::string join_path(const std::string& section, std::string_view key) {
  return section.empty() ? std::string(key) : section + "." + std::string(key);
}

}  // namespace

bool equals_ignore_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (lower_char(a[i]) != lower_char(b[i])) return false;
  }
  return true;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  const std::size_t n = a.size(), m = b.size();
  // Three rows suffice for the transposition lookback.
  std::vector<std::size_t> prev2(m + 1), prev(m + 1), cur(m + 1);
  for (std::size_t j = 0; j <= m; ++j) prev[j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= m; ++j) {
      const bool same = lower_char(a[i - 1]) == lower_char(b[j - 1]);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && lower_char(a[i - 1]) == lower_char(b[j - 2]) &&
          lower_char(a[i - 2]) == lower_char(b[j - 1])) {
        cur[j] = std::min(cur[j], prev2[j - 2] + 1);
      }
    }
    std::swap(prev2, prev);
    std::swap(prev, cur);
  }
  return prev[m];
}

std::string closest_match(std::string_view key, std::span<const std::string> candidates) {
  // A typo changes a few characters, proportionally more in long keys; a key that is the start of
  // a candidate ("stage3_prefetch_bucket") is a truncation and counts as close too.
  const std::size_t limit = std::max<std::size_t>(2, key.size() / 3);
  std::string best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const auto& c : candidates) {
    std::size_t d = edit_distance(key, c);
    const bool truncated =
        key.size() >= 4 && c.size() > key.size() && equals_ignore_case(c.substr(0, key.size()), key);
    if ((d <= limit || truncated) && d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  return best;
}

std::string describe_value(const Json& value) {
  return abbreviate(value.dump(-1, ' ', false, Json::error_handler_t::replace));
}

std::string describe_type_and_value(const Json& value) {
  std::string text;
  switch (value.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      text = "boolean ";
      break;
    case Json::value_t::string:
      text = "string ";
      break;
    case Json::value_t::array:
      text = "array ";
      break;
    case Json::value_t::object:
      text = "object ";
      break;
    default:
      text = "number ";
      break;
  }
  text += describe_value(value);
  if (value.is_string() && value.get_ref<const std::string&>() == "auto") {
    text +=
        " (\"auto\" is accepted only where the Hugging Face integration fills a value in; see "
        "docs/config.md)";
  }
  return text;
}

void ErrorList::add(std::string_view path, std::string_view message) {
  std::string line = source_ + ": ";
  if (!path.empty()) line += std::string(path) + ": ";
  line += message;
  lines_.push_back(std::move(line));
}

Status ErrorList::to_status() const {
  if (lines_.empty()) return ok_status();
  std::string message;
  for (const auto& line : lines_) {
    if (!message.empty()) message += '\n';
    message += line;
  }
  return invalid_argument(std::move(message));
}

void ReadContext::register_key(const std::string& section_path, std::string_view key) {
  auto& paths = paths_by_leaf_[std::string(key)];
  std::string full = join_path(section_path, key);
  if (std::find(paths.begin(), paths.end(), full) == paths.end()) paths.push_back(std::move(full));
}

std::vector<std::string> ReadContext::registered_paths() const {
  std::vector<std::string> out;
  for (const auto& [leaf, paths] : paths_by_leaf_) out.insert(out.end(), paths.begin(), paths.end());
  return out;
}

void ReadContext::add_unknown_key(std::string section_path, std::string key,
                                  std::vector<std::string> declared_here) {
  unknown_.push_back(
      {errors.reserve_line(), std::move(section_path), std::move(key), std::move(declared_here)});
}

void ReadContext::resolve_unknown_keys() {
  for (const auto& u : unknown_) {
    const std::string full = join_path(u.section_path, u.key);
    std::string line = errors.source() + ": " + full + ": ";
    // Candidates: the keys read at this level and the key table's keys of this level.
    std::vector<std::string> candidates = u.declared_here;
    for (const ConfigKey& k : config_keys()) {
      const std::string_view path = k.path;
      if (path.find('=') != std::string_view::npos) continue;
      const std::size_t dot = path.rfind('.');
      const std::string_view parent =
          dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
      const std::string leaf(dot == std::string_view::npos ? path : path.substr(dot + 1));
      if (parent == u.section_path &&
          std::find(candidates.begin(), candidates.end(), leaf) == candidates.end())
        candidates.push_back(leaf);
    }
    if (std::string match = closest_match(u.key, candidates); !match.empty()) {
      line += "unknown key; did you mean '" + match + "'?";
    } else if (auto elsewhere = paths_by_leaf_.find(u.key); elsewhere != paths_by_leaf_.end()) {
      line += "unknown key here; did you mean '" + elsewhere->second.front() + "'?";
    } else {
      line += "unknown key";
      if (!u.declared_here.empty()) {
        line += " (expected one of: ";
        for (std::size_t i = 0; i < u.declared_here.size(); ++i) {
          line += (i ? ", " : "") + u.declared_here[i];
        }
        line += ")";
      }
    }
    errors.set_line(u.line, std::move(line));
  }
  unknown_.clear();
}

bool NumberRange::contains(double x) const {
  if (lo_inclusive ? x < lo : x <= lo) return false;
  if (hi_inclusive ? x > hi : x >= hi) return false;
  return true;
}

std::string NumberRange::describe() const {
  const bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
  if (!has_lo && !has_hi) return "a number";
  if (!has_hi) return std::string("a number ") + (lo_inclusive ? ">= " : "> ") + format_number(lo);
  if (!has_lo) return std::string("a number ") + (hi_inclusive ? "<= " : "< ") + format_number(hi);
  return std::string("a number in ") + (lo_inclusive ? "[" : "(") + format_number(lo) + ", " +
         format_number(hi) + (hi_inclusive ? "]" : ")");
}

Section::Section(ReadContext* ctx, std::string path, const Json* object)
    : ctx_(ctx), path_(std::move(path)), object_(object) {}

std::string Section::key_path(std::string_view key) const { return join_path(path_, key); }

bool Section::has(std::string_view key) const {
  return object_ != nullptr && object_->find(std::string(key)) != object_->end();
}

const Json* Section::declare(std::string_view key) {
  if (std::find(declared_.begin(), declared_.end(), key) == declared_.end()) declared_.emplace_back(key);
  ctx_->register_key(path_, key);
  if (object_ == nullptr || ctx_->is_auto(key_path(key))) return nullptr;
  auto it = object_->find(std::string(key));
  return it == object_->end() ? nullptr : &*it;
}

void Section::error(std::string_view key, std::string_view message) {
  ctx_->errors.add(key_path(key), message);
}

void Section::expect(std::string_view key, const Json& found, std::string_view what, bool type_error) {
  error(key, "expected " + std::string(what) + ", found " +
                 (type_error ? describe_type_and_value(found) : describe_value(found)));
}

bool Section::read_bool(std::string_view key, bool* out) {
  const Json* v = declare(key);
  if (v == nullptr) return false;
  if (v->is_boolean()) {
    *out = v->get<bool>();
    return true;
  }
  if (std::int64_t x = -1; json_to_integer(*v, &x) && (x == 0 || x == 1)) {
    *out = x == 1;
    return true;
  }
  if (v->is_string()) {
    const auto& text = v->get_ref<const std::string&>();
    for (std::string_view t : {"true", "yes", "on", "t", "y", "1"}) {
      if (equals_ignore_case(text, t)) {
        *out = true;
        return true;
      }
    }
    for (std::string_view f : {"false", "no", "off", "f", "n", "0"}) {
      if (equals_ignore_case(text, f)) {
        *out = false;
        return true;
      }
    }
  }
  expect(key, *v, "true or false", true);
  return false;
}

bool Section::read_int(std::string_view key, std::int64_t* out, std::int64_t min, std::int64_t max) {
  const Json* v = declare(key);
  if (v == nullptr) return false;
  std::int64_t x = 0;
  if (!json_to_integer(*v, &x)) {
    expect(key, *v, "an integer", !v->is_number());
    return false;
  }
  if (x < min || x > max) {
    expect(key, *v, int_range(min, max, x), false);
    return false;
  }
  *out = x;
  return true;
}

bool Section::read_int(std::string_view key, int* out, int min, int max) {
  std::int64_t x = 0;
  if (!read_int(key, &x, min, max)) return false;
  *out = static_cast<int>(x);
  return true;
}

bool Section::read_count(std::string_view key, std::int64_t* out, std::int64_t min) {
  if (const Json* v = declare(key); v != nullptr && v->is_string()) {
    expect(key, *v, "an integer count of elements (this size counts elements, not bytes)", true);
    return false;
  }
  return read_int(key, out, min);
}

bool Section::read_number(std::string_view key, double* out, NumberRange range) {
  const Json* v = declare(key);
  if (v == nullptr) return false;
  if (!v->is_number()) {
    expect(key, *v, range.describe(), true);
    return false;
  }
  double x = v->get<double>();
  if (!range.contains(x)) {
    expect(key, *v, range.describe(), false);
    return false;
  }
  *out = x;
  return true;
}

bool Section::read_bytes(std::string_view key, std::uint64_t* out, std::uint64_t min,
                         std::uint64_t multiple) {
  const Json* v = declare(key);
  if (v == nullptr) return false;
  constexpr std::string_view kWhat = "a byte size (an integer, or a string such as \"1MiB\")";
  std::uint64_t bytes = 0;
  std::int64_t x = 0;
  if (v->is_string()) {
    auto parsed = parse_bytes(v->get_ref<const std::string&>());
    if (!parsed.ok()) {
      expect(key, *v, kWhat, false);
      return false;
    }
    bytes = *parsed;
  } else if (json_to_integer(*v, &x) && x >= 0) {
    bytes = static_cast<std::uint64_t>(x);
  } else {
    expect(key, *v, kWhat, !v->is_number());
    return false;
  }
  if (bytes < min) {
    expect(key, *v, "at least " + std::to_string(min) + " bytes", false);
    return false;
  }
  if (multiple > 1 && bytes % multiple != 0) {
    expect(key, *v, "a multiple of " + std::to_string(multiple) + " bytes", false);
    return false;
  }
  *out = bytes;
  return true;
}

bool Section::read_string(std::string_view key, std::string* out) {
  const Json* v = declare(key);
  if (v == nullptr) return false;
  if (!v->is_string()) {
    expect(key, *v, "a string", true);
    return false;
  }
  *out = v->get<std::string>();
  return true;
}

Section Section::child(std::string_view key) {
  const Json* v = declare(key);
  if (v != nullptr && !v->is_null() && !v->is_object()) {
    expect(key, *v, "an object", true);
    v = nullptr;
  }
  if (v != nullptr && v->is_null()) v = nullptr;
  return Section(ctx_, key_path(key), v);
}

void Section::reject(std::string_view key, std::string_view message) {
  if (declare(key) != nullptr) error(key, message);
}

void Section::finish() {
  if (object_ == nullptr) return;
  for (const auto& item : object_->items()) {
    if (std::find(declared_.begin(), declared_.end(), item.key()) == declared_.end() &&
        !ctx_->handled(key_path(item.key()))) {
      ctx_->add_unknown_key(path_, item.key(), declared_);
    }
  }
}

namespace {

// "<source>:<line>:<column>: invalid JSON: <what>" for the character at `offset` (both from 1).
Status invalid_json(std::string_view text, std::size_t offset, const std::string& what,
                    const std::string& source) {
  offset = std::min(offset, text.size());
  std::size_t line = 1, line_start = 0;
  for (std::size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return invalid_argument(source + ":" + std::to_string(line) + ":" +
                          std::to_string(offset - line_start + 1) + ": invalid JSON: " + what);
}

}  // namespace

Result<Json> parse_json(std::string_view text, ErrorList* errors) {
  // Duplicate keys: the parser keeps one of them silently, so watch the key events and report the
  // others with their path.
  struct Frame {
    bool array = false;
    std::size_t index = 0;
    std::string key;
    std::unordered_set<std::string> seen;
  };
  std::vector<Frame> stack;
  auto path_to_top = [&stack]() {
    std::string path;
    for (std::size_t i = 0; i + 1 < stack.size(); ++i) {
      if (stack[i].array) {
        path += "[" + std::to_string(stack[i].index) + "]";
      } else {
        path += (path.empty() ? "" : ".") + stack[i].key;
      }
    }
    return path;
  };
  auto callback = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        stack.push_back(Frame{});
        break;
      case Json::parse_event_t::array_start:
        stack.emplace_back();
        stack.back().array = true;
        break;
      case Json::parse_event_t::key: {
        Frame& top = stack.back();
        top.key = parsed.get<std::string>();
        if (!top.seen.insert(top.key).second) {
          std::string parent = path_to_top();
          errors->add(parent.empty() ? top.key : parent + "." + top.key,
                      "duplicate key (JSON keeps only one of them; remove the others)");
        }
        break;
      }
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        stack.pop_back();
        if (!stack.empty() && stack.back().array) ++stack.back().index;
        break;
      case Json::parse_event_t::value:
        if (!stack.empty() && stack.back().array) ++stack.back().index;
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const Json::parse_error& e) {
    // e.byte is the 1-based offset of the last character read: the one that did not fit.
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 3, column 5: syntax error ..." -> the
    // part after the position, which we give in compiler style instead.
    if (auto pos = what.find(": ", what.find("parse error")); pos != std::string::npos)
      what = what.substr(pos + 2);
    return invalid_json(text, e.byte == 0 ? 0 : e.byte - 1, what, errors->source());
  } catch (const Json::exception& e) {
    // A number too large for a double: "[json.exception.out_of_range.406] number overflow parsing
    // '1e400'". The exception carries no offset, so locate the quoted literal.
    std::string what = e.what();
    if (auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
    std::size_t offset = text.size();
    if (auto open = what.find('\''), close = what.rfind('\''); open != std::string::npos && close > open) {
      offset = std::min(offset, text.find(what.substr(open + 1, close - open - 1)));
    }
    return invalid_json(text, offset, what, errors->source());
  }
}

}  // namespace strata::config_detail
