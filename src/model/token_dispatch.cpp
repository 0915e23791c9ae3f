// Token dispatch; see token_dispatch.h.
#include "model/token_dispatch.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/error.h"
#include "dist/comm.h"

namespace moetron {

long build_dispatch_plan(ops::MoePlan& plan, std::vector<float>& combine_w, const int32_t* topk_idx,
                         const float* topk_w, const float* probs, const uint8_t* token_mask, long N, int E, int K,
                         double capacity_factor) {
  if (capacity_factor <= 0) {
    ops::moe_plan_build(plan, topk_idx, N, E, K);
    plan.overflow = 0;
    combine_w.clear();
    return 0;
  }
  long real = 0;
  for (long n = 0; n < N; n++) real += token_mask == nullptr || token_mask[n];
  const long cap = (long)std::ceil(capacity_factor * (double)real * K / E);
  // Assignments per expert, best first: real tokens, then higher probability, then earlier.
  std::vector<std::vector<int64_t>> by_expert(E);
  for (long i = 0; i < N * K; i++) by_expert[topk_idx[i]].push_back(i);
  std::vector<int32_t> idx(topk_idx, topk_idx + N * K);
  combine_w.assign(topk_w, topk_w + N * K);
  long dropped = 0;
  for (int e = 0; e < E; e++) {
    std::vector<int64_t>& v = by_expert[e];
    if ((long)v.size() <= cap) continue;
    auto key = [&](int64_t i) {
      const long n = i / K;
      return std::tuple<int, float, int64_t>(token_mask == nullptr || token_mask[n] ? 0 : 1, -probs[n * E + e], i);
    };
    std::stable_sort(v.begin(), v.end(), [&](int64_t x, int64_t y) { return key(x) < key(y); });
    for (size_t j = (size_t)cap; j < v.size(); j++) {
      idx[v[j]] = E;  // the overflow expert
      combine_w[v[j]] = 0.0f;
      dropped += token_mask == nullptr || token_mask[v[j] / K];
    }
  }
  ops::moe_plan_build(plan, idx.data(), N, E + 1, K);
  plan.overflow = 1;
  return dropped;
}

namespace {

dist::CommDType comm_dtype_of(const Tensor& t) {
  if (t.store == Store::i32) return dist::CommDType::i32;
  if (t.store == Store::u8) return dist::CommDType::u8;
  return t.elem_bytes == 2 ? dist::CommDType::bf16 : dist::CommDType::f32;
}

class LocalDispatch final : public TokenDispatcher {
 public:
  LocalDispatch(Backend& be, int C, int I) : be_(be), C_(C), I_(I) {}
  void forward(DispatchSaved& s, Tensor yperm, Tensor xperm, const PlanView& plan, const ExpertFfnWeights& w,
               Profile* profile) override {
    ScopedTimer t(profile, "fwd.experts");
    ffn_.forward(be_, yperm, ExpertFfnSaved{s.h13, s.act, s.u13, s.u2}, xperm, plan, w, C_, I_);
  }
  void backward(Tensor dxperm, Tensor dyperm, DispatchSaved& s, Tensor xperm, const PlanView& plan,
                const ExpertFfnWeights& w, Profile* profile) override {
    ScopedTimer t(profile, "bwd.experts");
    ffn_.backward(be_, dxperm, dyperm, ExpertFfnSaved{s.h13, s.act, s.u13, s.u2, s.recompute_act}, xperm, plan, w, C_,
                  I_);
  }

 private:
  Backend& be_;
  int C_, I_;
  ExpertFfn ffn_;
};

// Ranks exchange per-(owner, local expert) row counts, then rows.  Received rows arrive in
// source-major order (source rank, then local expert); the local experts run in expert-major
// order (local expert, then source rank).
class AllToAllDispatch final : public TokenDispatcher {
 public:
  AllToAllDispatch(Backend& be, dist::Comm& ep, int C, int I, int E)
      : be_(be), ep_(ep), P_(ep.size()), El_(E / ep.size()), C_(C), I_(I) {
    MOETRON_ASSERT(E % ep.size() == 0);
  }

  void forward(DispatchSaved& s, Tensor yperm, Tensor xperm, const PlanView& plan, const ExpertFfnWeights& w,
               Profile* profile) override {
    profile_ = profile;  // for the exchange's sections
    exchange_counts(s, *plan.plan);
    const size_t Mr = s.local.row_token.size();
    const Store act = be_.act_store();
    s.rows = s.rows_buf.get(be_, act, Mr * C_, "expert-parallel rows");
    s.ep_h13 = s.h13_buf.get(be_, act, Mr * 2 * I_, "expert-parallel h13");
    s.ep_act = s.act_buf.get(be_, act, Mr * I_, "expert-parallel act");
    s.ep_u13 = !w.w13.lora.on() ? Tensor{} : s.u13_buf.get(be_, act, Mr * w.w13.lora.r, "expert-parallel LoRA u13");
    s.ep_u2 = !w.w2.lora.on() ? Tensor{} : s.u2_buf.get(be_, act, Mr * w.w2.lora.r, "expert-parallel LoRA u2");
    // Index arrays in backend memory: the two gathers and the local plan's identity rows.
    const Tensor idx = s.index_buf.get(be_, Store::i32, 4 * Mr, "expert-parallel indices");
    s.expert_major_idx = idx.part(0, Mr);
    s.source_major_idx = idx.part(Mr, Mr);
    s.local_rows = idx.part(2 * Mr, 2 * Mr);
    be_.upload(s.expert_major_idx, s.to_expert_major.data());
    be_.upload(s.source_major_idx, s.to_source_major.data());
    s.local_view = be_.upload_plan(s.local, s.local_rows.part(0, Mr), s.local_rows.part(Mr, Mr));
    to_owners(s.rows, xperm, s);
    Tensor y_local = y_buf_.get(be_, act, Mr * C_, "expert-parallel outputs");
    {
      ScopedTimer t(profile_, "fwd.experts");
      ffn_.forward(be_, y_local, ExpertFfnSaved{s.ep_h13, s.ep_act, s.ep_u13, s.ep_u2}, s.rows, s.local_view, w, C_,
                   I_);
    }
    to_home(yperm, y_local, s);
  }

  void backward(Tensor dxperm, Tensor dyperm, DispatchSaved& s, Tensor xperm, const PlanView& plan,
                const ExpertFfnWeights& w, Profile* profile) override {
    (void)xperm;
    (void)plan;
    profile_ = profile;
    const size_t Mr = s.local.row_token.size();
    const Store act = be_.act_store();
    Tensor dy = y_buf_.get(be_, act, Mr * C_, "expert-parallel output gradients");
    Tensor dx = dx_buf_.get(be_, act, Mr * C_, "expert-parallel input gradients");
    to_owners(dy, dyperm, s);
    {
      ScopedTimer t(profile_, "bwd.experts");
      ffn_.backward(be_, dx, dy, ExpertFfnSaved{s.ep_h13, s.ep_act, s.ep_u13, s.ep_u2}, s.rows, s.local_view, w, C_,
                    I_);
    }
    to_home(dxperm, dx, s);
  }

 private:
  // Rows per (owner rank, local expert) from the global plan, exchanged over the host group:
  // recv[s * El + j] rows arrive from rank s for local expert j.  Builds the local plan and the
  // reorderings between the arrival (source-major) and expert-major orders.
  void exchange_counts(DispatchSaved& s, const ops::MoePlan& plan) {
    ScopedTimer t(profile_, "ep.all_to_all");
    const int P = P_, El = El_;
    std::vector<int64_t> send(P * El), recv(P * El);
    for (int e = 0; e < P * El; e++) send[e] = plan.expert_offsets[e + 1] - plan.expert_offsets[e];
    const std::vector<size_t> per_peer(P, (size_t)El);
    ep_.host().all_to_all_v(recv.data(), per_peer, send.data(), per_peer, dist::CommDType::i64);
    s.send_rows.assign(P, 0);
    s.recv_rows.assign(P, 0);
    std::vector<int64_t> expert_rows(El, 0);
    for (int p = 0; p < P; p++)
      for (int j = 0; j < El; j++) {
        s.send_rows[p] += (size_t)send[p * El + j];
        s.recv_rows[p] += (size_t)recv[p * El + j];
        expert_rows[j] += recv[p * El + j];
      }
    int64_t Mr = 0;
    for (int j = 0; j < El; j++) Mr += expert_rows[j];
    // The local plan: experts in order, each over its rows from every source in rank order.
    ops::MoePlan& lp = s.local;
    lp.N = Mr;
    lp.E = El;
    lp.K = 1;
    lp.overflow = 0;
    lp.expert_offsets.assign(El + 1, 0);
    for (int j = 0; j < El; j++) lp.expert_offsets[j + 1] = lp.expert_offsets[j] + expert_rows[j];
    lp.row_token.resize(Mr);
    lp.row_of.resize(Mr);
    for (int64_t m = 0; m < Mr; m++) lp.row_token[m] = lp.row_of[m] = (int32_t)m;
    s.to_source_major.resize(Mr);
    s.to_expert_major.resize(Mr);
    std::vector<int64_t> cursor(lp.expert_offsets.begin(), lp.expert_offsets.end() - 1);
    int64_t i = 0;
    for (int src = 0; src < P; src++)
      for (int j = 0; j < El; j++)
        for (int64_t r = 0; r < recv[src * El + j]; r++) {
          const int64_t em = cursor[j]++;  // the expert-major row of arrival row i
          s.to_source_major[i] = (int32_t)em;
          s.to_expert_major[em] = (int32_t)i;
          i++;
        }
  }

  // Rows in global plan order (in[M,C]) to their experts' owners, into out_local[Mr,C] in
  // expert-major order.
  void to_owners(Tensor out_local, Tensor in, const DispatchSaved& s) {
    ScopedTimer t(profile_, "ep.all_to_all");
    const size_t Mr = s.local.row_token.size();
    std::vector<size_t> sc(P_), rc(P_);
    for (int p = 0; p < P_; p++) {
      sc[p] = s.send_rows[p] * C_;
      rc[p] = s.recv_rows[p] * C_;
    }
    Tensor buf = stage_buf_.get(be_, in.store, Mr * C_, "expert-parallel exchange");
    ep_.all_to_all_v(buf.data, rc, in.data, sc, comm_dtype_of(in));
    be_.gather_rows(out_local, buf, s.expert_major_idx, (long)Mr, C_);
  }

  // Rows in expert-major order (y_local[Mr,C]) back to their home ranks, into out[M,C] in global
  // plan order.
  void to_home(Tensor out, Tensor y_local, const DispatchSaved& s) {
    ScopedTimer t(profile_, "ep.all_to_all");
    const size_t Mr = s.local.row_token.size();
    Tensor buf = stage_buf_.get(be_, y_local.store, Mr * C_, "expert-parallel exchange");
    be_.gather_rows(buf, y_local, s.source_major_idx, (long)Mr, C_);
    std::vector<size_t> sc(P_), rc(P_);
    for (int p = 0; p < P_; p++) {
      sc[p] = s.recv_rows[p] * C_;
      rc[p] = s.send_rows[p] * C_;
    }
    ep_.all_to_all_v(out.data, rc, buf.data, sc, comm_dtype_of(out));
  }

  Profile* profile_ = nullptr;  // the current call's
  Backend& be_;
  dist::Comm& ep_;
  int P_, El_, C_, I_;
  // Scratch shared by every layer and micro-batch: the exchange's staging rows, the local
  // experts' outputs (forward) / output gradients (backward), and their input gradients.
  GrowableBuffer stage_buf_, y_buf_, dx_buf_;
  ExpertFfn ffn_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_local_dispatch(Backend& be, int C, int I) {
  return std::make_unique<LocalDispatch>(be, C, I);
}

std::unique_ptr<TokenDispatcher> make_all_to_all_dispatch(Backend& be, dist::Comm& ep, int C, int I, int E) {
  return std::make_unique<AllToAllDispatch>(be, ep, C, I, E);
}

}  // namespace moetron
