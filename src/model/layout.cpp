// Model configs and the parameter descriptor table: which parameters each module of a GPT-2 or
// LLaMA model declares, where they live in the params/grads regions, how they are initialised
// and which Hugging Face tensors they export as. Also the FLOP count and the GEMM list of a step.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "strata/model.hpp"

namespace strata {
namespace {

using Json = nlohmann::ordered_json;

std::string field_error(std::string_view field, std::int64_t value, std::string_view why) {
  return "model config: " + std::string(field) + " = " + std::to_string(value) + " " + std::string(why);
}

// Builds the table module by module; each parameter's offsets follow the previous one's.
// Rows of a parameter that reach an exported tensor (all of them but the vocabulary padding).
std::int64_t exported_rows_of(const std::vector<ExportSlice>& exports, std::int64_t rows) {
  if (exports.empty()) return rows;
  std::int64_t end = 0;
  for (const auto& e : exports) end = std::max(end, e.row_begin + e.rows);
  return end;
}

// How a parameter splits over tensor-parallel ranks. kRows: the full rows are consecutive groups
// (qkv: q | k | v; gate_up: gate | up; one group otherwise), each cut into tp equal blocks; rank r
// holds block r of every group, in group order. kColumns: the columns cut into tp equal blocks.
struct Split {
  ShardKind kind = ShardKind::kReplicated;
  std::vector<std::int64_t> groups;  // kRows: rows per group (sum = rows); empty = one group
};

class LayoutBuilder {
 public:
  LayoutBuilder(const ModelConfig& config, TensorParallel tp) {
    layout_.config = config;
    layout_.tp = tp;
  }

  void begin_module(std::string name, ModuleKind kind, int layer) {
    ModuleDesc m;
    m.name = std::move(name);
    m.kind = kind;
    m.layer = layer;
    m.param_begin = param_cursor_;
    m.grad_begin = grad_cursor_;
    layout_.modules.push_back(std::move(m));
  }

  // Declares a parameter with its own storage. `exports` empty means one slice: the whole tensor
  // under `hf_name` (when non-empty).
  // `shape` is the full parameter's; with tensor parallelism the declared storage is this rank's
  // shard of it per `split` (the caller checked divisibility: check_tensor_parallel).
  int add(std::string name, std::vector<std::int64_t> shape, bool decay, ParamInit init,
          std::vector<ExportSlice> exports, Split split = {}) {
    ParamDesc p;
    p.name = std::move(name);
    p.dtype = layout_.config.dtype;
    p.weight_decay = decay;
    p.module = static_cast<int>(layout_.modules.size()) - 1;
    p.init = init;
    p.exports = std::move(exports);
    p.shard.full_shape = shape;
    p.shard.full_real_rows = exported_rows_of(p.exports, shape[0]);
    const TensorParallel tp = layout_.tp;
    if (tp.size > 1 && split.kind == ShardKind::kRows) {
      p.shard.kind = ShardKind::kRows;
      if (split.groups.empty()) split.groups = {shape[0]};
      std::int64_t group_begin = 0, rows = 0;
      for (std::int64_t g : split.groups) {
        const std::int64_t block = g / tp.size;
        p.shard.rows.push_back(ShardRows{group_begin + tp.rank * block, block});
        rows += block;
        group_begin += g;
      }
      shape[0] = rows;
      p.exports.clear();
    } else if (tp.size > 1 && split.kind == ShardKind::kColumns) {
      p.shard.kind = ShardKind::kColumns;
      const std::int64_t block = shape[1] / tp.size;
      p.shard.col_begin = tp.rank * block;
      shape[1] = block;
      p.exports.clear();
    }
    p.shape = std::move(shape);
    p.param_offset = param_cursor_;
    p.grad_offset = grad_cursor_;
    const auto n = static_cast<std::uint64_t>(p.numel());
    param_cursor_ = align_up(param_cursor_ + n * dtype_size(p.dtype), kParamAlignment);
    grad_cursor_ = align_up(grad_cursor_ + n * 4, kParamAlignment);
    return push(std::move(p));
  }

  // Declares `name` as sharing the storage (and gradient) of the parameter named `target`.
  int tie(std::string name, std::string_view target) {
    const int t = layout_.find(target);
    ParamDesc p = layout_.params[static_cast<std::size_t>(t)];
    p.name = std::move(name);
    p.tied_with = t;
    p.module = static_cast<int>(layout_.modules.size()) - 1;
    p.exports.clear();
    return push(std::move(p));
  }

  ModelLayout finish() {
    layout_.param_bytes = param_cursor_;
    layout_.grad_bytes = grad_cursor_;
    return std::move(layout_);
  }

 private:
  int push(ParamDesc p) {
    const int index = static_cast<int>(layout_.params.size());
    layout_.params.push_back(std::move(p));
    ModuleDesc& m = layout_.modules.back();
    m.params.push_back(index);
    m.param_end = param_cursor_;
    m.grad_end = grad_cursor_;
    return index;
  }

  ModelLayout layout_;
  std::uint64_t param_cursor_ = 0;
  std::uint64_t grad_cursor_ = 0;
};

ExportSlice whole(std::string name, std::int64_t rows, bool transpose = false) {
  return ExportSlice{std::move(name), 0, rows, transpose};
}

void describe_gpt2(const ModelConfig& c, LayoutBuilder& b) {
  const std::int64_t C = c.n_embd, F = c.ffn(), V = c.vocab_size, Vp = c.padded_vocab(), P = c.n_positions;
  const ParamInit normal{InitKind::kNormal, c.init_std};
  // GPT-2 scales the init of the projections that write into the residual stream by 1/√(2L).
  const ParamInit residual{InitKind::kNormal, c.init_std / std::sqrt(2.0 * static_cast<double>(c.n_layer))};
  const ParamInit zeros{InitKind::kZeros, 0.0};
  const ParamInit ones{InitKind::kOnes, 0.0};

  b.begin_module("embedding", ModuleKind::kEmbedding, -1);
  const Split rows{ShardKind::kRows, {}};
  const Split columns{ShardKind::kColumns, {}};
  const Split qkv{ShardKind::kRows, {C, C, C}};  // q | k | v, each split by heads
  b.add("wte.weight", {Vp, C}, true, normal, {whole("wte.weight", V)}, rows);
  b.add("wpe.weight", {P, C}, false, normal, {whole("wpe.weight", P)});
  for (std::int64_t l = 0; l < c.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    b.begin_module("h." + std::to_string(l), ModuleKind::kBlock, static_cast<int>(l));
    b.add(h + "ln_1.weight", {C}, false, ones, {whole(h + "ln_1.weight", C)});
    b.add(h + "ln_1.bias", {C}, false, zeros, {whole(h + "ln_1.bias", C)});
    b.add(h + "attn.c_attn.weight", {3 * C, C}, true, normal, {whole(h + "attn.c_attn.weight", 3 * C, true)}, qkv);
    b.add(h + "attn.c_attn.bias", {3 * C}, false, zeros, {whole(h + "attn.c_attn.bias", 3 * C)}, qkv);
    b.add(h + "attn.c_proj.weight", {C, C}, true, residual, {whole(h + "attn.c_proj.weight", C, true)}, columns);
    b.add(h + "attn.c_proj.bias", {C}, false, zeros, {whole(h + "attn.c_proj.bias", C)});
    b.add(h + "ln_2.weight", {C}, false, ones, {whole(h + "ln_2.weight", C)});
    b.add(h + "ln_2.bias", {C}, false, zeros, {whole(h + "ln_2.bias", C)});
    b.add(h + "mlp.c_fc.weight", {F, C}, true, normal, {whole(h + "mlp.c_fc.weight", F, true)}, rows);
    b.add(h + "mlp.c_fc.bias", {F}, false, zeros, {whole(h + "mlp.c_fc.bias", F)}, rows);
    b.add(h + "mlp.c_proj.weight", {C, F}, true, residual, {whole(h + "mlp.c_proj.weight", C, true)}, columns);
    b.add(h + "mlp.c_proj.bias", {C}, false, zeros, {whole(h + "mlp.c_proj.bias", C)});
  }
  b.begin_module("head", ModuleKind::kHead, -1);
  b.add("ln_f.weight", {C}, false, ones, {whole("ln_f.weight", C)});
  b.add("ln_f.bias", {C}, false, zeros, {whole("ln_f.bias", C)});
  b.tie("lm_head.weight", "wte.weight");
}

void describe_llama(const ModelConfig& c, LayoutBuilder& b) {
  const std::int64_t C = c.n_embd, F = c.ffn(), V = c.vocab_size, Vp = c.padded_vocab();
  const std::int64_t D = c.head_dim(), H = c.n_head, Hkv = c.kv_heads();
  const ParamInit normal{InitKind::kNormal, c.init_std};
  const ParamInit residual{InitKind::kNormal, c.init_std / std::sqrt(2.0 * static_cast<double>(c.n_layer))};
  const ParamInit ones{InitKind::kOnes, 0.0};

  b.begin_module("embedding", ModuleKind::kEmbedding, -1);
  const Split rows{ShardKind::kRows, {}};
  const Split columns{ShardKind::kColumns, {}};
  b.add("model.embed_tokens.weight", {Vp, C}, true, normal, {whole("model.embed_tokens.weight", V)}, rows);
  for (std::int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    b.begin_module("model.layers." + std::to_string(l), ModuleKind::kBlock, static_cast<int>(l));
    b.add(p + "input_layernorm.weight", {C}, false, ones, {whole(p + "input_layernorm.weight", C)});
    // q, k and v are one fused projection (one GEMM); Hugging Face keeps three tensors.
    b.add(p + "self_attn.qkv_proj.weight", {(H + 2 * Hkv) * D, C}, true, normal,
          {ExportSlice{p + "self_attn.q_proj.weight", 0, H * D, false},
           ExportSlice{p + "self_attn.k_proj.weight", H * D, Hkv * D, false},
           ExportSlice{p + "self_attn.v_proj.weight", (H + Hkv) * D, Hkv * D, false}},
          Split{ShardKind::kRows, {H * D, Hkv * D, Hkv * D}});
    b.add(p + "self_attn.o_proj.weight", {C, H * D}, true, residual,
          {whole(p + "self_attn.o_proj.weight", C)}, columns);
    b.add(p + "post_attention_layernorm.weight", {C}, false, ones,
          {whole(p + "post_attention_layernorm.weight", C)});
    // gate and up likewise: rows [0, F) are the gate, [F, 2F) the up projection (swiglu's layout).
    b.add(p + "mlp.gate_up_proj.weight", {2 * F, C}, true, normal,
          {ExportSlice{p + "mlp.gate_proj.weight", 0, F, false},
           ExportSlice{p + "mlp.up_proj.weight", F, F, false}},
          Split{ShardKind::kRows, {F, F}});  // each rank: its gate rows, then its up rows
    b.add(p + "mlp.down_proj.weight", {C, F}, true, residual, {whole(p + "mlp.down_proj.weight", C)}, columns);
  }
  b.begin_module("head", ModuleKind::kHead, -1);
  b.add("model.norm.weight", {C}, false, ones, {whole("model.norm.weight", C)});
  b.add("lm_head.weight", {Vp, C}, true, normal, {whole("lm_head.weight", V)}, rows);
}

// splitmix64: a counter-based generator, so element i of a parameter can be produced without
// generating the elements before it (initialisation in chunks gives the same values).
std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double uniform01(std::uint64_t bits) {  // (0, 1]
  return (static_cast<double>(bits >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

// The full parameter's element for element e of a shard with `shard_cols` columns.
std::int64_t full_element(const ShardMap& m, std::int64_t shard_cols, std::int64_t e) {
  switch (m.kind) {
    case ShardKind::kReplicated:
      return e;
    case ShardKind::kColumns: {
      const std::int64_t full_cols = m.full_shape[1];
      return (e / shard_cols) * full_cols + m.col_begin + e % shard_cols;
    }
    case ShardKind::kRows: {
      std::int64_t r = e / shard_cols;
      for (const ShardRows& b : m.rows) {
        if (r < b.rows) return (b.full_begin + r) * shard_cols + e % shard_cols;
        r -= b.rows;
      }
      return -1;  // outside the shard: not reached for e < numel
    }
  }
  return -1;
}

}  // namespace

std::string_view to_string(ShardKind kind) {
  switch (kind) {
    case ShardKind::kReplicated:
      return "replicated";
    case ShardKind::kRows:
      return "rows";
    case ShardKind::kColumns:
      return "columns";
  }
  return "unknown";
}

std::int64_t ShardMap::full_numel() const {
  std::int64_t n = 1;
  for (auto d : full_shape) n *= d;
  return n;
}

// Both directions walk the shard's rows: a row of a kRows shard is a whole full row; a row of a
// kColumns shard is a contiguous piece of one.
void shard_from_full(const ParamDesc& p, const float* full, float* shard) {
  const std::int64_t rows = p.shape[0], cols = p.numel() / std::max<std::int64_t>(rows, 1);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t at = full_element(p.shard, cols, r * cols);
    std::memcpy(shard + r * cols, full + at, static_cast<std::size_t>(cols) * sizeof(float));
  }
}

void full_from_shard(const ParamDesc& p, const float* shard, float* full) {
  const std::int64_t rows = p.shape[0], cols = p.numel() / std::max<std::int64_t>(rows, 1);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t at = full_element(p.shard, cols, r * cols);
    std::memcpy(full + at, shard + r * cols, static_cast<std::size_t>(cols) * sizeof(float));
  }
}

std::vector<ElementRun> shard_runs(const ParamDesc& p, std::int64_t begin, std::int64_t end) {
  std::vector<ElementRun> runs;
  const std::int64_t cols = p.numel() / std::max<std::int64_t>(p.shape[0], 1);
  for (std::int64_t e = begin; e < end;) {
    const std::int64_t row_end = std::min(end, (e / cols + 1) * cols);
    const std::int64_t at = full_element(p.shard, cols, e);
    if (!runs.empty() && runs.back().full_begin + runs.back().count == at) {
      runs.back().count += row_end - e;
    } else {
      runs.push_back({at, row_end - e});
    }
    e = row_end;
  }
  return runs;
}

std::string_view to_string(ModelKind kind) { return kind == ModelKind::kGpt2 ? "gpt2" : "llama"; }

Result<ModelKind> parse_model_kind(std::string_view text) {
  if (text == "gpt2") return ModelKind::kGpt2;
  if (text == "llama") return ModelKind::kLlama;
  return invalid_argument("model '" + std::string(text) + "' is not one of: gpt2, llama");
}

std::string_view to_string(ModuleKind kind) {
  switch (kind) {
    case ModuleKind::kEmbedding:
      return "embedding";
    case ModuleKind::kBlock:
      return "block";
    case ModuleKind::kHead:
      return "head";
  }
  return "unknown";
}

std::int64_t ModelConfig::ffn() const {
  if (ffn_hidden > 0) return ffn_hidden;
  if (kind == ModelKind::kGpt2) return 4 * n_embd;
  const std::int64_t f = (8 * n_embd + 2) / 3;
  return (f + 63) / 64 * 64;
}

std::int64_t ModelConfig::padded_vocab() const {
  if (vocab_multiple <= 1 || vocab_size <= vocab_multiple) return vocab_size;
  return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple;
}

Status ModelConfig::validate() const {
  auto range = [](std::string_view field, std::int64_t v, std::int64_t lo, std::int64_t hi) -> Status {
    if (v < lo || v > hi) {
      return invalid_argument(
          field_error(field, v, "is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]"));
    }
    return ok_status();
  };
  STRATA_RETURN_IF_ERROR(range("n_layer", n_layer, 1, 4096));
  STRATA_RETURN_IF_ERROR(range("n_head", n_head, 1, 4096));
  STRATA_RETURN_IF_ERROR(range("n_embd", n_embd, 1, 1 << 17));
  STRATA_RETURN_IF_ERROR(range("n_positions", n_positions, 1, 1 << 20));
  STRATA_RETURN_IF_ERROR(range("vocab_size", vocab_size, 1, std::numeric_limits<std::int32_t>::max() / 2));
  STRATA_RETURN_IF_ERROR(range("ffn_hidden", ffn_hidden, 0, 1 << 20));
  STRATA_RETURN_IF_ERROR(range("vocab_multiple", vocab_multiple, 1, 1 << 16));
  if (n_embd % n_head != 0) {
    return invalid_argument(
        field_error("n_embd", n_embd, "is not a multiple of n_head = " + std::to_string(n_head)));
  }
  if (kind == ModelKind::kGpt2 && n_kv_head != 0 && n_kv_head != n_head) {
    return invalid_argument(
        field_error("n_kv_head", n_kv_head, "must equal n_head for gpt2 (no grouped-query attention)"));
  }
  if (kind == ModelKind::kLlama) {
    STRATA_RETURN_IF_ERROR(range("n_kv_head", n_kv_head, 0, n_head));
    if (n_head % kv_heads() != 0) {
      return invalid_argument(
          field_error("n_kv_head", n_kv_head, "does not divide n_head = " + std::to_string(n_head)));
    }
    if (head_dim() % 2 != 0) {
      return invalid_argument(field_error(
          "n_embd", n_embd,
          "gives an odd head_dim " + std::to_string(head_dim()) + " (rotary embeddings rotate pairs)"));
    }
    if (!(rope_theta > 0.0) || !std::isfinite(rope_theta)) {
      return invalid_argument("model config: rope_theta = " + std::to_string(rope_theta) +
                              " must be positive");
    }
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return invalid_argument("model config: dtype " + std::string(to_string(dtype)) +
                            " is not supported for training (f32, bf16 or f16)");
  }
  if (!(norm_eps > 0.0) || !std::isfinite(norm_eps)) {
    return invalid_argument("model config: norm_eps = " + std::to_string(norm_eps) + " must be positive");
  }
  if (!(init_std > 0.0) || !std::isfinite(init_std)) {
    return invalid_argument("model config: init_std = " + std::to_string(init_std) + " must be positive");
  }
  return ok_status();
}

std::string hf_config_json(const ModelConfig& c) {
  Json j;
  const char* torch_dtype =
      c.dtype == DType::kBF16 ? "bfloat16" : (c.dtype == DType::kF16 ? "float16" : "float32");
  if (c.kind == ModelKind::kGpt2) {
    j["architectures"] = Json::array({"GPT2LMHeadModel"});
    j["model_type"] = "gpt2";
    j["n_layer"] = c.n_layer;
    j["n_head"] = c.n_head;
    j["n_embd"] = c.n_embd;
    j["n_positions"] = c.n_positions;
    j["n_ctx"] = c.n_positions;
    j["vocab_size"] = c.vocab_size;
    if (c.ffn() != 4 * c.n_embd) {
      j["n_inner"] = c.ffn();
    } else {
      j["n_inner"] = nullptr;
    }
    j["layer_norm_epsilon"] = c.norm_eps;
    j["activation_function"] = "gelu_new";
    j["tie_word_embeddings"] = true;
  } else {
    j["architectures"] = Json::array({"LlamaForCausalLM"});
    j["model_type"] = "llama";
    j["num_hidden_layers"] = c.n_layer;
    j["num_attention_heads"] = c.n_head;
    j["num_key_value_heads"] = c.kv_heads();
    j["hidden_size"] = c.n_embd;
    j["head_dim"] = c.head_dim();
    j["intermediate_size"] = c.ffn();
    j["max_position_embeddings"] = c.n_positions;
    j["vocab_size"] = c.vocab_size;
    j["rms_norm_eps"] = c.norm_eps;
    j["rope_theta"] = c.rope_theta;
    j["hidden_act"] = "silu";
    j["tie_word_embeddings"] = false;
  }
  j["initializer_range"] = c.init_std;
  j["torch_dtype"] = torch_dtype;
  return j.dump();
}

Result<ModelConfig> model_config_from_hf_json(std::string_view text, std::string_view source) {
  const std::string where(source);
  Json j = Json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument(where + ": the model config is not a JSON object");
  auto get_int = [&](const char* key, std::int64_t fallback, bool required) -> Result<std::int64_t> {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) return invalid_argument(where + ": model config has no '" + key + "'");
      return fallback;
    }
    if (!j[key].is_number_integer())
      return invalid_argument(where + ": model config '" + key + "' is not an integer");
    return j[key].get<std::int64_t>();
  };
  auto get_double = [&](const char* key, double fallback) -> Result<double> {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number()) return invalid_argument(where + ": model config '" + key + "' is not a number");
    return j[key].get<double>();
  };
  std::string type;
  if (j.contains("model_type") && j["model_type"].is_string()) type = j["model_type"].get<std::string>();
  if (type.empty()) type = j.contains("hidden_size") ? "llama" : "gpt2";
  ModelConfig c;
  if (type == "gpt2") {
    c.kind = ModelKind::kGpt2;
    STRATA_ASSIGN_OR_RETURN(c.n_layer, get_int("n_layer", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.n_head, get_int("n_head", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.n_embd, get_int("n_embd", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.n_positions, get_int("n_positions", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.vocab_size, get_int("vocab_size", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.ffn_hidden, get_int("n_inner", 0, false));
    STRATA_ASSIGN_OR_RETURN(c.norm_eps, get_double("layer_norm_epsilon", 1e-5));
  } else if (type == "llama") {
    c.kind = ModelKind::kLlama;
    STRATA_ASSIGN_OR_RETURN(c.n_layer, get_int("num_hidden_layers", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.n_head, get_int("num_attention_heads", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.n_kv_head, get_int("num_key_value_heads", 0, false));
    STRATA_ASSIGN_OR_RETURN(c.n_embd, get_int("hidden_size", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.ffn_hidden, get_int("intermediate_size", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.n_positions, get_int("max_position_embeddings", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.vocab_size, get_int("vocab_size", 0, true));
    STRATA_ASSIGN_OR_RETURN(c.norm_eps, get_double("rms_norm_eps", 1e-6));
    STRATA_ASSIGN_OR_RETURN(c.rope_theta, get_double("rope_theta", 10000.0));
    STRATA_ASSIGN_OR_RETURN(std::int64_t head_dim, get_int("head_dim", 0, false));
    if (head_dim != 0 && c.n_head > 0 && head_dim * c.n_head != c.n_embd) {
      return invalid_argument(where + ": model config head_dim = " + std::to_string(head_dim) +
                              " is not hidden_size / num_attention_heads (Strata requires that)");
    }
    if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean() &&
        j["tie_word_embeddings"].get<bool>()) {
      return invalid_argument(
          where + ": LLaMA with tie_word_embeddings = true is not supported (the head is untied)");
    }
  } else {
    return invalid_argument(where + ": model_type '" + type + "' is not one of: gpt2, llama");
  }
  STRATA_ASSIGN_OR_RETURN(c.init_std, get_double("initializer_range", 0.02));
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) {
    const std::string td = j["torch_dtype"].get<std::string>();
    c.dtype = td == "bfloat16" ? DType::kBF16 : (td == "float16" ? DType::kF16 : DType::kF32);
  }
  Status s = c.validate();
  if (!s.ok()) return s.with_context(where);
  return c;
}

std::string model_config_to_json(const ModelConfig& c) {
  Json j;
  j["kind"] = to_string(c.kind);
  j["n_layer"] = c.n_layer;
  j["n_head"] = c.n_head;
  j["n_kv_head"] = c.n_kv_head;
  j["n_embd"] = c.n_embd;
  j["n_positions"] = c.n_positions;
  j["vocab_size"] = c.vocab_size;
  j["ffn_hidden"] = c.ffn_hidden;
  j["vocab_multiple"] = c.vocab_multiple;
  j["norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["dtype"] = to_string(c.dtype);
  j["activation_checkpointing"] = c.activation_checkpointing;
  j["init_std"] = c.init_std;
  return j.dump();
}

Result<ModelConfig> model_config_from_json(std::string_view text, std::string_view source) {
  const std::string where(source);
  Json j = Json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument(where + ": the model config is not a JSON object");
  ModelConfig c;
  for (const auto& item : j.items()) {
    const std::string& key = item.key();
    const Json& v = item.value();
    auto int_field = [&](std::int64_t* dst) -> Status {
      if (!v.is_number_integer()) return invalid_argument(where + ": '" + key + "' is not an integer");
      *dst = v.get<std::int64_t>();
      return ok_status();
    };
    auto num_field = [&](double* dst) -> Status {
      if (!v.is_number()) return invalid_argument(where + ": '" + key + "' is not a number");
      *dst = v.get<double>();
      return ok_status();
    };
    if (key == "kind" || key == "dtype") {
      if (!v.is_string()) return invalid_argument(where + ": '" + key + "' is not a string");
      if (key == "kind") {
        auto k = parse_model_kind(v.get<std::string>());
        if (!k.ok()) return k.status().with_context(where);
        c.kind = *k;
      } else {
        auto d = parse_dtype(v.get<std::string>());
        if (!d.ok()) return d.status().with_context(where);
        c.dtype = *d;
      }
    } else if (key == "n_layer") {
      STRATA_RETURN_IF_ERROR(int_field(&c.n_layer));
    } else if (key == "n_head") {
      STRATA_RETURN_IF_ERROR(int_field(&c.n_head));
    } else if (key == "n_kv_head") {
      STRATA_RETURN_IF_ERROR(int_field(&c.n_kv_head));
    } else if (key == "n_embd") {
      STRATA_RETURN_IF_ERROR(int_field(&c.n_embd));
    } else if (key == "n_positions") {
      STRATA_RETURN_IF_ERROR(int_field(&c.n_positions));
    } else if (key == "vocab_size") {
      STRATA_RETURN_IF_ERROR(int_field(&c.vocab_size));
    } else if (key == "ffn_hidden") {
      STRATA_RETURN_IF_ERROR(int_field(&c.ffn_hidden));
    } else if (key == "vocab_multiple") {
      STRATA_RETURN_IF_ERROR(int_field(&c.vocab_multiple));
    } else if (key == "norm_eps") {
      STRATA_RETURN_IF_ERROR(num_field(&c.norm_eps));
    } else if (key == "rope_theta") {
      STRATA_RETURN_IF_ERROR(num_field(&c.rope_theta));
    } else if (key == "init_std") {
      STRATA_RETURN_IF_ERROR(num_field(&c.init_std));
    } else if (key == "activation_checkpointing") {
      if (!v.is_boolean()) return invalid_argument(where + ": '" + key + "' is not a boolean");
      c.activation_checkpointing = v.get<bool>();
    } else {
      return invalid_argument(where + ": unknown model config key '" + key + "'");
    }
  }
  Status s = c.validate();
  if (!s.ok()) return s.with_context(where);
  return c;
}

std::int64_t ParamDesc::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::int64_t ModelLayout::num_parameters() const {
  std::int64_t n = 0;
  for (const auto& p : params) {
    if (p.owns_storage()) n += p.numel();
  }
  return n;
}

int ModelLayout::find(std::string_view name) const {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

Status ModelLayout::is_valid() const {
  std::set<std::string> names;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pranges, granges;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamDesc& p = params[i];
    const std::string who = "parameter '" + p.name + "'";
    if (!names.insert(p.name).second) return internal_error("layout: duplicate " + who);
    if (p.module < 0 || p.module >= static_cast<int>(modules.size()))
      return internal_error("layout: " + who + " has no module");
    const auto& mp = modules[static_cast<std::size_t>(p.module)].params;
    if (std::find(mp.begin(), mp.end(), static_cast<int>(i)) == mp.end()) {
      return internal_error("layout: " + who + " is not listed by its module");
    }
    if (!p.owns_storage()) {
      if (p.tied_with >= static_cast<int>(params.size()) ||
          !params[static_cast<std::size_t>(p.tied_with)].owns_storage()) {
        return internal_error("layout: " + who + " is tied to a parameter that does not own storage");
      }
      const ParamDesc& t = params[static_cast<std::size_t>(p.tied_with)];
      if (t.shape != p.shape || t.param_offset != p.param_offset || t.grad_offset != p.grad_offset) {
        return internal_error("layout: " + who + " does not match the parameter it is tied to");
      }
      continue;
    }
    const auto n = static_cast<std::uint64_t>(p.numel());
    if (p.param_offset % kParamAlignment != 0 || p.grad_offset % kParamAlignment != 0) {
      return internal_error("layout: " + who + " is not aligned");
    }
    const ModuleDesc& m = modules[static_cast<std::size_t>(p.module)];
    const std::uint64_t pend = p.param_offset + n * dtype_size(p.dtype);
    const std::uint64_t gend = p.grad_offset + n * 4;
    if (pend > param_bytes || gend > grad_bytes)
      return internal_error("layout: " + who + " ends outside its region");
    if (p.param_offset < m.param_begin || pend > m.param_end || p.grad_offset < m.grad_begin ||
        gend > m.grad_end) {
      return internal_error("layout: " + who + " lies outside its module's range");
    }
    pranges.emplace_back(p.param_offset, pend);
    granges.emplace_back(p.grad_offset, gend);
    std::int64_t exported = 0;
    for (const auto& e : p.exports) {
      if (e.row_begin < 0 || e.rows < 1 || e.row_begin + e.rows > p.shape[0]) {
        return internal_error("layout: export '" + e.name + "' of " + who + " is outside its rows");
      }
      exported += e.rows;
    }
    (void)exported;
  }
  for (auto* ranges : {&pranges, &granges}) {
    std::sort(ranges->begin(), ranges->end());
    for (std::size_t i = 1; i < ranges->size(); ++i) {
      if ((*ranges)[i].first < (*ranges)[i - 1].second)
        return internal_error("layout: parameter storage overlaps");
    }
  }
  for (std::size_t i = 1; i < modules.size(); ++i) {
    if (modules[i].param_begin < modules[i - 1].param_end)
      return internal_error("layout: module ranges overlap");
  }
  return ok_status();
}

Status check_tensor_parallel(const ModelConfig& c, int tp) {
  STRATA_RETURN_IF_ERROR(c.validate());
  const std::string of = " over tensor_parallel_size = " + std::to_string(tp);
  if (tp < 1) return invalid_argument("tensor_parallel_size = " + std::to_string(tp) + " must be at least 1");
  if (tp == 1) return ok_status();
  if (c.n_head % tp != 0) {
    return invalid_argument(field_error("n_head", c.n_head, "query heads do not split evenly" + of));
  }
  if (c.kv_heads() % tp != 0) {
    return invalid_argument(field_error(c.n_kv_head > 0 ? "n_kv_head" : "n_head (= n_kv_head)", c.kv_heads(),
                                        "kv heads do not split evenly" + of +
                                            " (each rank keeps whole grouped kv heads)"));
  }
  if (c.ffn() % tp != 0) {
    return invalid_argument(field_error("ffn_hidden", c.ffn(), "(the MLP width) does not split evenly" + of));
  }
  if (c.padded_vocab() % tp != 0) {
    return invalid_argument(field_error("vocab_size", c.vocab_size,
                                        "padded to " + std::to_string(c.padded_vocab()) + " (vocab_multiple = " +
                                            std::to_string(c.vocab_multiple) + ") does not split evenly" + of +
                                            "; raise vocab_multiple to a multiple of it"));
  }
  return ok_status();
}

Result<ModelLayout> describe_model(const ModelConfig& config, TensorParallel tp) {
  STRATA_RETURN_IF_ERROR(check_tensor_parallel(config, tp.size));
  if (tp.rank < 0 || tp.rank >= tp.size) {
    return invalid_argument("tensor-parallel rank " + std::to_string(tp.rank) + " is outside [0, " +
                            std::to_string(tp.size) + ")");
  }
  LayoutBuilder b(config, tp);
  if (config.kind == ModelKind::kGpt2) {
    describe_gpt2(config, b);
  } else {
    describe_llama(config, b);
  }
  ModelLayout layout = b.finish();
  STRATA_RETURN_IF_ERROR(layout.is_valid());
  return layout;
}

std::vector<GemmShape> model_gemms(const ModelConfig& c, std::int64_t batch, std::int64_t seq_len) {
  const std::int64_t M = batch * seq_len, C = c.n_embd, F = c.ffn(), Vp = c.padded_vocab();
  const int L = static_cast<int>(c.n_layer);
  std::vector<GemmShape> out;
  // A linear layer (in -> out) over M rows: forward, input gradient, weight gradient.
  auto linear = [&](const std::string& what, std::int64_t in, std::int64_t outf, int count) {
    out.push_back(GemmShape{what + " forward", M, outf, in, false, true, false, count});
    out.push_back(GemmShape{what + " dinp", M, in, outf, false, false, false, count});
    out.push_back(GemmShape{what + " dweight", outf, in, M, true, false, true, count});
  };
  if (c.kind == ModelKind::kGpt2) {
    linear("attn.c_attn", C, 3 * C, L);
    linear("attn.c_proj", C, C, L);
    linear("mlp.c_fc", C, F, L);
    linear("mlp.c_proj", F, C, L);
  } else {
    const std::int64_t D = c.head_dim(), H = c.n_head, Hkv = c.kv_heads();
    linear("self_attn.qkv_proj", C, (H + 2 * Hkv) * D, L);
    linear("self_attn.o_proj", H * D, C, L);
    linear("mlp.gate_up_proj", C, 2 * F, L);
    linear("mlp.down_proj", F, C, L);
  }
  linear("lm_head", C, Vp, 1);
  return out;
}

double model_flops(const ModelConfig& c, std::int64_t batch, std::int64_t seq_len, bool forward_only) {
  double forward = 0.0;
  for (const auto& g : model_gemms(c, batch, seq_len)) {
    if (g.what.size() >= 8 && g.what.compare(g.what.size() - 8, 8, " forward") == 0) {
      forward +=
          2.0 * static_cast<double>(g.M) * static_cast<double>(g.N) * static_cast<double>(g.K) * g.count;
    }
  }
  // Causal attention: query t sees t+1 keys; scores and the weighted sum are 2·D flops per pair each.
  const double T = static_cast<double>(seq_len);
  const double pairs = T * (T + 1.0) / 2.0;
  forward += static_cast<double>(c.n_layer) * static_cast<double>(batch) * static_cast<double>(c.n_head) *
             2.0 * (2.0 * static_cast<double>(c.head_dim()) * pairs);
  return forward_only ? forward : 3.0 * forward;
}

void init_values(const ModelLayout& layout, int index, std::uint64_t seed, std::int64_t begin, std::int64_t n,
                 float* out) {
  const ParamDesc& p = layout.params[static_cast<std::size_t>(index)];
  switch (p.init.kind) {
    case InitKind::kZeros:
      std::fill(out, out + n, 0.0f);
      return;
    case InitKind::kOnes:
      std::fill(out, out + n, 1.0f);
      return;
    case InitKind::kNormal:
      break;
  }
  const std::uint64_t stream = mix64(seed ^ mix64(static_cast<std::uint64_t>(index) + 0x5eed));
  const std::int64_t full_rows = p.shard.full_shape[0];
  const std::int64_t cols = p.shard.full_numel() / full_rows;
  const std::int64_t shard_cols = p.numel() / p.shape[0];
  const std::int64_t real_rows = p.shard.full_real_rows;
  // Each element is a function of (seed, index, position in the full parameter) alone, so the
  // threads split it freely and a shard gets the values of the full parameter's elements.
#pragma omp parallel for schedule(static) if (n >= (1 << 18))
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t e = full_element(p.shard, shard_cols, begin + i);
    if (e / cols >= real_rows) {  // padded vocabulary rows stay zero: they are never exported
      out[i] = 0.0f;
      continue;
    }
    // Box-Muller on the pair (2k, 2k+1): element e takes the cosine or sine branch.
    const std::uint64_t pair = static_cast<std::uint64_t>(e) / 2;
    const double u1 = uniform01(mix64(stream ^ mix64(2 * pair)));
    const double u2 = uniform01(mix64(stream ^ mix64(2 * pair + 1)));
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * 3.14159265358979323846 * u2;
    const double z = (e % 2 == 0) ? r * std::cos(angle) : r * std::sin(angle);
    out[i] = static_cast<float>(z * p.init.std);
  }
}

}  // namespace strata
