// `moetron plan --search`; see plan_search.h.
#include "train/plan_search.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace moetron {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; i++)
    if (n % i == 0) d.push_back(i);
  return d;
}

// Seconds to move `bytes` over a group's link: within a node when `extent` consecutive ranks (the
// span of the group in rank order) fit in one.
double link_s(double bytes, int extent, const SearchHardware& hw) {
  const double gbps = extent <= hw.devices_per_node ? hw.intra_node_gbps : hw.inter_node_gbps;
  return bytes / (gbps * 1e9);
}

void estimate(SearchCandidate& c, const Plan& p, const SearchHardware& hw) {
  const double flops_per_s = hw.peak_tflops * 1e12 * hw.efficiency;
  double stage_s = 0, compute_s = 0, comm_s = 0, dp_s = 0;
  for (const StagePlan& s : p.stages) {
    const double compute = s.flops / flops_per_s;
    const double comm = link_s((double)s.comm.tp, p.tp, hw) + link_s((double)s.comm.ep, p.tp * p.ep, hw) +
                        link_s((double)s.comm.pp, p.world, hw);
    if (compute + comm > stage_s) {
      stage_s = compute + comm;
      compute_s = compute;
      comm_s = comm;
    }
    dp_s = std::max(dp_s, link_s((double)s.comm.dp, p.tp * p.dp, hw));
  }
  c.bubble = p.bubble;
  c.compute_s = compute_s;
  c.comm_s = comm_s + dp_s;
  c.step_s = stage_s / (1.0 - p.bubble) + dp_s;
  c.tokens_per_s = (double)p.tokens_per_step / c.step_s;
  c.mfu = p.flops_per_step / (p.world * hw.peak_tflops * 1e12 * c.step_s);
}

}  // namespace

std::vector<std::string> SearchCandidate::overrides() const {
  return {fmt::format("parallel.tp={}", tp), fmt::format("parallel.pp={}", pp), fmt::format("parallel.ep={}", ep),
          fmt::format("train.micro_batch_size={}", micro_batch_size), "train.recompute=" + recompute};
}

SearchResult search_layouts(const TrainConfig& cfg, const ModelConfig& model, int world, int64_t device_memory,
                            const SearchHardware& hw) {
  if (world < 1) fail("plan --search: --world-size must be >= 1, got {}", world);
  if (!(hw.peak_tflops > 0) || !(hw.efficiency > 0 && hw.efficiency <= 1) || !(hw.intra_node_gbps > 0) ||
      !(hw.inter_node_gbps > 0) || hw.devices_per_node < 1 || !(hw.reserve >= 0 && hw.reserve < 1))
    fail("plan --search: the hardware needs a positive peak, link speeds and devices per node, an efficiency in "
         "(0, 1] and a reserve in [0, 1)");
  const int64_t usable = (int64_t)((double)device_memory * (1.0 - hw.reserve));
  SearchResult r;
  for (int tp : divisors(world)) {
    if (tp > hw.devices_per_node) continue;  // tensor parallelism stays within a node
    for (int pp : divisors(world / tp)) {
      const int dp = world / (tp * pp);
      for (int ep : divisors(dp)) {
        if (ep > 1 && !model.is_moe()) continue;
        for (int mbs : {1, 2, 4, 8}) {
          for (const char* rc : {"none", "selective", "full"}) {
            TrainConfig c = cfg;
            c.parallel.tp = tp;
            c.parallel.pp = pp;
            c.parallel.ep = ep;
            c.parallel.layers_per_stage.clear();
            c.train.micro_batch_size = mbs;
            c.train.recompute = rc;
            SearchCandidate k;
            k.tp = tp;
            k.pp = pp;
            k.dp = dp;
            k.ep = ep;
            k.micro_batch_size = mbs;
            k.recompute = rc;
            try {
              const Plan p = make_plan(c, model, world);
              k.bytes = p.largest_stage().total_bytes();
              k.fits = device_memory == 0 || k.bytes <= usable;
              estimate(k, p, hw);
            } catch (const Error& e) {
              r.refused++;
              if (r.refusals.size() < 3 && std::find(r.refusals.begin(), r.refusals.end(), e.what()) == r.refusals.end())
                r.refusals.push_back(e.what());
              continue;
            }
            r.ranked.push_back(k);
          }
        }
      }
    }
  }
  std::stable_sort(r.ranked.begin(), r.ranked.end(), [](const SearchCandidate& a, const SearchCandidate& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits) return a.step_s != b.step_s ? a.step_s < b.step_s : a.bytes < b.bytes;
    return a.bytes < b.bytes;
  });
  return r;
}

std::string format_search(const SearchResult& r, const SearchHardware& hw, int world, int64_t device_memory,
                          size_t top) {
  size_t fitting = 0;
  for (const SearchCandidate& c : r.ranked) fitting += c.fits;
  std::string o = fmt::format(
      "search: {} layouts on {} devices ({} refused by the rules), {} fit {}\n"
      "assumed: {:.0f} TFLOP/s peak x {:.2f} efficiency; {} devices per node, {:.0f} GB/s within a node, {:.0f} GB/s "
      "between nodes; no overlap of communication with compute; {:.0f}% of the memory kept in reserve\n"
      "step = (compute + tp + ep + pp comm) / (1 - bubble) + dp comm, for the slowest stage\n\n",
      r.ranked.size() + r.refused, world, r.refused, fitting,
      device_memory > 0 ? "in " + format_bytes((double)device_memory) : "(no --device-memory)", hw.peak_tflops,
      hw.efficiency, hw.devices_per_node, hw.intra_node_gbps, hw.inter_node_gbps, 100.0 * hw.reserve);
  o += fmt::format("{:>4} {:>3} {:>3} {:>3} {:>3} {:>3} {:>9} {:>11} {:>9} {:>8} {:>7} {:>8} {:>11} {:>5}\n", "rank",
                   "tp", "pp", "dp", "ep", "mbs", "recompute", "memory", "compute", "comm", "bubble", "step",
                   "tokens/s", "MFU");
  size_t shown = 0;
  for (size_t i = 0; i < r.ranked.size() && shown < top; i++) {
    const SearchCandidate& c = r.ranked[i];
    if (!c.fits && fitting > 0) break;
    o += fmt::format("{:>4} {:>3} {:>3} {:>3} {:>3} {:>3} {:>9} {:>11} {:>8.2f}s {:>7.2f}s {:>6.1f}% {:>7.2f}s {:>11.0f} "
                     "{:>4.1f}%{}\n",
                     i + 1, c.tp, c.pp, c.dp, c.ep, c.micro_batch_size, c.recompute, format_bytes((double)c.bytes),
                     c.compute_s, c.comm_s, 100.0 * c.bubble, c.step_s, c.tokens_per_s, 100.0 * c.mfu,
                     c.fits ? "" : "  (does not fit)");
    shown++;
  }
  if (fitting > 0) {
    std::string ov;
    for (const std::string& s : r.ranked.front().overrides()) ov += " " + s;
    o += "\nbest:" + ov + "\n";
  } else {
    o += "\nno layout fits: the smallest is listed first\n";
  }
  for (const std::string& why : r.refusals) o += "refused, e.g.: " + why + "\n";
  return o;
}

nlohmann::json search_to_json(const SearchResult& r, const SearchHardware& hw) {
  nlohmann::json j;
  j["assumptions"] = {{"peak_tflops", hw.peak_tflops},
                      {"efficiency", hw.efficiency},
                      {"intra_node_gbps", hw.intra_node_gbps},
                      {"inter_node_gbps", hw.inter_node_gbps},
                      {"devices_per_node", hw.devices_per_node},
                      {"reserve", hw.reserve}};
  j["refused"] = r.refused;
  j["layouts"] = nlohmann::json::array();
  for (const SearchCandidate& c : r.ranked)
    j["layouts"].push_back({{"tp", c.tp},
                            {"pp", c.pp},
                            {"dp", c.dp},
                            {"ep", c.ep},
                            {"micro_batch_size", c.micro_batch_size},
                            {"recompute", c.recompute},
                            {"bytes", c.bytes},
                            {"fits", c.fits},
                            {"compute_s", c.compute_s},
                            {"comm_s", c.comm_s},
                            {"bubble", c.bubble},
                            {"step_s", c.step_s},
                            {"tokens_per_s", c.tokens_per_s},
                            {"mfu", c.mfu}});
  return j;
}

}  // namespace moetron
