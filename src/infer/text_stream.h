// Incremental detokenization with stop strings: tokens in, final text out, piece by piece.
//
// Text of a reply: for a chat reply, the decode of the reply's tokens alone (SentencePiece drops the
// dummy-prefix space of the first piece, as transformers' and mistral-common's decode do); for a
// completion, what decoding prompt + reply adds after the prompt's own decode (so " Paris" keeps its
// space) -- approximated by decoding from the prompt's last non-control token, `context` here.
//
// Decoding a window of recent tokens (TGI's prefix/read offsets) keeps the cost per token constant;
// text that ends in an incomplete UTF-8 character (byte-fallback pieces still arriving; SentencePiece
// shows them as U+FFFD) is held back until the character completes or the reply ends.
//
// Ids past the tokenizer's vocabulary (padding rows of a model whose vocab_size is larger) have no
// text, as in HF's decode.
//
// Stop strings (OpenAI `stop`): the reply ends before the first occurrence of any of them, which is
// not part of the text.  Text that could be the beginning of a stop string is held back until it is
// known not to be one.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace moetron {

class TextStream {
 public:
  TextStream(const Tokenizer& tok, std::span<const int32_t> context, std::vector<std::string> stop);

  // Adds one token; returns the text that became final (often empty).  After a stop string has
  // appeared, stopped() is true and further tokens are ignored.
  std::string push(int32_t id);
  // The end of the reply: returns the text still held back (minus a stop string's beginning only if
  // it was a whole stop string).
  std::string finish();

  bool stopped() const { return stopped_; }
  // Everything returned so far.
  const std::string& text() const { return emitted_; }

 private:
  std::string release(std::string more, bool final);

  const Tokenizer& tok_;
  std::vector<std::string> stop_;
  std::vector<int32_t> ids_;  // context + reply tokens
  size_t prefix_ = 0, read_ = 0;  // decode window: ids_[prefix_, read_) is already turned into text
  std::string pending_;           // decoded but held back (stop-string prefix)
  std::string emitted_;
  bool stopped_ = false;
};

// Bytes at the end of `s` that form an incomplete UTF-8 sequence (0 when s ends on a boundary).
size_t incomplete_utf8_tail(const std::string& s);

}  // namespace moetron
