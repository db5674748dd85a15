// strata tokenize --tokenizer FILE --input FILE [--field text] --out FILE.bin: turns text or JSONL
// into a token file that strata train --tokens reads (data.hpp's token files), with a real
// tokenizer (load_tokenizer: tokenizer.json, tokenizer.model, vocab.json + merges.txt, bytes).
//
// Documents: a text file is one document (held in memory while it is encoded); a JSONL file
// has one per line, the string under --field, read line by line. Each document is written as
// [bos] ids [eos]: bos when the tokenizer's configuration adds it (--bos overrides), eos after
// every document when the tokenizer has one (--eos off leaves it out), the usual separator of
// pre-training data. Ids are written little-endian, u16 when the vocabulary fits (else u32), flat
// as nanoGPT's train.bin or with llm.c's header (--llmc), plus a FILE.bin.json sidecar with the
// width, the count and the tokenizer. The file appears only when complete.
//
// Round trip: every document is decoded again and compared with its text. Where the tokenizer
// guarantees decode(encode(text)) == text (byte-level BPE without a normalizer) a difference is
// an error naming the document; elsewhere (NFC, SentencePiece normalization) the count of
// documents that differ is reported.
// Exit codes: 0 written, 1 a file could not be read or written or the round trip failed, 2 bad flags.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.hpp"
#include "strata/data.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"tokenizer", "FILE",
     "tokenizer.json (byte-level BPE: GPT-2, LLaMA 3, Qwen2), tokenizer.model (SentencePiece: LLaMA 2, "
     "Mistral), "
     "a GPT-2 vocab.json (merges.txt beside it), a directory holding one, or 'bytes' (required)"},
    {"input", "FILE", "text (one document) or JSONL (one document per line) (required)"},
    {"field", "NAME", "the JSONL field holding a document's text (default text)"},
    {"input-format", "auto|text|jsonl", "auto: jsonl for .jsonl/.ndjson files or with --field, else text"},
    {"out", "FILE.bin", "the token file to write, and FILE.bin.json beside it (required)"},
    {"token-dtype", "u16|u32", "id width (default u16 when the vocabulary fits, else u32)"},
    {"llmc", "", "write llm.c's 1024-byte header (magic, version, count) before the ids"},
    {"bos", "on|off", "start every document with bos (default: as the tokenizer's configuration says)"},
    {"eos", "on|off", "end every document with eos (default on when the tokenizer has one)"},
    {"check", "on|off", "decode every document again and compare with its text (default on)"},
    {"quiet", "", "no summary"},
    {"help", "", "show this help"},
};

std::string usage() {
  return "usage: strata tokenize --tokenizer FILE --input FILE [--field text] --out FILE.bin [flags]\n\n"
         "Writes a token file for strata train --tokens.\n\nflags:\n" +
         format_flags(kFlags);
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata tokenize: %s\n", s.message().c_str());
  return kExitFailure;
}

Result<bool> on_off(const Args& args, std::string_view name, bool fallback) {
  auto v = args.get(name);
  if (!v) return fallback;
  if (*v == "on") return true;
  if (*v == "off") return false;
  return invalid_argument("flag '--" + std::string(name) + "' expects on or off, got '" + *v + "'");
}

struct Settings {
  std::string input, out, field = "text";
  bool jsonl = false, llmc = false, bos = false, eos = false, check = true, quiet = false;
  TokenDType dtype = TokenDType::kU16;
};

// Reads the flags; `tok` decides the defaults.
Status read_settings(const Args& args, const Tokenizer& tok, Settings* s) {
  s->input = *args.get("input");
  s->out = *args.get("out");
  s->field = args.get("field").value_or("text");
  const std::string format = args.get("input-format").value_or("auto");
  if (format == "auto") {
    s->jsonl = args.has("field") || s->input.ends_with(".jsonl") || s->input.ends_with(".ndjson");
  } else if (format == "text" || format == "jsonl") {
    s->jsonl = format == "jsonl";
  } else {
    return invalid_argument("flag '--input-format' expects auto, text or jsonl, got '" + format + "'");
  }
  if (!s->jsonl && args.has("field")) return invalid_argument("flag '--field' is for JSONL input");
  s->dtype = tok.vocab_size() > 65536 ? TokenDType::kU32 : TokenDType::kU16;
  if (auto d = args.get("token-dtype")) {
    auto dtype = parse_token_dtype(*d);
    if (!dtype.ok()) return dtype.status().with_context("flag '--token-dtype'");
    if (*dtype == TokenDType::kU16 && tok.vocab_size() > 65536) {
      return invalid_argument("flag '--token-dtype u16': the tokenizer's vocabulary has " +
                              std::to_string(tok.vocab_size()) + " ids, more than u16 holds; use u32");
    }
    s->dtype = *dtype;
  }
  s->llmc = args.has("llmc");
  STRATA_ASSIGN_OR_RETURN(s->bos, on_off(args, "bos", tok.adds_bos()));
  STRATA_ASSIGN_OR_RETURN(s->eos, on_off(args, "eos", tok.eos_id() >= 0));
  STRATA_ASSIGN_OR_RETURN(s->check, on_off(args, "check", true));
  if (s->bos && tok.bos_id() < 0) return invalid_argument("flag '--bos on': the tokenizer has no bos token");
  if (s->eos && tok.eos_id() < 0) return invalid_argument("flag '--eos on': the tokenizer has no eos token");
  s->quiet = args.has("quiet");
  return ok_status();
}

struct Counts {
  std::uint64_t documents = 0, bytes = 0, differ = 0;
  std::uint64_t first_differ = 0;  // 1-based document number, 0 = none
};

// Encodes one document and appends it; `where` names it in errors ("line 12").
Status add_document(const Tokenizer& tok, const Settings& s, std::string_view text, const std::string& where,
                    TokenWriter& out, Counts& c, std::vector<std::int32_t>& ids) {
  ids.clear();
  if (s.bos) ids.push_back(tok.bos_id());
  const std::vector<std::int32_t> body = tok.encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  if (s.eos) ids.push_back(tok.eos_id());
  ++c.documents;
  c.bytes += text.size();
  if (s.check) {
    auto back = tok.decode(body);
    if (!back.ok()) return back.status().with_context(where);
    if (*back != text) {
      if (tok.round_trips()) {
        std::size_t i = 0;
        while (i < text.size() && i < back->size() && text[i] == (*back)[i]) ++i;
        return internal_error(where +
                              ": decoding the ids does not give the text back (first difference at byte " +
                              std::to_string(i) + "), though " + tok.name() + " guarantees it");
      }
      if (c.differ++ == 0) c.first_differ = c.documents;
    }
  }
  return out.append(ids);
}

Status tokenize(const Tokenizer& tok, const Settings& s, TokenWriter& out, Counts& c) {
  std::ifstream in(s.input, std::ios::binary);
  if (!in) return not_found("--input file '" + s.input + "' cannot be opened");
  std::vector<std::int32_t> ids;
  if (!s.jsonl) {
    std::ostringstream ss;
    ss << in.rdbuf();
    if (in.bad()) return io_error("--input file '" + s.input + "': read failed");
    return add_document(tok, s, ss.str(), "'" + s.input + "'", out, c, ids);
  }
  std::string line;
  std::uint64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = "'" + s.input + "' line " + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      return invalid_argument(where + " is not valid JSON: " + e.what());
    }
    if (!j.is_object() || !j.contains(s.field) || !j[s.field].is_string()) {
      return invalid_argument(where + " has no string field '" + s.field + "' (--field names it)");
    }
    STRATA_RETURN_IF_ERROR(
        add_document(tok, s, j[s.field].get_ref<const std::string&>(), where, out, c, ids));
  }
  if (in.bad()) return io_error("--input file '" + s.input + "': read failed");
  return ok_status();
}

int run_tokenize(std::span<const std::string> argv) {
  auto parsed = Args::parse(argv, kFlags);
  if (!parsed.ok()) return usage_error("tokenize", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("tokenize", "unexpected argument '" + args.positionals()[0] + "'", usage());
  }
  for (const char* required : {"tokenizer", "input", "out"}) {
    if (!args.has(required))
      return usage_error("tokenize", std::string("flag '--") + required + "' is required", usage());
  }
  auto tok = load_tokenizer(*args.get("tokenizer"));
  if (!tok.ok()) return fail(tok.status());
  Settings s;
  if (Status st = read_settings(args, **tok, &s); !st.ok())
    return usage_error("tokenize", st.message(), usage());
  auto out = TokenWriter::create(s.out, s.dtype, s.llmc ? TokenFormat::kLlmc : TokenFormat::kFlat);
  if (!out.ok()) return fail(out.status());
  Counts c;
  if (Status st = tokenize(**tok, s, *out, c); !st.ok()) return fail(st);
  TokenFileMeta meta;
  meta.tokenizer = (*tok)->name();
  meta.vocab_size = (*tok)->vocab_size();
  meta.bos_id = (*tok)->bos_id();
  meta.eos_id = (*tok)->eos_id();
  const std::uint64_t tokens = out->tokens();
  if (Status st = out->finish(meta); !st.ok()) return fail(st);
  if (s.quiet) return kExitOk;
  std::printf("tokenize %llu document(s), %llu bytes -> %llu tokens (%.2f bytes/token) with %s\n",
              static_cast<unsigned long long>(c.documents), static_cast<unsigned long long>(c.bytes),
              static_cast<unsigned long long>(tokens),
              tokens > 0 ? static_cast<double>(c.bytes) / static_cast<double>(tokens) : 0.0,
              (*tok)->name().c_str());
  std::printf("         %s%s%s\n", s.bos ? "bos first, " : "", s.eos ? "eos after each document, " : "",
              (std::string(to_string(s.dtype)) + (s.llmc ? " with llm.c's header" : " flat")).c_str());
  if (s.check) {
    if (c.differ == 0) {
      std::printf("         round trip: every document decodes to its text\n");
    } else {
      std::printf(
          "         round trip: %llu of %llu document(s) decode to other text (the first: document %llu); %s "
          "normalizes its input\n",
          static_cast<unsigned long long>(c.differ), static_cast<unsigned long long>(c.documents),
          static_cast<unsigned long long>(c.first_differ), (*tok)->name().c_str());
    }
  }
  std::printf("         wrote %s and %s\n", s.out.c_str(), token_meta_path(s.out).c_str());
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(tokenize, "turn text or JSONL into a token file for train --tokens", run_tokenize);

}  // namespace strata::cli
