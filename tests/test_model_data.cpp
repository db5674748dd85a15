// Tokenizers, the built-in corpus, batching and safetensors files.
#include <cerrno>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "harness/harness.hpp"
#include "strata/data.hpp"
#include "strata/safetensors.hpp"

namespace strata::testing {
namespace {

TEST(ByteTokenizer, RoundTripsAnyBytes) {
  auto tok = make_byte_tokenizer();
  std::string text = "Hello, \xff\x00world\n";
  text += '\0';
  auto ids = tok->encode(text);
  EXPECT_EQ(ids.size(), text.size());
  EXPECT_EQ(*tok->decode(ids), text);
  STRATA_EXPECT_ERROR(tok->decode({65, 300}), kInvalidArgument, "300");
}

TEST(Corpus, BuiltinIsDeterministicSplitAndStructured) {
  Corpus a = builtin_corpus(7, 200000);
  Corpus b = builtin_corpus(7, 200000);
  EXPECT_EQ(a.train, b.train);
  EXPECT_EQ(a.validation, b.validation);
  EXPECT_NE(builtin_corpus(8, 200000).train, a.train);
  double total = static_cast<double>(a.train.size() + a.validation.size());
  EXPECT_GE(total, 200000);
  EXPECT_NEAR(a.validation.size() / total, 0.1, 0.03);
  EXPECT_NE(a.train.find(" = "), std::string::npos);
  EXPECT_NE(a.train.find("Count:"), std::string::npos);
  // Arithmetic in the corpus is right: "a + b = c." lines add up.
  std::size_t checked = 0;
  for (std::size_t pos = 0; (pos = a.train.find(" + ", pos)) != std::string::npos && checked < 200; ++pos) {
    std::size_t start = a.train.find_last_of(" \n", pos - 1);
    start = start == std::string::npos ? 0 : start + 1;
    int x = std::stoi(a.train.substr(start, pos - start));
    std::size_t eq = a.train.find(" = ", pos);
    int y = std::stoi(a.train.substr(pos + 3, eq - pos - 3));
    int z = std::stoi(a.train.substr(eq + 3));
    ASSERT_EQ(x + y, z) << a.train.substr(start, eq + 8 - start);
    ++checked;
  }
  EXPECT_GT(checked, 50u);
  auto tok = make_byte_tokenizer();
  double h = unigram_entropy(tok->encode(a.train), 256);
  EXPECT_GT(h, 2.0);
  EXPECT_LT(h, 4.5);
}

TEST(Corpus, TextFileErrorsNameThePath) {
  STRATA_EXPECT_ERROR(load_text_corpus("/nonexistent/strata.txt"), kNotFound, "/nonexistent/strata.txt");
  TempDir dir;
  auto small = write_file(dir / "small.txt", "tiny");
  STRATA_EXPECT_ERROR(load_text_corpus(small), kInvalidArgument, "small.txt");
  std::string text;
  for (int i = 0; i < 100; ++i) text += "line " + std::to_string(i) + "\n";
  auto c = load_text_corpus(write_file(dir / "ok.txt", text));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->train + c->validation, text);
  EXPECT_EQ(c->validation.rfind("line", 0), 0u) << "the split falls on a line boundary";
}

TEST(Batcher, DeterministicBySeedAndIndexTargetsShiftByOne) {
  std::vector<std::int32_t> tokens(1000);
  for (int i = 0; i < 1000; ++i) tokens[i] = i % 251;
  auto b = Batcher::create(tokens, 4, 16, 42);
  ASSERT_TRUE(b.ok());
  std::vector<std::int32_t> in1, tg1, in2, tg2;
  b->batch(5, in1, tg1);
  b->batch(6, in2, tg2);
  EXPECT_NE(in1, in2);
  b->batch(5, in2, tg2);
  EXPECT_EQ(in1, in2);
  for (int r = 0; r < 4; ++r) {
    for (int t = 0; t + 1 < 16; ++t) EXPECT_EQ(tg1[r * 16 + t], in1[r * 16 + t + 1]);
  }
  auto other = Batcher::create(tokens, 4, 16, 43);
  other->batch(5, in2, tg2);
  EXPECT_NE(in1, in2);
  STRATA_EXPECT_ERROR(Batcher::create({1, 2, 3}, 1, 16, 0), kInvalidArgument, "at least 17");
}

TEST(Batcher, EvalWindowsAreNonOverlappingAndDropThePartialTail) {
  std::vector<std::int32_t> tokens(50);
  for (int i = 0; i < 50; ++i) tokens[i] = i;
  auto b = Batcher::create(tokens, 1, 9, 0);
  EXPECT_EQ(b->eval_windows(), 5);  // 5 windows of 10 tokens
  std::vector<std::int32_t> in, tg;
  b->eval_window(2, in, tg);
  EXPECT_EQ(in.front(), 20);
  EXPECT_EQ(tg.back(), 29);
}

TEST(BpeTokenizer, MergesByRankAndRoundTrips) {
  TempDir dir;
  // The byte alphabet (printable bytes map to themselves; space is U+0120 'Ġ') plus merges.
  nlohmann::json vocab = nlohmann::json::object();
  int id = 0;
  auto cp_utf8 = [](std::uint32_t cp) {
    std::string s;
    if (cp < 0x80) s += static_cast<char>(cp);
    else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  };
  std::uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    vocab[cp_utf8(direct ? b : next++)] = id++;
  }
  vocab["he"] = id++;
  vocab["hel"] = id++;
  vocab["hell"] = id++;
  vocab["hello"] = id++;
  vocab["\xc4\xa0w"] = id++;  // "Ġw"
  auto vpath = write_file(dir / "vocab.json", vocab.dump());
  auto mpath = write_file(dir / "merges.txt", "#version: 0.2\nh e\nhe l\nhel l\nhell o\n\xc4\xa0 w\n");
  auto tok = load_bpe_tokenizer(vpath, mpath);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  auto ids = (*tok)->encode("hello world's");
  // "hello" | " world" -> "Ġw" + o r l d | "'s"
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], vocab["hello"].get<int>());
  EXPECT_EQ(ids[1], vocab["\xc4\xa0w"].get<int>());
  EXPECT_EQ(*(*tok)->decode(ids), "hello world's");
  std::string odd = "tabs\tand  spaces\n\xe2\x82\xac 42!";
  EXPECT_EQ(*(*tok)->decode((*tok)->encode(odd)), odd);
  EXPECT_EQ((*tok)->vocab_size(), id);

  auto bad = write_file(dir / "bad_merges.txt", "h e\nonlyone\n");
  STRATA_EXPECT_ERROR(load_bpe_tokenizer(vpath, bad), kInvalidArgument, "line 2");
  auto badv = write_file(dir / "bad_vocab.json", "{\"a\": \"x\"}");
  STRATA_EXPECT_ERROR(load_bpe_tokenizer(badv, mpath), kInvalidArgument, "token 'a'");
  STRATA_EXPECT_ERROR(load_bpe_tokenizer(dir / "missing.json", mpath), kNotFound, "missing.json");

  // Two tokens sharing an id: decode would give back the other one's text ("hello" decoded as
  // "h", breaking fuzz_bpe's round trip). The error names the id and both tokens.
  nlohmann::json dup = vocab;
  dup["hello"] = vocab["h"];
  auto dupv = write_file(dir / "dup_vocab.json", dup.dump());
  STRATA_EXPECT_ERROR(load_bpe_tokenizer(dupv, mpath), kInvalidArgument, "ids must be distinct");
  const std::string message = load_bpe_tokenizer(dupv, mpath).status().message();
  EXPECT_NE(message.find("'hello'"), std::string::npos) << message;
  EXPECT_NE(message.find("'h'"), std::string::npos) << message;
  EXPECT_NE(message.find("id " + std::to_string(vocab["h"].get<int>())), std::string::npos) << message;
}

TEST(Safetensors, WriteReadRoundTripWithMetadata) {
  TempDir dir;
  std::vector<float> w = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  std::vector<std::uint16_t> h = {0x3f80, 0x4000};
  SafetensorsWriter writer;
  STRATA_ASSERT_OK(writer.add("h.0.attn.c_attn.weight", "F32", {2, 3}, w.data(), w.size() * 4));
  STRATA_ASSERT_OK(writer.add("wte.weight", "BF16", {2}, h.data(), 4));
  STRATA_EXPECT_ERROR(writer.add("wte.weight", "BF16", {2}, h.data(), 4), kInvalidArgument, "twice");
  STRATA_EXPECT_ERROR(writer.add("x", "F32", {3}, w.data(), 8), kInvalidArgument, "needs 12");
  STRATA_EXPECT_ERROR(writer.add("y", "Q4", {1}, w.data(), 4), kInvalidArgument, "'Q4'");
  writer.set_metadata("config", "{\"n_layer\": 1}");
  std::string path = (dir / "w.safetensors").string();
  STRATA_ASSERT_OK(writer.write(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->metadata().at("config"), "{\"n_layer\": 1}");
  ASSERT_NE(f->find("h.0.attn.c_attn.weight"), nullptr);
  EXPECT_EQ(f->find("h.0.attn.c_attn.weight")->shape, (std::vector<std::int64_t>{2, 3}));
  std::vector<float> back(6);
  STRATA_ASSERT_OK(f->read("h.0.attn.c_attn.weight", back.data(), 24));
  EXPECT_EQ(back, w);
  std::vector<std::uint16_t> hb(2);
  STRATA_ASSERT_OK(f->read("wte.weight", hb.data(), 4));
  EXPECT_EQ(hb, h);
  STRATA_EXPECT_ERROR(f->read("nope", hb.data(), 4), kNotFound, "'nope'");
  STRATA_EXPECT_ERROR(f->read("wte.weight", hb.data(), 2), kInvalidArgument, "wte.weight");
}

// The exact bytes one writer writes: the 8-byte length, the JSON with sorted keys padded with
// spaces to a multiple of 8, the data in add order. A regression check on the format itself
// (the file a pipeline's stages fill together must stay this file).
TEST(Safetensors, OneWriterWritesTheseExactBytes) {
  TempDir dir;
  const std::vector<float> a = {1.5f, -2.f};
  const std::vector<std::uint16_t> b = {0x3f80};
  SafetensorsWriter writer;
  STRATA_ASSERT_OK(writer.add("b", "F32", {2}, a.data(), 8));
  STRATA_ASSERT_OK(writer.add("a", "BF16", {1, 1}, b.data(), 2));
  writer.set_metadata("format", "pt");
  const std::string path = (dir / "w.safetensors").string();
  STRATA_ASSERT_OK(writer.write(path));
  std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"data_offsets":[8,10],"dtype":"BF16","shape":[1,1]},)"
      R"("b":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})";
  while (json.size() % 8 != 0) json += ' ';
  std::string want(8, '\0');
  for (int i = 0; i < 8; ++i) want[static_cast<std::size_t>(i)] = static_cast<char>(json.size() >> (8 * i));
  want += json;
  want.append(reinterpret_cast<const char*>(a.data()), 8);
  want.append(reinterpret_cast<const char*>(b.data()), 2);
  EXPECT_EQ(read_file(path), want);
}

// Several writers fill one file, each its own tensors in any order: the one writer's file byte
// for byte. The final name appears only at publish; a failed write (the fault hook, as a disk
// error) ends with discard: no temporary file, and the file already at the path keeps its bytes.
TEST(Safetensors, PartWritersFillTheOneWritersFile) {
  TempDir dir;
  // Awkward sizes: 1025 floats, 7 halves, an empty tensor.
  std::vector<float> x(1025), z(3);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.25f - 7.f;
  z = {9.f, 8.f, 7.f};
  std::vector<std::uint16_t> y = {1, 2, 3, 4, 5, 6, 7};
  SafetensorsWriter one;
  SafetensorsHeader header;
  auto add = [&](const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape,
                 const void* data, std::uint64_t n) {
    STRATA_ASSERT_OK(one.add(name, dtype, shape, data, n));
    STRATA_ASSERT_OK(header.add(name, dtype, shape, n));
  };
  add("layers.1.x", "F32", {5, 205}, x.data(), x.size() * 4);
  add("layers.0.y", "BF16", {7}, y.data(), 14);
  add("empty", "F32", {0, 4}, z.data(), 0);
  add("norm", "F32", {3}, z.data(), 12);
  one.set_metadata("producer", "strata");
  header.set_metadata("producer", "strata");
  const std::string reference = (dir / "one.safetensors").string(),
                    path = (dir / "parts.safetensors").string();
  STRATA_ASSERT_OK(one.write(reference));
  EXPECT_EQ(header.data_bytes(), x.size() * 4 + 14 + 12);

  // Opening before create() fails (the writers must be ordered after it), naming the file.
  STRATA_EXPECT_ERROR(SafetensorsPartWriter::open(path, header).status(), kIoError, "parts.safetensors.tmp");
  STRATA_ASSERT_OK(SafetensorsPartWriter::create(path, header));
  auto first = SafetensorsPartWriter::open(path, header);
  auto second = SafetensorsPartWriter::open(path, header);
  ASSERT_TRUE(first.ok() && second.ok()) << first.status().to_string() << second.status().to_string();
  STRATA_EXPECT_ERROR(first->write("nope", x.data(), 4), kInvalidArgument, "'nope'");
  STRATA_EXPECT_ERROR(first->write("norm", z.data(), 8), kInvalidArgument, "12 bytes");
  STRATA_ASSERT_OK(second->write("norm", z.data(), 12));
  STRATA_ASSERT_OK(first->write("layers.0.y", y.data(), 14));
  STRATA_ASSERT_OK(second->write("empty", z.data(), 0));
  STRATA_ASSERT_OK(first->write("layers.1.x", x.data(), x.size() * 4));
  STRATA_ASSERT_OK(second->close());
  STRATA_ASSERT_OK(first->close());
  EXPECT_FALSE(std::filesystem::exists(path)) << "the final name before publish";
  STRATA_ASSERT_OK(SafetensorsPartWriter::publish(path));
  EXPECT_FALSE(std::filesystem::exists(SafetensorsPartWriter::temp_path(path)));
  const std::string want = read_file(reference);
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(read_file(path) == want) << "the parts' file differs from the one writer's";

  // A failed write into a new temporary file: discard, the published file unchanged.
  STRATA_ASSERT_OK(SafetensorsPartWriter::create(path, header));
  std::uint64_t faulted_at = 0;
  auto failing = SafetensorsPartWriter::open(
      path, header, [&](const std::string& file, std::uint64_t offset, std::uint64_t nbytes) {
        EXPECT_EQ(file, SafetensorsPartWriter::temp_path(path));
        faulted_at = offset;
        return nbytes == 14 ? EIO : 0;
      });
  ASSERT_TRUE(failing.ok()) << failing.status().to_string();
  STRATA_ASSERT_OK(failing->write("layers.1.x", x.data(), x.size() * 4));
  auto f = SafetensorsFile::open(reference);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  Status bad = failing->write("layers.0.y", y.data(), 14);
  STRATA_EXPECT_ERROR(bad, kIoError, "layers.0.y");
  EXPECT_EQ(faulted_at, f->data_offset() + f->find("layers.0.y")->data_begin);
  EXPECT_NE(bad.message().find("offset " + std::to_string(faulted_at)), std::string::npos) << bad.to_string();
  STRATA_ASSERT_OK(failing->close());
  SafetensorsPartWriter::discard(path);
  EXPECT_FALSE(std::filesystem::exists(SafetensorsPartWriter::temp_path(path)));
  EXPECT_TRUE(read_file(path) == want) << "a discarded write changed the published file";

  // Creating in a missing directory names the temporary file.
  STRATA_EXPECT_ERROR(SafetensorsPartWriter::create((dir / "missing" / "w.safetensors").string(), header),
                      kIoError, "missing/w.safetensors.tmp");
}

TEST(Safetensors, CorruptFilesAreRejectedNamingTheProblem) {
  TempDir dir;
  auto put = [&](const std::string& name, const std::string& header, std::size_t data_bytes) {
    std::string bytes(8, '\0');
    std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
    bytes += header + std::string(data_bytes, '\0');
    return write_file(dir / name, bytes);
  };
  STRATA_EXPECT_ERROR(SafetensorsFile::open(write_file(dir / "short", "abc")), kInvalidArgument, "8-byte");
  STRATA_EXPECT_ERROR(SafetensorsFile::open(put("json", "{not json", 0)), kInvalidArgument, "not valid JSON");
  STRATA_EXPECT_ERROR(
      SafetensorsFile::open(put("range", R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8)),
      kInvalidArgument, "outside the data section");
  STRATA_EXPECT_ERROR(
      SafetensorsFile::open(put("shape", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16)),
      kInvalidArgument, "tensor 't'");
  STRATA_EXPECT_ERROR(
      SafetensorsFile::open(put("dtype", R"({"t":{"dtype":"F8","shape":[3],"data_offsets":[0,3]}})", 3)),
      kInvalidArgument, "unknown dtype 'F8'");
  STRATA_EXPECT_ERROR(SafetensorsFile::open(put("overlap", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
      "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12)),
                      kInvalidArgument, "overlap");
  STRATA_EXPECT_ERROR(SafetensorsFile::open((dir / "missing").string()), kNotFound, "missing");
  // 2^62 x 4 F32 elements wrap to 0 bytes in 64 bits: without a checked product this empty tensor
  // was accepted with a shape of 2^64 elements.
  STRATA_EXPECT_ERROR(SafetensorsFile::open(put("wrap", R"({"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0)),
                      kInvalidArgument, "more bytes than 2^64");
}

}  // namespace
}  // namespace strata::testing
