// The swap store's journal encoding. Records are appended whole with one write(2); a crash
// can leave only the last one torn, and its checksum tells replay where the valid prefix ends.
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

Result<JournalContents> decode_journal(const std::string& image, const std::string& path) {
  JournalContents out;
  out.file_bytes = image.size();
  std::size_t pos = 0;
  bool have_header = false;
  while (pos + kFrame <= image.size()) {
    Reader fr(image.data() + pos, kFrame);
    std::uint32_t magic, type, len, crc;
    fr.u32(magic);
    fr.u32(type);
    fr.u32(len);
    fr.u32(crc);
    if (magic != kMagic || len > kMaxPayload || pos + kFrame + len > image.size()) break;
    const char* payload = image.data() + pos + kFrame;
    Writer sum;
    sum.u32(type);
    sum.u32(len);
    std::uint32_t got = crc32c(sum.bytes().data(), sum.bytes().size());
    got = crc32c(payload, len, got);
    if (got != crc) break;
    Reader r(payload, len);
    if (!have_header) {
      std::uint32_t format;
      std::uint8_t checksums;
      if (type != kTypeHeader || !r.u32(format) || format != kFormat || !r.u32(out.header.dirs) ||
          !r.u64(out.header.member_capacity) || !r.u64(out.header.stripe_unit) ||
          !r.u64(out.header.checksum_block) || !r.u8(checksums)) {
        return data_loss("swap journal " + path + " has no valid header (format " + std::to_string(kFormat) +
                         "); remove the swap store's files to start over");
      }
      out.header.checksums = checksums != 0;
      have_header = true;
    } else if (type == kTypePut) {
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
      if (!ok || !r.done()) break;
      out.records.emplace_back(std::move(p));
    } else if (type == kTypeRemove) {
      JournalRemove rm;
      if (!(r.u64(rm.seq) && r.str(rm.key.name) && r.u32(rm.key.shard)) || !r.done()) break;
      out.records.emplace_back(std::move(rm));
    } else {
      break;
    }
    pos += kFrame + len;
    out.valid_bytes = pos;
  }
  if (!have_header) {
    return data_loss("swap journal " + path +
                     " has no valid header; remove the swap store's files to start over");
  }
  return out;
}

}  // namespace strata::nvme_detail
