// Unicode data for the byte-level BPE tokenizer: character classes of its split patterns and NFC.
// The tables come from tools/make_unicode_tables.py (Python's unicodedata; unicode_version() says
// which Unicode).  Texts are UTF-8; a byte that does not start a valid UTF-8 sequence is read as one
// character of class other (HF never sees such text: Python strings are valid by construction).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moetron::unicode {

// Character classes of the split patterns: \p{L}, \p{N}, \s (White_Space), anything else.
enum CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };
constexpr uint8_t kClassMask = 3;
constexpr uint8_t kNfcMaybe = 4;  // the character may change under NFC (or change its neighbour)

// Class bits and kNfcMaybe of a code point (anything above U+10FFFF is kOther).
uint8_t char_info(char32_t cp);
// The same for the BMP as a table of 65536 entries (built on first use), for inner loops.
const uint8_t* bmp_info();

// Decodes the UTF-8 character at p[0..n) (n >= 1): its code point and length.  An invalid or
// truncated sequence gives length 1 and kInvalid.
constexpr char32_t kInvalid = 0xFFFFFFFF;
inline char32_t decode_utf8(const unsigned char* p, size_t n, size_t& len) {
  const unsigned c = p[0];
  if (c < 0x80) {
    len = 1;
    return c;
  }
  len = 1;
  size_t need;
  char32_t cp;
  unsigned lo = 0x80, hi = 0xBF;  // the valid range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    cp = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    cp = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return kInvalid;
  }
  if (n < need) return kInvalid;
  for (size_t k = 1; k < need; k++) {
    const unsigned b = p[k];
    if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b & 0x3F);
  }
  len = need;
  return cp;
}

// Appends the UTF-8 encoding of cp (a scalar value).
void append_utf8(std::string& out, char32_t cp);

// Appends NFC(text) to out.  Invalid bytes are kept as they are (and block composition).
void nfc_append(std::string_view text, std::string& out);
// True when NFC(text) == text is certain from a quick scan (no character flagged kNfcMaybe).
bool nfc_quick_check(std::string_view text);

// Appends `bytes` as UTF-8 with each maximal invalid subsequence replaced by U+FFFD (the
// substitution Rust's String::from_utf8_lossy makes, which HF's ByteLevel decoder uses).
void append_utf8_lossy(std::string_view bytes, std::string& out);

const char* unicode_version();

}  // namespace moetron::unicode
