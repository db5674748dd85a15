// Seeing what happened: strata train's per-step metrics (time per engine, bytes per tier,
// traffic per link), its --trace (Chrome/Perfetto JSON), and strata report's HTML page, each
// from real short training runs; and the report's errors for a bad run directory.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "harness/harness.hpp"
#include "strata/model.hpp"
#include "strata/options.hpp"

namespace strata::testing {
namespace {

using Json = nlohmann::json;

const std::string kTiny = "--layers 2 --width 32 --heads 2 --seq-len 32 --batch 2 --threads 1 --quiet ";

// Every module's parameters on NVMe (none small enough to stay resident), optimizer on the host:
// every link carries traffic.
std::string three_tiers(const TempDir& dir) {
  const std::string config =
      write_file(dir / "zero.json", R"({"zero_optimization": {"stage3_param_persistence_threshold": 0}})");
  return "--config " + config + " --offload-param nvme --offload-optimizer cpu ";
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<Json> read_jsonl(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<Json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(Json::parse(line));
  return out;
}

// ---- metrics -----------------------------------------------------------------------------

TEST(CliMetrics, EachStepCarriesTimePerEngineBytesPerTierAndTrafficPerLink) {
  TempDir dir;
  const auto run = dir / "run";
  auto r = run_cli("train " + kTiny + three_tiers(dir) + "--steps 3 --grad-accum 2 --val-every 0 --out " +
                   run.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Json config = Json::parse(read_text(run / "run.json"));
  const auto lines = read_jsonl(run / "metrics.jsonl");  // the default with --out
  ASSERT_EQ(lines.size(), 3u);
  auto model = model_config_from_json(config["model"].dump(), "run.json");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  auto layout = describe_model(*model);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const std::uint64_t grad_bytes = layout->grad_bytes;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const Json& m = lines[i];
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(m["step"], static_cast<int>(i) + 1);
    for (const char* key : {"loss", "lr", "grad_norm", "step_s"}) EXPECT_TRUE(m[key].is_number()) << key;
    // Bytes per tier are the plan's.
    for (const char* tier : {"device", "host", "pinned", "nvme"})
      EXPECT_EQ(m["bytes"][tier], config["plan"][tier]) << tier;
    EXPECT_GT(m["bytes"]["nvme"].get<std::uint64_t>(), 0u);
    // Per micro-batch every fp32 gradient leaves the device once, and so do the per-token
    // losses (batch 2 x 32 tokens, fp32).
    EXPECT_EQ(m["traffic"]["d2h"].get<std::uint64_t>(), 2 * (grad_bytes + 2 * 32 * 4));
    // Every fetched byte came from NVMe and crossed to the device; the second micro-batch also
    // restores the gradients accumulated so far.
    EXPECT_GE(m["traffic"]["h2d"].get<std::uint64_t>(),
              m["traffic"]["nvme_read"].get<std::uint64_t>() + grad_bytes);
    EXPECT_GT(m["traffic"]["nvme_read"].get<std::uint64_t>(), 0u);
    const Json& t = m["time_s"];
    for (const char* key : {"compute", "fetch_stall", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer",
                            "optimizer_cpu", "update_stall"}) {
      ASSERT_TRUE(t.contains(key)) << key;
      EXPECT_GE(t[key].get<double>(), 0.0) << key;
    }
    EXPECT_GT(t["compute"].get<double>(), 0.0);
    EXPECT_GT(t["h2d"].get<double>(), 0.0);
    EXPECT_GT(t["d2h"].get<double>(), 0.0);
    EXPECT_GT(t["nvme_read"].get<double>(), 0.0);
    // The compute stream's busy time is part of the step's wall time.
    EXPECT_LT(t["compute"].get<double>(), m["step_s"].get<double>());
    // The early fetch across steps: nothing before the first step returns (it records the
    // trace); from the second step its first accesses find copies fetched when the previous
    // step returned, a subset of the prefetch hits.
    const auto early = m["early_fetch_hits"].get<std::uint64_t>();
    if (i == 0) {
      EXPECT_EQ(early, 0u);
    } else {
      EXPECT_GT(early, 0u);
      EXPECT_LE(early, m["prefetch_hits"].get<std::uint64_t>());
    }
  }
  // Steps after the first repeat the same schedule: the same bytes on the links the step drives.
  // (The host optimizer's writes land in whichever step they finish in: they overlap the next.)
  for (const char* link : {"h2d", "d2h", "nvme_read"})
    EXPECT_EQ(lines[1]["traffic"][link], lines[2]["traffic"][link]);
  // The per-step traffic adds up to no more than the run's totals (which also count
  // initialisation, validation and the final save).
  std::uint64_t nvme_read = 0, nvme_write = 0;
  for (const Json& m : lines) {
    nvme_read += m["traffic"]["nvme_read"].get<std::uint64_t>();
    nvme_write += m["traffic"]["nvme_write"].get<std::uint64_t>();
  }
  EXPECT_LE(nvme_read, config["summary"]["bytes_nvme_read"].get<std::uint64_t>());
  EXPECT_GT(nvme_write, 0u);
  EXPECT_LE(nvme_write, config["summary"]["bytes_nvme_written"].get<std::uint64_t>());
}

// ---- trace -------------------------------------------------------------------------------

struct Span {
  std::string name;
  std::int64_t begin_ns, end_ns;
  Json args;
};

TEST(CliTrace, TwoStepsGiveWellFormedTracksWithAForwardSpanPerModulePerMicroBatch) {
  TempDir dir;
  const auto trace = dir / "trace.json";
  const int steps = 2, accum = 2;
  auto r = run_cli("train " + kTiny + three_tiers(dir) + "--steps 2 --grad-accum 2 --val-every 0 --trace " +
                   trace.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("trace: " + trace.string()), std::string::npos) << r.output;
  const Json j = Json::parse(read_text(trace));  // throws (fails) unless valid JSON
  ASSERT_TRUE(j["traceEvents"].is_array());
  std::map<int, std::string> track;
  std::map<int, std::vector<Span>> spans;
  for (const Json& e : j["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("tid")) << e.dump();
    if (e["ph"] == "M" && e["name"] == "thread_name") track[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    const double ts = e["ts"], dur = e["dur"];
    ASSERT_GE(dur, 0.0) << e.dump();
    spans[e["tid"].get<int>()].push_back(
        Span{e["name"], std::llround(ts * 1e3), std::llround((ts + dur) * 1e3), e["args"]});
  }
  std::map<std::string, int> tid_of;
  for (const auto& [tid, name] : track) tid_of[name] = tid;
  for (const char* name :
       {"engine caller (host)", "stream train (compute)", "stream offload.h2d", "stream offload.grads",
        "copy engine host->device", "copy engine device->host", "host optimizer thread",
        "NVMe I/O: parameter reads", "NVMe I/O: parameter writes"}) {
    ASSERT_TRUE(tid_of.count(name)) << "no track '" << name << "'";
    EXPECT_FALSE(spans[tid_of[name]].empty()) << "no spans on '" << name << "'";
  }
  // Spans of one track nest or follow each other (by start time, as the file orders them).
  for (const auto& [tid, list] : spans) {
    std::vector<const Span*> open;
    for (const Span& s : list) {
      while (!open.empty() && open.back()->end_ns <= s.begin_ns) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.end_ns, open.back()->end_ns)
            << track[tid] << ": '" << s.name << "' overlaps '" << open.back()->name << "' without nesting";
      }
      open.push_back(&s);
    }
  }
  // One forward and one backward span per module per micro-batch, on the compute stream.
  std::map<std::string, int> forward, backward;
  for (const Span& s : spans[tid_of["stream train (compute)"]]) {
    if (s.name.rfind("forward ", 0) == 0 && s.name.rfind("forward (", 0) != 0) ++forward[s.args["module"]];
    if (s.name.rfind("backward ", 0) == 0) ++backward[s.args["module"]];
  }
  // 2 layers: the embedding, each block's modules and the head; more than four in any case.
  ASSERT_GE(forward.size(), 4u);
  EXPECT_EQ(forward.size(), backward.size());
  for (const auto& [module, n] : forward) {
    EXPECT_EQ(n, steps * accum) << module;
    EXPECT_EQ(backward[module], steps * accum) << module;
  }
  // Every module with parameters gets one Adam update per step on the optimizer thread.
  std::map<std::string, int> adam;
  for (const Span& s : spans[tid_of["host optimizer thread"]])
    if (s.name.rfind("adam ", 0) == 0) ++adam[s.args["module"]];
  EXPECT_EQ(adam.size(), forward.size());
  for (const auto& [module, n] : adam) EXPECT_EQ(n, steps) << module;
  // Fetches and copies carry their bytes; each copy lies inside its fetch on the h2d stream.
  for (const Span& s : spans[tid_of["stream offload.h2d"]])
    EXPECT_GT(s.args["bytes"].get<std::uint64_t>(), 0u);
  for (const Span& s : spans[tid_of["NVMe I/O: parameter reads"]]) EXPECT_EQ(s.name.rfind("read ", 0), 0u);
  // The caller's step spans: exactly one per step.
  int step_spans = 0;
  for (const Span& s : spans[tid_of["engine caller (host)"]]) step_spans += s.name == "step" ? 1 : 0;
  EXPECT_EQ(step_spans, steps);
}

TEST(CliTrace, AnUnwritableTraceFileIsRefusedBeforeTraining) {
  auto r = run_cli("train " + kTiny + "--steps 1 --trace /nonexistent-dir/t.json");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("/nonexistent-dir/t.json"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1/1"), std::string::npos) << r.output;
}

// ---- report ------------------------------------------------------------------------------

// A minimal XML reader: enough to say the page is well-formed (every element closed, in order)
// and to hand back the elements with their attributes and text.
struct Element {
  std::string tag;
  std::map<std::string, std::string> attrs;
  std::string text;
};

std::vector<Element> parse_xml(const std::string& doc, std::string* error) {
  std::vector<Element> all;
  std::vector<std::size_t> stack;
  std::size_t i = 0;
  while (i < doc.size()) {
    if (doc[i] != '<') {
      const std::size_t next = doc.find('<', i);
      if (!stack.empty()) all[stack.back()].text += doc.substr(i, next - i);
      i = next == std::string::npos ? doc.size() : next;
      continue;
    }
    if (doc.compare(i, 2, "<!") == 0) {
      i = doc.find('>', i) + 1;
      continue;
    }
    const std::size_t end = doc.find('>', i);
    if (end == std::string::npos) {
      *error = "unterminated tag at " + std::to_string(i);
      return all;
    }
    std::string body = doc.substr(i + 1, end - i - 1);
    i = end + 1;
    if (body[0] == '/') {
      const std::string tag = body.substr(1);
      if (stack.empty() || all[stack.back()].tag != tag) {
        *error = "</" + tag + "> closes <" +
                 (stack.empty() ? std::string("nothing") : all[stack.back()].tag) + ">";
        return all;
      }
      stack.pop_back();
      continue;
    }
    const bool self_closing = body.back() == '/';
    if (self_closing) body.pop_back();
    Element e;
    std::size_t k = body.find_first_of(" \n");
    e.tag = body.substr(0, k);
    static const std::regex attr(R"re(([\w:-]+)="([^"]*)")re");
    const std::string rest = k == std::string::npos ? "" : body.substr(k);
    for (std::sregex_iterator it(rest.begin(), rest.end(), attr), stop; it != stop; ++it)
      e.attrs[(*it)[1]] = (*it)[2];
    all.push_back(e);
    if (!self_closing) stack.push_back(all.size() - 1);
  }
  if (!stack.empty()) *error = "<" + all[stack.back()].tag + "> never closed";
  return all;
}

std::vector<std::pair<double, double>> points_of(const std::string& text) {
  std::vector<std::pair<double, double>> pts;
  std::istringstream in(text);
  std::string p;
  while (in >> p) {
    const auto comma = p.find(',');
    pts.emplace_back(std::stod(p.substr(0, comma)), std::stod(p.substr(comma + 1)));
  }
  return pts;
}

std::string fixed4(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", v);
  return buf;
}

TEST(CliReport, DrawsARealRunAndTheNumbersMatchItsMetrics) {
  TempDir dir;
  const auto run = dir / "run";
  const int steps = 6;
  auto r = run_cli("train " + kTiny + three_tiers(dir) + "--steps 6 --val-every 2 --out " + run.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto out = dir / "page.html";
  auto rep = run_cli("report " + run.string() + " --out " + out.string());
  ASSERT_EQ(rep.exit_code, 0) << rep.output;
  EXPECT_NE(rep.output.find("6 steps"), std::string::npos) << rep.output;
  const std::string html = read_text(out);
  // Self-contained: nothing is fetched.
  for (const char* needle : {"<script", "<link", "src=", "href=", "@import", "url("})
    EXPECT_EQ(html.find(needle), std::string::npos) << needle;
  std::string error;
  const auto elements = parse_xml(html, &error);
  ASSERT_EQ(error, "");
  const auto metrics = read_jsonl(run / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), static_cast<std::size_t>(steps));

  std::map<std::string, std::vector<std::pair<double, double>>> lines;
  int svgs = 0, polygons = 0;
  std::set<std::string> texts;
  std::map<std::string, std::string> summary;  // row id -> value text
  std::string last_row;
  for (const Element& e : elements) {
    if (e.tag == "svg") ++svgs;
    if (e.tag == "polyline") lines[e.attrs.at("data-series")] = points_of(e.attrs.at("points"));
    if (e.tag == "polygon") ++polygons;
    if (e.tag == "text") texts.insert(e.text);
    if (e.tag == "tr" && e.attrs.count("id")) last_row = e.attrs.at("id");
    if (e.tag == "td" && !last_row.empty()) summary[last_row] = e.text;
  }
  EXPECT_EQ(svgs, 6);      // loss, lr, grad norm, time, bytes, traffic
  EXPECT_EQ(polygons, 8);  // one stacked area per engine
  for (const char* series :
       {"train loss", "lr", "grad norm", "step time (wall)", "device", "host (pageable)", "host (pinned)",
        "NVMe", "host to device", "device to host", "NVMe read", "NVMe written"}) {
    ASSERT_TRUE(lines.count(series)) << series;
    EXPECT_EQ(lines[series].size(), static_cast<std::size_t>(steps)) << series;
  }
  ASSERT_TRUE(lines.count("validation loss"));
  EXPECT_EQ(lines["validation loss"].size(), 3u);  // steps 2, 4, 6
  for (const char* label :
       {"step", "loss (nats/token)", "learning rate", "global L2 norm", "seconds", "bytes"})
    EXPECT_TRUE(texts.count(label)) << "axis label '" << label << "'";
  // The loss line: x grows with the step, and the highest loss is drawn highest (smallest y).
  const auto& loss = lines["train loss"];
  std::size_t top = 0, worst = 0;
  for (std::size_t i = 0; i < loss.size(); ++i) {
    if (i > 0) {
      EXPECT_GT(loss[i].first, loss[i - 1].first);
    }
    if (loss[i].second < loss[top].second) top = i;
    if (metrics[i]["loss"].get<double>() > metrics[worst]["loss"].get<double>()) worst = i;
  }
  EXPECT_EQ(top, worst);
  // The lr line rises through warm-up exactly where the metrics do.
  for (std::size_t i = 1; i < lines["lr"].size(); ++i) {
    const double dl = metrics[i]["lr"].get<double>() - metrics[i - 1]["lr"].get<double>();
    const double dy = lines["lr"][i].second - lines["lr"][i - 1].second;
    if (dl > 0) {
      EXPECT_LT(dy, 0.0) << i;
    }
    if (dl < 0) {
      EXPECT_GT(dy, 0.0) << i;
    }
  }
  // Numbers in the summary table are the metrics'.
  EXPECT_EQ(summary["s-first-loss"], fixed4(metrics.front()["loss"]));
  EXPECT_EQ(summary["s-last-loss"], fixed4(metrics.back()["loss"]));
  EXPECT_EQ(summary["s-val-loss"], fixed4(metrics.back()["val_loss"]));
  for (const char* link : {"h2d", "d2h", "nvme_read", "nvme_write"}) {
    std::uint64_t total = 0;
    for (const Json& m : metrics) total += m["traffic"][link].get<std::uint64_t>();
    EXPECT_EQ(summary[std::string("s-traffic-") + link], format_bytes(total)) << link;
  }
  EXPECT_NE(summary["s-steps"].find("6 (step 1 to 6)"), std::string::npos) << summary["s-steps"];
  // The header comes from run.json.
  const Json config = Json::parse(read_text(run / "run.json"));
  EXPECT_NE(html.find(config["optimizer"].get<std::string>()), std::string::npos);
  EXPECT_NE(html.find("parameters on nvme, optimizer state on host"), std::string::npos);

  // Without --out the page goes to RUN_DIR/report.html.
  auto rep2 = run_cli("report " + run.string());
  ASSERT_EQ(rep2.exit_code, 0) << rep2.output;
  EXPECT_EQ(read_text(run / "report.html"), html);
}

TEST(CliReport, BadRunDirectoriesAreErrorsNamingTheFileAndLine) {
  TempDir dir;
  auto expect_error = [](const std::string& args, int code, std::vector<std::string> needles) {
    auto r = run_cli("report " + args);
    EXPECT_EQ(r.exit_code, code) << args << "\n" << r.output;
    for (const auto& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << n << "\n" << r.output;
  };
  expect_error("", 2, {"missing RUN_DIR"});
  expect_error((dir / "absent").string(), 1, {(dir / "absent").string(), "not a directory"});
  const auto run = dir / "run";
  std::filesystem::create_directories(run);
  expect_error(run.string(), 1, {(run / "run.json").string(), "not found"});
  write_file(run / "run.json", "{\n  \"steps\": 3,\n  \"plan\": {\n}}}\n");
  expect_error(run.string(), 1, {(run / "run.json").string() + ":4", "not valid JSON"});
  write_file(run / "run.json", "{\"steps\": 3}\n");
  expect_error(run.string(), 1, {(run / "metrics.jsonl").string(), "not found"});
  const std::string good = R"({"step":1,"loss":3.5,"lr":0.001})";
  write_file(run / "metrics.jsonl", "");
  expect_error(run.string(), 1, {"metrics.jsonl: no step records"});
  write_file(run / "metrics.jsonl", good + "\n" + R"({"step":2,"loss":3.4)" + "\n");
  expect_error(run.string(), 1, {"metrics.jsonl:2:", "not a JSON object"});
  write_file(run / "metrics.jsonl", good + "\n" + R"({"step":2,"lr":0.001})" + "\n");
  expect_error(run.string(), 1, {"metrics.jsonl:2:", "missing key 'loss'"});
  write_file(run / "metrics.jsonl", good + "\n\n" + R"({"step":3,"loss":"high"})" + "\n");
  expect_error(run.string(), 1, {"metrics.jsonl:3:", "key 'loss' is string, expected a number"});
  write_file(run / "metrics.jsonl", good + "\n" + good + "\n");
  expect_error(run.string(), 1, {"metrics.jsonl:2:", "step 1 follows step 1"});
  write_file(run / "metrics.jsonl", good + "\n" + R"({"step":2,"loss":3.0,"traffic":[1,2]})" + "\n");
  expect_error(run.string(), 1, {"metrics.jsonl:2:", "key 'traffic' is array, expected an object"});
  // A minimal but valid directory (an older metrics file: no time, bytes or traffic) still draws.
  write_file(run / "metrics.jsonl",
             good + "\n" + R"({"step":2,"loss":3.0,"lr":0.002,"val_loss":3.1})" + "\n");
  auto r = run_cli("report " + run.string() + " --out " + (dir / "p.html").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string error;
  const auto elements = parse_xml(read_text(dir / "p.html"), &error);
  EXPECT_EQ(error, "");
  int svgs = 0;
  for (const Element& e : elements) svgs += e.tag == "svg" ? 1 : 0;
  EXPECT_EQ(svgs, 3);  // loss, lr, grad norm
  expect_error(run.string() + " --out /nonexistent-dir/p.html", 1, {"/nonexistent-dir/p.html"});
}

// A parallel run's links (strata train --metrics under mpirun writes them; test_dist_cli_train
// checks the values): a link with traffic gets its summary row (the run's total) and its line in
// the traffic chart; one that moved nothing in the whole run is left out, beside the four host and
// NVMe links that every run shows.
TEST(CliReport, ParallelLinksWithTrafficAreChartedAndSummed) {
  TempDir dir;
  const auto run = dir / "run";
  std::filesystem::create_directories(run);
  write_file(run / "run.json", "{\"steps\": 3}\n");
  std::string metrics;
  for (int step = 1; step <= 3; ++step) {
    Json m{{"step", step}, {"loss", 4.0 - 0.1 * step}};
    m["traffic"] = Json{{"h2d", 1000 * step}, {"d2h", 500},           {"nvme_read", 0},
                        {"nvme_write", 0},     {"data_parallel", 4096 * step},
                        {"tensor_parallel", 0}, {"pipeline", 2048},    {"activations", 0}};
    metrics += m.dump() + "\n";
  }
  write_file(run / "metrics.jsonl", metrics);
  auto r = run_cli("report " + run.string() + " --out " + (dir / "p.html").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string error;
  const auto elements = parse_xml(read_text(dir / "p.html"), &error);
  ASSERT_EQ(error, "");
  std::set<std::string> series;
  std::map<std::string, std::string> summary;
  std::string last_row;
  for (const Element& e : elements) {
    if (e.tag == "polyline") series.insert(e.attrs.at("data-series"));
    if (e.tag == "tr" && e.attrs.count("id")) last_row = e.attrs.at("id");
    if (e.tag == "td" && !last_row.empty()) summary[last_row] = e.text;
  }
  for (const char* s : {"host to device", "device to host", "NVMe read", "NVMe written",
                        "data-parallel collectives", "pipeline sends"}) {
    EXPECT_TRUE(series.count(s)) << s;
  }
  EXPECT_FALSE(series.count("tensor-parallel collectives"));
  EXPECT_FALSE(series.count("activation offload"));
  EXPECT_EQ(summary["s-traffic-data_parallel"], format_bytes(4096 * 6));
  EXPECT_EQ(summary["s-traffic-pipeline"], format_bytes(2048 * 3));
  EXPECT_EQ(summary["s-traffic-nvme_read"], format_bytes(0));
  EXPECT_FALSE(summary.count("s-traffic-tensor_parallel"));
  EXPECT_FALSE(summary.count("s-traffic-activations"));
}

}  // namespace
}  // namespace strata::testing
