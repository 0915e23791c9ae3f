// One table of op cases for every backend (llama.cpp's test-backend-ops): each case runs an op --
// through the Backend interface (src/backend/backend.h), as the model calls it -- on
//   CpuBackend       against finite differences of its forward (the objective L = sum over the
//                    outputs of a fixed random cotangent times the output; tests/gradcheck.h);
//   Bf16CpuBackend   against the CPU within bf16 accuracy (5e-2 of each tensor's max: bf16 keeps 8
//                    bits per stored value; a wrong op misses by O(1));
//   CpuInferenceBackend  the forward ops against the CPU to fp32 rounding, in decode and prompt
//                    passes (the inference kernels);
//   CudaBackend      (with a GPU) against the CPU with the bf16 rule, the Bf16CpuBackend result
//                    being the naive implementation (tests/cuda_test_util.h); integer outputs
//                    exactly.
// Inputs in the act store are bf16 values, so every backend sees the same numbers.  The MoE cases
// cover an empty expert, skewed routing (every token on one expert), K = E and a capacity overflow
// expert; attention covers GQA, a sliding window, padding and packed segments, and attention over a
// KV cache (inference) a decode step and a prompt chunk under a sliding window.  On a GPU the unmasked
// attention cases run cuDNN's fused SDPA where it loads (cuda/attention_cudnn.h; the test prints which
// kernel ran), and every attention case runs again with the native kernel forced.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu.h"
#include "backend/cpu_bf16.h"
#include "backend/cpu_infer.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "cuda/backend.h"
#include "cuda_test_util.h"
#include "gradcheck.h"
#include "model/expert_ffn.h"
#include "ops/cross_entropy.h"
#include "ops/moe_dispatch.h"

namespace moetron {
namespace {

using testing::expect_gradient_close;
using testing::finite_difference;
using testing::random_vector;

// Named tensors of one case on one backend.  Float inputs are uploaded in their store ("act": the
// backend's act store); outputs are allocated by the case and read back as floats.
class Env {
 public:
  explicit Env(Backend& be) : be_(be) {}
  Backend& be() { return be_; }
  Tensor put(const std::string& name, const std::vector<float>& host, bool act) {
    const Tensor t = alloc(name, act ? be_.act_store() : Store::f32, host.size());
    if (t.elem_bytes == 2) {
      std::vector<uint16_t> h(host.size());
      for (size_t i = 0; i < h.size(); i++) h[i] = f32_to_bf16(host[i]);
      be_.upload(t, h.data());
    } else {
      be_.upload(t, host.data());
    }
    return t;
  }
  Tensor put_i32(const std::string& name, const std::vector<int32_t>& host) {
    const Tensor t = alloc(name, Store::i32, host.size());
    be_.upload(t, host.data());
    return t;
  }
  Tensor put_u8(const std::string& name, const std::vector<uint8_t>& host) {
    const Tensor t = alloc(name, Store::u8, host.size());
    be_.upload(t, host.data());
    return t;
  }
  // A zero-filled tensor.
  Tensor alloc(const std::string& name, Store s, size_t n) {
    allocs_.push_back(be_.allocate(std::max<size_t>(n, 1) * be_.element_bytes(s), name));
    const Tensor t = be_.view(allocs_.back()->data(), s, n);
    tensors_[name] = t;
    return t;
  }
  Tensor act(const std::string& name, size_t n) { return alloc(name, be_.act_store(), n); }
  Tensor f32(const std::string& name, size_t n) { return alloc(name, Store::f32, n); }
  Tensor operator[](const std::string& name) const { return tensors_.at(name); }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  std::vector<float> get(const std::string& name) {
    if (scalars_.count(name)) return scalars_[name];
    const Tensor t = tensors_.at(name);
    std::vector<float> out(t.numel);
    if (t.store == Store::i32) {
      std::vector<int32_t> h(t.numel);
      be_.download(h.data(), t);
      for (size_t i = 0; i < h.size(); i++) out[i] = (float)h[i];
    } else if (t.elem_bytes == 2) {
      std::vector<uint16_t> h(t.numel);
      be_.download(h.data(), t);
      for (size_t i = 0; i < h.size(); i++) out[i] = bf16_to_f32(h[i]);
    } else {
      be_.download(out.data(), t);
    }
    return out;
  }
  // A host-computed output (a loss).
  void set_scalar(const std::string& name, double v) { scalars_[name] = {(float)v}; }
  // Plans must outlive the views the backend made of them.
  ops::MoePlan& plan(const std::string& name) { return plans_[name]; }

 private:
  Backend& be_;
  std::vector<std::unique_ptr<Allocation>> allocs_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::vector<float>> scalars_;
  std::map<std::string, ops::MoePlan> plans_;
};

struct OpCase {
  std::string name;
  std::map<std::string, std::vector<float>> inputs;  // float inputs by name
  std::vector<std::string> act_inputs;               // those in the act store (bf16 values)
  std::vector<std::string> wrt;                      // inputs checked by finite differences
  std::vector<std::string> outputs;                  // compared across backends
  std::map<std::string, std::vector<float>> cot;     // output -> cotangent (the objective's weights)
  std::vector<std::string> cot_act;                  // cotangents the backward reads in the act store
  // Writes the outputs from the inputs (Env holds the inputs under their names).
  std::function<void(Env&)> forward;
  // Reads "d:<output>" cotangents, writes "g:<input>" gradients (of the objective).
  std::function<void(Env&)> backward;
  bool is_act(const std::string& n) const {
    return std::find(act_inputs.begin(), act_inputs.end(), n) != act_inputs.end();
  }
};

void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

float rb(float x) { return bf16_to_f32(f32_to_bf16(x)); }
std::vector<float> rnd(size_t n, uint32_t seed, float scale = 1.0f) { return random_vector(n, seed, scale); }
std::vector<float> rnd_bf16(size_t n, uint32_t seed, float scale = 1.0f) {
  std::vector<float> v = random_vector(n, seed, scale);
  for (float& x : v) x = rb(x);
  return v;
}

// The case's forward on `be` with `inputs`; the Env holds everything afterwards.
std::unique_ptr<Env> run_forward(Backend& be, const OpCase& c, const std::map<std::string, std::vector<float>>& in) {
  auto env = std::make_unique<Env>(be);
  for (const auto& [name, v] : in) env->put(name, v, c.is_act(name));
  c.forward(*env);
  return env;
}

double objective(const OpCase& c, Env& env) {
  double s = 0;
  for (const auto& [out, r] : c.cot) s += testing::weighted_sum(env.get(out), r);
  return s;
}

// Forward and backward: outputs and gradients by name.
std::map<std::string, std::vector<float>> run_case(Backend& be, const OpCase& c) {
  std::unique_ptr<Env> env = run_forward(be, c, c.inputs);
  std::map<std::string, std::vector<float>> r;
  for (const std::string& o : c.outputs) r[o] = env->get(o);
  if (c.backward) {
    for (const auto& [out, v] : c.cot)
      env->put("d:" + out, v, std::find(c.cot_act.begin(), c.cot_act.end(), out) != c.cot_act.end());
    c.backward(*env);
    for (const std::string& w : c.wrt) r["g:" + w] = env->get("g:" + w);
  }
  be.synchronize("op case");
  return r;
}

// ---- the cases -----------------------------------------------------------------------------------

OpCase rmsnorm_case() {
  const long N = 7;
  const int C = 48;
  OpCase c;
  c.name = "rmsnorm";
  c.inputs = {{"x", rnd(N * C, 1, 2.0f)}, {"w", rnd(C, 2, 0.2f)}};
  for (float& v : c.inputs["w"]) v += 1.0f;
  c.wrt = {"x", "w"};
  c.outputs = {"y", "rstd"};
  c.cot = {{"y", rnd(N * C, 3)}};
  c.forward = [=](Env& e) { e.be().rmsnorm_forward(e.act("y", N * C), e.f32("rstd", N), e["x"], e["w"], N, C, 1e-5f); };
  c.backward = [=](Env& e) {
    e.be().rmsnorm_backward(e.f32("g:x", N * C), e.f32("g:w", C), e["d:y"], e["x"], e["w"], e["rstd"], N, C, false);
  };
  return c;
}

OpCase matmul_case() {
  const int N = 9, IC = 24, OC = 40;
  OpCase c;
  c.name = "matmul";
  c.inputs = {{"x", rnd_bf16(N * IC, 1)}, {"W", rnd_bf16(OC * IC, 2, 0.3f)}};
  c.act_inputs = {"x", "W"};
  c.wrt = {"x", "W"};
  c.outputs = {"y"};
  c.cot = {{"y", rnd_bf16(N * OC, 3)}};
  c.cot_act = {"y"};
  c.forward = [=](Env& e) { e.be().matmul_forward(e.f32("y", N * OC), e["x"], e["W"], N, IC, OC, false); };
  c.backward = [=](Env& e) {
    e.be().matmul_backward(e.f32("g:x", N * IC), e.f32("g:W", OC * IC), e["d:y"], e["x"], e["W"], N, IC, OC, false);
  };
  return c;
}

// The strided block copy (latent attention's head slices): y[n, h, 0:5] = 1.5 x[n, h*7 + 2 : h*7 + 7]
// for 3 heads, and y[n, h, 5:9] = r[n] broadcast to every head; the backward is the transposed copy,
// whose broadcast side sums over the heads.
OpCase copy_block_case() {
  const long N = 6;
  const int H = 3, W = 7, D = 9, Rr = 4;
  OpCase c;
  c.name = "copy_block";
  c.inputs = {{"x", rnd_bf16(N * H * W, 1)}, {"r", rnd_bf16(N * Rr, 2)}};
  c.act_inputs = {"x", "r"};
  c.wrt = {"x", "r"};
  c.outputs = {"y"};
  c.cot = {{"y", rnd_bf16(N * H * D, 3)}};
  c.cot_act = {"y"};
  const ops::BlockCopy slice{N, H, 5, (long)H * D, D, 0, (long)H * W, W, 2};
  const ops::BlockCopy bcast{N, H, Rr, (long)H * D, D, 5, Rr, 0, 0};
  c.forward = [=](Env& e) {
    const Tensor y = e.act("y", N * H * D);
    e.be().fill_zero(y);
    e.be().copy_block(y, e["x"], slice, 1.5f, false);
    e.be().copy_block(y, e["r"], bcast, 1.0f, false);
  };
  c.backward = [=](Env& e) {
    const Tensor gx = e.act("g:x", N * H * W), gr = e.act("g:r", N * Rr);
    e.be().fill_zero(gx);
    e.be().fill_zero(gr);
    e.be().copy_block(gx, e["d:y"], slice.transposed(), 1.5f, true);
    e.be().copy_block(gr, e["d:y"], bcast.transposed(), 1.0f, true);
  };
  return c;
}

// spec: which dims of each head rotate and how (GLM's partial RoPE, DeepSeek's interleaved pairs at
// an offset, YaRN's frequencies and attention factor; ops/rope.h).
OpCase rope_case(const std::string& name = "rope", ops::RopeSpec spec = ops::RopeSpec{10000.0f}) {
  const long N = 12;
  const int H = 3, HD = 16;
  std::vector<int32_t> pos(N);
  for (long i = 0; i < N; i++) pos[i] = (int32_t)(i * 7 % 19);
  OpCase c;
  c.name = name;
  c.inputs = {{"x", rnd_bf16(N * H * HD, 1)}};
  c.act_inputs = {"x"};
  c.wrt = {"x"};
  c.outputs = {"y"};
  c.cot = {{"y", rnd_bf16(N * H * HD, 2)}};
  c.cot_act = {"y"};
  c.forward = [=](Env& e) {
    const Tensor y = e.act("y", N * H * HD);
    e.be().copy(y, e["x"]);
    e.be().rope_forward(y, e.put_i32("pos", pos), N, H, HD, spec);
  };
  c.backward = [=](Env& e) {
    const Tensor g = e.act("g:x", N * H * HD);
    e.be().copy(g, e["d:y"]);
    e.be().rope_backward(g, e["pos"], N, H, HD, spec);
  };
  return c;
}

// Attention of the last n rows of a sequence over its KV cache (inference: a decode step, a chunk of
// a prompt), forward only: the cache holds pos0 + n rows, the rows' own keys among them.
OpCase attention_kv_case(const std::string& name, int n, int pos0, int NH, int NKV, int HD, int window) {
  const size_t nq = (size_t)n * NH * HD, nk = (size_t)(pos0 + n) * NKV * HD;
  OpCase c;
  c.name = name;
  c.inputs = {{"q", rnd_bf16(nq, 5, 1.5f)}, {"k", rnd_bf16(nk, 6, 1.5f)}, {"v", rnd_bf16(nk, 7)}};
  c.act_inputs = {"q", "k", "v"};
  c.outputs = {"out"};
  c.forward = [=](Env& e) {
    const Backend::KvSeq seq{0, n, pos0, e["k"], e["v"]};
    e.be().attention_kv_forward(e.act("out", nq), e["q"], std::span(&seq, 1), window, NH, NKV, HD);
  };
  return c;
}

OpCase attention_case(const std::string& name, int B, int T, int NH, int NKV, int HD, int window, bool padding,
                      bool segments) {
  const size_t nq = (size_t)B * T * NH * HD, nk = (size_t)B * T * NKV * HD;
  std::vector<int32_t> amask, seg;
  if (padding) {
    amask.assign((size_t)B * T, 1);
    for (int t = T - T / 4; t < T; t++) amask[(size_t)(B - 1) * T + t] = 0;
  }
  if (segments) {
    seg.assign((size_t)B * T, 0);
    for (int b = 0; b < B; b++)
      for (int t = 0; t < T; t++) seg[(size_t)b * T + t] = t < T / 3 ? 0 : (t < 2 * T / 3 ? 1 : 2);
  }
  OpCase c;
  c.name = name;
  c.inputs = {{"q", rnd_bf16(nq, 1, 1.5f)}, {"k", rnd_bf16(nk, 2, 1.5f)}, {"v", rnd_bf16(nk, 3)}};
  c.act_inputs = {"q", "k", "v"};
  c.wrt = {"q", "k", "v"};
  c.outputs = {"out"};
  c.cot = {{"out", rnd_bf16(nq, 4)}};
  c.cot_act = {"out"};
  auto mask = [=](Env& e) {
    AttnMask m;
    if (padding) m.attention_mask = e.has("amask") ? e["amask"] : e.put_i32("amask", amask);
    if (segments) m.segment_ids = e.has("seg") ? e["seg"] : e.put_i32("seg", seg);
    m.sliding_window = window;
    return m;
  };
  c.forward = [=](Env& e) {
    Backend& be = e.be();
    be.attention_forward(e.act("out", nq), e.f32("saved", be.attention_saved_numel(B, T, NH)), e["q"], e["k"], e["v"],
                         mask(e), B, T, NH, NKV, HD);
  };
  c.backward = [=](Env& e) {
    e.be().attention_backward(e.act("g:q", nq), e.act("g:k", nk), e.act("g:v", nk), e["d:out"], e["out"], e["saved"],
                              e["q"], e["k"], e["v"], mask(e), B, T, NH, NKV, HD);
  };
  return c;
}

// The router: probabilities and renormalised top-K weights, with the aux-loss gradient per expert
// on the probabilities of real tokens (the objective's probs cotangent is that gradient, masked).
// renormalize false: the top-K weights are the probabilities (Qwen3-MoE's norm_topk_prob false).
// Sigmoid (DeepSeek-V3 / GLM-4.5, ops/router.h): grouped selection by score + bias, weights scaled;
// the selection bias is an input that is not differentiated.
OpCase router_case(const std::string& name, const ops::RouterSpec& spec, int E, int K) {
  const long N = 16;
  std::vector<uint8_t> mask(N, 1);
  mask[N - 1] = mask[N - 2] = 0;
  std::vector<double> daux(E);
  for (int e = 0; e < E; e++) daux[e] = 0.1 * (e - 3.5);
  std::vector<float> cot_probs((size_t)N * E, 0.0f);
  for (long n = 0; n < N; n++)
    for (int e = 0; e < E; e++) cot_probs[n * E + e] = mask[n] ? (float)daux[e] : 0.0f;
  OpCase c;
  c.name = name;
  // Logits spread apart so the top-K choice (and the groups') does not flip under a finite-difference step.
  std::vector<float> logits((size_t)N * E), bias(E);
  for (long n = 0; n < N; n++)
    for (int e = 0; e < E; e++)
      logits[n * E + e] = 0.5f * (float)((e * 5 + n * 3) % E) + 0.02f * (float)(mix64(n * E + e) % 5);
  for (int e = 0; e < E; e++) bias[e] = 0.05f * (float)((e * 3) % 4);  // shifts choices, kept out of ties
  c.inputs = {{"logits", logits}};
  if (spec.sigmoid) c.inputs["bias"] = bias;
  c.wrt = {"logits"};
  c.outputs = {"probs", "w", "idx"};
  c.cot = {{"w", rnd(N * K, 2)}, {"probs", cot_probs}};
  c.forward = [=](Env& e) {
    e.be().router_forward(e.f32("probs", N * E), e.alloc("idx", Store::i32, N * K), e.f32("w", N * K), e["logits"],
                          spec.sigmoid ? e["bias"] : Tensor{}, N, E, K, spec);
  };
  c.backward = [=](Env& e) {
    e.be().router_backward(e.f32("g:logits", N * E), e["d:w"], daux.data(), e.put_u8("mask", mask), e["probs"],
                           e["idx"], e["w"], N, E, K, spec);
  };
  return c;
}

ops::RouterSpec sigmoid_spec(bool renormalize, int n_group, int topk_group, float scale) {
  ops::RouterSpec s;
  s.sigmoid = true;
  s.renormalize = renormalize;
  s.n_group = n_group;
  s.topk_group = topk_group;
  s.scale = scale;
  return s;
}

// The router z-loss: z = mean over real tokens of logsumexp(logits)^2 from the layer statistics.
OpCase z_loss_case() {
  const long N = 10;
  const int E = 6, K = 2;
  std::vector<uint8_t> mask(N, 1);
  mask[3] = 0;
  OpCase c;
  c.name = "router_z_loss";
  c.inputs = {{"logits", rnd(N * E, 1, 2.0f)}};
  c.wrt = {"logits"};
  c.outputs = {"z"};
  c.cot = {{"z", {1.0f}}};
  c.forward = [=](Env& e) {
    Backend& be = e.be();
    const Tensor probs = e.f32("probs", N * E), idx = e.alloc("idx", Store::i32, N * K), w = e.f32("w", N * K);
    be.router_forward(probs, idx, w, e["logits"], Tensor{}, N, E, K, ops::RouterSpec{});
    ops::RouterLayerStats st;
    be.router_layer_stats(st, e["logits"], probs, idx, e.put_u8("mask", mask), N, E, K);
    e.set_scalar("z", ops::router_z_loss_layer(st));
  };
  c.backward = [=](Env& e) {
    const Tensor g = e.f32("g:logits", N * E);
    e.be().router_z_loss_backward(g, e["logits"], e["probs"], e["mask"], N, E, 1.0f, N - 1);
  };
  return c;
}

// DeepSeek-V3's sequence-wise balance loss (ops/router.h) of sigmoid scores: its value from the row
// statistics (host), its gradient through the normalised scores (rows of 5 tokens, one padding).
OpCase sequence_loss_case() {
  const long N = 10;
  const int E = 6, K = 2, row = 5;
  std::vector<uint8_t> mask(N, 1);
  mask[7] = 0;
  ops::RouterSpec spec;
  spec.sigmoid = true;
  auto grad = std::make_shared<std::vector<float>>();
  OpCase c;
  c.name = "router_sequence_loss";
  std::vector<float> logits((size_t)N * E);
  for (long n = 0; n < N; n++)
    for (int e = 0; e < E; e++) logits[n * E + e] = 0.4f * (float)((e * 5 + n * 3) % E) - 1.0f;
  c.inputs = {{"logits", logits}};
  c.wrt = {"logits"};
  c.outputs = {"aux"};
  c.cot = {{"aux", {1.0f}}};
  c.forward = [=](Env& e) {
    Backend& be = e.be();
    const Tensor probs = e.f32("probs", N * E), idx = e.alloc("idx", Store::i32, N * K), w = e.f32("w", N * K);
    be.router_forward(probs, idx, w, e["logits"], Tensor{}, N, E, K, spec);
    ops::RouterLayerStats st;
    be.router_row_stats(st, probs, idx, e.put_u8("mask", mask), N, E, K, row, true);
    std::vector<double> g;
    e.set_scalar("aux", ops::sequence_balance_loss(st, E, K, &g));
    grad->assign(g.begin(), g.end());
  };
  c.backward = [=](Env& e) {
    const Tensor g = e.f32("g:logits", N * E), rg = e.f32("row_grad", (long)grad->size());
    e.be().fill_zero(g);
    e.be().upload(rg, grad->data());
    e.be().router_sequence_backward(g, rg, e["mask"], e["probs"], N, E, row, true, 1.0f);
  };
  return c;
}

// Permute into plan order and combine back, for a plan built from fixed top-K choices.
OpCase permute_combine_case(const std::string& name, std::vector<int32_t> topk, long N, int E, int K) {
  const int C = 20;
  const long M = N * K;
  OpCase c;
  c.name = name;
  c.inputs = {{"x", rnd_bf16(N * C, 1)}, {"yperm", rnd_bf16(M * C, 2)}, {"w", rnd(N * K, 3, 0.5f)}};
  c.act_inputs = {"x", "yperm"};
  c.wrt = {"x", "yperm", "w"};
  c.outputs = {"xperm", "out"};
  c.cot = {{"xperm", rnd_bf16(M * C, 4)}, {"out", rnd(N * C, 5)}};
  c.cot_act = {"xperm"};
  auto view = [=](Env& e) {
    ops::MoePlan& p = e.plan("plan");
    if (p.expert_offsets.empty()) ops::moe_plan_build(p, topk.data(), N, E, K);
    return e.be().upload_plan(p, e.has("rt") ? e["rt"] : e.alloc("rt", Store::i32, M),
                              e.has("ro") ? e["ro"] : e.alloc("ro", Store::i32, M));
  };
  c.forward = [=](Env& e) {
    const PlanView pv = view(e);
    e.be().moe_permute_forward(e.act("xperm", M * C), e["x"], pv, C);
    e.be().moe_combine_forward(e.f32("out", N * C), e["yperm"], e["w"], pv, C);
  };
  c.backward = [=](Env& e) {
    const PlanView pv = view(e);
    e.be().moe_permute_backward(e.f32("g:x", N * C), e["d:xperm"], pv, C);
    e.be().moe_combine_backward(e.act("g:yperm", M * C), e.f32("g:w", N * K), e["d:out"], e["yperm"], e["w"], pv, C);
  };
  return c;
}

// The grouped expert FFN over a plan from fixed top-K choices; overflow: the last expert collects
// assignments a capacity limit dropped and is never computed (their rows stay zero).
// The plan of `topk` [N,K] over E experts (the last one the overflow expert when `overflow`), built
// once per Env, and its view in the Env's backend.
PlanView plan_view(Env& e, const std::vector<int32_t>& topk, long N, int E, int K, bool overflow) {
  const long M = N * K;
  ops::MoePlan& p = e.plan("plan");
  if (p.expert_offsets.empty()) {
    ops::moe_plan_build(p, topk.data(), N, E, K);
    p.overflow = overflow ? 1 : 0;
  }
  return e.be().upload_plan(p, e.has("rt") ? e["rt"] : e.alloc("rt", Store::i32, M),
                            e.has("ro") ? e["ro"] : e.alloc("ro", Store::i32, M));
}

// C and I multiples of 8 (the default): on an H100 the experts run as CUTLASS grouped GEMMs
// (cuda/grouped_gemm.h); otherwise the per-expert cuBLASLt loop.
OpCase experts_case(const std::string& name, std::vector<int32_t> topk, long N, int E, int K, bool overflow,
                    int C = 16, int I = 24) {
  const long M = N * K;
  const int Ew = E - (overflow ? 1 : 0);  // experts with weights
  OpCase c;
  c.name = name;
  c.inputs = {{"xperm", rnd_bf16(M * C, 1)},
              {"w13", rnd_bf16((size_t)Ew * 2 * I * C, 2, 0.3f)},
              {"w2", rnd_bf16((size_t)Ew * C * I, 3, 0.3f)}};
  c.act_inputs = {"xperm", "w13", "w2"};
  c.wrt = {"xperm", "w13", "w2"};
  c.outputs = {"y"};
  c.cot = {{"y", rnd_bf16(M * C, 4)}};
  c.cot_act = {"y"};
  auto view = [=](Env& e) { return plan_view(e, topk, N, E, K, overflow); };
  c.forward = [=](Env& e) {
    e.be().moe_experts_forward(e.act("y", M * C), e.act("h13", M * 2 * I), e.act("act", M * I), e["xperm"], e["w13"],
                               e["w2"], view(e), C, I);
  };
  c.backward = [=](Env& e) {
    e.be().moe_experts_backward(e.act("g:xperm", M * C), e.f32("g:w13", (size_t)Ew * 2 * I * C),
                                e.f32("g:w2", (size_t)Ew * C * I), e["d:y"], e["h13"], e["act"], e["xperm"], e["w13"],
                                e["w2"], view(e), C, I);
  };
  return c;
}

// The grouped linear: y (act store, accumulated onto its input) += alpha * x @ W[e]^T per expert.
// OC 20 (the default) is not a multiple of 8: the per-expert path; OC 24: the grouped GEMM on an H100.
OpCase grouped_matmul_case(const std::string& name, std::vector<int32_t> topk, long N, int E, int K, bool overflow,
                           int OC = 20) {
  const int IC = 16;
  const float alpha = 1.75f;
  const long M = N * K;
  const int Ew = E - (overflow ? 1 : 0);
  OpCase c;
  c.name = name;
  c.inputs = {{"x", rnd_bf16(M * IC, 1)}, {"W", rnd_bf16((size_t)Ew * OC * IC, 2, 0.3f)}, {"y", rnd_bf16(M * OC, 5)}};
  c.act_inputs = {"x", "W", "y"};
  c.wrt = {"x", "W"};
  c.outputs = {"y"};
  c.cot = {{"y", rnd_bf16(M * OC, 4)}};
  c.cot_act = {"y"};
  auto view = [=](Env& e) { return plan_view(e, topk, N, E, K, overflow); };
  c.forward = [=](Env& e) { e.be().grouped_matmul_forward(e["y"], e["x"], e["W"], view(e), IC, OC, alpha, true); };
  c.backward = [=](Env& e) {
    // The overflow rows get no gradient: zero them first so the comparison sees a defined value.
    const Tensor gx = e.act("g:x", M * IC);
    e.be().fill_zero(gx);
    e.be().grouped_matmul_backward(gx, e.f32("g:W", (size_t)Ew * OC * IC), e["d:y"], e["x"], e["W"], view(e), IC, OC,
                                   alpha, false);
  };
  return c;
}

// The expert FFN in pieces with LoRA on gate_up and down over a frozen base (model/expert_ffn.h):
// grouped linears and SwiGLU, the gradients of the input and of the four factors.
OpCase expert_ffn_lora_case(const std::string& name, std::vector<int32_t> topk, long N, int E, int K, bool overflow) {
  const int C = 16, I = 12, r = 3;
  const float scale = 1.5f;
  const long M = N * K;
  const int Ew = E - (overflow ? 1 : 0);
  OpCase c;
  c.name = name;
  c.inputs = {{"x", rnd_bf16(M * C, 1)},
              {"w13", rnd_bf16((size_t)Ew * 2 * I * C, 2, 0.3f)},
              {"w2", rnd_bf16((size_t)Ew * C * I, 3, 0.3f)},
              {"a13", rnd_bf16((size_t)Ew * r * C, 6, 0.3f)},
              {"b13", rnd_bf16((size_t)Ew * 2 * I * r, 7, 0.3f)},
              {"a2", rnd_bf16((size_t)Ew * r * I, 8, 0.3f)},
              {"b2", rnd_bf16((size_t)Ew * C * r, 9, 0.3f)}};
  c.act_inputs = {"x", "w13", "w2", "a13", "b13", "a2", "b2"};
  c.wrt = {"x", "a13", "b13", "a2", "b2"};
  c.outputs = {"y"};
  c.cot = {{"y", rnd_bf16(M * C, 4)}};
  c.cot_act = {"y"};
  auto view = [=](Env& e) { return plan_view(e, topk, N, E, K, overflow); };
  auto weights = [=](Env& e, bool grads) {
    ExpertFfnWeights w;
    w.w13.w = e["w13"];
    w.w2.w = e["w2"];
    w.w13.lora = LoraFactors{e["a13"], e["b13"], {}, {}, r, scale};
    w.w2.lora = LoraFactors{e["a2"], e["b2"], {}, {}, r, scale};
    if (grads) {
      w.w13.lora.da = e.f32("g:a13", (size_t)Ew * r * C);
      w.w13.lora.db = e.f32("g:b13", (size_t)Ew * 2 * I * r);
      w.w2.lora.da = e.f32("g:a2", (size_t)Ew * r * I);
      w.w2.lora.db = e.f32("g:b2", (size_t)Ew * C * r);
    }
    return w;
  };
  auto saved = [=](Env& e) {
    return ExpertFfnSaved{e.has("h13") ? e["h13"] : e.act("h13", M * 2 * I),
                          e.has("act") ? e["act"] : e.act("act", M * I), e.has("u13") ? e["u13"] : e.act("u13", M * r),
                          e.has("u2") ? e["u2"] : e.act("u2", M * r)};
  };
  c.forward = [=](Env& e) {
    const Tensor y = e.act("y", M * C);
    e.be().fill_zero(y);  // the overflow rows are not computed
    ExpertFfn ffn;
    ffn.forward(e.be(), y, saved(e), e["x"], view(e), weights(e, false), C, I);
  };
  c.backward = [=](Env& e) {
    const Tensor gx = e.act("g:x", M * C);
    e.be().fill_zero(gx);
    ExpertFfn ffn;
    ffn.backward(e.be(), gx, e["d:y"], saved(e), e["x"], view(e), weights(e, true), C, I);
  };
  return c;
}

// The head and the cross-entropy: logits = lnf @ head^T, loss = scale * sum CE, with ignored rows.
OpCase head_case() {
  const long N = 10;
  const int C = 24, V = 50;
  std::vector<int32_t> targets(N);
  for (long n = 0; n < N; n++) targets[n] = (int32_t)(mix64(n) % V);
  targets[2] = ops::IGNORE_INDEX;
  OpCase c;
  c.name = "head_cross_entropy";
  c.inputs = {{"lnf", rnd_bf16(N * C, 1)}, {"head", rnd_bf16((size_t)V * C, 2, 0.5f)}};
  c.act_inputs = {"lnf", "head"};
  c.wrt = {"lnf", "head"};
  c.outputs = {"logits", "loss"};
  c.cot = {{"loss", {1.0f}}};
  const float scale = 1.0f / (N - 1);
  c.forward = [=](Env& e) {
    Backend& be = e.be();
    const Tensor logits = e.f32("logits", N * V), lse = e.f32("lse", N);
    be.matmul_forward(logits, e["lnf"], e["head"], (int)N, C, V, false);
    const double loss = be.cross_entropy_forward(lse, logits, e.put_i32("targets", targets), N, V, 0, scale, nullptr);
    e.set_scalar("loss", loss);
  };
  c.backward = [=](Env& e) {
    e.be().head_backward(e.f32("g:lnf", N * C), e.f32("g:head", (size_t)V * C), e["logits"], e["lse"], e["targets"],
                         e["lnf"], e["head"], N, C, V, 0, scale, true);
  };
  return c;
}

// The norm over rows split across ranks (OLMoE's q/k norms under tp), on one rank holding it all:
// ss = row_dot(x, x), y = rmsnorm_forward_stats(x, ss); dot = row_dot(dy, x, w), backward_stats.
// (The split itself -- partial sums all-reduced, replicas' 1/rep -- is tests/test_dist_train.cpp's.)
OpCase rmsnorm_stats_case() {
  const long N = 6;
  const int C = 40;
  OpCase c;
  c.name = "rmsnorm_stats";
  c.inputs = {{"x", rnd(N * C, 1, 2.0f)}, {"w", rnd(C, 2, 0.2f)}};
  for (float& v : c.inputs["w"]) v += 1.0f;
  c.wrt = {"x", "w"};
  c.outputs = {"y", "rstd", "ss"};
  c.cot = {{"y", rnd(N * C, 3)}};
  c.forward = [=](Env& e) {
    const Tensor ss = e.f32("ss", N);
    e.be().row_dot(ss, e["x"], e["x"], Tensor{}, N, C);
    e.be().rmsnorm_forward_stats(e.act("y", N * C), e.f32("rstd", N), e["x"], e["w"], ss, N, C, C, 1.0f, 1e-5f);
  };
  c.backward = [=](Env& e) {
    const Tensor dot = e.f32("dot", N);
    e.be().row_dot(dot, e["d:y"], e["x"], e["w"], N, C);
    e.be().rmsnorm_backward_stats(e.f32("g:x", N * C), e.f32("g:w", C), e["d:y"], e["x"], e["w"], e["rstd"], dot, N, C,
                                  C, 1.0f);
  };
  return c;
}

// A projection bias (Qwen2-MoE's q/k/v): y = x + bias per row; the bias gradient is the column sum.
OpCase bias_case() {
  const long N = 13;
  const int C = 20;
  OpCase c;
  c.name = "bias";
  c.inputs = {{"x", rnd(N * C, 1)}, {"b", rnd(C, 2)}};
  c.wrt = {"x", "b"};
  c.outputs = {"y"};
  c.cot = {{"y", rnd(N * C, 3)}};
  c.forward = [=](Env& e) {
    const Tensor y = e.f32("y", N * C);
    e.be().copy(y, e["x"]);
    e.be().add_bias_rows(y, e["b"], N, C);
  };
  c.backward = [=](Env& e) {
    e.be().copy(e.f32("g:x", N * C), e["d:y"]);
    e.be().bias_backward(e.f32("g:b", C), e["d:y"], N, C);
  };
  return c;
}

// The shared-expert gate's sigmoid, over values far into both tails.
OpCase sigmoid_case() {
  const long n = 17;
  OpCase c;
  c.name = "sigmoid";
  c.inputs = {{"x", rnd(n, 1, 6.0f)}};
  c.wrt = {"x"};
  c.outputs = {"s"};
  c.cot = {{"s", rnd(n, 2)}};
  c.forward = [=](Env& e) { e.be().sigmoid_forward(e.f32("s", n), e["x"], n); };
  c.backward = [=](Env& e) { e.be().sigmoid_backward(e.f32("g:x", n), e["d:s"], e["s"], n); };
  return c;
}

// OLMoE's clip_qkv: values clamped to [-1.5, 1.5] with the gradient zero where clipped; no value
// within 0.1 of a bound, so a finite-difference step never crosses one.
OpCase clamp_case() {
  const long n = 40;
  const float c = 1.5f;
  std::vector<float> x = rnd_bf16(n, 1, 3.0f);
  for (float& v : x)
    if (std::fabs(std::fabs(v) - c) < 0.1f) v = rb(v > 0 ? c + 0.5f : -c - 0.5f);
  OpCase k;
  k.name = "clamp";
  k.inputs = {{"x", x}};
  k.act_inputs = {"x"};
  k.wrt = {"x"};
  k.outputs = {"y"};
  k.cot = {{"y", rnd_bf16(n, 2)}};
  k.cot_act = {"y"};
  k.forward = [=](Env& e) {
    const Tensor y = e.act("y", n);
    e.be().copy(y, e["x"]);
    e.be().clamp_forward(y, e.alloc("mask", Store::u8, n), c, n);
  };
  k.backward = [=](Env& e) {
    const Tensor g = e.act("g:x", n);
    e.be().copy(g, e["d:y"]);
    e.be().clamp_backward(g, e["mask"], n);
  };
  return k;
}

OpCase embedding_case() {
  const long N = 30;
  const int C = 12, V = 9;
  std::vector<int32_t> tokens(N);
  for (long n = 0; n < N; n++) tokens[n] = (int32_t)(mix64(n) % 4) * 2;  // repeats, and unused rows
  OpCase c;
  c.name = "embedding";
  c.inputs = {{"wte", rnd((size_t)V * C, 1)}};
  c.wrt = {"wte"};
  c.outputs = {"out"};
  c.cot = {{"out", rnd(N * C, 2)}};
  c.forward = [=](Env& e) {
    e.be().embedding_forward(e.f32("out", N * C), e.put_i32("tokens", tokens), e["wte"], N, C, 0, V, true);
  };
  c.backward = [=](Env& e) {
    e.be().embedding_backward(e.f32("g:wte", (size_t)V * C), e["d:out"], e["tokens"], N, C, 0, V, true);
  };
  return c;
}

std::vector<int32_t> routed(long N, int K, const std::function<int(long, int)>& f) {
  std::vector<int32_t> t(N * K);
  for (long n = 0; n < N; n++)
    for (int k = 0; k < K; k++) t[n * K + k] = f(n, k);
  return t;
}

std::vector<OpCase> all_cases() {
  const long N = 12;
  std::vector<OpCase> cases = {rmsnorm_case(), matmul_case(),        rope_case(),  z_loss_case(),
                               bias_case(),    sigmoid_case(),       clamp_case(), rmsnorm_stats_case(),
                               head_case(),    embedding_case()};
  {
    ops::RopeSpec partial{10000.0f};  // GLM-4.5: the first half of each head rotates
    partial.rotary_dim = 8;
    cases.push_back(rope_case("rope_partial", partial));
    ops::RopeSpec mla = partial;  // DeepSeek-V3: the last dims of each head, interleaved pairs, YaRN
    mla.offset = 6;
    mla.interleaved = true;
    mla.yarn = true;
    mla.yarn_factor = 4.0f;
    mla.yarn_low = 1.0f;
    mla.yarn_high = 3.0f;
    mla.attention_factor = 1.1f;
    cases.push_back(rope_case("rope_interleaved_yarn", mla));
  }
  cases.push_back(copy_block_case());
  cases.push_back(sequence_loss_case());
  cases.push_back(router_case("router", ops::RouterSpec::softmax(true), 8, 2));
  cases.push_back(router_case("router_no_renormalize", ops::RouterSpec::softmax(false), 8, 2));
  // DeepSeek-V3's rule: 4 groups of 2, the 2 best searched, K = 3, weights renormalised x 2.5.
  cases.push_back(router_case("router_sigmoid_groups", sigmoid_spec(true, 4, 2, 2.5f), 8, 3));
  // GLM-4.5-Air's: one group, weights not renormalised, x 1.5.
  cases.push_back(router_case("router_sigmoid_plain", sigmoid_spec(false, 1, 1, 1.5f), 8, 2));
  cases.push_back(attention_case("attention_gqa", 2, 17, 4, 2, 8, 0, false, false));
  // Unmasked with a sliding window: on a GPU with cuDNN, the fused SDPA path (attention_cudnn.h).
  cases.push_back(attention_case("attention_gqa_window", 2, 24, 4, 2, 16, 7, false, false));
  cases.push_back(attention_case("attention_window_padding", 2, 21, 4, 1, 16, 5, true, false));
  cases.push_back(attention_case("attention_segments", 1, 24, 2, 2, 8, 0, false, true));
  cases.push_back(attention_kv_case("attention_kv_decode", 1, 40, 4, 2, 8, 0));
  cases.push_back(attention_kv_case("attention_kv_chunk_window", 6, 13, 4, 1, 16, 5));
  // MoE routing: balanced; expert 2 empty; every token on expert 0 (skewed); K = E.
  const int E = 4;
  const auto balanced = routed(N, 2, [](long n, int k) { return (int)((n + 2 * k) % 4); });
  const auto empty2 = routed(N, 2, [](long n, int k) { return k == 0 ? (int)(n % 2) : 3; });
  const auto skewed = routed(N, 1, [](long, int) { return 0; });
  const auto k_eq_e = routed(N, E, [](long n, int k) { return (int)((n + k) % 4); });
  cases.push_back(permute_combine_case("permute_combine", balanced, N, E, 2));
  cases.push_back(permute_combine_case("permute_combine_k_eq_e", k_eq_e, N, E, E));
  cases.push_back(experts_case("experts_balanced", balanced, N, E, 2, false));
  cases.push_back(experts_case("experts_balanced_unaligned", balanced, N, E, 2, false, 12, 20));
  cases.push_back(experts_case("experts_empty_expert", empty2, N, E, 2, false));
  cases.push_back(experts_case("experts_skewed", skewed, N, E, 1, false));
  cases.push_back(experts_case("experts_k_eq_e", k_eq_e, N, E, E, false));
  // Capacity drops: a fifth expert collects a third of the assignments and is not computed.
  const auto dropped = routed(N, 2, [](long n, int k) { return (n + k) % 3 == 0 ? 4 : (int)((n + k) % 4); });
  cases.push_back(experts_case("experts_capacity_overflow", dropped, N, E + 1, 2, true));
  cases.push_back(grouped_matmul_case("grouped_matmul", balanced, N, E, 2, false));
  cases.push_back(grouped_matmul_case("grouped_matmul_aligned", balanced, N, E, 2, false, 24));
  cases.push_back(grouped_matmul_case("grouped_matmul_empty_expert", empty2, N, E, 2, false));
  cases.push_back(grouped_matmul_case("grouped_matmul_capacity_overflow", dropped, N, E + 1, 2, true));
  cases.push_back(expert_ffn_lora_case("expert_ffn_lora", balanced, N, E, 2, false));
  cases.push_back(expert_ffn_lora_case("expert_ffn_lora_capacity_overflow", dropped, N, E + 1, 2, true));
  return cases;
}

class BackendOps : public ::testing::TestWithParam<OpCase> {};

TEST_P(BackendOps, CpuBackwardMatchesFiniteDifferences) {
  const OpCase& c = GetParam();
  CpuBackend be;
  const auto r = run_case(be, c);
  for (const std::string& w : c.wrt) {
    std::map<std::string, std::vector<float>> in = c.inputs;
    std::vector<float>& x = in[w];
    const auto res = finite_difference(x, r.at("g:" + w), [&] {
      std::unique_ptr<Env> env = run_forward(be, c, in);
      return objective(c, *env);
    });
    expect_gradient_close(res, (c.name + " d/d" + w).c_str());
  }
}

// Every machine: the naive bf16 backend stays within bf16 accuracy of fp32 on the same inputs.
TEST_P(BackendOps, Bf16CpuWithinBf16AccuracyOfTheCpu) {
  const OpCase& c = GetParam();
  CpuBackend cpu;
  Bf16CpuBackend bf16;
  const auto ref = run_case(cpu, c), got = run_case(bf16, c);
  for (const auto& [name, v] : ref) {
    if (name == "idx") {
      EXPECT_EQ(got.at(name), v) << c.name << " " << name;
      continue;
    }
    testing::expect_close(got.at(name), v, 5e-2, 1e-6, c.name + " " + name);
  }
}

// Every machine: the CPU inference backend's forward ops (the inference kernels: matrix-vector tasks in
// decode passes, the prefill GEMM in prompt passes, the fused experts, attention over a cache) give the
// CPU backend's outputs to fp32 rounding (1e-5 of each tensor's max: the same fp32 arithmetic summed
// in another order; a wrong row, expert or mask misses by O(1)).  Integer outputs exactly.
TEST_P(BackendOps, CpuInferenceForwardMatchesTheCpu) {
  const OpCase& c = GetParam();
  CpuBackend cpu;
  const std::unique_ptr<Env> ref = run_forward(cpu, c, c.inputs);
  for (const bool decode : {true, false}) {
    CpuInferenceBackend infer;
    infer.begin_inference_pass(decode, 16);
    const std::unique_ptr<Env> got = run_forward(infer, c, c.inputs);
    infer.end_inference_pass();
    for (const std::string& o : c.outputs) {
      const std::string what = c.name + " " + o + (decode ? " (decode)" : " (prompt)");
      if (o == "idx")
        EXPECT_EQ(got->get(o), ref->get(o)) << what;
      else
        testing::expect_close(got->get(o), ref->get(o), 1e-5, 1e-6, what);
    }
  }
}

TEST_P(BackendOps, CudaMeetsTheBf16Rule) {
  MOETRON_REQUIRE_GPU();
  const OpCase& c = GetParam();
  CpuBackend cpu;
  Bf16CpuBackend naive;
  gpu::CudaBackend cuda;
  const auto ref = run_case(cpu, c), nv = run_case(naive, c), got = run_case(cuda, c);
  if (c.name.rfind("attention_", 0) == 0) std::printf("%s: %s attention\n", c.name.c_str(), cuda.last_attention());
  for (const auto& [name, v] : ref) {
    if (name == "idx") {
      EXPECT_EQ(got.at(name), v) << c.name << " " << name;
      continue;
    }
    testing::expect_bf16_rule(got.at(name), nv.at(name), v, c.name + " " + name);
  }
}

// The attention cases again with the native kernel forced: where cuDNN serves the case above (an
// unmasked one), this keeps the native kernel -- the fallback for masks and segments -- under the rule.
TEST_P(BackendOps, CudaNativeAttentionMeetsTheBf16Rule) {
  MOETRON_REQUIRE_GPU();
  const OpCase& c = GetParam();
  if (c.name.rfind("attention_", 0) != 0 || c.name.rfind("attention_kv", 0) == 0) GTEST_SKIP() << "not attention";
  CpuBackend cpu;
  Bf16CpuBackend naive;
  gpu::CudaBackend cuda;
  cuda.set_attention_impl(gpu::CudaBackend::AttentionImpl::native);
  const auto ref = run_case(cpu, c), nv = run_case(naive, c), got = run_case(cuda, c);
  EXPECT_STREQ(cuda.last_attention(), "native");
  for (const auto& [name, v] : ref) testing::expect_bf16_rule(got.at(name), nv.at(name), v, c.name + " " + name);
}

INSTANTIATE_TEST_SUITE_P(Table, BackendOps, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) { return info.param.name; });

// The CPU-only data-movement and optimizer ops against direct host computations (the CUDA side of
// these is compared with the CPU below).
TEST(BackendOpsExact, GatherSumOfSquaresAdamWAndInitAgreeAcrossBackends) {
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(std::make_unique<CpuBackend>());
  if (gpu::cuda_unavailable_reason().empty()) backends.push_back(std::make_unique<gpu::CudaBackend>());
  const int C = 10;
  const long rows = 7;
  const std::vector<float> in = rnd(rows * C, 1), p = rnd(40000, 2), g = rnd(40000, 3);
  const std::vector<int32_t> index = {6, 0, 3, 3, 1, 5, 2};
  const std::vector<std::pair<size_t, size_t>> counted = {{0, 100}, {16000, 17000}, {20000, 40000}};
  std::vector<float> first_p;
  double first_ss = 0;
  for (auto& be : backends) {
    SCOPED_TRACE(be->name());
    Env e(*be);
    const Tensor out = e.f32("out", rows * C);
    be->gather_rows(out, e.put("in", in, false), e.put_i32("index", index), rows, C);
    const std::vector<float> got = e.get("out");
    for (long m = 0; m < rows; m++)
      for (int j = 0; j < C; j++) EXPECT_EQ(got[m * C + j], in[index[m] * C + j]);
    const double ss = be->sum_squares(e.put("p", p, false), counted);
    double want = 0;
    for (const auto& [b, en] : counted)
      for (size_t i = b; i < en; i++) want += (double)p[i] * p[i];
    EXPECT_NEAR(ss, want, 1e-9 * want);
    const Tensor param = e.put("param", p, false), m = e.f32("m", p.size()), v = e.f32("v", p.size());
    be->adamw_update(param, m, v, e.put("g", g, false), 0.5f, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1);
    const std::vector<float> updated = e.get("param");
    const Tensor init = e.f32("init", 5000);
    be->init_normal(init, 7, 99, 0.02, 0.0f);
    const std::vector<float> drawn = e.get("init");
    for (size_t i = 0; i < drawn.size(); i += 97)
      EXPECT_NEAR(drawn[i], (float)(0.02 * normal_at(7, 99, i)), 1e-7) << "init element " << i;
    if (first_p.empty()) {
      first_p = updated;
      first_ss = ss;
    } else {
      testing::expect_close(updated, first_p, 1e-6, 0.0, "adamw vs the CPU");
      EXPECT_NEAR(ss, first_ss, 1e-9 * first_ss);
    }
  }
}

}  // namespace
}  // namespace moetron
