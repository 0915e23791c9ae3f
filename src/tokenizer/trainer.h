// `moetron tokenizer train`: a SentencePiece model from chat / prompt-completion / text JSONL.
//
// The texts are every message content (chat), the prompt and the completion (prompt_completion),
// or the text (text), split at newlines into SentencePiece "sentences" (so no piece spans a line
// break; "\n" itself is encoded through byte fallback, as in the Mistral tokenizer).  Settings follow
// the Llama/Mistral tokenizers: BPE, byte fallback, digits split, identity normalisation, whitespace
// kept as is, a dummy prefix, <unk>=0 <s>=1 </s>=2, no pad; the vocabulary has exactly vocab_size
// pieces (Error when the data cannot fill it).  Bad JSONL lines, and lines longer than
// kDefaultMaxLineBytes (16 MiB, io/line_reader.h), are skipped and counted.
// Writes PREFIX.vocab (piece TAB score) and PREFIX.model, each through a temporary file beside it.
// PREFIX is a prefix, not a directory: "dir/" or an existing directory is an Error (use
// dir/tokenizer), as is a missing parent directory, and -- unless `overwrite` -- an existing
// PREFIX.model or PREFIX.vocab (checked before training, and again when the files are placed).  On
// any Error nothing is left behind and nothing that existed is changed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/jsonl.h"

namespace moetron {

struct TokenizerTrainOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  int vocab_size = 32000;
  std::string model_type = "bpe";  // bpe | unigram
  double character_coverage = 0.9995;
  bool byte_fallback = true;
  RecordFormat format = RecordFormat::auto_detect;
  size_t max_sentences = 2000000;  // SentencePiece samples this many sentences when there are more
  std::vector<std::string> user_defined_symbols;  // always single pieces, e.g. "[INST]"
  int threads = 0;                                // 0: all cores
  uint32_t seed = 1234;                           // SentencePiece's sampling seed
  bool verbose = false;                           // SentencePiece's own progress log on stderr
  bool overwrite = false;                         // replace an existing PREFIX.model / PREFIX.vocab
};

struct TokenizerTrainResult {
  std::string model_path, vocab_path;
  size_t texts = 0;          // sentences given to SentencePiece
  size_t skipped_lines = 0;  // unusable JSONL lines (counted, not fatal)
};

TokenizerTrainResult train_tokenizer(const TokenizerTrainOptions& opts);

}  // namespace moetron
