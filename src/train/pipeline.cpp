#include "train/pipeline.h"

#include <algorithm>

#include "core/error.h"

namespace moetron {

PipelineLink::PipelineLink(Backend& be, dist::Comm& pp, int experts)
    : be_(be), pp_(pp), stage_(pp.rank()), stages_(pp.size()), E_(experts), stats_in_(2 * experts + 1),
      aux_in_(experts) {}

void PipelineLink::recv_forward(size_t n) {
  if (!first()) transfer(-1, nullptr, nullptr, 0, stage_ - 1, hidden_buf_, hidden_in_, stats_in_, n);
}
void PipelineLink::send_forward(const Model& m, size_t n) {
  if (!last())
    transfer(stage_ + 1, m.stage_output(), pack(m).data(), stats_in_.size(), -1, grad_buf_, grad_in_, aux_in_, n);
}
void PipelineLink::send_forward_recv_backward(const Model& m, size_t n) {
  if (!last())
    transfer(stage_ + 1, m.stage_output(), pack(m).data(), stats_in_.size(), stage_ + 1, grad_buf_, grad_in_, aux_in_,
             n);
}
void PipelineLink::send_backward_recv_forward(const Model& m, size_t n) {
  if (!first())
    transfer(stage_ - 1, m.input_grad(), m.input_aux_grad().data(), aux_in_.size(), stage_ - 1, hidden_buf_,
             hidden_in_, stats_in_, n);
}
void PipelineLink::recv_backward(size_t n) {
  if (!last()) transfer(-1, nullptr, nullptr, 0, stage_ + 1, grad_buf_, grad_in_, aux_in_, n);
}
void PipelineLink::send_backward(const Model& m, size_t n) {
  if (!first())
    transfer(stage_ - 1, m.input_grad(), m.input_aux_grad().data(), aux_in_.size(), -1, hidden_buf_, hidden_in_,
             stats_in_, n);
}

StageInput PipelineLink::input() {
  StageInput in;
  if (first()) return in;
  in.hidden = static_cast<const float*>(hidden_in_.data);
  if (E_ > 0) {
    pooled_in_.assigned.assign(stats_in_.begin(), stats_in_.begin() + E_);
    pooled_in_.prob_sum.assign(stats_in_.begin() + E_, stats_in_.begin() + 2 * E_);
    pooled_in_.tokens = stats_in_[2 * E_];
    in.pooled = &pooled_in_;
  }
  return in;
}

StageGrad PipelineLink::grad() const {
  StageGrad g;
  if (last()) return g;
  g.hidden = static_cast<const float*>(grad_in_.data);
  if (E_ > 0) g.aux_grad = aux_in_.data();
  return g;
}

const std::vector<double>& PipelineLink::pack(const Model& m) {
  stats_out_.assign(stats_in_.size(), 0.0);
  if (E_ > 0) {
    const ops::RouterLayerStats& st = m.pooled_stats();
    std::copy(st.assigned.begin(), st.assigned.end(), stats_out_.begin());
    std::copy(st.prob_sum.begin(), st.prob_sum.end(), stats_out_.begin() + E_);
    stats_out_[2 * E_] = st.tokens;
  }
  return stats_out_;
}

void PipelineLink::transfer(int to, const float* hidden, const double* stats, size_t stats_n, int from,
                            GrowableBuffer& hidden_in, Tensor& hidden_view, std::vector<double>& stats_in, size_t n) {
  constexpr int kHidden = 40, kStats = 41;
  if (from != -1) hidden_view = hidden_in.get(be_, Store::f32, n, "pipeline hidden states");
  pp_.sendrecv(hidden, to != -1 ? n : 0, to, from != -1 ? hidden_view.data : nullptr, from != -1 ? n : 0, from,
               dist::CommDType::f32, kHidden);
  if (E_ > 0)
    pp_.host().sendrecv(stats, to != -1 ? stats_n : 0, to, stats_in.data(), from != -1 ? stats_in.size() : 0, from,
                        dist::CommDType::f64, kStats);
}

void run_1f1b(Model& model, PipelineLink& link, const std::vector<Batch>& micro, const LossWeights& weights,
              int stage, int stages, const std::function<void(const Losses&)>& account) {
  const int P = stages, st = stage, m = (int)micro.size();
  const size_t C = (size_t)model.config().hidden_size;
  const size_t n = micro.empty() ? 0 : (size_t)micro[0].B * micro[0].T * C;
  for (const Batch& b : micro)
    if ((size_t)b.B * b.T * C != n)
      fail("pipeline: micro-batches of one step differ in shape ({}x{} and {}x{})", micro[0].B, micro[0].T, b.B, b.T);
  model.discard_pending();  // an evaluation's forward may have left one
  int f = 0;
  auto forward = [&] { account(model.forward_queued(micro[f++], weights, link.input())); };
  auto backward = [&] { model.backward(link.grad()); };
  const int warmup = std::min(P - st - 1, m), steady = m - warmup;
  for (int i = 0; i < warmup; i++) {
    link.recv_forward(n);
    forward();
    link.send_forward(model, n);
  }
  if (steady > 0) link.recv_forward(n);
  for (int i = 0; i < steady; i++) {
    forward();
    link.send_forward_recv_backward(model, n);
    backward();
    if (i + 1 == steady)
      link.send_backward(model, n);
    else
      link.send_backward_recv_forward(model, n);
  }
  for (int i = 0; i < warmup; i++) {
    link.recv_backward(n);
    backward();
    link.send_backward(model, n);
  }
}

Losses stage_forward(Model& model, PipelineLink& link, const Batch& b, const LossWeights& w) {
  const size_t n = (size_t)b.B * b.T * model.config().hidden_size;
  link.recv_forward(n);
  const Losses l = model.forward(b, w, link.input());
  link.send_forward(model, n);
  return l;
}

}  // namespace moetron
