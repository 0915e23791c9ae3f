#include "model/weights.h"

#include <fmt/format.h>

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

}  // namespace

void load_hf_weights(const ModelTensors& files, const ParamTable& table, float* params, const std::string& source) {
  // The HF tensors of each parameter.
  std::vector<std::vector<const HfTensorRef*>> refs_of(table.specs().size());
  for (const HfTensorRef& ref : table.hf_tensors()) refs_of[ref.spec_index].push_back(&ref);

  std::set<std::string> used;
  for (size_t si = 0; si < table.specs().size(); si++) {
    const ParamSpec& spec = table.specs()[si];
    const std::vector<const HfTensorRef*>& refs = refs_of[si];
    size_t present = 0;
    for (const HfTensorRef* ref : refs) present += files.find(ref->name) != nullptr;
    // The transformers-5 packing stores a whole stacked MoE tensor in exactly our layout.
    const std::string packed = table.is_moe() ? packed_name(spec) : "";
    const TensorView* whole = present == 0 && !packed.empty() ? files.find(packed) : nullptr;
    if (whole) {
      if (whole->shape != spec.shape)
        fail("{}: tensor '{}' has shape {}, but config.json implies {}", source, whole->name, shape_str(whole->shape),
             shape_str(spec.shape));
      read_f32(*whole, params + spec.offset, spec.numel);
      used.insert(whole->name);
      continue;
    }
    for (const HfTensorRef* ref : refs) {
      const TensorView* t = files.find(ref->name);
      if (!t) fail("{}: tensor '{}' (shape {}) is missing", source, ref->name, shape_str(ref->shape));
      if (t->shape != ref->shape)
        fail("{}: tensor '{}' has shape {}, but config.json implies {}", source, ref->name, shape_str(t->shape),
             shape_str(ref->shape));
      read_f32(*t, params + ref->offset, ref->numel);
      used.insert(ref->name);
    }
  }
  for (const std::string& name : files.names()) {
    if (used.count(name)) continue;
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // a buffer, not a parameter
    fail(
        "{}: tensor '{}' is not a parameter of the model config.json describes (architecture, layer count "
        "or expert count mismatch?)",
        source, name);
  }
}

void add_hf_tensors(SafetensorsWriter& writer, const ParamTable& table, const float* values, DType storage,
                    const std::string& prefix) {
  for (const HfTensorRef& ref : table.hf_tensors())
    writer.add_f32(prefix + ref.name, ref.shape, values + ref.offset, storage);
}

}  // namespace moetron
