// Fuzz target: a SentencePiece `tokenizer.model` — moetron's own reader of the ModelProto (FastBpe,
// the fast encoder) and the tokenizer as `data prepare` and the model loaders open it — then
// encoding and decoding a text.  Input: 2 bytes (little-endian) giving the text's length, the text,
// then the model's bytes.
#include <vector>

#include "fuzz_common.h"
#include "tokenizer/bpe.h"
#include "tokenizer/tokenizer.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t text_len = std::min<size_t>(size_t(data[0]) | size_t(data[1]) << 8, size - 2);
  const std::string_view text = fuzz::as_text(data + 2, text_len);
  const std::string_view model = fuzz::as_text(data + 2 + text_len, size - 2 - text_len);

  std::string why;
  if (const std::unique_ptr<FastBpe> bpe = FastBpe::create(model, &why)) {
    std::vector<int32_t> ids;
    for (bool prefix : {false, true}) {
      ids.clear();
      if (bpe->encode(text, prefix, ids))
        for (int32_t id : ids)
          if (id < 0) std::abort();
    }
  } else if (why.empty()) {
    std::abort();  // declining says why
  }

  fuzz::expect_ok_or_error([&] {
    const Tokenizer tok = Tokenizer::from_bytes(std::string(model), "fuzz.model");
    const std::vector<int32_t> ids = tok.encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= tok.vocab_size()) std::abort();
    (void)tok.decode(ids);
    (void)tok.encode_literal(text);
    for (int32_t id : {0, tok.vocab_size() - 1, tok.bos_id(), tok.eos_id()})
      if (id >= 0) (void)tok.id_to_piece(id);
  });
  return 0;
}
