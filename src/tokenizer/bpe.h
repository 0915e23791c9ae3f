// A fast encoder for SentencePiece BPE models that produces exactly SentencePiece's token ids.
//
// Why: Debian's SentencePiece 0.1.97 spends most of its encode time in a std::unordered_map lookup
// per candidate merge and in building a SentencePieceText protobuf (string copies per piece); the
// data pipeline's speed is the tokenizer's speed.  This class runs the same algorithm on flat
// arrays with an open-addressing piece table:
//   1. normalise (identity rule set only): the model's dummy prefix "▁" (U+2581) if requested, and
//      every ' ' (U+0020) replaced by "▁"; an empty text encodes to nothing;
//   2. split into UTF-8 characters;
//   3. repeatedly merge the adjacent pair whose concatenation is a NORMAL piece with the highest
//      score, the leftmost on ties (SentencePiece's bpe::Model::SampleEncode agenda, alpha = 0);
//   4. map pieces to ids; a symbol that is not a piece is <unk>, which with byte fallback becomes one
//      <0xXX> piece per UTF-8 byte, and without it merges with an immediately preceding <unk>.
// It declines (create() returns nullptr and says why) any model using something it does not
// implement: non-BPE models, a non-identity normaliser, remove_extra_whitespaces,
// treat_whitespace_as_suffix, disabled whitespace escaping, USER_DEFINED or UNUSED pieces, or a
// reserved piece that is a single character.  encode() declines texts that are not valid UTF-8
// (SentencePiece substitutes U+FFFD byte by byte there).  The caller then uses SentencePiece.
// Tests compare it with SentencePiece on many texts and models (tests/test_tokenizer.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moetron {

class FastBpe {
 public:
  // The serialized ModelProto (the bytes of a .model file).
  static std::unique_ptr<FastBpe> create(std::string_view model, std::string* why_not);

  // Appends the ids of `text`; false (nothing appended) when the text is not valid UTF-8.
  // Thread-safe (const, no shared mutable state).
  bool encode(std::string_view text, bool dummy_prefix, std::vector<int32_t>& out) const;

  bool model_adds_dummy_prefix() const { return add_dummy_prefix_; }

 private:
  FastBpe() = default;
  struct Slot {
    uint64_t hash = 0;
    uint32_t offset = 0, len = 0;  // len 0: empty slot
    int32_t id = -1;
    float score = 0;
  };
  // The NORMAL piece equal to `s`, or nullptr.
  const Slot* find(const char* s, size_t n) const;

  struct Sym {
    uint32_t start, len;
    int32_t prev, next;
  };
  struct Cand {
    float score;
    int32_t left, right;
    uint32_t size;
  };
  struct Piece {
    uint32_t start, len;
  };
  struct Scratch {  // per encode() call
    std::vector<Sym> sym;
    std::vector<Cand> heap;
    std::vector<Piece> pieces;
  };
  static constexpr size_t kLinearMax = 32;  // segments up to this many characters merge by linear scans
  void merge_segment(const std::string& norm, size_t a, size_t b, Scratch& sc) const;

  std::vector<Slot> table_;
  std::string arena_;  // the piece strings, concatenated
  uint64_t mask_ = 0;
  size_t max_len_ = 0;  // longest NORMAL piece in bytes
  int32_t unk_id_ = -1;
  bool byte_fallback_ = false;
  bool add_dummy_prefix_ = true;
  bool word_split_ = false;  // merges never cross the start of a "▁" run (see create())
  int32_t byte_ids_[256] = {};
};

}  // namespace moetron
