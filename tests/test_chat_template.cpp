// Chat templates against mistral-common (mistral) and hand-written expectations (llama2, chatml, raw),
// with the exact positions of the loss mask.  The expected ids were produced by Python sentencepiece on
// ../shared/data/mixtral-tokenizer.model; tests/golden/chat/mistral_v1.json by
// tools/make_chat_reference.py (mistral-common 1.13.1).
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mixtral_tokenizer.h"
#include <nlohmann/json.hpp>

#include "data/jsonl.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const std::string kSource = MOETRON_SOURCE_DIR;

using moetron::testing::kMixtral;
using moetron::testing::mixtral;

using Ids = std::vector<int32_t>;
using Mask = std::vector<uint8_t>;

ChatMessage S(std::string c) { return {Role::system, std::move(c)}; }
ChatMessage U(std::string c) { return {Role::user, std::move(c)}; }
ChatMessage A(std::string c) { return {Role::assistant, std::move(c)}; }

// A mask of length n with 1 exactly at `ones`.
Mask mask_with_ones(size_t n, std::set<size_t> ones) {
  Mask m(n, 0);
  for (size_t i : ones) m.at(i) = 1;
  return m;
}

std::vector<std::pair<std::string, std::vector<ChatMessage>>> load_cases(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  std::vector<std::pair<std::string, std::vector<ChatMessage>>> out;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    std::vector<ChatMessage> msgs;
    for (const auto& m : j.at("messages")) msgs.push_back({parse_role(m.at("role").get<std::string>()), m.at("content")});
    out.emplace_back(j.at("name").get<std::string>(), std::move(msgs));
  }
  return out;
}

ChatErrorKind expect_chat_error(ChatTemplate t, const std::vector<ChatMessage>& msgs) {
  try {
    apply_chat_template(t, mixtral(), msgs);
  } catch (const ChatError& e) {
    return e.kind();
  }
  ADD_FAILURE() << "expected a ChatError from template " << chat_template_name(t);
  return ChatErrorKind::unknown_role;
}

}  // namespace

TEST(ChatTemplate, NamesAndRoles) {
  EXPECT_EQ(parse_chat_template("mistral"), ChatTemplate::mistral);
  EXPECT_EQ(parse_chat_template("llama2"), ChatTemplate::llama2);
  EXPECT_EQ(parse_chat_template("chatml"), ChatTemplate::chatml);
  EXPECT_EQ(parse_chat_template("raw"), ChatTemplate::raw);
  EXPECT_THROW(parse_chat_template("vicuna"), Error);
  EXPECT_EQ(parse_role("system"), Role::system);
  EXPECT_EQ(parse_role("assistant"), Role::assistant);
  EXPECT_EQ(parse_role("developer"), Role::system);  // OpenAI's newer name for the system message
  try {
    parse_role("tool");
    FAIL() << "tool is not a supported role";
  } catch (const ChatError& e) {
    EXPECT_EQ(e.kind(), ChatErrorKind::unknown_role);
    EXPECT_NE(std::string(e.what()).find("'tool'"), std::string::npos);
  }
  EXPECT_THROW(parse_role("User"), ChatError);  // roles are case-sensitive, as in the OpenAI schema
}

// The committed conversations tokenize exactly as mistral-common's v1 encode_chat_completion does.
TEST(ChatTemplateMistral, MatchesMistralCommonOnAllCases) {
  REQUIRE_MIXTRAL();
  std::ifstream gf(kSource + "/tests/golden/chat/mistral_v1.json");
  ASSERT_TRUE(gf.good());
  const auto golden = nlohmann::json::parse(gf);
  ASSERT_EQ(golden.at("tokenizer_sha256").get<std::string>(), mixtral().sha256());
  const auto cases = load_cases(kSource + "/tests/data/chat_cases.jsonl");
  ASSERT_GE(cases.size(), 30u);
  ASSERT_EQ(cases.size(), golden.at("cases").size());
  size_t masks_checked = 0;
  for (size_t i = 0; i < cases.size(); i++) {
    const auto& g = golden["cases"][i];
    ASSERT_EQ(g.at("name").get<std::string>(), cases[i].first);
    const TokenizedDocument d = apply_chat_template(ChatTemplate::mistral, mixtral(), cases[i].second);
    EXPECT_EQ(d.tokens, g.at("tokens").get<Ids>()) << "case " << cases[i].first;
    ASSERT_EQ(d.loss_mask.size(), d.tokens.size());
    if (!g.at("loss_mask").is_null()) {
      EXPECT_EQ(d.loss_mask, g["loss_mask"].get<Mask>()) << "case " << cases[i].first;
      masks_checked++;
    }
    const TokenizedDocument all = apply_chat_template(ChatTemplate::mistral, mixtral(), cases[i].second, {true});
    EXPECT_EQ(all.tokens, d.tokens);
    EXPECT_EQ(all.loss_mask, Mask(d.tokens.size(), 1)) << "train_on_prompt puts every position in the loss";
  }
  EXPECT_GE(masks_checked, 30u);
}

// The conversations mistral-common refuses are refused here too.
TEST(ChatTemplateMistral, RefusesWhatMistralCommonRefuses) {
  REQUIRE_MIXTRAL();
  std::ifstream gf(kSource + "/tests/golden/chat/mistral_v1.json");
  const auto golden = nlohmann::json::parse(gf);
  const auto cases = load_cases(kSource + "/tests/data/chat_error_cases.jsonl");
  ASSERT_EQ(cases.size(), golden.at("error_cases").size());
  ASSERT_GE(cases.size(), 4u);
  for (const auto& [name, msgs] : cases) {
    SCOPED_TRACE(name);
    const ChatErrorKind k = expect_chat_error(ChatTemplate::mistral, msgs);
    EXPECT_EQ(k, name == "error_empty_assistant" ? ChatErrorKind::empty_assistant : ChatErrorKind::bad_role_order);
  }
}

TEST(ChatTemplateMistral, LossMaskPositions) {
  REQUIRE_MIXTRAL();
  // <s> [INST] What is the capital of France? [/INST] The capital of France is Paris. </s>
  const TokenizedDocument d =
      apply_chat_template(ChatTemplate::mistral, mixtral(), std::vector{U("What is the capital of France?"),
                                                                        A("The capital of France is Paris.")});
  const Ids want = {1,   733,  16289, 28793, 1824, 349,  272,  5565,  302,   4843, 28804, 733,
                    28748, 16289, 28793, 415,  5565, 302,  4843, 349,   5465,  28723, 2};
  EXPECT_EQ(d.tokens, want);
  // Positions 15..21 are "The capital of France is Paris." and 22 is its EOS: exactly these are 1.
  EXPECT_EQ(d.loss_mask, mask_with_ones(23, {15, 16, 17, 18, 19, 20, 21, 22}));
  EXPECT_EQ(d.loss_tokens(), 8u);
  // A prompt awaiting generation has no loss token; train_on_prompt makes all 16 positions 1.
  const std::vector prompt = {U("What is the capital of France?")};
  EXPECT_EQ(apply_chat_template(ChatTemplate::mistral, mixtral(), prompt).loss_tokens(), 0u);
  EXPECT_EQ(apply_chat_template(ChatTemplate::mistral, mixtral(), prompt, {true}).loss_mask, Mask(15, 1));
}

TEST(ChatTemplateLlama2, HandWrittenTokensAndMask) {
  REQUIRE_MIXTRAL();
  const std::vector msgs = {S("  Be nice.\n"), U("Hi "), A(" Hello"), U("Again"), A("Sure")};
  const TokenizedDocument d = apply_chat_template(ChatTemplate::llama2, mixtral(), msgs);
  // Exchange 1: <s> "[INST] <<SYS>>\nBe nice.\n<</SYS>>\n\nHi [/INST]" (22 tokens) "Hello " </s>
  // Exchange 2: <s> "[INST] Again [/INST]" "Sure " </s>.  The split pieces equal Meta's single
  // encode of "[INST] <<SYS>>\n...\n\nHi [/INST] Hello " (checked in Python).
  const Ids want = {1,     733, 16289, 28793, 2087, 18741, 4060, 13,    3574, 5171,  28723, 13,    28789,
                    700,   18741, 4060, 13,   13,   23809, 733,  28748, 16289, 28793, 22557, 28705, 2,
                    1,     733, 16289, 28793, 9706, 733,  28748, 16289, 28793, 12875, 28705, 2};
  EXPECT_EQ(d.tokens, want);
  EXPECT_EQ(d.tokens, [&] {
    Ids t = {1};
    for (int32_t x : mixtral().encode("[INST] <<SYS>>\nBe nice.\n<</SYS>>\n\nHi [/INST]")) t.push_back(x);
    for (int32_t x : mixtral().encode("Hello ")) t.push_back(x);
    t.push_back(2);
    t.push_back(1);
    for (int32_t x : mixtral().encode("[INST] Again [/INST]")) t.push_back(x);
    for (int32_t x : mixtral().encode("Sure ")) t.push_back(x);
    t.push_back(2);
    return t;
  }());
  // 1 exactly on "Hello", its trailing "▁" and </s> (23, 24, 25) and "Sure", "▁", </s> (35, 36, 37).
  EXPECT_EQ(d.loss_mask, mask_with_ones(38, {23, 24, 25, 35, 36, 37}));
  EXPECT_EQ(apply_chat_template(ChatTemplate::llama2, mixtral(), msgs, {true}).loss_mask, Mask(38, 1));
  // A final user message: <s> [INST] ... [/INST] with nothing in the loss.
  const TokenizedDocument p = apply_chat_template(ChatTemplate::llama2, mixtral(), std::vector{U("Again")});
  EXPECT_EQ(p.tokens, (Ids{1, 733, 16289, 28793, 9706, 733, 28748, 16289, 28793}));
  EXPECT_EQ(p.loss_tokens(), 0u);
}

TEST(ChatTemplateLlama2, RoleOrderErrors) {
  REQUIRE_MIXTRAL();
  using V = std::vector<ChatMessage>;
  EXPECT_EQ(expect_chat_error(ChatTemplate::llama2, V{}), ChatErrorKind::bad_role_order);
  EXPECT_EQ(expect_chat_error(ChatTemplate::llama2, V{A("x")}), ChatErrorKind::bad_role_order);
  EXPECT_EQ(expect_chat_error(ChatTemplate::llama2, V{U("a"), U("b"), A("c")}), ChatErrorKind::bad_role_order);
  EXPECT_EQ(expect_chat_error(ChatTemplate::llama2, V{U("a"), A("b"), A("c")}), ChatErrorKind::bad_role_order);
  EXPECT_EQ(expect_chat_error(ChatTemplate::llama2, V{U("a"), S("s"), A("c")}), ChatErrorKind::bad_role_order);
  EXPECT_EQ(expect_chat_error(ChatTemplate::llama2, V{S("s")}), ChatErrorKind::bad_role_order);
  EXPECT_EQ(expect_chat_error(ChatTemplate::llama2, V{S("s"), S("t"), U("u")}), ChatErrorKind::bad_role_order);
}

TEST(ChatTemplateChatml, HandWrittenTokensAndMask) {
  REQUIRE_MIXTRAL();
  const std::vector msgs = {U("Hi"), A("Hello")};
  const TokenizedDocument d = apply_chat_template(ChatTemplate::chatml, mixtral(), msgs);
  // <s> "<|im_start|>user\n" (1-9) "Hi<|im_end|>" (10-17) "\n" (18) "<|im_start|>assistant\n" (19-28)
  // "Hello<|im_end|>" (29-36) "\n" (37) </s> (38); markers are text for this vocabulary, no "▁" added.
  const Ids want = {1,     28789, 28766, 321,   28730, 2521,  28766, 28767, 1838,  13,    23809, 28789, 28766,
                    321,   28730, 416,   28766, 28767, 13,    28789, 28766, 321,   28730, 2521,  28766, 28767,
                    489,   11143, 13,    16230, 28789, 28766, 321,   28730, 416,   28766, 28767, 13,    2};
  EXPECT_EQ(d.tokens, want);
  EXPECT_EQ(d.loss_mask, mask_with_ones(39, {29, 30, 31, 32, 33, 34, 35, 36, 38}));
  EXPECT_EQ(mixtral().decode(d.tokens), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n");
  EXPECT_EQ(apply_chat_template(ChatTemplate::chatml, mixtral(), msgs, {true}).loss_mask, Mask(39, 1));
  // Generation prompt after a final user message; no EOS, no loss.
  ChatOptions gen;
  gen.add_generation_prompt = true;
  const TokenizedDocument p = apply_chat_template(ChatTemplate::chatml, mixtral(), std::vector{U("Hi")}, gen);
  EXPECT_EQ(mixtral().decode(p.tokens), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(p.loss_tokens(), 0u);
  // Any order of roles is expressible; no messages is not.
  EXPECT_NO_THROW(apply_chat_template(ChatTemplate::chatml, mixtral(), std::vector{A("a"), S("s"), A("b")}));
  EXPECT_EQ(expect_chat_error(ChatTemplate::chatml, {}), ChatErrorKind::bad_role_order);
}

TEST(ChatTemplateRaw, HandWrittenTokensAndMask) {
  REQUIRE_MIXTRAL();
  const TokenizedDocument d = apply_chat_template(ChatTemplate::raw, mixtral(), std::vector{U("Hi"), A("Hello")});
  EXPECT_EQ(d.tokens, (Ids{1, 15359, 22557, 2}));  // <s> ▁Hi ▁Hello </s>
  EXPECT_EQ(d.loss_mask, (Mask{0, 0, 1, 1}));
  const TokenizedDocument two =
      apply_chat_template(ChatTemplate::raw, mixtral(), std::vector{S("Hi"), A("Hello"), U("Hi"), A("Hello")});
  EXPECT_EQ(two.tokens, (Ids{1, 15359, 22557, 2, 15359, 22557, 2}));
  EXPECT_EQ(two.loss_mask, (Mask{0, 0, 1, 1, 0, 1, 1}));
  EXPECT_EQ(expect_chat_error(ChatTemplate::raw, {}), ChatErrorKind::bad_role_order);
}

TEST(ChatTemplate, TextDocumentIsAllLoss) {
  REQUIRE_MIXTRAL();
  TokenizedDocument d;
  tokenize_text(mixtral(), "Hello world", d);
  EXPECT_EQ(d.tokens, (Ids{1, 22557, 1526, 2}));
  EXPECT_EQ(d.loss_mask, (Mask{1, 1, 1, 1}));
}

// Every template on every committed conversation: mask and tokens have equal lengths, mask is 0/1,
// and the masked tokens decode to the assistant text (for mistral/raw, where no markup is masked).
TEST(ChatTemplate, MaskCoversAssistantTextOnly) {
  REQUIRE_MIXTRAL();
  for (const auto& [name, msgs] : load_cases(kSource + "/tests/data/chat_cases.jsonl")) {
    for (ChatTemplate t : {ChatTemplate::mistral, ChatTemplate::llama2, ChatTemplate::chatml, ChatTemplate::raw}) {
      TokenizedDocument d;
      try {
        apply_chat_template(t, mixtral(), msgs, {}, d);
      } catch (const ChatError&) {
        continue;  // e.g. llama2 refuses merged or system-in-the-middle orders
      }
      ASSERT_EQ(d.tokens.size(), d.loss_mask.size()) << name;
      for (uint8_t m : d.loss_mask) ASSERT_LE(m, 1);
      if (t != ChatTemplate::raw) continue;
      Ids masked;
      for (size_t i = 0; i < d.tokens.size(); i++)
        if (d.loss_mask[i] && d.tokens[i] != mixtral().eos_id()) masked.push_back(d.tokens[i]);
      std::string want;
      for (const ChatMessage& m : msgs)
        if (m.role == Role::assistant) {
          for (int32_t x : mixtral().encode(m.content)) want += mixtral().id_to_piece(x);
        }
      std::string got;
      for (int32_t x : masked) got += mixtral().id_to_piece(x);
      EXPECT_EQ(got, want) << name;
    }
  }
}
