// Private helpers for config.cpp: a JSON reader that validates one object level at a time and
// collects every error instead of stopping at the first.
//
// Each read_* call *declares* its key as known at that level, whether or not the file has it, so
// that Section::finish() can report the keys nobody declared, with a did-you-mean suggestion drawn
// from the declared ones. Sections of an absent object are read too (over no object): that fills in
// the defaults through the same code and registers their keys for "belongs in section X" hints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.hpp"

namespace strata::config_detail {

using Json = nlohmann::ordered_json;

// Optimal-string-alignment distance (insertions, deletions, substitutions, adjacent
// transpositions), ignoring ASCII case.
std::size_t edit_distance(std::string_view a, std::string_view b);

bool equals_ignore_case(std::string_view a, std::string_view b);

// The candidate that `key` most plausibly misspells, or "" when none is close.
std::string closest_match(std::string_view key, std::span<const std::string> candidates);

// An integer, or a float with an integral value (DeepSpeed configs write 5e8 for counts).
bool json_to_integer(const Json& value, std::int64_t* out);

// For type errors: the JSON type and the (abbreviated) value, e.g. `string "3"`, `boolean true`.
std::string describe_type_and_value(const Json& value);
// For value errors: the (abbreviated) value as JSON text, e.g. `"gpu"`, `7`, `1.5`.
std::string describe_value(const Json& value);

// Error lines for one config source. Every line is complete on its own ("<source>: <path>: ...")
// so that grep and editors can use it.
class ErrorList {
 public:
  explicit ErrorList(std::string source) : source_(std::move(source)) {}

  void add(std::string_view path, std::string_view message);
  void add_line(std::string line) { lines_.push_back(std::move(line)); }
  // Keeps a slot in document order for a line that can only be written later.
  std::size_t reserve_line() {
    lines_.emplace_back();
    return lines_.size() - 1;
  }
  void set_line(std::size_t index, std::string line) { lines_[index] = std::move(line); }

  bool empty() const { return lines_.empty(); }
  const std::string& source() const { return source_; }
  // kInvalidArgument with one error per line; OK when there are none.
  Status to_status() const;

 private:
  std::string source_;
  std::vector<std::string> lines_;
};

// State shared by all sections of one parse.
class ReadContext {
 public:
  explicit ReadContext(std::string source) : errors(std::move(source)) {}

  ErrorList errors;

  void register_key(const std::string& section_path, std::string_view key);
  // Every key path registered so far.
  std::vector<std::string> registered_paths() const;
  // An undeclared key: its message is written by resolve_unknown_keys(), once every section has
  // declared its keys.
  void add_unknown_key(std::string section_path, std::string key, std::vector<std::string> declared_here);
  void resolve_unknown_keys();

  // Paths the key table already dealt with (ignored, refused or "auto"): not unknown keys, and an
  // "auto" value is not read (the key keeps its default).
  void mark_handled(std::string path) { handled_.insert(std::move(path)); }
  bool handled(const std::string& path) const { return handled_.count(path) != 0; }
  void mark_auto(std::string path) { auto_.insert(std::move(path)); }
  bool is_auto(const std::string& path) const { return auto_.count(path) != 0; }

 private:
  struct Unknown {
    std::size_t line;
    std::string section_path;
    std::string key;
    std::vector<std::string> declared_here;
  };
  std::map<std::string, std::vector<std::string>, std::less<>> paths_by_leaf_;
  std::set<std::string, std::less<>> handled_;
  std::set<std::string, std::less<>> auto_;
  std::vector<Unknown> unknown_;
};

template <typename E>
struct Choice {
  std::string_view name;
  E value;
};

struct NumberRange {
  double lo = -std::numeric_limits<double>::infinity();
  bool lo_inclusive = true;
  double hi = std::numeric_limits<double>::infinity();
  bool hi_inclusive = true;

  static NumberRange at_least(double lo) { return {lo, true}; }
  static NumberRange above(double lo) { return {lo, false}; }
  bool contains(double x) const;
  std::string describe() const;  // "a number >= 0", "a number in [0, 1)"
};

// One JSON object level, e.g. "zero_optimization.offload_param".
class Section {
 public:
  // `object` may be null: the section is absent and every read leaves its default in place.
  Section(ReadContext* ctx, std::string path, const Json* object);

  const std::string& path() const { return path_; }
  bool present() const { return object_ != nullptr; }
  std::string key_path(std::string_view key) const;
  // Whether the file has `key` here (does not declare it).
  bool has(std::string_view key) const;

  // Declares `key`; returns its value, or null when absent.
  const Json* declare(std::string_view key);

  // The readers declare `key`. A key set to "auto" (accepted by the key table) reads as absent.
  // Booleans are taken as DeepSpeed's loader (pydantic) takes them: true/false, 0/1, and the
  // strings true/false, yes/no, on/off, t/f, y/n, 1/0 in any case. Present and valid: store into *out, return
  // true. Present and invalid: record an error, return false. Absent: return false and leave *out alone.
  bool read_bool(std::string_view key, bool* out);
  bool read_int(std::string_view key, std::int64_t* out, std::int64_t min,
                std::int64_t max = std::numeric_limits<std::int64_t>::max());
  bool read_int(std::string_view key, int* out, int min, int max = std::numeric_limits<int>::max());
  // A count of elements (DeepSpeed's bucket and buffer sizes): like read_int, but a string such as
  // "64MiB" is answered with a reminder that these sizes are not in bytes.
  bool read_count(std::string_view key, std::int64_t* out, std::int64_t min);
  bool read_number(std::string_view key, double* out, NumberRange range = {});
  // An integer, or a string with a unit ("64MiB"), checked against a minimum and a granularity.
  bool read_bytes(std::string_view key, std::uint64_t* out, std::uint64_t min, std::uint64_t multiple);
  bool read_string(std::string_view key, std::string* out);

  template <typename E>
  bool read_choice(std::string_view key, E* out, std::span<const Choice<E>> choices, bool ignore_case) {
    const Json* v = declare(key);
    if (v == nullptr) return false;
    if (v->is_string()) {
      const auto& text = v->get_ref<const std::string&>();
      for (const auto& c : choices) {
        if (text == c.name || (ignore_case && equals_ignore_case(text, c.name))) {
          *out = c.value;
          return true;
        }
      }
    }
    std::string expected = "one of ";
    for (std::size_t i = 0; i < choices.size(); ++i) {
      expected += (i ? ", \"" : "\"") + std::string(choices[i].name) + "\"";
    }
    if (ignore_case) expected += " (any case)";
    expect(key, *v, expected, !v->is_string());
    return false;
  }

  // A nested object. Null or absent: an absent section. Another type: an error, then absent.
  Section child(std::string_view key);

  // Declares `key` and, when present, reports it with `message` (a key that is valid JSON but not
  // allowed in this combination, e.g. betas for Adagrad).
  void reject(std::string_view key, std::string_view message);
  void error(std::string_view key, std::string_view message);
  // "expected <what>, found <value>" at `key`; `type_error` describes the found value with its type.
  void expect(std::string_view key, const Json& found, std::string_view what, bool type_error);

  // Reports every key of the object that no read declared.
  void finish();

  ReadContext* context() const { return ctx_; }

 private:
  ReadContext* ctx_;
  std::string path_;
  const Json* object_;
  std::vector<std::string> declared_;
};

// Parses `text` as JSON. On a syntax error returns the Status "<source>:<line>:<col>: invalid JSON:
// ...". Duplicate keys (which JSON parsers silently resolve) are added to `errors` with their path.
Result<Json> parse_json(std::string_view text, ErrorList* errors);

// The key paths the config reader reads (config.cpp), for the test that keeps the key table
// complete.
std::vector<std::string> declared_key_paths();

}  // namespace strata::config_detail
