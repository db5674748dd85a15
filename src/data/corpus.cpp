// The built-in corpus and text-file corpora.
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include "strata/data.hpp"

namespace strata {
namespace {

// A tiny grammar with number agreement: "the small fox chases a red bird near the river."
struct Grammar {
  std::mt19937_64& rng;

  template <std::size_t N>
  const char* pick(const char* const (&words)[N]) {
    return words[rng() % N];
  }

  std::string noun_phrase(bool plural) {
    static const char* const kDet1[] = {"the", "a", "this", "that", "every"};
    static const char* const kDetN[] = {"the", "some", "these", "those", "many", "two", "three"};
    static const char* const kAdj[] = {"small", "red",   "quiet", "old", "bright",
                                       "heavy", "green", "quick", "tall"};
    static const char* const kNoun[] = {"fox",  "bird", "river", "stone", "child",
                                        "tree", "boat", "lamp",  "wolf",  "cat"};
    static const char* const kNounPl[] = {"foxes", "birds", "rivers", "stones", "children",
                                          "trees", "boats", "lamps",  "wolves", "cats"};
    std::string s = plural ? pick(kDetN) : pick(kDet1);
    if (rng() % 2) s += std::string(" ") + pick(kAdj);
    std::size_t n = rng() % 10;
    s += std::string(" ") + (plural ? kNounPl[n] : kNoun[n]);
    return s;
  }

  std::string sentence() {
    static const char* const kVerb1[] = {"sees", "follows", "finds", "watches", "carries", "chases", "hears"};
    static const char* const kVerbN[] = {"see", "follow", "find", "watch", "carry", "chase", "hear"};
    static const char* const kPrep[] = {"near", "under", "behind", "beside", "across"};
    bool plural = rng() % 2;
    std::size_t v = rng() % 7;
    std::string s =
        noun_phrase(plural) + " " + (plural ? kVerbN[v] : kVerb1[v]) + " " + noun_phrase(rng() % 2);
    if (rng() % 3 == 0) s += std::string(" ") + pick(kPrep) + " " + noun_phrase(rng() % 2);
    s += ".";
    s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
    return s;
  }
};

std::string arithmetic(std::mt19937_64& rng) {
  int a = static_cast<int>(rng() % 100);
  int b = static_cast<int>(rng() % 100);
  switch (rng() % 3) {
    case 0:
      return std::to_string(a) + " + " + std::to_string(b) + " = " + std::to_string(a + b) + ".";
    case 1: {
      if (a < b) std::swap(a, b);
      return std::to_string(a) + " - " + std::to_string(b) + " = " + std::to_string(a - b) + ".";
    }
    default: {
      a %= 13;
      b %= 13;
      return std::to_string(a) + " times " + std::to_string(b) + " is " + std::to_string(a * b) + ".";
    }
  }
}

std::string counting(std::mt19937_64& rng) {
  int start = static_cast<int>(rng() % 90);
  int step = 1 + static_cast<int>(rng() % 3);
  int n = 4 + static_cast<int>(rng() % 5);
  std::string s = "Count:";
  for (int i = 0; i < n; ++i) s += " " + std::to_string(start + i * step);
  return s + ".";
}

}  // namespace

Corpus builtin_corpus(std::uint64_t seed, std::size_t bytes) {
  std::mt19937_64 rng(seed);
  Grammar grammar{rng};
  Corpus c;
  c.train.reserve(bytes);
  std::size_t doc = 0;
  while (c.train.size() + c.validation.size() < bytes) {
    // A document is a short paragraph mixing the three kinds of sentence.
    std::string d;
    int sentences = 3 + static_cast<int>(rng() % 5);
    for (int i = 0; i < sentences; ++i) {
      switch (rng() % 4) {
        case 0:
          d += arithmetic(rng);
          break;
        case 1:
          d += counting(rng);
          break;
        default:
          d += grammar.sentence();
          break;
      }
      d += (i + 1 < sentences) ? " " : "\n";
    }
    (doc++ % 10 == 9 ? c.validation : c.train) += d;
  }
  return c;
}

Result<Corpus> load_text_corpus(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("data file '" + path + "' cannot be opened");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return io_error("data file '" + path + "': read failed");
  std::string text = ss.str();
  if (text.size() < 64) {
    return invalid_argument("data file '" + path + "' has " + std::to_string(text.size()) +
                            " bytes; need at least 64 to split into training and validation text");
  }
  std::size_t cut = text.size() * 9 / 10;
  std::size_t nl = text.find('\n', cut);
  if (nl != std::string::npos && nl + 1 < text.size()) cut = nl + 1;
  Corpus c;
  c.train = text.substr(0, cut);
  c.validation = text.substr(cut);
  return c;
}

double unigram_entropy(std::span<const std::int32_t> tokens, std::int32_t vocab_size) {
  if (tokens.empty()) return 0.0;
  std::vector<double> count(static_cast<std::size_t>(vocab_size), 0.0);
  for (auto t : tokens) {
    if (t >= 0 && t < vocab_size) count[static_cast<std::size_t>(t)] += 1.0;
  }
  double n = static_cast<double>(tokens.size());
  double h = 0.0;
  for (double c : count) {
    if (c > 0) h -= (c / n) * std::log(c / n);
  }
  return h;
}

Result<Batcher> Batcher::create(std::vector<std::int32_t> tokens, std::int64_t B, std::int64_t T,
                                std::uint64_t seed) {
  if (B < 1 || T < 1) return invalid_argument("batch size and sequence length must be >= 1");
  if (static_cast<std::int64_t>(tokens.size()) < T + 1) {
    return invalid_argument("the data has " + std::to_string(tokens.size()) +
                            " tokens; a sequence length of " + std::to_string(T) + " needs at least " +
                            std::to_string(T + 1));
  }
  Batcher b;
  b.tokens_ = std::move(tokens);
  b.B_ = B;
  b.T_ = T;
  b.seed_ = seed;
  return b;
}

void Batcher::batch(std::uint64_t index, std::vector<std::int32_t>& inputs,
                    std::vector<std::int32_t>& targets) const {
  // One generator per batch, seeded from (seed, index): batches are independent of history.
  std::seed_seq seq{static_cast<std::uint32_t>(seed_), static_cast<std::uint32_t>(seed_ >> 32),
                    static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32)};
  std::mt19937_64 rng(seq);
  const auto span = static_cast<std::uint64_t>(tokens_.size()) - static_cast<std::uint64_t>(T_);
  inputs.resize(static_cast<std::size_t>(B_ * T_));
  targets.resize(static_cast<std::size_t>(B_ * T_));
  for (std::int64_t b = 0; b < B_; ++b) {
    std::size_t start = static_cast<std::size_t>(rng() % span);
    for (std::int64_t t = 0; t < T_; ++t) {
      inputs[static_cast<std::size_t>(b * T_ + t)] = tokens_[start + static_cast<std::size_t>(t)];
      targets[static_cast<std::size_t>(b * T_ + t)] = tokens_[start + static_cast<std::size_t>(t) + 1];
    }
  }
}

std::int64_t Batcher::eval_windows() const { return static_cast<std::int64_t>(tokens_.size()) / (T_ + 1); }

void Batcher::eval_window(std::int64_t w, std::vector<std::int32_t>& inputs,
                          std::vector<std::int32_t>& targets) const {
  inputs.resize(static_cast<std::size_t>(T_));
  targets.resize(static_cast<std::size_t>(T_));
  std::size_t start = static_cast<std::size_t>(w * (T_ + 1));
  for (std::int64_t t = 0; t < T_; ++t) {
    inputs[static_cast<std::size_t>(t)] = tokens_[start + static_cast<std::size_t>(t)];
    targets[static_cast<std::size_t>(t)] = tokens_[start + static_cast<std::size_t>(t) + 1];
  }
}

}  // namespace strata
