// Pipeline stage assignment: contiguous module ranges balanced by forward FLOPs (model.hpp,
// docs/parallel.md "Pipeline parallel").
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "strata/model.hpp"

namespace strata {

std::vector<double> module_flops(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len) {
  // model_flops is a sum over layers plus the head, so the model without blocks is the head and
  // one block more is one block (every block has the same shapes).
  ModelConfig none = config, one = config;
  none.n_layer = 0;
  one.n_layer = 1;
  const double head = model_flops(none, batch, seq_len, true);
  const double block = model_flops(one, batch, seq_len, true) - head;
  std::vector<double> f;
  f.push_back(0.0);  // the embedding: a gather
  for (std::int64_t l = 0; l < config.n_layer; ++l) f.push_back(block);
  f.push_back(head);
  return f;
}

Result<std::vector<int>> pipeline_stages(const ModelConfig& config, int stages, std::int64_t seq_len) {
  const std::vector<double> f = module_flops(config, 1, seq_len > 0 ? seq_len : config.n_positions);
  const int M = static_cast<int>(f.size());
  if (stages < 1 || stages > M) {
    return invalid_argument("pipeline_parallel_size = " + std::to_string(stages) + ": the model has " +
                            std::to_string(M) + " modules (embedding, " + std::to_string(config.n_layer) +
                            " blocks, head) and every stage needs at least one; use 1 to " +
                            std::to_string(M));
  }
  // cost(i, j): the FLOPs of modules [i, j), always summed in the same order, so equal splits
  // compare equal below.
  auto cost = [&](int i, int j) {
    double c = 0.0;
    for (int k = i; k < j; ++k) c += f[static_cast<std::size_t>(k)];
    return c;
  };
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest possible largest-stage cost of modules [i, M) over stages k..stages-1.
  std::vector<std::vector<double>> best(static_cast<std::size_t>(stages) + 1,
                                        std::vector<double>(static_cast<std::size_t>(M) + 1, inf));
  best[static_cast<std::size_t>(stages)][static_cast<std::size_t>(M)] = 0.0;
  for (int k = stages - 1; k >= 0; --k) {
    for (int i = 0; i < M; ++i) {
      double b = inf;
      for (int j = i + 1; j <= M; ++j)
        b = std::min(b, std::max(cost(i, j), best[k + 1][static_cast<std::size_t>(j)]));
      best[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)] = b;
    }
  }
  const double target = best[0][0];
  std::vector<int> bounds{0};
  int i = 0;
  for (int k = 0; k < stages; ++k) {
    int j = i + 1;
    while (j <= M &&
           std::max(cost(i, j), best[static_cast<std::size_t>(k) + 1][static_cast<std::size_t>(j)]) > target)
      ++j;
    if (j > M) return internal_error("pipeline_stages: no split reaches the optimum");  // unreachable
    bounds.push_back(j);
    i = j;
  }
  return bounds;
}

}  // namespace strata
