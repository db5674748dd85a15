// Agreement on failures between ranks (docs/offload.md "Faults"): a rank that cannot do its part
// of a collective piece of work keeps its place in the collectives and every rank of the group
// learns the same outcome at the same point, instead of its peers waiting for it until the comm
// timeout. Each call is collective over the Comm (or the groups) it is given: every rank calls it
// at the same point.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "parallel/rank_comms.hpp"
#include "strata/parallel.hpp"
#include "strata/status.hpp"

namespace strata::parallel {

// Words per rank of the exchange: a flag, the status code and the first bytes of the message.
inline constexpr std::size_t kAgreeWords = 64;

// The exchange: OK when every rank of `comm` succeeded, else the lowest failing rank's status as
// that rank had it (its code and the first bytes of its message), its rank in `*failing` where
// given. A failed exchange is returned with context naming `group`, `verb` and `what`
// ("exchanging whether each could write its part of the weights"; `*failing` = -1).
Status first_failure(Comm& comm, const Status& mine, const std::string& what, const char* group,
                     int* failing = nullptr, const char* verb = "read");

// Each rank's outcome of the read before a collective, `mine`, exchanged: OK when every rank read;
// otherwise every rank returns the same error, naming the lowest failing rank of `group`
// ("data-parallel", "tensor-parallel") and `what`, with that rank's message. `verb` names what
// failed ("read"; the pipeline checkpoint's stages agree on "write").
Status agree_on_read(Comm& comm, const Status& mine, const std::string& what, const char* group,
                     const char* verb = "read");

// first_failure over the tensor-, then the data-parallel, then the pipeline group (those this
// rank has, through their callers' Comms): every rank of the grid ends with the same lowest
// failing rank's status.
Status agree_everywhere(RankComms& c, const Status& mine, const std::string& what, const char* verb);

// The data-parallel leg of a collective on the caller's Comm, timed and counted by its owner
// (the engine's dp_wait).
using TimedWait = std::function<Status(CommWork work, const char* what, std::uint64_t bytes)>;

// `n` words from the writer (tp 0, dp 0, stage 0) to every rank: over the tensor-parallel groups,
// the data-parallel groups, then the pipeline groups (collective over all three).
Status broadcast_from_writer(RankComms& c, std::uint32_t* words, std::size_t n, const char* what,
                             const TimedWait& dp_wait);

}  // namespace strata::parallel
