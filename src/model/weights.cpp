#include "model/weights.h"

#include <map>
#include <set>

#include <fmt/format.h>

#include "core/error.h"
#include "io/model_files.h"

namespace moetron {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); i++) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// transformers-5 names of one layer's packed MoE tensors.
std::string packed_name(int layer, const char* what) { return fmt::format("model.layers.{}.mlp.{}", layer, what); }

}  // namespace

void load_hf_weights(const ModelTensors& files, const ParamTable& table, float* params, const std::string& source) {
  std::set<std::string> used;
  // Packed expert tensors are read once per layer and sliced.
  std::map<std::string, std::vector<float>> packed_cache;
  auto packed = [&](const TensorView& t) -> const std::vector<float>& {
    auto it = packed_cache.find(t.name);
    if (it == packed_cache.end()) it = packed_cache.emplace(t.name, to_f32(t)).first;
    return it->second;
  };

  for (const HfTensorRef& ref : table.hf_tensors()) {
    const ParamSpec& spec = table.spec_of(ref);
    float* dst = params + ref.offset;
    if (const TensorView* t = files.find(ref.name)) {
      if (t->shape != ref.shape)
        fail("{}: tensor '{}' has shape {}, but config.json implies {}", source, ref.name, shape_str(t->shape),
             shape_str(ref.shape));
      read_f32(*t, dst, ref.numel);
      used.insert(ref.name);
      continue;
    }
    // transformers-5 packing for MoE layers.
    const TensorView* t = nullptr;
    if (spec.kind == ParamKind::router) t = files.find(packed_name(spec.layer, "gate.weight"));
    if (spec.kind == ParamKind::ffn_w1 || spec.kind == ParamKind::ffn_w3)
      t = files.find(packed_name(spec.layer, "experts.gate_up_proj"));
    if (spec.kind == ParamKind::ffn_w2) t = files.find(packed_name(spec.layer, "experts.down_proj"));
    if (!t || (spec.n_stacked == 0 && spec.kind != ParamKind::router))
      fail("{}: tensor '{}' (shape {}) is missing", source, ref.name, shape_str(ref.shape));
    used.insert(t->name);
    if (spec.kind == ParamKind::router) {
      if (t->shape != ref.shape)
        fail("{}: tensor '{}' has shape {}, expected {}", source, t->name, shape_str(t->shape), shape_str(ref.shape));
      read_f32(*t, dst, ref.numel);
      continue;
    }
    const int64_t E = spec.shape[0], A = spec.shape[1], Bd = spec.shape[2];
    const std::vector<int64_t> want =
        spec.kind == ParamKind::ffn_w2 ? std::vector<int64_t>{E, A, Bd} : std::vector<int64_t>{E, 2 * A, Bd};
    if (t->shape != want)
      fail("{}: tensor '{}' has shape {}, expected {}", source, t->name, shape_str(t->shape), shape_str(want));
    const std::vector<float>& all = packed(*t);
    const int e = ref.stacked_index;
    const size_t per = (size_t)A * Bd;
    size_t src_off = spec.kind == ParamKind::ffn_w2 ? per * e : per * (2 * e);
    if (spec.kind == ParamKind::ffn_w3) src_off += per;  // up rows follow the gate rows
    std::copy(all.begin() + src_off, all.begin() + src_off + per, dst);
  }
  for (const std::string& name : files.names()) {
    if (used.count(name)) continue;
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // a buffer, not a parameter
    fail("{}: tensor '{}' is not a parameter of the model config.json describes (architecture, layer count "
         "or expert count mismatch?)",
         source, name);
  }
}

void add_hf_tensors(SafetensorsWriter& writer, const ParamTable& table, const float* values, DType storage,
                    const std::string& prefix) {
  for (const HfTensorRef& ref : table.hf_tensors()) writer.add_f32(prefix + ref.name, ref.shape, values + ref.offset, storage);
}

}  // namespace moetron
