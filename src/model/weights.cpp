#include "model/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "core/error.h"
#include "io/model_files.h"

namespace moetron {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); i++) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// transformers-5 in-memory name of a whole stacked MoE tensor, or "" when there is none.
std::string packed_name(const ParamSpec& spec) {
  const std::string p = fmt::format("model.layers.{}.mlp.", spec.layer);
  switch (spec.kind) {
    case ParamKind::router:
      return p + "gate.weight";
    case ParamKind::ffn_w13:
      return p + "experts.gate_up_proj";
    case ParamKind::ffn_w2:
      return p + "experts.down_proj";
    default:
      return "";
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void check_shape(const TensorView& t, const std::vector<int64_t>& expected, const std::string& source) {
  if (t.shape != expected)
    fail("{}: tensor '{}' has shape {}, but config.json implies {}", source, t.name, shape_str(t.shape),
         shape_str(expected));
}

void read_view_slice(const TensorView& t, const HfTensorSlice& slice, int64_t dim_offset, float* out) {
  if (slice.dim < 0) {
    read_f32_slice(t, 0, dim_offset, dim_offset + slice.ref->shape[0], out);
  } else {
    read_f32_slice(t, slice.dim, (slice.dim == 0 ? dim_offset : 0) + slice.begin,
                   (slice.dim == 0 ? dim_offset : 0) + slice.end, out);
  }
}

// NaN or infinity in weights makes every logit NaN (a forward pass "succeeds", generation streams
// garbage): refused when the values are read, naming the tensor and its file.
void check_finite(const float* values, size_t n, const TensorView& t, const std::string& hf_name) {
  const size_t i = first_non_finite(values, n);
  if (i == n) return;
  const std::string part = hf_name == t.name ? "" : fmt::format(" (the part holding '{}')", hf_name);
  fail("{}: tensor '{}'{} holds a non-finite value ({}) at element {} of the values read: the weights are corrupt "
       "(NaN or Inf), and a model computed from them would give NaN logits",
       t.file, t.name, part, values[i], i);
}

}  // namespace

std::pair<int64_t, int64_t> split_range(int64_t n, int parts, int part) {
  if (parts <= 0 || part < 0 || part >= parts) fail("split_range: part {} of {} is invalid", part, parts);
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = part * base + std::min<int64_t>(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

std::vector<int64_t> HfTensorSlice::shape() const {
  std::vector<int64_t> s = ref->shape;
  if (dim >= 0) s[static_cast<size_t>(dim)] = end - begin;
  return s;
}

size_t HfTensorSlice::numel() const {
  size_t n = 1;
  for (int64_t d : shape()) n *= static_cast<size_t>(d);
  return n;
}

std::vector<HfTensorSlice> shard_slices(const ModelConfig& cfg, const ParamTable& table, const WeightShard& shard) {
  const int L = cfg.num_hidden_layers, E = std::max(cfg.num_local_experts, 1);
  const int lb = shard.layer_begin, le = shard.layer_end < 0 ? L : shard.layer_end;
  const int eb = shard.expert_begin, ee = shard.expert_end < 0 ? E : shard.expert_end;
  const int tp = shard.tp_size, r = shard.tp_rank;
  if (lb < 0 || lb > le || le > L)
    fail("weight shard: layer range [{}, {}) is outside the model's {} layers (num_hidden_layers)", lb, le, L);
  if (eb < 0 || eb >= ee || ee > E)
    fail("weight shard: expert range [{}, {}) is outside the model's {} experts (num_local_experts)", eb, ee, E);
  if (tp < 1 || r < 0 || r >= tp) fail("weight shard: tp_rank {} is outside [0, tp_size {})", r, tp);
  const int NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads, HD = cfg.head_dim;
  const int I = cfg.intermediate_size;
  if (NH % tp != 0) fail("weight shard: num_attention_heads {} is not divisible by tp {}", NH, tp);
  if (NKV % tp != 0 && tp % NKV != 0)
    fail("weight shard: num_key_value_heads {} and tp {}: neither divides the other", NKV, tp);
  if (I % tp != 0) fail("weight shard: intermediate_size {} is not divisible by tp {}", I, tp);

  // Heads [h0, h1) of this rank, and its kv heads (one replicated head when NKV < tp).
  const int64_t h0 = int64_t{NH} / tp * r, h1 = h0 + NH / tp;
  const int64_t kv0 = NKV >= tp ? int64_t{NKV} / tp * r : r / (tp / NKV);
  const int64_t kv1 = NKV >= tp ? kv0 + NKV / tp : kv0 + 1;
  const auto [v0, v1] = split_range(cfg.vocab_size, tp, r);
  const int64_t i0 = int64_t{I} / tp * r, i1 = i0 + I / tp;

  std::vector<HfTensorSlice> out;
  for (const HfTensorRef& ref : table.hf_tensors()) {
    const ParamSpec& spec = table.spec_of(ref);
    if (spec.layer >= 0 && (spec.layer < lb || spec.layer >= le)) continue;
    if (spec.kind == ParamKind::embedding && lb != 0) continue;
    if ((spec.kind == ParamKind::final_norm || spec.kind == ParamKind::lm_head) && le != L) continue;
    if (spec.n_stacked > 0 && table.is_moe() && (ref.stacked_index < eb || ref.stacked_index >= ee)) continue;
    HfTensorSlice s;
    s.ref = &ref;
    auto cut = [&](int dim, int64_t begin, int64_t end) {
      s.dim = dim;
      s.begin = begin;
      s.end = end;
    };
    if (tp > 1) {
      switch (spec.kind) {
        case ParamKind::embedding:
        case ParamKind::lm_head:
          cut(0, v0, v1);
          break;
        case ParamKind::q_proj:
          cut(0, h0 * HD, h1 * HD);
          break;
        case ParamKind::k_proj:
        case ParamKind::v_proj:
          cut(0, kv0 * HD, kv1 * HD);
          break;
        case ParamKind::o_proj:
          cut(1, h0 * HD, h1 * HD);
          break;
        case ParamKind::ffn_w13:
          cut(0, i0, i1);
          break;
        case ParamKind::ffn_w2:
          cut(1, i0, i1);
          break;
        default:
          break;  // norms and router: whole on every rank
      }
    }
    out.push_back(s);
  }
  return out;
}

namespace {

// The file tensor holding `ref` -- its Hub-named tensor, or for MoE tensors the transformers-5
// packed tensor that holds it -- with its shape checked against config.json (headers only).
const TensorView& locate(const ModelTensors& files, const ParamTable& table, const HfTensorRef& ref,
                         const std::string& source) {
  if (const TensorView* t = files.find(ref.name)) {
    check_shape(*t, ref.shape, source);
    return *t;
  }
  // The transformers-5 packing: the router under mlp.gate, experts stacked whole.
  const ParamSpec& spec = table.spec_of(ref);
  const std::string packed = table.is_moe() ? packed_name(spec) : "";
  const TensorView* whole = packed.empty() ? nullptr : files.find(packed);
  if (!whole) fail("{}: tensor '{}' (shape {}) is missing", source, ref.name, shape_str(ref.shape));
  check_shape(*whole, spec.shape, source);
  return *whole;
}

}  // namespace

std::string read_hf_slice(const ModelTensors& files, const ParamTable& table, const HfTensorSlice& slice,
                          float* out, const std::string& source) {
  const HfTensorRef& ref = *slice.ref;
  const TensorView& t = locate(files, table, ref, source);
  if (t.name == ref.name) {
    read_view_slice(t, slice, 0, out);
  } else if (table.spec_of(ref).kind == ParamKind::router) {
    read_view_slice(t, slice, 0, out);
  } else {
    // gate_up_proj [E, 2I, C] holds w1 (gate) rows then w3 (up) rows; down_proj [E, C, I] is w2.
    const int64_t row_offset = ends_with(ref.name, ".w3.weight") ? ref.shape[0] : 0;
    read_view_slice(select_index(t, ref.stacked_index), slice, row_offset, out);
  }
  check_finite(out, slice.numel(), t, ref.name);
  return t.name;
}

void check_weights_size(const ModelTensors& files, const ParamTable& table, const std::string& source) {
  std::set<std::string> used;
  for (const HfTensorRef& ref : table.hf_tensors()) used.insert(locate(files, table, ref, source).name);
  for (const std::string& name : files.names()) {
    if (used.count(name)) continue;
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // a buffer, not a parameter
    fail(
        "{}: tensor '{}' is not a parameter of the model config.json describes (architecture, layer count "
        "or expert count mismatch?)",
        source, name);
  }
}

void load_hf_weights(const ModelTensors& files, const ParamTable& table, float* params, const std::string& source) {
  check_weights_size(files, table, source);
  for (const HfTensorRef& ref : table.hf_tensors()) {
    HfTensorSlice whole;
    whole.ref = &ref;
    read_hf_slice(files, table, whole, params + ref.offset, source);
  }
}

void add_hf_tensors(SafetensorsWriter& writer, const ParamTable& table, const float* values, DType storage,
                    const std::string& prefix) {
  for (const HfTensorRef& ref : table.hf_tensors())
    writer.add_f32(prefix + ref.name, ref.shape, values + ref.offset, storage);
}

}  // namespace moetron
