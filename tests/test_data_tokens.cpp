// Token files (src/data): flat u16/u32 files as nanoGPT writes them, llm.c's headered files,
// shards read as one stream, the vocabulary check, the sidecar, TokenWriter, path lists, and the
// window sampler's order.
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <set>

#include "harness/harness.hpp"
#include "strata/data.hpp"

namespace strata::testing {
namespace {

// Little-endian ids of the given width, written by hand (not by TokenWriter), as numpy's
// `np.array(ids, dtype=np.uint16).tofile(path)` does.
std::string raw_ids(const std::vector<std::uint32_t>& ids, int width) {
  std::string out;
  for (std::uint32_t v : ids) {
    for (int b = 0; b < width; ++b) out += static_cast<char>((v >> (8 * b)) & 0xFF);
  }
  return out;
}

// llm.c's header: 256 int32, magic, version, count.
std::string llmc_header(std::int32_t magic, std::int32_t version, std::int32_t count) {
  std::string h(1024, '\0');
  std::memcpy(h.data(), &magic, 4);
  std::memcpy(h.data() + 4, &version, 4);
  std::memcpy(h.data() + 8, &count, 4);
  return h;
}

std::vector<std::int32_t> read_all(const TokenDataset& d) {
  std::vector<std::int32_t> out(d.size());
  EXPECT_TRUE(d.read(0, out).ok());
  return out;
}

std::vector<std::uint32_t> iota_ids(std::uint32_t from, std::size_t n, std::uint32_t step = 1) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = from + static_cast<std::uint32_t>(i) * step;
  return v;
}

// nanoGPT's train.bin (bare uint16) and a uint32 file: the ids come back as written, also
// across the boundary between two shards of different widths.
TEST(TokenDataset, FlatFilesOfBothWidthsReadAsOneStream) {
  TempDir dir;
  const auto a = iota_ids(0, 1025, 63);       // up to 64,512: fits u16
  const auto b = iota_ids(65530, 4097, 101);  // past 65,535: needs u32
  write_file(dir / "a.bin", raw_ids(a, 2));
  write_file(dir / "b.bin", raw_ids(b, 4));
  auto a16 = TokenDataset::open({(dir / "a.bin").string()});
  ASSERT_TRUE(a16.ok()) << a16.status().to_string();
  EXPECT_EQ(a16->size(), a.size()) << "a flat file is u16 unless told otherwise (nanoGPT)";
  EXPECT_EQ(a16->files()[0].format, TokenFormat::kFlat);
  // Two files, two widths: the second one's width comes from a sidecar.
  write_file(dir / "b.bin.json", R"({"dtype": "u32", "tokens": 4097})");
  auto both = TokenDataset::open({(dir / "a.bin").string(), (dir / "b.bin").string()});
  ASSERT_TRUE(both.ok()) << both.status().to_string();
  ASSERT_EQ(both->size(), a.size() + b.size());
  EXPECT_EQ(both->files()[1].dtype, TokenDType::kU32);
  std::vector<std::int32_t> want(a.begin(), a.end());
  want.insert(want.end(), b.begin(), b.end());
  EXPECT_EQ(read_all(*both), want);
  // A window across the boundary.
  std::vector<std::int32_t> w(7);
  STRATA_ASSERT_OK(both->read(a.size() - 3, w));
  EXPECT_EQ(w, std::vector<std::int32_t>(want.begin() + static_cast<std::ptrdiff_t>(a.size() - 3),
                                         want.begin() + static_cast<std::ptrdiff_t>(a.size() + 4)));
  STRATA_EXPECT_ERROR(both->read(both->size() - 2, w), kInvalidArgument, "past its end");
  EXPECT_EQ(both->describe(), (dir / "a.bin").string() + " (+1 more)");
  // Asking for u32 where a file has 2050 bytes of u16 ids: not a multiple of 4.
  TokenDatasetOptions u32;
  u32.dtype = TokenDType::kU32;
  write_file(dir / "odd.bin", raw_ids(iota_ids(0, 1025), 2));
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "odd.bin").string()}, u32), kInvalidArgument,
                      "not a multiple of 4");
}

// llm.c's files are recognised by their magic (20240520 v1: u16 "gpt-2"; 20240801 v7: u32
// "llama-3"), the ids start after the 1024-byte header, and a count that disagrees with the
// size (a truncated download) is an error naming the file.
TEST(TokenDataset, LlmcHeaderedFiles) {
  TempDir dir;
  const auto ids16 = iota_ids(7, 4097, 13);
  const auto ids32 = iota_ids(100000, 1025, 7);
  write_file(dir / "gpt2.bin", llmc_header(20240520, 1, 4097) + raw_ids(ids16, 2));
  write_file(dir / "llama3.bin", llmc_header(20240801, 7, 1025) + raw_ids(ids32, 4));
  auto d = TokenDataset::open({(dir / "gpt2.bin").string(), (dir / "llama3.bin").string()});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->files()[0].format, TokenFormat::kLlmc);
  EXPECT_EQ(d->files()[0].dtype, TokenDType::kU16);
  EXPECT_EQ(d->files()[0].header_bytes, 1024u);
  EXPECT_EQ(d->files()[1].dtype, TokenDType::kU32);
  std::vector<std::int32_t> want(ids16.begin(), ids16.end());
  want.insert(want.end(), ids32.begin(), ids32.end());
  EXPECT_EQ(read_all(*d), want);

  write_file(dir / "cut.bin", llmc_header(20240520, 1, 4097) + raw_ids(ids16, 2).substr(0, 8000));
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "cut.bin").string()}), kDataLoss, "cut.bin");
  TokenDatasetOptions u32;
  u32.dtype = TokenDType::kU32;
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "gpt2.bin").string()}, u32), kInvalidArgument,
                      "llm.c header of u16 tokens");
  // Another magic is not a header: the file is flat ids.
  write_file(dir / "other.bin", llmc_header(20240522, 1, 4) + raw_ids({1, 2}, 2));
  auto flat = TokenDataset::open({(dir / "other.bin").string()});
  ASSERT_TRUE(flat.ok());
  EXPECT_EQ(flat->files()[0].format, TokenFormat::kFlat);
  EXPECT_EQ(flat->size(), 514u);
}

// An id outside the model's vocabulary is an error naming the file, the token's index in it and
// its byte offset (after an llm.c header: 1024 + 2 * index).
TEST(TokenDataset, IdsOutsideTheVocabularyNameFileAndOffset) {
  TempDir dir;
  auto ids = iota_ids(0, 600);
  write_file(dir / "a.bin", raw_ids(ids, 2));
  ids[517] = 50257;
  write_file(dir / "b.bin", llmc_header(20240520, 1, 600) + raw_ids(ids, 2));
  TokenDatasetOptions o;
  o.vocab_limit = 50257;
  auto d = TokenDataset::open({(dir / "a.bin").string(), (dir / "b.bin").string()}, o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  std::vector<std::int32_t> w(100);
  STRATA_ASSERT_OK(d->read(0, w));
  STRATA_ASSERT_OK(d->read(600, w));  // b's first 100 are fine
  const Status s = d->read(1100, w);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find((dir / "b.bin").string()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("token 517 (byte offset 2058) is 50257"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("vocabulary of 50257"), std::string::npos) << s.message();
  d->set_vocab_limit(0);  // unchecked
  STRATA_EXPECT_OK(d->read(1100, w));
}

// TokenWriter: flat and llm.c files that TokenDataset reads back, with a sidecar; the file
// appears only when finished (a writer dropped half-way leaves nothing); ids that do not fit the
// width are refused naming them.
TEST(TokenWriter, WritesFilesTokenDatasetReadsAndNothingHalfWay) {
  TempDir dir;
  const std::vector<std::int32_t> ids = {0, 1, 65535, 42, 7};
  for (TokenFormat format : {TokenFormat::kFlat, TokenFormat::kLlmc}) {
    const std::string path = (dir / (format == TokenFormat::kFlat ? "flat.bin" : "llmc.bin")).string();
    auto w = TokenWriter::create(path, TokenDType::kU16, format);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    STRATA_ASSERT_OK(w->append(ids));
    STRATA_ASSERT_OK(w->append(std::vector<std::int32_t>{9}));
    EXPECT_FALSE(std::filesystem::exists(path)) << "no file before finish()";
    TokenFileMeta meta;
    meta.tokenizer = "bytes";
    meta.vocab_size = 65536;
    meta.eos_id = 7;
    STRATA_ASSERT_OK(w->finish(meta));
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    auto d = TokenDataset::open({path});
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(d->files()[0].format, format);
    std::vector<std::int32_t> want = ids;
    want.push_back(9);
    EXPECT_EQ(read_all(*d), want);
    auto m = read_token_meta(path);
    ASSERT_TRUE(m.ok() && m->has_value());
    EXPECT_EQ((*m)->tokens, 6u);
    EXPECT_EQ((*m)->vocab_size, 65536);
    EXPECT_EQ((*m)->eos_id, 7);
  }
  {
    auto w = TokenWriter::create((dir / "u32.bin").string(), TokenDType::kU32, TokenFormat::kFlat);
    ASSERT_TRUE(w.ok());
    STRATA_ASSERT_OK(w->append(std::vector<std::int32_t>{128000, 5}));
    STRATA_ASSERT_OK(w->finish({}));
    auto d = TokenDataset::open({(dir / "u32.bin").string()});  // the sidecar says u32
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(read_all(*d), (std::vector<std::int32_t>{128000, 5}));
  }
  {
    auto w = TokenWriter::create((dir / "dropped.bin").string(), TokenDType::kU16, TokenFormat::kFlat);
    ASSERT_TRUE(w.ok());
    STRATA_ASSERT_OK(w->append(ids));
    STRATA_EXPECT_ERROR(w->append(std::vector<std::int32_t>{70000}), kInvalidArgument,
                        "70000, which does not fit u16");
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "dropped.bin"));
  EXPECT_FALSE(std::filesystem::exists(dir / "dropped.bin.tmp"));
  // A sidecar that disagrees with its file (the file was cut after writing).
  std::filesystem::resize_file(dir / "flat.bin", 8);
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "flat.bin").string()}), kDataLoss, "counts 6");
  write_file(dir / "flat.bin.json", "{\"dtype\": \"u8\"}");
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "flat.bin").string()}), kInvalidArgument,
                      "\"dtype\" is \"u8\"");
  // A number JSON cannot hold (found by fuzz_token_file: the parser's overflow exception
  // escaped) is an error naming the sidecar, as is a value of the wrong type.
  write_file(dir / "flat.bin.json", "{\"dtype\": \"u16\", \"tokens\": 1E400}");
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "flat.bin").string()}), kInvalidArgument, "flat.bin.json");
  write_file(dir / "flat.bin.json", "{\"dtype\": \"u16\", \"tokens\": 4, \"tokenizer\": 7}");
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "flat.bin").string()}), kInvalidArgument,
                      "\"tokenizer\" is 7");
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "missing.bin").string()}), kNotFound, "missing.bin");
  write_file(dir / "empty.bin", "");
  STRATA_EXPECT_ERROR(TokenDataset::open({(dir / "empty.bin").string()}), kInvalidArgument, "empty");
}

TEST(TokenPaths, ListsAndGlobsInOrder) {
  TempDir dir;
  for (const char* n : {"s_002.bin", "s_000.bin", "s_001.bin", "val.bin"}) write_file(dir / n, "ab");
  const std::string d = dir.path().string();
  auto g = expand_token_paths(d + "/s_*.bin," + d + "/val.bin");
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(*g,
            (std::vector<std::string>{d + "/s_000.bin", d + "/s_001.bin", d + "/s_002.bin", d + "/val.bin"}));
  STRATA_EXPECT_ERROR(expand_token_paths(d + "/x_*.bin"), kNotFound, "x_*.bin' matches no file");
  STRATA_EXPECT_ERROR(expand_token_paths("a.bin,,b.bin"), kInvalidArgument, "empty entry");
}

// Never read whole: a 1 GiB token file (sparse: it costs no disk) is opened and sampled, and the
// process's resident memory grows by the pages the windows touch, not by the file. (Catches a
// reader that touches every page at open: resident memory then grows by the whole GiB.)
TEST(TokenDataset, MapsTheFileAndTouchesOnlyTheWindowsItReads) {
  TempDir dir;
  const std::filesystem::path big = dir / "big.bin";
  { std::ofstream(big.string()).put('\0'); }
  std::filesystem::resize_file(big, 1ull << 30);
  auto rss_kib = [] {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
    }
    return -1ll;
  };
  const long long before = rss_kib();
  auto d = TokenDataset::open({big.string()});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  auto s = WindowSampler::create(*d, 1024, 5);
  ASSERT_TRUE(s.ok());
  std::vector<std::int32_t> in, tg;
  for (std::uint64_t i = 0; i < 64; ++i) STRATA_ASSERT_OK(s->batch(i * 4, 4, in, tg));
  const long long grown = rss_kib() - before;
  // 256 windows of 2 KiB touch at most 512 pages (2 MiB), plus the vectors.
  EXPECT_LT(grown, 16 * 1024) << "resident memory grew by " << grown
                              << " KiB reading 256 windows of a 1 GiB file";
}

// The keyed permutation is a bijection on [0, n) for awkward n, differs between keys, and is a
// function of (key, x) alone.
TEST(WindowSampler, PermutationIsABijectionForAwkwardSizes) {
  for (std::uint64_t n : {1ull, 2ull, 3ull, 5ull, 17ull, 1025ull, 4097ull, 65537ull}) {
    std::vector<char> seen(n, 0);
    for (std::uint64_t x = 0; x < n; ++x) {
      const std::uint64_t y = permute_index(x, n, 99);
      ASSERT_LT(y, n);
      ASSERT_FALSE(seen[y]) << "n " << n << ": " << y << " twice";
      seen[y] = 1;
    }
  }
  std::size_t same = 0;
  for (std::uint64_t x = 0; x < 4097; ++x) same += permute_index(x, 4097, 1) == permute_index(x, 4097, 2);
  EXPECT_LT(same, 20u) << "two keys give nearly the same order";
  EXPECT_EQ(permute_index(1000, 4097, 7), permute_index(1000, 4097, 7));
}

// Windows: each epoch visits its N = (n-1)/T windows once each, in an order of its own; the
// windows of one epoch sit on one grid (offset + k*T) and cover every target of it; a batch's
// rows are the dataset's tokens at the window, targets one further; the same seed gives the same
// windows, another seed others.
TEST(WindowSampler, EpochsVisitEveryWindowOnceInOrdersOfTheirOwn) {
  TempDir dir;
  const std::size_t n = 4099;  // (n-1)/T = 256 windows of T = 16, slack 2
  write_file(dir / "t.bin", raw_ids(iota_ids(0, n), 2));
  auto d = TokenDataset::open({(dir / "t.bin").string()});
  ASSERT_TRUE(d.ok());
  auto s = WindowSampler::create(*d, 16, 42);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const std::uint64_t N = s->windows_per_epoch();
  ASSERT_EQ(N, 256u);
  std::vector<std::vector<std::uint64_t>> orders;
  for (std::uint64_t e = 0; e < 3; ++e) {
    std::set<std::uint64_t> starts;
    std::vector<std::uint64_t> order;
    for (std::uint64_t k = 0; k < N; ++k) {
      const std::uint64_t start = s->window_start(e * N + k);
      ASSERT_LE(start + 16, n - 1) << "a window's last target lies in the data";
      starts.insert(start);
      order.push_back(start);
    }
    EXPECT_EQ(starts.size(), N) << "epoch " << e << " repeats a window";
    const std::uint64_t offset = *starts.begin();
    EXPECT_LE(offset, 2u);
    for (std::uint64_t st : starts) EXPECT_EQ((st - offset) % 16, 0u);
    orders.push_back(order);
  }
  EXPECT_NE(orders[0], orders[1]);
  EXPECT_NE(orders[1], orders[2]);

  std::vector<std::int32_t> in, tg;
  STRATA_ASSERT_OK(s->batch(300, 3, in, tg));
  ASSERT_EQ(in.size(), 48u);
  for (int r = 0; r < 3; ++r) {
    const auto start = static_cast<std::int32_t>(s->window_start(300 + static_cast<std::uint64_t>(r)));
    for (int t = 0; t < 16; ++t) {
      EXPECT_EQ(in[static_cast<std::size_t>(r * 16 + t)], start + t);  // the ids are their own positions
      EXPECT_EQ(tg[static_cast<std::size_t>(r * 16 + t)], start + t + 1);
    }
  }
  auto again = WindowSampler::create(*d, 16, 42);
  auto other = WindowSampler::create(*d, 16, 43);
  std::vector<std::int32_t> in2, tg2;
  STRATA_ASSERT_OK(again->batch(300, 3, in2, tg2));
  EXPECT_EQ(in, in2);
  STRATA_ASSERT_OK(other->batch(300, 3, in2, tg2));
  EXPECT_NE(in, in2);
  STRATA_EXPECT_ERROR(WindowSampler::create(*d, 5000, 1), kInvalidArgument, "needs at least 5001");
}

}  // namespace
}  // namespace strata::testing
