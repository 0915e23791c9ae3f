// Chat templates: a conversation (system / user / assistant messages) -> token ids and a loss mask.
//
// Loss mask: 1 on the tokens of every assistant message and the end-of-turn token that closes it
// (EOS; for chatml "<|im_end|>" and, at the end of the document, EOS); 0 on everything else (BOS,
// markup, system and user text).  With train_on_prompt every position is 1.
//
// Templates (S = system, U = user, A = assistant; enc() = Tokenizer::encode, one call per piece,
// so SentencePiece's dummy prefix puts a "▁" at the start of each piece; lit() = encode_literal):
//
//   mistral  Mixtral-8x7B-Instruct-v0.1, exactly as mistral-common's v1 tokenizer
//            (MistralTokenizer.encode_chat_completion) does it:
//              BOS  enc("[INST] " + U1 + " [/INST]")  enc(A1) EOS  enc("[INST] " + U2 + " [/INST]") ...
//            * all non-empty system messages, wherever they are, are joined with "\n\n" into one
//              system prompt, which is put before the FIRST user message: "[INST] " + S + "\n\n" + U1;
//            * consecutive messages of the same role are merged into one, their non-empty contents
//              joined with "\n\n"; a system message between two user messages separates them
//              (two [INST] blocks follow each other);
//            * when the first merged message is not a user message (a conversation that starts
//              with an assistant, or holds only system messages) an empty user message is put first;
//            * a conversation may end with a user message (a prompt awaiting generation) or with an
//              assistant message (training data);
//            * errors as mistral-common raises them: no messages, a lone assistant message, a system
//              message right after an assistant message (bad_role_order); an assistant message with
//              empty content (empty_assistant).
//   llama2   Meta's Llama 2 chat format (llama/generation.py chat_completion), per exchange:
//              BOS enc("[INST] " + P + " [/INST]") enc(strip(A) + " ") EOS
//            with P = strip(U), and for the first exchange with a system message
//            P = "<<SYS>>\n" + strip(S) + "\n<</SYS>>\n\n" + strip(U); a final user message without an
//            answer gives BOS enc("[INST] " + P + " [/INST]").  strip() removes ASCII whitespace.
//            Order: an optional system message first, then user/assistant strictly alternating,
//            starting with user; anything else is bad_role_order.
//   chatml   BOS, then for every message  lit("<|im_start|>" + role + "\n")  lit(content + "<|im_end|>")
//            lit("\n"); EOS after the last message when it is an assistant message (not when the EOS
//            is <|im_end|>, which already closed it).  Markers are plain text unless the vocabulary
//            defines them as pieces.  Any order of roles.  add_generation_prompt appends
//            lit("<|im_start|>assistant\n") after a final non-assistant message.
//            With a byte-level tokenizer (tokenizer.json) the markers are added tokens and the
//            tokens are exactly HF's apply_chat_template(tokenize=True) of the ChatML (Qwen2.5-style)
//            template: "<|im_start|>" + role + "\n" + content + "<|im_end|>" is encoded as one text
//            (a pre-token may straddle "\n" and the content), and a token holding content bytes is
//            content (HF's assistant-mask rule).
//   raw      BOS, then every message's content as enc(content), EOS after each assistant message;
//            no markup, any order of roles.
//
// Documents in plain-text format (no roles) use tokenize_text(): BOS enc(text) EOS, all positions 1.
//
// Stop tokens: chat_stop_ids() names the ids that end a generated reply besides the model's EOS
// (for chatml, "<|im_end|>" when the vocabulary has it as one token).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace moetron {

enum class Role : uint8_t { system, user, assistant };

// "system" (or OpenAI's "developer") | "user" | "assistant" -> Role; ChatError(unknown_role) otherwise.
Role parse_role(std::string_view name);
const char* role_name(Role role);

struct ChatMessage {
  Role role = Role::user;
  std::string content;
};

// Why a conversation cannot be encoded; each kind is counted separately by `data prepare`.
enum class ChatErrorKind : uint8_t { unknown_role, bad_role_order, empty_assistant };
const char* chat_error_kind_name(ChatErrorKind kind);  // "unknown_role", ...

class ChatError : public Error {
 public:
  ChatError(ChatErrorKind kind, const std::string& what) : Error(what), kind_(kind) {}
  ChatErrorKind kind() const { return kind_; }

 private:
  ChatErrorKind kind_;
};

enum class ChatTemplate : uint8_t { mistral, llama2, chatml, raw };
// Error listing the known names for anything else.
ChatTemplate parse_chat_template(std::string_view name);
const char* chat_template_name(ChatTemplate t);

struct ChatOptions {
  bool train_on_prompt = false;        // loss mask 1 everywhere
  bool add_generation_prompt = false;  // chatml only (the other templates end a prompt by themselves)
};

// Tokens and their loss mask (same length; mask values 0/1).
struct TokenizedDocument {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;
  void clear() {
    tokens.clear();
    loss_mask.clear();
  }
  size_t loss_tokens() const;
};

// Encodes a conversation into `out` (cleared first).  ChatError for a conversation the template
// cannot express; Error if the tokenizer lacks a BOS/EOS token the template needs.
void apply_chat_template(ChatTemplate tmpl, const Tokenizer& tok, std::span<const ChatMessage> messages,
                         const ChatOptions& opts, TokenizedDocument& out);
TokenizedDocument apply_chat_template(ChatTemplate tmpl, const Tokenizer& tok, std::span<const ChatMessage> messages,
                                      const ChatOptions& opts = {});

// Ids that end an assistant reply under `tmpl` besides the model's EOS ids (chatml: <|im_end|>).
std::vector<int32_t> chat_stop_ids(ChatTemplate tmpl, const Tokenizer& tok);

// A plain-text document: BOS enc(text) EOS (BOS/EOS only when the tokenizer has them), mask all 1.
void tokenize_text(const Tokenizer& tok, std::string_view text, TokenizedDocument& out);

}  // namespace moetron
