// The linear layer and its LoRA adapter; see linear.h.
#include "model/linear.h"

namespace moetron {

void lora_forward(Backend& be, Tensor out, Tensor u, Tensor x, const LoraFactors& f, const PlanView& plan, int IC,
                  int OC) {
  if (!f.on()) return;
  const int r = f.r;
  be.grouped_matmul_forward(u, x, f.a, plan, IC, f.u_width(), 1.0f, false);
  if (!f.split) return be.grouped_matmul_forward(out, u, f.b, plan, r, OC, f.scale, true);
  // Gate rows from u[:, :r], up rows from u[:, r:] (strides 2r and OC).
  const int I = OC / 2;
  const size_t Ir = (size_t)I * r;
  be.grouped_matmul_forward(out, u, f.b.part(0, Ir), plan, r, I, f.scale, true, 2 * r, OC);
  be.grouped_matmul_forward(out.part(I, out.numel - I), u.part(r, u.numel - r), f.b.part(Ir, Ir), plan, r, I, f.scale,
                            true, 2 * r, OC);
}

void lora_backward(Backend& be, Tensor dx, Tensor du, Tensor dout, Tensor x, Tensor u, const LoraFactors& f,
                   const PlanView& plan, int IC, int OC) {
  if (!f.on()) return;
  const int r = f.r;
  du = du.part(0, u.numel);
  // out += s u B^T: du = s dout B, dB += s dout^T u;  u = x A^T: dx += du A, dA += du^T x.
  if (!f.split) {
    be.grouped_matmul_backward(du, f.db, dout, u, f.b, plan, r, OC, f.scale, false);
  } else {
    const int I = OC / 2;
    const size_t Ir = (size_t)I * r, n = du.numel;
    const Tensor db_gate = f.db.empty() ? Tensor{} : f.db.part(0, Ir);
    const Tensor db_up = f.db.empty() ? Tensor{} : f.db.part(Ir, Ir);
    be.grouped_matmul_backward(du, db_gate, dout, u, f.b.part(0, Ir), plan, r, I, f.scale, false, 2 * r, OC);
    be.grouped_matmul_backward(du.part(r, n - r), db_up, dout.part(I, dout.numel - I), u.part(r, u.numel - r),
                               f.b.part(Ir, Ir), plan, r, I, f.scale, false, 2 * r, OC);
  }
  be.grouped_matmul_backward(dx, f.da, du, x, f.a, plan, IC, f.u_width(), 1.0f, true);
}

void linear_forward(Backend& be, Tensor out, Tensor u, Tensor x, const LinearWeights& w, const PlanView& ident, long N,
                    int IC, int OC, bool accumulate) {
  be.matmul_forward(out, x, w.w, (int)N, IC, OC, accumulate);
  lora_forward(be, out, u, x, w.lora, ident, IC, OC);
}

void linear_backward(Backend& be, Tensor dx, Tensor du, Tensor dout, Tensor x, Tensor u, const LinearWeights& w,
                     const PlanView& ident, long N, int IC, int OC, bool accumulate) {
  be.matmul_backward(dx, w.dw, dout, x, w.w, (int)N, IC, OC, accumulate);
  lora_backward(be, dx, du, dout, x, u, w.lora, ident, IC, OC);
}

void linears_backward(Backend& be, Tensor dx, Tensor du, Tensor x, std::initializer_list<LinearGrad> parts,
                      const PlanView& ident, long N, int IC) {
  bool first = true;
  for (const LinearGrad& p : parts) {
    be.matmul_backward(dx, p.w.dw, p.dout, x, p.w.w, (int)N, IC, p.OC, !first);
    first = false;
  }
  for (const LinearGrad& p : parts) lora_backward(be, dx, du, p.dout, x, p.u, p.w.lora, ident, IC, p.OC);
}

void grouped_linear_forward(Backend& be, Tensor out, Tensor u, Tensor x, const LinearWeights& w, const PlanView& plan,
                            int IC, int OC) {
  be.grouped_matmul_forward(out, x, w.w, plan, IC, OC, 1.0f, false);
  lora_forward(be, out, u, x, w.lora, plan, IC, OC);
}

void grouped_linear_backward(Backend& be, Tensor dx, Tensor du, Tensor dout, Tensor x, Tensor u, const LinearWeights& w,
                             const PlanView& plan, int IC, int OC) {
  be.grouped_matmul_backward(dx, w.dw, dout, x, w.w, plan, IC, OC, 1.0f, false);
  lora_backward(be, dx, du, dout, x, u, w.lora, plan, IC, OC);
}

}  // namespace moetron
