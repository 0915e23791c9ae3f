// moetron bench: the benchmarks that print the figures the project claims.
//   bench train: a few training steps of a (default: small Mixtral) model on random tokens; prints
//   tokens/s, achieved GFLOP/s, the sgemm GFLOP/s measured in the same process, MFU, peak RSS and
//   the FLOP formula used.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <omp.h>

#include "cli/bench_model_shape.h"
#include "cli/commands.h"
#include "cli/flag_range.h"
#include "cli/threads.h"
#include "core/error.h"
#include "core/stats.h"
#include "core/profile.h"
#include "core/rng.h"
#include "backend/select.h"
#include "cuda/runtime.h"
#include "dist/comm.h"
#include "optim/zero.h"
#include "io/hf_config.h"
#include "model/flops.h"
#include "model/lora.h"
#include "model/model.h"
#include "ops/blas.h"
#include "ops/matmul.h"
#include "optim/adamw.h"

namespace moetron::cli {

namespace {

using Clock = std::chrono::steady_clock;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_maxrss / 1024.0;
}

int run_bench_train(int argc, char** argv) {
  CLI::App app{"Train a model for a few steps on random tokens and report throughput and MFU.", "moetron bench train"};
  std::string model_dir;
  BenchModelShape shape;
  int seq = 512, micro_batch = 4, steps = 5, warmup = 1, threads = 0, sgemm_n = 2048, grad_accum = 1;
  double peak_tflops = 989.0;
  bool json = false, profile = false;
  std::string device = "cpu";
  app.add_option("--device", device, "cpu (fp32; MFU against the in-process sgemm peak), or cuda (bf16 with fp32 "
                                     "masters on one NVIDIA GPU; MFU against --peak-tflops)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--grad-accum", grad_accum, "micro-batches per optimizer step");
  app.add_option("--peak-tflops", peak_tflops, "dense bf16 peak for the MFU (--device cuda; H100/H200: 989)");
  app.add_option("--model", model_dir, "take the model shape from this HF directory's config.json instead");
  add_model_shape_options(app, shape);
  app.add_option("--seq", seq);
  app.add_option("--micro-batch", micro_batch);
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--threads", threads, "threads for OpenMP and BLAS (default: all)");
  app.add_option("--sgemm-size", sgemm_n, "size of the square sgemm that sets the peak (--device cpu)");
  app.add_flag("--json", json, "also print one JSON line with the figures");
  app.add_flag("--profile", profile, "print the time spent per section of the timed steps");
  int lora_rank = 0;
  std::vector<std::string> lora_targets = {"attention", "experts"};
  app.add_option("--lora-rank", lora_rank, "LoRA fine-tuning at this rank on a frozen base (0: full fine-tuning)");
  app.add_option("--lora-targets", lora_targets, "LoRA targets (lora.targets)")->delimiter(',');
  bool base_bf16 = false;
  app.add_flag("--base-bf16", base_bf16, "LoRA: keep the frozen base in bf16 (model.dtype bf16)");
  std::string recompute = "none";
  app.add_option("--recompute", recompute,
                 "activation recompute (train.recompute): none | full | selective; MFU counts 3 forwards either way");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_thread_count("--threads", threads);
  check_flag_range("--steps", steps, 1, 100000);
  check_flag_range("--warmup", warmup, 0, 100000);
  check_flag_range("--grad-accum", grad_accum, 1, 4096);
  check_flag_range("--micro-batch", micro_batch, 1, kMaxBenchBatch);
  Recompute recompute_mode = Recompute::none;
  try {
    recompute_mode = parse_recompute(recompute, "--recompute");
  } catch (const Error& e) {
    throw InputError(e.what());  // a usage error: exit 2
  }
  check_flag_range("--seq", seq, 2, kMaxBenchPositions);
  if (threads > 0) {
    omp_set_num_threads(threads);
    ops::blas_set_num_threads(threads);
  }
  ModelConfig cfg;
  if (!model_dir.empty()) {
    cfg = load_model_config((std::filesystem::path(model_dir) / "config.json").string());
  } else {
    cfg = bench_model_config(shape, "bench train flags");
  }
  const bool cuda = device == "cuda";
  if (!cuda) check_bench_model_size(cfg);  // the model is allocated, with gradients and Adam's moments
  const std::unique_ptr<Backend> backend = make_backend(device);  // Error naming the reason without a GPU
  // On a GPU: bf16 GEMM copy, fp32 master, gradient and Adam's two moments, in the device's memory.
  if (cuda) check_bench_model_size(cfg, (int64_t)gpu::device_info().total_bytes, 18.0);
  const int nthreads = omp_get_max_threads();
  std::printf("bench train (%s): %s, seq %d, micro-batch %d, grad-accum %d, recompute %s, %d threads\n",
              backend->name(), describe_model_shape(cfg).c_str(), seq, micro_batch, grad_accum, recompute.c_str(),
              nthreads);
  double peak_gflops = 0;
  if (cuda) {
    const gpu::DeviceInfo dev = gpu::device_info();
    std::printf("device: %s (compute capability %d.%d, %d SMs, %.1f GiB, %.1f GiB free)\n", dev.name.c_str(),
                dev.major, dev.minor, dev.sm_count, dev.total_bytes / kGiB, dev.free_bytes / kGiB);
    peak_gflops = peak_tflops * 1e3;
  } else {
    peak_gflops = ops::measure_sgemm_gflops(sgemm_n, 8);
    std::printf("BLAS: %s, kernels %s (core type from %s)\n", ops::blas_library().path.c_str(),
                ops::blas_library().core_name.c_str(), ops::blas_library().coretype_source.c_str());
  }
  std::fflush(stdout);

  LoraSpec lora;
  if (lora_rank < 0) fail("--lora-rank must be >= 0");
  if (lora_rank > 0) {
    lora.rank = lora_rank;
    lora.alpha = 2.0 * lora_rank;
    lora.targets = parse_lora_targets(lora_targets, cfg, "--lora-targets");
    lora.base_bf16 = base_bf16;
  }
  Model model(*backend, cfg, nullptr, nullptr, LayerRange{}, lora);
  model.set_recompute(recompute_mode);
  model.init_parameters(1234);
  if (lora.on()) {
    // B = 0 would leave the adapters' input gradients zero: a random B makes every product do work.
    std::vector<float> a(model.train_table().total());
    init_lora_parameters(model.train_table(), 5, a.data());
    for (const HfTensorRef& t : model.train_table().hf_tensors())
      if (model.train_table().spec_of(t).kind == ParamKind::lora_b)
        for (size_t i = 0; i < t.numel; i++) a[t.offset + i] = (float)(0.01 * normal_at(9, t.offset, i));
    model.set_train_params(a.data());
  }
  AdamWConfig acfg;
  acfg.lr = 1e-4;
  dist::SelfComm self("bench");
  ShardedAdamW opt(*backend, model.train_table(), acfg, self, self, false);
  size_t trainable = 0;
  for (const ParamSpec& sp : model.train_table().specs()) trainable += sp.numel;
  std::printf("trainable parameters: %zu (%s)\n", trainable,
              lora.on() ? fmt::format("LoRA rank {}, the base frozen", lora.rank).c_str() : "full fine-tuning");
  // grad_accum micro-batches of random tokens (labels = inputs), the same every step.
  std::vector<Batch> batches(grad_accum);
  long loss_tokens = 0;
  for (int a = 0; a < grad_accum; a++) {
    Batch& b = batches[a];
    b.B = micro_batch;
    b.T = seq;
    b.input_ids.resize((size_t)micro_batch * seq);
    for (size_t i = 0; i < b.input_ids.size(); i++)
      b.input_ids[i] = (int32_t)(mix64(i * 7919 + 17 + (uint64_t)a * 1000003) % (uint64_t)cfg.vocab_size);
    b.labels = b.input_ids;
    loss_tokens += count_loss_tokens(b);
  }
  LossWeights w;
  w.ce_scale = 1.0 / (double)loss_tokens;
  w.aux_coef = cfg.router_aux_loss_coef / grad_accum;

  Profile prof;
  Profile* pp = profile ? &prof : nullptr;
  model.set_profile(pp);
  std::vector<double> times;
  double last_loss = 0;
  for (int s = 0; s < warmup + steps; s++) {
    if (s == warmup) prof.clear();
    backend->synchronize("bench train");
    const auto t0 = Clock::now();
    {
      ScopedTimer t(pp, "zero_grads");
      model.zero_grads();
    }
    double loss = 0;
    for (const Batch& b : batches) {
      loss += model.forward(b, w).loss;
      model.backward();
    }
    {
      ScopedTimer t(pp, "optimizer");
      const double norm = opt.global_norm(model.train_grad_tensor());
      opt.step(model.train_param_tensor(), model.train_grad_tensor(), acfg.lr, (float)clip_coefficient(norm, 1.0));
      backend->synchronize("bench train");
    }
    const double dt = seconds_since(t0);
    last_loss = loss;
    if (s >= warmup) times.push_back(dt);
    std::printf("  step %d: %.3f s  loss %.4f%s\n", s + 1, dt, loss, s < warmup ? "  (warm-up)" : "");
    std::fflush(stdout);
  }
  if (!cuda) peak_gflops = std::max(peak_gflops, ops::measure_sgemm_gflops(sgemm_n, 8));
  const double step_s = median(times);
  const double tokens = (double)micro_batch * seq * grad_accum;
  const double tps = tokens / step_s;
  const FlopCount fc = count_flops(cfg, seq);
  const double gflops = tps * fc.train_per_token() / 1e9;
  const double mfu = gflops / peak_gflops;
  std::printf("FLOP formula: per token 3 x forward; forward = 2*L*(C*Q + 2*C*KV + Q*C + C*E + K*3*C*I) + 2*C*V "
              "[matmuls] + 2*L*T*Q [causal attention] = %.4g + %.4g FLOP\n",
              fc.forward_matmul_per_token, fc.forward_attention_per_token);
  std::printf("step time (median of %d): %.4f s  (%g tokens per step)\n", steps, step_s, tokens);
  std::printf("tokens/s: %.1f\n", tps);
  if (cuda) {
    std::printf("achieved TFLOP/s: %.1f\n", gflops / 1e3);
    std::printf("peak TFLOP/s (dense bf16): %.1f\n", peak_tflops);
  } else {
    std::printf("achieved GFLOP/s: %.2f\n", gflops);
    std::printf("sgemm peak GFLOP/s (%dx%d, same process): %.2f\n", sgemm_n, sgemm_n, peak_gflops);
  }
  std::printf("MFU: %.1f%%\n", 100.0 * mfu);
  std::printf("peak RSS: %.0f MiB\n", peak_rss_mib());
  std::printf("%s memory: model state %.2f GiB, AdamW moments %.2f GiB, activations %.2f GiB\n", backend->name(),
              model.state_bytes() / kGiB, opt.state_bytes() / kGiB, model.activation_bytes() / kGiB);
  if (profile) {
    const std::vector<std::pair<double, std::string>> rows = prof.largest_first(steps);
    double total = 0;
    for (const auto& r : rows) total += r.first;
    std::printf("profile (seconds per step, %d timed steps%s; sections sum to %.3f of %.3f s):\n", steps,
                cuda ? ", device-synchronised sections" : "", total, step_s);
    for (const auto& [sec, name] : rows) std::printf("  %-20s %8.4f  %5.1f%%\n", name.c_str(), sec, 100.0 * sec / step_s);
  }
  if (json)
    std::printf("{\"device\": \"%s\", \"tokens_per_s\": %.2f, \"gflops\": %.3f, \"tflops\": %.3f, "
                "\"peak_gflops\": %.3f, \"sgemm_peak_gflops\": %.3f, \"mfu\": %.4f, \"step_s\": %.5f, "
                "\"tokens_per_step\": %.0f, \"train_flop_per_token\": %.6g, \"peak_rss_mib\": %.1f, \"threads\": %d, "
                "\"final_loss\": %.6f, \"state_gib\": %.3f, \"optimizer_gib\": %.3f, \"activation_gib\": %.3f, "
                "\"lora_rank\": %d, \"trainable_params\": %zu, \"optimizer_state_bytes\": %zu, \"recompute\": \"%s\"}\n",
                device.c_str(), tps, gflops, gflops / 1e3, peak_gflops, cuda ? 0.0 : peak_gflops, mfu, step_s, tokens,
                fc.train_per_token(), peak_rss_mib(), nthreads, last_loss, model.state_bytes() / kGiB,
                opt.state_bytes() / kGiB, model.activation_bytes() / kGiB, lora.rank, trainable, opt.state_bytes(),
                recompute.c_str());
  return 0;
}

}  // namespace

int run_bench(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: moetron bench train|data|checkpoint|generate|kernels [options]   (see moetron bench train --help)\n");
    return 2;
  }
  const std::string what = argv[1];
  if (what == "train") return run_bench_train(argc - 1, argv + 1);
  if (what == "data") return run_bench_data(argc - 1, argv + 1);  // src/cli/bench_data.cpp
  if (what == "checkpoint") return run_bench_checkpoint(argc - 1, argv + 1);  // src/cli/bench_checkpoint.cpp
  if (what == "generate") return run_bench_generate(argc - 1, argv + 1);  // src/cli/bench_generate.cpp
  if (what == "kernels") return run_bench_kernels(argc - 1, argv + 1);    // src/cli/bench_kernels.cpp
  std::fprintf(stderr, "moetron bench: unknown benchmark '%s' (available: train, data, checkpoint, generate, kernels)\n",
               what.c_str());
  return 2;
}

}  // namespace moetron::cli
