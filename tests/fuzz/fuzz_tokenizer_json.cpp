// Fuzz target: a Hugging Face `tokenizer.json` (byte-level BPE, tokenizer/byte_bpe.h) as
// Tokenizer::from_bytes reads it for `data prepare` and the model loaders, then encoding a text,
// decoding the ids, the chatml template, and piece lookups.  Input: 2 bytes (little-endian) giving
// the text's length, the text, then the file's bytes.
#include <vector>

#include "fuzz_common.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t text_len = std::min<size_t>(size_t(data[0]) | size_t(data[1]) << 8, size - 2);
  const std::string_view text = fuzz::as_text(data + 2, text_len);
  const std::string_view file = fuzz::as_text(data + 2 + text_len, size - 2 - text_len);

  fuzz::expect_ok_or_error([&] {
    const Tokenizer tok = Tokenizer::from_bytes(std::string(file), "tokenizer.json");
    const std::vector<int32_t> ids = tok.encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= tok.vocab_size()) std::abort();
    if (tok.encode_literal(text) != ids) std::abort();  // the same encoding for byte-level BPE
    (void)tok.decode(ids);
    for (int32_t id : {0, tok.vocab_size() - 1, tok.bos_id(), tok.eos_id()})
      if (id >= 0 && id < tok.vocab_size()) {
        const std::string piece = tok.id_to_piece(id);
        if (!piece.empty() && tok.piece_to_id(piece) < 0) std::abort();
      }
    const std::vector<ChatMessage> msgs = {{Role::user, std::string(text)}, {Role::assistant, std::string(text)}};
    const TokenizedDocument d = apply_chat_template(ChatTemplate::chatml, tok, msgs);
    if (d.tokens.size() != d.loss_mask.size()) std::abort();
  });
  return 0;
}
