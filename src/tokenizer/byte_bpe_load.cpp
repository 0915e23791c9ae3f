// Reading and validating tokenizer.json for ByteBpe (byte_bpe.h states what is accepted).  Every
// refusal names the field path, e.g. "pre_tokenizer.pretokenizers[1].type".
#include <algorithm>
#include <string>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_limits.h"
#include "tokenizer/byte_bpe.h"
#include "tokenizer/unicode.h"

namespace moetron {

using nlohmann::json;

namespace {

// The split patterns recognised exactly (as stored in tokenizer.json, after JSON unescaping).
constexpr std::string_view kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

const char* kind_of(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    default: return "a value";
  }
}

// The byte each byte-level character stands for (GPT-2's bytes_to_unicode, inverted).
struct ByteLevelMap {
  int16_t byte_of[324];  // code point -> byte, -1 when not a byte-level character
  ByteLevelMap() {
    std::fill(std::begin(byte_of), std::end(byte_of), int16_t{-1});
    int extra = 0;
    for (int b = 0; b < 256; b++) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      byte_of[printable ? b : 256 + extra++] = (int16_t)b;
    }
  }
  // The bytes a byte-level string stands for; false when a character is not byte-level.
  bool to_bytes(std::string_view s, std::string& out) const {
    out.clear();
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    for (size_t i = 0; i < s.size();) {
      size_t len;
      const char32_t cp = unicode::decode_utf8(p + i, s.size() - i, len);
      if (cp == unicode::kInvalid || cp >= 324 || byte_of[cp] < 0) return false;
      out += (char)byte_of[cp];
      i += len;
    }
    return true;
  }
};

}  // namespace

struct ByteBpeLoader {
  const std::string& name;
  ByteBpe& t;

  template <typename... Args>
  [[noreturn]] void bad(fmt::format_string<Args...> f, Args&&... args) {
    fail("{}: {}", name, fmt::format(f, std::forward<Args>(args)...));
  }

  const json* member(const json& obj, const char* key) {
    const auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }
  bool flag(const json& obj, const std::string& path, const char* key, bool dflt) {
    const json* v = member(obj, key);
    if (v == nullptr || v->is_null()) return dflt;
    if (!v->is_boolean()) bad("{}.{} is {}, expected true or false", path, key, kind_of(*v));
    return v->get<bool>();
  }
  std::string type_of(const json& obj, const std::string& path) {
    if (!obj.is_object()) bad("{} is {}, expected an object", path, kind_of(obj));
    const json* v = member(obj, "type");
    if (v == nullptr) bad("{}.type is missing", path);
    if (!v->is_string()) bad("{}.type is {}, expected a string", path, kind_of(*v));
    return v->get<std::string>();
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& what, const char* expected) {
    bad("{} {} is not supported (expected {})", path, json_preview(json(what), 60), expected);
  }
  void must_be_null(const json& root, const char* key, const char* why) {
    const json* v = member(root, key);
    if (v != nullptr && !v->is_null()) bad("{} is {}, which is not supported ({})", key, json_preview(*v), why);
  }
  void require_false(const json& obj, const std::string& path, const char* key, bool dflt, const char* why) {
    if (flag(obj, path, key, dflt)) bad("{}.{} = true is not supported ({})", path, key, why);
  }
  int32_t id_value(const json& v, const std::string& path) {
    if (!v.is_number_integer()) bad("{} is {}, expected an integer id", path, kind_of(v));
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id >= ByteBpe::kMaxVocab)
      bad("{} = {} is out of range [0, {}) (a larger vocabulary is refused)", path, id, ByteBpe::kMaxVocab);
    return (int32_t)id;
  }

  void normalizer(const json& root) {
    const json* n = member(root, "normalizer");
    if (n == nullptr || n->is_null()) return;
    const std::string ty = type_of(*n, "normalizer");
    if (ty == "NFC") {
      t.nfc_ = true;
      return;
    }
    if (ty != "Sequence") unsupported("normalizer.type", ty, "NFC or Sequence");
    const json* list = member(*n, "normalizers");
    if (list == nullptr || !list->is_array()) bad("normalizer.normalizers is missing or not an array");
    for (size_t i = 0; i < list->size(); i++) {
      const std::string path = fmt::format("normalizer.normalizers[{}]", i);
      const std::string sub = type_of((*list)[i], path);
      if (sub != "NFC") unsupported(path + ".type", sub, "NFC");
      t.nfc_ = true;
    }
  }

  void byte_level(const json& p, const std::string& path, bool want_regex) {
    require_false(p, path, "add_prefix_space", true, "a space would be put before each text");
    const bool use_regex = flag(p, path, "use_regex", true);
    if (use_regex != want_regex)
      bad("{}.use_regex = {} is not supported here (expected {}: {})", path, use_regex, want_regex,
          want_regex ? "a lone ByteLevel pre-tokenizer splits with GPT-2's pattern"
                     : "after a Split, ByteLevel only maps bytes");
  }

  void pre_tokenizer(const json& root) {
    const json* p = member(root, "pre_tokenizer");
    if (p == nullptr || p->is_null()) bad("pre_tokenizer is missing or null (expected ByteLevel or Sequence)");
    const std::string ty = type_of(*p, "pre_tokenizer");
    if (ty == "ByteLevel") {
      byte_level(*p, "pre_tokenizer", true);
      t.pattern_ = ByteBpe::Pattern::gpt2;
      return;
    }
    if (ty != "Sequence") unsupported("pre_tokenizer.type", ty, "ByteLevel or Sequence");
    const json* list = member(*p, "pretokenizers");
    if (list == nullptr || !list->is_array()) bad("pre_tokenizer.pretokenizers is missing or not an array");
    const size_t n = list->size();
    if (n == 1) {
      const std::string t0 = type_of((*list)[0], "pre_tokenizer.pretokenizers[0]");
      if (t0 != "ByteLevel") unsupported("pre_tokenizer.pretokenizers[0].type", t0, "ByteLevel");
      byte_level((*list)[0], "pre_tokenizer.pretokenizers[0]", true);
      t.pattern_ = ByteBpe::Pattern::gpt2;
      return;
    }
    if (n != 2) bad("pre_tokenizer.pretokenizers has {} entries (expected [Split, ByteLevel] or [ByteLevel])", n);
    const std::string p0 = "pre_tokenizer.pretokenizers[0]", p1 = "pre_tokenizer.pretokenizers[1]";
    const std::string t0 = type_of((*list)[0], p0), t1 = type_of((*list)[1], p1);
    if (t0 != "Split") unsupported(p0 + ".type", t0, "Split");
    if (t1 != "ByteLevel") unsupported(p1 + ".type", t1, "ByteLevel");
    const json& split = (*list)[0];
    const json* pat = member(split, "pattern");
    if (pat == nullptr || !pat->is_object()) bad("{}.pattern is missing or not an object", p0);
    const json* re = member(*pat, "Regex");
    if (re == nullptr || !re->is_string())
      bad("{}.pattern is {}, expected {{\"Regex\": ...}} with Qwen's or GPT-2's pattern", p0, json_preview(*pat));
    const std::string s = re->get<std::string>();
    if (s == kQwenPattern)
      t.pattern_ = ByteBpe::Pattern::qwen;
    else if (s == kGpt2Pattern)
      t.pattern_ = ByteBpe::Pattern::gpt2;
    else
      bad("{}.pattern.Regex {} is not supported (expected Qwen's or GPT-2's split pattern)", p0, json_preview(*re));
    const json* beh = member(split, "behavior");
    if (beh == nullptr || !beh->is_string() || beh->get<std::string>() != "Isolated")
      bad("{}.behavior is {}, expected \"Isolated\"", p0, beh ? json_preview(*beh) : "missing");
    require_false(split, p0, "invert", false, "the pattern would mark what to drop");
    byte_level((*list)[1], p1, false);
  }

  void decoder(const json& root) {
    const json* d = member(root, "decoder");
    if (d == nullptr || d->is_null()) bad("decoder is missing or null (expected ByteLevel)");
    const std::string ty = type_of(*d, "decoder");
    if (ty != "ByteLevel") unsupported("decoder.type", ty, "ByteLevel");
  }

  void post_processor(const json& root) {
    const json* p = member(root, "post_processor");
    if (p == nullptr || p->is_null()) return;
    const std::string ty = type_of(*p, "post_processor");
    if (ty == "ByteLevel") return;  // offsets only
    if (ty == "TemplateProcessing") {
      const json* single = member(*p, "single");
      bool adds = single == nullptr || !single->is_array();
      if (!adds)
        for (const json& e : *single) adds = adds || !e.is_object() || !e.contains("Sequence");
      if (adds) bad("post_processor: a TemplateProcessing that adds tokens is not supported (templates add BOS/EOS)");
      return;
    }
    unsupported("post_processor.type", ty, "null, ByteLevel or a TemplateProcessing that adds no tokens");
  }

  void set_piece(int32_t id, std::string piece, ByteBpe::Kind kind, const std::string& path) {
    if ((size_t)id >= t.piece_.size()) {
      t.piece_.resize((size_t)id + 1);
      t.kind_.resize((size_t)id + 1, ByteBpe::Kind::none);
    }
    if (t.kind_[(size_t)id] != ByteBpe::Kind::none) {
      // HF lists a token both in the vocab and among the added tokens (GPT-2's <|endoftext|>):
      // allowed when both name the same string.
      if (kind != ByteBpe::Kind::vocab && t.kind_[(size_t)id] == ByteBpe::Kind::vocab && t.piece_[(size_t)id] == piece) {
        t.kind_[(size_t)id] = kind;
        return;
      }
      bad("{}: id {} is given to both {} and {}", path, id, json_preview(json(t.piece_[(size_t)id]), 60),
          json_preview(json(piece), 60));
    }
    t.piece_[(size_t)id] = std::move(piece);
    t.kind_[(size_t)id] = kind;
  }

  void model(const json& root) {
    const json* m = member(root, "model");
    if (m == nullptr) bad("model is missing");
    const std::string ty = type_of(*m, "model");
    if (ty != "BPE") unsupported("model.type", ty, "BPE");
    require_false(*m, "model", "byte_fallback", false, "byte-level vocabularies need no byte fallback");
    if (const json* d = member(*m, "dropout"); d != nullptr && !d->is_null())
      bad("model.dropout is {}, expected null (BPE dropout is random)", json_preview(*d));
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (const json* v = member(*m, key); v != nullptr && !v->is_null() && !(v->is_string() && v->get<std::string>().empty()))
        bad("model.{} is {}, expected null", key, json_preview(*v));
    t.ignore_merges_ = flag(*m, "model", "ignore_merges", false);
    t.fuse_unk_ = flag(*m, "model", "fuse_unk", false);

    const json* vocab = member(*m, "vocab");
    if (vocab == nullptr || !vocab->is_object()) bad("model.vocab is {}, expected an object", vocab ? kind_of(*vocab) : "missing");
    if (vocab->empty()) bad("model.vocab is empty");
    if (vocab->size() > (size_t)ByteBpe::kMaxVocab) bad("model.vocab has {} pieces (at most {})", vocab->size(), ByteBpe::kMaxVocab);
    std::unordered_map<std::string, int32_t> ids;
    ids.reserve(vocab->size());
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      const std::string path = fmt::format("model.vocab[{}]", json_preview(json(it.key()), 60));
      if (it.key().empty()) bad("model.vocab has an empty piece");
      if (it.key().size() > ByteBpe::kMaxPieceBytes) bad("{}: piece longer than {} bytes", path, ByteBpe::kMaxPieceBytes);
      const int32_t id = id_value(it.value(), path);
      set_piece(id, it.key(), ByteBpe::Kind::vocab, path);
      ids.emplace(it.key(), id);
    }

    if (const json* unk = member(*m, "unk_token"); unk != nullptr && !unk->is_null()) {
      if (!unk->is_string()) bad("model.unk_token is {}, expected a string or null", kind_of(*unk));
      const auto f = ids.find(unk->get<std::string>());
      if (f == ids.end()) bad("model.unk_token {} is not in model.vocab", json_preview(*unk));
      t.unk_id_ = f->second;
    }

    const json* merges = member(*m, "merges");
    if (merges == nullptr || !merges->is_array())
      bad("model.merges is {}, expected an array", merges ? kind_of(*merges) : "missing");
    if (merges->size() > ByteBpe::kMaxMerges) bad("model.merges has {} entries (at most {})", merges->size(), ByteBpe::kMaxMerges);
    size_t cap = 16;
    while (cap < merges->size() * 2) cap <<= 1;
    t.merge_table_.assign(cap, {});
    t.merge_mask_ = cap - 1;
    std::string a, b;
    for (size_t i = 0; i < merges->size(); i++) {
      const json& e = (*merges)[i];
      if (e.is_string()) {
        const std::string& s = e.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          bad("model.merges[{}] = {}: expected two pieces separated by one space", i, json_preview(e));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        bad("model.merges[{}] is {}, expected \"a b\" or [\"a\", \"b\"]", i, json_preview(e));
      }
      const auto fa = ids.find(a), fb = ids.find(b), fm = ids.find(a + b);
      if (fa == ids.end()) bad("model.merges[{}]: {} is not in model.vocab", i, json_preview(json(a), 60));
      if (fb == ids.end()) bad("model.merges[{}]: {} is not in model.vocab", i, json_preview(json(b), 60));
      if (fm == ids.end()) bad("model.merges[{}]: the merged piece {} is not in model.vocab", i, json_preview(json(a + b), 60));
      const uint64_t key = (uint64_t)(uint32_t)fa->second << 32 | (uint32_t)fb->second;
      for (size_t s = ByteBpe::merge_slot(key) & t.merge_mask_;; s = (s + 1) & t.merge_mask_) {
        ByteBpe::MergeSlot& slot = t.merge_table_[s];
        if (slot.key == key || slot.key == ~uint64_t{0}) {  // a repeated pair takes the later rank, as in HF
          slot = {key, (uint32_t)i, fm->second};
          break;
        }
      }
    }
  }

  void added_tokens(const json& root) {
    const json* list = member(root, "added_tokens");
    if (list == nullptr || list->is_null()) return;
    if (!list->is_array()) bad("added_tokens is {}, expected an array", kind_of(*list));
    if (list->size() > (size_t)ByteBpe::kMaxVocab) bad("added_tokens has {} entries (at most {})", list->size(), ByteBpe::kMaxVocab);
    // Hugging Face tokenizers does not take the declared ids as they are: in list order, a token whose
    // content is a vocabulary piece gets that piece's id, any other the vocabulary's size (its entry
    // count, not its largest id + 1) plus the number of such tokens before it (checked against
    // tokenizers 0.23.3 on 1500 random files).  A file whose declared ids differ encodes differently
    // there; it is refused, naming the token, rather than given ids HF would not give.
    std::unordered_map<std::string, int32_t> vocab_id;  // copies: set_piece may grow piece_
    for (size_t id = 0; id < t.kind_.size(); id++)
      if (t.kind_[id] == ByteBpe::Kind::vocab) vocab_id.emplace(t.piece_[id], (int32_t)id);
    const int64_t vocab_entries = (int64_t)vocab_id.size();
    int64_t new_tokens = 0;
    for (size_t i = 0; i < list->size(); i++) {
      const json& e = (*list)[i];
      const std::string path = fmt::format("added_tokens[{}]", i);
      if (!e.is_object()) bad("{} is {}, expected an object", path, kind_of(e));
      const json* id = member(e, "id");
      if (id == nullptr) bad("{}.id is missing", path);
      const json* content = member(e, "content");
      if (content == nullptr || !content->is_string() || content->get_ref<const std::string&>().empty())
        bad("{}.content is {}, expected a non-empty string", path, content ? json_preview(*content) : "missing");
      ByteBpe::Added a;
      a.content = content->get<std::string>();
      if (a.content.size() > ByteBpe::kMaxPieceBytes) bad("{}.content is longer than {} bytes", path, ByteBpe::kMaxPieceBytes);
      a.id = id_value(*id, path + ".id");
      a.special = flag(e, path, "special", false);
      a.lstrip = flag(e, path, "lstrip", false);
      a.rstrip = flag(e, path, "rstrip", false);
      a.single_word = flag(e, path, "single_word", false);
      a.normalized = flag(e, path, "normalized", !a.special);
      set_piece(a.id, a.content, a.special ? ByteBpe::Kind::special : ByteBpe::Kind::added, path);
      {
        const auto v = vocab_id.find(a.content);
        const int64_t hf = v != vocab_id.end() ? v->second : vocab_entries + new_tokens++;
        if (hf != a.id)
          bad("{} ({}) declares id {}, but Hugging Face tokenizers gives it id {} ({}); the file's ids are "
              "inconsistent",
              path, json_preview(json(a.content), 60), a.id, hf,
              v != vocab_id.end() ? "its content is that vocabulary piece's"
                                  : fmt::format("added tokens that are not vocabulary pieces take the ids from the "
                                                "vocabulary's {} entries on, in list order", vocab_entries));
      }
      if (a.normalized && t.nfc_) {  // HF matches normalized tokens by their normalised content
        std::string n;
        unicode::nfc_append(a.content, n);
        a.content = std::move(n);
      }
      (a.normalized ? t.norm_added_ : t.raw_added_).tokens.push_back(std::move(a));
    }
  }

  void finish() {
    const ByteLevelMap map;
    const size_t n = t.piece_.size();
    t.bytes_.assign(n, {});
    std::fill(std::begin(t.byte_id_), std::end(t.byte_id_), -1);
    size_t pieces = 0;  // the table is sized by the pieces it holds, not by the largest id
    for (const ByteBpe::Kind k : t.kind_) pieces += k == ByteBpe::Kind::vocab;
    size_t cap = 16;
    while (cap < pieces * 2) cap <<= 1;
    t.byte_table_.assign(cap, {});
    t.byte_mask_ = cap - 1;
    std::string raw;
    for (size_t id = 0; id < n; id++) {
      const ByteBpe::Kind k = t.kind_[id];
      if (k == ByteBpe::Kind::none || k == ByteBpe::Kind::special) continue;
      // HF's ByteLevel decoder: a token of byte-level characters stands for those bytes; any other
      // token for its own UTF-8.
      const bool byte_level = map.to_bytes(t.piece_[id], raw);
      t.bytes_[id] = byte_level ? raw : t.piece_[id];
      if (k != ByteBpe::Kind::vocab || !byte_level) continue;  // BPE over bytes cannot reach it
      if (raw.size() == 1) t.byte_id_[(unsigned char)raw[0]] = (int32_t)id;
      const uint64_t h = ByteBpe::hash_bytes(raw);
      for (size_t s = h & t.byte_mask_;; s = (s + 1) & t.byte_mask_) {
        ByteBpe::ByteSlot& slot = t.byte_table_[s];
        if (slot.id < 0) {
          slot = {h, (int32_t)id};
          break;
        }
      }
    }
    t.piece_index_.reserve(n);
    for (size_t id = 0; id < n; id++)
      if (t.kind_[id] != ByteBpe::Kind::none) t.piece_index_.emplace_back(t.piece_[id], (int32_t)id);
    std::sort(t.piece_index_.begin(), t.piece_index_.end());
    t.raw_added_.index();
    t.norm_added_.index();
  }
};

std::unique_ptr<ByteBpe> ByteBpe::from_json(std::string_view json_text, const std::string& name) {
  const json root = parse_json(json_text, name);
  std::unique_ptr<ByteBpe> t(new ByteBpe());
  ByteBpeLoader l{name, *t};
  if (!root.is_object()) l.bad("the file is {}, expected a tokenizer.json object", kind_of(root));
  l.must_be_null(root, "truncation", "it would cut encodings");
  l.must_be_null(root, "padding", "it would pad encodings");
  l.normalizer(root);
  l.pre_tokenizer(root);
  l.model(root);
  l.added_tokens(root);
  l.decoder(root);
  l.post_processor(root);
  l.finish();
  return t;
}

}  // namespace moetron
