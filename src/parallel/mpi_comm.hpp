// The mpi backend's bounded reduction buffer (docs/parallel.md "Reductions from point-to-point
// messages, chunked"): its capacity, how a reduction is cut into chunks of it, and a read-only
// view of what a Comm holds, for the tests. Free of MPI, so a test can include it alone.
#pragma once

#include <cstddef>

#include "strata/parallel.hpp"

namespace strata::detail {

// The receive buffer of the mpi backend's direct reductions (reduce_direct), fp32 bytes in all,
// for the life of a Comm: two halves (one being folded while the next chunk lands in the other),
// each holding one chunk from every peer. A reduction of any size streams through it.
inline constexpr std::size_t kMpiReduceBufferBytes = std::size_t{2} << 20;

// fp32 elements of one chunk (per peer, per half) in a group of `ranks`; each rank's range of a
// reduction is cut into pieces of this many elements. A group of one has no peers and no chunks.
constexpr std::size_t mpi_reduce_chunk_elements(int ranks) {
  return ranks <= 1 ? ~std::size_t{0}
                    : kMpiReduceBufferBytes / sizeof(float) / (2 * static_cast<std::size_t>(ranks - 1));
}

// The bytes of reduction receive buffer `comm` holds now (its allocated capacity), at most
// kMpiReduceBufferBytes; 0 for a Comm of another backend. Call it with no operation of `comm`
// pending (after waiting for the last one): the buffer belongs to the thread running them.
std::size_t mpi_reduce_buffer_bytes(const Comm& comm);

}  // namespace strata::detail
