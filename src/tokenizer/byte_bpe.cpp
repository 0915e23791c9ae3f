// Byte-level BPE encoding and decoding (byte_bpe.h); the file reader is byte_bpe_load.cpp.
#include "tokenizer/byte_bpe.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "tokenizer/unicode.h"

namespace moetron {

namespace {

using unicode::kLetter;
using unicode::kNumber;
using unicode::kOther;
using unicode::kSpace;

struct CharAt {
  char32_t cp;
  uint8_t cls;  // kOther, kLetter, kNumber, kSpace
  uint8_t len;  // bytes
};

// The character at p[i] (i < n).
inline CharAt char_at(const unsigned char* p, size_t n, size_t i, const uint8_t* bmp) {
  const unsigned char c = p[i];
  if (c < 0x80) return {c, (uint8_t)(bmp[c] & unicode::kClassMask), 1};
  size_t len;
  const char32_t cp = unicode::decode_utf8(p + i, n - i, len);
  if (cp == unicode::kInvalid) return {cp, kOther, 1};
  const uint8_t info = cp < 0x10000 ? bmp[cp] : unicode::char_info(cp);
  return {cp, (uint8_t)(info & unicode::kClassMask), (uint8_t)len};
}

// The end of the run of characters of class `cls` that starts at i; `last` gets the start of its
// last character.
inline size_t run_of(const unsigned char* p, size_t n, size_t i, uint8_t cls, const uint8_t* bmp, size_t& last) {
  last = i;
  while (i < n) {
    const CharAt c = char_at(p, n, i, bmp);
    if (c.cls != cls) break;
    last = i;
    i += c.len;
  }
  return i;
}

inline char lower_ascii(unsigned char c) { return (c >= 'A' && c <= 'Z') ? (char)(c + 32) : (char)c; }

// The contraction at p[i] == '\'': its end, or i.  `fold`: (?i:...) (Qwen), else case-sensitive.
inline size_t contraction(const unsigned char* p, size_t n, size_t i, bool fold) {
  if (i + 1 >= n) return i;
  // Under Unicode case folding U+017F (long s, C5 BF) is an 's' as well (Oniguruma's (?i)).
  if (fold && i + 2 < n && p[i + 1] == 0xC5 && p[i + 2] == 0xBF) return i + 3;
  const char a = fold ? lower_ascii(p[i + 1]) : (char)p[i + 1];
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
  if (i + 2 >= n) return i;
  const char b = fold ? lower_ascii(p[i + 2]) : (char)p[i + 2];
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  return i;
}

// The whitespace alternatives both patterns end with, for the run starting at i:
//   \s+(?!\S)  the run, less its last character when a non-space follows;  \s+  the run.
inline size_t trailing_space(const unsigned char* p, size_t n, size_t i, const uint8_t* bmp) {
  size_t last;
  const size_t j = run_of(p, n, i, kSpace, bmp, last);
  if (j == n || last == i) return j;
  return last;
}

// Qwen's pattern, alternatives in order (a backtracking regex takes the first that matches):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?\p{L}+ | \p{N} | ?[^\s\p{L}\p{N}]+[\r\n]* |
//   \s*[\r\n]+ | \s+(?!\S) | \s+
// Returns the end of the match at i (> i: some alternative always matches).
size_t match_qwen(const unsigned char* p, size_t n, size_t i, const uint8_t* bmp) {
  const CharAt c = char_at(p, n, i, bmp);
  size_t last;
  if (c.cp == '\'') {
    const size_t e = contraction(p, n, i, true);
    if (e > i) return e;
  }
  if (c.cls == kLetter) return run_of(p, n, i, kLetter, bmp, last);
  const bool newline = c.cp == '\r' || c.cp == '\n';
  if (c.cls != kNumber && !newline && i + c.len < n && char_at(p, n, i + c.len, bmp).cls == kLetter)
    return run_of(p, n, i + c.len, kLetter, bmp, last);
  if (c.cls == kNumber) return i + c.len;
  size_t k = i;
  if (c.cp == ' ' && i + 1 < n && char_at(p, n, i + 1, bmp).cls == kOther) k = i + 1;
  if (k > i || c.cls == kOther) {
    size_t j = run_of(p, n, k, kOther, bmp, last);
    while (j < n && (p[j] == '\r' || p[j] == '\n')) j++;
    return j;
  }
  // c is whitespace.  \s*[\r\n]+ ends after the run's last \r or \n (bytes \r and \n never occur
  // inside a multi-byte character).
  const size_t j = run_of(p, n, i, kSpace, bmp, last);
  for (size_t q = j; q > i; q--)
    if (p[q - 1] == '\r' || p[q - 1] == '\n') return q;
  return trailing_space(p, n, i, bmp);
}

// GPT-2's pattern:  's|'t|'re|'ve|'m|'ll|'d | ?\p{L}+ | ?\p{N}+ | ?[^\s\p{L}\p{N}]+ | \s+(?!\S) | \s+
size_t match_gpt2(const unsigned char* p, size_t n, size_t i, const uint8_t* bmp) {
  const CharAt c = char_at(p, n, i, bmp);
  size_t last;
  if (c.cp == '\'') {
    const size_t e = contraction(p, n, i, false);
    if (e > i) return e;
  }
  if (c.cp == ' ' && i + 1 < n) {
    const CharAt d = char_at(p, n, i + 1, bmp);
    if (d.cls != kSpace) return run_of(p, n, i + 1, d.cls, bmp, last);
  }
  if (c.cls != kSpace) return run_of(p, n, i, c.cls, bmp, last);
  return trailing_space(p, n, i, bmp);
}

bool is_word_char(const CharAt& c) { return c.cls == kLetter || c.cls == kNumber || c.cp == '_'; }

}  // namespace

// Ids of recently seen words (HF's BPE cache).  Bounded: a shard that fills up is cleared.  Mutable
// state behind const encode(), guarded per shard; it never changes results.
struct ByteBpe::WordCache {
  static constexpr size_t kShards = 16, kPerShard = 4096, kMaxWordBytes = 64;
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return (size_t)ByteBpe::hash_bytes(s); }
  };
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, Hash, std::equal_to<>> map;
  };
  Shard shards[kShards];

  Shard& shard_of(std::string_view w) { return shards[(ByteBpe::hash_bytes(w) >> 7) % kShards]; }
  bool get(std::string_view w, std::vector<int32_t>& out) {
    Shard& s = shard_of(w);
    std::lock_guard<std::mutex> lock(s.mu);
    const auto it = s.map.find(w);
    if (it == s.map.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }
  void put(std::string_view w, const int32_t* ids, size_t n) {
    Shard& s = shard_of(w);
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.map.size() >= kPerShard) s.map.clear();
    s.map.emplace(std::string(w), std::vector<int32_t>(ids, ids + n));
  }
};

ByteBpe::ByteBpe() : cache_(std::make_unique<WordCache>()) {}
ByteBpe::~ByteBpe() = default;

void ByteBpe::AddedSet::index() {
  any = !tokens.empty();
  for (uint32_t i = 0; i < tokens.size(); i++) by_first[(unsigned char)tokens[i].content[0]].push_back(i);
  for (auto& v : by_first)
    std::stable_sort(v.begin(), v.end(),
                     [&](uint32_t a, uint32_t b) { return tokens[a].content.size() > tokens[b].content.size(); });
}

int32_t ByteBpe::piece_to_id(std::string_view piece) const {
  const auto it = std::lower_bound(piece_index_.begin(), piece_index_.end(), piece,
                                   [](const auto& e, std::string_view s) { return std::string_view(e.first) < s; });
  return it != piece_index_.end() && it->first == piece ? it->second : -1;
}

int32_t ByteBpe::find_bytes(std::string_view bytes) const {
  const uint64_t h = hash_bytes(bytes);
  for (size_t s = h & byte_mask_;; s = (s + 1) & byte_mask_) {
    const ByteSlot& slot = byte_table_[s];
    if (slot.id < 0) return -1;
    if (slot.hash == h && bytes_[(size_t)slot.id] == bytes) return slot.id;
  }
}

bool ByteBpe::find_merge(int32_t a, int32_t b, uint32_t& rank, int32_t& merged) const {
  const uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
  for (size_t s = merge_slot(key) & merge_mask_;; s = (s + 1) & merge_mask_) {
    const MergeSlot& slot = merge_table_[s];
    if (slot.key == key) {
      rank = slot.rank;
      merged = slot.merged;
      return true;
    }
    if (slot.key == ~uint64_t{0}) return false;
  }
}

// Leftmost-longest matches of the set's tokens in `text`; the text between them goes to on_text.
template <class OnText, class OnToken>
void ByteBpe::split_added(const AddedSet& set, std::string_view text, OnText&& on_text, OnToken&& on_token) const {
  if (!set.any) {
    if (!text.empty()) on_text(text);
    return;
  }
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  const uint8_t* bmp = unicode::bmp_info();
  size_t done = 0, i = 0;
  while (i < n) {
    const Added* best = nullptr;
    for (; i < n && best == nullptr; i++)
      for (uint32_t idx : set.by_first[p[i]]) {
        const Added& a = set.tokens[idx];
        if (a.content.size() <= n - i && std::memcmp(p + i, a.content.data(), a.content.size()) == 0) {
          best = &a;
          break;
        }
      }
    if (best == nullptr) break;
    size_t start = --i, stop = i + best->content.size();
    if (best->single_word) {
      size_t b = start > 0 ? start - 1 : 0;  // the start of the character before the match
      while (b > 0 && (p[b] & 0xC0) == 0x80 && start - b < 4) b--;
      const bool word_before = start > 0 && is_word_char(char_at(p, n, b, bmp));
      const bool word_after = stop < n && is_word_char(char_at(p, n, stop, bmp));
      if (word_before || word_after) {
        i = stop;
        continue;
      }
    }
    if (best->lstrip)
      while (start > done) {
        size_t b = start - 1;  // step back one character
        while (b > done && (p[b] & 0xC0) == 0x80 && start - b < 4) b--;
        if (char_at(p, n, b, bmp).cls != kSpace) break;
        start = b;
      }
    if (best->rstrip)
      while (stop < n) {
        const CharAt c = char_at(p, n, stop, bmp);
        if (c.cls != kSpace) break;
        stop += c.len;
      }
    if (done < start) on_text(text.substr(done, start - done));
    on_token(best->id);
    done = i = stop;
  }
  if (done < n) on_text(text.substr(done));
}

void ByteBpe::encode(std::string_view text, std::vector<int32_t>& out) const {
  auto token = [&](int32_t id) { out.push_back(id); };
  auto normalized = [&](std::string_view s) {
    split_added(norm_added_, s, [&](std::string_view piece) { encode_normalized(piece, out); }, token);
  };
  split_added(raw_added_, text, [&](std::string_view seg) {
    if (!nfc_ || unicode::nfc_quick_check(seg)) {
      normalized(seg);
      return;
    }
    std::string norm;
    unicode::nfc_append(seg, norm);
    normalized(norm);
  }, token);
}

void ByteBpe::encode_normalized(std::string_view text, std::vector<int32_t>& out) const {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  const uint8_t* bmp = unicode::bmp_info();
  for (size_t i = 0; i < n;) {
    size_t j = pattern_ == Pattern::qwen ? match_qwen(p, n, i, bmp) : match_gpt2(p, n, i, bmp);
    if (j <= i) j = i + 1;  // cannot happen (every character matches); never loop
    encode_word(text.substr(i, j - i), out);
    i = j;
  }
}

void ByteBpe::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1 && byte_id_[(unsigned char)word[0]] >= 0) {
    out.push_back(byte_id_[(unsigned char)word[0]]);
    return;
  }
  if (ignore_merges_) {
    const int32_t id = find_bytes(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  if (cacheable && cache_->get(word, out)) return;
  const size_t before = out.size();
  bpe(word, out);
  if (cacheable) cache_->put(word, out.data() + before, out.size() - before);
}

void ByteBpe::bpe(std::string_view word, std::vector<int32_t>& out) const {
  // The word's bytes as symbols; a byte with no piece is <unk> (fused when fuse_unk) or, without
  // an unk token, dropped (HF's BPE does the same).
  std::vector<int32_t> sym;
  sym.reserve(word.size());
  for (unsigned char b : word) {
    int32_t id = byte_id_[b];
    if (id < 0) {
      if (unk_id_ < 0) continue;
      if (fuse_unk_ && !sym.empty() && sym.back() == unk_id_) continue;
      id = unk_id_;
    }
    sym.push_back(id);
  }
  const size_t n = sym.size();
  if (n <= 64) {
    // Small words: ranks of the adjacent pairs in an array; merge the lowest (leftmost on ties),
    // then update the two pairs around it.
    constexpr uint32_t kNone = UINT32_MAX;
    uint32_t rank[64];
    int32_t merged[64];
    size_t m = n;
    for (size_t k = 0; k + 1 < m; k++)
      if (!find_merge(sym[k], sym[k + 1], rank[k], merged[k])) rank[k] = kNone;
    while (m > 1) {
      size_t best = 0;
      for (size_t k = 1; k + 1 < m; k++)
        if (rank[k] < rank[best]) best = k;
      if (rank[best] == kNone) break;
      sym[best] = merged[best];
      // Remove symbol best+1 and pair best+1.
      for (size_t k = best + 1; k + 1 < m; k++) sym[k] = sym[k + 1];
      for (size_t k = best + 1; k + 2 < m; k++) {
        rank[k] = rank[k + 1];
        merged[k] = merged[k + 1];
      }
      m--;
      if (best > 0 && !find_merge(sym[best - 1], sym[best], rank[best - 1], merged[best - 1])) rank[best - 1] = kNone;
      if (best + 1 < m && !find_merge(sym[best], sym[best + 1], rank[best], merged[best])) rank[best] = kNone;
    }
    out.insert(out.end(), sym.begin(), sym.begin() + (long)m);
    return;
  }
  // Long words: a heap of candidate merges ordered by (rank, position), stale ones skipped (HF's
  // Word::merge_all).
  struct Cand {
    uint32_t rank;
    int32_t pos, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (size_t k = 0; k < n; k++) {
    prev[k] = (int32_t)k - 1;
    next[k] = k + 1 < n ? (int32_t)k + 1 : -1;
  }
  std::vector<Cand> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[(size_t)pos] < 0) return;
    uint32_t r;
    int32_t mg;
    if (find_merge(sym[(size_t)pos], sym[(size_t)next[(size_t)pos]], r, mg)) {
      heap.push_back({r, pos, mg});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (size_t k = 0; k + 1 < n; k++) push((int32_t)k);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Cand c = heap.back();
    heap.pop_back();
    const size_t pos = (size_t)c.pos;
    if (!alive[pos] || next[pos] < 0) continue;
    const size_t nx = (size_t)next[pos];
    uint32_t r;
    int32_t mg;
    if (!find_merge(sym[pos], sym[nx], r, mg) || mg != c.merged) continue;
    sym[pos] = mg;
    alive[nx] = 0;
    next[pos] = next[nx];
    if (next[nx] >= 0) prev[(size_t)next[nx]] = (int32_t)pos;
    push(prev[pos]);
    push((int32_t)pos);
  }
  for (int32_t k = 0; k >= 0 && (size_t)k < n; k = next[(size_t)k]) out.push_back(sym[(size_t)k]);
}

std::string ByteBpe::decode(std::span<const int32_t> ids) const {
  std::string raw;
  for (int32_t id : ids) {
    const Kind k = kind_[(size_t)id];
    if (k == Kind::none || k == Kind::special) continue;
    raw += bytes_[(size_t)id];
  }
  std::string text;
  text.reserve(raw.size());
  unicode::append_utf8_lossy(raw, text);
  return text;
}

}  // namespace moetron
