// moetron bench data: throughput of the dataset-preparation pipeline (read JSONL, parse, apply the
// chat template, tokenize, in parallel chunks) on a JSONL file; prints tokens/s (median of the
// repeats), input MB/s and peak RSS.  Nothing is written unless --write DIR is given.
// bench/python_data_pipeline.py does the same job in Python for comparison, and
// bench/make_chat_jsonl.py generates a synthetic chat file to run both on.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/threads.h"
#include "core/error.h"
#include "data/prepare.h"

namespace moetron::cli {

int run_bench_data(int argc, char** argv) {
  CLI::App app{"Tokens/s of `data prepare`'s template-and-tokenize pipeline on a JSONL file.", "moetron bench data"};
  PrepareOptions o;
  std::string tmpl = "mistral", write_dir;
  int repeats = 3;
  bool json = false;
  app.add_option("--input", o.inputs, "JSONL input files")->required();
  app.add_option("--tokenizer", o.tokenizer_path, "SentencePiece tokenizer.model or Hugging Face tokenizer.json (byte-level BPE)")->required();
  app.add_option("--threads", o.threads, "threads (default: all)");
  app.add_option("--template", tmpl, "chat template: mistral | llama2 | chatml | raw")
      ->check(CLI::IsMember({"mistral", "llama2", "chatml", "raw"}));
  app.add_option("--repeats", repeats, "timed runs; the median is reported");
  app.add_option("--write", write_dir, "also write the dataset to this directory (default: no output)");
  app.add_flag("--json", json, "also print one JSON line with the figures");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_thread_count("--threads", o.threads);
  if (repeats < 1) fail("--repeats must be at least 1");
  o.chat_template = parse_chat_template(tmpl);
  o.output_dir = write_dir;
  o.log = nullptr;
  o.valid_fraction = 0.0;

  // CPU seconds of the process (all threads): tokens per CPU-second is the per-core rate even when
  // other processes share the cores (wall-clock rates then understate it).
  auto cpu_seconds = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + (double)u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
  };
  std::vector<double> tps, secs, per_cpu;
  PrepareReport r;
  for (int i = 0; i < repeats; i++) {
    const double c0 = cpu_seconds();
    r = prepare_dataset(o);
    const double cpu = cpu_seconds() - c0;
    const uint64_t tokens = r.train.tokens + r.valid.tokens;
    secs.push_back(r.seconds);
    tps.push_back((double)tokens / r.seconds);
    per_cpu.push_back((double)tokens / cpu);
    std::printf("  run %d: %.3f s, %.0f tokens/s, %.1f MB/s, %.0f tokens per CPU-second, %.0f%% of the time in the "
                "parallel section\n",
                i + 1, r.seconds, tps.back(), (double)r.input_bytes / r.seconds / 1e6, per_cpu.back(),
                100.0 * r.parallel_seconds / r.seconds);
  }
  std::vector<double> sorted = tps;
  std::sort(sorted.begin(), sorted.end());
  const double med = sorted[sorted.size() / 2];
  std::sort(secs.begin(), secs.end());
  const double med_s = secs[secs.size() / 2];
  std::sort(per_cpu.begin(), per_cpu.end());
  const double med_cpu = per_cpu[per_cpu.size() / 2];
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double rss_mib = (double)ru.ru_maxrss / 1024.0;
  const uint64_t docs = r.train.documents + r.valid.documents, tokens = r.train.tokens + r.valid.tokens;
  std::printf("bench data: template %s, %d threads, %.1f MB input, %llu documents, %llu tokens, %llu skipped lines\n",
              tmpl.c_str(), r.threads, (double)r.input_bytes / 1e6, (unsigned long long)docs,
              (unsigned long long)tokens, (unsigned long long)r.skipped);
  std::printf("tokens/s (median of %d): %.0f  (%.0f per thread)\n", repeats, med, med / r.threads);
  std::printf("tokens per CPU-second (median): %.0f\n", med_cpu);
  std::printf("input MB/s: %.1f\n", (double)r.input_bytes / med_s / 1e6);
  std::printf("peak RSS: %.0f MiB\n", rss_mib);
  if (json)
    std::printf("{\"tokens_per_s\": %.1f, \"tokens_per_cpu_s\": %.1f, \"threads\": %d, \"tokens\": %llu, \"documents\": %llu, \"input_bytes\": %llu, "
                "\"seconds\": %.4f, \"peak_rss_mib\": %.1f}\n",
                med, med_cpu, r.threads, (unsigned long long)tokens, (unsigned long long)docs,
                (unsigned long long)r.input_bytes, med_s, rss_mib);
  return 0;
}

}  // namespace moetron::cli
