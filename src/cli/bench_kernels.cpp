// moetron bench kernels: the two kernels that dominate an MoE layer's step, at a real model's layer
// shapes, through the backend the model runs on -- causal GQA attention (forward, backward) and the
// grouped expert GEMM of the gate/up projection (forward, backward: d input and d weight) over a
// balanced routing plan -- with their TFLOP/s, to set beside torch's SDPA and grouped matmul on the same
// GPU (bench/torch_kernels.py; scripts/gpu-check.sh runs both).
//   moetron bench kernels --device cuda --shape mixtral-8x7b --seq 4096 [--micro-batch 1] [--runs 5] [--json]
// FLOPs: attention forward 2 x 2 B NH T^2 HD / 2 (causal: half the scores), backward 2.5x the forward
// (FlashAttention's count); the GEMM forward 2 M C 2I with M = B T K rows, its backward twice that.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/select.h"
#include "cli/commands.h"
#include "cli/flag_range.h"
#include "core/error.h"
#include "core/rng.h"
#include "cuda/runtime.h"
#include "ops/moe_dispatch.h"

namespace moetron::cli {

namespace {

struct KernelShape {
  int C, NH, NKV, HD, E, K, I;
};

// Presets: one decoder layer of the model (HF config.json values).
KernelShape preset(const std::string& name) {
  if (name == "mixtral-8x7b") return {4096, 32, 8, 128, 8, 2, 14336};
  if (name == "qwen3-30b-a3b") return {2048, 32, 4, 128, 128, 8, 768};
  throw InputError(fmt::format("--shape {}: expected mixtral-8x7b or qwen3-30b-a3b (or set every dimension flag)",
                               name));
}

struct Timing {
  double seconds = 0;  // median over the runs
  double tflops = 0;
};

// Median seconds of `runs` calls of f (after one warm-up), each ended by a synchronize.
template <typename F>
Timing time_it(Backend& be, int runs, double flops, F&& f) {
  f();
  be.synchronize("bench kernels warm-up");
  std::vector<double> s;
  for (int r = 0; r < runs; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    be.synchronize("bench kernels");
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  Timing t;
  t.seconds = s[s.size() / 2];
  t.tflops = flops / t.seconds / 1e12;
  return t;
}

}  // namespace

int run_bench_kernels(int argc, char** argv) {
  CLI::App app{"Time attention and the grouped expert GEMM at a model's layer shapes on one backend.",
               "moetron bench kernels"};
  std::string device = "cpu", shape_name = "mixtral-8x7b";
  int seq = 4096, micro_batch = 1, runs = 5;
  KernelShape sh{0, 0, 0, 0, 0, 0, 0};
  bool json = false;
  app.add_option("--device", device, "cpu or cuda");
  app.add_option("--shape", shape_name, "mixtral-8x7b or qwen3-30b-a3b (the dimension flags override its values)");
  app.add_option("--seq", seq, "sequence length T");
  app.add_option("--micro-batch", micro_batch, "sequences B");
  app.add_option("--runs", runs, "timed runs per kernel (the median is reported)");
  app.add_option("--hidden", sh.C, "hidden size C");
  app.add_option("--heads", sh.NH, "attention heads");
  app.add_option("--kv-heads", sh.NKV, "key/value heads");
  app.add_option("--head-dim", sh.HD, "head dimension");
  app.add_option("--experts", sh.E, "experts E");
  app.add_option("--top-k", sh.K, "experts per token K");
  app.add_option("--intermediate", sh.I, "expert width I");
  app.add_flag("--json", json, "also print one JSON line of the figures");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (device != "cpu" && device != "cuda") throw InputError(fmt::format("--device {}: expected cpu or cuda", device));
  KernelShape s = preset(shape_name);
  for (auto [flag, mine, base] : {std::tuple{"--hidden", &sh.C, &s.C}, {"--heads", &sh.NH, &s.NH},
                                  {"--kv-heads", &sh.NKV, &s.NKV}, {"--head-dim", &sh.HD, &s.HD},
                                  {"--experts", &sh.E, &s.E}, {"--top-k", &sh.K, &s.K},
                                  {"--intermediate", &sh.I, &s.I}}) {
    if (*mine != 0) *base = *mine;
    check_flag_range(flag, *base, 1, 1 << 16);
  }
  check_flag_range("--seq", seq, 2, 1 << 20);
  check_flag_range("--micro-batch", micro_batch, 1, 1024);
  check_flag_range("--runs", runs, 1, 1000);
  if (s.NH % s.NKV != 0)
    throw InputError(fmt::format("--heads {} must be a multiple of --kv-heads {}", s.NH, s.NKV));
  if (s.K > s.E) throw InputError(fmt::format("--top-k {} exceeds --experts {}", s.K, s.E));
  const long N = (long)micro_batch * seq, M = N * s.K;
  const int Q = s.NH * s.HD, KVd = s.NKV * s.HD, I2 = 2 * s.I;

  const std::unique_ptr<Backend> be = make_backend(device);  // Error naming the reason without a GPU
  // What is allocated, bounded before it is: the device's memory, or (cpu) half of 2^32 floats.
  const double elems = (double)N * (4.0 * Q + 4.0 * KVd) + be->attention_saved_numel(micro_batch, seq, s.NH) +
                       (double)M * (2.0 * s.C + 2.0 * I2) + 3.0 * s.E * I2 * s.C;
  const double limit = device == "cuda" ? 0.9 * (double)gpu::device_info().total_bytes : 2.0 * (1ll << 30) * 4;
  if (elems * 4 > limit)
    throw InputError(fmt::format("--shape/--seq/--micro-batch: the kernels' tensors need {:.1f} GiB, more than {:.1f} GiB",
                                 elems * 4 / (1 << 30), limit / (1 << 30)));
  const Store act = be->act_store(), f32 = Store::f32, i32 = Store::i32;
  std::vector<std::unique_ptr<Allocation>> allocs;
  const auto take = [&](Store st, size_t n, const char* what) {
    allocs.push_back(be->allocate(std::max<size_t>(n * be->element_bytes(st), 1), what));
    return be->view(allocs.back()->data(), st, n);
  };
  // Random values in [-1, 1) in the act store (through an f32 staging tensor).
  uint64_t salt = 0;
  const auto random = [&](Store st, size_t n, const char* what) {
    const Tensor t = take(st, n, what);
    std::vector<float> host(n);
    salt++;
    for (size_t i = 0; i < n; i++) host[i] = (float)(2.0 * uniform_at(77, salt, i, 0) - 1.0) * 0.5f;
    if (st == f32) {
      be->upload(t, host.data());
    } else {
      const Tensor stage = take(f32, n, "bench kernels staging");
      be->upload(stage, host.data());
      be->convert(t, stage);
    }
    return t;
  };

  std::printf("bench kernels (%s): C %d, %d heads (%d kv) of %d, %d experts top-%d of width %d; B %d x T %d\n",
              be->name(), s.C, s.NH, s.NKV, s.HD, s.E, s.K, s.I, micro_batch, seq);
  std::fflush(stdout);
  // Attention.
  const Tensor q = random(act, (size_t)N * Q, "q"), k = random(act, (size_t)N * KVd, "k"),
               v = random(act, (size_t)N * KVd, "v"), dout = random(act, (size_t)N * Q, "d out");
  const Tensor out = take(act, (size_t)N * Q, "out"), dq = take(act, (size_t)N * Q, "dq"),
               dk = take(act, (size_t)N * KVd, "dk"), dv = take(act, (size_t)N * KVd, "dv");
  const Tensor saved = take(f32, be->attention_saved_numel(micro_batch, seq, s.NH), "attention state");
  const AttnMask mask{};
  const double attn_fwd = 2.0 * 2.0 * micro_batch * (double)s.NH * seq * (double)seq * s.HD / 2.0;
  const Timing af = time_it(*be, runs, attn_fwd, [&] {
    be->attention_forward(out, saved, q, k, v, mask, micro_batch, seq, s.NH, s.NKV, s.HD);
  });
  const Timing ab = time_it(*be, runs, 2.5 * attn_fwd, [&] {
    be->attention_backward(dq, dk, dv, dout, out, saved, q, k, v, mask, micro_batch, seq, s.NH, s.NKV, s.HD);
  });
  // The grouped gate/up GEMM over a balanced plan: token n's k-th expert is (n K + k) mod E.
  std::vector<int32_t> experts(M);
  for (long i = 0; i < M; i++) experts[i] = (int32_t)(i % s.E);
  ops::MoePlan plan;
  ops::moe_plan_build(plan, experts.data(), N, s.E, s.K);
  const PlanView pv = be->upload_plan(plan, take(i32, M, "row_token"), take(i32, M, "row_of"));
  const Tensor x = random(act, (size_t)M * s.C, "rows"), w = random(act, (size_t)s.E * I2 * s.C, "w13");
  const Tensor y = take(act, (size_t)M * I2, "h13"), dy = random(act, (size_t)M * I2, "d h13");
  const Tensor dx = take(act, (size_t)M * s.C, "d rows"), dw = take(f32, (size_t)s.E * I2 * s.C, "d w13");
  be->fill_zero(dw);
  const double gemm = 2.0 * (double)M * s.C * I2;
  const Timing gf = time_it(*be, runs, gemm, [&] { be->grouped_matmul_forward(y, x, w, pv, s.C, I2, 1.0f, false); });
  const Timing gb = time_it(*be, runs, 2 * gemm, [&] {
    be->grouped_matmul_backward(dx, dw, dy, x, w, pv, s.C, I2, 1.0f, false);
  });

  const auto row = [](const char* name, const Timing& t) {
    std::printf("  %-28s %10.3f ms  %8.2f TFLOP/s\n", name, 1e3 * t.seconds, t.tflops);
  };
  row("attention forward", af);
  row("attention backward", ab);
  row("grouped GEMM forward (w13)", gf);
  row("grouped GEMM backward (w13)", gb);
  if (json)
    std::printf("{\"device\": \"%s\", \"shape\": \"%s\", \"seq\": %d, \"micro_batch\": %d, "
                "\"attention_forward_tflops\": %.6g, \"attention_backward_tflops\": %.6g, "
                "\"grouped_gemm_forward_tflops\": %.6g, \"grouped_gemm_backward_tflops\": %.6g, "
                "\"attention_forward_ms\": %.6g, \"attention_backward_ms\": %.6g, \"grouped_gemm_forward_ms\": %.6g, "
                "\"grouped_gemm_backward_ms\": %.6g}\n",
                device.c_str(), shape_name.c_str(), seq, micro_batch, af.tflops, ab.tflops, gf.tflops, gb.tflops,
                1e3 * af.seconds, 1e3 * ab.seconds, 1e3 * gf.seconds, 1e3 * gb.seconds);
  return 0;
}

}  // namespace moetron::cli
