// The `--device cuda` paths of `moetron forward` and `moetron bench train`.
#include "cuda/commands.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "core/error.h"
#include "core/stats.h"
#include "core/profile.h"
#include "core/rng.h"
#include "cuda/model.h"
#include "model/flops.h"
#include "optim/adamw.h"

namespace moetron::gpu {

namespace {

using Clock = std::chrono::steady_clock;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace

ForwardResult forward_pass(const ModelConfig& cfg, const std::vector<float>& params, const Batch& batch,
                           const LossWeights& weights, bool want_grads) {
  CudaMixtralModel model(cfg);
  if (params.size() != model.table().total())
    fail("[forward_pass] {} parameters given, the model has {}", params.size(), model.table().total());
  model.set_params(params.data());
  ForwardResult r;
  r.losses = model.forward(batch, weights);
  r.logits.resize((size_t)batch.B * batch.T * cfg.vocab_size);
  model.get_logits(r.logits.data());
  if (want_grads) {
    model.zero_grads();
    model.backward();
    r.grads.resize(model.table().total());
    model.get_grads(r.grads.data());
  }
  return r;
}

int bench_train(const ModelConfig& cfg, const BenchTrainOptions& o) {
  if (o.steps < 1) fail("--steps must be at least 1");
  if (o.grad_accum < 1) fail("--grad-accum must be at least 1");
  if (o.micro_batch < 1 || o.seq < 2) fail("--micro-batch must be >= 1 and --seq >= 2");
  const DeviceInfo dev = device_info();
  std::printf("bench train (cuda): %s hidden %d, %d layers, %d heads (%d kv), experts %d top-%d, intermediate %d, "
              "vocab %d, seq %d, micro-batch %d, grad-accum %d\n",
              cfg.architecture.c_str(), cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
              cfg.num_key_value_heads, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
              cfg.vocab_size, o.seq, o.micro_batch, o.grad_accum);
  std::printf("device: %s (compute capability %d.%d, %d SMs, %.1f GiB, %.1f GiB free)\n", dev.name.c_str(), dev.major,
              dev.minor, dev.sm_count, dev.total_bytes / kGiB, dev.free_bytes / kGiB);
  std::fflush(stdout);

  CudaMixtralModel model(cfg);
  model.init_parameters(1234);
  AdamWConfig acfg;
  acfg.lr = 1e-4;
  CudaAdamW opt(model, acfg);

  // grad_accum micro-batches of random tokens (labels = inputs), the same every step.
  std::vector<Batch> batches(o.grad_accum);
  long loss_tokens = 0;
  for (int a = 0; a < o.grad_accum; a++) {
    Batch& b = batches[a];
    b.B = o.micro_batch;
    b.T = o.seq;
    b.input_ids.resize((size_t)o.micro_batch * o.seq);
    for (size_t i = 0; i < b.input_ids.size(); i++)
      b.input_ids[i] = (int32_t)(mix64(i * 7919 + 17 + (uint64_t)a * 1000003) % (uint64_t)cfg.vocab_size);
    b.labels = b.input_ids;
    loss_tokens += count_loss_tokens(b);
  }
  LossWeights w;
  w.ce_scale = 1.0 / (double)loss_tokens;
  w.aux_coef = cfg.router_aux_loss_coef / o.grad_accum;

  Profile prof;
  model.set_profile(o.profile ? &prof : nullptr);
  std::vector<double> times;
  double last_loss = 0;
  for (int s = 0; s < o.warmup + o.steps; s++) {
    if (s == o.warmup) prof.clear();
    model.context().synchronize("bench train");
    const auto t0 = Clock::now();
    model.zero_grads();
    double loss = 0;
    for (const Batch& b : batches) {
      loss += model.forward(b, w).loss;
      model.backward();
    }
    {
      ScopedTimer t(o.profile ? &prof : nullptr, "optimizer");
      const double norm = model.grad_norm();
      opt.step(acfg.lr, (float)clip_coefficient(norm, 1.0));
      model.context().synchronize("bench train");
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    last_loss = loss;
    if (s >= o.warmup) times.push_back(dt);
    std::printf("  step %d: %.3f s  loss %.4f%s\n", s + 1, dt, loss, s < o.warmup ? "  (warm-up)" : "");
    std::fflush(stdout);
  }
  const double step_s = median(times);
  const double tokens = (double)o.micro_batch * o.seq * o.grad_accum;
  const double tps = tokens / step_s;
  const FlopCount fc = count_flops(cfg, o.seq);
  const double tflops = tps * fc.train_per_token() / 1e12;
  const double mfu = tflops / o.peak_tflops;
  std::printf("FLOP formula: per token 3 x forward; forward = 2*L*(C*Q + 2*C*KV + Q*C + C*E + K*3*C*I) + 2*C*V "
              "[matmuls] + 2*L*T*Q [causal attention] = %.4g + %.4g FLOP\n",
              fc.forward_matmul_per_token, fc.forward_attention_per_token);
  std::printf("step time (median of %d): %.4f s  (%g tokens per step)\n", o.steps, step_s, tokens);
  std::printf("tokens/s: %.1f\n", tps);
  std::printf("achieved TFLOP/s: %.1f\n", tflops);
  std::printf("peak TFLOP/s (dense bf16): %.1f\n", o.peak_tflops);
  std::printf("MFU: %.1f%%\n", 100.0 * mfu);
  std::printf("device memory: model state %.2f GiB, AdamW moments %.2f GiB, activations %.2f GiB\n",
              model.state_bytes() / kGiB, opt.state_bytes() / kGiB, model.activation_bytes() / kGiB);
  if (o.profile) {
    std::vector<std::pair<double, std::string>> rows;
    double total = 0;
    for (const auto& [name, e] : prof.sections()) {
      rows.emplace_back(e.seconds / o.steps, name);
      total += e.seconds / o.steps;
    }
    std::sort(rows.rbegin(), rows.rend());
    std::printf("profile (seconds per step, device-synchronised sections; they sum to %.4f of %.4f s):\n", total,
                step_s);
    for (const auto& [sec, name] : rows)
      std::printf("  %-20s %8.4f  %5.1f%%\n", name.c_str(), sec, 100.0 * sec / step_s);
  }
  if (o.json)
    std::printf("{\"device\": \"cuda\", \"tokens_per_s\": %.2f, \"tflops\": %.3f, \"peak_tflops\": %.1f, \"mfu\": %.4f, "
                "\"step_s\": %.5f, \"tokens_per_step\": %.0f, \"train_flop_per_token\": %.6g, \"final_loss\": %.6f, "
                "\"state_gib\": %.3f, \"optimizer_gib\": %.3f, \"activation_gib\": %.3f}\n",
                tps, tflops, o.peak_tflops, mfu, step_s, tokens, fc.train_per_token(), last_loss,
                model.state_bytes() / kGiB, opt.state_bytes() / kGiB, model.activation_bytes() / kGiB);
  return 0;
}

}  // namespace moetron::gpu
