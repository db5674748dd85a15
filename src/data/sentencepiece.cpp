// SentencePiece models (tokenizer.model of LLaMA 2, Mistral, ...) through the SentencePiece
// library: it implements the model types (BPE, unigram), the normalizer and byte fallback, so
// nothing of it is written here. bos/eos are the model's; as in the Hugging Face tokenizers of
// these families a sequence starts with bos and has no eos, unless tokenizer_config.json beside
// the model says otherwise (add_bos_token, add_eos_token, bos_token, eos_token).
#include <sentencepiece_processor.h>

#include "data/tokenizers.hpp"

namespace strata::data {
namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  std::int32_t vocab_size() const override { return static_cast<std::int32_t>(sp_.GetPieceSize()); }
  std::string name() const override { return "sentencepiece:" + path_; }
  std::int32_t bos_id() const override { return bos_; }
  std::int32_t eos_id() const override { return eos_; }
  bool adds_bos() const override { return adds_bos_; }
  bool adds_eos() const override { return adds_eos_; }

  std::vector<std::int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    // Fails only when no model is loaded, which load() rules out.
    (void)sp_.Encode(absl::string_view(text.data(), text.size()), &ids).ok();
    return std::vector<std::int32_t>(ids.begin(), ids.end());
  }

  Result<std::string> decode(const std::vector<std::int32_t>& ids) const override {
    std::vector<int> in(ids.begin(), ids.end());
    for (int id : in) {
      if (id < 0 || id >= sp_.GetPieceSize())
        return invalid_argument(name() + ": id " + std::to_string(id) + " is not in the vocabulary");
    }
    std::string out;
    const auto s = sp_.Decode(in, &out);
    if (!s.ok()) return invalid_argument(name() + ": " + s.ToString());
    return out;
  }

  Status load(const std::string& path) {
    path_ = path;
    const auto s = sp_.Load(path);
    if (!s.ok()) {
      return invalid_argument("tokenizer '" + path +
                              "' is neither JSON nor a SentencePiece model: " + s.ToString());
    }
    bos_ = sp_.bos_id();
    eos_ = sp_.eos_id();
    adds_bos_ = bos_ >= 0;
    STRATA_ASSIGN_OR_RETURN(SpecialTokensConfig cfg, read_tokenizer_config(path));
    auto resolve = [&](const std::optional<std::string>& piece, const char* key,
                       std::int32_t& slot) -> Status {
      if (!piece) return ok_status();
      if (piece->empty()) {
        slot = -1;
        return ok_status();
      }
      const int id = sp_.PieceToId(*piece);
      if (id == sp_.unk_id() && *piece != sp_.IdToPiece(sp_.unk_id())) {
        return invalid_argument("tokenizer config '" + cfg.path + "': " + key + " '" + *piece +
                                "' is not a piece of the SentencePiece model");
      }
      slot = id;
      return ok_status();
    };
    STRATA_RETURN_IF_ERROR(resolve(cfg.bos_token, "bos_token", bos_));
    STRATA_RETURN_IF_ERROR(resolve(cfg.eos_token, "eos_token", eos_));
    if (cfg.add_bos_token) adds_bos_ = *cfg.add_bos_token;
    if (cfg.add_eos_token) adds_eos_ = *cfg.add_eos_token;
    if ((adds_bos_ && bos_ < 0) || (adds_eos_ && eos_ < 0)) {
      return invalid_argument("tokenizer '" + path +
                              "': " + (adds_bos_ && bos_ < 0 ? "add_bos_token" : "add_eos_token") +
                              " is true but the model has no such token");
    }
    return ok_status();
  }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  std::string path_;
  std::int32_t bos_ = -1, eos_ = -1;
  bool adds_bos_ = false, adds_eos_ = false;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_sentencepiece(const std::string& path) {
  auto tok = std::make_unique<SentencePieceTokenizer>();
  STRATA_RETURN_IF_ERROR(tok->load(path));
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

}  // namespace strata::data
