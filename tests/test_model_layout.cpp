// The descriptor table of the built-in models: parameter counts, names, flags, ties, module
// ranges, initialisation, configs and the FLOP formula. No device needed.
#include <algorithm>
#include <cmath>
#include <span>
#include <utility>
#include <nlohmann/json.hpp>

#include "harness/harness.hpp"
#include "strata/model.hpp"
#include "strata/safetensors.hpp"

namespace strata::testing {
namespace {

ModelConfig gpt2(std::int64_t L, std::int64_t C, std::int64_t H, std::int64_t V, std::int64_t P) {
  ModelConfig c;
  c.kind = ModelKind::kGpt2;
  c.n_layer = L;
  c.n_embd = C;
  c.n_head = H;
  c.vocab_size = V;
  c.n_positions = P;
  return c;
}

ModelConfig llama(std::int64_t L, std::int64_t C, std::int64_t H, std::int64_t Hkv, std::int64_t V) {
  ModelConfig c;
  c.kind = ModelKind::kLlama;
  c.n_layer = L;
  c.n_embd = C;
  c.n_head = H;
  c.n_kv_head = Hkv;
  c.vocab_size = V;
  c.n_positions = 64;
  return c;
}

TEST(ModelLayout, Gpt2CountsNamesFlagsAndTies) {
  const ModelConfig c = gpt2(3, 48, 4, 300, 40);  // vocab 300 pads to 320
  auto layout = describe_model(c);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const std::int64_t C = 48, L = 3, V = 300, Vp = 320, P = 40;
  EXPECT_EQ(c.padded_vocab(), Vp);
  // wte (padded) + wpe + per block (12C² + 13C) + ln_f; the tied head adds nothing.
  EXPECT_EQ(layout->num_parameters(), Vp * C + P * C + L * (12 * C * C + 13 * C) + 2 * C);
  EXPECT_EQ(layout->modules.size(), static_cast<std::size_t>(L + 2));
  EXPECT_EQ(layout->modules.front().kind, ModuleKind::kEmbedding);
  EXPECT_EQ(layout->modules.back().kind, ModuleKind::kHead);
  STRATA_EXPECT_OK(layout->is_valid());

  const int wte = layout->find("wte.weight");
  const int head = layout->find("lm_head.weight");
  ASSERT_GE(wte, 0);
  ASSERT_GE(head, 0);
  EXPECT_EQ(layout->params[static_cast<std::size_t>(head)].tied_with, wte);
  EXPECT_EQ(layout->params[static_cast<std::size_t>(head)].param_offset,
            layout->params[static_cast<std::size_t>(wte)].param_offset);
  EXPECT_TRUE(layout->params[static_cast<std::size_t>(head)].exports.empty());
  // wte exports only the real vocabulary.
  ASSERT_EQ(layout->params[static_cast<std::size_t>(wte)].exports.size(), 1u);
  EXPECT_EQ(layout->params[static_cast<std::size_t>(wte)].exports[0].rows, V);

  const auto& attn = layout->params[static_cast<std::size_t>(layout->find("h.1.attn.c_attn.weight"))];
  EXPECT_EQ(attn.shape, (std::vector<std::int64_t>{3 * C, C}));
  EXPECT_TRUE(attn.weight_decay);
  ASSERT_EQ(attn.exports.size(), 1u);
  EXPECT_TRUE(attn.exports[0].transpose);  // Conv1D layout in HF
  EXPECT_EQ(attn.module, 2);               // embedding is module 0, h.0 module 1
  for (const char* no_decay :
       {"h.0.ln_1.weight", "h.0.ln_1.bias", "h.2.mlp.c_fc.bias", "wpe.weight", "ln_f.bias"}) {
    EXPECT_FALSE(layout->params[static_cast<std::size_t>(layout->find(no_decay))].weight_decay) << no_decay;
  }
  // A module's own parameters are one contiguous range, in declaration order.
  for (const auto& m : layout->modules) {
    std::uint64_t cursor = m.param_begin;
    for (int i : m.params) {
      const auto& p = layout->params[static_cast<std::size_t>(i)];
      if (!p.owns_storage()) continue;
      EXPECT_GE(p.param_offset, cursor) << p.name;
      cursor = p.param_offset + static_cast<std::uint64_t>(p.numel()) * 4;
    }
    EXPECT_LE(cursor, m.param_end) << m.name;
  }
}

TEST(ModelLayout, LlamaFusedProjectionsExportAsHuggingFaceTensors) {
  const ModelConfig c = llama(2, 64, 8, 2, 256);
  auto layout = describe_model(c);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const std::int64_t C = 64, D = 8, H = 8, Hkv = 2, F = c.ffn(), V = 256, L = 2;
  EXPECT_EQ(F, 192);  // 8/3·64 = 170.7 → multiple of 64
  const std::int64_t per_block = 2 * C + (H + 2 * Hkv) * D * C + C * H * D + 3 * F * C;
  EXPECT_EQ(layout->num_parameters(), 2 * V * C + L * per_block + C);
  const auto& qkv =
      layout->params[static_cast<std::size_t>(layout->find("model.layers.1.self_attn.qkv_proj.weight"))];
  ASSERT_EQ(qkv.exports.size(), 3u);
  EXPECT_EQ(qkv.exports[0].name, "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(qkv.exports[1].row_begin, H * D);
  EXPECT_EQ(qkv.exports[1].rows, Hkv * D);
  EXPECT_EQ(qkv.exports[2].name, "model.layers.1.self_attn.v_proj.weight");
  EXPECT_EQ(qkv.exports[2].row_begin, (H + Hkv) * D);
  const auto& gu =
      layout->params[static_cast<std::size_t>(layout->find("model.layers.0.mlp.gate_up_proj.weight"))];
  ASSERT_EQ(gu.exports.size(), 2u);
  EXPECT_EQ(gu.exports[1].name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(gu.exports[1].row_begin, F);
  EXPECT_GE(layout->find("lm_head.weight"), 0);
  EXPECT_TRUE(layout->params[static_cast<std::size_t>(layout->find("lm_head.weight"))].owns_storage());
}

TEST(ModelLayout, Bf16HalvesParameterBytesNotGradientBytes) {
  ModelConfig c = gpt2(2, 64, 4, 256, 32);
  auto f32 = describe_model(c);
  c.dtype = DType::kBF16;
  auto bf16 = describe_model(c);
  ASSERT_TRUE(f32.ok() && bf16.ok());
  EXPECT_EQ(f32->grad_bytes, bf16->grad_bytes);
  EXPECT_LT(bf16->param_bytes, f32->param_bytes * 6 / 10);
  STRATA_EXPECT_OK(bf16->is_valid());
}

TEST(ModelConfig, ValidationNamesTheField) {
  ModelConfig c = gpt2(2, 100, 3, 256, 32);
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "n_embd");
  c = gpt2(0, 64, 4, 256, 32);
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "n_layer");
  c = llama(2, 64, 8, 3, 256);
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "n_kv_head");
  c = llama(2, 24, 8, 0, 256);  // head_dim 3 cannot rotate pairs
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "head_dim");
  c = gpt2(2, 64, 4, 256, 32);
  c.n_kv_head = 2;
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "n_kv_head");
  STRATA_EXPECT_ERROR(describe_model(gpt2(2, 64, 4, 0, 32)), kInvalidArgument, "vocab_size");
}

TEST(ModelConfig, HuggingFaceAndNativeJsonRoundTrip) {
  ModelConfig g = gpt2(5, 96, 6, 50257, 1024);
  auto hf = nlohmann::json::parse(hf_config_json(g));
  EXPECT_EQ(hf["model_type"], "gpt2");
  EXPECT_EQ(hf["n_layer"], 5);
  EXPECT_EQ(hf["n_embd"], 96);
  EXPECT_EQ(hf["n_positions"], 1024);
  EXPECT_EQ(hf["vocab_size"], 50257);
  auto back = model_config_from_hf_json(hf_config_json(g), "test");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->n_layer, 5);
  EXPECT_EQ(back->ffn(), g.ffn());

  ModelConfig l = llama(3, 64, 8, 4, 1000);
  l.dtype = DType::kBF16;
  auto lj = nlohmann::json::parse(hf_config_json(l));
  EXPECT_EQ(lj["model_type"], "llama");
  EXPECT_EQ(lj["num_key_value_heads"], 4);
  EXPECT_EQ(lj["intermediate_size"], l.ffn());
  EXPECT_EQ(lj["torch_dtype"], "bfloat16");
  auto lb = model_config_from_hf_json(hf_config_json(l), "test");
  ASSERT_TRUE(lb.ok()) << lb.status().to_string();
  EXPECT_EQ(lb->kind, ModelKind::kLlama);
  EXPECT_EQ(lb->kv_heads(), 4);
  EXPECT_EQ(lb->dtype, DType::kBF16);

  l.activation_checkpointing = true;
  l.vocab_multiple = 128;
  auto nb = model_config_from_json(model_config_to_json(l), "test");
  ASSERT_TRUE(nb.ok()) << nb.status().to_string();
  EXPECT_EQ(model_config_to_json(*nb), model_config_to_json(l));

  STRATA_EXPECT_ERROR(model_config_from_hf_json("{\"model_type\": \"gpt2\", \"n_layer\": 2}", "cfg.json"),
                      kInvalidArgument, "cfg.json");
  STRATA_EXPECT_ERROR(model_config_from_json("{\"n_layers\": 2}", "x"), kInvalidArgument, "n_layers");
}

TEST(ModelLayout, InitIsDeterministicChunkIndependentAndScaled) {
  auto layout = describe_model(gpt2(4, 64, 4, 256, 32));
  ASSERT_TRUE(layout.ok());
  const int fc = layout->find("h.0.mlp.c_fc.weight");
  const int proj = layout->find("h.0.mlp.c_proj.weight");
  const auto n = layout->params[static_cast<std::size_t>(fc)].numel();
  std::vector<float> a(static_cast<std::size_t>(n)), b(a.size()), other(a.size());
  init_values(*layout, fc, 7, 0, n, a.data());
  init_values(*layout, fc, 7, 0, 1001, b.data());
  init_values(*layout, fc, 7, 1001, n - 1001, b.data() + 1001);
  EXPECT_EQ(a, b);
  init_values(*layout, fc, 8, 0, n, other.data());
  EXPECT_NE(a, other);
  double sum = 0, sq = 0;
  for (float v : a) {
    sum += v;
    sq += static_cast<double>(v) * v;
  }
  const double mean = sum / static_cast<double>(n), sd = std::sqrt(sq / static_cast<double>(n) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.002);
  EXPECT_NEAR(sd, 0.02, 0.001);
  // Residual projections are scaled by 1/sqrt(2L).
  std::vector<float> p(static_cast<std::size_t>(layout->params[static_cast<std::size_t>(proj)].numel()));
  init_values(*layout, proj, 7, 0, static_cast<std::int64_t>(p.size()), p.data());
  double psq = 0;
  for (float v : p) psq += static_cast<double>(v) * v;
  EXPECT_NEAR(std::sqrt(psq / static_cast<double>(p.size())), 0.02 / std::sqrt(8.0), 0.001);
  std::vector<float> ln(64);
  init_values(*layout, layout->find("h.0.ln_1.weight"), 7, 0, 64, ln.data());
  EXPECT_EQ(ln, std::vector<float>(64, 1.0f));
}

TEST(ModelFlops, MatchesTheFormula) {
  const ModelConfig c = gpt2(2, 64, 4, 256, 128);
  const std::int64_t B = 3, T = 16, C = 64, N = B * T;
  // Forward: 24·C² per token per layer in the blocks, 2·C·V in the head, causal attention.
  const double fwd =
      2.0 * N * 12 * C * C * 2 + 2.0 * N * C * 256 + 2 * B * 4 * 2.0 * (2.0 * 16 * T * (T + 1) / 2.0);
  EXPECT_DOUBLE_EQ(model_flops(c, B, T, true), fwd);
  EXPECT_DOUBLE_EQ(model_flops(c, B, T), 3 * fwd);
  // Every linear appears as forward, dinp and dweight.
  const auto gemms = model_gemms(c, B, T);
  EXPECT_EQ(gemms.size(), 15u);
  EXPECT_EQ(gemms[2].M, 3 * C);  // c_attn dweight: (out, in) += doutᵀ·inp
  EXPECT_EQ(gemms[2].K, N);
  EXPECT_TRUE(gemms[2].trans_a);
}

// ---- tensor-parallel shards ----

// For tp = 2 and 4 (GPT-2 and LLaMA with grouped kv heads): every element of every full parameter
// is held by exactly one rank (split parameters) or by every rank (replicated ones, whole);
// shard_from_full / full_from_shard round-trip; each shard's init_values are the full
// parameter's values at the elements it holds, so a tensor-parallel run starts where one process
// does; and the shards of one rank are the table of a model of the same modules.
void expect_shards_tile(const ModelConfig& c, int tp) {
  auto full = describe_model(c);
  ASSERT_TRUE(full.ok()) << full.status().to_string();
  std::vector<ModelLayout> shards;
  for (int r = 0; r < tp; ++r) {
    auto s = describe_model(c, TensorParallel{tp, r});
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    ASSERT_EQ(s->params.size(), full->params.size());
    ASSERT_EQ(s->modules.size(), full->modules.size());
    shards.push_back(std::move(*s));
  }
  const std::string what = std::string(to_string(c.kind)) + " tp=" + std::to_string(tp);
  std::int64_t split = 0;
  for (std::size_t i = 0; i < full->params.size(); ++i) {
    const ParamDesc& f = full->params[i];
    if (!f.owns_storage()) {
      for (const auto& s : shards) EXPECT_EQ(s.params[i].tied_with, f.tied_with) << what << " " << f.name;
      continue;
    }
    std::vector<float> values(static_cast<std::size_t>(f.numel()));
    init_values(*full, static_cast<int>(i), 42, 0, f.numel(), values.data());
    std::vector<int> hits(values.size(), 0);
    for (int r = 0; r < tp; ++r) {
      const ParamDesc& p = shards[static_cast<std::size_t>(r)].params[i];
      EXPECT_EQ(p.name, f.name);
      EXPECT_EQ(p.shard.full_shape, f.shape) << what << " " << f.name;
      if (p.shard.kind == ShardKind::kReplicated) {
        EXPECT_EQ(p.shape, f.shape) << what << " " << f.name;
      } else {
        EXPECT_EQ(p.numel() * tp, f.numel()) << what << " " << f.name;
        EXPECT_TRUE(p.exports.empty());
      }
      // Mark the elements this shard holds: its own indices, through full_from_shard.
      std::vector<float> index(static_cast<std::size_t>(p.numel())), placed(values.size(), -1.0f);
      for (std::size_t k = 0; k < index.size(); ++k) index[k] = static_cast<float>(k);
      full_from_shard(p, index.data(), placed.data());
      for (std::size_t k = 0; k < placed.size(); ++k) hits[k] += placed[k] >= 0.0f ? 1 : 0;
      // shard_from_full is its inverse, and init_values gives the full parameter's values.
      std::vector<float> back(index.size()), init(index.size()), sliced(index.size());
      shard_from_full(p, placed.data(), back.data());
      EXPECT_EQ(back, index) << what << " " << f.name;
      init_values(shards[static_cast<std::size_t>(r)], static_cast<int>(i), 42, 0, p.numel(), init.data());
      shard_from_full(p, values.data(), sliced.data());
      EXPECT_EQ(init, sliced) << what << " " << f.name << " rank " << r;
    }
    const bool replicated = shards[0].params[i].shard.kind == ShardKind::kReplicated;
    if (!replicated) ++split;
    for (std::size_t k = 0; k < hits.size(); ++k) {
      ASSERT_EQ(hits[k], replicated ? tp : 1) << what << " " << f.name << " element " << k;
    }
  }
  EXPECT_GT(split, 0) << what;
}

TEST(ModelLayout, TensorParallelShardsTileTheFullParameters) {
  ModelConfig g = gpt2(2, 64, 4, 97, 32);  // vocabulary 97 padded to 128
  ModelConfig l = llama(2, 64, 4, 2, 97);  // grouped kv heads
  for (int tp : {2, 4}) expect_shards_tile(g, tp);
  expect_shards_tile(l, 2);
  l.n_kv_head = 4;
  l.ffn_hidden = 192;
  expect_shards_tile(l, 4);
}

TEST(ModelLayout, TensorParallelShardsSplitByHeads) {
  const ModelConfig l = llama(1, 64, 4, 2, 97);  // D = 16: q 64 rows, k and v 32 each
  auto s = describe_model(l, TensorParallel{2, 1});
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const ParamDesc& qkv = s->params[static_cast<std::size_t>(s->find("model.layers.0.self_attn.qkv_proj.weight"))];
  ASSERT_EQ(qkv.shard.kind, ShardKind::kRows);
  ASSERT_EQ(qkv.shard.rows.size(), 3u);
  EXPECT_EQ(qkv.shard.rows[0].full_begin, 32);  // query heads 2, 3
  EXPECT_EQ(qkv.shard.rows[1].full_begin, 64 + 16);  // kv head 1 of k
  EXPECT_EQ(qkv.shard.rows[2].full_begin, 96 + 16);  // ... and of v
  EXPECT_EQ(qkv.shape, (std::vector<std::int64_t>{64, 64}));
  const ParamDesc& gate_up = s->params[static_cast<std::size_t>(s->find("model.layers.0.mlp.gate_up_proj.weight"))];
  const std::int64_t F = l.ffn();
  ASSERT_EQ(gate_up.shard.rows.size(), 2u);
  EXPECT_EQ(gate_up.shard.rows[0].full_begin, F / 2);      // its gate rows ...
  EXPECT_EQ(gate_up.shard.rows[1].full_begin, F + F / 2);  // ... then its up rows
  const ParamDesc& o = s->params[static_cast<std::size_t>(s->find("model.layers.0.self_attn.o_proj.weight"))];
  EXPECT_EQ(o.shard.kind, ShardKind::kColumns);
  EXPECT_EQ(o.shard.col_begin, 32);
  EXPECT_EQ(s->params[static_cast<std::size_t>(s->find("model.norm.weight"))].shard.kind, ShardKind::kReplicated);
  const ParamDesc& head = s->params[static_cast<std::size_t>(s->find("lm_head.weight"))];
  EXPECT_EQ(head.shard.rows[0].full_begin, 64);  // vocabulary rows 64..127 of the padded 128
}

// Writers that each hold part of every parameter fill write_weights' file byte for byte: the
// shards of tp ranks (shard_runs), each cut again at an odd element as a stage-3 slice cuts a
// unit's flat buffer, encoded by encode_weights_part and written with write_range, for GPT-2 (its
// Conv1D tensors transposed) and LLaMA, fp32 and bf16, both formats. And the write counts the
// docs give: a row-split shard of a row-major tensor is one range per exported tensor, a row-split
// shard of a transposed tensor one per stored column, a column-split one of a transposed tensor
// one range.
TEST(WeightsParts, ShardsAndSlicesFillTheOneWritersFile) {
  TempDir dir;
  const int tp = 2;
  for (const ModelConfig& base : {gpt2(2, 64, 4, 97, 32), llama(2, 64, 4, 2, 97)}) {
    auto full = describe_model(base);
    ASSERT_TRUE(full.ok()) << full.status().to_string();
    std::vector<std::vector<float>> values(full->params.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i].resize(static_cast<std::size_t>(full->params[i].numel()));
      for (std::size_t k = 0; k < values[i].size(); ++k) values[i][k] = std::sin(0.37f * static_cast<float>(k + 11 * i));
    }
    std::vector<ModelLayout> shards;
    for (int r = 0; r < tp; ++r) {
      auto s = describe_model(base, TensorParallel{tp, r});
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      shards.push_back(std::move(*s));
    }
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      for (const WeightFormat format : {WeightFormat::kHuggingFace, WeightFormat::kNative}) {
        const std::string what = std::string(to_string(base.kind)) + " " + std::string(to_string(dtype)) +
                                 (format == WeightFormat::kNative ? " native" : " hf");
        const std::string reference = (dir / "one.safetensors").string(), path = (dir / "parts.safetensors").string();
        STRATA_ASSERT_OK(write_weights(*full, reference, format, dtype, [&](int i, std::vector<float>& out) {
          out = values[static_cast<std::size_t>(i)];
          return ok_status();
        }));
        auto header = weights_header(*full, format, dtype);
        ASSERT_TRUE(header.ok()) << header.status().to_string();
        STRATA_ASSERT_OK(SafetensorsPartWriter::create(path, *header));
        std::vector<EncodedRange> ranges;
        for (int r = 0; r < tp; ++r) {
          auto part = SafetensorsPartWriter::open(path, *header);
          ASSERT_TRUE(part.ok()) << part.status().to_string();
          for (std::size_t i = 0; i < full->params.size(); ++i) {
            const ParamDesc& p = shards[static_cast<std::size_t>(r)].params[i];
            if (!p.owns_storage() || (p.shard.kind == ShardKind::kReplicated && r != 0)) continue;
            std::vector<float> shard(static_cast<std::size_t>(p.numel()));
            shard_from_full(p, values[i].data(), shard.data());
            const std::int64_t n = p.numel(), cut = std::min<std::int64_t>(n, 37);
            for (const auto& [a, b] : {std::pair{std::int64_t{0}, cut}, std::pair{cut, n}}) {
              const std::vector<ElementRun> runs = shard_runs(p, a, b);
              STRATA_ASSERT_OK(encode_weights_part(*full, *header, static_cast<int>(i), format, dtype, runs,
                                                   std::span<const float>(shard).subspan(
                                                       static_cast<std::size_t>(a), static_cast<std::size_t>(b - a)),
                                                   ranges));
              for (const EncodedRange& e : ranges)
                STRATA_ASSERT_OK(part->write_range(e.tensor, e.offset, e.bytes.data(), e.bytes.size()));
            }
          }
          STRATA_ASSERT_OK(part->close());
        }
        STRATA_ASSERT_OK(SafetensorsPartWriter::publish(path));
        const std::string want = read_file(reference);
        ASSERT_GT(want.size(), 1000u) << what;
        EXPECT_TRUE(read_file(path) == want) << what << ": the parts' file differs from the one writer's";
      }
    }
    // Write counts of whole shards (rank 1, HF, fp32).
    auto header = weights_header(*full, WeightFormat::kHuggingFace, DType::kF32);
    ASSERT_TRUE(header.ok()) << header.status().to_string();
    auto ranges_of = [&](const std::string& name) {
      const int i = full->find(name);
      EXPECT_GE(i, 0) << name;
      const ParamDesc& p = shards[1].params[static_cast<std::size_t>(i)];
      std::vector<float> shard(static_cast<std::size_t>(p.numel()));
      shard_from_full(p, values[static_cast<std::size_t>(i)].data(), shard.data());
      std::vector<EncodedRange> ranges;
      EXPECT_TRUE(encode_weights_part(*full, *header, i, WeightFormat::kHuggingFace, DType::kF32,
                                      shard_runs(p, 0, p.numel()), shard, ranges)
                      .ok());
      return ranges.size();
    };
    const std::size_t C = 64;
    if (base.kind == ModelKind::kGpt2) {
      EXPECT_EQ(ranges_of("h.0.mlp.c_fc.weight"), C);        // rows of (4C, C), stored (C, 4C): a run per column
      EXPECT_EQ(ranges_of("h.0.attn.c_attn.weight"), 3 * C);  // q, k and v rows: three runs per column
      EXPECT_EQ(ranges_of("h.0.mlp.c_proj.weight"), 1u);     // columns of (C, 4C), stored (4C, C): one run
      EXPECT_EQ(ranges_of("wte.weight"), 1u);                 // vocabulary rows 64..96 (the rest is padding)
    } else {
      EXPECT_EQ(ranges_of("model.layers.0.mlp.gate_up_proj.weight"), 2u);  // its gate rows, its up rows
      EXPECT_EQ(ranges_of("model.layers.0.self_attn.o_proj.weight"), C);   // columns of a row-major tensor
    }
  }
  // Bad input names the parameter.
  auto full = describe_model(llama(1, 64, 4, 2, 97));
  ASSERT_TRUE(full.ok());
  auto header = weights_header(*full, WeightFormat::kHuggingFace, DType::kF32);
  ASSERT_TRUE(header.ok());
  const int norm = full->find("model.norm.weight");
  std::vector<float> v(64, 1.0f);
  std::vector<EncodedRange> ranges;
  const std::vector<ElementRun> outside = {{60, 8}};
  STRATA_EXPECT_ERROR(encode_weights_part(*full, *header, norm, WeightFormat::kHuggingFace, DType::kF32, outside,
                                          std::span<const float>(v).first(8), ranges),
                      kInvalidArgument, "outside parameter 'model.norm.weight'");
  const std::vector<ElementRun> some = {{0, 8}};
  STRATA_EXPECT_ERROR(encode_weights_part(*full, *header, norm, WeightFormat::kHuggingFace, DType::kF32, some, v, ranges),
                      kInvalidArgument, "64 values for runs of 8 elements");
  // The fused projection has no tensor of its own in a Hugging Face header.
  const int fused = full->find("model.layers.0.mlp.gate_up_proj.weight");
  STRATA_EXPECT_ERROR(encode_weights_part(*full, *header, fused, WeightFormat::kNative, DType::kF32, some,
                                          std::span<const float>(v).first(8), ranges),
                      kInvalidArgument, "the header does not hold parameter 'model.layers.0.mlp.gate_up_proj.weight'");
}

TEST(ModelLayout, TensorParallelSizesThatDoNotSplitAreNamed) {
  ModelConfig l = llama(1, 64, 4, 2, 97);
  STRATA_EXPECT_ERROR(check_tensor_parallel(l, 4), kInvalidArgument, "n_kv_head");
  STRATA_EXPECT_ERROR(check_tensor_parallel(l, 4), kInvalidArgument, "tensor_parallel_size = 4");
  STRATA_EXPECT_ERROR(check_tensor_parallel(l, 3), kInvalidArgument, "n_head");
  ModelConfig g = gpt2(1, 64, 4, 62, 32);  // 62 ≤ vocab_multiple: not padded, 62 rows
  STRATA_EXPECT_ERROR(check_tensor_parallel(g, 4), kInvalidArgument, "vocab_size");
  STRATA_EXPECT_ERROR(describe_model(g, TensorParallel{4, 0}).status(), kInvalidArgument, "vocab_multiple");
  STRATA_EXPECT_ERROR(check_tensor_parallel(g, 0), kInvalidArgument, "tensor_parallel_size = 0");
  EXPECT_FALSE(describe_model(gpt2(1, 64, 4, 97, 32), TensorParallel{2, 2}).ok());
}

}  // namespace
}  // namespace strata::testing
