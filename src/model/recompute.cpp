// Activation recompute's names; see recompute.h.
#include "model/recompute.h"

#include "core/error.h"

namespace moetron {

Recompute parse_recompute(std::string_view s, std::string_view where) {
  if (s == "none") return Recompute::none;
  if (s == "full") return Recompute::full;
  if (s == "selective") return Recompute::selective;
  fail("{}: must be one of none, full, selective, got \"{}\"", where, s);
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::full: return "full";
    case Recompute::selective: return "selective";
  }
  return "?";
}

}  // namespace moetron
