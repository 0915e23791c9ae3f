// The process grid (DESIGN §6): world = pp x dp x tp, ep dividing dp.
//
// Rank order (Megatron's): tp fastest, then dp, then pp:
//   world_rank = tp_rank + tp * (dp_rank + dp * pp_rank)
// so the ranks of a tensor-parallel group are neighbours (one node when tp <= GPUs per node).
// Expert parallelism subdivides the data-parallel group: dp_rank = edp_rank * ep + ep_rank, the ep
// consecutive dp ranks of one expert-parallel group hold different experts (E/ep each), and the
// dp/ep ranks with the same ep_rank (the expert-data-parallel group) hold the same experts.
//
// Groups (each a Comm split from the world, ranks ordered by the coordinate that varies):
//   tp   same (pp, dp):            tensor-parallel all-reduces
//   dp   same (pp, tp):            gradient reduction and ZeRO-1 of the non-expert weights
//   pp   same (dp, tp):            pipeline send/recv between stages
//   ep   same (pp, tp, edp_rank):  token all-to-all
//   edp  same (pp, tp, ep_rank):   gradient reduction and ZeRO-1 of the expert weights
#pragma once

#include <memory>
#include <string>

#include "dist/comm.h"

namespace moetron::dist {

struct GridShape {
  int world = 1, tp = 1, pp = 1, dp = 1, ep = 1;
};

// dp = world / (tp * pp).  Error naming the numbers when a size is below 1, the world does not
// divide, or ep does not divide dp (parallel.ep).  The model's rules are model/params.h's
// (check_tp_split, check_ep_split); train/layout.h applies them all.
GridShape grid_shape(int world, int tp, int pp, int ep);

struct GridCoord {
  int tp = 0, pp = 0, dp = 0, ep = 0, edp = 0;
};
GridCoord grid_coord(const GridShape& shape, int world_rank);
int grid_rank(const GridShape& shape, const GridCoord& c);  // the world rank at (tp, dp, pp)

class ProcessGrid {
 public:
  // Collective over `world` (splits the groups).  `world` must outlive the grid.
  ProcessGrid(Comm& world, int tp, int pp, int ep);

  const GridShape& shape() const { return shape_; }
  const GridCoord& coord() const { return coord_; }
  Comm& world() const { return world_; }
  Comm& tp() const { return *tp_; }
  Comm& dp() const { return *dp_; }
  Comm& pp() const { return *pp_; }
  Comm& ep() const { return *ep_; }
  Comm& edp() const { return *edp_; }
  // "rank 5 (tp 1, dp 2, pp 0)" for messages.
  std::string describe() const;

 private:
  Comm& world_;
  GridShape shape_;
  GridCoord coord_;
  std::unique_ptr<Comm> tp_, dp_, pp_, ep_, edp_;
};

}  // namespace moetron::dist
