// moetron bench generate: prefill and decode tokens/s of the KV-cache generator on a model directory
// (or a random model of a given shape), greedy, with pseudo-random prompt ids (the same ids
// bench/hf_generate.py gives transformers' generate).  Prefill = the prompt's forward pass on an empty
// cache; decode = each later token (choosing it from the logits plus its forward pass).  Medians over
// --runs after one untimed warm-up run.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <omp.h>

#include "backend/kernels/argmax.h"
#include "backend/kernels/simd.h"
#include "cli/bench_model_shape.h"
#include "cli/commands.h"
#include "cli/flag_range.h"
#include "cli/generation_options.h"
#include "cli/threads.h"
#include "core/error.h"
#include "core/stats.h"
#include "core/rng.h"
#include "infer/model_runner.h"
#include "infer/model.h"
#include "infer/sampler.h"

namespace moetron::cli {

namespace {

using Clock = std::chrono::steady_clock;

// The sections of `prof` per decode step (`steps` of them, `step_s` seconds each), largest first; what
// they leave out (embedding, norms, RoPE, sampling) is the rest.
void print_profile(const char* what, const Profile& prof, long steps, double step_s) {
  std::vector<std::pair<double, std::string>> rows = prof.largest_first(steps);
  double total = 0;
  for (const auto& r : rows) total += r.first;
  rows.emplace_back(step_s - total, "rest");
  std::printf("profile of %s (ms per step, %ld steps of %.2f ms):\n", what, steps, 1e3 * step_s);
  for (const auto& [sec, name] : rows) std::printf("  %-22s %8.3f  %5.1f%%\n", name.c_str(), 1e3 * sec, 100.0 * sec / step_s);
}

}  // namespace

int run_bench_generate(int argc, char** argv) {
  CLI::App app{"Prefill and decode tokens/s of moetron's KV-cache generation (greedy) on one sequence.",
               "moetron bench generate"};
  std::string model_dir;
  BenchModelShape shape;
  shape.hidden = 256;
  shape.intermediate = 512;
  int prompt_tokens = 128, new_tokens = 64, runs = 3, threads = 0, batch = 0;
  bool json = false, profile = false;
  app.add_option("--model", model_dir, "HF model directory (default: a random model of the shape below)");
  add_model_shape_options(app, shape);
  app.add_option("--prompt-tokens", prompt_tokens, "prompt length");
  app.add_option("--new-tokens", new_tokens, "tokens generated per run");
  app.add_option("--runs", runs, "timed runs (after one warm-up)");
  app.add_option("--threads", threads, "threads for OpenMP and BLAS (default: all)");
  std::string quantize = "none";
  add_quantize_option(app, quantize);
  app.add_flag("--json", json, "also print one JSON line with the figures");
  app.add_option("--batch", batch,
                 "also time B sequences decoded together (Runner::forward_batch, as serve's continuous batching): "
                 "total decode tokens/s");
  app.add_flag("--profile", profile, "print the time a decode step spends per section (one sequence, and --batch)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_thread_count("--threads", threads);
  // Every size is bounded before anything is allocated: --batch 1000000 or --new-tokens 1e9 is a typo,
  // not a run that takes the machine's memory.
  check_flag_range("--prompt-tokens", prompt_tokens, 1, kMaxBenchPositions);
  check_flag_range("--new-tokens", new_tokens, 2, kMaxBenchPositions);
  check_flag_range("--runs", runs, 1, 10000);
  check_flag_range("--batch", batch, 0, kMaxBenchBatch);
  if (threads > 0) omp_set_num_threads(threads);  // inference uses no BLAS library (backend/kernels/gemm.h)
  const WeightQuant quant = parse_weight_quant(quantize, "--quantize");
  if (quant != WeightQuant::none && model_dir.empty()) fail("--quantize needs --model (a model read from files)");
  std::unique_ptr<InferenceModel> model;
  if (!model_dir.empty()) {
    model = load_inference_model(model_dir, "", false, quant);
  } else {
    const ModelConfig shape_cfg = bench_model_config(shape, "bench generate flags");
    check_bench_model_size(shape_cfg);
    model = std::make_unique<InferenceModel>(shape_cfg);
    init_parameters(model->table, model->cfg, 1234, model->owned.data());
  }
  const ModelConfig& cfg = model->cfg;
  check_bench_positions(cfg, prompt_tokens, new_tokens, 1 + batch);
  std::printf("bench generate: %s; prompt %d, new tokens %d, %d threads\n", describe_model_shape(cfg).c_str(),
              prompt_tokens, new_tokens, omp_get_max_threads());
  std::printf("weights: %s, %.1f MB, %s (kernels: %s)\n", model->storage_name().c_str(),
              model->weight_bytes() / 1e6, model->owned.empty() ? "used in place from the mapped files" : "in memory",
              kernels::simd_name(kernels::simd_level()));
  if (const MappedFile::HugePages& h = model->huge_pages; h.windows > 0)
    std::printf("2 MiB pages: %.1f of %.1f MB of mapped weights%s\n", h.huge / 1e6, h.windows / 1e6,
                h.reread ? " (dropped from the page cache and read again to get them)" : "");
  // The prompt bench/hf_generate.py uses: BOS, then ids 3 + mix64(i * 7919 + 17) % (V - 3).
  std::vector<int32_t> prompt(prompt_tokens);
  prompt[0] = 1;
  for (int i = 1; i < prompt_tokens; i++)
    prompt[i] = (int32_t)(3 + mix64((uint64_t)i * 7919 + 17) % (uint64_t)(cfg.vocab_size - 3));

  ModelRunner dec(*model);
  std::vector<float> logits(cfg.vocab_size);
  std::vector<double> prefill, decode;
  size_t kv_bytes = 0;
  double read_token = 0;  // weight bytes one decode step of one sequence reads
  Profile single_prof, batch_prof;  // --profile: the timed runs' decode steps, the batched steps
  double single_s = 0;
  for (int run = 0; run <= runs; run++) {
    KvCache cache = dec.new_cache();
    cache.reserve(prompt_tokens + new_tokens);
    Sampler sampler({}, cfg.vocab_size);
    const auto t0 = Clock::now();
    dec.forward(cache, prompt, logits.data());
    const auto t1 = Clock::now();
    int32_t next = sampler.next(logits.data(), {}, {});
    const size_t read0 = dec.weights_read();
    dec.set_profile(profile && run > 0 ? &single_prof : nullptr);
    for (int i = 1; i < new_tokens; i++) {
      dec.forward(cache, std::span<const int32_t>(&next, 1), logits.data());
      next = sampler.next(logits.data(), {}, {});
    }
    dec.set_profile(nullptr);
    const auto t2 = Clock::now();
    read_token = (double)(dec.weights_read() - read0) / (new_tokens - 1);
    kv_bytes = cache.bytes();
    const double pf = std::chrono::duration<double>(t1 - t0).count();
    const double dc = std::chrono::duration<double>(t2 - t1).count();
    std::printf("  run %d: prefill %.4f s, decode %.4f s%s\n", run, pf, dc, run == 0 ? "  (warm-up)" : "");
    if (run > 0) {
      prefill.push_back(prompt_tokens / pf);
      decode.push_back((new_tokens - 1) / dc);
      single_s += dc;
    }
  }
  double batch_tps = 0, read_step = 0;
  if (batch > 0) {
    // B sequences, each prefilled with its own prompt, then new_tokens steps of all B at once.
    std::vector<KvCache> caches;
    std::vector<int32_t> next(batch);
    for (int b = 0; b < batch; b++) {
      caches.push_back(dec.new_cache());
      caches.back().reserve(prompt_tokens + new_tokens);
      std::vector<int32_t> p = prompt;
      for (int i = 1; i < prompt_tokens; i++) p[i] = (int32_t)(3 + mix64((uint64_t)(i + 7 * b) * 7919) % (cfg.vocab_size - 3));
      dec.forward(caches.back(), p, logits.data());
      next[b] = (int32_t)kernels::argmax(logits.data(), cfg.vocab_size);
    }
    std::vector<KvCache*> ptrs;
    for (auto& c : caches) ptrs.push_back(&c);
    std::vector<float> bl((size_t)batch * cfg.vocab_size);
    const size_t read0 = dec.weights_read();
    dec.set_profile(profile ? &batch_prof : nullptr);
    const auto t0 = Clock::now();
    for (int i = 1; i < new_tokens; i++) {
      dec.forward_batch(ptrs, next, bl.data());
      for (int b = 0; b < batch; b++) {
        const float* l = bl.data() + (size_t)b * cfg.vocab_size;
        next[b] = (int32_t)kernels::argmax(l, cfg.vocab_size);
      }
    }
    const double batch_s = std::chrono::duration<double>(Clock::now() - t0).count();
    dec.set_profile(nullptr);
    batch_tps = (double)batch * (new_tokens - 1) / batch_s;
    read_step = (double)(dec.weights_read() - read0) / (new_tokens - 1);
    std::printf("decode tokens/s with %d sequences decoded together: %.1f (%.2fx one sequence)\n", batch, batch_tps,
                batch_tps / median(decode));
    if (profile) print_profile("steps of the batch", batch_prof, new_tokens - 1, batch_s / (new_tokens - 1));
    // Where decoding streams the weights from memory, a step costs about the bytes it reads: B tokens
    // of one step against B steps of one token bound the gain (the routing decides the experts read).
    std::printf("weights read: %.1f MB a token alone (%.1f GB/s), %.1f MB a step of %d (%.1f GB/s): batching "
                "gains at most %.2fx at the same bandwidth\n",
                read_token / 1e6, read_token * median(decode) / 1e9, read_step / 1e6, batch,
                read_step * batch_tps / batch / 1e9, batch * read_token / read_step);
  }
  if (profile) print_profile("one sequence's decode steps", single_prof, (long)runs * (new_tokens - 1),
                             single_s / runs / (new_tokens - 1));
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double p = median(prefill), d = median(decode);
  std::printf("prefill tokens/s: %.1f\n", p);
  std::printf("decode tokens/s: %.1f\n", d);
  std::printf("peak RSS: %.0f MiB (weights %.1f MiB, KV cache %.1f MiB)\n", ru.ru_maxrss / 1024.0,
              model->weight_bytes() / 1048576.0, kv_bytes / 1048576.0);
  if (json)
    std::printf("{\"prefill_tokens_per_s\": %.2f, \"decode_tokens_per_s\": %.2f, \"threads\": %d, "
                "\"peak_rss_bytes\": %ld, \"weight_bytes\": %zu, \"kv_cache_bytes\": %zu, \"weights\": \"%s\", "
                "\"simd\": \"%s\", \"batch\": %d, \"batch_decode_tokens_per_s\": %.2f, \"weights_read_per_token\": %.0f, "
                "\"weights_read_per_batch_step\": %.0f}\n",
                p, d, omp_get_max_threads(), (long)ru.ru_maxrss * 1024, model->weight_bytes(), kv_bytes,
                model->storage_name().c_str(), kernels::simd_name(kernels::simd_level()), batch, batch_tps,
                read_token, read_step);
  return 0;
}

}  // namespace moetron::cli
