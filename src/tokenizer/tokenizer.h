// A tokenizer: SentencePiece (`tokenizer.model` as shipped in Hugging Face Llama/Mistral/Mixtral model
// directories, or written by `moetron tokenizer train`) or byte-level BPE (a Hugging Face
// `tokenizer.json`, as shipped with Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE/OLMoE; byte_bpe.h).  The kind is
// recognised by the file's content (a JSON object is a tokenizer.json).
//
// Two encodings of a text:
//   encode()          exactly SentencePiece's Encode: the model's normaliser, including its "dummy
//                     prefix" (a "▁" before the text when the model sets add_dummy_prefix, as
//                     Llama/Mistral models do).  This is what mistral-common and Meta's Llama code
//                     call, once per piece of a chat template.
//   encode_literal()  the same model without the dummy prefix: the pieces spell the text exactly,
//                     so consecutive segments concatenate like one text (ChatML markup).
// For byte-level BPE both are HF's encode(text, add_special_tokens=False): no dummy prefix, added
// tokens (<|im_start|>, ...) matched in the text.
// For BPE models with the identity normaliser (Llama, Mistral, Mixtral, `moetron tokenizer train`)
// both run on FastBpe (bpe.h), which gives SentencePiece's ids several times faster; other models
// and non-UTF-8 texts go through SentencePiece itself.  encode_reference() always does (for
// byte-level BPE it is encode()).
// Special tokens of a tokenizer.json: BOS/EOS/PAD come from tokenizer_config.json beside it
// (bos_token / eos_token / pad_token: a string, {"content": ...} or null) when load() finds one,
// else there are none (-1); UNK is the model's unk_token.
// All methods are const and thread-safe (SentencePieceProcessor's encode/decode are const).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace moetron {

class FastBpe;
class ByteBpe;

class Tokenizer {
 public:
  // Loads a SentencePiece model or a tokenizer.json (with the tokenizer_config.json in the same
  // directory, when there is one).  Error naming the file when it is missing, unreadable, not a
  // tokenizer, or (tokenizer.json) uses something byte_bpe.h does not implement.
  static Tokenizer load(const std::string& path);
  // The same from the file's bytes; `name` is used in messages and returned by path().
  // `config_json`: the text of a tokenizer_config.json for a tokenizer.json ("" = none).
  static Tokenizer from_bytes(const std::string& bytes, const std::string& name, std::string_view config_json = {});

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<int32_t>& out) const;
  std::vector<int32_t> encode_literal(std::string_view text) const;
  void encode_literal_append(std::string_view text, std::vector<int32_t>& out) const;
  // The same through SentencePiece itself (the oracle FastBpe is tested against).
  std::vector<int32_t> encode_reference(std::string_view text, bool literal = false) const;
  // True when encode() runs on FastBpe; why_not_fast() says why not otherwise.
  bool fast() const { return fast_ != nullptr || bbpe_ != nullptr; }
  // True for a tokenizer.json (byte-level BPE).
  bool byte_level() const { return bbpe_ != nullptr; }
  const std::string& why_not_fast() const { return why_not_fast_; }

  // Text of the ids (control tokens such as <s> and a tokenizer.json's special added tokens decode
  // to nothing, byte pieces to their bytes).
  // Error naming the id when one is outside [0, vocab_size).
  std::string decode(std::span<const int32_t> ids) const;
  // The piece string of one id ("▁the", "<0x0A>", "<s>"; byte-level: "Ġthe", "<|im_end|>"); Error
  // when out of range.
  std::string id_to_piece(int32_t id) const;
  // Byte-level BPE: the byte range of `text` each of `ids` (= encode(text)) came from, HF's
  // offsets; false when the pieces do not spell the text back (a normaliser changed it) or for
  // SentencePiece models.
  bool token_offsets(std::span<const int32_t> ids, std::string_view text,
                     std::vector<std::pair<size_t, size_t>>& out) const;
  // The id of a piece string, or -1 when the vocabulary has no such piece.
  int32_t piece_to_id(std::string_view piece) const;

  int32_t vocab_size() const { return vocab_size_; }
  int32_t bos_id() const { return bos_id_; }  // -1 when the model has none (likewise below)
  int32_t eos_id() const { return eos_id_; }
  int32_t unk_id() const { return unk_id_; }
  int32_t pad_id() const { return pad_id_; }
  bool adds_dummy_prefix() const { return dummy_prefix_; }

  const std::string& path() const { return path_; }
  // sha256 (hex) of the model file's (tokenizer.json's) bytes: identifies the tokenizer in dataset.json.
  const std::string& sha256() const { return sha256_; }

 private:
  Tokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;       // as stored
  std::unique_ptr<sentencepiece::SentencePieceProcessor> literal_;  // add_dummy_prefix = false
  std::unique_ptr<FastBpe> fast_;                                   // null when the model needs SentencePiece
  std::unique_ptr<ByteBpe> bbpe_;                                   // a tokenizer.json (sp_ and fast_ null)
  std::string path_, sha256_, why_not_fast_;
  int32_t vocab_size_ = 0, bos_id_ = -1, eos_id_ = -1, unk_id_ = -1, pad_id_ = -1;
  bool dummy_prefix_ = false;
};

}  // namespace moetron
