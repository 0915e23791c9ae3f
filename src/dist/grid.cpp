#include "dist/grid.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetron::dist {

GridShape grid_shape(int world, int tp, int pp, int ep) {
  if (world < 1) fail("parallel layout: the world size must be >= 1, got {}", world);
  if (tp < 1 || pp < 1 || ep < 1) fail("parallel layout: tp {}, pp {}, ep {} must all be >= 1", tp, pp, ep);
  if (world % (tp * pp) != 0)
    fail("parallel layout: world size {} is not divisible by tp {} x pp {} = {}", world, tp, pp, tp * pp);
  GridShape s;
  s.world = world;
  s.tp = tp;
  s.pp = pp;
  s.dp = world / (tp * pp);
  s.ep = ep;
  if (s.dp % ep != 0)
    fail("parallel.ep: ep {} does not divide the data-parallel size {} (= world {} / (tp {} x pp {}))", ep, s.dp,
         world, tp, pp);
  return s;
}

GridCoord grid_coord(const GridShape& s, int r) {
  if (r < 0 || r >= s.world) fail("process grid: rank {} outside a world of {}", r, s.world);
  GridCoord c;
  c.tp = r % s.tp;
  c.dp = (r / s.tp) % s.dp;
  c.pp = r / (s.tp * s.dp);
  c.ep = c.dp % s.ep;
  c.edp = c.dp / s.ep;
  return c;
}

int grid_rank(const GridShape& s, const GridCoord& c) { return c.tp + s.tp * (c.dp + s.dp * c.pp); }

ProcessGrid::ProcessGrid(Comm& world, int tp, int pp, int ep)
    : world_(world), shape_(grid_shape(world.size(), tp, pp, ep)), coord_(grid_coord(shape_, world.rank())) {
  const GridCoord& c = coord_;
  const GridShape& s = shape_;
  // Colors number the groups; keys order the ranks inside them.
  tp_ = world.split(c.pp * s.dp + c.dp, c.tp, "tp");
  dp_ = world.split(c.pp * s.tp + c.tp, c.dp, "dp");
  pp_ = world.split(c.dp * s.tp + c.tp, c.pp, "pp");
  ep_ = world.split((c.pp * s.tp + c.tp) * (s.dp / s.ep) + c.edp, c.ep, "ep");
  edp_ = world.split((c.pp * s.tp + c.tp) * s.ep + c.ep, c.edp, "edp");
}

std::string ProcessGrid::describe() const {
  return fmt::format("rank {} (tp {}, dp {}, pp {}, ep {})", world_.rank(), coord_.tp, coord_.dp, coord_.pp,
                     coord_.ep);
}

}  // namespace moetron::dist
