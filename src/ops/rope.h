// Rotary position embedding.  N tokens, H heads, HD head dim.  Activation gradients assign (=).
//
// A RopeSpec says which dims of each head rotate and how (hf_config.h; transformers'
// modeling_rope_utils.py and apply_rotary_pos_emb*):
//   - the R dims [offset, offset + R) of each head (R = 0: HD - offset): all of them (Llama), the
//     first R (GLM's partial_rotary_factor), or the last qk_rope_head_dim (DeepSeek's latent attention);
//   - pairs (j, j + R/2), HF's rotate-half, or (2j, 2j + 1), DeepSeek's interleaved layout.
//     transformers writes the interleaved result de-interleaved (the rotated even dims, then the odd
//     ones); moetron keeps each pair in place.  That permutes q's and k's rotated dims alike, so every
//     q . k -- the only use of rotated values -- is the same;
//   - inv_freq[j] = 1 / theta^(2j/R) (j < R/2), computed in fp32 as transformers does, or YaRN's blend
//     of it with inv_freq / factor over the correction range [yarn_low, yarn_high];
//   - angle = (float)pos * inv_freq[j] in fp32, cos and sin evaluated in double on that fp32 angle,
//     then times attention_factor (YaRN's; 1 otherwise):
//       y[a] = x[a] cos - x[b] sin,  y[b] = x[b] cos + x[a] sin   for each pair (a, b).
// The backward is the inverse rotation (sin -> -sin), scaled by the same attention_factor.
#pragma once

#include <cstdint>
#include <vector>

namespace moetron::ops {

struct RopeSpec {
  float theta = 10000.0f;
  int rotary_dim = 0;  // R; 0: every dim from offset on
  int offset = 0;
  bool interleaved = false;
  // YaRN (rope_type "yarn"): factor > 1 blends the frequencies below the correction range's ramp.
  bool yarn = false;
  float yarn_factor = 1.0f;
  float yarn_low = 0.0f, yarn_high = 0.0f;
  float attention_factor = 1.0f;
  bool operator==(const RopeSpec& o) const {  // spelled out: the CUDA sources compile as C++17
    return theta == o.theta && rotary_dim == o.rotary_dim && offset == o.offset && interleaved == o.interleaved &&
           yarn == o.yarn && yarn_factor == o.yarn_factor && yarn_low == o.yarn_low && yarn_high == o.yarn_high &&
           attention_factor == o.attention_factor;
  }
  // The rotated width for a head of HD dims.
  int rotated(int HD) const { return rotary_dim > 0 ? rotary_dim : HD - offset; }
};

// The R/2 inverse frequencies (fp32, as transformers computes them).
std::vector<float> rope_inv_freq(const RopeSpec& spec, int R);

// out[N,H,HD] from inp[N,H,HD] with positions pos[N].  out may alias inp.
void rope_forward(float* out, const float* inp, const int32_t* pos, long N, int H, int HD, const RopeSpec& spec);
// dinp[N,H,HD] from dout[N,H,HD] (the inverse rotation).  dinp may alias dout.
void rope_backward(float* dinp, const float* dout, const int32_t* pos, long N, int H, int HD, const RopeSpec& spec);
// Plain rotate-half RoPE over the whole head (theta only).
inline void rope_forward(float* out, const float* inp, const int32_t* pos, long N, int H, int HD, float theta) {
  rope_forward(out, inp, pos, N, H, HD, RopeSpec{theta});
}
inline void rope_backward(float* dinp, const float* dout, const int32_t* pos, long N, int H, int HD, float theta) {
  rope_backward(dinp, dout, pos, N, H, HD, RopeSpec{theta});
}

// The cos and sin of positions pos[N]'s angles, as rope_forward computes them (attention_factor
// included): cs[N, R/2], sn[N, R/2] (=).  Inference computes them once per pass and rotates q and k of
// every layer with them.
void rope_angles(float* cs, float* sn, const int32_t* pos, long N, int R, const RopeSpec& spec);
inline void rope_angles(float* cs, float* sn, const int32_t* pos, long N, int HD, float theta) {
  rope_angles(cs, sn, pos, N, HD, RopeSpec{theta});
}

// rope_forward with the angles given by rope_angles: bitwise rope_forward's result.  out may alias inp.
void rope_forward_angles(float* out, const float* inp, const float* cs, const float* sn, long N, int H, int HD,
                         const RopeSpec& spec);
inline void rope_forward_angles(float* out, const float* inp, const float* cs, const float* sn, long N, int H,
                                int HD) {
  rope_forward_angles(out, inp, cs, sn, N, H, HD, RopeSpec{});
}

}  // namespace moetron::ops
