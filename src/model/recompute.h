// Activation recompute (train.recompute): what a micro-batch keeps between its forward and its
// backward, and what the backward computes again.
//   none       every layer keeps every tensor its backward reads.
//   full       every layer keeps its input x [N,C] only; before a layer's backward its forward runs
//              again (the same blocks, no statistics recorded) into one layer's work set shared by
//              every layer and micro-batch.  Cost: one more forward of the layers.
//   selective  every layer keeps what its backward reads except the attention probabilities (a
//              backend whose attention keeps more than per-row statistics: the CPU's [B,NH,T,T])
//              and the SwiGLU outputs of the experts, the shared expert and the dense FFN ([rows,I]);
//              the backward recomputes them (the attention forward, the SwiGLU) into buffers shared
//              by every layer.  Cost: one attention forward and one SwiGLU per layer.
// The recomputed values are the forward's bit for bit (the same kernels on the same inputs), so
// losses and gradients do not depend on the mode.
#pragma once

#include <string>
#include <string_view>

namespace moetron {

enum class Recompute { none, full, selective };

// "none" | "full" | "selective"; anything else: an Error naming `where` and the value.
Recompute parse_recompute(std::string_view s, std::string_view where);
const char* recompute_name(Recompute r);

}  // namespace moetron
