// strata report: one self-contained HTML page about a training run (strata train --out DIR):
// a header with the run's configuration (DIR/run.json) and charts of DIR/metrics.jsonl drawn as
// inline SVG — loss and validation loss, learning rate, gradient norm, step time per engine,
// bytes per tier and traffic per link. No scripts, stylesheets or fonts are fetched: the file
// opens anywhere, offline. docs/observability.md says what each metric means.
//
// Exit codes: 0 written, 1 a file could not be read (or is malformed: the message names the
// file and line) or written, 2 bad flags.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr FlagSpec kReportFlags[] = {
    {"out", "FILE", "where to write the page (default RUN_DIR/report.html)"},
    {"help", "", "show this help"},
};

std::string report_usage() {
  return "usage: strata report RUN_DIR [--out FILE.html]\n\n"
         "Writes one self-contained HTML page (inline SVG, no external files) about a run saved with\n"
         "strata train --out RUN_DIR: its configuration, and charts of its metrics.jsonl.\n\nflags:\n" +
         format_flags(kReportFlags);
}

// The time breakdown, in stacking order: key in the metrics' "time_s", legend text, colour.
struct Part {
  const char* key;
  const char* label;
  const char* color;
};
constexpr Part kTimeParts[] = {
    {"compute", "compute stream busy", "#4c72b0"},
    {"fetch_stall", "compute waiting for parameters", "#c44e52"},
    {"h2d", "host-to-device copies", "#55a868"},
    {"d2h", "device-to-host copies", "#8172b2"},
    {"nvme_read", "NVMe reads", "#ccb974"},
    {"nvme_write", "NVMe writes", "#937860"},
    {"optimizer", "host optimizer (wall)", "#64b5cd"},
    {"update_stall", "caller waiting for the optimizer", "#da8bc3"},
};
constexpr Part kTiers[] = {
    {"device", "device", "#4c72b0"},
    {"host", "host (pageable)", "#55a868"},
    {"pinned", "host (pinned)", "#8172b2"},
    {"nvme", "NVMe", "#c44e52"},
};
constexpr Part kLinks[] = {
    {"h2d", "host to device", "#4c72b0"},
    {"d2h", "device to host", "#55a868"},
    {"nvme_read", "NVMe read", "#ccb974"},
    {"nvme_write", "NVMe written", "#c44e52"},
    // The rest only when the run moved any (parallel runs, activation offload).
    {"data_parallel", "data-parallel collectives", "#8172b2"},
    {"tensor_parallel", "tensor-parallel collectives", "#937860"},
    {"pipeline", "pipeline sends", "#da8bc3"},
    {"activations", "activation offload", "#64b5cd"},
};
// kLinks before this index are shown in every run that records traffic.
constexpr std::size_t kAlwaysShownLinks = 4;

struct Record {
  std::int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, step_s = 0;
  std::optional<double> val_loss;
  std::vector<double> time, bytes, traffic;  // by kTimeParts, kTiers, kLinks
  double optimizer_cpu = 0;
};

struct Run {
  std::string dir;
  Json config;  // run.json
  std::vector<Record> records;
  bool have_time = false, have_stream_time = false, have_bytes = false, have_traffic = false;
};

// Line number (1-based) of byte `offset` in `text`.
std::size_t line_of(const std::string& text, std::size_t offset) {
  offset = std::min(offset, text.size());
  return 1 + static_cast<std::size_t>(
                 std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(offset), '\n'));
}

Result<std::string> read_file(const std::string& path, std::string_view hint) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return not_found("'" + path + "' not found" + std::string(hint));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("'" + path + "' cannot be opened for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A number under `key` of `obj` (required or not); errors name the file, line and key.
Result<std::optional<double>> number(const Json& obj, const char* key, bool required,
                                     const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) return invalid_argument(where + ": missing key '" + key + "' (expected a number)");
    return std::optional<double>();
  }
  if (!it->is_number()) {
    return invalid_argument(where + ": key '" + key + "' is " + std::string(it->type_name()) +
                            ", expected a number");
  }
  return std::optional<double>(it->get<double>());
}

Status read_group(const Json& obj, const char* key, std::span<const Part> parts, const std::string& where,
                  std::vector<double>* out, bool* seen) {
  out->assign(parts.size(), 0.0);
  auto it = obj.find(key);
  if (it == obj.end()) return ok_status();
  if (!it->is_object()) {
    return invalid_argument(where + ": key '" + key + "' is " + std::string(it->type_name()) +
                            ", expected an object");
  }
  *seen = true;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(auto v, number(*it, parts[i].key, false, where + ": '" + key + "'"));
    (*out)[i] = v.value_or(0.0);
  }
  return ok_status();
}

Result<Run> load_run(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return not_found("run directory '" + dir + "' does not exist or is not a directory");
  }
  Run run;
  run.dir = dir;
  const std::string config_path = (std::filesystem::path(dir) / "run.json").string();
  STRATA_ASSIGN_OR_RETURN(std::string config_text,
                          read_file(config_path, " (strata train --out DIR writes it when the run starts)"));
  try {
    run.config = Json::parse(config_text);
  } catch (const Json::parse_error& e) {
    return invalid_argument(config_path + ":" +
                            std::to_string(line_of(config_text, e.byte > 0 ? e.byte - 1 : 0)) +
                            ": not valid JSON (" + e.what() + ")");
  }
  if (!run.config.is_object()) return invalid_argument(config_path + ": expected a JSON object");

  const std::string metrics_path = (std::filesystem::path(dir) / "metrics.jsonl").string();
  STRATA_ASSIGN_OR_RETURN(std::string text,
                          read_file(metrics_path, " (strata train --out DIR writes one record per step)"));
  std::istringstream lines(text);
  std::string line;
  std::size_t n = 0;
  while (std::getline(lines, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = metrics_path + ":" + std::to_string(n);
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error& e) {
      return invalid_argument(where + ": not a JSON object (" + e.what() + ")");
    }
    if (!j.is_object())
      return invalid_argument(where + ": expected a JSON object, got " + std::string(j.type_name()));
    Record r;
    STRATA_ASSIGN_OR_RETURN(auto step, number(j, "step", true, where));
    if (*step != std::floor(*step) || *step < 1) {
      return invalid_argument(where + ": key 'step' is " + std::to_string(*step) +
                              ", expected a positive integer");
    }
    r.step = static_cast<std::int64_t>(*step);
    if (!run.records.empty() && r.step <= run.records.back().step) {
      return invalid_argument(where + ": step " + std::to_string(r.step) + " follows step " +
                              std::to_string(run.records.back().step) + " (steps must increase)");
    }
    STRATA_ASSIGN_OR_RETURN(auto loss, number(j, "loss", true, where));
    r.loss = *loss;
    STRATA_ASSIGN_OR_RETURN(r.val_loss, number(j, "val_loss", false, where));
    STRATA_ASSIGN_OR_RETURN(auto lr, number(j, "lr", false, where));
    r.lr = lr.value_or(0.0);
    STRATA_ASSIGN_OR_RETURN(auto gn, number(j, "grad_norm", false, where));
    r.grad_norm = gn.value_or(0.0);
    STRATA_ASSIGN_OR_RETURN(auto st, number(j, "step_s", false, where));
    r.step_s = st.value_or(0.0);
    STRATA_RETURN_IF_ERROR(read_group(j, "time_s", kTimeParts, where, &r.time, &run.have_time));
    if (auto it = j.find("time_s"); it != j.end() && it->is_object()) {
      run.have_stream_time = run.have_stream_time || it->contains("compute");
      STRATA_ASSIGN_OR_RETURN(auto cpu, number(*it, "optimizer_cpu", false, where + ": 'time_s'"));
      r.optimizer_cpu = cpu.value_or(0.0);
    }
    STRATA_RETURN_IF_ERROR(read_group(j, "bytes", kTiers, where, &r.bytes, &run.have_bytes));
    STRATA_RETURN_IF_ERROR(read_group(j, "traffic", kLinks, where, &r.traffic, &run.have_traffic));
    run.records.push_back(std::move(r));
  }
  if (run.records.empty()) return invalid_argument(metrics_path + ": no step records (the file is empty)");
  return run;
}

// ---- drawing -------------------------------------------------------------------------------

std::string escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Axis values: "0.5", "3e-04", "12 ms", "1.50 GiB".
enum class Unit { kPlain, kSeconds, kBytes };
std::string tick_text(double v, Unit unit, double step) {
  if (unit == Unit::kBytes) {
    if (v == 0) return "0";
    static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (std::fabs(v) >= 1024 && u < 4) {
      v /= 1024;
      ++u;
    }
    return fmt("%g ", v) + kUnits[u];
  }
  if (unit == Unit::kSeconds) {
    if (v == 0) return "0";
    if (std::fabs(v) < 1e-3 || step < 1e-4) return fmt("%.0f us", v * 1e6);
    if (std::fabs(v) < 1.0 || step < 0.1) return fmt("%.0f ms", v * 1e3);
    return fmt("%.3g s", v);
  }
  if (v == 0) return "0";
  if (std::fabs(v) < 1e-3 || std::fabs(v) >= 1e5) return fmt("%.1e", v);
  return fmt("%.4g", v);
}

// Ticks at 1, 2 or 5 x 10^k covering [lo, hi] with about `want` steps.
std::vector<double> nice_ticks(double lo, double hi, int want) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1.0 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / want;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  for (double t = std::floor(lo / step) * step; t <= hi + step * 0.5; t += step) {
    ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
    if (t >= hi) break;
  }
  return ticks;
}

struct Series {
  std::string name;
  std::string color;
  std::vector<double> x, y;
  bool markers = false;  // sparse series (validation): circles at each point too
};

// One chart: x is the step, lines (or stacked areas) over it, axes with tick labels and titles.
class Chart {
 public:
  static constexpr double kW = 620, kPlotH = 214, kLeft = 78, kRight = 16, kBottom = 46, kLegendRow = 15;

  Chart(std::string id, std::string title, std::string y_title, Unit unit)
      : id_(std::move(id)), title_(std::move(title)), y_title_(std::move(y_title)), unit_(unit) {}

  void line(Series s) { lines_.push_back(std::move(s)); }
  // Areas stack in the order given, from zero.
  void area(Series s) { areas_.push_back(std::move(s)); }
  void zero_based() { zero_ = true; }
  void note(std::string n) { note_ = std::move(n); }

  std::string svg() const {
    double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
    auto extend = [&](const Series& s, const std::vector<double>& ys) {
      for (std::size_t i = 0; i < s.x.size(); ++i) {
        x0 = std::min(x0, s.x[i]);
        x1 = std::max(x1, s.x[i]);
        if (std::isfinite(ys[i])) {
          y0 = std::min(y0, ys[i]);
          y1 = std::max(y1, ys[i]);
        }
      }
    };
    const auto tops = stacked();
    for (const Series& s : lines_) extend(s, s.y);
    for (std::size_t k = 0; k < areas_.size(); ++k) extend(areas_[k], tops[k]);
    if (x0 > x1) x0 = x1 = 1;
    if (y0 > y1) y0 = y1 = 0;
    if (zero_) y0 = std::min(0.0, y0);
    if (x1 == x0) x1 = x0 + 1;
    // Bytes tick at round numbers of their unit (256 MiB, not 268435456).
    double scale = 1;
    if (unit_ == Unit::kBytes)
      while (std::max(std::fabs(y0), std::fabs(y1)) / scale >= 1024 && scale < 1099511627776.0) scale *= 1024;
    std::vector<double> yt = nice_ticks(y0 / scale, y1 / scale, 5);
    for (double& t : yt) t *= scale;
    y0 = std::min(y0, yt.front());
    y1 = std::max(y1, yt.back());
    const std::vector<double> xt = nice_ticks(x0, x1, 8);
    // The legend wraps into rows under the title; the plot starts below it.
    struct Entry {
      const Series* s;
      double x, y;
    };
    std::vector<Entry> legend;
    double lx = kLeft, ly = 24;
    for (const auto* list : {&areas_, &lines_}) {
      for (const Series& s : *list) {
        const double w = 22 + 6.2 * static_cast<double>(s.name.size());
        if (lx > kLeft && lx + w > kW - kRight) {
          lx = kLeft;
          ly += kLegendRow;
        }
        legend.push_back(Entry{&s, lx, ly});
        lx += w;
      }
    }
    const double kTop = ly + kLegendRow + 6, kH = kTop + kPlotH + kBottom;
    const double pw = kW - kLeft - kRight, ph = kPlotH;
    auto X = [&](double v) { return kLeft + (v - x0) / (x1 - x0) * pw; };
    auto Y = [&](double v) { return kTop + (1.0 - (v - y0) / (y1 - y0)) * ph; };

    std::ostringstream o;
    o << "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"" << id_ << "\" class=\"chart\" width=\"" << kW
      << "\" height=\"" << kH << "\" viewBox=\"0 0 " << kW << " " << kH << "\">\n";
    o << "<text class=\"title\" x=\"" << kLeft << "\" y=\"16\">" << escape(title_) << "</text>\n";
    for (const Entry& e : legend) {
      o << "<rect x=\"" << e.x << "\" y=\"" << e.y << "\" width=\"10\" height=\"10\" fill=\"" << e.s->color
        << "\"/>";
      o << "<text class=\"legend\" x=\"" << e.x + 14 << "\" y=\"" << e.y + 9 << "\">" << escape(e.s->name)
        << "</text>\n";
    }
    // Grid and ticks.
    for (double t : yt) {
      if (t < y0 - 1e-12 || t > y1 + 1e-12) continue;
      o << "<line class=\"grid\" x1=\"" << kLeft << "\" x2=\"" << kW - kRight << "\" y1=\"" << Y(t)
        << "\" y2=\"" << Y(t) << "\"/>";
      o << "<text class=\"tick ytick\" x=\"" << kLeft - 6 << "\" y=\"" << Y(t) + 4
        << "\" text-anchor=\"end\">" << escape(tick_text(t, unit_, yt.size() > 1 ? yt[1] - yt[0] : 1.0))
        << "</text>\n";
    }
    for (double t : xt) {
      if (t < x0 - 1e-9 || t > x1 + 1e-9) continue;
      o << "<line class=\"tickmark\" x1=\"" << X(t) << "\" x2=\"" << X(t) << "\" y1=\"" << kTop + ph
        << "\" y2=\"" << kTop + ph + 5 << "\"/>";
      o << "<text class=\"tick xtick\" x=\"" << X(t) << "\" y=\"" << kTop + ph + 18
        << "\" text-anchor=\"middle\">" << fmt("%.0f", t) << "</text>\n";
    }
    // Areas (polygons: the top edge left to right, the bottom edge back).
    for (std::size_t k = 0; k < areas_.size(); ++k) {
      const Series& s = areas_[k];
      o << "<polygon class=\"area\" data-series=\"" << escape(s.name) << "\" fill=\"" << s.color
        << "\" fill-opacity=\"0.85\" points=\"";
      for (std::size_t i = 0; i < s.x.size(); ++i) o << X(s.x[i]) << "," << Y(tops[k][i]) << " ";
      for (std::size_t i = s.x.size(); i-- > 0;)
        o << X(s.x[i]) << "," << Y(k == 0 ? 0.0 : tops[k - 1][i]) << " ";
      o << "\"/>\n";
    }
    for (const Series& s : lines_) {
      o << "<polyline class=\"line\" data-series=\"" << escape(s.name) << "\" fill=\"none\" stroke=\""
        << s.color << "\" stroke-width=\"1.6\" points=\"";
      for (std::size_t i = 0; i < s.x.size(); ++i) o << X(s.x[i]) << "," << Y(s.y[i]) << " ";
      o << "\"/>\n";
      if (s.markers) {
        for (std::size_t i = 0; i < s.x.size(); ++i)
          o << "<circle class=\"marker\" cx=\"" << X(s.x[i]) << "\" cy=\"" << Y(s.y[i])
            << "\" r=\"3\" fill=\"" << s.color << "\"/>";
        o << "\n";
      }
    }
    // Axes and their titles.
    o << "<line class=\"axis\" x1=\"" << kLeft << "\" x2=\"" << kLeft << "\" y1=\"" << kTop << "\" y2=\""
      << kTop + ph << "\"/>";
    o << "<line class=\"axis\" x1=\"" << kLeft << "\" x2=\"" << kW - kRight << "\" y1=\"" << kTop + ph
      << "\" y2=\"" << kTop + ph << "\"/>\n";
    o << "<text class=\"axis-label\" x=\"" << kLeft + pw / 2 << "\" y=\"" << kH - 8
      << "\" text-anchor=\"middle\">step</text>\n";
    o << "<text class=\"axis-label\" transform=\"translate(14," << kTop + ph / 2
      << ") rotate(-90)\" text-anchor=\"middle\">" << escape(y_title_) << "</text>\n";
    o << "</svg>\n";
    if (!note_.empty()) o << "<p class=\"note\">" << escape(note_) << "</p>\n";
    return o.str();
  }

 private:
  std::vector<std::vector<double>> stacked() const {
    std::vector<std::vector<double>> tops;
    for (std::size_t k = 0; k < areas_.size(); ++k) {
      std::vector<double> t = areas_[k].y;
      if (k > 0)
        for (std::size_t i = 0; i < t.size(); ++i) t[i] += tops[k - 1][i];
      tops.push_back(std::move(t));
    }
    return tops;
  }

  std::string id_, title_, y_title_;
  Unit unit_;
  bool zero_ = false;
  std::string note_;
  std::vector<Series> lines_, areas_;
};

std::string json_text(const Json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); }

// Header rows: what the run was.
std::vector<std::pair<std::string, std::string>> config_rows(const Json& c) {
  std::vector<std::pair<std::string, std::string>> rows;
  auto add = [&](const std::string& k, const std::string& v) { rows.emplace_back(k, v); };
  if (c.contains("model") && c["model"].is_object()) {
    const Json& m = c["model"];
    std::string text;
    for (const char* key : {"kind", "n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "dtype"}) {
      if (!m.contains(key)) continue;
      if (!text.empty()) text += ", ";
      text += std::string(key) + " " + json_text(m[key]);
    }
    add("model", text);
  }
  if (c.contains("parameters")) add("parameters", json_text(c["parameters"]));
  if (c.contains("micro_batch")) {
    add("batch", json_text(c["micro_batch"]) + " sequences x " + json_text(c.value("grad_accum", Json(1))) +
                     " micro-batches x " + json_text(c.value("seq_len", Json(0))) + " tokens");
  }
  for (const char* key : {"steps", "lr", "warmup_steps", "grad_clip", "weight_decay", "optimizer", "device",
                          "compute_threads", "data", "tokenizer", "seed"}) {
    if (c.contains(key)) add(key, json_text(c[key]));
  }
  if (c.contains("offload") && c["offload"].is_object()) {
    add("placement", "parameters on " + json_text(c["offload"].value("param", Json("?"))) +
                         ", optimizer state on " + json_text(c["offload"].value("optimizer", Json("?"))));
  }
  if (c.contains("plan") && c["plan"].is_object()) {
    std::string text;
    for (const Part& t : kTiers) {
      if (!c["plan"].contains(t.key) || !c["plan"][t.key].is_number()) continue;
      if (!text.empty()) text += ", ";
      text += std::string(t.label) + " " + format_bytes(c["plan"][t.key].get<std::uint64_t>());
    }
    add("memory plan", text);
  }
  return rows;
}

std::string render(const Run& run) {
  const auto& R = run.records;
  const std::size_t n = R.size();
  std::vector<double> steps(n);
  for (std::size_t i = 0; i < n; ++i) steps[i] = static_cast<double>(R[i].step);
  auto column = [&](auto get) {
    std::vector<double> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = get(R[i]);
    return v;
  };

  // Figures from the metrics, also shown as numbers (the tests compare them with the file).
  double min_loss = R[0].loss, step_sum = 0;
  std::int64_t min_step = R[0].step;
  std::optional<double> last_val;
  std::vector<double> link_total(std::size(kLinks), 0.0), time_total(std::size(kTimeParts), 0.0);
  double cpu_total = 0;
  for (const Record& r : R) {
    if (r.loss < min_loss) {
      min_loss = r.loss;
      min_step = r.step;
    }
    step_sum += r.step_s;
    if (r.val_loss) last_val = r.val_loss;
    for (std::size_t k = 0; k < link_total.size(); ++k) link_total[k] += r.traffic[k];
    for (std::size_t k = 0; k < time_total.size(); ++k) time_total[k] += r.time[k];
    cpu_total += r.optimizer_cpu;
  }

  std::ostringstream o;
  const std::string title = "Strata run report: " + run.dir;
  o << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<title>" << escape(title)
    << "</title>\n<style>\n"
    << "body{font-family:sans-serif;margin:24px;color:#222;max-width:1300px}\n"
    << "h1{font-size:20px}h2{font-size:16px;margin-top:28px}\n"
    << "table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid #ddd;"
       "text-align:left;vertical-align:top}\n"
    << "td.num{text-align:right;font-variant-numeric:tabular-nums}\n"
    << ".charts{display:flex;flex-wrap:wrap;gap:18px}.charts>div{flex:0 0 auto}\n"
    << "svg.chart{background:#fff;border:1px solid #ccc}svg text{font-family:sans-serif}\n"
    << "svg .title{font-size:14px;font-weight:bold}svg .legend{font-size:11px}svg "
       ".tick{font-size:11px;fill:#444}\n"
    << "svg .axis-label{font-size:12px}svg .axis{stroke:#333;stroke-width:1}svg .grid{stroke:#e4e4e4}"
       "svg .tickmark{stroke:#333}\n"
    << ".note{font-size:12px;color:#555;max-width:620px}\n"
    << "</style>\n</head>\n<body>\n";
  o << "<h1>" << escape(title) << "</h1>\n";

  o << "<h2>Configuration</h2>\n<table id=\"config\">\n";
  for (const auto& [k, v] : config_rows(run.config))
    o << "<tr><th>" << escape(k) << "</th><td>" << escape(v) << "</td></tr>\n";
  o << "</table>\n";

  o << "<h2>Summary of metrics.jsonl</h2>\n<table id=\"summary\">\n";
  auto row = [&](const std::string& id, const std::string& k, const std::string& v) {
    o << "<tr id=\"" << id << "\"><th>" << escape(k) << "</th><td class=\"num\">" << escape(v)
      << "</td></tr>\n";
  };
  row("s-steps", "steps recorded",
      std::to_string(n) + " (step " + std::to_string(R.front().step) + " to " +
          std::to_string(R.back().step) + ")");
  row("s-first-loss", "first loss", fmt("%.4f", R.front().loss));
  row("s-last-loss", "last loss", fmt("%.4f", R.back().loss));
  row("s-min-loss", "lowest loss", fmt("%.4f", min_loss) + " at step " + std::to_string(min_step));
  if (last_val) row("s-val-loss", "last validation loss", fmt("%.4f", *last_val));
  row("s-step-time", "mean step time", fmt("%.2f ms", 1e3 * step_sum / static_cast<double>(n)));
  const auto shown = [&](std::size_t link) { return link < kAlwaysShownLinks || link_total[link] > 0; };
  if (run.have_traffic) {
    for (std::size_t k = 0; k < link_total.size(); ++k)
      if (shown(k))
        row(std::string("s-traffic-") + kLinks[k].key, std::string("traffic ") + kLinks[k].label,
            format_bytes(static_cast<std::uint64_t>(std::llround(link_total[k]))));
  }
  if (run.have_time) {
    for (std::size_t k = 0; k < time_total.size(); ++k) {
      if (!run.have_stream_time && k < 4) continue;
      row(std::string("s-time-") + kTimeParts[k].key, kTimeParts[k].label, fmt("%.3f s", time_total[k]));
    }
    row("s-time-optimizer_cpu", "host optimizer thread CPU", fmt("%.3f s", cpu_total));
  }
  o << "</table>\n";

  o << "<h2>Charts</h2>\n<div class=\"charts\">\n";
  {
    Chart c("chart-loss", "Loss", "loss (nats/token)", Unit::kPlain);
    c.line(Series{"train loss", "#4c72b0", steps, column([](const Record& r) { return r.loss; })});
    Series val{"validation loss", "#dd8452", {}, {}, true};
    for (const Record& r : R) {
      if (r.val_loss) {
        val.x.push_back(static_cast<double>(r.step));
        val.y.push_back(*r.val_loss);
      }
    }
    if (!val.x.empty()) c.line(std::move(val));
    o << "<div>" << c.svg() << "</div>\n";
  }
  {
    Chart c("chart-lr", "Learning rate", "learning rate", Unit::kPlain);
    c.zero_based();
    c.line(Series{"lr", "#55a868", steps, column([](const Record& r) { return r.lr; })});
    o << "<div>" << c.svg() << "</div>\n";
  }
  {
    Chart c("chart-grad-norm", "Gradient norm (before clipping)", "global L2 norm", Unit::kPlain);
    c.zero_based();
    c.line(Series{"grad norm", "#c44e52", steps, column([](const Record& r) { return r.grad_norm; })});
    o << "<div>" << c.svg() << "</div>\n";
  }
  if (run.have_time) {
    Chart c("chart-time", "Step time by engine", "seconds", Unit::kSeconds);
    c.zero_based();
    for (std::size_t k = 0; k < std::size(kTimeParts); ++k) {
      if (!run.have_stream_time && k < 4) continue;
      c.area(Series{kTimeParts[k].label, kTimeParts[k].color, steps,
                    column([k](const Record& r) { return r.time[k]; })});
    }
    c.line(Series{"step time (wall)", "#000000", steps, column([](const Record& r) { return r.step_s; })});
    c.note(std::string("Busy and waiting seconds per engine during each step, stacked. The engines run "
                       "concurrently, so a stack above the wall-clock line is overlap at work.") +
           (run.have_stream_time ? "" : " Stream times (compute, copies) were not measured in this run."));
    o << "<div>" << c.svg() << "</div>\n";
  }
  if (run.have_bytes) {
    Chart c("chart-bytes", "Bytes per tier", "bytes", Unit::kBytes);
    c.zero_based();
    for (std::size_t k = 0; k < std::size(kTiers); ++k)
      c.line(Series{kTiers[k].label, kTiers[k].color, steps,
                    column([k](const Record& r) { return r.bytes[k]; })});
    c.note("From the memory plan: everything is allocated when the engine starts, so these stay flat.");
    o << "<div>" << c.svg() << "</div>\n";
  }
  if (run.have_traffic) {
    Chart c("chart-traffic", "Traffic per link, per step", "bytes", Unit::kBytes);
    c.zero_based();
    for (std::size_t k = 0; k < std::size(kLinks); ++k)
      if (shown(k))
        c.line(Series{kLinks[k].label, kLinks[k].color, steps,
                      column([k](const Record& r) { return r.traffic[k]; })});
    o << "<div>" << c.svg() << "</div>\n";
  }
  o << "</div>\n</body>\n</html>\n";
  return o.str();
}

int run_report(std::span<const std::string> argv) {
  auto parsed = Args::parse(argv, kReportFlags);
  if (!parsed.ok()) return usage_error("report", parsed.status().message(), report_usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(report_usage().c_str(), stdout);
    return kExitOk;
  }
  if (args.positionals().size() != 1) {
    return usage_error("report",
                       args.positionals().empty() ? "missing RUN_DIR"
                                                  : "unexpected argument '" + args.positionals()[1] + "'",
                       report_usage());
  }
  const std::string dir = args.positionals()[0];
  auto run = load_run(dir);
  if (!run.ok()) {
    std::fprintf(stderr, "strata report: %s\n", run.status().message().c_str());
    return kExitFailure;
  }
  const std::string out_path =
      args.get("out").value_or((std::filesystem::path(dir) / "report.html").string());
  const std::string html = render(*run);
  std::ofstream out(out_path, std::ios::trunc | std::ios::binary);
  out << html;
  out.flush();
  if (!out) {
    std::fprintf(stderr, "strata report: cannot write '%s'\n", out_path.c_str());
    return kExitFailure;
  }
  std::printf("report: %s (%zu steps)\n", out_path.c_str(), run->records.size());
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(report, "draw a training run (strata train --out DIR) as one self-contained HTML page",
                   run_report);

}  // namespace strata::cli
