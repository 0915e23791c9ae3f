// Fuzz target: one line of a dataset (chat / prompt-completion / text JSONL), as `data prepare`
// reads it: parse_record (never throws: a bad line is a counted skip), then every chat template
// over a real tokenizer (the committed tiny SentencePiece model), as the packer tokenizes it.
// Input: the first byte picks the file's format (the rest is the line).
#include "data/jsonl.h"
#include "fuzz_common.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer tok =
      Tokenizer::load(std::string(MOETRON_SOURCE_DIR) + "/tests/golden/generate/mixtral_gqa/tokenizer.model");
  if (size == 0) return 0;
  constexpr RecordFormat kFormats[] = {RecordFormat::auto_detect, RecordFormat::chat, RecordFormat::prompt_completion,
                                       RecordFormat::text};
  const RecordFormat format = kFormats[data[0] % 4];
  const std::string_view line = fuzz::as_text(data + 1, size - 1);
  Record rec;
  RecordError err;
  bool ok = false;
  try {
    ok = parse_record(line, format, rec, err);
  } catch (...) {
    std::fprintf(stderr, "parse_record threw (it must report a skip instead)\n");
    std::abort();
  }
  if (!ok) {
    if (err.message.empty()) std::abort();  // a skipped line says why
    return 0;
  }
  TokenizedDocument doc;
  if (rec.format == RecordFormat::text) {
    fuzz::expect_ok_or_error([&] { tokenize_text(tok, rec.text, doc); });
    if (doc.tokens.size() != doc.loss_mask.size()) std::abort();
    return 0;
  }
  for (ChatTemplate t : {ChatTemplate::mistral, ChatTemplate::llama2, ChatTemplate::chatml, ChatTemplate::raw}) {
    for (bool train_on_prompt : {false, true}) {
      fuzz::expect_ok_or_error([&] {
        doc.clear();
        apply_chat_template(t, tok, rec.messages, ChatOptions{train_on_prompt, false}, doc);
        if (doc.tokens.size() != doc.loss_mask.size()) std::abort();
        for (int32_t id : doc.tokens)
          if (id < 0 || id >= tok.vocab_size()) std::abort();
      });
    }
  }
  return 0;
}
