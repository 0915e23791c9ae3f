// Byte-level BPE from a Hugging Face tokenizer.json (tokenizer/byte_bpe.h) against HF `tokenizers`:
// ids, decodes and ChatML (tokens and assistant mask of transformers' apply_chat_template) on a
// multilingual text set, for a small vocabulary trained by `tokenizers` (tests/data, GPT-2's
// ByteLevel pattern) and the real Qwen vocabulary (../shared/data, Qwen's Split pattern + NFC; those
// tests skip when it is absent).  The expectations come from tools/make_tokenizer_json_reference.py.
// Also: refusals of malformed or unsupported files naming the field, tokenizer_config.json, the
// model-directory lookup, thread safety, and `data prepare --template chatml` end to end.
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "infer/model.h"
#include "io/indexed_dataset.h"
#include "temp_dir.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace fs = std::filesystem;
using namespace moetron;
using nlohmann::json;

namespace {

const std::string kSource = MOETRON_SOURCE_DIR;
const std::string kTiny = kSource + "/tests/data/tiny-bytelevel-tokenizer.json";
const std::string kQwen = kSource + "/../shared/data/qwen-tokenizer.json";

std::string read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

const json& reference() {
  static const json r = json::parse(read_file(kSource + "/tests/data/tokenizer_json_reference.json"));
  return r;
}

const Tokenizer& tiny() {
  static const Tokenizer t = Tokenizer::load(kTiny);
  return t;
}

const Tokenizer& qwen() {
  static const Tokenizer t = Tokenizer::load(kQwen);
  return t;
}

#define REQUIRE_QWEN()                                                                               \
  if (!fs::exists(kQwen))                                                                            \
  GTEST_SKIP() << "the Qwen tokenizer is not at " << kQwen << " (../shared/data is absent); this test " \
               << "needs the real vocabulary"

std::string show(const std::string& s) { return json(s).dump(-1, ' ', true).substr(0, 120); }

void expect_texts(const Tokenizer& tok, const json& ref) {
  ASSERT_EQ(tok.sha256(), ref["sha256"].get<std::string>()) << "the reference was made from another file";
  ASSERT_EQ(tok.vocab_size(), ref["vocab_size"].get<int>());
  size_t checked = 0;
  for (const json& c : ref["texts"]) {
    const std::string text = c["text"];
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok.encode(text);
    EXPECT_EQ(got, want) << "text " << show(text);
    EXPECT_EQ(tok.encode_literal(text), want) << "text " << show(text);
    EXPECT_EQ(tok.decode(want), c["decoded"].get<std::string>()) << "text " << show(text);
    // The round trip gives the normalised text back when no special token was in it.
    bool has_special = false;
    for (const auto& [name, id] : ref["specials"].items()) has_special |= text.find(name) != std::string::npos;
    has_special |= text.find("<extra>") != std::string::npos;  // lstrip/rstrip absorb the spaces around it
    if (!has_special) {
      EXPECT_EQ(tok.decode(got), c["nfc"].get<std::string>()) << "text " << show(text);
    }
    checked++;
  }
  EXPECT_GE(checked, 30u);
}

void expect_chats(const Tokenizer& tok, const json& ref) {
  for (const json& c : ref["chats"]) {
    std::vector<ChatMessage> msgs;
    for (const json& m : c["messages"]) msgs.push_back({parse_role(m["role"].get<std::string>()), m["content"]});
    ChatOptions o;
    o.add_generation_prompt = c["add_generation_prompt"].get<bool>();
    const TokenizedDocument d = apply_chat_template(ChatTemplate::chatml, tok, msgs, o);
    EXPECT_EQ(d.tokens, c["ids"].get<std::vector<int32_t>>()) << c["messages"].dump();
    const std::vector<int> mask = c["mask"].get<std::vector<int>>();
    EXPECT_EQ(std::vector<int>(d.loss_mask.begin(), d.loss_mask.end()), mask) << c["messages"].dump();
  }
}

// The tiny tokenizer.json with `edit` applied, loaded; the Error's message (or "" when it loads).
std::string load_error(const std::function<void(json&)>& edit) {
  json j = json::parse(read_file(kTiny));
  edit(j);
  try {
    (void)Tokenizer::from_bytes(j.dump(), "tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string load_error_text(const std::string& text) {
  try {
    (void)Tokenizer::from_bytes(text, "tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TokenizerJson, TinyEncodeDecodeEqualsHf) { expect_texts(tiny(), reference()["tiny"]); }

TEST(TokenizerJson, QwenEncodeDecodeEqualsHf) {
  REQUIRE_QWEN();
  ASSERT_TRUE(reference().contains("qwen")) << "tests/data/tokenizer_json_reference.json has no Qwen part";
  expect_texts(qwen(), reference()["qwen"]);
}

TEST(TokenizerJson, QwenKnownIdsAndProperties) {
  REQUIRE_QWEN();
  const Tokenizer& t = qwen();
  // ../shared/data/README.md's example.
  EXPECT_EQ(t.encode("Hello world, 12345!"), (std::vector<int32_t>{9707, 1879, 11, 220, 16, 17, 18, 19, 20, 0}));
  EXPECT_TRUE(t.byte_level());
  EXPECT_FALSE(t.adds_dummy_prefix());
  EXPECT_EQ(t.vocab_size(), 151646);
  EXPECT_EQ(t.piece_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(t.piece_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.id_to_piece(151643), "<|endoftext|>");
  EXPECT_EQ(t.id_to_piece(1879), "\xC4\xA0world");  // "Ġworld"
  EXPECT_EQ(t.piece_to_id("\xC4\xA0world"), 1879);
  EXPECT_EQ(t.piece_to_id("no such piece"), -1);
  // No tokenizer_config.json beside it: no BOS/EOS/PAD (Qwen has no BOS in any case).
  EXPECT_EQ(t.bos_id(), -1);
  EXPECT_EQ(t.eos_id(), -1);
  EXPECT_EQ(t.pad_id(), -1);
  EXPECT_EQ(t.unk_id(), -1);
  // Special tokens decode to nothing (as SentencePiece's control tokens do).
  EXPECT_EQ(t.decode(std::vector<int32_t>{151644, 9707, 151645}), "Hello");
  EXPECT_THROW((void)t.decode(std::vector<int32_t>{151646}), Error);
  EXPECT_THROW((void)t.id_to_piece(-1), Error);
}

TEST(TokenizerJson, TinyChatmlEqualsHfApplyChatTemplate) { expect_chats(tiny(), reference()["tiny"]); }

TEST(TokenizerJson, QwenChatmlEqualsHfApplyChatTemplate) {
  REQUIRE_QWEN();
  expect_chats(qwen(), reference()["qwen"]);
  // The stop token of chatml generation.
  EXPECT_EQ(chat_stop_ids(ChatTemplate::chatml, qwen()), std::vector<int32_t>{151645});
  EXPECT_TRUE(chat_stop_ids(ChatTemplate::mistral, qwen()).empty());
}

TEST(TokenizerJson, ChatmlWithEosAppendsItUnlessItIsImEnd) {
  moetron::testing::TempDir d("tokjson");
  fs::copy_file(kTiny, d.file("tokenizer.json"));
  const std::vector<ChatMessage> msgs = {{Role::user, "hi"}, {Role::assistant, "ok"}};
  std::ofstream(d.file("tokenizer_config.json")) << R"({"eos_token": "<|endoftext|>", "bos_token": null})";
  const Tokenizer a = Tokenizer::load(d.file("tokenizer.json"));
  const TokenizedDocument da = apply_chat_template(ChatTemplate::chatml, a, msgs);
  ASSERT_GE(da.tokens.size(), 3u);
  EXPECT_EQ(da.tokens.back(), a.piece_to_id("<|endoftext|>"));
  EXPECT_EQ(da.loss_mask.back(), 1);
  std::ofstream(d.file("tokenizer_config.json")) << R"({"eos_token": "<|im_end|>"})";
  const Tokenizer b = Tokenizer::load(d.file("tokenizer.json"));
  const TokenizedDocument db = apply_chat_template(ChatTemplate::chatml, b, msgs);
  EXPECT_EQ(db.tokens, std::vector<int32_t>(da.tokens.begin(), da.tokens.end() - 1));
  EXPECT_EQ(db.tokens.back(), b.encode("\n").at(0));
}

TEST(TokenizerJson, TokenizerConfigGivesSpecialIds) {
  moetron::testing::TempDir d("tokjson");
  fs::copy_file(kTiny, d.file("tokenizer.json"));
  {
    const Tokenizer t = Tokenizer::load(d.file("tokenizer.json"));  // no config: none
    EXPECT_EQ(t.bos_id(), -1);
    EXPECT_EQ(t.eos_id(), -1);
  }
  std::ofstream(d.file("tokenizer_config.json"))
      << R"({"bos_token": {"__type": "AddedToken", "content": "<|im_start|>"}, "eos_token": "<|im_end|>",
             "pad_token": "<|endoftext|>", "chat_template": "x"})";
  const Tokenizer t = Tokenizer::load(d.file("tokenizer.json"));
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.sha256(), tiny().sha256());  // the tokenizer.json identifies it

  std::ofstream(d.file("tokenizer_config.json")) << R"({"eos_token": "<nope>"})";
  try {
    (void)Tokenizer::load(d.file("tokenizer.json"));
    ADD_FAILURE() << "an unknown eos_token loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("eos_token \"<nope>\" is not a token"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos) << e.what();
  }
  std::ofstream(d.file("tokenizer_config.json")) << R"({"eos_token": 5})";
  EXPECT_THROW((void)Tokenizer::load(d.file("tokenizer.json")), Error);
  std::ofstream(d.file("tokenizer_config.json")) << R"({"eos_token": )";
  EXPECT_THROW((void)Tokenizer::load(d.file("tokenizer.json")), Error);
}

TEST(TokenizerJson, ModelDirectoryFindsTokenizerJson) {
  moetron::testing::TempDir d("tokjson");
  ModelConfig cfg;
  cfg.vocab_size = 1000;
  EXPECT_EQ(load_model_tokenizer(d.path().string(), "", cfg, false), nullptr);
  try {
    (void)load_model_tokenizer(d.path().string(), "", cfg, true);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tokenizer.model or tokenizer.json"), std::string::npos) << e.what();
  }
  fs::copy_file(kTiny, d.file("tokenizer.json"));
  std::ofstream(d.file("tokenizer_config.json")) << R"({"eos_token": "<|im_end|>"})";
  const auto tok = load_model_tokenizer(d.path().string(), "", cfg, true);
  ASSERT_NE(tok, nullptr);
  EXPECT_TRUE(tok->byte_level());
  EXPECT_EQ(tok->eos_id(), 2);
  std::vector<int32_t> eos = model_eos_ids(d.path().string(), cfg, tok.get());
  add_chat_stop_ids(eos, ChatTemplate::chatml, *tok, cfg);
  EXPECT_NE(std::find(eos.begin(), eos.end(), 2), eos.end());
  cfg.vocab_size = 10;  // the model's vocabulary must hold the tokenizer's
  EXPECT_THROW((void)load_model_tokenizer(d.path().string(), "", cfg, true), Error);
}

TEST(TokenizerJson, RefusesUnsupportedAndMalformedFilesNamingTheField) {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"Metaspace", [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", "x"}}}}, {{"type", "Metaspace"}}}}};
       }, "pre_tokenizer.pretokenizers[1].type \"Metaspace\" is not supported (expected ByteLevel)"},
      {"unknown regex", [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}, {"behavior", "Isolated"}},
                                                  {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
       }, "pre_tokenizer.pretokenizers[0].pattern.Regex \"\\\\w+\" is not supported"},
      {"Whitespace", [](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; },
       "pre_tokenizer.type \"Whitespace\" is not supported"},
      {"no pre_tokenizer", [](json& j) { j["pre_tokenizer"] = nullptr; }, "pre_tokenizer is missing or null"},
      {"prefix space", [](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; },
       "pre_tokenizer.add_prefix_space = true is not supported"},
      {"NFKC", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "normalizer.type \"NFKC\" is not supported"},
      {"Lowercase in a sequence", [](json& j) {
         j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}};
       }, "normalizer.normalizers[1].type \"Lowercase\" is not supported"},
      {"WordPiece", [](json& j) { j["model"]["type"] = "WordPiece"; }, "model.type \"WordPiece\" is not supported"},
      {"byte fallback", [](json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback = true is not supported"},
      {"dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout is 0.1"},
      {"decoder", [](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }, "decoder.type \"Metaspace\" is not supported"},
      {"post processor adds", [](json& j) {
         j["post_processor"] = {{"type", "TemplateProcessing"},
                                {"single", {{{"SpecialToken", {{"id", "<|endoftext|>"}}}}, {{"Sequence", {{"id", "A"}}}}}}};
       }, "post_processor: a TemplateProcessing that adds tokens"},
      {"Bert", [](json& j) { j["post_processor"] = {{"type", "BertProcessing"}}; }, "post_processor.type \"BertProcessing\""},
      {"truncation", [](json& j) { j["truncation"] = {{"max_length", 5}}; }, "truncation is {\"max_length\":5}"},
      {"padding", [](json& j) { j["padding"] = {{"length", 5}}; }, "padding is"},
      {"merge unknown", [](json& j) { j["model"]["merges"][0] = "zzqq a"; }, "model.merges[0]: \"zzqq\" is not in model.vocab"},
      {"merge result unknown", [](json& j) { j["model"]["merges"][0] = {"!", "!"}; j["model"]["vocab"].erase("!!"); },
       "the merged piece \"!!\" is not in model.vocab"},
      {"merge shape", [](json& j) { j["model"]["merges"][3] = 7; }, "model.merges[3] is 7"},
      {"merge one piece", [](json& j) { j["model"]["merges"][2] = "ab"; }, "model.merges[2] = \"ab\": expected two pieces"},
      {"duplicated id", [](json& j) { j["model"]["vocab"]["!"] = 4; }, "id 4 is given to both"},
      {"negative id", [](json& j) { j["model"]["vocab"]["!"] = -1; }, "model.vocab[\"!\"] = -1 is out of range"},
      {"huge id", [](json& j) { j["model"]["vocab"]["!"] = 1 << 30; }, "is out of range [0, 2097152)"},
      {"id type", [](json& j) { j["model"]["vocab"]["!"] = "3"; }, "model.vocab[\"!\"] is a string, expected an integer id"},
      {"vocab type", [](json& j) { j["model"]["vocab"] = json::array(); }, "model.vocab is an array, expected an object"},
      {"merges missing", [](json& j) { j["model"].erase("merges"); }, "model.merges is missing"},
      {"model missing", [](json& j) { j.erase("model"); }, "model is missing"},
      {"unk unknown", [](json& j) { j["model"]["unk_token"] = "<unk>"; }, "model.unk_token \"<unk>\" is not in model.vocab"},
      {"added id clash", [](json& j) { j["added_tokens"][3]["id"] = 5; }, "added_tokens[3]: id 5 is given to both"},
      {"added content", [](json& j) { j["added_tokens"][0]["content"] = ""; }, "added_tokens[0].content is \"\""},
      {"added flag", [](json& j) { j["added_tokens"][1]["lstrip"] = "yes"; }, "added_tokens[1].lstrip is a string"},
      {"added id", [](json& j) { j["added_tokens"][1].erase("id"); }, "added_tokens[1].id is missing"},
      // Ids HF tokenizers would not give (what tokenizers 0.23.3's token_to_id returns for these files):
      // an added token repeating a vocabulary piece's text under another id gets the piece's id (100);
      // with a gap in the vocabulary's ids (800 entries, the largest 900) the added tokens get 800, 801,
      // not the declared 901, 902; and they get them in list order (declared 801, 800: HF 800, 801).
      {"added repeats a piece", [](json& j) { j["added_tokens"][3]["content"] = "\u00a4"; },
       "added_tokens[3] (\"\u00a4\") declares id 800, but Hugging Face tokenizers gives it id 100 (its content is "
       "that vocabulary piece's)"},
      {"vocabulary gap", [](json& j) {
         j["model"]["vocab"]["\u00a4"] = 900;
         j["added_tokens"][3]["id"] = 901;
         j["added_tokens"][4]["id"] = 902;
       }, "added_tokens[3] (\"<extra>\") declares id 901, but Hugging Face tokenizers gives it id 800 (added tokens "
          "that are not vocabulary pieces take the ids from the vocabulary's 800 entries on, in list order)"},
      {"added out of order", [](json& j) {
         j["added_tokens"][3]["id"] = 801;
         j["added_tokens"][4]["id"] = 800;
       }, "added_tokens[3] (\"<extra>\") declares id 801, but Hugging Face tokenizers gives it id 800"},
  };
  for (const Case& c : cases) {
    const std::string err = load_error(c.edit);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.what << ": got \"" << err << "\", expected \"" << c.expect << "\"";
    EXPECT_EQ(err.rfind("tokenizer.json: ", 0), 0u) << c.what << ": " << err;
  }
  EXPECT_EQ(load_error([](json&) {}), "");
  EXPECT_NE(load_error_text("{").find("not valid JSON"), std::string::npos);
  EXPECT_NE(load_error_text("{}").find("pre_tokenizer is missing"), std::string::npos);
  EXPECT_NE(load_error_text(std::string(100, '[') + "{").find("not a SentencePiece model"), std::string::npos);
  const std::string deep = "{\"model\": " + std::string(5000, '[') + std::string(5000, ']') + "}";
  EXPECT_NE(load_error_text(deep).find("deeper than"), std::string::npos) << load_error_text(deep);
  EXPECT_NE(load_error_text(" \n{\"model\": 3}").find("pre_tokenizer"), std::string::npos);
}

TEST(TokenizerJson, InvalidUtf8AndEdgeTextsDoNotBreakIt) {
  const Tokenizer& t = tiny();
  const std::string bad = "ab\xff\xfe c\xe3\x81 \xed\xa0\x80x\xf4\x90\x80\x80";
  const std::vector<int32_t> ids = t.encode(bad);
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < t.vocab_size());
  EXPECT_EQ(t.decode(ids), "ab\xEF\xBF\xBD\xEF\xBF\xBD c\xEF\xBF\xBD \xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBDx"
                           "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_TRUE(t.encode("").empty());
  EXPECT_EQ(t.decode(std::vector<int32_t>{}), "");
  // A token's bytes may end mid-character; decoding a prefix of the ids never fails.
  const std::vector<int32_t> jp = t.encode("東京🙂");
  for (size_t k = 0; k <= jp.size(); k++) (void)t.decode(std::span(jp).first(k));
}

TEST(TokenizerJson, NfcMatchesPython) {
  // A few NFC cases beside those in the reference texts (Hangul, reordering, singletons, exclusions).
  auto nfc = [](std::string_view s) {
    std::string out;
    unicode::nfc_append(s, out);
    return out;
  };
  EXPECT_EQ(nfc("e\xCC\x81"), "\xC3\xA9");                          // e + acute -> é
  EXPECT_EQ(nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // jamo -> 각
  EXPECT_EQ(nfc("a\xCC\xA3\xCC\x87"), "\xE1\xBA\xA1\xCC\x87");      // a + dot below + dot above -> ạ̇
  EXPECT_EQ(nfc("a\xCC\x87\xCC\xA3"), "\xE1\xBA\xA1\xCC\x87");      // reordered first
  EXPECT_EQ(nfc("\xE2\x84\xAB"), "\xC3\x85");                       // Angstrom sign -> Å
  EXPECT_EQ(nfc("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");       // excluded: stays decomposed
  EXPECT_EQ(nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(nfc("x\xFF" "e\xCC\x81"), "x\xFF\xC3\xA9");             // invalid bytes kept
}

TEST(TokenizerJson, ConcurrentEncodesAgree) {
  const Tokenizer& t = tiny();
  std::vector<std::string> texts;
  for (const json& c : reference()["tiny"]["texts"]) texts.push_back(c["text"]);
  std::vector<std::vector<int32_t>> want;
  for (const auto& s : texts) want.push_back(t.encode(s));
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; k++)
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 20; rep++)
        for (size_t i = 0; i < texts.size(); i++)
          if (t.encode(texts[(i + (size_t)k) % texts.size()]) != want[(i + (size_t)k) % texts.size()]) bad[(size_t)k]++;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
}

TEST(TokenizerJson, DataPrepareChatmlEndToEnd) {
  moetron::testing::TempDir d("tokjson");
  const json& chats = reference()["tiny"]["chats"];
  {
    std::ofstream f(d.file("chat.jsonl"));
    for (const json& c : chats)
      if (!c["add_generation_prompt"].get<bool>()) f << json{{"messages", c["messages"]}}.dump() << "\n";
  }
  const std::string out = d.file("out");
  const std::string cmd = std::string(MOETRON_BINARY) + " data prepare --input " + d.file("chat.jsonl") +
                          " --tokenizer " + kTiny + " --template chatml --valid-fraction 0 --output " + out +
                          " > " + d.file("log.txt") + " 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(d.file("log.txt"));
  const json ds = json::parse(read_file(out + "/dataset.json"));
  EXPECT_EQ(ds["tokenizer"]["sha256"], tiny().sha256());
  EXPECT_EQ(ds["tokenizer"]["vocab_size"], tiny().vocab_size());
  EXPECT_EQ(ds["template"], "chatml");
  const IndexedDataset toks = IndexedDataset::open(out + "/train");
  const IndexedDataset mask = IndexedDataset::open(out + "/train_mask");
  // Every document is one of the reference conversations, token for token and mask for mask.
  size_t expected_docs = 0;
  for (const json& c : chats) expected_docs += !c["add_generation_prompt"].get<bool>();
  ASSERT_EQ(toks.size(), expected_docs);
  for (size_t i = 0; i < toks.size(); i++) {
    std::vector<int32_t> ids(toks.length(i)), m(mask.length(i));
    toks.read(i, ids.data());
    mask.read(i, m.data());
    bool found = false;
    for (const json& c : chats)
      if (ids == c["ids"].get<std::vector<int32_t>>()) {
        found = true;
        EXPECT_EQ(m, c["mask"].get<std::vector<int32_t>>());
      }
    EXPECT_TRUE(found) << "document " << i << " matches no reference conversation";
  }
}
