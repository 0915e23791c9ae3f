// The ModelProto reader and its checks (sp_model.h).
#include "tokenizer/sp_model.h"

#include <cstdint>
#include <cstring>

#include "core/error.h"

namespace moetron::spm {

namespace {

// ---- a minimal protocol-buffers wire-format reader for the ModelProto fields we need ----
// (sentencepiece_model.proto: ModelProto{1: repeated SentencePiece pieces, 2: TrainerSpec,
//  3: NormalizerSpec}; SentencePiece{1: piece, 2: score (float), 3: type}; TrainerSpec{3: model_type,
//  24: treat_whitespace_as_suffix, 35: byte_fallback}; NormalizerSpec{1: name, 2: precompiled_charsmap,
//  3: add_dummy_prefix, 4: remove_extra_whitespaces, 5: escape_whitespaces, 6: normalization_rule_tsv}.
// A message field that occurs twice is merged, a scalar's last value wins: reading the fields in
// order and overwriting gives exactly that.)

struct Wire {
  const uint8_t* p;
  const uint8_t* end;
  explicit Wire(std::string_view s)
      : p(reinterpret_cast<const uint8_t*>(s.data())), end(reinterpret_cast<const uint8_t*>(s.data()) + s.size()) {}
  bool done() const { return p >= end; }
  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) return false;
      const uint8_t b = *p++;
      v |= (uint64_t)(b & 0x7F) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }
  bool key(uint32_t& field, uint32_t& type) {
    uint64_t k;
    if (!varint(k)) return false;
    field = (uint32_t)(k >> 3);
    type = (uint32_t)(k & 7);
    return true;
  }
  bool bytes(std::string_view& s) {
    uint64_t n;
    if (!varint(n) || n > (uint64_t)(end - p)) return false;
    s = std::string_view(reinterpret_cast<const char*>(p), (size_t)n);
    p += n;
    return true;
  }
  bool fixed32(uint32_t& v) {
    if (end - p < 4) return false;
    std::memcpy(&v, p, 4);
    p += 4;
    return true;
  }
  bool skip(uint32_t type) {
    uint64_t v;
    std::string_view s;
    uint32_t f;
    switch (type) {
      case 0: return varint(v);
      case 1:
        if (end - p < 8) return false;
        p += 8;
        return true;
      case 2: return bytes(s);
      case 5: return fixed32(f);
      default: return false;  // groups (3, 4) do not occur in ModelProto
    }
  }
};

}  // namespace

static bool parse_piece(std::string_view msg, ParsedPiece& out) {
  Wire w(msg);
  while (!w.done()) {
    uint32_t f, t;
    if (!w.key(f, t)) return false;
    if (f == 1 && t == 2) {
      if (!w.bytes(out.piece)) return false;
    } else if (f == 2 && t == 5) {
      uint32_t bits;
      if (!w.fixed32(bits)) return false;
      std::memcpy(&out.score, &bits, 4);
    } else if (f == 3 && t == 0) {
      uint64_t v;
      if (!w.varint(v)) return false;
      out.type = (int)v;
    } else if (!w.skip(t)) {
      return false;
    }
  }
  return true;
}

bool parse_model(std::string_view model, ParsedModel& m) {
  Wire w(model);
  while (!w.done()) {
    uint32_t f, t;
    if (!w.key(f, t)) return false;
    std::string_view sub;
    if (f == 1 && t == 2) {
      ParsedPiece p;
      if (!w.bytes(sub) || !parse_piece(sub, p)) return false;
      m.pieces.push_back(p);
    } else if ((f == 2 || f == 3) && t == 2) {
      if (!w.bytes(sub)) return false;
      Wire s(sub);
      while (!s.done()) {
        uint32_t sf, st;
        if (!s.key(sf, st)) return false;
        uint64_t v = 0;
        std::string_view b;
        if (st == 0) {
          if (!s.varint(v)) return false;
        } else if (st == 2) {
          if (!s.bytes(b)) return false;
        } else if (!s.skip(st)) {
          return false;
        }
        if (f == 2) {  // TrainerSpec
          if (sf == 3 && st == 0) m.model_type = (int)v;
          if (sf == 24 && st == 0) m.treat_whitespace_as_suffix = v != 0;
          if (sf == 35 && st == 0) m.byte_fallback = v != 0;
        } else {  // NormalizerSpec
          if ((sf == 2 || sf == 6) && st == 2 && !b.empty()) m.identity = false;
          if (sf == 3 && st == 0) m.add_dummy_prefix = v != 0;
          if (sf == 4 && st == 0) m.remove_extra_whitespaces = v != 0;
          if (sf == 5 && st == 0) m.escape_whitespaces = v != 0;
        }
      }
    } else if (!w.skip(t)) {
      return false;
    }
  }
  return true;
}

void check_sentencepiece_model(std::string_view model, const std::string& name) {
  ParsedModel m;
  if (!parse_model(model, m)) fail("tokenizer '{}': not a SentencePiece model (the file is not a well-formed ModelProto)", name);
  if (m.pieces.empty()) fail("tokenizer '{}': the model has no pieces", name);
  if (m.pieces.size() > kMaxPieces)
    fail("tokenizer '{}': the model has {} pieces, more than the {} moetron accepts", name, m.pieces.size(), kMaxPieces);
  if (m.model_type < 1 || m.model_type > 4)
    fail("tokenizer '{}': unknown model_type {} (expected 1 unigram, 2 bpe, 3 word or 4 char)", name, m.model_type);
  for (size_t i = 0; i < m.pieces.size(); i++) {
    const ParsedPiece& p = m.pieces[i];
    if (p.piece.empty()) fail("tokenizer '{}': piece {} is an empty string", name, i);
    // SentencePiece's trie takes pieces as C strings: a NUL makes a shorter (or empty) key.
    if (p.piece.find('\0') != std::string_view::npos) fail("tokenizer '{}': piece {} contains a NUL byte", name, i);
    if (p.piece.size() > kMaxPieceBytes)
      fail("tokenizer '{}': piece {} is {} bytes long, more than {}", name, i, p.piece.size(), kMaxPieceBytes);
    if (p.type < kNormal || p.type > kByte) fail("tokenizer '{}': piece {} has unknown type {}", name, i, p.type);
  }
}

}  // namespace moetron::spm
