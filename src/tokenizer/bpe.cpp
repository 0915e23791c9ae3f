// FastBpe: SentencePiece's BPE encoding on flat arrays (bpe.h says what and why).
#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "tokenizer/sp_model.h"
#include "tokenizer/utf8.h"

namespace moetron {

using namespace spm;

namespace {

inline uint64_t hash_bytes(const char* s, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ ((uint64_t)n * 0xff51afd7ed558ccdull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, s, 8);
    h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
    s += 8;
    n -= 8;
  }
  uint64_t w = 0;
  std::memcpy(&w, s, n);
  h = (h ^ w) * 0x94d049bb133111ebull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 32);
}

// Bytes of the UTF-8 character starting with `lead` (the input is valid UTF-8).
inline size_t char_len(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

}  // namespace

std::unique_ptr<FastBpe> FastBpe::create(std::string_view model, std::string* why_not) {
  auto decline = [&](std::string why) -> std::unique_ptr<FastBpe> {
    if (why_not) *why_not = std::move(why);
    return nullptr;
  };
  ParsedModel m;
  if (!parse_model(model, m)) return decline("the model file does not parse as a ModelProto");
  if (m.model_type != 2) return decline("not a BPE model");
  if (!m.identity) return decline("the normaliser is not the identity");
  if (m.remove_extra_whitespaces) return decline("remove_extra_whitespaces is set");
  if (!m.escape_whitespaces) return decline("escape_whitespaces is off");
  if (m.treat_whitespace_as_suffix) return decline("treat_whitespace_as_suffix is set");
  std::unique_ptr<FastBpe> b(new FastBpe());
  b->byte_fallback_ = m.byte_fallback;
  b->add_dummy_prefix_ = m.add_dummy_prefix;
  std::fill(std::begin(b->byte_ids_), std::end(b->byte_ids_), -1);
  size_t normal = 0;
  for (size_t i = 0; i < m.pieces.size(); i++) {
    const ParsedPiece& p = m.pieces[i];
    if (p.type == kUserDefined || p.type == kUnused) return decline("the model has user-defined or unused pieces");
    if (p.type == kNormal) {
      normal++;
      continue;
    }
    if (p.type == kUnknown) b->unk_id_ = (int32_t)i;
    if (!p.piece.empty() && char_len((unsigned char)p.piece[0]) >= p.piece.size())
      return decline(fmt::format("reserved piece {} is a single character", i));
    if (p.type == kByte && p.piece.size() == 6 && p.piece.substr(0, 3) == "<0x" && p.piece[5] == '>') {
      const unsigned v = (unsigned)std::stoul(std::string(p.piece.substr(3, 2)), nullptr, 16);
      if (v < 256) b->byte_ids_[v] = (int32_t)i;
    }
  }
  if (b->unk_id_ < 0) return decline("the model has no <unk> piece");
  if (b->byte_fallback_)
    for (int v = 0; v < 256; v++)
      if (b->byte_ids_[v] < 0) return decline("byte fallback without all 256 byte pieces");
  size_t cap = 16;
  while (cap < 2 * normal + 16) cap *= 2;
  b->table_.assign(cap, Slot{});
  b->mask_ = cap - 1;
  for (size_t i = 0; i < m.pieces.size(); i++) {
    const ParsedPiece& p = m.pieces[i];
    if (p.type != kNormal) continue;
    if (p.piece.empty()) return decline("an empty piece");
    if (b->find(p.piece.data(), p.piece.size())) continue;  // SentencePiece refuses duplicates; keep the first
    const uint64_t h = hash_bytes(p.piece.data(), p.piece.size());
    size_t k = h & b->mask_;
    while (b->table_[k].len) k = (k + 1) & b->mask_;
    b->table_[k] = Slot{h, (uint32_t)b->arena_.size(), (uint32_t)p.piece.size(), (int32_t)i, p.score};
    b->arena_.append(p.piece);
    b->max_len_ = std::max(b->max_len_, p.piece.size());
  }
  // Word splitting (see encode()) is exact when no NORMAL piece has "▁" after a character that is
  // not "▁" (true of Llama/Mistral vocabularies and of `tokenizer train` with split_by_whitespace).
  b->word_split_ = true;
  for (const ParsedPiece& p : m.pieces) {
    if (p.type != kNormal) continue;
    size_t i = 0;
    while (i < p.piece.size() && p.piece.substr(i, 3) == "\xe2\x96\x81") i += 3;
    if (p.piece.find("\xe2\x96\x81", i) != std::string_view::npos) {
      b->word_split_ = false;
      break;
    }
  }
  return b;
}

const FastBpe::Slot* FastBpe::find(const char* s, size_t n) const {
  if (n > max_len_ || table_.empty()) return nullptr;
  const uint64_t h = hash_bytes(s, n);
  for (size_t k = h & mask_;; k = (k + 1) & mask_) {
    const Slot& e = table_[k];
    if (e.len == 0) return nullptr;
    if (e.hash == h && e.len == n && std::memcmp(arena_.data() + e.offset, s, n) == 0) return &e;
  }
}

namespace {

constexpr char kSpace[] = "\xe2\x96\x81";  // U+2581, SentencePiece's whitespace symbol

inline bool is_space_at(const std::string& s, size_t i) {
  return i + 3 <= s.size() && s[i] == kSpace[0] && s[i + 1] == kSpace[1] && s[i + 2] == kSpace[2];
}

}  // namespace

// Step 3 on norm[a, b): appends the final pieces as (start, len) to `pieces`.
void FastBpe::merge_segment(const std::string& norm, size_t a, size_t b, Scratch& sc) const {
  sc.sym.clear();
  for (size_t i = a; i < b;) {
    const size_t n = std::min(char_len((unsigned char)norm[i]), b - i);
    const int32_t idx = (int32_t)sc.sym.size();
    sc.sym.push_back({(uint32_t)i, (uint32_t)n, idx - 1, -1});
    if (idx > 0) sc.sym[idx - 1].next = idx;
    i += n;
  }
  const size_t k = sc.sym.size();
  if (k <= kLinearMax) {
    // Short segment: keep the current symbols in an array and the score of each adjacent pair;
    // merge the best pair (highest score, leftmost on ties) until no pair is a piece.
    Sym* sym = sc.sym.data();
    float score[kLinearMax];
    bool ok[kLinearMax];
    size_t m = k;
    auto rescore = [&](size_t i) {
      const Slot* e = find(norm.data() + sym[i].start, sym[i].len + sym[i + 1].len);
      ok[i] = e != nullptr;
      if (e) score[i] = e->score;
    };
    for (size_t i = 0; i + 1 < m; i++) rescore(i);
    while (true) {
      size_t best = m;
      for (size_t i = 0; i + 1 < m; i++)
        if (ok[i] && (best == m || score[i] > score[best])) best = i;
      if (best == m) break;
      sym[best].len += sym[best + 1].len;
      for (size_t i = best + 1; i + 1 < m; i++) sym[i] = sym[i + 1];
      for (size_t i = best + 1; i + 2 < m; i++) {
        score[i] = score[i + 1];
        ok[i] = ok[i + 1];
      }
      m--;
      if (best > 0) rescore(best - 1);
      if (best + 1 < m) rescore(best);
    }
    for (size_t i = 0; i < m; i++) sc.pieces.push_back({sym[i].start, sym[i].len});
    return;
  }
  // Long segment: SentencePiece's agenda, a max-heap of candidate pairs, best score first and
  // leftmost first on ties; entries made stale by an earlier merge are recognised by their size.
  std::vector<Sym>& sym = sc.sym;
  auto worse = [](const Cand& x, const Cand& y) { return x.score < y.score || (x.score == y.score && x.left > y.left); };
  sc.heap.clear();
  auto maybe_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const uint32_t size = sym[l].len + sym[r].len;
    const Slot* e = find(norm.data() + sym[l].start, size);
    if (!e) return;
    sc.heap.push_back({e->score, l, r, size});
    std::push_heap(sc.heap.begin(), sc.heap.end(), worse);
  };
  for (size_t i = 1; i < k; i++) maybe_add((int32_t)i - 1, (int32_t)i);
  while (!sc.heap.empty()) {
    std::pop_heap(sc.heap.begin(), sc.heap.end(), worse);
    const Cand top = sc.heap.back();
    sc.heap.pop_back();
    Sym& l = sym[top.left];
    Sym& r = sym[top.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != top.size) continue;
    l.len += r.len;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = top.left;
    r.len = 0;
    maybe_add(l.prev, top.left);
    maybe_add(top.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) sc.pieces.push_back({sym[i].start, sym[i].len});
}

bool FastBpe::encode(std::string_view text, bool dummy_prefix, std::vector<int32_t>& out) const {
  if (text.empty()) return true;  // SentencePiece: an empty text has no pieces, not even the dummy prefix
  if (!is_valid_utf8(text)) return false;

  // 1. Normalise.
  std::string norm;
  norm.reserve(text.size() + 3 + 2 * (size_t)std::count(text.begin(), text.end(), ' '));
  if (dummy_prefix) norm.append(kSpace, 3);
  for (char c : text) {
    if (c == ' ')
      norm.append(kSpace, 3);
    else
      norm.push_back(c);
  }

  // 4. Ids of the merged pieces, emitted after each segment (so the piece list stays a word long, not
  //    a text long); prev_unk carries over segment boundaries.
  Scratch sc;
  bool prev_unk = false;
  auto emit = [&]() {
    for (const Piece& p : sc.pieces) {
      if (const Slot* e = find(norm.data() + p.start, p.len)) {
        out.push_back(e->id);
        prev_unk = false;
        continue;
      }
      if (byte_fallback_) {
        for (uint32_t k = 0; k < p.len; k++) out.push_back(byte_ids_[(unsigned char)norm[p.start + k]]);
      } else if (!prev_unk) {
        out.push_back(unk_id_);
      }
      prev_unk = true;
    }
    sc.pieces.clear();
  };

  // 2-3. Characters, merged.  When no piece holds a "▁" after another character (checked in create()),
  //      no merge can cross the start of a "▁" run that follows another character, so the text is
  //      cut there into words merged independently: the same result, in small cache-resident arrays.
  if (!word_split_) {
    merge_segment(norm, 0, norm.size(), sc);
  } else {
    size_t a = 0;
    bool prev_space = false;
    for (size_t i = 0; i < norm.size();) {
      const bool space = is_space_at(norm, i);
      if (space && !prev_space && i > a) {
        merge_segment(norm, a, i, sc);
        emit();
        a = i;
      }
      prev_space = space;
      i += char_len((unsigned char)norm[i]);
    }
    merge_segment(norm, a, norm.size(), sc);
  }
  emit();
  return true;
}

}  // namespace moetron
