// LoRA adapters: the adapter table, PEFT's initialisation, its directory format and merging; see lora.h.
#include "model/lora.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/json_limits.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "ops/matmul.h"

namespace moetron {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";
constexpr size_t kMaxAdapterConfigBytes = 1 << 20;

struct TargetInfo {
  LoraTarget target;
  const char* name;    // config / PEFT name
  ParamKind base;      // the base tensor
  bool expert;         // a fused expert parameter (PEFT target_parameters)
};
constexpr TargetInfo kTargets[] = {
    {LoraTarget::q_proj, "q_proj", ParamKind::q_proj, false},
    {LoraTarget::k_proj, "k_proj", ParamKind::k_proj, false},
    {LoraTarget::v_proj, "v_proj", ParamKind::v_proj, false},
    {LoraTarget::o_proj, "o_proj", ParamKind::o_proj, false},
    {LoraTarget::experts_gate_up, "experts.gate_up_proj", ParamKind::ffn_w13, true},
    {LoraTarget::experts_down, "experts.down_proj", ParamKind::ffn_w2, true},
    {LoraTarget::mlp, "mlp", ParamKind::ffn_w13, false},
    {LoraTarget::router, "router", ParamKind::router, false},
};

const TargetInfo& info(LoraTarget t) {
  for (const TargetInfo& i : kTargets)
    if (i.target == t) return i;
  fail("lora: unknown target {}", (int)t);
}

std::string valid_names() {
  std::vector<std::string> v{"attention", "experts"};  // and every kTargets name
  for (const TargetInfo& i : kTargets) v.push_back(i.name);
  return fmt::format("{}", fmt::join(v, ", "));
}

std::string layer_prefix(int l) { return fmt::format("model.layers.{}.", l); }

// The index in the whole tensor of element i of a (possibly sliced) 1-d or 2-d tensor.
size_t whole_index(const HfTensorRef& t, size_t i) {
  if (t.slice_dim < 0) return i;
  const size_t cols = (size_t)t.shape.back(), full_cols = (size_t)t.full_shape.back();
  const size_t a = i / cols, b = i % cols;
  if (t.slice_dim == 0) return (a + (size_t)t.slice_begin) * full_cols + b;
  return a * full_cols + b + (size_t)t.slice_begin;
}

// PEFT's tensor names for layer l's fused experts: the k-th targeted parameter of n (in the experts
// module's parameter order: gate_up_proj, down_proj) is nested under n-1-k "base_layer." wrappers.
std::string peft_expert_name(int l, int k, int n, const char* factor) {
  std::string s = std::string(kPeftPrefix) + layer_prefix(l) + "mlp.experts.";
  for (int i = 0; i < n - 1 - k; i++) s += "base_layer.";
  return s + factor + ".weight";
}

// The internal (and, with kPeftPrefix, PEFT's) name of a non-expert adapter's factor.
std::string module_name(int l, LoraTarget t, const char* factor) {
  if (t == LoraTarget::router) return layer_prefix(l) + "mlp.gate." + factor + ".weight";
  return layer_prefix(l) + "self_attn." + info(t).name + "." + factor + ".weight";
}
std::string peft_module_name(int l, LoraTarget t, const char* factor) {
  return std::string(kPeftPrefix) + module_name(l, t, factor);
}

std::vector<LoraTarget> expert_targets(const LoraSpec& spec) {
  std::vector<LoraTarget> v;
  for (LoraTarget t : spec.targets)
    if (info(t).expert) v.push_back(t);
  return v;
}

// One PEFT tensor and where its values live in the whole adapter table: either one spec's
// contiguous values (`direct`), or the expert B layout [out, r*E] (column j*E + e = B_e[:, j]) of a
// stacked [E, out, r] spec.
struct PeftTensor {
  std::string name;
  std::vector<int64_t> shape;
  const ParamSpec* spec = nullptr;
  bool expert_b = false;
  size_t offset = 0, numel = 0;  // where the values live in the whole adapter table (not expert_b)
};

// `ex`: the expert targets in PEFT's target_parameters order (which fixes their names).
std::vector<PeftTensor> peft_tensors(const ModelConfig& cfg, const LoraSpec& spec, const ParamTable& table,
                                     const std::vector<LoraTarget>& ex) {
  std::vector<PeftTensor> out;
  for (int l = 0; l < cfg.num_hidden_layers; l++)
    for (LoraTarget t : spec.targets) {
      if (t == LoraTarget::mlp) {  // the table's own tensors are PEFT's (gate, up, down of the layer)
        for (const HfTensorRef& ref : table.hf_tensors()) {
          const ParamSpec& sp = table.spec_of(ref);
          if (sp.layer != l || sp.expert || (sp.target != ParamKind::ffn_w13 && sp.target != ParamKind::ffn_w2 &&
                                             sp.target != ParamKind::shared_w13 && sp.target != ParamKind::shared_w2))
            continue;
          out.push_back({kPeftPrefix + ref.name, ref.shape, &sp, false, ref.offset, ref.numel});
        }
        continue;
      }
      const ParamKind base = info(t).base;
      const ParamSpec* a = table.find_lora(base, l, false);
      const ParamSpec* b = table.find_lora(base, l, true);
      if (a == nullptr || a->expert != info(t).expert) continue;  // an expert target in a dense layer
      if (!info(t).expert) {
        out.push_back({peft_module_name(l, t, "lora_A"), a->shape, a, false, a->offset, a->numel});
        out.push_back({peft_module_name(l, t, "lora_B"), b->shape, b, false, b->offset, b->numel});
        continue;
      }
      const int k = (int)(std::find(ex.begin(), ex.end(), t) - ex.begin()), n = (int)ex.size();
      const int64_t E = a->shape[0], r = a->shape[1];
      out.push_back({peft_expert_name(l, k, n, "lora_A"), {E * r, a->shape[2]}, a, false, a->offset, a->numel});
      out.push_back({peft_expert_name(l, k, n, "lora_B"), {b->shape[1], r * E}, b, true, b->offset, b->numel});
    }
  return out;
}

// Between a stacked [E, out, r] B and PEFT's [out, r*E].
void expert_b_to_peft(const float* stacked, float* peft, int64_t E, int64_t out, int64_t r) {
  for (int64_t e = 0; e < E; e++)
    for (int64_t o = 0; o < out; o++)
      for (int64_t j = 0; j < r; j++) peft[o * r * E + j * E + e] = stacked[(e * out + o) * r + j];
}
void expert_b_from_peft(const float* peft, float* stacked, int64_t E, int64_t out, int64_t r) {
  for (int64_t e = 0; e < E; e++)
    for (int64_t o = 0; o < out; o++)
      for (int64_t j = 0; j < r; j++) stacked[(e * out + o) * r + j] = peft[o * r * E + j * E + e];
}

}  // namespace

float LoraSpec::scale() const {
  if (rank <= 0) return 0.0f;
  return (float)(rslora ? alpha / std::sqrt((double)rank) : alpha / (double)rank);
}

bool LoraSpec::has(LoraTarget t) const { return std::find(targets.begin(), targets.end(), t) != targets.end(); }

ParamKind LoraSpec::base_kind(LoraTarget t) { return info(t).base; }

std::string lora_target_name(LoraTarget t) { return info(t).name; }

std::vector<LoraTarget> parse_lora_targets(const std::vector<std::string>& names, const ModelConfig& cfg,
                                           const std::string& field) {
  if (names.empty()) fail("{}: no targets (valid: {})", field, valid_names());
  std::set<LoraTarget> out;
  for (const std::string& n : names) {
    std::vector<LoraTarget> these;
    if (n == "attention") {
      these = {LoraTarget::q_proj, LoraTarget::k_proj, LoraTarget::v_proj, LoraTarget::o_proj};
    } else if (n == "experts") {
      these = {LoraTarget::experts_gate_up, LoraTarget::experts_down};
    } else {
      for (const TargetInfo& i : kTargets)
        if (n == i.name) these = {i.target};
      if (these.empty()) fail("{}: unknown target '{}' (valid: {})", field, n, valid_names());
    }
    for (LoraTarget t : these) {
      if ((info(t).expert || t == LoraTarget::router) && !cfg.is_moe())
        fail("{}: target '{}': the model ({}) has no routed experts", field, n, cfg.architecture);
      if (t == LoraTarget::mlp) {
        bool dense = cfg.has_shared_expert();
        for (int l = 0; l < cfg.num_hidden_layers; l++) dense = dense || !cfg.is_moe_layer(l);
        if (!dense)
          fail("{}: target '{}': the model ({}) has no dense FFN layers or shared experts (its experts: 'experts')", field,
               n, cfg.architecture);
      }
      out.insert(t);
    }
  }
  return {out.begin(), out.end()};
}

ParamTable::ParamTable(const ModelConfig& cfg, const LoraSpec& lora, const ParamShard& shard)
    : num_layers_(cfg.num_hidden_layers), moe_(cfg.is_moe()), shard_(shard), lora_(true) {
  if (lora.rank <= 0 || lora.rank > (1 << 16)) fail("lora.rank: {} is not in [1, 65536]", lora.rank);
  // The base's part validates the shard and says how each base tensor is sliced; the adapters follow.
  const ParamTable base(cfg, shard);
  whole_ = base.is_whole();
  const int64_t r = lora.rank, C = cfg.hidden_size;
  const int tp_rank = shard.tp_rank;
  const int lb = shard.layer_begin, le = shard.layer_end < 0 ? cfg.num_hidden_layers : shard.layer_end;
  auto ref_of = [&](const ParamSpec& s) -> const HfTensorRef& {
    for (const HfTensorRef& t : base.hf_tensors())
      if (t.spec_index == (size_t)(&s - base.specs().data())) return t;
    fail("lora: no tensor for {}", s.name);
  };
  auto add_lora = [&](ParamKind kind, const ParamSpec& b, std::string name, std::vector<int64_t> shape,
                      TpSplit split, bool primary) -> ParamSpec& {
    ParamSpec& s = add(cfg, kind, b.layer, std::move(shape), true);
    s.name = std::move(name);
    s.target = b.kind;
    s.tp_split = split;
    s.tp_primary = primary;
    s.expert = b.expert;
    s.n_stacked = b.expert ? (int)b.shape[0] : 0;
    return s;
  };
  auto push_ref = [&](size_t si, std::string name, std::vector<int64_t> shape, size_t offset,
                      std::vector<int64_t> full, int dim, int64_t begin, int64_t end, int stacked) {
    HfTensorRef t;
    t.name = std::move(name);
    t.shape = std::move(shape);
    t.offset = offset;
    t.numel = 1;
    for (int64_t d : t.shape) t.numel *= (size_t)d;
    t.spec_index = si;
    t.stacked_index = stacked;
    t.full_shape = std::move(full);
    t.slice_dim = dim;
    t.slice_begin = begin;
    t.slice_end = end;
    hf_tensors_.push_back(std::move(t));
  };
  for (int l = lb; l < le; l++)
    for (LoraTarget tg : lora.targets) {
      const TargetInfo& ti = info(tg);
      if ((ti.expert || tg == LoraTarget::router) && !cfg.is_moe_layer(l)) continue;
      const std::string p = layer_prefix(l);
      if (tg == LoraTarget::mlp) {
        // The dense FFN of a dense layer, or the shared expert of an MoE layer: PEFT's separate gate_proj,
        // up_proj (stacked split, expert_ffn.h) and down_proj adapters, split over tp with their base.
        const bool moe_l = cfg.is_moe_layer(l);
        if (moe_l && !cfg.has_shared_expert()) continue;
        const ParamSpec& w13 = base.at(moe_l ? ParamKind::shared_w13 : ParamKind::ffn_w13, l);
        const ParamSpec& w2 = base.at(moe_l ? ParamKind::shared_w2 : ParamKind::ffn_w2, l);
        const std::string n = p + (moe_l ? "mlp.shared_expert." : "mlp.");
        std::vector<const HfTensorRef*> gate_up, down;
        for (const HfTensorRef& t : base.hf_tensors()) {
          if (&base.spec_of(t) == &w13) gate_up.push_back(&t);
          if (&base.spec_of(t) == &w2) down.push_back(&t);
        }
        const int64_t Ir = w13.shape[1] / 2, I = gate_up[0]->full_shape[0];
        const size_t ai = specs_.size();
        ParamSpec& a = add_lora(ParamKind::lora_a, w13, n + "gate_up.lora_A", {1, 2 * r, C}, TpSplit::none, tp_rank == 0);
        push_ref(ai, n + "gate_proj.lora_A.weight", {r, C}, a.offset, {r, C}, -1, 0, 0, -1);
        push_ref(ai, n + "up_proj.lora_A.weight", {r, C}, a.offset + r * C, {r, C}, -1, 0, 0, -1);
        const size_t bi = specs_.size();
        ParamSpec& bb = add_lora(ParamKind::lora_b, w13, n + "gate_up.lora_B", {1, 2 * Ir, r}, w13.tp_split, w13.tp_primary);
        for (int half = 0; half < 2; half++) {
          const HfTensorRef& g = *gate_up[half];
          push_ref(bi, n + (half ? "up_proj" : "gate_proj") + ".lora_B.weight", {Ir, r}, bb.offset + half * Ir * r,
                   {I, r}, g.slice_dim, g.slice_begin, g.slice_end, -1);
        }
        const HfTensorRef& d = *down[0];
        const size_t di = specs_.size();
        ParamSpec& da = add_lora(ParamKind::lora_a, w2, n + "down_proj.lora_A.weight", {1, r, Ir}, w2.tp_split, w2.tp_primary);
        push_ref(di, da.name, {r, Ir}, da.offset, {r, d.full_shape[1]}, d.slice_dim, d.slice_begin, d.slice_end, -1);
        const size_t dbi = specs_.size();
        ParamSpec& db = add_lora(ParamKind::lora_b, w2, n + "down_proj.lora_B.weight", {1, C, r}, TpSplit::none, tp_rank == 0);
        push_ref(dbi, db.name, {C, r}, db.offset, {C, r}, -1, 0, 0, -1);
        continue;
      }
      const ParamSpec& b = base.at(ti.base, l);
      if (!ti.expert) {
        // q/k/v: rows split (B follows, A whole); o: columns split (A follows, B whole).
        const HfTensorRef& br = ref_of(b);
        // The router is whole on every rank (so are its adapters, with identical gradients).
        const bool row_parallel = ti.base == ParamKind::o_proj;
        const int64_t out = b.shape[0], in = b.shape[1];
        const size_t ai = specs_.size();
        ParamSpec& a = add_lora(ParamKind::lora_a, b, module_name(l, tg, "lora_A"), {r, in},
                                row_parallel ? b.tp_split : TpSplit::none, row_parallel ? b.tp_primary : tp_rank == 0);
        push_ref(ai, a.name, a.shape, a.offset, {r, br.full_shape[1]}, row_parallel ? br.slice_dim : -1,
                 br.slice_begin, br.slice_end, -1);
        const size_t bi = specs_.size();
        ParamSpec& bb = add_lora(ParamKind::lora_b, b, module_name(l, tg, "lora_B"), {out, r},
                                 row_parallel ? TpSplit::none : b.tp_split, row_parallel ? tp_rank == 0 : b.tp_primary);
        push_ref(bi, bb.name, bb.shape, bb.offset, {br.full_shape[0], r}, row_parallel ? -1 : br.slice_dim,
                 br.slice_begin, br.slice_end, -1);
        continue;
      }
      // Experts: per expert the base's HF tensors (w1/w3 or w2) give the tp slice of its width.
      const int64_t El = b.shape[0];
      const int e0 = shard.expert_begin;
      const std::string n = p + "mlp.experts.";
      if (ti.base == ParamKind::ffn_w13) {
        const int64_t Ir = b.shape[1] / 2;
        const size_t ai = specs_.size();
        ParamSpec& a = add_lora(ParamKind::lora_a, b, n + "gate_up_proj.lora_A", {El, r, C}, TpSplit::none,
                                tp_rank == 0);
        for (int64_t el = 0; el < El; el++)
          push_ref(ai, fmt::format("{}{}.gate_up_proj.lora_A", n, e0 + el), {r, C}, a.offset + el * r * C, {r, C}, -1,
                   0, 0, e0 + (int)el);
        const size_t bi = specs_.size();
        ParamSpec& bb = add_lora(ParamKind::lora_b, b, n + "gate_up_proj.lora_B", {El, 2 * Ir, r}, b.tp_split,
                                 b.tp_primary);
        // The base's gate (w1) tensor of the first local expert carries the slice of the width.
        const HfTensorRef* w1 = nullptr;
        for (const HfTensorRef& t : base.hf_tensors())
          if (&base.spec_of(t) == &b) {
            w1 = &t;
            break;
          }
        for (int64_t el = 0; el < El; el++)
          for (int half = 0; half < 2; half++)
            push_ref(bi, fmt::format("{}{}.gate_up_proj.lora_B.{}", n, e0 + el, half ? "up" : "gate"), {Ir, r},
                     bb.offset + (el * 2 + half) * Ir * r, {w1->full_shape[0], r}, w1->slice_dim, w1->slice_begin,
                     w1->slice_end, e0 + (int)el);
      } else {
        const int64_t Ir = b.shape[2];
        const HfTensorRef* w2 = nullptr;
        for (const HfTensorRef& t : base.hf_tensors())
          if (&base.spec_of(t) == &b) {
            w2 = &t;
            break;
          }
        const size_t ai = specs_.size();
        ParamSpec& a = add_lora(ParamKind::lora_a, b, n + "down_proj.lora_A", {El, r, Ir}, b.tp_split, b.tp_primary);
        for (int64_t el = 0; el < El; el++)
          push_ref(ai, fmt::format("{}{}.down_proj.lora_A", n, e0 + el), {r, Ir}, a.offset + el * r * Ir,
                   {r, w2->full_shape[1]}, w2->slice_dim, w2->slice_begin, w2->slice_end, e0 + (int)el);
        const size_t bi = specs_.size();
        ParamSpec& bb = add_lora(ParamKind::lora_b, b, n + "down_proj.lora_B", {El, C, r}, TpSplit::none,
                                 tp_rank == 0);
        for (int64_t el = 0; el < El; el++)
          push_ref(bi, fmt::format("{}{}.down_proj.lora_B", n, e0 + el), {C, r}, bb.offset + el * C * r, {C, r}, -1, 0,
                   0, e0 + (int)el);
      }
    }
}

void init_lora_parameters(const ParamTable& table, uint64_t seed, float* values) {
  if (!table.is_lora()) fail("init_lora_parameters: not an adapter table");
  for (const HfTensorRef& t : table.hf_tensors()) {
    float* p = values + t.offset;
    if (table.spec_of(t).kind == ParamKind::lora_b) {
      std::fill(p, p + t.numel, 0.0f);
      continue;
    }
    // kaiming_uniform_(a = sqrt(5)) over fan_in = the whole tensor's input features: U(-1/sqrt(in), 1/sqrt(in)).
    const double bound = 1.0 / std::sqrt((double)t.full_shape.back());
    const uint64_t key = hash_name(t.name);
    for (size_t i = 0; i < t.numel; i++)
      p[i] = (float)(bound * (2.0 * uniform_at(seed, key, whole_index(t, i), 0) - 1.0));
  }
}

void write_peft_adapter(const std::string& dir, const ModelConfig& cfg, const LoraSpec& spec, const ParamTable& table,
                        const float* values, const std::string& base_model) {
  if (!table.is_lora() || !table.is_whole()) fail("write_peft_adapter: needs the whole adapter table");
  fs::create_directories(dir);
  std::vector<std::string> modules, params;
  for (LoraTarget t : spec.targets) {
    if (t == LoraTarget::mlp)
      modules.insert(modules.end(), {"gate_proj", "up_proj", "down_proj"});
    else if (t == LoraTarget::router)
      params.push_back("mlp.gate.weight");
    else
      (info(t).expert ? params : modules).push_back(std::string(info(t).expert ? "mlp." : "") + info(t).name);
  }
  json c = {{"peft_type", "LORA"},
            {"task_type", "CAUSAL_LM"},
            {"r", spec.rank},
            {"lora_alpha", spec.alpha},
            {"lora_dropout", 0.0},
            {"use_rslora", spec.rslora},
            {"use_dora", false},
            {"bias", "none"},
            {"fan_in_fan_out", false},
            {"init_lora_weights", true},
            {"inference_mode", true},
            {"modules_to_save", nullptr},
            {"layers_to_transform", nullptr},
            {"layers_pattern", nullptr},
            {"rank_pattern", json::object()},
            {"alpha_pattern", json::object()},
            {"target_modules", modules},
            {"target_parameters", params.empty() ? json(nullptr) : json(params)},
            {"base_model_name_or_path", base_model},
            {"auto_mapping", {{"base_model_class", cfg.architecture}, {"parent_library", "transformers"}}},
            {"revision", nullptr}};
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  std::vector<std::vector<float>> owned;
  for (const PeftTensor& t : peft_tensors(cfg, spec, table, expert_targets(spec))) {
    const float* src = values + t.offset;
    if (!t.expert_b) {
      w.add_f32(t.name, t.shape, src);
      continue;
    }
    const int64_t E = t.spec->shape[0], out = t.spec->shape[1], r = t.spec->shape[2];
    owned.emplace_back((size_t)(E * out * r));
    expert_b_to_peft(src, owned.back().data(), E, out, r);
    w.add_f32(t.name, t.shape, owned.back().data());
  }
  w.write((fs::path(dir) / "adapter_model.safetensors").string());
  const std::string cpath = (fs::path(dir) / "adapter_config.json").string();
  {
    std::ofstream o(cpath + ".tmp", std::ios::binary);
    o << c.dump(2) << "\n";
    if (!o) fail("{}: cannot write", cpath);
  }
  fs::rename(cpath + ".tmp", cpath);
}

namespace {
PeftAdapter read_peft_adapter_unchecked(const std::string& dir, const ModelConfig& cfg);
}

PeftAdapter read_peft_adapter(const std::string& dir, const ModelConfig& cfg) {
  try {
    return read_peft_adapter_unchecked(dir, cfg);
  } catch (const InputError&) {
    throw;
  } catch (const Error& e) {
    throw InputError(e.what());
  }
}

namespace {
PeftAdapter read_peft_adapter_unchecked(const std::string& dir, const ModelConfig& cfg) {
  const std::string cpath = (fs::path(dir) / "adapter_config.json").string();
  const std::string wpath = (fs::path(dir) / "adapter_model.safetensors").string();
  std::error_code ec;
  if (!fs::is_regular_file(cpath, ec))
    fail("{}: not a PEFT adapter directory (no adapter_config.json)", dir);
  if (fs::file_size(cpath, ec) > kMaxAdapterConfigBytes)
    fail("{}: larger than {} bytes; not an adapter config", cpath, kMaxAdapterConfigBytes);
  std::ifstream in(cpath, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const json c = parse_json(ss.str(), cpath);
  if (!c.is_object()) fail("{}: expected a JSON object", cpath);
  auto field = [&](const char* k) -> const json* {
    const auto it = c.find(k);
    return it == c.end() || it->is_null() ? nullptr : &*it;
  };
  auto refuse_if = [&](const char* k, bool bad, const std::string& what) {
    if (bad) fail("{}: field '{}': {} (moetron reads plain LoRA adapters)", cpath, k, what);
  };
  const json* type = field("peft_type");
  refuse_if("peft_type", !type || !type->is_string() || type->get<std::string>() != "LORA",
            fmt::format("{} is not \"LORA\"", type ? json_preview(*type) : "missing"));
  PeftAdapter out;
  LoraSpec& spec = out.spec;
  const json* r = field("r");
  refuse_if("r", !r || !r->is_number_integer() || r->get<int64_t>() <= 0 || r->get<int64_t>() > (1 << 16),
            fmt::format("{} is not an integer in [1, 65536]", r ? json_preview(*r) : "missing"));
  spec.rank = (int)r->get<int64_t>();
  const json* alpha = field("lora_alpha");
  refuse_if("lora_alpha", !alpha || !alpha->is_number() || !std::isfinite(alpha->get<double>()),
            fmt::format("{} is not a number", alpha ? json_preview(*alpha) : "missing"));
  spec.alpha = alpha->get<double>();
  for (const char* k : {"use_dora", "fan_in_fan_out", "use_qalora"})
    if (const json* v = field(k); v && !(v->is_boolean() && !v->get<bool>()))
      refuse_if(k, true, json_preview(*v) + " is not supported");
  if (const json* v = field("use_rslora")) {
    refuse_if("use_rslora", !v->is_boolean(), "not a boolean");
    spec.rslora = v->get<bool>();
  }
  if (const json* v = field("bias")) refuse_if("bias", !v->is_string() || v->get<std::string>() != "none", json_preview(*v) + " is not \"none\"");
  for (const char* k : {"rank_pattern", "alpha_pattern"})
    if (const json* v = field(k)) refuse_if(k, !v->is_object() || !v->empty(), "per-module ranks are not supported");
  for (const char* k : {"modules_to_save", "layers_to_transform", "layers_pattern", "trainable_token_indices"})
    if (const json* v = field(k)) refuse_if(k, !(v->is_array() && v->empty()), json_preview(*v) + " is not supported");
  if (const json* v = field("lora_dropout"))
    refuse_if("lora_dropout", !v->is_number(), "not a number");
  if (const json* v = field("auto_mapping"))
    if (v->is_object() && v->contains("base_model_class") && (*v)["base_model_class"].is_string() &&
        (*v)["base_model_class"].get<std::string>() != cfg.architecture)
      fail("{}: field 'auto_mapping.base_model_class': the adapter was made for {}, the base is {}", cpath,
           (*v)["base_model_class"].get<std::string>(), cfg.architecture);
  // Targets: attention modules by name, fused expert parameters by path (their order fixes the names).
  std::vector<std::string> names;
  std::set<std::string> mlp_modules;
  std::vector<LoraTarget> param_order;
  if (const json* v = field("target_modules")) {
    refuse_if("target_modules", !v->is_array(), "a regular expression is not supported (give a list of names)");
    for (const json& m : *v) {
      refuse_if("target_modules", !m.is_string(), "names must be strings");
      const std::string s = m.get<std::string>();
      if (s != "q_proj" && s != "k_proj" && s != "v_proj" && s != "o_proj" && s != "gate_proj" && s != "up_proj" &&
          s != "down_proj")
        fail("{}: field 'target_modules': module '{}' is not one moetron adapts (valid: q_proj, k_proj, v_proj, o_proj, "
             "gate_proj + up_proj + down_proj)",
             cpath, s);
      if (s == "gate_proj" || s == "up_proj" || s == "down_proj")
        mlp_modules.insert(s);
      else
        names.push_back(s);
    }
    if (!mlp_modules.empty() && mlp_modules.size() != 3)
      fail("{}: field 'target_modules': gate_proj, up_proj and down_proj are adapted together (got {})", cpath,
           fmt::join(mlp_modules, ", "));
    if (!mlp_modules.empty()) names.push_back("mlp");
  }
  if (const json* v = field("target_parameters")) {
    refuse_if("target_parameters", !v->is_array(), "expected a list");
    for (const json& m : *v) {
      refuse_if("target_parameters", !m.is_string(), "names must be strings");
      const std::string s = m.get<std::string>();
      if (s == "mlp.gate.weight") {
        if (std::find(names.begin(), names.end(), "router") != names.end())
          fail("{}: field 'target_parameters': '{}' is listed twice", cpath, s);
        names.push_back("router");
        continue;
      }
      if (s != "mlp.experts.gate_up_proj" && s != "mlp.experts.down_proj")
        fail("{}: field 'target_parameters': parameter '{}' is not one moetron adapts (valid: "
             "mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight)",
             cpath, s);
      const LoraTarget t = s == "mlp.experts.gate_up_proj" ? LoraTarget::experts_gate_up : LoraTarget::experts_down;
      if (std::find(param_order.begin(), param_order.end(), t) != param_order.end())
        fail("{}: field 'target_parameters': '{}' is listed twice", cpath, s);
      param_order.push_back(t);
      names.push_back(s.substr(4));
    }
  }
  if (const json* v = field("lora_dropout"); v && v->get<double>() != 0.0 && !param_order.empty())
    fail("{}: field 'lora_dropout': {} with target_parameters (PEFT itself refuses dropout on fused experts)", cpath,
         v->get<double>());
  if (names.empty()) fail("{}: fields 'target_modules' / 'target_parameters': no targets", cpath);
  spec.targets = parse_lora_targets(names, cfg, cpath + ": targets");
  const ParamTable table(cfg, spec);
  if (!fs::is_regular_file(wpath, ec)) fail("{}: missing (the adapter's weights)", wpath);
  const SafetensorsFile f = SafetensorsFile::open(wpath);
  // PEFT nests the expert wrappers in the experts module's parameter order (gate_up_proj, then
  // down_proj), whatever order adapter_config.json lists them in (it saves a set).
  const std::vector<PeftTensor> want = peft_tensors(cfg, spec, table, expert_targets(spec));
  // Every name and shape is checked against the file's header before the table is allocated: the
  // config's r alone sizes it, so an absurd r with tiny tensors would otherwise allocate gigabytes.
  std::set<std::string> expected;
  for (const PeftTensor& t : want) {
    expected.insert(t.name);
    const TensorView* v = f.find(t.name);
    if (v == nullptr)
      fail("{}: tensor '{}' is missing (the adapter does not match the base: {} layers, targets {})", wpath, t.name,
           cfg.num_hidden_layers, fmt::join(names, ", "));
    if (v->shape != t.shape)
      fail("{}: tensor '{}' has shape [{}], the base implies [{}] (an adapter for another model, or another rank)",
           wpath, t.name, fmt::join(v->shape, ", "), fmt::join(t.shape, ", "));
  }
  for (const std::string& n : f.names())
    if (!expected.count(n))
      fail("{}: unexpected tensor '{}' (not an adapter of {} with targets {})", wpath, n, cfg.architecture,
           fmt::join(names, ", "));
  out.values.assign(table.total(), 0.0f);
  // For the bound below: the largest |A| value and the largest row sum of |B| (a row: one output's r
  // values, of one expert).
  double peak_a = 0.0, row_b = 0.0;
  for (const PeftTensor& t : want) {
    const TensorView& v = *f.find(t.name);
    float* dst = out.values.data() + t.offset;
    // NaN / Inf would turn every logit NaN (perplexity nan, serve answering 500s, a merged model
    // every loader refuses): refused here, naming the element in the file's order, as base weights are.
    auto refuse_non_finite = [&](const float* p) {
      if (const size_t bad = first_non_finite(p, t.numel); bad < t.numel)
        fail("{}: tensor '{}' holds a non-finite value ({}) at element {}: the adapter is corrupt", wpath, t.name,
             p[bad], bad);
    };
    if (!t.expert_b) {
      read_f32(v, dst, t.numel);
      refuse_non_finite(dst);
    } else {
      const std::vector<float> tmp = to_f32(v);
      refuse_non_finite(tmp.data());
      expert_b_from_peft(tmp.data(), dst, t.spec->shape[0], t.spec->shape[1], t.spec->shape[2]);
    }
    if (t.spec->kind == ParamKind::lora_b) {
      const size_t r = (size_t)t.spec->shape.back();
      for (size_t row = 0; row < t.numel / r; row++) {
        double sum = 0.0;
        for (size_t j = 0; j < r; j++) sum += std::fabs(dst[row * r + j]);
        row_b = std::max(row_b, sum);
      }
    } else {
      for (size_t i = 0; i < t.numel; i++) peak_a = std::max(peak_a, (double)std::fabs(dst[i]));
    }
  }
  // |(s B A)_ij| <= |s| max_i sum_k |B_ik| max|A|.  A trained adapter changes a weight by well under 1;
  // an update that can reach f16's largest value (65504) is a lora_alpha typed wrong (1e30), and makes
  // the activations overflow to Inf/NaN (generate stops, perplexity would print nan, serve answer 500s).
  constexpr double kMaxUpdate = 65504.0;
  const double bound = std::fabs((double)spec.scale()) * row_b * peak_a;
  if (!std::isfinite(spec.scale()) || !(bound <= kMaxUpdate))
    fail("{}: field 'lora_alpha': {} with r {} gives the scale {} and weight updates of up to {:.3g} (scale x the "
         "largest row sum of |lora_B| x the largest |lora_A|), beyond {}: the model's activations would overflow",
         cpath, spec.alpha, spec.rank, spec.scale(), bound, kMaxUpdate);
  return out;
}
}  // namespace

void merge_lora(const ParamTable& base, float* base_values, const ParamTable& adapters, const float* adapter_values,
                const LoraSpec& spec) {
  if (!base.is_whole() || !adapters.is_whole() || !adapters.is_lora()) fail("merge_lora: needs whole tables");
  const float s = spec.scale();
  for (const ParamSpec& a : adapters.specs()) {
    if (a.kind != ParamKind::lora_a) continue;
    const ParamSpec* b = adapters.find_lora(a.target, a.layer, true);
    const ParamSpec& w = base.at(a.target, a.layer);
    const bool stacked = a.shape.size() == 3;
    const int64_t E = stacked ? a.shape[0] : 1, in = a.shape.back();
    if (stacked && !a.expert && (a.target == ParamKind::ffn_w13 || a.target == ParamKind::shared_w13)) {
      // Split gate / up adapters (expert_ffn.h): W13[:I] += s Bg Ag, W13[I:] += s Bu Au.
      const int64_t r = a.shape[1] / 2, I = b->shape[1] / 2;
      for (int half = 0; half < 2; half++)
        ops::sgemm(false, false, (int)I, (int)in, (int)r, s, adapter_values + b->offset + half * I * r, (int)r,
                   adapter_values + a.offset + half * r * in, (int)in, 1.0f, base_values + w.offset + half * I * in,
                   (int)in);
      continue;
    }
    const int64_t r = stacked ? a.shape[1] : a.shape[0];
    const int64_t out = stacked ? b->shape[1] : b->shape[0];
    for (int64_t e = 0; e < E; e++)  // W[e] [out, in] += s * B[e] [out, r] @ A[e] [r, in]
      ops::sgemm(false, false, (int)out, (int)in, (int)r, s, adapter_values + b->offset + e * out * r, (int)r,
                 adapter_values + a.offset + e * r * in, (int)in, 1.0f, base_values + w.offset + e * out * in,
                 (int)in);
  }
}

}  // namespace moetron
