// Unicode lookups and NFC (unicode.h).  NFC is the standard algorithm: full canonical decomposition
// (Hangul algorithmically), canonical ordering of combining marks, then canonical composition of
// unblocked pairs.  It runs only on texts the quick check flags.
#include "tokenizer/unicode.h"

#include <algorithm>
#include <array>
#include <vector>

namespace moetron::unicode {

namespace {

struct CpRange {
  char32_t first, last;
  uint8_t value;
};
struct Decomposition {
  char32_t cp;
  uint8_t len;
  char32_t parts[4];
};
struct Composition {
  char32_t first, second, composite;
};

#include "tokenizer/unicode_tables.inc"

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

template <size_t N>
uint8_t range_lookup(const CpRange (&ranges)[N], char32_t cp) {
  const CpRange* end = ranges + N;
  const CpRange* it = std::upper_bound(ranges, end, cp, [](char32_t c, const CpRange& r) { return c < r.first; });
  if (it == ranges) return 0;
  --it;
  return cp <= it->last ? it->value : 0;
}

// The class byte of every BMP code point, built once (the supplementary planes use the ranges).
const std::array<uint8_t, 0x10000>& bmp_table() {
  static const std::array<uint8_t, 0x10000> table = [] {
    std::array<uint8_t, 0x10000> t{};
    for (const CpRange& r : kClassRanges)
      for (char32_t cp = r.first; cp <= r.last && cp < 0x10000; cp++) t[cp] = r.value;
    return t;
  }();
  return table;
}

uint8_t ccc(char32_t cp) {
  if (cp < 0x300) return 0;
  return range_lookup(kCccRanges, cp);
}

const Decomposition* find_decomposition(char32_t cp) {
  const Decomposition* end = kDecompositions + std::size(kDecompositions);
  const Decomposition* it =
      std::lower_bound(kDecompositions, end, cp, [](const Decomposition& d, char32_t c) { return d.cp < c; });
  return it != end && it->cp == cp ? it : nullptr;
}

// The primary composite of (a, b), or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const Composition* end = kCompositions + std::size(kCompositions);
  const Composition* it = std::lower_bound(kCompositions, end, std::pair{a, b}, [](const Composition& c, auto key) {
    return c.first < key.first || (c.first == key.first && c.second < key.second);
  });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const Decomposition* d = find_decomposition(cp)) {
    out.insert(out.end(), d->parts, d->parts + d->len);
    return;
  }
  out.push_back(cp);
}

}  // namespace

uint8_t char_info(char32_t cp) {
  if (cp < 0x10000) return bmp_table()[cp];
  if (cp > 0x10FFFF) return kOther;
  return range_lookup(kClassRanges, cp);
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += (char)cp;
  } else if (cp < 0x800) {
    out += (char)(0xC0 | (cp >> 6));
    out += (char)(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += (char)(0xE0 | (cp >> 12));
    out += (char)(0x80 | ((cp >> 6) & 0x3F));
    out += (char)(0x80 | (cp & 0x3F));
  } else {
    out += (char)(0xF0 | (cp >> 18));
    out += (char)(0x80 | ((cp >> 12) & 0x3F));
    out += (char)(0x80 | ((cp >> 6) & 0x3F));
    out += (char)(0x80 | (cp & 0x3F));
  }
}

bool nfc_quick_check(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    if (p[i] < 0x80) {  // ASCII is stable and composes with nothing before it
      i++;
      continue;
    }
    size_t len;
    const char32_t cp = decode_utf8(p + i, n - i, len);
    if (cp != kInvalid && (char_info(cp) & kNfcMaybe)) return false;
    i += len;
  }
  return true;
}

void nfc_append(std::string_view text, std::string& out) {
  if (nfc_quick_check(text)) {
    out.append(text);
    return;
  }
  // Work in runs between invalid bytes; each run is normalised on its own (an invalid byte is
  // copied and blocks composition across it).
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  std::vector<char32_t> buf;
  auto flush = [&] {
    // Canonical ordering: a stable sort of each run of non-starters by combining class.
    for (size_t i = 0; i < buf.size();) {
      if (ccc(buf[i]) == 0) {
        i++;
        continue;
      }
      size_t j = i;
      while (j < buf.size() && ccc(buf[j]) != 0) j++;
      std::stable_sort(buf.begin() + (long)i, buf.begin() + (long)j,
                       [](char32_t a, char32_t b) { return ccc(a) < ccc(b); });
      i = j;
    }
    // Canonical composition.  prev_cc: the class of the last character kept after the starter,
    // -1 when the starter is the last one kept.
    size_t starter = SIZE_MAX, w = 0;
    int prev_cc = -1;
    for (size_t r = 0; r < buf.size(); r++) {
      const char32_t c = buf[r];
      const int cc = ccc(c);
      if (starter != SIZE_MAX) {
        const bool blocked = prev_cc != -1 && (prev_cc == 0 || prev_cc >= cc);
        if (!blocked)
          if (const char32_t comp = compose(buf[starter], c)) {
            buf[starter] = comp;
            continue;
          }
      }
      buf[w] = c;
      if (cc == 0) {
        starter = w;
        prev_cc = -1;
      } else {
        prev_cc = cc;
      }
      w++;
    }
    for (size_t i = 0; i < w; i++) append_utf8(out, buf[i]);
    buf.clear();
  };
  for (size_t i = 0; i < n;) {
    size_t len;
    const char32_t cp = decode_utf8(p + i, n - i, len);
    if (cp == kInvalid) {
      flush();
      out += (char)p[i];
    } else {
      decompose(cp, buf);
    }
    i += len;
  }
  flush();
}

void append_utf8_lossy(std::string_view bytes, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  for (size_t i = 0; i < n;) {
    size_t len;
    if (decode_utf8(p + i, n - i, len) != kInvalid) {
      out.append(bytes.data() + i, len);
      i += len;
      continue;
    }
    // The maximal subpart: a lead byte and the continuation bytes that are still a valid prefix.
    const unsigned c = p[i];
    size_t need = 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      need = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    size_t k = 1;
    while (k < need && i + k < n) {
      const unsigned b = p[i + k];
      if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) break;
      k++;
    }
    out += "\xEF\xBF\xBD";
    i += k;
  }
}

const uint8_t* bmp_info() { return bmp_table().data(); }

const char* unicode_version() { return kUnicodeVersion; }

}  // namespace moetron::unicode
