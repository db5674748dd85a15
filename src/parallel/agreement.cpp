// Agreement on failures between ranks (agreement.hpp).
#include "parallel/agreement.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

namespace strata::parallel {

Status first_failure(Comm& comm, const Status& mine, const std::string& what, const char* group, int* failing,
                     const char* verb) {
  if (failing != nullptr) *failing = -1;
  // Word 0: 1 read, 0 failed; word 1: the status code; then the message's first bytes (NUL-padded).
  std::array<std::uint32_t, kAgreeWords> word{};
  word[0] = mine.ok() ? 1 : 0;
  word[1] = static_cast<std::uint32_t>(mine.code());
  if (!mine.ok())
    std::memcpy(word.data() + 2, mine.message().data(),
                std::min<std::size_t>(mine.message().size(), 4 * (kAgreeWords - 2) - 1));
  std::vector<std::uint32_t> all(kAgreeWords * static_cast<std::size_t>(comm.size()));
  // The words travel as raw f32 bits (an all-gather moves bits, it does not add).
  Status s = comm.all_gather(word.data(), all.data(), kAgreeWords, DType::kF32).wait();
  if (!s.ok()) {
    return s.with_context(std::string(group) + " ranks: exchanging whether each could " + verb + " " + what);
  }
  for (int r = 0; r < comm.size(); ++r) {
    const std::uint32_t* theirs = all.data() + static_cast<std::size_t>(r) * kAgreeWords;
    if (theirs[0] == 1) continue;
    const std::string cause(reinterpret_cast<const char*>(theirs + 2),
                            strnlen(reinterpret_cast<const char*>(theirs + 2), 4 * (kAgreeWords - 2)));
    const auto code = theirs[1] == 0 || theirs[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(theirs[1]);
    if (failing != nullptr) *failing = r;
    return Status(code, cause);
  }
  return ok_status();
}

Status agree_on_read(Comm& comm, const Status& mine, const std::string& what, const char* group,
                     const char* verb) {
  int failing = -1;
  Status s = first_failure(comm, mine, what, group, &failing, verb);
  if (s.ok() || failing < 0) return s;
  return Status(s.code(), std::string(group) + " rank " + std::to_string(failing) + " of " +
                              std::to_string(comm.size()) + " could not " + verb + " " + what + ": " +
                              s.message());
}

Status agree_everywhere(RankComms& c, const Status& mine, const std::string& what, const char* verb) {
  Status all = mine;
  if (c.tp_size > 1) all = first_failure(*c.tp_step, all, what, "tensor-parallel", nullptr, verb);
  if (c.dp_size > 1) all = first_failure(*c.dp_caller, all, what, "data-parallel", nullptr, verb);
  if (c.pp_size > 1) all = first_failure(*c.pp_caller, all, what, "pipeline", nullptr, verb);
  return all;
}

Status broadcast_from_writer(RankComms& c, std::uint32_t* words, std::size_t n, const char* what,
                             const TimedWait& dp_wait) {
  // The writer's tp group first, then the dp groups (the first stage's get it from theirs), then
  // the pp groups (every stage from the first).
  Status b;
  if (c.tp_size > 1) b = c.tp_step->broadcast(words, n, DType::kF32, 0).wait();
  if (b.ok() && c.dp_size > 1) b = dp_wait(c.dp_caller->broadcast(words, n, DType::kF32, 0), what, 4 * n);
  if (b.ok() && c.pp_size > 1) b = c.pp_caller->broadcast(words, n, DType::kF32, 0).wait();
  return b.ok() ? b : b.with_context(what);
}

std::string RankComms::rank_name() const {
  std::string name;
  auto add = [&name](const std::string& part) { name += (name.empty() ? "" : ", ") + part; };
  if (pp_size > 1) add("pipeline stage " + std::to_string(pp_rank));
  if (tp_size > 1) add("tensor-parallel rank " + std::to_string(tp_rank) + " of " + std::to_string(tp_size));
  if (dp_size > 1) add("data-parallel rank " + std::to_string(dp_rank) + " of " + std::to_string(dp_size));
  return name;
}

}  // namespace strata::parallel
