// Tokenizers (src/data): Hugging Face tokenizer.json byte-level BPE in the GPT-2, LLaMA 3 and
// Qwen2 configurations, SentencePiece models, load_tokenizer's dispatch and refusals.
//
// No real tokenizer file can be downloaded here, so each test builds a small one from the
// published definition: GPT-2's byte alphabet in GPT-2's id order (byte b's token is the code
// point GPT-2's bytes_to_unicode gives it; ids 0..93 for '!'..'~', 94..105 for U+00A1..U+00AC,
// 106..187 for U+00AE..U+00FF, then 188..255 for the other bytes in byte order, so ' ' -> 220
// 'Ġ' and '\n' -> 198 'Ċ' as in GPT-2), a few merges of our own, and the pre-tokenizer regexes
// exactly as GPT-2's ByteLevel and the LLaMA 3 / Qwen2 tokenizer.json files publish them. The
// expected ids are worked out by hand from those definitions; each test names the property.
#include <nlohmann/json.hpp>

#include "data/bpe.hpp"
#include "harness/harness.hpp"
#include "strata/data.hpp"

namespace strata::testing {
namespace {

using Json = nlohmann::ordered_json;

// The published pre-tokenizer patterns (tokenizer.json "Split" of LLaMA 3 and Qwen2).
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's id of the token for byte b.
int byte_id(unsigned char b) {
  const auto direct = [](int x) { return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE; };
  if (direct(b)) {
    int id = 0;
    for (int x = 0; x < b; ++x) id += direct(x) ? 1 : 0;
    return id;
  }
  int id = 188;
  for (int x = 0; x < b; ++x) id += direct(x) ? 0 : 1;
  return id;
}

// The byte-level spelling of raw bytes ("Ġw" for " w").
std::string bl(std::string_view raw) {
  static const std::vector<std::uint32_t> map = data::byte_to_codepoint();
  std::string out;
  for (unsigned char c : raw) data::append_utf8(out, map[c]);
  return out;
}

std::vector<std::int32_t> byte_ids(std::string_view raw) {
  std::vector<std::int32_t> out;
  for (unsigned char c : raw) out.push_back(byte_id(c));
  return out;
}

// A tokenizer.json: the byte alphabet at GPT-2's ids, then `tokens` (raw text) from id 256 and
// `merges` (raw text pairs) in rank order.
struct Builder {
  Json vocab = Json::object();
  Json merges = Json::array();
  Json added = Json::array();
  Json pre_tokenizer = Json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  Json normalizer = nullptr;
  Json post_processor = Json{{"type", "ByteLevel"}};
  bool ignore_merges = false;
  int next = 256;

  Builder() {
    std::vector<std::pair<int, std::string>> bytes;
    for (int b = 0; b < 256; ++b)
      bytes.emplace_back(byte_id(static_cast<unsigned char>(b)), bl(std::string(1, static_cast<char>(b))));
    std::sort(bytes.begin(), bytes.end());
    for (auto& [id, s] : bytes) vocab[s] = id;
  }
  int token(std::string_view raw) {
    vocab[bl(raw)] = next;
    return next++;
  }
  // A merge of two raw strings; adds the result to the vocabulary and returns its id.
  int merge(std::string_view a, std::string_view b) {
    merges.push_back(bl(a) + " " + bl(b));
    return token(std::string(a) + std::string(b));
  }
  int special(const std::string& content, int id) {
    added.push_back(Json{{"id", id},
                         {"content", content},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", false},
                         {"normalized", false},
                         {"special", true}});
    return id;
  }
  Json json() const {
    return Json{{"version", "1.0"},
                {"truncation", nullptr},
                {"padding", nullptr},
                {"added_tokens", added},
                {"normalizer", normalizer},
                {"pre_tokenizer", pre_tokenizer},
                {"post_processor", post_processor},
                {"decoder", Json{{"type", "ByteLevel"}}},
                {"model", Json{{"type", "BPE"},
                               {"dropout", nullptr},
                               {"unk_token", nullptr},
                               {"continuing_subword_prefix", ""},
                               {"end_of_word_suffix", ""},
                               {"fuse_unk", false},
                               {"byte_fallback", false},
                               {"ignore_merges", ignore_merges},
                               {"vocab", vocab},
                               {"merges", merges}}}};
  }
  std::unique_ptr<Tokenizer> load(const TempDir& dir, const std::string& name = "tokenizer.json") const {
    std::filesystem::create_directories(dir / name.substr(0, name.rfind('/') + 1));
    auto tok = load_tokenizer(write_file(dir / name, json().dump()));
    EXPECT_TRUE(tok.ok()) << tok.status().to_string();
    return tok.ok() ? std::move(*tok) : nullptr;
  }
};

Json split(const char* pattern) {
  return Json{
      {"type", "Sequence"},
      {"pretokenizers",
       Json::array({Json{{"type", "Split"},
                         {"pattern", Json{{"Regex", pattern}}},
                         {"behavior", "Isolated"},
                         {"invert", false}},
                    Json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
}

std::vector<std::int32_t> cat(std::initializer_list<std::vector<std::int32_t>> parts) {
  std::vector<std::int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// GPT-2: the byte alphabet's ids, the ByteLevel regex's pieces (contractions, an optional
// space before letters / digits / other symbols, whitespace runs that leave their last space to
// the next word), merges applied by rank within a piece and never across pieces.
TEST(TokenizerJson, Gpt2AlphabetRegexAndMerges) {
  TempDir dir;
  Builder b;
  const int he = b.merge("h", "e");
  const int ll = b.merge("l", "l");
  const int hell = b.merge("he", "ll");
  const int hello = b.merge("hell", "o");
  const int sw = b.merge(" ", "w");
  const int or_ = b.merge("o", "r");
  const int swor = b.merge(" w", "or");
  const int ld = b.merge("l", "d");
  const int sworld = b.merge(" wor", "ld");
  (void)he, (void)ll, (void)hell, (void)sw, (void)or_, (void)swor, (void)ld;
  auto tok = b.load(dir);
  ASSERT_NE(tok, nullptr);
  // GPT-2's ids of single bytes.
  EXPECT_EQ(tok->encode("!"), std::vector<std::int32_t>{0});
  EXPECT_EQ(tok->encode("a"), std::vector<std::int32_t>{64});
  EXPECT_EQ(tok->encode("\n"), std::vector<std::int32_t>{198});
  EXPECT_EQ(tok->encode(" "), std::vector<std::int32_t>{220});
  // "Hello" is not "hello": no merge starts with 'H', so only "ll" merges.
  EXPECT_EQ(tok->encode("hello world"), (std::vector<std::int32_t>{hello, sworld}));
  EXPECT_EQ(tok->encode("Hello"), cat({byte_ids("He"), {ll}, byte_ids("o")}));
  // Pieces: "hello" | " world" | "'s" | " 42" | "!!" | "  " (two trailing spaces) — "'s" and
  // " 42" have no merges, so their bytes.
  EXPECT_EQ(tok->encode("hello world's 42!!  "),
            cat({{hello, sworld}, byte_ids("'s"), byte_ids(" 42"), byte_ids("!!"), byte_ids("  ")}));
  // A space run before a word leaves its last space to it: "a" | " " | " world".
  EXPECT_EQ(tok->encode("a  world"), cat({byte_ids("a"), byte_ids(" "), {sworld}}));
  // Merges never cross a piece: "hel" + "lo" split by the regex at the digit.
  EXPECT_EQ(tok->encode("hel1lo"), cat({{he}, byte_ids("l"), byte_ids("1"), byte_ids("lo")}));
  EXPECT_EQ(tok->vocab_size(), b.next);
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_FALSE(tok->adds_bos());
  EXPECT_TRUE(tok->round_trips());
}

// Merge rank decides, not position: with "b c" ranked before "a b", "abc" is a + bc; equal pairs
// merge leftmost first ("aaa" -> "aa" + "a").
TEST(TokenizerJson, MergeRankBeforePositionAndLeftmostFirst) {
  TempDir dir;
  Builder b;
  const int bc = b.merge("b", "c");
  const int ab = b.merge("a", "b");
  const int aa = b.merge("a", "a");
  auto tok = b.load(dir);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->encode("abc"), cat({byte_ids("a"), {bc}}));
  EXPECT_EQ(tok->encode("abd"), cat({{ab}, byte_ids("d")}));
  EXPECT_EQ(tok->encode("aaa"), cat({{aa}, byte_ids("a")}));
  EXPECT_EQ(tok->encode("aaaa"), (std::vector<std::int32_t>{aa, aa}));
}

// Unicode properties through PCRE2: 'é' is a letter (\p{L}), so "café" is one piece and its
// merges apply across the two bytes of 'é'; '²' is a number (\p{N}), so "x²" is two pieces.
TEST(TokenizerJson, PreTokenizerUsesUnicodeProperties) {
  TempDir dir;
  Builder b;
  b.merge("\xc3", "\xa9");                   // é
  const int fe = b.merge("f", "\xc3\xa9");   // f + é
  const int sup2 = b.merge("\xc2", "\xb2");  // ²
  const int x2 = b.merge("x", "\xc2\xb2");   // would merge x + ², were they one piece
  (void)x2;
  auto tok = b.load(dir);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->encode("caf\xc3\xa9"), cat({byte_ids("ca"), {fe}}));
  EXPECT_EQ(tok->encode("x\xc2\xb2"), cat({byte_ids("x"), {sup2}}));
  // U+3000 IDEOGRAPHIC SPACE is whitespace (\s with Unicode semantics): a run of two before a
  // word leaves its last one to stand alone, so the two never merge (were \s ASCII only, the
  // run would be one "other symbols" piece and merge).
  const std::string ideo = "\xe3\x80\x80";
  Builder w;
  w.merge("\xe3", "\x80");
  const int sp = w.merge("\xe3\x80", "\x80");
  const int sp2 = w.merge(ideo, ideo);
  (void)sp2;
  TempDir dir2;
  auto ws = w.load(dir2);
  ASSERT_NE(ws, nullptr);
  EXPECT_EQ(ws->encode("x" + ideo + ideo + "y"), cat({byte_ids("x"), {sp, sp}, byte_ids("y")}));
}

// Added tokens: found anywhere in the text (leftmost, then longest), never split by the BPE,
// decoded to their content; lstrip/rstrip take the whitespace beside them along.
TEST(TokenizerJson, AddedTokensAreMatchedWholeAndDecodeToTheirContent) {
  TempDir dir;
  Builder b;
  const int eot = b.special("<|endoftext|>", 50256);
  const int eo = b.special("<|end", 50257);  // a prefix of the other: the longer one wins
  auto tok = b.load(dir);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->encode("a<|endoftext|>b"), cat({byte_ids("a"), {eot}, byte_ids("b")}));
  EXPECT_EQ(tok->encode("<|end<|endoftext|>"), (std::vector<std::int32_t>{eo, eot}));
  EXPECT_EQ(*tok->decode(tok->encode("x <|endoftext|> y")), "x <|endoftext|> y");
  EXPECT_EQ(tok->vocab_size(), 50258);
  EXPECT_EQ(tok->eos_id(), eot) << "<|endoftext|> is GPT-2's eos when nothing else names one";
  STRATA_EXPECT_ERROR(tok->decode({300}), kInvalidArgument, "id 300");

  Builder s;
  s.added.push_back(Json{{"id", 1000}, {"content", "<mask>"}, {"lstrip", true}, {"rstrip", true}});
  TempDir dir2;
  auto t2 = s.load(dir2);
  ASSERT_NE(t2, nullptr);
  EXPECT_EQ(t2->encode("a  <mask> b"), cat({byte_ids("a"), {1000}, byte_ids("b")}));
  EXPECT_FALSE(t2->round_trips()) << "stripped whitespace does not come back";
}

// LLaMA 3: the Split regex (digits in runs of at most three, one non-letter before a word,
// case-insensitive contractions, newline runs), ignore_merges (a piece that is a vocabulary
// entry is that entry, merges or not), bos from the TemplateProcessing post-processor, eos from
// tokenizer_config.json.
TEST(TokenizerJson, Llama3RegexIgnoreMergesAndTemplateBos) {
  TempDir dir;
  Builder b;
  b.pre_tokenizer = split(kLlama3Pattern);
  b.ignore_merges = true;
  const int hello = b.token(" hello");  // no merge makes it
  const int n123 = b.token("123");
  const int dollar_h = b.merge("$", "h");
  const int sa = b.merge("S", "a");
  (void)sa;
  const int bot = b.special("<|begin_of_text|>", 128000);
  const int eot = b.special("<|end_of_text|>", 128001);
  b.post_processor = Json{
      {"type", "Sequence"},
      {"processors",
       Json::array(
           {Json{{"type", "ByteLevel"}},
            Json{{"type", "TemplateProcessing"},
                 {"single",
                  Json::array({Json{{"SpecialToken", Json{{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                               Json{{"Sequence", Json{{"id", "A"}, {"type_id", 0}}}}})},
                 {"special_tokens",
                  Json{{"<|begin_of_text|>", Json{{"id", "<|begin_of_text|>"},
                                                  {"ids", Json::array({128000})},
                                                  {"tokens", Json::array({"<|begin_of_text|>"})}}}}}}})}};
  write_file(dir / "tokenizer_config.json",
             R"({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})");
  auto tok = b.load(dir);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->encode(" hello"), std::vector<std::int32_t>{hello});
  EXPECT_EQ(tok->encode("12345"), cat({{n123}, byte_ids("45")}));
  // "$hello": one piece in LLaMA 3, so "$h" merges (GPT-2 would cut "$" | "hello").
  EXPECT_EQ(tok->encode("$hello"), cat({{dollar_h}, byte_ids("ello")}));
  // "'S" is a contraction whatever its case: "'Sam" is "'S" | "am", so "Sa" does not merge
  // (a case-sensitive pattern would keep "'Sam" whole).
  EXPECT_EQ(tok->encode("'Sam"), byte_ids("'Sam"));
  EXPECT_EQ(tok->bos_id(), bot);
  EXPECT_EQ(tok->eos_id(), eot);
  EXPECT_TRUE(tok->adds_bos());
  EXPECT_FALSE(tok->adds_eos());
  const std::string text = "Mixed 12345 numbers,\n\n  spaces\ttabs and \xf0\x9f\x98\x80 emoji";
  EXPECT_EQ(*tok->decode(tok->encode(text)), text);
}

// The same regexes on pieces we can observe: a Split whose pieces are single bytes shows where
// the regex cut. ignore_merges is off and the only merges join two spaces or two newlines, so a
// piece boundary shows as a pair that did not merge.
TEST(TokenizerJson, Llama3AndQwen2DigitRuns) {
  TempDir dir;
  Builder b;
  const int d12 = b.merge("1", "2");
  const int d34 = b.merge("3", "4");
  b.pre_tokenizer = split(kLlama3Pattern);
  auto llama = b.load(dir, "llama/tokenizer.json");
  b.pre_tokenizer = split(kQwen2Pattern);
  auto qwen = b.load(dir, "qwen/tokenizer.json");
  ASSERT_NE(llama, nullptr);
  ASSERT_NE(qwen, nullptr);
  // LLaMA 3: "1234" is "123" | "4", so 1+2 merge and 3, 4 stay apart.
  EXPECT_EQ(llama->encode("1234"), cat({{d12}, byte_ids("3"), byte_ids("4")}));
  // Qwen2: every digit is a piece of its own: nothing merges.
  EXPECT_EQ(qwen->encode("1234"), byte_ids("1234"));
  // GPT-2's " ?\p{N}+" keeps the run whole: 12 + 34.
  b.pre_tokenizer = Json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  auto gpt2 = b.load(dir, "gpt2/tokenizer.json");
  ASSERT_NE(gpt2, nullptr);
  EXPECT_EQ(gpt2->encode("1234"), (std::vector<std::int32_t>{d12, d34}));
}

// Qwen2's NFC normalizer (through ICU): "e" + U+0301 COMBINING ACUTE is composed to U+00E9
// before the bytes are taken, so both spellings give the same ids; the round trip is then not
// guaranteed (decode gives the composed form).
TEST(TokenizerJson, NfcNormalizerComposes) {
  TempDir dir;
  Builder b;
  b.normalizer = Json{{"type", "NFC"}};
  b.pre_tokenizer = split(kQwen2Pattern);
  auto tok = b.load(dir);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->encode("e\xcc\x81"), byte_ids("\xc3\xa9"));
  EXPECT_EQ(tok->encode("caf\xc3\xa9"), byte_ids("caf\xc3\xa9"));
  EXPECT_EQ(*tok->decode(tok->encode("cafe\xcc\x81")), "caf\xc3\xa9");
  EXPECT_FALSE(tok->round_trips());
  // Bytes that are not UTF-8 pass through the normalizer untouched.
  EXPECT_EQ(tok->encode("\xff"
                        "e\xcc\x81"),
            byte_ids("\xff\xc3\xa9"));
}

// Byte-level BPE without a normalizer is lossless on any bytes, UTF-8 or not.
TEST(TokenizerJson, AnyBytesRoundTrip) {
  TempDir dir;
  Builder b;
  b.merge(" ", " ");
  b.merge("\xc3", "\xa9");
  b.pre_tokenizer = split(kLlama3Pattern);
  auto tok = b.load(dir);
  ASSERT_NE(tok, nullptr);
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    const auto bytes = random_bytes(1 + seed * 37, seed);
    const std::string text(bytes.begin(), bytes.end());
    EXPECT_EQ(*tok->decode(tok->encode(text)), text) << "seed " << seed;
  }
}

// What is not built is refused naming the key and its value; a broken file names the file.
TEST(TokenizerJson, RefusesWhatIsNotBuiltNamingTheKey) {
  TempDir dir;
  auto refuse = [&](const std::function<void(Json&)>& edit, const std::string& want) {
    Json j = Builder().json();
    edit(j);
    const std::string path = write_file(dir / "tokenizer.json", j.dump());
    auto tok = load_tokenizer(path);
    ASSERT_FALSE(tok.ok()) << want;
    EXPECT_NE(tok.status().message().find(want), std::string::npos) << tok.status().message();
    EXPECT_NE(tok.status().message().find(path), std::string::npos) << tok.status().message();
  };
  refuse([](Json& j) { j["model"]["type"] = "Unigram"; }, "model.type = \"Unigram\"");
  refuse([](Json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback");
  refuse([](Json& j) { j["model"]["continuing_subword_prefix"] = "##"; }, "model.continuing_subword_prefix");
  refuse([](Json& j) { j["normalizer"] = Json{{"type", "Lowercase"}}; }, "normalizer.type = \"Lowercase\"");
  refuse(
      [](Json& j) {
        j["pre_tokenizer"] = Json{{"type", "Metaspace"}};
      },
      "pre_tokenizer.type = \"Metaspace\"");
  refuse([](Json& j) { j["pre_tokenizer"] = split(kLlama3Pattern)["pretokenizers"][0]; },
         "has no ByteLevel step");
  refuse([](Json& j) { j["pre_tokenizer"] = split("("); }, "pre_tokenizer.pretokenizers[0].pattern");
  refuse([](Json& j) { j["post_processor"] = Json{{"type", "BertProcessing"}}; }, "post_processor.type");
  refuse([](Json& j) { j["decoder"] = Json{{"type", "Metaspace"}}; }, "decoder.type");
  refuse(
      [](Json& j) {
        j["added_tokens"] = Json::array({Json{{"id", 300}, {"content", "x"}, {"single_word", true}}});
      },
      "added_tokens[0].single_word");
  refuse([](Json& j) { j["model"]["merges"] = Json::array({"a zz"}); }, "merge 0 ('a zz') needs token 'zz'");
  refuse([](Json& j) { j["model"]["vocab"].erase("a"); }, "lacks the single-byte token for byte 97");
  refuse([](Json& j) { j["model"]["merges"] = Json::array({"abc"}); }, "model.merges[0]");
  // A value of the wrong type names its key (nlohmann's type errors must not escape).
  refuse([](Json& j) { j["pre_tokenizer"]["add_prefix_space"] = "yes"; }, "pre_tokenizer.add_prefix_space");
  refuse([](Json& j) { j["model"]["ignore_merges"] = 1; }, "model.ignore_merges");
  refuse(
      [](Json& j) {
        j["post_processor"] = Json{{"type", "TemplateProcessing"}, {"single", 3}};
      },
      "post_processor.single");
  STRATA_EXPECT_ERROR(load_tokenizer(write_file(dir / "broken.json", "{\"model\": ")), kInvalidArgument,
                      "broken.json");
  STRATA_EXPECT_ERROR(load_tokenizer((dir / "none.json").string()), kNotFound, "none.json");
  write_file(dir / "tokenizer_config.json", R"({"eos_token": "<nope>"})");
  refuse([](Json&) {}, "eos_token '<nope>' is not a token");
}

// GPT-2's vocab.json + merges.txt: the same model, through load_bpe_tokenizer and through
// load_tokenizer (the vocab file, or the directory).
TEST(Gpt2Files, LoadThroughBothEntriesAndAgreeWithTokenizerJson) {
  TempDir dir;
  Builder b;
  b.merge("h", "e");
  b.merge(" ", "t");
  b.merge(" t", "he");
  b.token("<|endoftext|>");
  Json merges = b.merges;
  std::string mtext = "#version: 0.2\n";
  for (const auto& m : merges) mtext += m.get<std::string>() + "\n";
  std::filesystem::create_directories(dir / "gpt2");
  write_file(dir / "gpt2" / "vocab.json", b.vocab.dump());
  write_file(dir / "gpt2" / "merges.txt", mtext);
  auto files =
      load_bpe_tokenizer((dir / "gpt2" / "vocab.json").string(), (dir / "gpt2" / "merges.txt").string());
  auto by_dir = load_tokenizer((dir / "gpt2").string());
  auto json = b.load(dir, "hf/tokenizer.json");
  ASSERT_TRUE(files.ok()) << files.status().to_string();
  ASSERT_TRUE(by_dir.ok()) << by_dir.status().to_string();
  const std::string text = "the other then he\n\nthe";
  EXPECT_EQ((*files)->encode(text), json->encode(text));
  EXPECT_EQ((*by_dir)->encode(text), json->encode(text));
  EXPECT_EQ((*files)->name(), "gpt2-bpe");
  EXPECT_EQ((*files)->eos_id(), b.vocab[bl("<|endoftext|>")].get<int>());
  std::filesystem::create_directories(dir / "lone");
  write_file(dir / "lone" / "vocab.json", "{\"a\": 0}");
  STRATA_EXPECT_ERROR(load_tokenizer((dir / "lone" / "vocab.json").string()), kNotFound, "merges.txt");
  STRATA_EXPECT_ERROR(load_tokenizer(dir.path().string()), kNotFound, "holds no tokenizer.json");
  auto bytes = load_tokenizer("bytes");
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ((*bytes)->name(), "bytes");
}

// ---- SentencePiece ------------------------------------------------------------------------------

// A protobuf writer for the few ModelProto fields a test model needs (sentencepiece_model.proto:
// ModelProto.pieces = 1 {piece = 1, score = 2, type = 3}, trainer_spec = 2 {model_type = 3,
// vocab_size = 4, byte_fallback = 35, unk_id = 40, bos_id = 41, eos_id = 42, pad_id = 43},
// normalizer_spec = 3 {name = 1, add_dummy_prefix = 3, remove_extra_whitespaces = 4}).
struct Proto {
  std::string bytes;
  void varint(std::uint64_t v) {
    while (v >= 0x80) {
      bytes += static_cast<char>((v & 0x7F) | 0x80);
      v >>= 7;
    }
    bytes += static_cast<char>(v);
  }
  void key(int field, int wire) {
    varint(static_cast<std::uint64_t>(field) << 3 | static_cast<unsigned>(wire));
  }
  void int_field(int field, std::int64_t v) {
    key(field, 0);
    varint(static_cast<std::uint64_t>(v));
  }
  void float_field(int field, float f) {
    key(field, 5);
    char b[4];
    std::memcpy(b, &f, 4);
    bytes.append(b, 4);
  }
  void bytes_field(int field, const std::string& s) {
    key(field, 2);
    varint(s.size());
    bytes += s;
  }
};

enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kByte = 6 };

// A LLaMA-2-shaped model: <unk> <s> </s>, the 256 byte pieces (byte fallback), BPE over pieces
// whose scores give the merge order, the identity normalizer with a dummy prefix.
std::string llama2_like_model(const std::vector<std::pair<std::string, float>>& pieces) {
  Proto m;
  auto piece = [&](const std::string& text, float score, int type) {
    Proto p;
    p.bytes_field(1, text);
    p.float_field(2, score);
    p.int_field(3, type);
    m.bytes_field(1, p.bytes);
  };
  piece("<unk>", 0, kUnknown);
  piece("<s>", 0, kControl);
  piece("</s>", 0, kControl);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    piece(name, 0, kByte);
  }
  for (const auto& [text, score] : pieces) piece(text, score, kNormal);
  Proto trainer;
  trainer.int_field(3, 2);  // BPE
  trainer.int_field(4, static_cast<std::int64_t>(3 + 256 + pieces.size()));
  trainer.int_field(35, 1);  // byte_fallback
  trainer.int_field(40, 0);
  trainer.int_field(41, 1);
  trainer.int_field(42, 2);
  trainer.int_field(43, -1);
  m.bytes_field(2, trainer.bytes);
  Proto normalizer;
  normalizer.bytes_field(1, "identity");
  normalizer.int_field(3, 1);  // add_dummy_prefix
  normalizer.int_field(4, 0);  // remove_extra_whitespaces off
  m.bytes_field(3, normalizer.bytes);
  return m.bytes;
}

// SentencePiece's BPE (through the library): spaces become U+2581 '▁', a dummy '▁' starts the
// text, the adjacent pair whose concatenation is the highest-scoring piece merges first, and a
// character no piece covers falls back to its UTF-8 bytes' pieces <0xXX> (id 3 + byte). bos is
// <s> (1) and added, eos </s> (2) not, as LLaMA 2's tokenizer does; tokenizer_config.json can
// change that.
TEST(SentencePiece, BpeMergesByScoreWithByteFallback) {
  TempDir dir;
  const std::string u = "\xe2\x96\x81";  // ▁
  const std::vector<std::pair<std::string, float>> pieces = {
      {u, -100},         {"h", -101}, {"e", -102},   {"l", -103},     {"o", -104},    {"w", -105},
      {"r", -106},       {"d", -107}, {"ll", -1},    {"he", -2},      {u + "he", -3}, {u + "hell", -4},
      {u + "hello", -5}, {"or", -6},  {u + "w", -7}, {u + "wor", -8}, {"ld", -9},     {u + "world", -10}};
  auto id_of = [&](const std::string& p) {
    for (std::size_t i = 0; i < pieces.size(); ++i)
      if (pieces[i].first == p) return static_cast<std::int32_t>(3 + 256 + i);
    return -1;
  };
  const std::string path = write_file(dir / "tokenizer.model", llama2_like_model(pieces));
  auto tok = load_tokenizer(path);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  // ll(-1), he(-2), ▁he(-3), ▁hell(-4), ▁hello(-5); or(-6), ▁w(-7), ▁wor(-8), ld(-9), ▁world(-10).
  EXPECT_EQ((*tok)->encode("hello world"),
            (std::vector<std::int32_t>{id_of(u + "hello"), id_of(u + "world")}));
  // 'é' is no piece: its two bytes' pieces; "▁h" is no piece either.
  EXPECT_EQ((*tok)->encode("h\xc3\xa9"),
            (std::vector<std::int32_t>{id_of(u), id_of("h"), 3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(*(*tok)->decode((*tok)->encode("hello world h\xc3\xa9")), "hello world h\xc3\xa9");
  EXPECT_EQ((*tok)->vocab_size(), static_cast<std::int32_t>(3 + 256 + pieces.size()));
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  EXPECT_TRUE((*tok)->adds_bos());
  EXPECT_FALSE((*tok)->adds_eos());
  STRATA_EXPECT_ERROR((*tok)->decode({100000}), kInvalidArgument, "id 100000");

  write_file(dir / "tokenizer_config.json", R"({"add_bos_token": false, "add_eos_token": true})");
  auto configured = load_tokenizer(dir.path().string());  // the directory finds tokenizer.model
  ASSERT_TRUE(configured.ok()) << configured.status().to_string();
  EXPECT_FALSE((*configured)->adds_bos());
  EXPECT_TRUE((*configured)->adds_eos());

  const std::string junk = write_file(dir / "junk.model", "not a model");
  STRATA_EXPECT_ERROR(load_tokenizer(junk), kInvalidArgument, "junk.model");
}

}  // namespace
}  // namespace strata::testing
