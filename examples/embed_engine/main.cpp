// embed_engine: a training program of its own that embeds Strata's OffloadEngine. The program
// owns the data (a synthetic corpus of additions it generates, or a text file), the batching and
// the loop; Strata owns the model state and where it lives: the parameters on NVMe (a fresh
// temporary directory), the fp32 master weights and Adam moments in host memory, activations on
// the device (the cpu backend's emulated accelerator here). After every step the program reads
// the engine's statistics and prints the traffic of that step and the prefetch hit rate; at the
// end it evaluates on text it held out.
//
//   embed_engine [STEPS] [TEXT_FILE]      (defaults: 60 steps, the generated corpus)
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <strata/device.hpp>
#include <strata/engine.hpp>
#include <strata/offload.hpp>
#include <string>
#include <vector>

namespace {

int fail(const char* what, const strata::Status& s) {
  std::fprintf(stderr, "embed_engine: %s: %s\n", what, s.to_string().c_str());
  return 1;
}

// "17+25=42\n" lines: the digits after '=' follow from the ones before, so the loss keeps falling
// as the model learns the format and then some arithmetic.
std::string make_additions(std::size_t bytes, std::mt19937& rng) {
  std::string text;
  std::uniform_int_distribution<int> operand(0, 99);
  while (text.size() < bytes) {
    const int a = operand(rng), b = operand(rng);
    text += std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n";
  }
  return text;
}

// A swap directory of our own, removed with the engine's files in it when the program ends.
struct SwapDir {
  std::filesystem::path path;
  SwapDir() {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / ("embed_engine-swap-" + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~SwapDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

double kib(std::uint64_t bytes) { return static_cast<double>(bytes) / 1024.0; }

}  // namespace

int main(int argc, char** argv) {
  const long steps = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 60;
  if (steps < 1) {
    std::fprintf(stderr, "embed_engine: STEPS '%s' must be a positive number\n", argv[1]);
    return 2;
  }
  std::mt19937 rng(2024);
  std::string text;
  if (argc > 2) {
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "embed_engine: cannot open text file '%s'\n", argv[2]);
      return 1;
    }
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } else {
    text = make_additions(1 << 16, rng);
  }
  // Byte tokens; the last 10% of the text is held out for evaluation.
  std::vector<std::int32_t> tokens(text.begin(), text.end());
  for (auto& t : tokens) t = static_cast<unsigned char>(t);
  const std::size_t n_train = tokens.size() * 9 / 10;
  const std::vector<std::int32_t> train(tokens.begin(),
                                        tokens.begin() + static_cast<std::ptrdiff_t>(n_train));
  const std::vector<std::int32_t> held_out(tokens.begin() + static_cast<std::ptrdiff_t>(n_train),
                                           tokens.end());

  strata::TrainerConfig config;
  config.model.kind = strata::ModelKind::kGpt2;
  config.model.n_layer = 2;
  config.model.n_embd = 128;  // a block holds ~200k parameters: above the persistence threshold, so it moves
  config.model.n_head = 4;
  config.model.vocab_size = 256;
  config.model.n_positions = 32;
  config.seq_len = 32;
  config.micro_batch = 4;
  config.schedule.kind = strata::LrScheduleKind::kWarmupCosine;
  config.schedule.lr = 3e-3;
  config.schedule.warmup_steps = 2;
  config.schedule.total_steps = steps;
  config.schedule.min_ratio = 0.1;
  if (static_cast<std::int64_t>(train.size()) < config.seq_len + 2 ||
      static_cast<std::int64_t>(held_out.size()) < config.seq_len + 1) {
    std::fprintf(stderr, "embed_engine: the text has %zu bytes; it needs at least %lld\n", text.size(),
                 static_cast<long long>(10 * (config.seq_len + 2)));
    return 1;
  }

  SwapDir swap;
  strata::OffloadSettings placement;
  placement.params = strata::Tier::kNvme;
  placement.optimizer = strata::Tier::kHost;
  placement.nvme_path = {swap.path.string()};
  placement.io.nvme_path = placement.nvme_path;

  strata::DeviceConfig device_config;
  device_config.kind = strata::DeviceKind::kCpu;
  device_config.memory_bytes = 256ull << 20;
  device_config.pinned_bytes = 64ull << 20;
  auto device = strata::Device::create(device_config);
  if (!device.ok()) return fail("device", device.status());
  auto created = strata::OffloadEngine::create(config, placement, **device);
  if (!created.ok()) return fail("engine", created.status());
  strata::OffloadEngine& engine = **created;
  std::printf(
      "embed_engine: %zu training bytes, %zu held out; parameters on nvme (%s), optimizer on host\n%s",
      train.size(), held_out.size(), swap.path.c_str(), engine.plan().to_string().c_str());

  // The program's own batching: random windows of the training text, targets shifted by one.
  const std::size_t n = static_cast<std::size_t>(config.micro_batch * config.seq_len);
  std::vector<std::int32_t> inputs(n), targets(n);
  std::uniform_int_distribution<std::size_t> start(
      0, train.size() - static_cast<std::size_t>(config.seq_len) - 1);
  strata::OffloadStats last = engine.stats();
  for (long step = 0; step < steps; ++step) {
    for (std::int64_t b = 0; b < config.micro_batch; ++b) {
      const std::size_t s = start(rng);
      for (std::int64_t t = 0; t < config.seq_len; ++t) {
        inputs[static_cast<std::size_t>(b * config.seq_len + t)] = train[s + static_cast<std::size_t>(t)];
        targets[static_cast<std::size_t>(b * config.seq_len + t)] =
            train[s + static_cast<std::size_t>(t) + 1];
      }
    }
    auto m = engine.step(inputs, targets);
    if (!m.ok()) return fail("step", m.status());
    const strata::OffloadStats now = engine.stats();
    std::printf(
        "step %lld loss %.4f | lr %.2e | h2d +%.0f KiB, nvme read +%.0f KiB, written +%.0f KiB | prefetch "
        "hit rate "
        "%.2f\n",
        static_cast<long long>(m->step), m->loss, m->lr, kib(now.bytes_h2d - last.bytes_h2d),
        kib(now.bytes_nvme_read - last.bytes_nvme_read),
        kib(now.bytes_nvme_written - last.bytes_nvme_written), now.hit_rate());
    last = now;
  }

  auto eval = engine.evaluate(held_out, 0);
  if (!eval.ok()) return fail("evaluate", eval.status());
  const strata::OffloadStats total = engine.stats();
  std::printf("held-out loss %.4f over %lld tokens\n", eval->loss, static_cast<long long>(eval->tokens));
  std::printf(
      "total: h2d %.0f KiB, d2h %.0f KiB, nvme read %.0f KiB, written %.0f KiB; %llu of %llu parameter "
      "fetches issued ahead; %llu allocations after the first step\n",
      kib(total.bytes_h2d), kib(total.bytes_d2h), kib(total.bytes_nvme_read), kib(total.bytes_nvme_written),
      static_cast<unsigned long long>(total.prefetch_hits),
      static_cast<unsigned long long>(total.param_accesses),
      static_cast<unsigned long long>(total.allocations_after_warmup));
  return 0;
}
