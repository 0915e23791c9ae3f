// The parameter table: one row per model tensor, laid out in one contiguous fp32 allocation.
// Parameters, gradients and optimizer state are each one allocation of `total` floats with the same
// offsets, so an optimizer or a reduction walks them as flat arrays.
//
// Expert weights are stored stacked so a grouped GEMM can run over them: w13 [E, 2I, C] holds per
// expert the gate rows (w1) then the up rows (w3) -- transformers-5's gate_up_proj layout, so one
// GEMM computes gate and up -- and w2 [E, C, I].  On disk (Hugging Face names) they are separate
// tensors `model.layers.N.block_sparse_moe.experts.e.{w1,w3,w2}.weight`.  A dense model's FFN
// (`mlp.{gate,up,down}_proj`) is stored exactly like one expert: [1, 2I, C] / [1, C, I].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/hf_config.h"

namespace moetron {

enum class ParamKind {
  embedding,   // [V, C]
  input_norm,  // [C]
  q_proj,      // [NH*HD, C]
  k_proj,      // [NKV*HD, C]
  v_proj,      // [NKV*HD, C]
  o_proj,      // [C, NH*HD]
  post_norm,   // [C]
  router,      // [E, C]
  ffn_w13,     // [E, 2I, C] gate rows then up rows per expert (dense: E = 1)
  ffn_w2,      // [E, C, I] down
  final_norm,  // [C]
  lm_head,     // [V, C]
};

struct ParamSpec {
  std::string name;            // moetron name; equals the HF name for non-stacked tensors
  ParamKind kind;
  int layer = -1;              // decoder layer, -1 for embedding / final norm / head
  std::vector<int64_t> shape;  // storage shape (stacked for experts)
  size_t offset = 0;           // in floats, into the flat allocation
  size_t numel = 0;
  bool weight_decay = true;    // false for RMSNorm weights
  int n_stacked = 0;           // experts stacked along dim 0 (0: not an expert tensor)
  bool is_norm() const { return !weight_decay; }
};

// One HF tensor: a name and where its values live inside the flat allocation.
struct HfTensorRef {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset = 0;
  size_t numel = 0;
  size_t spec_index = 0;  // into ParamTable::specs()
  int stacked_index = -1;  // expert index for stacked tensors (0 for a dense FFN)
};

class ParamTable {
 public:
  explicit ParamTable(const ModelConfig& cfg);

  const std::vector<ParamSpec>& specs() const { return specs_; }
  size_t total() const { return total_; }
  bool is_moe() const { return moe_; }
  const ParamSpec& at(ParamKind kind, int layer = -1) const;
  // The tensors as Hugging Face names them (experts expanded, dense FFN under mlp.* names).
  const std::vector<HfTensorRef>& hf_tensors() const { return hf_tensors_; }
  const HfTensorRef* find_hf(const std::string& name) const;
  const ParamSpec& spec_of(const HfTensorRef& t) const { return specs_[t.spec_index]; }

 private:
  void add(ParamKind kind, int layer, std::vector<int64_t> shape, bool decay);
  std::vector<ParamSpec> specs_;
  std::vector<HfTensorRef> hf_tensors_;
  size_t total_ = 0;
  int num_layers_ = 0;
  bool moe_ = false;
};

// Fills params (table.total() floats) from the counter-based RNG: normal(0, initializer_range)
// for matrices, 1 for norm weights.  Each HF tensor draws from its own stream keyed by its HF name,
// element index = position within that tensor, so any slice can be initialised alone.
void init_parameters(const ParamTable& table, const ModelConfig& cfg, uint64_t seed, float* params);

}  // namespace moetron
