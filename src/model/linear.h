// The linear layer, HF nn.Linear (weight [OC, IC]), with an optional LoRA adapter (model/lora.h):
//   out = x W^T + scale (x A^T) B^T
// This is the one place an adapter's arithmetic is written: the attention projections, the router,
// the dense FFN, the shared expert and -- grouped over a MoE plan, one weight per expert -- the
// routed experts all go through it.  The base product and the adapter are separate backend calls,
// the adapter after the base (a frozen base has no gradient: dW empty).
// Dimensions: rows (N tokens, or M plan rows), IC in, OC out, r rank, E stacked experts (1 unless
// grouped).
#pragma once

#include <initializer_list>

#include "backend/backend.h"

namespace moetron {

struct LoraFactors {
  Tensor a, b;    // A [E, r, IC], B [E, OC, r] as the products read them (act store; the router's f32)
  Tensor da, db;  // their gradients (f32, +=); empty when not trained
  int r = 0;
  float scale = 0.0f;
  // PEFT's separate gate_proj and up_proj adapters of a dense FFN / shared expert read as one
  // [2I, C] gate_up weight: A [2r, C] holds the gate factor then the up one, B [2I, r] the gate rows
  // then the up rows; u [rows, 2r] is read as u[:, :r] by the gate rows, u[:, r:] by the up rows.
  bool split = false;
  bool on() const { return !a.empty(); }
  // Columns of u = x A^T per row.
  int u_width() const { return split ? 2 * r : r; }
};

struct LinearWeights {
  Tensor w;   // [E, OC, IC] as the products read them
  Tensor dw;  // f32, +=; empty: frozen
  LoraFactors lora;
};

// out[rows, OC] += scale (x A^T) B^T over plan's groups (the expert of each row); u[rows, u_width]
// = x A^T is kept for the backward.  A no-op when the factors are off.
void lora_forward(Backend& be, Tensor out, Tensor u, Tensor x, const LoraFactors& f, const PlanView& plan, int IC,
                  int OC);
// dx[rows, IC] += d(x) through the adapter; dA, dB += (when present).  du: scratch of u's size.
void lora_backward(Backend& be, Tensor dx, Tensor du, Tensor dout, Tensor x, Tensor u, const LoraFactors& f,
                   const PlanView& plan, int IC, int OC);

// out[N, OC] (= or += when accumulate) = x[N, IC] W^T, then + the adapter over `ident` (the
// identity plan of the N rows; unused without an adapter).
void linear_forward(Backend& be, Tensor out, Tensor u, Tensor x, const LinearWeights& w, const PlanView& ident, long N,
                    int IC, int OC, bool accumulate);
// dx[N, IC] (= or += when accumulate; skipped when empty) and dW (+=) from dout[N, OC], then the
// adapter's (dx +=).
void linear_backward(Backend& be, Tensor dx, Tensor du, Tensor dout, Tensor x, Tensor u, const LinearWeights& w,
                     const PlanView& ident, long N, int IC, int OC, bool accumulate);

// Several linear layers reading the same x (q, k and v): dx[N, IC] (assign) = the sum of their input
// gradients -- the base products' first, then the adapters', in the order given -- and each one's
// weight gradients.
struct LinearGrad {
  const LinearWeights& w;
  Tensor dout;  // [N, OC]
  Tensor u;     // the forward's x A^T (empty without an adapter)
  int OC;
};
void linears_backward(Backend& be, Tensor dx, Tensor du, Tensor x, std::initializer_list<LinearGrad> parts,
                      const PlanView& ident, long N, int IC);

// The same per expert over plan's rows (w [E, OC, IC]): out[M, OC] (assign), computed rows only.
void grouped_linear_forward(Backend& be, Tensor out, Tensor u, Tensor x, const LinearWeights& w, const PlanView& plan,
                            int IC, int OC);
void grouped_linear_backward(Backend& be, Tensor dx, Tensor du, Tensor dout, Tensor x, Tensor u, const LinearWeights& w,
                             const PlanView& plan, int IC, int OC);

}  // namespace moetron
