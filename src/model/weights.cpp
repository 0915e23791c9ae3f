#include "model/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/error.h"
#include "core/interrupt.h"
#include "io/hf_config.h"
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
  if (!table.is_whole()) fail("weight shard: the table must be the whole model");
  const int L = cfg.num_hidden_layers, E = std::max(cfg.num_local_experts, 1);
  const int lb = shard.layer_begin, le = shard.layer_end < 0 ? L : shard.layer_end;
  const int eb = shard.expert_begin, ee = shard.expert_end < 0 ? E : shard.expert_end;
  if (lb < 0 || lb > le || le > L)
    fail("weight shard: layer range [{}, {}) is outside the model's {} layers (num_hidden_layers)", lb, le, L);
  if (eb < 0 || eb >= ee || ee > E)
    fail("weight shard: expert range [{}, {}) is outside the model's {} experts (num_local_experts)", eb, ee, E);
  if (shard.tp_size < 1 || shard.tp_rank < 0 || shard.tp_rank >= shard.tp_size)
    fail("weight shard: tp_rank {} is outside [0, tp_size {})", shard.tp_rank, shard.tp_size);
  std::vector<HfTensorSlice> out;
  if (lb == le) return out;
  // The slices are the sharded parameter table's (one place decides how tensors split).
  ParamShard ps;
  ps.layer_begin = lb;
  ps.layer_end = le;
  ps.expert_begin = eb;
  ps.expert_end = ee;
  ps.tp_rank = shard.tp_rank;
  ps.tp_size = shard.tp_size;
  const ParamTable part(cfg, ps);
  std::map<std::string, const HfTensorRef*> whole;
  for (const HfTensorRef& ref : table.hf_tensors()) whole[ref.name] = &ref;
  for (const HfTensorRef& t : part.hf_tensors()) {
    const auto it = whole.find(t.name);
    if (it == whole.end()) fail("weight shard: tensor '{}' is not part of the whole model", t.name);
    HfTensorSlice s;
    s.ref = it->second;
    if (t.slice_dim >= 0) {
      s.dim = t.slice_dim;
      s.begin = t.slice_begin;
      s.end = t.slice_end;
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
  const std::string packed = spec.expert || spec.kind == ParamKind::router ? packed_name(spec) : "";
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
    // The up half is the second of each expert's two [I, C] blocks in the stacked storage.
    const ParamSpec& spec = table.spec_of(ref);
    const bool up = spec.kind == ParamKind::ffn_w13 && (ref.offset - spec.offset) / ref.numel % 2 == 1;
    const int64_t row_offset = up ? ref.shape[0] : 0;
    read_view_slice(select_index(t, ref.stacked_index), slice, row_offset, out);
  }
  check_finite(out, slice.numel(), t, ref.name);
  return t.name;
}

TensorView hf_tensor_view(const ModelTensors& files, const ParamTable& table, const HfTensorRef& ref,
                          const std::string& source) {
  const TensorView& t = locate(files, table, ref, source);
  if (t.name == ref.name || table.spec_of(ref).kind == ParamKind::router) return t;
  // A packed expert tensor: expert `stacked_index`, and for gate_up_proj the gate or the up half.
  const ParamSpec& spec = table.spec_of(ref);
  const bool up = spec.kind == ParamKind::ffn_w13 && (ref.offset - spec.offset) / ref.numel % 2 == 1;
  TensorView v = select_index(t, ref.stacked_index);
  const size_t bytes = ref.numel * dtype_size(v.dtype);
  v.data += up ? bytes : 0;
  v.nbytes = bytes;
  v.shape = ref.shape;
  v.name = ref.name;
  return v;
}

namespace {

// A tensor of a multi-token-prediction layer: model.layers.<l>. with l in [L, L + mtp).
bool is_mtp_tensor(const std::string& name, const ParamTable& table) {
  if (table.mtp_layers() == 0 || name.rfind("model.layers.", 0) != 0) return false;
  size_t at = 13;
  long l = 0;
  bool digits = false;
  for (; at < name.size() && name[at] >= '0' && name[at] <= '9' && l < (1L << 20); at++, digits = true)
    l = l * 10 + (name[at] - '0');
  return digits && at < name.size() && name[at] == '.' && l >= table.num_layers() &&
         l < table.num_layers() + table.mtp_layers();
}

}  // namespace

std::string mtp_note(size_t ignored, const ParamTable& table, const std::string& source) {
  if (ignored == 0) return "";
  return fmt::format("{}: {} tensors of the multi-token-prediction layer(s) model.layers.{}.* are not part of the "
                     "model and were not loaded (transformers ignores them too)",
                     source, ignored, table.num_layers());
}

size_t check_weights_size(const ModelTensors& files, const ParamTable& table, const std::string& source) {
  std::set<std::string> used;
  for (const HfTensorRef& ref : table.hf_tensors()) used.insert(locate(files, table, ref, source).name);
  size_t ignored = 0;
  for (const std::string& name : files.names()) {
    if (used.count(name)) continue;
    if (is_mtp_tensor(name, table)) {
      ignored++;
      continue;
    }
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // a buffer, not a parameter
    // Tied embeddings: transformers ignores a saved lm_head.weight (the head IS the embedding).
    if (name == "lm_head.weight" && table.head_kind() == ParamKind::embedding) continue;
    fail(
        "{}: tensor '{}' is not a parameter of the model config.json describes (architecture, layer count "
        "or expert count mismatch?)",
        source, name);
  }
  return ignored;
}

void load_hf_weights(const ModelTensors& files, const ParamTable& table, float* params, const std::string& source) {
  check_weights_size(files, table, source);
  for (const HfTensorRef& ref : table.hf_tensors()) {
    check_interrupted();  // a command that writes (convert --merge-lora) stops on Ctrl-C here too
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

size_t write_random_model(const std::string& dir, const ModelConfig& cfg, uint64_t seed, DType storage) {
  const ParamTable table(cfg);
  std::vector<float> params(table.total());
  init_parameters(table, cfg, seed, params.data());
  std::vector<ModelTensorToWrite> tensors;
  size_t numel = 0;
  for (const HfTensorRef& ref : table.hf_tensors()) {
    tensors.push_back({ref.name, storage, ref.shape, params.data() + ref.offset});
    numel += ref.numel;
  }
  std::filesystem::create_directories(dir);
  write_model_safetensors(dir, tensors);
  std::ofstream(std::filesystem::path(dir) / "config.json") << model_config_to_json(cfg).dump(2) << "\n";
  return numel;
}

}  // namespace moetron
