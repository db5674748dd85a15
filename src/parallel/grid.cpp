// The TP x PP x DP rank grid (formula in parallel.hpp) and the process groups built from it.
#include <array>

#include "parallel/internal.hpp"

namespace strata {

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

std::string_view to_string(CommBackend backend) {
  switch (backend) {
    case CommBackend::kMpi:
      return "mpi";
    case CommBackend::kNccl:
      return "nccl";
  }
  return "unknown";
}

Result<CommBackend> parse_comm_backend(std::string_view text) {
  if (text == "mpi") return CommBackend::kMpi;
  if (text == "nccl") return CommBackend::kNccl;
  return invalid_argument("comm backend '" + std::string(text) + "' is not known (expected mpi or nccl)");
}

Result<CommBackend> comm_backend_for_device(std::string_view device) {
  if (device == "cpu") return CommBackend::kMpi;
  if (device == "cuda") return CommBackend::kNccl;
  return invalid_argument("device '" + std::string(device) +
                          "' has no comm backend (expected cpu -> mpi or cuda -> nccl)");
}

std::string_view to_string(GridAxis axis) {
  switch (axis) {
    case GridAxis::kTensor:
      return "tp";
    case GridAxis::kPipeline:
      return "pp";
    case GridAxis::kData:
      return "dp";
  }
  return "unknown";
}

Result<RankGrid> RankGrid::create(int world_size, int tp, int pp) {
  if (world_size < 1 || tp < 1 || pp < 1) {
    return invalid_argument("rank grid: world size " + std::to_string(world_size) + ", tensor parallel " +
                            std::to_string(tp) + " and pipeline parallel " + std::to_string(pp) +
                            " must all be at least 1");
  }
  if (world_size % (tp * pp) != 0) {
    return invalid_argument(
        "rank grid: world size " + std::to_string(world_size) +
        " is not a multiple of tensor parallel x pipeline parallel = " + std::to_string(tp) + " x " +
        std::to_string(pp) + " (data parallel = world / (tp * pp) must be whole)");
  }
  return RankGrid(tp, pp, world_size / (tp * pp));
}

int RankGrid::size(GridAxis axis) const {
  switch (axis) {
    case GridAxis::kTensor:
      return tp_;
    case GridAxis::kPipeline:
      return pp_;
    case GridAxis::kData:
      return dp_;
  }
  return 0;
}

GridCoord RankGrid::coord_of(int rank) const {
  GridCoord c;
  c.tp = rank % tp_;
  c.pp = (rank / tp_) % pp_;
  c.dp = rank / (tp_ * pp_);
  return c;
}

std::vector<int> RankGrid::group_ranks(GridAxis axis, int rank) const {
  GridCoord c = coord_of(rank);
  std::vector<int> out;
  for (int i = 0; i < size(axis); ++i) {
    GridCoord m = c;
    (axis == GridAxis::kTensor ? m.tp : axis == GridAxis::kPipeline ? m.pp : m.dp) = i;
    out.push_back(rank_of(m));
  }
  return out;
}

int RankGrid::group_index(GridAxis axis, int rank) const {
  // Number the groups by the two coordinates the members share, in grid order.
  GridCoord c = coord_of(rank);
  switch (axis) {
    case GridAxis::kTensor:
      return c.dp * pp_ + c.pp;
    case GridAxis::kPipeline:
      return c.dp * tp_ + c.tp;
    case GridAxis::kData:
      return c.pp * tp_ + c.tp;
  }
  return -1;
}

Comm& ProcessGroups::group(GridAxis axis) const {
  switch (axis) {
    case GridAxis::kTensor:
      return *tp;
    case GridAxis::kPipeline:
      return *pp;
    case GridAxis::kData:
      return *dp;
  }
  return *world;
}

Result<ProcessGroups> make_process_groups(CommContext& context, CommBackend backend, int tp, int pp) {
  STRATA_ASSIGN_OR_RETURN(RankGrid grid, RankGrid::create(context.world_size(), tp, pp));
  ProcessGroups g;
  g.grid = grid;
  g.coord = grid.coord_of(context.world_rank());
  STRATA_ASSIGN_OR_RETURN(g.world, context.world(backend));
  const int me = context.world_rank();
  constexpr std::array<GridAxis, 3> kAxes = {GridAxis::kTensor, GridAxis::kPipeline, GridAxis::kData};
  for (GridAxis axis : kAxes) {
    // The key is the coordinate along the axis, so group rank == coordinate.
    const int key = axis == GridAxis::kTensor     ? g.coord.tp
                    : axis == GridAxis::kPipeline ? g.coord.pp
                                                  : g.coord.dp;
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> c,
                            g.world->split(grid.group_index(axis, me), key, to_string(axis)));
    (axis == GridAxis::kTensor ? g.tp : axis == GridAxis::kPipeline ? g.pp : g.dp) = std::move(c);
  }
  return g;
}

}  // namespace strata
