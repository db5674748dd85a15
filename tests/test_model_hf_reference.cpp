// The Hugging Face files mean what Hugging Face means: an independent, plain double-precision
// forward pass written from the Hugging Face definitions (GPT2LMHeadModel with Conv1D weights
// (in, out) and gelu_new; LlamaForCausalLM with nn.Linear weights (out, in), rotate-half rotary
// embeddings, grouped-query heads, SiLU-gated MLP), reading only the tensors of a file that
// strata wrote, gives the loss strata computes for the same windows.
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "harness/harness.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/safetensors.hpp"

namespace strata::testing {
namespace {

using Mat = std::vector<double>;  // row-major

// The tensors of a file, widened to double.
class HfTensors {
 public:
  explicit HfTensors(const std::string& path) : file_(*SafetensorsFile::open(path)) {}
  const Mat& operator[](const std::string& name) {
    auto it = cache_.find(name);
    if (it != cache_.end()) return it->second;
    const SafetensorsEntry* e = file_.find(name);
    EXPECT_NE(e, nullptr) << name;
    Mat m;
    if (e != nullptr) {
      std::vector<char> raw(e->nbytes());
      EXPECT_TRUE(file_.read(name, raw.data(), raw.size()).ok());
      if (e->dtype == "F32") {
        m.resize(raw.size() / 4);
        for (std::size_t i = 0; i < m.size(); ++i) {
          float f;
          std::memcpy(&f, raw.data() + 4 * i, 4);
          m[i] = f;
        }
      } else {  // BF16
        m.resize(raw.size() / 2);
        for (std::size_t i = 0; i < m.size(); ++i) {
          std::uint16_t h;
          std::memcpy(&h, raw.data() + 2 * i, 2);
          const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
          float f;
          std::memcpy(&f, &u, 4);
          m[i] = f;
        }
      }
    }
    return cache_.emplace(name, std::move(m)).first->second;
  }
  nlohmann::json config() { return nlohmann::json::parse(file_.metadata().at("config")); }

 private:
  SafetensorsFile file_;
  std::map<std::string, Mat> cache_;
};

// y (T, out) = x (T, in) · W, with W stored (in, out) (Conv1D) or (out, in) (nn.Linear).
Mat linear(const Mat& x, std::int64_t T, std::int64_t in, const Mat& W, std::int64_t out, bool w_in_out,
           const Mat* bias = nullptr) {
  Mat y(static_cast<std::size_t>(T * out), 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t o = 0; o < out; ++o) {
      double acc = bias ? (*bias)[static_cast<std::size_t>(o)] : 0.0;
      for (std::int64_t i = 0; i < in; ++i) {
        const double w =
            w_in_out ? W[static_cast<std::size_t>(i * out + o)] : W[static_cast<std::size_t>(o * in + i)];
        acc += x[static_cast<std::size_t>(t * in + i)] * w;
      }
      y[static_cast<std::size_t>(t * out + o)] = acc;
    }
  }
  return y;
}

Mat layer_norm(const Mat& x, std::int64_t T, std::int64_t C, const Mat& w, const Mat* b, double eps,
               bool rms) {
  Mat y(x.size());
  for (std::int64_t t = 0; t < T; ++t) {
    const double* r = x.data() + t * C;
    double mean = 0, var = 0;
    if (!rms) {
      for (std::int64_t c = 0; c < C; ++c) mean += r[c] / static_cast<double>(C);
    }
    for (std::int64_t c = 0; c < C; ++c) var += (r[c] - mean) * (r[c] - mean) / static_cast<double>(C);
    const double rstd = 1.0 / std::sqrt(var + eps);
    for (std::int64_t c = 0; c < C; ++c) {
      y[static_cast<std::size_t>(t * C + c)] = (r[c] - mean) * rstd * w[static_cast<std::size_t>(c)] +
                                               (b ? (*b)[static_cast<std::size_t>(c)] : 0.0);
    }
  }
  return y;
}

// Causal attention of (T, H, D) queries over (T, Hkv, D) keys/values, head h reading kv head h/(H/Hkv).
Mat attention(const Mat& q, const Mat& k, const Mat& v, std::int64_t T, std::int64_t H, std::int64_t Hkv,
              std::int64_t D) {
  Mat out(static_cast<std::size_t>(T * H * D), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t kh = h / (H / Hkv);
    for (std::int64_t i = 0; i < T; ++i) {
      std::vector<double> s(static_cast<std::size_t>(i + 1));
      double m = -1e300;
      for (std::int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (std::int64_t d = 0; d < D; ++d) {
          dot += q[static_cast<std::size_t>((i * H + h) * D + d)] *
                 k[static_cast<std::size_t>((j * Hkv + kh) * D + d)];
        }
        s[static_cast<std::size_t>(j)] = dot * scale;
        m = std::max(m, s[static_cast<std::size_t>(j)]);
      }
      double z = 0;
      for (auto& e : s) z += (e = std::exp(e - m));
      for (std::int64_t j = 0; j <= i; ++j) {
        for (std::int64_t d = 0; d < D; ++d) {
          out[static_cast<std::size_t>((i * H + h) * D + d)] +=
              s[static_cast<std::size_t>(j)] / z * v[static_cast<std::size_t>((j * Hkv + kh) * D + d)];
        }
      }
    }
  }
  return out;
}

double cross_entropy(const Mat& logits, std::int64_t T, std::int64_t V, const std::int32_t* targets) {
  double total = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const double* r = logits.data() + t * V;
    double m = -1e300;
    for (std::int64_t v = 0; v < V; ++v) m = std::max(m, r[v]);
    double z = 0;
    for (std::int64_t v = 0; v < V; ++v) z += std::exp(r[v] - m);
    total += m + std::log(z) - r[targets[t]];
  }
  return total;
}

// Σ loss over one window (T inputs, T targets) of a GPT2LMHeadModel.
double gpt2_window(HfTensors& w, const std::int32_t* inputs, const std::int32_t* targets, std::int64_t T) {
  auto cfg = w.config();
  const std::int64_t C = cfg["n_embd"], H = cfg["n_head"], L = cfg["n_layer"], V = cfg["vocab_size"];
  const double eps = cfg["layer_norm_epsilon"];
  const std::int64_t D = C / H;
  Mat x(static_cast<std::size_t>(T * C));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t c = 0; c < C; ++c) {
      x[static_cast<std::size_t>(t * C + c)] = w["wte.weight"][static_cast<std::size_t>(inputs[t] * C + c)] +
                                               w["wpe.weight"][static_cast<std::size_t>(t * C + c)];
    }
  }
  for (std::int64_t l = 0; l < L; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    Mat a = layer_norm(x, T, C, w[p + "ln_1.weight"], &w[p + "ln_1.bias"], eps, false);
    Mat qkv = linear(a, T, C, w[p + "attn.c_attn.weight"], 3 * C, true, &w[p + "attn.c_attn.bias"]);
    Mat q(static_cast<std::size_t>(T * C)), k(q.size()), v(q.size());
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t c = 0; c < C; ++c) {
        q[static_cast<std::size_t>(t * C + c)] = qkv[static_cast<std::size_t>(t * 3 * C + c)];
        k[static_cast<std::size_t>(t * C + c)] = qkv[static_cast<std::size_t>(t * 3 * C + C + c)];
        v[static_cast<std::size_t>(t * C + c)] = qkv[static_cast<std::size_t>(t * 3 * C + 2 * C + c)];
      }
    }
    Mat att = attention(q, k, v, T, H, H, D);
    Mat proj = linear(att, T, C, w[p + "attn.c_proj.weight"], C, true, &w[p + "attn.c_proj.bias"]);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    Mat m = layer_norm(x, T, C, w[p + "ln_2.weight"], &w[p + "ln_2.bias"], eps, false);
    Mat f = linear(m, T, C, w[p + "mlp.c_fc.weight"], 4 * C, true, &w[p + "mlp.c_fc.bias"]);
    for (auto& e : f)
      e = 0.5 * e * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (e + 0.044715 * e * e * e)));  // gelu_new
    Mat o = linear(f, T, 4 * C, w[p + "mlp.c_proj.weight"], C, true, &w[p + "mlp.c_proj.bias"]);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
  }
  Mat h = layer_norm(x, T, C, w["ln_f.weight"], &w["ln_f.bias"], eps, false);
  Mat logits = linear(h, T, C, w["wte.weight"], V, false);  // tied head
  return cross_entropy(logits, T, V, targets);
}

// Σ loss over one window of a LlamaForCausalLM.
double llama_window(HfTensors& w, const std::int32_t* inputs, const std::int32_t* targets, std::int64_t T) {
  auto cfg = w.config();
  const std::int64_t C = cfg["hidden_size"], H = cfg["num_attention_heads"], Hkv = cfg["num_key_value_heads"];
  const std::int64_t L = cfg["num_hidden_layers"], V = cfg["vocab_size"], F = cfg["intermediate_size"];
  const double eps = cfg["rms_norm_eps"], theta = cfg["rope_theta"];
  const std::int64_t D = C / H;
  Mat x(static_cast<std::size_t>(T * C));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t c = 0; c < C; ++c) {
      x[static_cast<std::size_t>(t * C + c)] =
          w["model.embed_tokens.weight"][static_cast<std::size_t>(inputs[t] * C + c)];
    }
  }
  // q·cos + rotate_half(q)·sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]), angles t·θ^(-2i/D).
  auto rope = [&](Mat& m, std::int64_t heads) {
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t h = 0; h < heads; ++h) {
        double* r = m.data() + (t * heads + h) * D;
        std::vector<double> orig(r, r + D);
        for (std::int64_t i = 0; i < D; ++i) {
          const std::int64_t f = i % (D / 2);
          const double angle = static_cast<double>(t) *
                               std::pow(theta, -2.0 * static_cast<double>(f) / static_cast<double>(D));
          const double rot = i < D / 2 ? -orig[static_cast<std::size_t>(i + D / 2)]
                                       : orig[static_cast<std::size_t>(i - D / 2)];
          r[i] = orig[static_cast<std::size_t>(i)] * std::cos(angle) + rot * std::sin(angle);
        }
      }
    }
  };
  for (std::int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Mat a = layer_norm(x, T, C, w[p + "input_layernorm.weight"], nullptr, eps, true);
    Mat q = linear(a, T, C, w[p + "self_attn.q_proj.weight"], H * D, false);
    Mat k = linear(a, T, C, w[p + "self_attn.k_proj.weight"], Hkv * D, false);
    Mat v = linear(a, T, C, w[p + "self_attn.v_proj.weight"], Hkv * D, false);
    rope(q, H);
    rope(k, Hkv);
    Mat att = attention(q, k, v, T, H, Hkv, D);
    Mat o = linear(att, T, H * D, w[p + "self_attn.o_proj.weight"], C, false);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    Mat m = layer_norm(x, T, C, w[p + "post_attention_layernorm.weight"], nullptr, eps, true);
    Mat g = linear(m, T, C, w[p + "mlp.gate_proj.weight"], F, false);
    Mat u = linear(m, T, C, w[p + "mlp.up_proj.weight"], F, false);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
    Mat d = linear(g, T, F, w[p + "mlp.down_proj.weight"], C, false);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += d[i];
  }
  Mat h = layer_norm(x, T, C, w["model.norm.weight"], nullptr, eps, true);
  Mat logits = linear(h, T, C, w["lm_head.weight"], V, false);
  return cross_entropy(logits, T, V, targets);
}

TEST(HuggingFaceReference, StrataLossEqualsAPlainHuggingFaceForward) {
  TempDir dir;
  const Corpus corpus = builtin_corpus(5, 20000);
  const auto tokens = make_byte_tokenizer()->encode(corpus.validation);
  for (ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      DeviceConfig dc;
      dc.memory_bytes = 64ull << 20;
      dc.pinned_bytes = 16ull << 20;
      dc.compute_threads = 1;
      auto device = Device::create(dc);
      ASSERT_TRUE(device.ok());
      TrainerConfig cfg;
      cfg.model.kind = kind;
      cfg.model.n_layer = 2;
      cfg.model.n_embd = 32;
      cfg.model.n_head = 4;
      cfg.model.n_kv_head = kind == ModelKind::kLlama ? 2 : 0;
      cfg.model.n_positions = 24;
      cfg.model.vocab_size = 300;  // padded to 320 inside strata, 300 rows in the file
      cfg.model.dtype = dtype;
      cfg.model.init_std = 0.1;
      cfg.micro_batch = 2;
      cfg.seq_len = 24;
      cfg.schedule.kind = LrScheduleKind::kConstant;
      cfg.schedule.lr = 1e-2;
      auto trainer = Trainer::create(cfg, **device);
      ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
      auto batcher = Batcher::create(tokens, cfg.micro_batch, cfg.seq_len, 1);
      std::vector<std::int32_t> inputs, targets;
      for (int s = 0; s < 3; ++s) {  // move away from the initialisation
        batcher->batch(static_cast<std::uint64_t>(s), inputs, targets);
        ASSERT_TRUE((*trainer)->step(inputs, targets).ok());
      }
      const std::int64_t windows = 3;
      auto own = (*trainer)->evaluate(tokens, windows);
      ASSERT_TRUE(own.ok()) << own.status().to_string();
      const std::string path = (dir / "hf.safetensors").string();
      STRATA_ASSERT_OK((*trainer)->save_weights(path));
      HfTensors w(path);
      double total = 0;
      const std::int64_t T = cfg.seq_len;
      for (std::int64_t win = 0; win < windows; ++win) {
        const std::int32_t* window = tokens.data() + win * (T + 1);
        total += kind == ModelKind::kGpt2 ? gpt2_window(w, window, window + 1, T)
                                          : llama_window(w, window, window + 1, T);
      }
      const double reference = total / static_cast<double>(windows * T);
      // fp32: summation order only (measured 2e-9). bf16: strata also rounds activations to bf16 between
      // ops (measured 1e-4).
      const double tolerance = dtype == DType::kF32 ? 1e-6 : 2e-3;
      EXPECT_NEAR(own->loss, reference, tolerance * reference) << to_string(kind) << " " << to_string(dtype);
    }
  }
}

}  // namespace
}  // namespace strata::testing

namespace strata::testing {
namespace {

// A GPT-2 file as transformers' GPT2LMHeadModel state dicts often are: names under
// "transformer.", an explicit (tied) lm_head.weight and the attention-mask buffers. It loads.
TEST(HuggingFaceReference, LoadsGpt2FilesWithTheTransformerPrefixAndExtraBuffers) {
  TempDir dir;
  DeviceConfig dc;
  dc.memory_bytes = 64ull << 20;
  dc.pinned_bytes = 16ull << 20;
  dc.compute_threads = 1;
  auto device = Device::create(dc);
  ASSERT_TRUE(device.ok());
  TrainerConfig cfg;
  cfg.model.n_layer = 2;
  cfg.model.n_embd = 32;
  cfg.model.n_head = 4;
  cfg.model.n_positions = 16;
  cfg.model.vocab_size = 256;
  cfg.micro_batch = 2;
  cfg.seq_len = 16;
  auto trainer = Trainer::create(cfg, **device);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  const std::string ours = (dir / "ours.safetensors").string();
  STRATA_ASSERT_OK((*trainer)->save_weights(ours));
  auto file = SafetensorsFile::open(ours);
  ASSERT_TRUE(file.ok());
  SafetensorsWriter writer;
  std::vector<std::vector<char>> keep;
  for (const auto& e : file->entries()) {
    auto& bytes = keep.emplace_back(e.nbytes());
    STRATA_ASSERT_OK(file->read(e.name, bytes.data(), bytes.size()));
    STRATA_ASSERT_OK(writer.add("transformer." + e.name, e.dtype, e.shape, bytes.data(), bytes.size()));
    if (e.name == "wte.weight")
      STRATA_ASSERT_OK(writer.add("lm_head.weight", e.dtype, e.shape, bytes.data(), bytes.size()));
  }
  std::vector<char> mask(16 * 16, 1);
  STRATA_ASSERT_OK(writer.add("transformer.h.0.attn.bias", "U8", {1, 1, 16, 16}, mask.data(), mask.size()));
  for (const auto& [k, v] : file->metadata()) writer.set_metadata(k, v);
  const std::string theirs = (dir / "theirs.safetensors").string();
  STRATA_ASSERT_OK(writer.write(theirs));

  const auto tokens = make_byte_tokenizer()->encode(builtin_corpus(2, 8000).validation);
  auto own = (*trainer)->evaluate(tokens, 4);
  ASSERT_TRUE(own.ok());
  // A differently initialised trainer takes the weights from the rewritten file.
  auto device2 = Device::create(dc);
  ASSERT_TRUE(device2.ok());
  cfg.seed = 999;
  auto other = Trainer::create(cfg, **device2);
  ASSERT_TRUE(other.ok());
  auto before = (*other)->evaluate(tokens, 4);
  ASSERT_TRUE(before.ok());
  EXPECT_NE(before->loss, own->loss);
  STRATA_ASSERT_OK((*other)->load_weights(theirs));
  auto again = (*other)->evaluate(tokens, 4);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->loss, own->loss);
}

}  // namespace
}  // namespace strata::testing
