// The swap store's journal encoding. Records are appended whole with one write(2); a crash
// can leave only the last one torn, and its checksum tells replay where the valid prefix ends.
// A bad record with intact records after it is not a crash but corruption: decoding reports it
// and carries on, so the records after it are never mistaken for a torn tail.
#include <cstdio>
#include <cstring>

#include "nvme/swap_internal.hpp"

namespace strata::nvme_detail {
namespace {

constexpr std::uint32_t kMagic = 0x524A5753u;  // "SWJR"
constexpr std::uint32_t kFormat = 1;
constexpr std::uint32_t kTypeHeader = 1, kTypePut = 2, kTypeRemove = 3;
constexpr std::size_t kFrame = 16;
constexpr std::uint32_t kMaxPayload = 1u << 30;

class Writer {
 public:
  void u8(std::uint8_t v) { s_.push_back(static_cast<char>(v)); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) s_.push_back(static_cast<char>(v >> (8 * i)));
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) s_.push_back(static_cast<char>(v >> (8 * i)));
  }
  void str(const std::string& v) {
    u32(static_cast<std::uint32_t>(v.size()));
    s_ += v;
  }
  std::string& bytes() { return s_; }

 private:
  std::string s_;
};

class Reader {
 public:
  Reader(const char* p, std::size_t n) : p_(p), n_(n) {}
  bool u8(std::uint8_t& v) {
    if (n_ < 1) return false;
    v = static_cast<std::uint8_t>(*p_);
    ++p_;
    --n_;
    return true;
  }
  bool u32(std::uint32_t& v) {
    if (n_ < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p_[i])) << (8 * i);
    p_ += 4;
    n_ -= 4;
    return true;
  }
  bool u64(std::uint64_t& v) {
    if (n_ < 8) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p_[i])) << (8 * i);
    p_ += 8;
    n_ -= 8;
    return true;
  }
  bool str(std::string& v) {
    std::uint32_t len;
    if (!u32(len) || n_ < len) return false;
    v.assign(p_, len);
    p_ += len;
    n_ -= len;
    return true;
  }
  bool done() const { return n_ == 0; }

 private:
  const char* p_;
  std::size_t n_;
};

std::string frame(std::uint32_t type, const std::string& payload) {
  Writer w;
  w.u32(kMagic);
  w.u32(type);
  w.u32(static_cast<std::uint32_t>(payload.size()));
  Writer sum;
  sum.u32(type);
  sum.u32(static_cast<std::uint32_t>(payload.size()));
  std::uint32_t crc = crc32c(sum.bytes().data(), sum.bytes().size());
  crc = crc32c(payload.data(), payload.size(), crc);
  w.u32(crc);
  w.bytes() += payload;
  return std::move(w.bytes());
}

}  // namespace

std::string encode_header(const JournalHeader& h) {
  Writer w;
  w.u32(kFormat);
  w.u32(h.dirs);
  w.u64(h.member_capacity);
  w.u64(h.stripe_unit);
  w.u64(h.checksum_block);
  w.u8(h.checksums ? 1 : 0);
  return frame(kTypeHeader, w.bytes());
}

std::string encode(const JournalRecord& r) {
  Writer w;
  if (const auto* put = std::get_if<JournalPut>(&r)) {
    w.u64(put->seq);
    w.str(put->key.name);
    w.u32(put->key.shard);
    w.u64(put->size);
    w.u32(static_cast<std::uint32_t>(put->extents.size()));
    for (const auto& e : put->extents) {
      w.u64(e.offset);
      w.u64(e.length);
    }
    w.u32(static_cast<std::uint32_t>(put->crcs.size()));
    for (std::uint32_t c : put->crcs) w.u32(c);
    return frame(kTypePut, w.bytes());
  }
  const auto& rm = std::get<JournalRemove>(r);
  w.u64(rm.seq);
  w.str(rm.key.name);
  w.u32(rm.key.shard);
  return frame(kTypeRemove, w.bytes());
}

namespace {

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

struct Frame {
  std::uint32_t magic = 0, type = 0, len = 0, crc = 0;
  const char* payload = nullptr;
};

// Reads the frame at `pos`; an empty string when it is intact, else why not.
std::string read_frame(const std::string& image, std::size_t pos, Frame* f) {
  if (image.size() - pos < kFrame) {
    return std::to_string(image.size() - pos) + " bytes left, a record's frame has " + std::to_string(kFrame);
  }
  Reader fr(image.data() + pos, kFrame);
  fr.u32(f->magic);
  fr.u32(f->type);
  fr.u32(f->len);
  fr.u32(f->crc);
  if (f->magic != kMagic) return "magic " + hex32(f->magic) + ", expected " + hex32(kMagic) + " ('SWJR')";
  if (f->len > kMaxPayload || f->len > image.size() - pos - kFrame) {
    return "payload of " + std::to_string(f->len) + " bytes runs past the end of the journal (" +
           std::to_string(image.size()) + " bytes)";
  }
  f->payload = image.data() + pos + kFrame;
  Writer sum;
  sum.u32(f->type);
  sum.u32(f->len);
  std::uint32_t got = crc32c(sum.bytes().data(), sum.bytes().size());
  got = crc32c(f->payload, f->len, got);
  if (got != f->crc)
    return "checksum mismatch (stored crc32c " + hex32(f->crc) + ", computed " + hex32(got) + ")";
  return {};
}

// Parses a put or remove payload; false when it is malformed.
bool parse_payload(const Frame& f, JournalRecord* out) {
  Reader r(f.payload, f.len);
  if (f.type == kTypePut) {
    JournalPut p;
    std::uint32_t n;
    bool ok = r.u64(p.seq) && r.str(p.key.name) && r.u32(p.key.shard) && r.u64(p.size) && r.u32(n);
    for (std::uint32_t i = 0; ok && i < n; ++i) {
      Extent e{};
      ok = r.u64(e.offset) && r.u64(e.length);
      p.extents.push_back(e);
    }
    ok = ok && r.u32(n);
    for (std::uint32_t i = 0; ok && i < n; ++i) {
      std::uint32_t c = 0;
      ok = r.u32(c);
      p.crcs.push_back(c);
    }
    if (!ok || !r.done()) return false;
    *out = std::move(p);
    return true;
  }
  if (f.type == kTypeRemove) {
    JournalRemove rm;
    if (!(r.u64(rm.seq) && r.str(rm.key.name) && r.u32(rm.key.shard)) || !r.done()) return false;
    *out = std::move(rm);
    return true;
  }
  return false;
}

// The record at `pos`: empty string and *out set when intact, else why not.
std::string read_record(const std::string& image, std::size_t pos, JournalRecord* out, std::size_t* next) {
  Frame f;
  std::string why = read_frame(image, pos, &f);
  if (!why.empty()) return why;
  if (f.type != kTypePut && f.type != kTypeRemove) {
    return "unknown record type " + std::to_string(f.type) + " (expected " + std::to_string(kTypePut) +
           " put or " + std::to_string(kTypeRemove) + " remove)";
  }
  if (!parse_payload(f, out)) {
    return std::string("malformed ") + (f.type == kTypePut ? "put" : "remove") + " record of " +
           std::to_string(f.len) + " bytes";
  }
  *next = pos + kFrame + f.len;
  return {};
}

// What a bad record seems to hold, trusting its frame but not its checksum.
void guess(const std::string& image, std::size_t pos, JournalDamage* d) {
  Frame f;
  std::string why = read_frame(image, pos, &f);
  if (f.payload == nullptr) return;  // no plausible frame
  JournalRecord r;
  if (!parse_payload(f, &r)) return;
  if (const auto* put = std::get_if<JournalPut>(&r)) {
    d->suspect = "a put of " + put->key.to_string();
    d->suspect_key = put->key;
  } else {
    const auto& rm = std::get<JournalRemove>(r);
    d->suspect = "a remove of " + rm.key.to_string();
    d->suspect_key = rm.key;
  }
}

}  // namespace

Result<JournalContents> decode_journal(const std::string& image, const std::string& path) {
  JournalContents out;
  out.file_bytes = image.size();
  auto bad_header = [&](const std::string& what) {
    return data_loss("swap journal " + path + ": " + what +
                     "; not a usable Strata swap journal (remove the swap store's strata-swap.* files to "
                     "start over)");
  };
  Frame f;
  if (image.size() < kFrame) {
    return bad_header("the file has " + std::to_string(image.size()) + " bytes, too short for the " +
                      std::to_string(kFrame) + "-byte frame of its header at offset 0");
  }
  if (std::string why = read_frame(image, 0, &f); !why.empty())
    return bad_header("header at offset 0: " + why);
  if (f.type != kTypeHeader) {
    return bad_header("the record at offset 0 has type " + std::to_string(f.type) +
                      ", expected the header (type " + std::to_string(kTypeHeader) + ")");
  }
  {
    Reader r(f.payload, f.len);
    std::uint32_t format = 0;
    std::uint8_t checksums = 0;
    if (!r.u32(format)) return bad_header("header at offset 0 has no format field");
    if (format != kFormat) {
      return bad_header("header at offset 0 has format " + std::to_string(format) +
                        "; this build reads format " + std::to_string(kFormat));
    }
    if (!r.u32(out.header.dirs) || !r.u64(out.header.member_capacity) || !r.u64(out.header.stripe_unit) ||
        !r.u64(out.header.checksum_block) || !r.u8(checksums) || !r.done()) {
      return bad_header("header at offset 0 has " + std::to_string(f.len) + " payload bytes, format " +
                        std::to_string(kFormat) + " has 33");
    }
    out.header.checksums = checksums != 0;
  }
  std::size_t pos = kFrame + f.len;
  out.valid_bytes = pos;
  while (pos < image.size()) {
    JournalRecord rec;
    std::size_t next = 0;
    std::string why = read_record(image, pos, &rec, &next);
    if (why.empty()) {
      out.records.push_back(std::move(rec));
      out.record_offsets.push_back(pos);
      pos = next;
      out.valid_bytes = pos;
      continue;
    }
    // Look for the next intact record. A magic number inside a payload is not enough: the
    // frame's checksum and the payload must check out too.
    std::size_t resume = std::string::npos;
    for (std::size_t q = pos + 1; q + kFrame <= image.size(); ++q) {
      if (std::memcmp(image.data() + q, "SWJR", 4) != 0) continue;
      JournalRecord probe;
      std::size_t probe_next = 0;
      if (read_record(image, q, &probe, &probe_next).empty()) {
        resume = q;
        break;
      }
    }
    if (resume == std::string::npos) break;  // a torn tail: valid_bytes ends before it
    JournalDamage d;
    d.offset = pos;
    d.bytes = resume - pos;
    d.reason = why;
    guess(image, pos, &d);
    out.damage.push_back(std::move(d));
    pos = resume;
  }
  return out;
}

}  // namespace strata::nvme_detail
