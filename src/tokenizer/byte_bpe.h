// A byte-level BPE tokenizer read from a Hugging Face `tokenizers` file (`tokenizer.json`, as shipped
// with Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE/OLMoE/GPT-2 style models), giving the ids HF's
// `Tokenizer.encode(text, add_special_tokens=False)` gives.
//
// What it reads (anything else that would change ids is refused with an Error naming the field):
//   model           type BPE: vocab {piece: id}, merges ("a b" strings or [a, b] pairs, rank = index),
//                   ignore_merges, unk_token (null or a vocab piece) with fuse_unk; byte_fallback,
//                   dropout, continuing_subword_prefix and end_of_word_suffix must be off.
//   normalizer      null, NFC, or a Sequence of NFC.
//   pre_tokenizer   Sequence[Split(Regex P, behavior Isolated), ByteLevel(add_prefix_space false,
//                   use_regex false)] with P Qwen's or GPT-2's pattern, or ByteLevel(add_prefix_space
//                   false, use_regex true), i.e. the GPT-2 pattern.  The patterns run on hand-written
//                   matchers (no regex engine), over Unicode classes from unicode.h.
//   added_tokens    matched in the text before the model runs, leftmost-longest, as HF does with
//                   split_special_tokens=False: tokens with normalized=false on the raw text, then
//                   normalized=true ones on each normalised piece; lstrip/rstrip absorb adjacent
//                   whitespace, single_word requires no word character on either side.
//   decoder         ByteLevel.
//   post_processor  null, ByteLevel, or a TemplateProcessing that adds no tokens.
//   truncation, padding: null.
// Encoding: split on added tokens -> normalise -> pre-tokenize into words -> per word, the whole word
// when it is a piece and ignore_merges is set, else BPE over its bytes: repeatedly merge the adjacent
// pair of lowest merge rank (leftmost on ties).  Words' ids are cached (bounded, thread-safe).
// Decoding: special added tokens decode to nothing (as SentencePiece control tokens do); every other
// token contributes its bytes; the bytes are read as UTF-8 with U+FFFD for invalid sequences.
// Bounds: at most kMaxVocab ids, pieces of at most kMaxPieceBytes, kMaxMerges merges.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moetron {

class ByteBpe {
 public:
  static constexpr int32_t kMaxVocab = 1 << 21;
  static constexpr size_t kMaxPieceBytes = 4096;
  static constexpr size_t kMaxMerges = size_t{1} << 23;

  // The parsed tokenizer.json text; `name` prefixes every message ("NAME: model.merges[3]: ...").
  static std::unique_ptr<ByteBpe> from_json(std::string_view json_text, const std::string& name);
  ~ByteBpe();

  // Appends the ids of `text` (any bytes; invalid UTF-8 bytes are single characters of class other).
  // Thread-safe.
  void encode(std::string_view text, std::vector<int32_t>& out) const;
  // The text of ids, each in [0, vocab_size()) (the caller checks).
  std::string decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const { return (int32_t)piece_.size(); }  // max id + 1
  int32_t unk_id() const { return unk_id_; }
  // The piece string as in the file (byte-level characters, "Ġthe"), the content of an added token,
  // or "" for an id that names nothing.
  const std::string& piece(int32_t id) const { return piece_[(size_t)id]; }
  int32_t piece_to_id(std::string_view piece) const;  // -1 when none
  bool is_special(int32_t id) const { return kind_[(size_t)id] == Kind::special; }
  // The bytes of the text an id was encoded from: a special added token's content, else what it
  // decodes to.
  const std::string& text_of(int32_t id) const { return is_special(id) ? piece_[(size_t)id] : bytes_[(size_t)id]; }

  enum class Pattern : uint8_t { qwen, gpt2 };

  // The hashes of the two tables (shared by the loader and the encoder).
  static uint64_t hash_bytes(std::string_view s) {  // FNV-1a with a final mix
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h ^ (h >> 29);
  }
  static size_t merge_slot(uint64_t key) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20); }

 private:
  ByteBpe();
  friend struct ByteBpeLoader;
  enum class Kind : uint8_t { none, vocab, added, special };
  struct Added {
    std::string content;
    int32_t id = -1;
    bool lstrip = false, rstrip = false, single_word = false, normalized = false, special = false;
  };
  // Added tokens of one group (normalized or not), indexed by their first byte.
  struct AddedSet {
    std::vector<Added> tokens;
    std::vector<uint32_t> by_first[256];  // indices into tokens, longest first
    bool any = false;
    void index();
  };
  struct WordCache;

  template <class OnText, class OnToken>
  void split_added(const AddedSet& set, std::string_view text, OnText&& on_text, OnToken&& on_token) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  int32_t find_bytes(std::string_view bytes) const;  // the vocab piece spelling these bytes, or -1
  // (rank, merged id) of the pair, or false.
  bool find_merge(int32_t a, int32_t b, uint32_t& rank, int32_t& merged) const;

  std::vector<std::string> piece_;  // by id
  std::vector<std::string> bytes_;  // by id: what the token decodes to
  std::vector<Kind> kind_;          // by id
  // Raw-bytes -> id of the vocab pieces BPE can reach (open addressing; slot id -1 = empty).
  struct ByteSlot {
    uint64_t hash = 0;
    int32_t id = -1;
  };
  std::vector<ByteSlot> byte_table_;
  uint64_t byte_mask_ = 0;
  // (left id, right id) -> (rank, merged id), open addressing; key ~0 = empty.
  struct MergeSlot {
    uint64_t key = ~uint64_t{0};
    uint32_t rank = 0;
    int32_t merged = -1;
  };
  std::vector<MergeSlot> merge_table_;
  uint64_t merge_mask_ = 0;
  int32_t byte_id_[256] = {};  // the piece of each single byte, or -1
  std::vector<std::pair<std::string, int32_t>> piece_index_;  // sorted, for piece_to_id
  AddedSet raw_added_, norm_added_;
  Pattern pattern_ = Pattern::gpt2;
  bool nfc_ = false, ignore_merges_ = false, fuse_unk_ = false;
  int32_t unk_id_ = -1;
  std::unique_ptr<WordCache> cache_;
};

}  // namespace moetron
