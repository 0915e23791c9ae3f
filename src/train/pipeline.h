// Pipeline parallelism (DESIGN §6): the point-to-point traffic between neighbouring stages and
// Megatron's 1F1B ("PipeDream-flush") schedule, written once for every backend.
#pragma once

#include <functional>
#include <vector>

#include "backend/backend.h"
#include "dist/comm.h"
#include "model/model.h"

namespace moetron {

// The point-to-point traffic of one pipeline stage with its neighbours in the pp group: hidden
// states [N,C] and the router statistics pooled so far ([E] assigned, [E] prob sums, tokens) go
// forward; the gradient of the hidden states [N,C] and the pooled aux loss's gradient per expert [E]
// go back.  Every transfer is a sendrecv, so in the 1F1B steady state, where neighbours exchange in
// opposite directions at once, neither waits for the other.  On a stage without that neighbour (or
// without pipeline parallelism) a call does nothing.  Hidden states live in the backend's memory
// and travel over `pp` (a group over that memory); the statistics over pp.host().
class PipelineLink {
 public:
  PipelineLink(Backend& be, dist::Comm& pp, int experts);

  // Receives the previous stage's output (the next forward's input); n floats.
  void recv_forward(size_t n);
  void send_forward(const Model& m, size_t n);
  // The forward's output to the next stage while its gradient for the oldest pending micro-batch
  // comes back.
  void send_forward_recv_backward(const Model& m, size_t n);
  // The backward's input gradient to the previous stage while the next forward's input arrives.
  void send_backward_recv_forward(const Model& m, size_t n);
  void recv_backward(size_t n);
  void send_backward(const Model& m, size_t n);

  StageInput input();
  StageGrad grad() const;

 private:
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  const std::vector<double>& pack(const Model& m);
  // Hidden states (n floats) and the statistics that go with them, each one sendrecv.
  void transfer(int to, const float* hidden, const double* stats, size_t stats_n, int from, GrowableBuffer& hidden_in,
                Tensor& hidden_view, std::vector<double>& stats_in, size_t n);

  Backend& be_;
  dist::Comm& pp_;
  int stage_, stages_, E_;
  GrowableBuffer hidden_buf_, grad_buf_;
  Tensor hidden_in_, grad_in_;
  std::vector<double> stats_in_, stats_out_, aux_in_;
  ops::RouterLayerStats pooled_in_;
};

// Stage `stage` of `stages` runs the step's micro-batches (all of one shape) in the 1F1B order:
// min(stages - stage - 1, m) warm-up forwards, then one forward and one backward at a time, then the
// remaining backwards; it keeps at most min(stages - stage, m) micro-batches' activations whatever
// m.  `account` sees each forward's losses.  Without pipeline parallelism: forward, backward, ...
void run_1f1b(Model& model, PipelineLink& link, const std::vector<Batch>& micro, const LossWeights& weights,
              int stage, int stages, const std::function<void(const Losses&)>& account);

// One forward (no backward) on this stage: the previous stage's output is received first, this
// stage's is sent on after.
Losses stage_forward(Model& model, PipelineLink& link, const Batch& batch, const LossWeights& weights);

}  // namespace moetron
