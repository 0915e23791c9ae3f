#include "tokenizer/tokenizer.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <sentencepiece_processor.h>

#include "core/error.h"
#include "core/json_limits.h"
#include "core/sha256.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_bpe.h"
#include "tokenizer/sp_model.h"

namespace moetron {

namespace {

// The serialized ModelProto with NormalizerSpec.add_dummy_prefix forced to false.  Protocol buffers
// merge a repeated occurrence of an embedded message field into the earlier one, and for a scalar
// field the last value wins, so appending
//   0x1A 0x02      field 3 of ModelProto (normalizer_spec), length-delimited, 2 bytes:
//   0x18 0x00      field 3 of NormalizerSpec (add_dummy_prefix), varint, 0
// overrides exactly that one flag and keeps everything else (the installed SentencePiece ships no
// protobuf headers to edit the message directly).
std::string without_dummy_prefix(const std::string& serialized) {
  std::string s = serialized;
  const char patch[4] = {0x1A, 0x02, 0x18, 0x00};
  s.append(patch, sizeof patch);
  return s;
}

std::unique_ptr<sentencepiece::SentencePieceProcessor> load_proto(const std::string& bytes, const std::string& name) {
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto st = sp->LoadFromSerializedProto(bytes);
  if (!st.ok()) fail("tokenizer '{}': not a SentencePiece model ({})", name, st.ToString());
  return sp;
}

// A tokenizer.json is a JSON object; a SentencePiece ModelProto never starts with '{' (0x7B would be
// field 15 as a group, which ModelProto does not have).
bool looks_like_json(const std::string& bytes) {
  for (const char c : bytes) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    return c == '{';
  }
  return false;
}

// The id of tokenizer_config.json's `key` (a string, {"content": ...}, null or absent: -1).
int32_t config_token(const nlohmann::json& cfg, const char* key, const ByteBpe& bpe, const std::string& what) {
  const auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return -1;
  const nlohmann::json* content = &*it;
  if (it->is_object()) {
    const auto c = it->find("content");
    if (c == it->end()) fail("{}: {} is an object without \"content\"", what, key);
    content = &*c;
  }
  if (!content->is_string()) fail("{}: {} is {}, expected a token string, {{\"content\": ...}} or null", what, key, json_preview(*it));
  const int32_t id = bpe.piece_to_id(content->get<std::string>());
  if (id < 0) fail("{}: {} {} is not a token of the tokenizer", what, key, json_preview(*content));
  return id;
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("tokenizer '{}': cannot open: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail("tokenizer '{}': read error", path);
  const std::string bytes = ss.str();
  std::string config;
  if (looks_like_json(bytes)) {
    const std::filesystem::path cfg = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
    std::error_code ec;
    if (std::filesystem::is_regular_file(cfg, ec)) {
      std::ifstream c(cfg, std::ios::binary);
      std::ostringstream cs;
      cs << c.rdbuf();
      if (!c || c.bad()) fail("{}: cannot read: {}", cfg.string(), std::strerror(errno));
      config = cs.str();
      if (config.empty()) fail("{}: empty file, expected a JSON object", cfg.string());
    }
  }
  return from_bytes(bytes, path, config);
}

Tokenizer Tokenizer::from_bytes(const std::string& bytes, const std::string& name, std::string_view config_json) {
  if (bytes.empty()) fail("tokenizer '{}': empty file, expected a SentencePiece model or a tokenizer.json", name);
  if (looks_like_json(bytes)) {
    Tokenizer t;
    t.bbpe_ = ByteBpe::from_json(bytes, name);
    t.path_ = name;
    t.sha256_ = sha256_hex(bytes);
    t.vocab_size_ = t.bbpe_->vocab_size();
    t.unk_id_ = t.bbpe_->unk_id();
    if (!config_json.empty()) {
      const std::string what = fmt::format("tokenizer_config.json beside {}", name);
      const nlohmann::json cfg = parse_json(config_json, what);
      if (!cfg.is_object()) fail("{}: expected a JSON object", what);
      t.bos_id_ = config_token(cfg, "bos_token", *t.bbpe_, what);
      t.eos_id_ = config_token(cfg, "eos_token", *t.bbpe_, what);
      t.pad_id_ = config_token(cfg, "pad_token", *t.bbpe_, what);
    }
    return t;
  }
  spm::check_sentencepiece_model(bytes, name);
  Tokenizer t;
  t.sp_ = load_proto(bytes, name);
  t.literal_ = load_proto(without_dummy_prefix(bytes), name);
  t.path_ = name;
  t.sha256_ = sha256_hex(bytes);
  t.vocab_size_ = t.sp_->GetPieceSize();
  if (t.vocab_size_ <= 0) fail("tokenizer '{}': empty vocabulary", name);
  t.bos_id_ = t.sp_->bos_id();
  t.eos_id_ = t.sp_->eos_id();
  t.unk_id_ = t.sp_->unk_id();
  t.pad_id_ = t.sp_->pad_id();
  // The two processors differ exactly by the dummy prefix; a one-letter text shows whether the model
  // adds one.
  t.dummy_prefix_ = t.sp_->EncodeAsPieces("a") != t.literal_->EncodeAsPieces("a");
  t.fast_ = FastBpe::create(bytes, &t.why_not_fast_);
  if (t.fast_ && t.fast_->model_adds_dummy_prefix() != t.dummy_prefix_) {
    t.fast_.reset();
    t.why_not_fast_ = "its reading of add_dummy_prefix disagrees with SentencePiece";
  }
  return t;
}

std::vector<int32_t> Tokenizer::encode_reference(std::string_view text, bool literal) const {
  if (bbpe_) return encode(text);
  std::vector<int> ids;
  const auto st = (literal ? literal_ : sp_)->Encode(text, &ids);
  if (!st.ok()) fail("tokenizer '{}': encode failed: {}", path_, st.ToString());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

void Tokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  if (bbpe_) return bbpe_->encode(text, out);
  if (fast_ && fast_->encode(text, dummy_prefix_, out)) return;
  std::vector<int> ids;
  const auto st = sp_->Encode(text, &ids);
  if (!st.ok()) fail("tokenizer '{}': encode failed: {}", path_, st.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

void Tokenizer::encode_literal_append(std::string_view text, std::vector<int32_t>& out) const {
  if (bbpe_) return bbpe_->encode(text, out);
  if (fast_ && fast_->encode(text, false, out)) return;
  std::vector<int> ids;
  const auto st = literal_->Encode(text, &ids);
  if (!st.ok()) fail("tokenizer '{}': encode failed: {}", path_, st.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode_append(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::encode_literal(std::string_view text) const {
  std::vector<int32_t> out;
  encode_literal_append(text, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::vector<int> v(ids.begin(), ids.end());
  for (size_t i = 0; i < v.size(); i++)
    if (v[i] < 0 || v[i] >= vocab_size_)
      fail("tokenizer '{}': cannot decode id {} at position {}: outside the vocabulary [0, {})", path_, v[i], i,
           vocab_size_);
  if (bbpe_) return bbpe_->decode(ids);
  std::string text;
  const auto st = sp_->Decode(v, &text);
  if (!st.ok()) fail("tokenizer '{}': decode failed: {}", path_, st.ToString());
  return text;
}

std::string Tokenizer::id_to_piece(int32_t id) const {
  if (id < 0 || id >= vocab_size_)
    fail("tokenizer '{}': id {} is outside the vocabulary [0, {})", path_, id, vocab_size_);
  if (bbpe_) return bbpe_->piece(id);
  return sp_->IdToPiece(id);
}

bool Tokenizer::token_offsets(std::span<const int32_t> ids, std::string_view text,
                              std::vector<std::pair<size_t, size_t>>& out) const {
  out.clear();
  if (!bbpe_) return false;
  size_t at = 0;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size_) return false;
    const std::string& t = bbpe_->text_of(id);
    if (text.compare(at, t.size(), t) != 0) return false;
    out.emplace_back(at, at + t.size());
    at += t.size();
  }
  return at == text.size();
}

int32_t Tokenizer::piece_to_id(std::string_view piece) const {
  if (bbpe_) return bbpe_->piece_to_id(piece);
  const int id = sp_->PieceToId(piece);
  // SentencePiece answers unk_id for an unknown piece; only "<unk>" itself may map there.
  if (id == unk_id_ && sp_->IdToPiece(id) != piece) return -1;
  return id;
}

}  // namespace moetron
