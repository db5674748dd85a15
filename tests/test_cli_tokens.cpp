// strata tokenize and strata train --tokens from the command line: the ids a tokenizer.json
// writes with bos/eos, llm.c headers, the round-trip report, token files of both widths training
// alike, validation windows equal to strata eval's, and bad input named.
#include <nlohmann/json.hpp>

#include "harness/harness.hpp"
#include "strata/data.hpp"

namespace strata::testing {
namespace {

using Json = nlohmann::ordered_json;

const std::string kTiny = "--layers 1 --width 32 --heads 2 --seq-len 32 --batch 2 --threads 1 --quiet ";

// GPT-2's byte alphabet at ids 0..255 in byte order (the order does not matter here), one merge
// "h e" (id 256), and the special tokens <|bos|> (300) and <|eos|> (301), bos added by the
// post-processor as LLaMA 3's is.
std::string tiny_tokenizer_json(bool nfc = false) {
  Json vocab = Json::object();
  std::uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const std::uint32_t cp = direct ? static_cast<std::uint32_t>(b) : next++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    vocab[s] = b;
  }
  vocab["he"] = 256;
  Json special =
      Json{{"<|bos|>",
            Json{{"id", "<|bos|>"}, {"ids", Json::array({300})}, {"tokens", Json::array({"<|bos|>"})}}}};
  return Json{
      {"added_tokens",
       Json::array({Json{{"id", 300}, {"content", "<|bos|>"}}, Json{{"id", 301}, {"content", "<|eos|>"}}})},
      {"normalizer", nfc ? Json{{"type", "NFC"}} : Json()},
      {"pre_tokenizer", Json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor",
       Json{{"type", "TemplateProcessing"},
            {"single", Json::array({Json{{"SpecialToken", Json{{"id", "<|bos|>"}, {"type_id", 0}}}},
                                    Json{{"Sequence", Json{{"id", "A"}, {"type_id", 0}}}}})},
            {"special_tokens", special}}},
      {"decoder", Json{{"type", "ByteLevel"}}},
      {"model", Json{{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array({"h e"})}}}}
      .dump();
}

std::vector<std::int32_t> read_tokens(const std::string& path) {
  auto d = TokenDataset::open({path});
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  if (!d.ok()) return {};
  std::vector<std::int32_t> out(d->size());
  EXPECT_TRUE(d->read(0, out).ok());
  return out;
}

// JSONL: one document per line, [bos] ids [eos]; "he" merged; the sidecar records the
// tokenizer; --llmc writes the header; --bos/--eos off leave them out.
TEST(CliTokenize, JsonlWithTokenizerJsonWritesBosIdsEosAndASidecar) {
  TempDir dir;
  write_file(dir / "tokenizer.json", tiny_tokenizer_json());
  write_file(dir / "tokenizer_config.json", R"({"eos_token": "<|eos|>"})");
  const std::string in =
      write_file(dir / "docs.jsonl", "{\"text\": \"the cat\", \"id\": 1}\n\n{\"text\": \"ah\"}\n");
  const std::string out = (dir / "docs.bin").string();
  auto r = run_cli("tokenize --tokenizer " + (dir / "tokenizer.json").string() + " --input " + in +
                   " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("2 document(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every document decodes to its text"), std::string::npos) << r.output;
  std::vector<std::int32_t> want = {300, 't', 256, ' ', 'c', 'a', 't', 301, 300, 'a', 'h', 301};
  EXPECT_EQ(read_tokens(out), want);
  auto meta = read_token_meta(out);
  ASSERT_TRUE(meta.ok() && meta->has_value());
  EXPECT_EQ((*meta)->vocab_size, 302);
  EXPECT_EQ((*meta)->bos_id, 300);
  EXPECT_EQ((*meta)->eos_id, 301);

  const std::string llmc = (dir / "llmc.bin").string();
  r = run_cli("tokenize --tokenizer " + dir.path().string() + " --input " + in + " --out " + llmc +
              " --llmc --bos off --eos off --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_file(llmc).substr(0, 4), std::string("\x88\xd8\x34\x01", 4))
      << "magic 20240520, little-endian";
  EXPECT_EQ(read_tokens(llmc), (std::vector<std::int32_t>{'t', 256, ' ', 'c', 'a', 't', 'a', 'h'}));
}

// Bad input: the JSONL line is named; flags are usage errors (exit 2); nothing is left behind.
TEST(CliTokenize, BadInputIsNamedAndLeavesNoFile) {
  TempDir dir;
  const std::string out = (dir / "o.bin").string();
  const std::string bad = write_file(dir / "bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": 3}\n");
  auto r = run_cli("tokenize --tokenizer bytes --input " + bad + " --out " + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("bad.jsonl' line 2 has no string field 'text'"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_FALSE(std::filesystem::exists(out + ".tmp"));
  const std::string broken = write_file(dir / "broken.jsonl", "{\"text\": \"ok\"}\n{\"text\n");
  r = run_cli("tokenize --tokenizer bytes --input " + broken + " --out " + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("broken.jsonl' line 2 is not valid JSON"), std::string::npos) << r.output;
  r = run_cli("tokenize --tokenizer bytes --input " + (dir / "none.txt").string() + " --out " + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("none.txt"), std::string::npos) << r.output;
  r = run_cli("tokenize --tokenizer " + (dir / "none.json").string() + " --input " + bad + " --out " + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  r = run_cli("tokenize --tokenizer bytes --input " + bad + " --out " + out + " --eos on");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("no eos token"), std::string::npos) << r.output;
  r = run_cli("tokenize --tokenizer bytes --input " + bad);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'--out' is required"), std::string::npos) << r.output;
}

// A normalizing tokenizer (NFC) is not lossless: the documents that decode to other text are
// counted, not refused.
TEST(CliTokenize, RoundTripCountsWhatANormalizerChanges) {
  TempDir dir;
  write_file(dir / "tokenizer.json", tiny_tokenizer_json(true));
  const std::string in = write_file(
      dir / "d.jsonl", "{\"text\": \"plain\"}\n{\"text\": \"cafe\\u0301\"}\n{\"text\": \"more\"}\n");
  auto r = run_cli("tokenize --tokenizer " + (dir / "tokenizer.json").string() + " --input " + in +
                   " --out " + (dir / "d.bin").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1 of 3 document(s) decode to other text (the first: document 2)"),
            std::string::npos)
      << r.output;
}

// The same ids in a u16 file, a u32 file and an llm.c u32 file train alike, bit for bit.
TEST(CliTrainTokens, BothWidthsAndLlmcHeadersTrainAlike) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the fox " + std::to_string(i % 13) + " sees the river.\n";
  const std::string txt = write_file(dir / "t.txt", text);
  ASSERT_EQ(
      run_cli("tokenize --tokenizer bytes --input " + txt + " --out " + (dir / "u16.bin").string()).exit_code,
      0);
  ASSERT_EQ(run_cli("tokenize --tokenizer bytes --input " + txt + " --out " + (dir / "u32.bin").string() +
                    " --token-dtype u32 --llmc --quiet")
                .exit_code,
            0);
  std::filesystem::copy_file(dir / "u32.bin", dir / "nosidecar.bin");
  const std::string flags = kTiny + "--steps 4 --val-every 0 ";
  auto losses = [&](const std::string& extra, const std::string& name) {
    const std::string m = (dir / (name + ".jsonl")).string();
    auto r = run_cli("train " + flags + extra + " --metrics " + m);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::vector<double> out;
    for (const auto& j : read_jsonl(m)) out.push_back(j["loss"].get<double>());
    return out;
  };
  const auto a = losses("--tokens " + (dir / "u16.bin").string(), "a");
  const auto b = losses("--tokens " + (dir / "u32.bin").string(), "b");
  const auto c = losses("--tokens " + (dir / "nosidecar.bin").string() + " --vocab-size 256", "c");
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
  auto header = run_cli("train " + flags + "--tokens " + (dir / "u32.bin").string());
  EXPECT_NE(header.output.find("u32 llm.c"), std::string::npos) << header.output;
}

// Validation on --val-tokens uses strata eval's windows: the run's last validation loss equals
// eval's over the same text with its saved weights, to the last bit.
TEST(CliTrainTokens, ValidationMatchesEvalOfTheSavedWeights) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i)
    text += "count " + std::to_string(i) + " then " + std::to_string(i + 1) + ".\n";
  const std::string txt = write_file(dir / "t.txt", text);
  const std::string val = write_file(dir / "v.txt", text.substr(2000, 3000));
  ASSERT_EQ(
      run_cli("tokenize --tokenizer bytes --input " + txt + " --out " + (dir / "t.bin").string()).exit_code,
      0);
  ASSERT_EQ(
      run_cli("tokenize --tokenizer bytes --input " + val + " --out " + (dir / "v.bin").string()).exit_code,
      0);
  const std::string m = (dir / "m.jsonl").string(), w = (dir / "w.safetensors").string();
  auto r = run_cli("train " + kTiny + "--steps 3 --val-windows 0 --tokens " + (dir / "t.bin").string() +
                   " --val-tokens " + (dir / "v.bin").string() + " --metrics " + m + " --save-weights " + w);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_jsonl(m);
  ASSERT_TRUE(!lines.empty() && lines.back().contains("val_loss"));
  auto e = run_cli("eval --weights " + w + " --data " + val + " --seq-len 32 --json --threads 1");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const auto j = nlohmann::json::parse(e.output.substr(e.output.find('{')));
  EXPECT_EQ(j["loss"].get<double>(), lines.back()["val_loss"].get<double>());
}

// Bad input: an id past the vocabulary names the file and its byte offset (exit 1); flags that
// do not go together, and a vocabulary nobody gives, are usage errors (exit 2).
TEST(CliTrainTokens, BadIdsAndFlagsAreNamed) {
  TempDir dir;
  std::string ids;
  for (int i = 0; i < 4000; ++i) {
    const int v = i == 2500 ? 300 : i % 200;
    ids += static_cast<char>(v & 0xFF);
    ids += static_cast<char>(v >> 8);
  }
  const std::string bin = write_file(dir / "ids.bin", ids);
  // Every window of the 4000 tokens is visited within 125 steps of 1 x 32: token 2500 is met.
  auto r = run_cli(
      "train --layers 1 --width 32 --heads 2 --seq-len 32 --threads 1 --quiet --batch 1 --steps 200 "
      "--val-every 0 --tokens " +
      bin + " --vocab-size 256");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(
      r.output.find(bin + "': token 2500 (byte offset 5000) is 300, outside the model's vocabulary of 256"),
      std::string::npos)
      << r.output;
  r = run_cli("train " + kTiny + "--tokens " + bin);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--vocab-size"), std::string::npos) << r.output;
  r = run_cli("train " + kTiny + "--tokens " + bin + " --vocab-size 256 --data " + bin);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("flag '--data' is for text"), std::string::npos) << r.output;
  r = run_cli("train " + kTiny + "--val-tokens " + bin);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'--val-tokens' needs '--tokens'"), std::string::npos) << r.output;
  r = run_cli("train " + kTiny + "--tokens " + bin + " --vocab-size 256 --token-dtype u8");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = run_cli("train " + kTiny + "--tokens " + (dir / "none_*.bin").string() + " --vocab-size 256");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("matches no file"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata::testing
