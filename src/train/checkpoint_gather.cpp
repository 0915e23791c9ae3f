#include "train/checkpoint_gather.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "optim/zero.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace moetron {

namespace {

size_t total_of(const std::vector<std::pair<size_t, size_t>>& rs) {
  size_t n = 0;
  for (const auto& [b, e] : rs) n += e - b;
  return n;
}

// The part of a whole tensor `view` (of the whole model's shape) that `ref` of a sharded table holds.
void read_slice(const TensorView& view, const HfTensorRef& ref, float* out, const std::string& source) {
  if (view.shape != ref.full_shape)
    fail("{}: tensor '{}' has shape {}, but the model config implies {}", source, view.name,
         nlohmann::json(view.shape).dump(), nlohmann::json(ref.full_shape).dump());
  if (ref.slice_dim < 0)
    read_f32(view, out, ref.numel);
  else
    read_f32_slice(view, ref.slice_dim, ref.slice_begin, ref.slice_end, out);
}

}  // namespace

std::vector<std::pair<size_t, size_t>> rank_state_ranges(const ParamTable& t, const Layout& layout, int d) {
  struct Set {
    ParamSet set;
    int size, rank;
  };
  std::vector<Set> sets;
  if (layout.ep <= 1)
    sets.push_back({ParamSet::all, layout.dp, d});
  else
    sets = {{ParamSet::dense, layout.dp, d}, {ParamSet::experts, layout.dp / layout.ep, d / layout.ep}};
  std::vector<ShardedAdamW::Range> out;
  for (const Set& s : sets) {
    if (!layout.zero1 && s.rank != 0) continue;
    const auto r = ShardedAdamW::state_ranges_of(t, s.set, s.size, s.rank, layout.zero1);
    out.insert(out.end(), r.begin(), r.end());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void gather_whole_state(dist::Comm& w, const Layout& layout, const dist::GridShape& gs, const dist::GridCoord& me,
                        const ModelConfig& mcfg, const ParamTable& local, const RankState& mine,
                        const ParamTable& whole, std::vector<float>& params, std::vector<float>& m,
                        std::vector<float>& v, const LoraSpec* lora) {
  constexpr int kParams = 11, kExpAvg = 12, kExpAvgSq = 13;
  if (w.rank() != 0) {
    const size_t total = local.total();
    if (me.edp == 0) w.send(mine.params, total, dist::CommDType::f32, 0, kParams);
    const auto ranges = rank_state_ranges(local, layout, me.dp);
    const size_t n = total_of(ranges);
    if (n > 0) {
      std::vector<float> pm(n), pv(n);
      size_t p = 0;
      for (const auto& [b, e] : ranges) {
        std::copy(mine.exp_avg.begin() + b, mine.exp_avg.begin() + e, pm.begin() + p);
        std::copy(mine.exp_avg_sq.begin() + b, mine.exp_avg_sq.begin() + e, pv.begin() + p);
        p += e - b;
      }
      w.send(pm.data(), n, dist::CommDType::f32, 0, kExpAvg);
      w.send(pv.data(), n, dist::CommDType::f32, 0, kExpAvgSq);
    }
    return;
  }
  params.assign(whole.total(), 0.0f);
  m.assign(whole.total(), 0.0f);
  v.assign(whole.total(), 0.0f);
  for (int stage = 0; stage < gs.pp; stage++)
    for (int t = 0; t < gs.tp; t++) {
      for (int d = 0; d < gs.dp; d++) {
        dist::GridCoord c;
        c.tp = t;
        c.dp = d;
        c.pp = stage;
        const int src = dist::grid_rank(gs, c);
        const ParamShard shard = layout_shard(layout, mcfg, stage, t, d % gs.ep);
        const ParamTable lt = lora ? ParamTable(mcfg, *lora, shard) : ParamTable(mcfg, shard);
        const auto ranges = rank_state_ranges(lt, layout, d);
        const size_t n = total_of(ranges);
        const bool sends_params = d < gs.ep;  // edp rank 0
        std::vector<float> lp, lm, lv;
        const float *pp = nullptr, *pm = nullptr, *pv = nullptr;
        if (src == 0) {
          pp = mine.params;
          pm = mine.exp_avg.data();
          pv = mine.exp_avg_sq.data();
        } else {
          lp.assign(lt.total(), 0.0f);
          lm.assign(lt.total(), 0.0f);
          lv.assign(lt.total(), 0.0f);
          if (sends_params) w.recv(lp.data(), lt.total(), dist::CommDType::f32, src, kParams);
          if (n > 0) {
            std::vector<float> rm(n), rv(n);
            w.recv(rm.data(), n, dist::CommDType::f32, src, kExpAvg);
            w.recv(rv.data(), n, dist::CommDType::f32, src, kExpAvgSq);
            size_t p = 0;
            for (const auto& [b, e] : ranges) {
              std::copy(rm.begin() + p, rm.begin() + p + (e - b), lm.begin() + b);
              std::copy(rv.begin() + p, rv.begin() + p + (e - b), lv.begin() + b);
              p += e - b;
            }
          }
          pp = lp.data();
          pm = lm.data();
          pv = lv.data();
        }
        if (sends_params) copy_to_whole(lt, pp, whole, params.data());
        copy_to_whole(lt, pm, whole, m.data(), ranges);
        copy_to_whole(lt, pv, whole, v.data(), ranges);
      }
    }
}

void read_rank_optimizer_state(const std::string& dir, const ParamTable& table, float* params, float* exp_avg,
                               float* exp_avg_sq) {
  const std::string opt_dir = (fs::path(dir) / "optimizer").string();
  const ShardedSafetensors opt = ShardedSafetensors::open(opt_dir, "optimizer");
  for (const HfTensorRef& ref : table.hf_tensors()) {
    const std::pair<const char*, float*> parts[] = {{".master", params}, {".exp_avg", exp_avg},
                                                    {".exp_avg_sq", exp_avg_sq}};
    for (const auto& [suffix, dst] : parts) {
      const TensorView* t = opt.find(ref.name + suffix);
      if (t == nullptr) fail("{}: tensor '{}' is missing", opt_dir, ref.name + suffix);
      read_slice(*t, ref, dst + ref.offset, opt_dir);
    }
  }
}

void read_rank_hf_weights(const ModelTensors& files, const std::string& dir, const ModelConfig& mcfg,
                          const ParamTable& table, float* params) {
  // Only this rank's slices are read (weights.h): its tensor-parallel part of its experts.  Each
  // rank also checks that the directory holds nothing the whole model lacks.
  const ParamTable whole(mcfg);
  std::set<std::string> used;
  for (const HfTensorRef& ref : table.hf_tensors()) {
    HfTensorSlice slice;
    slice.ref = whole.find_hf(ref.name);
    MOETRON_ASSERT(slice.ref != nullptr);
    slice.dim = ref.slice_dim;
    slice.begin = ref.slice_begin;
    slice.end = ref.slice_end;
    used.insert(read_hf_slice(files, whole, slice, params + ref.offset, dir));
  }
  for (const std::string& name : files.names())
    if (!used.count(name) && whole.find_hf(name) == nullptr && name.find("rotary_emb.inv_freq") == std::string::npos)
      fail("{}: tensor '{}' is not a parameter of the model config.json describes", dir, name);
}

}  // namespace moetron
