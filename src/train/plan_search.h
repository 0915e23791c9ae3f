// `moetron plan --search`: every layout of a training config on N devices -- tp (within a node), pp,
// ep, micro-batch size and activation recompute -- checked by the rules `train` applies
// (train/layout.h), sized by make_plan (train/plan.h), the ones that fit the device memory ranked by
// an estimated step time.  The estimate is stated, not measured:
//   compute  = the largest stage's FLOPs per rank (recompute's included) / (peak x efficiency);
//   comm     = each group's bytes per rank (plan.h RankComm) / the link it uses: within a node when
//              the group's ranks share one (Megatron's rank order: tp fastest, then dp, then pp; the
//              ep group is ep consecutive dp ranks), otherwise the inter-node link; no overlap;
//   step     = (compute + tp + ep + pp comm) / (1 - bubble) + dp comm
// Layouts the rules refuse are not listed; the reasons are counted.  A layout fits when its largest
// rank needs at most (1 - reserve) of the device memory.
#pragma once

#include <string>
#include <vector>

#include "io/hf_config.h"
#include "train/config.h"
#include "train/plan.h"

namespace moetron {

// The stated hardware (defaults: H100 SXM nodes of 8 with NVLink 4 and one 400 Gb/s NIC per GPU).
struct SearchHardware {
  double peak_tflops = 989.0;     // dense bf16 per device
  double efficiency = 0.40;       // achieved / peak for the compute (Megatron-Core reports ~0.47 on Mixtral)
  double intra_node_gbps = 450.0;  // GB/s per device and direction (NVLink 4: 900 GB/s both ways)
  double inter_node_gbps = 50.0;   // GB/s per device (400 Gb/s)
  int devices_per_node = 8;
  // A layout fits when its largest rank needs at most (1 - reserve) of the device memory: the CUDA
  // context, library workspaces and allocator fragmentation are not in make_plan's count.
  double reserve = 0.10;
};

struct SearchCandidate {
  int tp = 1, pp = 1, dp = 1, ep = 1, micro_batch_size = 1;
  std::string recompute;
  int64_t bytes = 0;  // the largest rank's memory (make_plan)
  bool fits = false;
  double compute_s = 0, comm_s = 0, step_s = 0, bubble = 0;
  double tokens_per_s = 0;
  double mfu = 0;  // the model's training FLOPs (3 forwards) per step over the world's peak
  // The config overrides that select this layout.
  std::vector<std::string> overrides() const;
};

struct SearchResult {
  std::vector<SearchCandidate> ranked;  // fitting ones first by step time, then the others by memory
  int refused = 0;                      // layouts the rules refused
  std::vector<std::string> refusals;    // one example reason per distinct rule (first words)
};

// Every layout of `cfg` (its batch, sequence, dtype, device, zero1) on `world` devices; device_memory
// bytes per device (0: every layout fits).
SearchResult search_layouts(const TrainConfig& cfg, const ModelConfig& model, int world, int64_t device_memory,
                            const SearchHardware& hw);

std::string format_search(const SearchResult& r, const SearchHardware& hw, int world, int64_t device_memory,
                          size_t top);
nlohmann::json search_to_json(const SearchResult& r, const SearchHardware& hw);

}  // namespace moetron
