// What every block of the layer body (model/model.h) is given besides its own tensors: the backend,
// the config, the tensor-parallel group and the profile.  Blocks (model/attention_block.h,
// model/moe_block.h, model/dense_ffn.h, model/linear.h) hold no parameters: the model resolves each
// layer's weights and hands them in, so the same block runs over any weight storage.
#pragma once

#include <optional>

#include "backend/backend.h"
#include "core/profile.h"
#include "io/hf_config.h"

namespace moetron {

namespace dist {
class Comm;
}

struct BlockEnv {
  Backend& be;
  const ModelConfig& cfg;
  dist::Comm* tp = nullptr;  // the tensor-parallel group (null: none)
  int tp_size = 1;
  Profile* profile = nullptr;
  bool inference = false;  // a pass over KV caches (Model::infer): sections take their inference names
  // train.recompute selective (model/recompute.h): a training carve leaves out what the backward
  // recomputes (attention probabilities, SwiGLU outputs), whose buffers the model shares between layers.
  bool selective = false;

  bool tp_on() const { return tp_size > 1; }
  // A section's name: training's, or inference's (bench generate --profile).
  const char* sec(const char* train, const char* infer) const { return inference ? infer : train; }
  // x (f32) summed over the tp group, in place.
  void tp_all_reduce(Tensor x) const;
  // Replicas of each kv head across the tp ranks (1 unless NKV < tp).
  int kv_replicas() const {
    return tp_on() && cfg.num_key_value_heads < tp_size ? tp_size / cfg.num_key_value_heads : 1;
  }
};

// A profile section; on a device backend it synchronises before and after (only when on), so the
// time is the device's.
class Section {
 public:
  Section(Backend& be, Profile* profile, const char* name) : be_(be), on_(profile != nullptr) {
    if (on_) be.synchronize(name);
    timer_.emplace(profile, name);
  }
  Section(const BlockEnv& env, const char* name) : Section(env.be, env.profile, name) {}
  ~Section() {
    if (on_) {
      try {
        be_.synchronize("profile section");
      } catch (...) {  // surfaces at the next call
      }
    }
  }
  Section(const Section&) = delete;
  Section& operator=(const Section&) = delete;

 private:
  Backend& be_;
  bool on_;
  std::optional<ScopedTimer> timer_;
};

}  // namespace moetron
