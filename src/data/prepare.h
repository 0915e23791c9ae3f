// `moetron data prepare`: chat / prompt-completion / text JSONL -> tokenized, loss-masked Megatron
// datasets (DESIGN §7):
//   DIR/train.{bin,idx}        token ids, one sequence per document (uint16 when the vocabulary has
//                              at most 65536 pieces, else int32)
//   DIR/train_mask.{bin,idx}   uint8 loss mask, the same sequence lengths (chat_template.h says
//                              which positions are 1)
//   DIR/valid.{bin,idx}, DIR/valid_mask.{bin,idx}   the same for the validation split
//   DIR/dataset.json           sources, tokenizer checksum, template, per-split counts of documents,
//                              tokens and loss tokens, skipped lines with file:line and reason
//
// Streaming: lines are read in chunks (at most chunk_lines lines / chunk_bytes bytes), each chunk is
// parsed, templated and tokenized in parallel (OpenMP, `threads`), and the documents are written in
// input order, so memory is bounded by a chunk and the output is identical for any thread count.
// Split: with valid_fraction, a line goes to valid when a hash of (seed, input file index, line
// number) falls below the fraction (deterministic, independent of chunking and threads); with
// valid_inputs, the inputs are all train and valid_inputs all valid.
// Bad lines (SkipReason in data/jsonl.h) are counted with file:line, reported on `log` and in
// dataset.json; strict makes the first one an Error.  Zero usable training documents is an Error.
// On any Error no output file is left behind (the writers work on temporary files, renamed at the
// end; an output directory created by this run is removed again).
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/jsonl.h"
#include "jinja/jinja.h"
#include "tokenizer/chat_template.h"

namespace moetron {

// A model's own Jinja chat template (jinja/): each conversation is rendered as transformers'
// apply_chat_template does (the line's "tools" and "chat_template_kwargs" included, any roles),
// encoded whole (HF's encode: byte-level BPE tokenizers only), and masked on the assistant turns by
// jinja::assistant_spans (generation blocks, else the prefix rule; a conversation that is not
// prefix-stable is skipped as not_prefix_stable, a refused one as template_error).
struct JinjaChat {
  std::shared_ptr<const jinja::Template> tmpl;
  std::vector<std::pair<std::string, std::string>> special_tokens;
  std::string origin;  // the file it came from (dataset.json)
  std::string sha256;  // of the template text (dataset.json)
};

struct PrepareOptions {
  std::vector<std::string> inputs;        // split into train/valid by valid_fraction ...
  std::vector<std::string> valid_inputs;  // ... unless these are given: then inputs = train, these = valid
  std::string tokenizer_path;
  std::string output_dir;  // empty: dry run (nothing written; `moetron bench data`)
  ChatTemplate chat_template = ChatTemplate::mistral;
  std::optional<JinjaChat> jinja;  // set: the model's template instead of chat_template
  RecordFormat format = RecordFormat::auto_detect;
  double valid_fraction = 0.01;
  bool train_on_prompt = false;
  int threads = 0;  // 0: OpenMP's default
  bool strict = false;
  uint64_t seed = 1234;
  bool progress = false;          // a progress line on stderr (the CLI sets it when stderr is a terminal)
  FILE* log = stderr;             // skipped-line reports; nullptr: silent
  size_t chunk_lines = 4096;      // lines per parallel chunk
  size_t chunk_bytes = 8u << 20;  // and at most this many bytes (a longer single line is one chunk)
  size_t max_listed_skips = 1000; // skipped lines listed in dataset.json and on `log` (all are counted)
  // Longer lines are skipped (SkipReason::line_too_long, counted and listed like any unusable line;
  // an Error with strict) without being held in memory: parsing and tokenizing a line takes tens of
  // times its size.
  size_t max_line_bytes = kDefaultMaxLineBytes;
};

struct SplitCounts {
  uint64_t documents = 0, tokens = 0, loss_tokens = 0;
};

struct SkippedLine {
  std::string file;
  uint64_t line = 0;
  SkipReason reason = SkipReason::invalid_json;
  std::string message;
};

struct PrepareReport {
  SplitCounts train, valid;
  uint64_t lines = 0;        // all lines read
  uint64_t blank_lines = 0;  // empty or whitespace-only lines (ignored, not errors)
  uint64_t skipped = 0;
  std::array<uint64_t, kSkipReasonCount> skipped_by_reason{};
  std::vector<SkippedLine> skipped_lines;  // the first max_listed_skips
  uint64_t input_bytes = 0;
  double seconds = 0;           // wall time of the read-tokenize-write pipeline
  double parallel_seconds = 0;  // of which in the parallel parse-template-tokenize sections
  int threads = 0;
  nlohmann::json dataset_json;  // what DIR/dataset.json holds (also filled on a dry run)
};

PrepareReport prepare_dataset(const PrepareOptions& opts);

}  // namespace moetron
