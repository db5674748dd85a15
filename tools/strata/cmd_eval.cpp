// strata eval --weights FILE --data FILE [--seq-len T] [--json]: the mean next-token
// cross-entropy (natural log) of a model over consecutive non-overlapping windows of T+1 byte
// tokens from the start of the data (a final partial window is dropped). FILE is a safetensors
// file with Hugging Face GPT-2/LLaMA names and its config in the metadata (what strata train
// --save-weights and strata export write, or weights trained elsewhere), or a native run file.
// Exit codes: 0 evaluated, 1 a file could not be read or is not usable, 2 bad flags.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.hpp"
#include "model_flags.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"weights", "FILE", "safetensors weights with the model config in their metadata (required)"},
    {"data", "FILE", "text to evaluate on, as byte tokens (required)"},
    {"seq-len", "T", "tokens of context per window (default: the model's context length)"},
    {"batch", "N", "windows per forward pass (default 8, as strata train)"},
    {"max-windows", "N", "evaluate only the first N windows (default: all)"},
    {"json", "", "print {\"loss\": L, \"tokens\": N}"},
    {"device", "cpu|cuda", "device backend (default: the 'device' tunable, cpu)"},
    {"threads", "N", "compute threads of the cpu backend (default: every core)"},
    {"help", "", "show this help"},
};

std::string usage() {
  return "usage: strata eval --weights FILE --data FILE [--seq-len T] [--json]\n\n"
         "Mean next-token cross-entropy (nats) over consecutive windows of T+1 byte tokens from the\n"
         "start of the data; a final partial window is dropped.\n\nflags:\n" +
         format_flags(kFlags);
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata eval: %s\n", s.message().c_str());
  return kExitFailure;
}

int run_eval(std::span<const std::string> argv) {
  use_passive_openmp_wait("eval", argv);
  auto parsed = Args::parse(argv, kFlags);
  if (!parsed.ok()) return usage_error("eval", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty())
    return usage_error("eval", "unexpected argument '" + args.positionals()[0] + "'", usage());
  for (const char* required : {"weights", "data"}) {
    if (!args.has(required))
      return usage_error("eval", std::string("flag '--") + required + "' is required", usage());
  }
  std::int64_t batch = 8, max_windows = 0, seq_len = 0;
  Status s = int_flag(args, "batch", 1, 1 << 20, &batch);
  if (s.ok()) s = int_flag(args, "max-windows", 0, 1ll << 40, &max_windows);
  if (s.ok()) s = int_flag(args, "seq-len", 1, 1 << 20, &seq_len);
  if (!s.ok()) return usage_error("eval", s.message(), usage());

  const std::string weights = *args.get("weights");
  auto config = read_weights_config(weights);
  if (!config.ok()) return fail(config.status());
  if (!args.has("seq-len")) seq_len = config->n_positions;
  if (seq_len > config->n_positions) {
    return usage_error("eval",
                       "flag '--seq-len' (" + std::to_string(seq_len) + ") exceeds the context length of '" +
                           weights + "' (n_positions = " + std::to_string(config->n_positions) + ")",
                       usage());
  }
  const std::string data_path = *args.get("data");
  std::ifstream in(data_path, std::ios::binary);
  if (!in) return fail(not_found("data file '" + data_path + "' cannot be opened"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::vector<std::int32_t> tokens = make_byte_tokenizer()->encode(ss.str());
  if (config->vocab_size < 256) {
    return fail(invalid_argument("'" + weights + "' has a vocabulary of " +
                                 std::to_string(config->vocab_size) + " tokens; byte tokens need 256"));
  }
  if (static_cast<std::int64_t>(tokens.size()) < seq_len + 1) {
    return fail(invalid_argument("data file '" + data_path + "' has " + std::to_string(tokens.size()) +
                                 " bytes; one window needs seq_len + 1 = " + std::to_string(seq_len + 1)));
  }

  TrainerConfig sizing;
  sizing.model = *config;
  sizing.micro_batch = batch;
  sizing.seq_len = seq_len;
  auto needed = Trainer::device_bytes(sizing);
  if (!needed.ok()) return fail(needed.status().with_context("'" + weights + "'"));
  Options options;
  DeviceConfig dc;
  s = device_options(args, *needed, &options, &dc);
  if (!s.ok())
    return s.code() == StatusCode::kInvalidArgument ? usage_error("eval", s.message(), usage()) : fail(s);
  auto device = Device::create(dc);
  // A device this machine or build does not have (cuda without a GPU): exit 2, as train does.
  if (!device.ok() && device.status().code() == StatusCode::kUnavailable) {
    return usage_error("eval", "--device " + std::string(to_string(dc.kind)) + ": " + device.status().message(),
                       usage());
  }
  if (!device.ok()) return fail(device.status());
  auto stream = (*device)->create_stream("eval");
  if (!stream.ok()) return fail(stream.status());
  auto layout = describe_model(*config);
  if (!layout.ok()) return fail(layout.status().with_context("'" + weights + "'"));
  Model::Options mo;
  mo.max_batch = batch;
  mo.max_seq_len = seq_len;
  mo.with_grads = false;
  auto model = Model::create(std::move(*layout), **device, **stream, mo);
  if (!model.ok()) return fail(model.status());
  s = load_weights(**model, weights);
  if (!s.ok()) return fail(s);
  auto result = evaluate_windows(**model, tokens, seq_len, batch, max_windows);
  if (!result.ok()) return fail(result.status());
  if (args.has("json")) {
    nlohmann::json out;
    out["loss"] = result->loss;
    out["tokens"] = result->tokens;
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("loss %.6f nats/token over %lld tokens (%lld windows of %lld)\n", result->loss,
                static_cast<long long>(result->tokens), static_cast<long long>(result->tokens / seq_len),
                static_cast<long long>(seq_len + 1));
  }
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(eval, "mean next-token loss of a weights file on a text file", run_eval);

}  // namespace strata::cli
