// `moetron plan`: layout validation and per-rank estimates (see plan.h for the layout semantics).
// Dimension letters as in plan.h: B micro-batch, T sequence, N = B*T, C hidden, NH heads, NKV kv
// heads, HD head dim, E experts, K experts per token, M = K*N, I FFN width, L layers, V vocab,
// m micro-batches per step per data-parallel rank; the suffix r marks a per-rank (tp-split) size.
#include "train/plan.h"

#include "model/lora.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "model/flops.h"
#include "model/params.h"

namespace moetron {

namespace {

namespace fs = std::filesystem;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The per-rank shapes of one layout (everything the formulas need).
struct Dims {
  int64_t B, T, N, C, NH, NKV, HD, E, K, M, I, L, V;
  int64_t NHr, Qr, KVr, Ir, Vr;  // per tp rank
  // Latent attention's per-token extras (model/latent_attention.h), act store and f32: the normed
  // q_a output and latent, the RoPE key, o_proj's input; the f32 q_a / kv_a outputs, the latent.
  int64_t mla_a = 0, mla_f32 = 0;
  bool moe;
};

Dims dims_of(const Plan& p) {
  const ModelConfig& c = p.model;
  Dims d{};
  d.B = p.micro_batch_size;
  d.T = p.seq_length;
  d.N = d.B * d.T;
  d.C = c.hidden_size;
  d.NH = c.num_attention_heads;
  d.NKV = c.num_key_value_heads;
  d.HD = c.head_dim;
  d.moe = c.is_moe();
  d.E = d.moe ? c.num_local_experts : 1;
  d.K = d.moe ? c.num_experts_per_tok : 1;
  d.M = d.K * d.N;
  d.I = c.expert_intermediate_size();  // the MoE layers' (a Qwen3-MoE dense layer's is intermediate_size)
  d.L = c.num_hidden_layers;
  d.V = c.vocab_size;
  d.NHr = d.NH / p.tp;
  d.Qr = d.NHr * d.HD;
  d.KVr = (d.NKV >= p.tp ? d.NKV / p.tp : 1) * d.HD;
  if (c.is_mla()) {  // k and v (v padded to head_dim) of every head: [N, NHr*HD] each
    d.KVr = d.Qr;
    d.mla_a = c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim + d.NHr * c.v_head_dim;
    d.mla_f32 = c.q_lora_rank + 2 * c.kv_lora_rank + c.qk_rope_head_dim + 2;
  }
  d.Ir = d.I / p.tp;
  d.Vr = d.V / p.tp;
  return d;
}

}  // namespace

namespace {

int64_t numel(const ParamTable& t, ParamKind kind, int layer = -1) { return (int64_t)t.at(kind, layer).numel; }

RankParams rank_params(const Plan& p, const ParamTable& t, int first, int n, bool first_stage, bool last_stage) {
  const Dims d = dims_of(p);
  const int64_t ep = d.moe ? p.ep : 1;
  // kv heads: split over tp, or (NKV < tp) every rank holds the one head its query heads use.
  auto kv_rank = [&](int64_t x) { return d.NKV >= p.tp ? x / p.tp : x / d.NKV; };
  RankParams r;
  if (first_stage) r.embedding = numel(t, ParamKind::embedding) / p.tp;
  for (int l = first; l < first + n; l++) {
    if (t.has(ParamKind::kv_a_proj, l)) {  // latent attention: down-projections whole, up-projections by heads
      for (ParamKind k : {ParamKind::q_proj, ParamKind::q_b_proj, ParamKind::kv_b_proj, ParamKind::o_proj})
        if (t.has(k, l)) r.attention += numel(t, k, l) / p.tp;
      for (ParamKind k : {ParamKind::q_a_proj, ParamKind::kv_a_proj})
        if (t.has(k, l)) r.attention += numel(t, k, l);
      for (ParamKind k : {ParamKind::q_a_norm, ParamKind::kv_a_norm})
        if (t.has(k, l)) r.norms += numel(t, k, l);
    } else {
      r.attention += numel(t, ParamKind::q_proj, l) / p.tp + numel(t, ParamKind::o_proj, l) / p.tp +
                     kv_rank(numel(t, ParamKind::k_proj, l)) + kv_rank(numel(t, ParamKind::v_proj, l));
    }
    r.norms += numel(t, ParamKind::input_norm, l) + numel(t, ParamKind::post_norm, l);
    if (t.has(ParamKind::q_norm, l)) r.norms += numel(t, ParamKind::q_norm, l) + numel(t, ParamKind::k_norm, l);
    if (t.has(ParamKind::q_bias, l))
      r.attention += numel(t, ParamKind::q_bias, l) / p.tp + kv_rank(numel(t, ParamKind::k_bias, l)) +
                     kv_rank(numel(t, ParamKind::v_bias, l));
    if (t.has(ParamKind::router, l)) r.router += numel(t, ParamKind::router, l);
    if (t.has(ParamKind::router_bias, l)) r.router += numel(t, ParamKind::router_bias, l);
    if (t.has(ParamKind::shared_w13, l)) {  // shared experts: dense, tp-split; Qwen2-MoE's gate replicated
      r.dense_ffn += (numel(t, ParamKind::shared_w13, l) + numel(t, ParamKind::shared_w2, l)) / p.tp;
      if (t.has(ParamKind::shared_gate, l)) r.router += numel(t, ParamKind::shared_gate, l);
    }
    // Routed experts split over ep; a dense layer's FFN in an MoE model (Qwen3-MoE mlp_only_layers)
    // only over tp, and it is a dense parameter (dp) for ZeRO-1.
    const int64_t ffn = numel(t, ParamKind::ffn_w13, l) + numel(t, ParamKind::ffn_w2, l);
    if (d.moe && !t.at(ParamKind::ffn_w13, l).expert)
      r.dense_ffn += ffn / p.tp;
    else
      r.experts += ffn / (ep * p.tp);
  }
  if (last_stage) {
    r.norms += numel(t, ParamKind::final_norm);
    if (t.has(ParamKind::lm_head)) r.lm_head = numel(t, ParamKind::lm_head) / p.tp;  // absent when tied
  }
  return r;
}

// One layer's saved activations of one micro-batch on one rank without recompute, and the part of
// them selective recompute does not keep (model/recompute.h).
struct LayerActivationBytes {
  int64_t all = 0, recomputable = 0;
};
LayerActivationBytes layer_activation_bytes(const Plan& p) {
  const Dims d = dims_of(p);
  const int64_t a = p.activation_dtype_bytes;
  const bool cpu = p.device != "cuda";
  // x, ln1, h, ln2 [N,C]; q, att [N,Qr]; k, v [N,KVr]; MoE: xperm, yperm [M,C]; h13 [M,2Ir], act [M,Ir].
  const int64_t layer_a = 4 * d.N * d.C + d.N * (2 * d.Qr + 2 * d.KVr + d.mla_a) + (d.moe ? 2 * d.M * d.C : 0) +
                          3 * d.M * d.Ir;
  // fp32: rstd1, rstd2 [N]; attention state: cpu probabilities [B,NHr,T,T], cuda log-sum-exp
  // [B,NHr,T]; MoE: router logits, probs [N,E], top-k weights and indices [N,K].
  const int64_t probs = cpu ? d.B * d.NHr * d.T * d.T : 0;
  const int64_t layer_f32 = 2 * d.N + d.N * d.mla_f32 + (cpu ? probs : d.B * d.NHr * d.T) +
                            (d.moe ? 2 * d.N * d.E + 2 * d.N * d.K : 0);
  return {a * layer_a + 4 * layer_f32, 4 * probs + a * d.M * d.Ir};
}

// Saved activations of one micro-batch on one rank of a stage (the tensors our backward keeps):
// every layer's (none), less what selective recomputes, or (full) each layer's input x [N,C] fp32.
int64_t stage_activation_bytes(const Plan& p, int n_layers, bool last_stage) {
  const Dims d = dims_of(p);
  const int64_t a = p.activation_dtype_bytes;
  const LayerActivationBytes l = layer_activation_bytes(p);
  const int64_t per_layer = p.recompute == "full"        ? 4 * d.N * d.C
                            : p.recompute == "selective" ? l.all - l.recomputable
                                                         : l.all;
  int64_t bytes = n_layers * per_layer;
  // Last stage: final residual and norm [N,C] (a), fp32 logits [N,Vr], rstd and log-sum-exp [N].
  if (last_stage) bytes += a * 2 * d.N * d.C + 4 * (d.N * d.Vr + 2 * d.N);
  return bytes;
}

// Backward scratch of one layer and one micro-batch: d residual, d norm, tmp [N,C]; d att, dq [N,Qr];
// dk, dv [N,KVr]; MoE: d xperm, d yperm [M,C], d router logits [N,E], d top-k [N,K]; FFN [M,3Ir].
// Recompute's buffers: full, one layer's whole activations and its output [N,C] fp32; selective, one
// layer's recomputed part.
int64_t workspace_bytes(const Plan& p) {
  const Dims d = dims_of(p);
  const int64_t a = p.activation_dtype_bytes;
  const LayerActivationBytes l = layer_activation_bytes(p);
  const int64_t recompute = p.recompute == "full"        ? l.all + 4 * d.N * d.C
                            : p.recompute == "selective" ? l.recomputable
                                                         : 0;
  return a * (3 * d.N * d.C + 2 * d.N * d.Qr + 2 * d.N * d.KVr + (d.moe ? 2 * d.M * d.C : 0) + 3 * d.M * d.Ir) +
         4 * (d.moe ? d.N * d.E + d.N * d.K : 0) + recompute;
}

RankComm stage_comm(const Plan& p, const StagePlan& s) {
  const Dims d = dims_of(p);
  const double a = p.activation_dtype_bytes, m = p.micro_batches;
  const double S = (double)d.N * d.C * a;  // one micro-batch's hidden states
  const bool first = s.stage == 0, last = s.stage == p.pp - 1;
  RankComm c;
  if (p.tp > 1) {
    const double ar = 2.0 * (p.tp - 1) / p.tp;
    // Per layer 2 forward (after o_proj, after w2) + 2 backward (inputs of qkv, w13), and for MoE the
    // routing weights' gradient (fp32 [N, K], backward); the vocab-parallel embedding's forward; the
    // head's input gradient; the vocab-parallel CE's row maxima (fp32 [N]) and exp sums and target
    // logits (2 fp64 [N]) -- as model/ (the attention block) and dist/tp_ops.cpp do it.
    const double n_ar = 4.0 * s.num_layers + (first ? 1 : 0) + (last ? 1 : 0);
    const double routing = d.moe ? s.num_layers * ar * (double)d.N * d.K * 4 : 0.0;
    c.tp = std::llround(m * (n_ar * ar * S + routing + (last ? 5.0 * ar * d.N * 4 : 0)));
  }
  if (p.pp > 1) c.pp = std::llround(m * S * ((last ? 0 : 1) + (first ? 0 : 1)));
  if (p.dp > 1) {
    const double dense = (double)s.params.dense(), experts = (double)s.params.expert_sharded();
    const int edp = p.dp / (d.moe ? p.ep : 1);  // ranks holding the same experts
    const double fd = (p.dp - 1.0) / p.dp, fe = (edp - 1.0) / edp;
    if (p.zero1)  // reduce-scatter fp32 gradients, all-gather updated parameters
      c.dp = std::llround((fd * dense + fe * experts) * (p.grad_dtype_bytes + p.param_dtype_bytes));
    else  // all-reduce fp32 gradients
      c.dp = std::llround(2.0 * (fd * dense + fe * experts) * p.grad_dtype_bytes);
  }
  if (p.ep > 1 && d.moe)  // dispatch + combine, forward and backward, per layer and micro-batch
    c.ep = std::llround(m * 4.0 * s.num_layers * (p.ep - 1.0) / p.ep * (double)d.M * d.C * a);
  return c;
}

std::string si(double v, const char* unit) {
  const char* prefixes[] = {"", "K", "M", "G", "T", "P", "E"};
  int i = 0;
  while (std::fabs(v) >= 1000.0 && i < 6) {
    v /= 1000.0;
    i++;
  }
  return fmt::format("{:.2f} {}{}", v, prefixes[i], unit);
}

std::string dtype_name(int bytes) { return bytes == 2 ? "bf16" : "fp32"; }

// A text table: a header row, then rows; columns right-aligned except the first.
std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); i++) {
      if (w.size() <= i) w.push_back(0);
      w[i] = std::max(w[i], r[i].size());
    }
  std::string out;
  for (const auto& r : rows) {
    std::string line = " ";
    for (size_t i = 0; i < r.size(); i++)
      line += i == 0 ? fmt::format(" {:<{}}", r[i], w[i]) : fmt::format("  {:>{}}", r[i], w[i]);
    out += line + "\n";
  }
  return out;
}

}  // namespace

const StagePlan& Plan::largest_stage() const {
  MOETRON_ASSERT(!stages.empty());
  size_t best = 0;
  for (size_t i = 1; i < stages.size(); i++)
    if (stages[i].total_bytes() > stages[best].total_bytes()) best = i;
  return stages[best];
}

ModelConfig plan_model_config(const TrainConfig& cfg, std::string* source) {
  if (cfg.model.init == "random") {
    if (source) *source = "model.config";
    return model_config_from_json(cfg.model.config, "model.config");
  }
  const fs::path path = fs::path(cfg.model.init) / "config.json";
  if (!fs::exists(path))
    fail("model.init: '{}' has no config.json (relative paths are taken from the current directory, {})",
         cfg.model.init, fs::current_path().string());
  if (source) *source = path.string();
  return load_model_config(path.string());
}

Plan make_plan(const TrainConfig& cfg, const ModelConfig& model, int world_size, const std::string& model_source) {
  const Layout layout = resolve_layout(cfg, model, world_size);
  Plan p;
  p.model_source = model_source;
  p.model = model;
  p.device = cfg.device;
  p.dtype = cfg.model.dtype;
  p.world = layout.world;
  p.tp = layout.tp;
  p.pp = layout.pp;
  p.ep = layout.ep;
  p.dp = layout.dp;
  p.zero1 = layout.zero1;
  p.seq_length = cfg.data.seq_length;
  p.micro_batch_size = cfg.train.micro_batch_size;
  p.global_batch_size = cfg.train.global_batch_size;
  p.micro_batches = layout.micro_batches;
  p.recompute = cfg.train.recompute;
  p.tokens_per_step = (int64_t)p.global_batch_size * p.seq_length;
  const bool bf16 = cfg.model.dtype == "bf16";
  p.param_dtype_bytes = bf16 ? 2 : 4;
  p.grad_dtype_bytes = 4;
  p.optimizer_bytes_per_param = bf16 ? 12 : 8;  // fp32 master (bf16 only: fp32 parameters are the master) + m, v
  p.activation_dtype_bytes = (cfg.device == "cuda" && bf16) ? 2 : 4;

  const ParamTable t(model);
  for (const ParamSpec& s : t.specs()) {
    if (s.is_buffer()) continue;  // the routing selection bias: state, not a parameter (transformers' count)
    p.params_total += (int64_t)s.numel;
    if (s.expert) p.params_experts += (int64_t)s.numel;
  }
  p.params_active = p.params_total;
  // The input embedding is a lookup, not a product: DeepSeek-V3's published 36.6B active leaves it out.
  p.params_active_compute = p.params_active - (t.has(ParamKind::embedding) && !model.tie_word_embeddings
                                                   ? (int64_t)t.at(ParamKind::embedding).numel
                                                   : 0);
  if (model.is_moe()) {
    const int64_t idle =
        p.params_experts / model.num_local_experts * (model.num_local_experts - model.num_experts_per_tok);
    p.params_active -= idle;
    p.params_active_compute -= idle;
  }

  const FlopCount fc = count_flops(model, p.seq_length);
  p.flops_per_step = fc.train_per_token() * (double)p.tokens_per_step;
  const double head_fwd = 2.0 * model.hidden_size * model.vocab_size;
  const double layer_fwd =
      (fc.forward_matmul_per_token - head_fwd + fc.forward_attention_per_token) / model.num_hidden_layers;
  // Recompute's forward work again, per token and layer: full, the whole layer; selective, the
  // attention where the backend keeps its probabilities (the CPU's; the SwiGLU is not counted).
  const double recompute_fwd = p.recompute == "full" ? layer_fwd
                               : p.recompute == "selective" && cfg.device != "cuda"
                                   ? fc.forward_attention_per_token / model.num_hidden_layers
                                   : 0.0;
  const int m = p.micro_batches;
  p.bubble = (p.pp - 1.0) / (m + p.pp - 1.0);

  const std::vector<int> starts = stage_layer_starts(cfg, model);
  int64_t opt = p.optimizer_bytes_per_param;
  LoraSpec lora;
  if (cfg.lora.rank > 0) {
    lora.rank = cfg.lora.rank;
    lora.alpha = cfg.lora.alpha;
    lora.targets = parse_lora_targets(cfg.lora.targets, model, "lora.targets");
    p.lora_rank = lora.rank;
    // Model keeps a frozen base in bf16 (model.dtype bf16; one layer at a time widened to fp32,
    // not counted) or fp32; adapters are fp32 masters (+ their bf16 GEMM copy on cuda) with fp32 Adam
    // moments.
    p.base_bytes_per_param = bf16 ? 2 : 4 + (p.activation_dtype_bytes == 2 ? 2 : 0);
    opt = 8;
    const ParamTable adapters(model, lora);
    for (const ParamSpec& s : adapters.specs()) p.lora_params_total += (int64_t)s.numel;
  }
  const int64_t dense_shards = p.zero1 ? p.dp : 1;
  const int64_t expert_shards = p.zero1 ? p.dp / (model.is_moe() ? p.ep : 1) : 1;
  for (int si = 0; si < p.pp; si++) {
    StagePlan s;
    s.stage = si;
    s.first_layer = starts[si];
    s.num_layers = starts[si + 1] - starts[si];
    const bool first = si == 0, last = si == p.pp - 1;
    s.params = rank_params(p, t, s.first_layer, s.num_layers, first, last);
    s.trainable = s.params.total();
    int64_t dense_trainable = s.params.dense(), expert_trainable = s.params.expert_sharded();
    s.param_bytes = s.params.total() * p.param_dtype_bytes;
    int64_t lora_act = 0;  // u = x A^T [rows, r] of every adapted projection, per micro-batch
    if (lora.on()) {
      const ParamTable lt(model, lora, layout_shard(layout, model, si, 0, 0));
      dense_trainable = expert_trainable = 0;
      for (const ParamSpec& ls : lt.specs()) (ls.expert ? expert_trainable : dense_trainable) += (int64_t)ls.numel;
      s.trainable = dense_trainable + expert_trainable;
      s.param_bytes = s.params.total() * p.base_bytes_per_param + s.trainable * (p.activation_dtype_bytes == 2 ? 6 : 4);
      const Dims d = dims_of(p);
      for (int l = s.first_layer; l < s.first_layer + s.num_layers; l++)
        for (const ParamSpec& ls : lt.specs())
          if (ls.layer == l && ls.kind == ParamKind::lora_a) lora_act += (ls.expert ? d.M : d.N) * lora.rank;
      lora_act *= p.activation_dtype_bytes;
    }
    s.grad_bytes = s.trainable * p.grad_dtype_bytes;
    s.optimizer_bytes = (ceil_div(dense_trainable, dense_shards) + ceil_div(expert_trainable, expert_shards)) * opt;
    s.activation_bytes_per_micro_batch = stage_activation_bytes(p, s.num_layers, last) + lora_act;
    s.in_flight = std::min(p.pp - si, m);
    s.workspace_bytes = workspace_bytes(p);
    s.flops = (3.0 * (s.num_layers * layer_fwd + (last ? head_fwd : 0.0)) + s.num_layers * recompute_fwd) *
              (double)p.tokens_per_step /
              ((double)p.dp * p.tp);
    s.comm = stage_comm(p, s);
    p.stages.push_back(s);
  }
  if (p.pp > 1 && m < p.pp)
    p.warnings.push_back(fmt::format(
        "pipeline: {} micro-batches per step per data-parallel rank < pp {}: the 1F1B pipeline never fills "
        "(bubble {:.1f}%); raise train.global_batch_size or lower train.micro_batch_size",
        m, p.pp, 100.0 * p.bubble));
  if (cfg.device == "cpu" && bf16 && !lora.on())
    p.warnings.push_back("model.dtype bf16 on device cpu: the CPU trainer supports fp32 only");
  return p;
}

std::vector<std::string> plan_formulas(const Plan& p) {
  const bool cpu = p.device != "cuda";
  std::vector<std::string> f = {
      "layout: world = pp x dp x tp; m = global_batch / (micro_batch x dp); stage s holds layers "
      "[s L/pp, (s+1) L/pp) (or the parallel.layers_per_stage list)",
      "params per rank: embedding V/tp x C (first stage); per layer q, o NH/tp x HD x C, k, v "
      "max(NKV/tp, 1) x HD x C, norms 2C and router E x C (replicated over tp), experts E/ep x 3 x I/tp x C; "
      "final norm C + head V/tp x C (last stage)",
      fmt::format("bytes per parameter: weights {} B ({}), gradients {} B (fp32), optimizer {} B ({}Adam m, v) "
                  "divided by {} with ZeRO-1 ({})",
                  p.param_dtype_bytes, p.dtype, p.grad_dtype_bytes, p.optimizer_bytes_per_param,
                  p.optimizer_bytes_per_param == 12 ? "fp32 master + " : "", "dp for dense, dp/ep for expert tensors",
                  p.zero1 ? "on" : "off"),
      fmt::format("activations per micro-batch, per layer ({} B each): 4 N C (x, ln1, h, ln2) + N (2 NH/tp HD + "
                  "2 max(NKV/tp, 1) HD) (q, att, k, v){} + 2 M C (permuted rows in/out) + 3 M I/tp (h13, act); "
                  "fp32: 2 N (rstd){} + 2 N E + 2 N K (router logits, probs, top-k); N = B T, M = K N",
                  p.activation_dtype_bytes, cpu ? " + B NH/tp T^2 (attention probs, CPU backward)" : "",
                  cpu ? "" : " + B NH/tp T (attention log-sum-exp, flash-style backward)"),
      "activations, last stage: + 2 N C (final residual, norm) + fp32 N V/tp (logits) + 2 N; workspace: one "
      "layer's backward scratch 3 N C + 2 N NH/tp HD + 2 N max(NKV/tp,1) HD + 2 M C + 3 M I/tp (+ fp32 N E + N K)",
      "in-flight micro-batches (1F1B): stage s holds min(pp - s, m); activations = per micro-batch x in flight + "
      "workspace",
      fmt::format("recompute ({}): full keeps fp32 N C (x) per layer, its workspace + one layer's activations + "
                  "fp32 N C, FLOPs + 1 forward of the layers; selective keeps a layer's activations less fp32 B "
                  "NH/tp T^2 (probs, cpu) and M I/tp (act), its workspace + those of one layer, FLOPs + the "
                  "attention forward (cpu)",
                  p.recompute),
      "FLOPs per step: 3 x forward (count_flops) x global_batch x T; per rank: the stage's layers (+ head on the "
      "last stage) / (dp x tp)",
      "comm (bytes a rank sends per step; ring: all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, "
      "all-to-all (n-1)/n S): S = B T C x activation bytes",
      "  tp: m x (4 per layer (2 forward, 2 backward) + 1 embedding (first) + 1 head input grad (last)) all-reduces "
      "of S, + MoE: 1 fp32 [B T K] per layer (routing-weight gradient), + 1 fp32 and 2 fp64 [B T] (vocab-parallel "
      "CE, last)",
      "  dp: ZeRO-1: reduce-scatter fp32 grads + all-gather params over dp (experts: dp/ep); otherwise "
      "all-reduce fp32 grads",
      "  pp: m x S forward to the next stage + m x S backward to the previous",
      "  ep: m x 4 per layer (dispatch, combine; forward, backward) all-to-alls of K B T C x activation bytes",
      "pipeline bubble: (pp - 1) / (m + pp - 1)",
  };
  return f;
}

std::string format_plan(const Plan& p) {
  const ModelConfig& c = p.model;
  std::string o;
  o += fmt::format("model       {} from {}\n", c.architecture, p.model_source);
  o += fmt::format("            L {}, C {}, NH {}, NKV {}, HD {}, E {}, K {}, I {}, V {}\n", c.num_hidden_layers,
                   c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_local_experts,
                   c.num_experts_per_tok, c.intermediate_size, c.vocab_size);
  if (c.is_moe())
    o += fmt::format("parameters  {} total ({}), {} active per token ({}; {} without the input embedding); expert "
                     "weights {}, {} of {} experts per token\n",
                     format_count((double)p.params_total, 1), p.params_total, format_count((double)p.params_active, 1),
                     p.params_active, format_count((double)p.params_active_compute, 1),
                     format_count((double)p.params_experts, 2), c.num_experts_per_tok, c.num_local_experts);
  else
    o += fmt::format("parameters  {} total ({}), all active per token (dense)\n",
                     format_count((double)p.params_total, 1), p.params_total);
  o += fmt::format("layout      world {} = pp {} x dp {} x tp {}; ep {}; ZeRO-1 {}; recompute {}\n", p.world, p.pp,
                   p.dp, p.tp, p.ep, p.zero1 ? "on" : "off", p.recompute);
  o += fmt::format("batch       {} sequences x {} tokens = {} tokens per step; micro-batch {}; m = {} "
                   "micro-batches per step per data-parallel rank\n",
                   p.global_batch_size, p.seq_length, p.tokens_per_step, p.micro_batch_size, p.micro_batches);
  o += fmt::format("pipeline    1F1B; bubble (pp-1)/(m+pp-1) = {}/{} = {:.1f}%\n", p.pp - 1,
                   p.micro_batches + p.pp - 1, 100.0 * p.bubble);
  o += fmt::format("dtypes      weights {} ({} B), gradients fp32 (4 B), optimizer {} B per parameter, "
                   "activations {} ({} B, device {})\n",
                   p.dtype, p.param_dtype_bytes, p.optimizer_bytes_per_param, dtype_name(p.activation_dtype_bytes),
                   p.activation_dtype_bytes, p.device);

  if (p.lora_rank > 0)
    o += fmt::format("lora        rank {}: {} adapter parameters ({:.3f}% of the model) train; the base is frozen ({} B "
                     "per parameter, no gradients or optimizer state)\n",
                     p.lora_rank, format_count((double)p.lora_params_total, 2),
                     100.0 * (double)p.lora_params_total / (double)p.params_total, p.base_bytes_per_param);
  o += "\nmemory per rank (every rank of a stage needs the same)\n";
  std::vector<std::vector<std::string>> rows = {{"stage", "layers", "params", "trainable", "weights", "grads", "optimizer",
                                                 "act/micro-batch", "in flight", "workspace", "activations",
                                                 "total"}};
  for (const StagePlan& s : p.stages)
    rows.push_back({std::to_string(s.stage), fmt::format("{}-{}", s.first_layer, s.first_layer + s.num_layers - 1),
                    format_count((double)s.params.total()), format_count((double)s.trainable),
                    format_bytes((double)s.param_bytes),
                    format_bytes((double)s.grad_bytes), format_bytes((double)s.optimizer_bytes),
                    format_bytes((double)s.activation_bytes_per_micro_batch), std::to_string(s.in_flight),
                    format_bytes((double)s.workspace_bytes), format_bytes((double)s.activation_bytes()),
                    format_bytes((double)s.total_bytes())});
  o += table(rows);
  const StagePlan& big = p.largest_stage();
  o += fmt::format("  largest: stage {}, {} per rank ({} bytes)\n", big.stage, format_bytes((double)big.total_bytes()),
                   big.total_bytes());

  o += "\ncompute and communication per step per rank (bytes sent)\n";
  rows = {{"stage", "FLOPs", "tp", "dp", "pp", "ep", "comm total"}};
  for (const StagePlan& s : p.stages)
    rows.push_back({std::to_string(s.stage), si(s.flops, "FLOP"), format_bytes((double)s.comm.tp),
                    format_bytes((double)s.comm.dp), format_bytes((double)s.comm.pp), format_bytes((double)s.comm.ep),
                    format_bytes((double)s.comm.total())});
  o += table(rows);
  o += fmt::format("  model: {} per step ({} per token)\n", si(p.flops_per_step, "FLOP"),
                   si(p.flops_per_step / (double)p.tokens_per_step, "FLOP"));

  o += "\nformulas\n";
  for (const std::string& f : plan_formulas(p)) o += "  " + f + "\n";
  for (const std::string& w : p.warnings) o += "warning: " + w + "\n";
  return o;
}

nlohmann::json plan_to_json(const Plan& p) {
  using nlohmann::json;
  json j;
  j["model"] = {{"source", p.model_source},
                {"architecture", p.model.architecture},
                {"num_hidden_layers", p.model.num_hidden_layers},
                {"hidden_size", p.model.hidden_size},
                {"num_attention_heads", p.model.num_attention_heads},
                {"num_key_value_heads", p.model.num_key_value_heads},
                {"head_dim", p.model.head_dim},
                {"num_local_experts", p.model.num_local_experts},
                {"num_experts_per_tok", p.model.num_experts_per_tok},
                {"intermediate_size", p.model.intermediate_size},
                {"vocab_size", p.model.vocab_size}};
  j["params"] = {{"total", p.params_total},
                 {"active", p.params_active},
                 {"active_without_embedding", p.params_active_compute},
                 {"experts", p.params_experts}};
  if (p.lora_rank > 0)
    j["lora"] = {{"rank", p.lora_rank}, {"params", p.lora_params_total}, {"base_bytes_per_param", p.base_bytes_per_param}};
  j["layout"] = {{"world", p.world}, {"tp", p.tp}, {"pp", p.pp}, {"dp", p.dp}, {"ep", p.ep}, {"zero1", p.zero1}, {"recompute", p.recompute}};
  j["batch"] = {{"global_batch_size", p.global_batch_size}, {"micro_batch_size", p.micro_batch_size},
                {"seq_length", p.seq_length},               {"micro_batches", p.micro_batches},
                {"tokens_per_step", p.tokens_per_step}};
  j["dtypes"] = {{"device", p.device},
                 {"param_bytes", p.param_dtype_bytes},
                 {"grad_bytes", p.grad_dtype_bytes},
                 {"optimizer_bytes_per_param", p.optimizer_bytes_per_param},
                 {"activation_bytes", p.activation_dtype_bytes}};
  j["flops_per_step"] = p.flops_per_step;
  j["bubble"] = p.bubble;
  json stages = json::array();
  for (const StagePlan& s : p.stages) {
    const RankParams& r = s.params;
    stages.push_back({{"stage", s.stage},
                      {"first_layer", s.first_layer},
                      {"num_layers", s.num_layers},
                      {"params",
                       {{"embedding", r.embedding},
                        {"attention", r.attention},
                        {"norms", r.norms},
                        {"router", r.router},
                        {"experts", r.experts},
                        {"dense_ffn", r.dense_ffn},
                        {"lm_head", r.lm_head},
                        {"total", r.total()},
                        {"trainable", s.trainable}}},
                      {"bytes",
                       {{"params", s.param_bytes},
                        {"grads", s.grad_bytes},
                        {"optimizer", s.optimizer_bytes},
                        {"activations_per_micro_batch", s.activation_bytes_per_micro_batch},
                        {"in_flight", s.in_flight},
                        {"workspace", s.workspace_bytes},
                        {"activations", s.activation_bytes()},
                        {"total", s.total_bytes()}}},
                      {"flops", s.flops},
                      {"comm_bytes",
                       {{"tp", s.comm.tp}, {"dp", s.comm.dp}, {"pp", s.comm.pp}, {"ep", s.comm.ep},
                        {"total", s.comm.total()}}}});
  }
  j["stages"] = stages;
  j["largest_stage"] = p.largest_stage().stage;
  j["max_rank_bytes"] = p.largest_stage().total_bytes();
  j["warnings"] = p.warnings;
  j["formulas"] = plan_formulas(p);
  return j;
}

int64_t parse_byte_size(const std::string& text, const std::string& what) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit((unsigned char)text[i]) || text[i] == '.')) i++;
  const std::string num = text.substr(0, i);
  std::string unit = text.substr(i);
  unit.erase(0, unit.find_first_not_of(' '));
  for (char& ch : unit) ch = (char)std::tolower((unsigned char)ch);
  if (num.empty() || std::count(num.begin(), num.end(), '.') > 1)
    fail("{}: '{}' is not a size (expected e.g. 80GB, 80GiB or a number of bytes)", what, text);
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1.0},           {"b", 1.0},           {"kb", 1e3},          {"mb", 1e6},
      {"gb", 1e9},         {"tb", 1e12},         {"kib", 1024.0},      {"mib", 1048576.0},
      {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  for (const auto& [name, mult] : kUnits)
    if (unit == name) {
      const double v = std::stod(num) * mult;
      if (!(v >= 1.0) || v > 9.0e18) fail("{}: '{}' is out of range (expected a positive size)", what, text);
      return (int64_t)std::llround(v);
    }
  fail("{}: '{}': unknown unit '{}' (expected B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)", what, text, unit);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int i = 0;
  while (bytes >= 1024.0 && i < 5) {
    bytes /= 1024.0;
    i++;
  }
  return i == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[i]);
}

std::string format_count(double n, int decimals) {
  if (n >= 1e12) return fmt::format("{:.{}f}T", n / 1e12, decimals);
  if (n >= 1e9) return fmt::format("{:.{}f}B", n / 1e9, decimals);
  if (n >= 1e6) return fmt::format("{:.{}f}M", n / 1e6, decimals);
  if (n >= 1e3) return fmt::format("{:.{}f}K", n / 1e3, decimals);
  return fmt::format("{:.0f}", n);
}

}  // namespace moetron
