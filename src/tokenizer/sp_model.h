// A SentencePiece tokenizer.model read by moetron itself: the ModelProto fields the fast encoder
// (bpe.h) needs, and the checks that keep a hostile file away from the SentencePiece library.
//
// SentencePiece (the Debian libsentencepiece) trusts its input in places: a model with an empty
// piece, or one holding a NUL byte (its trie takes C strings), makes its trie builder throw through a
// noexcept frame (std::terminate, found by tests/fuzz/fuzz_tokenizer).  check_sentencepiece_model() refuses such files first.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moetron::spm {

// SentencePiece::Type.
enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

struct ParsedPiece {
  std::string_view piece;
  float score = 0;
  int type = kNormal;
};

struct ParsedModel {
  std::vector<ParsedPiece> pieces;
  int model_type = 1;  // UNIGRAM unless set
  bool byte_fallback = false, treat_whitespace_as_suffix = false;
  bool identity = true;  // no precompiled_charsmap, no normalization_rule_tsv
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
};

// Parses the fields above from a serialized ModelProto; false when the bytes are not a well-formed
// protocol-buffers message (pieces' strings point into `model`).
bool parse_model(std::string_view model, ParsedModel& m);

// Error naming `name` unless the model is one SentencePiece can load safely: a well-formed
// ModelProto with 1..kMaxPieces pieces, each a non-empty string without NUL bytes of at most kMaxPieceBytes
// bytes with a known type, and a known model type.
constexpr size_t kMaxPieces = size_t(1) << 22;
constexpr size_t kMaxPieceBytes = 4096;
void check_sentencepiece_model(std::string_view model, const std::string& name);

}  // namespace moetron::spm
