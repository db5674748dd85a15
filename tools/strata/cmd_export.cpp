// strata export --run DIR --weights OUT.safetensors [--dtype f32|bf16|fp16]: converts a training
// run's saved weights (DIR/weights.safetensors in Strata's native layout, written by
// strata train --out DIR) to safetensors with Hugging Face tensor names and layouts (GPT-2 or
// LLaMA) and the model config as JSON in the metadata under "config". No device is needed.
// Exit codes: 0 written, 1 a file could not be read or written, 2 bad flags.
#include <cstdio>
#include <filesystem>
#include <map>

#include "cli.hpp"
#include "strata/model.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"run", "DIR|FILE", "a training run directory (strata train --out DIR) or a weights file (required)"},
    {"weights", "OUT", "the Hugging Face safetensors file to write (required)"},
    {"dtype", "f32|bf16|fp16", "tensor dtype to write (default: the run's working dtype)"},
    {"help", "", "show this help"},
};

std::string usage() {
  return "usage: strata export --run DIR --weights OUT.safetensors [--dtype f32|bf16|fp16]\n\n"
         "Writes a training run's weights with Hugging Face GPT-2/LLaMA names and layouts.\n\nflags:\n" +
         format_flags(kFlags);
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata export: %s\n", s.message().c_str());
  return kExitFailure;
}

int run_export(std::span<const std::string> argv) {
  auto parsed = Args::parse(argv, kFlags);
  if (!parsed.ok()) return usage_error("export", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("export", "unexpected argument '" + args.positionals()[0] + "'", usage());
  }
  for (const char* required : {"run", "weights"}) {
    if (!args.has(required))
      return usage_error("export", std::string("flag '--") + required + "' is required", usage());
  }
  std::string input = *args.get("run");
  if (std::filesystem::is_directory(input))
    input = (std::filesystem::path(input) / "weights.safetensors").string();
  auto config = read_weights_config(input);
  if (!config.ok()) return fail(config.status());
  DType dtype = config->dtype;
  if (auto d = args.get("dtype")) {
    auto parsed_dtype = parse_dtype(*d);
    if (!parsed_dtype.ok())
      return usage_error("export", "flag '--dtype': " + parsed_dtype.status().message(), usage());
    dtype = *parsed_dtype;
  }
  auto layout = describe_model(*config);
  if (!layout.ok()) return fail(layout.status().with_context("'" + input + "'"));
  std::map<int, std::vector<float>> values;
  Status s = read_weights(*layout, input, [&](int index, std::span<const float> v) {
    values[index].assign(v.begin(), v.end());
    return ok_status();
  });
  if (!s.ok()) return fail(s);
  const std::string out = *args.get("weights");
  s = write_weights(*layout, out, WeightFormat::kHuggingFace, dtype, [&](int index, std::vector<float>& v) {
    v = std::move(values[index]);
    return ok_status();
  });
  if (!s.ok()) return fail(s);
  std::printf("wrote %s: %s, %lld parameters, %s (Hugging Face names)\n", out.c_str(),
              std::string(to_string(config->kind)).c_str(), static_cast<long long>(layout->num_parameters()),
              std::string(to_string(dtype)).c_str());
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(export, "write a training run's weights as Hugging Face safetensors", run_export);

}  // namespace strata::cli
