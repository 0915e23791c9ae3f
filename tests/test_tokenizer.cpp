// Tokenizer wrapper (SentencePiece), SHA-256, and `moetron tokenizer train`.
// Token ids below were produced by Python sentencepiece 0.2.3 on ../shared/data/mixtral-tokenizer.model
// (the same file mistral-common ships as tokenizer.model.v1).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "mixtral_tokenizer.h"

#include "core/error.h"
#include "core/sha256.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const std::string kMixtralSha = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055";

using moetron::testing::kMixtral;
using moetron::testing::mixtral;

using Ids = std::vector<int32_t>;

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("moetron_tok_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

}  // namespace

TEST(Sha256, KnownVectors) {
  // FIPS 180-4 examples and the empty string.
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in uneven pieces (exercises the block buffer).
  Sha256 s;
  const std::string chunk(997, 'a');
  size_t left = 1000000;
  while (left > 0) {
    const size_t n = std::min(left, chunk.size());
    s.update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(s.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Tokenizer, MissingFileNamesIt) {
  try {
    Tokenizer::load("/nonexistent/dir/tokenizer.model");
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/tokenizer.model"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, NotAModelNamesIt) {
  const fs::path d = temp_dir("notamodel");
  std::ofstream(d / "bad.model") << "this is not a protobuf";
  try {
    Tokenizer::load((d / "bad.model").string());
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.model"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("SentencePiece"), std::string::npos) << e.what();
  }
  std::ofstream(d / "empty.model");
  EXPECT_THROW(Tokenizer::load((d / "empty.model").string()), Error);
  fs::remove_all(d);
}

// Found by tests/fuzz/fuzz_tokenizer: SentencePiece builds its trie from pieces as C strings, and an
// empty piece (or one starting with NUL) made it throw through a noexcept frame: std::terminate, no
// error message.  The model is checked before SentencePiece sees it.
TEST(Tokenizer, PiecesSentencePieceCannotHoldAreRefusedBeforeLoading) {
  std::ifstream in(std::string(MOETRON_SOURCE_DIR) + "/tests/golden/generate/mixtral_gqa/tokenizer.model", std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string model = ss.str();
  ASSERT_GT(model.size(), 100u);
  EXPECT_NO_THROW(Tokenizer::from_bytes(model, "tiny.model"));
  // Appending a ModelProto field 1 (a repeated SentencePiece) adds one more piece: {1: piece}.
  const std::string empty_piece = model + std::string("\x0a\x02\x0a\x00", 4);
  const std::string nul_piece = model + std::string("\x0a\x04\x0a\x02\x00\x41", 6);
  for (const auto& [bytes, want] : {std::pair{empty_piece, "is an empty string"}, std::pair{nul_piece, "NUL byte"}}) {
    try {
      Tokenizer::from_bytes(bytes, "hostile.model");
      FAIL() << "expected an Error for " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("hostile.model"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
}

TEST(Tokenizer, MixtralSpecialIdsAndChecksum) {
  REQUIRE_MIXTRAL();
  const Tokenizer& t = mixtral();
  EXPECT_EQ(t.vocab_size(), 32000);
  EXPECT_EQ(t.unk_id(), 0);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.pad_id(), -1);
  EXPECT_TRUE(t.adds_dummy_prefix());
  EXPECT_EQ(t.sha256(), kMixtralSha);
  EXPECT_EQ(sha256_file(kMixtral), kMixtralSha);
  EXPECT_EQ(t.id_to_piece(1), "<s>");
  EXPECT_EQ(t.id_to_piece(13), "<0x0A>");
  EXPECT_EQ(t.piece_to_id("</s>"), 2);
  EXPECT_EQ(t.piece_to_id("<unk>"), 0);
  EXPECT_EQ(t.piece_to_id("no-such-piece-xyz"), -1);
  EXPECT_THROW(t.id_to_piece(32000), Error);
  EXPECT_THROW(t.id_to_piece(-1), Error);
}

TEST(Tokenizer, MixtralEncodeMatchesPythonSentencePiece) {
  REQUIRE_MIXTRAL();
  const Tokenizer& t = mixtral();
  EXPECT_EQ(t.encode("[INST]"), (Ids{733, 16289, 28793}));
  EXPECT_EQ(t.encode("[INST] hi [/INST]"), (Ids{733, 16289, 28793, 12014, 733, 28748, 16289, 28793}));
  EXPECT_EQ(t.encode("Hello world"), (Ids{22557, 1526}));
  EXPECT_EQ(t.encode(""), Ids{});
  EXPECT_EQ(t.encode(" "), Ids{259});
  EXPECT_EQ(t.encode("  a"), (Ids{259, 264}));
  EXPECT_EQ(t.encode("x "), (Ids{1318, 28705}));
  EXPECT_EQ(t.encode("\n"), (Ids{28705, 13}));
  EXPECT_EQ(t.encode("日本語"), (Ids{28705, 29142, 29119, 30321}));
  // Without the dummy prefix the pieces spell the text exactly.
  EXPECT_EQ(t.encode_literal("Hello world"), (Ids{16230, 1526}));
  EXPECT_EQ(t.encode_literal("\n"), Ids{13});
  EXPECT_EQ(t.encode_literal(" x"), Ids{1318});
  EXPECT_EQ(t.encode_literal("<|im_start|>user\n"), (Ids{28789, 28766, 321, 28730, 2521, 28766, 28767, 1838, 13}));
  EXPECT_EQ(t.encode_literal("🎉"), Ids{31862});
}

TEST(Tokenizer, MixtralDecode) {
  REQUIRE_MIXTRAL();
  const Tokenizer& t = mixtral();
  EXPECT_EQ(t.decode(Ids{1, 22557, 1526, 2}), "Hello world");
  const std::string s = "Multi-line\ntext with émoji 🎉 and 日本語 and a rare 𠮷.";
  EXPECT_EQ(t.decode(t.encode(s)), s);
  EXPECT_EQ(t.decode(t.encode_literal(s)), s);
  EXPECT_THROW(t.decode(Ids{5, 32000}), Error);
}

TEST(Tokenizer, ConcurrentEncodeEqualsSerial) {
  REQUIRE_MIXTRAL();
  const Tokenizer& t = mixtral();
  std::vector<std::string> texts;
  for (int i = 0; i < 64; i++)
    texts.push_back("Sentence " + std::to_string(i * 7919) + ": routers send tokens to experts, 専門家 " +
                    std::string(i % 5, ' ') + std::to_string(i));
  std::vector<Ids> serial;
  for (const auto& s : texts) serial.push_back(t.encode(s));
  std::vector<std::vector<Ids>> got(4, std::vector<Ids>(texts.size()));
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; w++)
    threads.emplace_back([&, w] {
      for (int rep = 0; rep < 20; rep++)
        for (size_t i = 0; i < texts.size(); i++) got[w][i] = t.encode(texts[(i + w * 13) % texts.size()]);
    });
  for (auto& th : threads) th.join();
  for (int w = 0; w < 4; w++)
    for (size_t i = 0; i < texts.size(); i++) EXPECT_EQ(got[w][i], serial[(i + w * 13) % texts.size()]);
}

// ---- FastBpe (bpe.h) against SentencePiece itself ----

namespace {

// Deterministic varied texts: ASCII words, runs of spaces, tabs, newlines, NUL, CJK, kana, Arabic,
// emoji (4-byte), combining marks, a literal "▁", U+FFFD, NBSP, ideographic space, rare CJK
// Extension B; some long texts without any space (long words go through the heap path).
std::vector<std::string> random_texts(size_t count, uint64_t seed) {
  const std::vector<std::string> pool = {
      "the", "router", "expert", "a", "Z", "0", "123", "9", ".", ",", "?", "'", "\"", "(", ")", "-", " ", " ", " ",
      "  ", "   ", "\t", "\n", "\n\n", std::string(1, '\0'), "\r", "東", "京", "語", "は", "の", "ー", "مرحبا",
      "🎉", "👍🏽", "👨‍👩‍👧", "é", "e\u0301", "▁", "▁▁", "\ufffd", "\u00a0", "\u3000", "𠮷", "\U0001D518", "ß",
      "Привет", "ñ", "<s>", "</s>", "[INST]", "<0x0A>", "~", "\\", "{", "}"};
  std::vector<std::string> out;
  uint64_t x = seed;
  auto next = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return x >> 33;
  };
  for (size_t i = 0; i < count; i++) {
    std::string s;
    const size_t n = next() % (i % 10 == 0 ? 400 : 40);
    const bool no_space = i % 7 == 3;
    for (size_t k = 0; k < n; k++) {
      const std::string& piece = pool[next() % pool.size()];
      if (no_space && piece.find(' ') != std::string::npos) continue;
      s += piece;
    }
    out.push_back(s);
  }
  return out;
}

void expect_fast_equals_sentencepiece(const Tokenizer& t, const std::vector<std::string>& texts) {
  size_t checked = 0;
  for (const std::string& s : texts) {
    ASSERT_EQ(t.encode(s), t.encode_reference(s)) << "text: '" << s << "'";
    ASSERT_EQ(t.encode_literal(s), t.encode_reference(s, true)) << "literal text: '" << s << "'";
    checked++;
  }
  EXPECT_EQ(checked, texts.size());
}

// Protocol-buffer fields for a hand-made ModelProto.
std::string pb_varint(uint64_t v) {
  std::string s;
  do {
    uint8_t b = v & 0x7F;
    v >>= 7;
    s.push_back((char)(b | (v ? 0x80 : 0)));
  } while (v);
  return s;
}
std::string pb_bytes(int field, const std::string& b) { return pb_varint((uint64_t)field << 3 | 2) + pb_varint(b.size()) + b; }
std::string pb_uint(int field, uint64_t v) { return pb_varint((uint64_t)field << 3) + pb_varint(v); }
std::string pb_float(int field, float f) {
  std::string s = pb_varint((uint64_t)field << 3 | 5);
  char b[4];
  std::memcpy(b, &f, 4);
  return s + std::string(b, 4);
}

}  // namespace

TEST(FastBpe, MixtralEqualsSentencePiece) {
  REQUIRE_MIXTRAL();
  const Tokenizer& t = mixtral();
  ASSERT_TRUE(t.fast()) << t.why_not_fast();
  expect_fast_equals_sentencepiece(t, random_texts(3000, 1));
  // Invalid UTF-8 goes to SentencePiece (which substitutes U+FFFD per byte): still equal.
  for (std::string s : {std::string("ab\xff cd"), std::string("\xe3\x81"), std::string("x\xc0\xafy")})
    EXPECT_EQ(t.encode(s), t.encode_reference(s));
}

// A hand-made BPE model whose pieces cross word boundaries ("a▁b"), so whole texts are merged at
// once, and without byte fallback, so runs of unknown characters become one <unk>.
TEST(FastBpe, HandMadeModelWithoutWordSplitOrByteFallback) {
  std::string model;
  auto piece = [&](const std::string& p, float score, int type) {
    model += pb_bytes(1, pb_bytes(1, p) + pb_float(2, score) + pb_uint(3, (uint64_t)type));
  };
  piece("<unk>", 0, 2);
  piece("<s>", 0, 3);
  piece("</s>", 0, 3);
  const std::vector<std::pair<std::string, float>> normal = {
      {"▁", -1}, {"a", -2}, {"b", -3}, {"c", -4}, {"▁a", -5}, {"a▁", -5}, {"a▁b", -6},
      {"▁▁", -7}, {"ab", -5}, {"bc", -8}, {"abc", -9}, {"▁ab", -4}, {"ca", -5}};
  for (const auto& [p, sc] : normal) piece(p, sc, 1);
  model += pb_bytes(2, pb_uint(3, 2));                  // TrainerSpec: model_type BPE
  model += pb_bytes(3, pb_bytes(1, "identity") + pb_uint(4, 0));  // remove_extra_whitespaces false
  const Tokenizer t = Tokenizer::from_bytes(model, "handmade");
  ASSERT_TRUE(t.fast()) << t.why_not_fast();
  std::vector<std::string> texts;
  uint64_t x = 7;
  for (int i = 0; i < 3000; i++) {
    std::string s;
    const int n = (int)((x = x * 6364136223846793005ull + 1) >> 59) * (i % 5 == 0 ? 4 : 1);
    for (int k = 0; k < n; k++) s += "abc xy"[((x = x * 6364136223846793005ull + 1) >> 40) % 6];
    texts.push_back(s);
  }
  expect_fast_equals_sentencepiece(t, texts);
  // "▁" (id 3), then x and y, both unknown, as one <unk>; "a b" merges across the space into "a▁b".
  EXPECT_EQ(t.encode("xy"), (Ids{3, 0}));
  EXPECT_EQ(t.encode_literal("a b"), (Ids{9}));
}

TEST(FastBpe, UnsupportedModelsUseSentencePiece) {
  // A user-defined symbol: FastBpe declines, encoding still works through SentencePiece.
  const fs::path d = temp_dir("fast_decline");
  {
    std::ofstream f(d / "c.jsonl");
    const char* w[] = {"router", "expert", "[INST]", "token", "mixture", "sparse", "gate", "layer", "quickly",
                       "attention", "values", "keys", "jumps", "over", "lazy", "dogs", "while", "brown", "fox"};
    for (int i = 0; i < 300; i++) {
      std::string t;
      for (int k = 0; k < 12; k++) t += std::string(w[(i * 7 + k * 5) % 19]) + " ";
      f << R"({"text": ")" << t << i << "\"}\n";
    }
  }
  TokenizerTrainOptions o;
  o.inputs = {(d / "c.jsonl").string()};
  o.output_prefix = (d / "uds").string();
  o.vocab_size = 305;
  o.user_defined_symbols = {"[INST]"};
  train_tokenizer(o);
  const Tokenizer t = Tokenizer::load((d / "uds.model").string());
  EXPECT_FALSE(t.fast());
  EXPECT_NE(t.why_not_fast().find("user-defined"), std::string::npos) << t.why_not_fast();
  const Ids ids = t.encode("router [INST] expert");
  EXPECT_EQ(ids, t.encode_reference("router [INST] expert"));
  EXPECT_NE(std::find(ids.begin(), ids.end(), t.piece_to_id("[INST]")), ids.end());
  // A unigram model: declined too.
  o.output_prefix = (d / "uni").string();
  o.user_defined_symbols.clear();
  o.model_type = "unigram";
  train_tokenizer(o);
  const Tokenizer u = Tokenizer::load((d / "uni.model").string());
  EXPECT_FALSE(u.fast());
  EXPECT_EQ(u.decode(u.encode("router expert")), "router expert");
  fs::remove_all(d);
}

// ---- moetron tokenizer train ----

namespace {

// Two files: chat lines in PATH, text lines in PATH.text.jsonl (the format is detected per file).
void write_corpus(const fs::path& path) {
  std::ofstream f(path), ft(path.string() + ".text.jsonl");
  const char* words[] = {"router", "expert", "token", "mixture", "sparse", "gate", "layer", "attention",
                         "東京", "専門家", "données", "🙂"};
  for (int i = 0; i < 400; i++) {
    std::string a, b;
    for (int k = 0; k < 12; k++) a += std::string(words[(i * 7 + k * 3) % 12]) + " ";
    for (int k = 0; k < 9; k++) b += std::string(words[(i * 5 + k) % 12]) + (k % 4 == 3 ? ".\\n" : " ");
    if (i % 3 == 0)
      f << R"({"messages": [{"role": "user", "content": ")" << a << R"("}, {"role": "assistant", "content": ")" << b
        << "\"}]}\n";
    else
      ft << R"({"text": ")" << a << b << "\"}\n";
  }
  f << "not json at all\n";
}

}  // namespace

TEST(TokenizerTrain, BpeWithByteFallbackAndRequestedVocab) {
  const fs::path d = temp_dir("train");
  write_corpus(d / "corpus.jsonl");
  TokenizerTrainOptions o;
  o.inputs = {(d / "corpus.jsonl").string(), (d / "corpus.jsonl.text.jsonl").string()};
  o.output_prefix = (d / "tok").string();
  o.vocab_size = 400;
  const TokenizerTrainResult r = train_tokenizer(o);
  EXPECT_EQ(r.skipped_lines, 1u);  // the non-JSON line
  // 134 chat lines: the user text and the assistant's 3 lines; 266 text lines of 3 lines each.
  EXPECT_EQ(r.texts, 134u * 4 + 266u * 3);
  ASSERT_TRUE(fs::exists(d / "tok.model"));
  EXPECT_TRUE(fs::exists(d / "tok.vocab"));
  const Tokenizer t = Tokenizer::load((d / "tok.model").string());
  EXPECT_EQ(t.vocab_size(), 400);
  EXPECT_EQ(t.unk_id(), 0);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  // Byte fallback: all 256 byte pieces exist, and text never seen in training round-trips without <unk>.
  for (int b : {0x00, 0x0A, 0x41, 0xFF}) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    EXPECT_GE(t.piece_to_id(name), 0) << name;
  }
  const std::string unseen = "Zebra Ω ünïcödé ∑ 𝔘 — never in the corpus";
  const Ids ids = t.encode(unseen);
  for (int32_t id : ids) EXPECT_NE(id, t.unk_id()) << "byte fallback should avoid <unk>";
  EXPECT_EQ(t.decode(ids), unseen);
  // FastBpe handles the models `tokenizer train` writes, with and without byte fallback.
  ASSERT_TRUE(t.fast()) << t.why_not_fast();
  expect_fast_equals_sentencepiece(t, random_texts(1000, 2));
  TokenizerTrainOptions nb = o;
  nb.output_prefix = (d / "nobytes").string();
  nb.byte_fallback = false;
  nb.vocab_size = 150;
  train_tokenizer(nb);
  const Tokenizer tn = Tokenizer::load((d / "nobytes.model").string());
  ASSERT_TRUE(tn.fast()) << tn.why_not_fast();
  expect_fast_equals_sentencepiece(tn, random_texts(1000, 3));
  // BPE merged the frequent words: "router" is far fewer tokens than letters.
  EXPECT_LE(t.encode("router expert").size(), 4u);
  fs::remove_all(d);
}

TEST(TokenizerTrain, VocabTooSmallForBytesIsAnError) {
  const fs::path d = temp_dir("train_small");
  write_corpus(d / "corpus.jsonl");
  TokenizerTrainOptions o;
  o.inputs = {(d / "corpus.jsonl").string()};
  o.output_prefix = (d / "tok").string();
  o.vocab_size = 100;  // < 256 byte pieces + 3 specials
  EXPECT_THROW(train_tokenizer(o), Error);
  EXPECT_FALSE(fs::exists(d / "tok.model"));
  fs::remove_all(d);
}

// --output is a prefix.  "dir/" wrote the hidden dir/.model and dir/.vocab, an existing directory
// "dir" wrote dir.model beside it, and existing files were replaced silently: each is refused now
// before any training, naming the option, and nothing that existed is changed (--force replaces).
TEST(TokenizerTrain, OutputMustBeANewPrefix) {
  const fs::path d = temp_dir("train_out");
  write_corpus(d / "corpus.jsonl");
  TokenizerTrainOptions o;
  o.inputs = {(d / "corpus.jsonl").string()};
  o.vocab_size = 300;
  fs::create_directories(d / "dir");
  auto refused = [&](const std::string& prefix, const std::string& needle) {
    SCOPED_TRACE(prefix);
    o.output_prefix = prefix;
    try {
      train_tokenizer(o);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused((d / "dir").string() + "/", "names a directory");
  refused((d / "dir").string(), "names a directory");
  refused((d / "dir").string() + "/.", "names a directory");
  refused((d / "missing" / "tok").string(), "does not exist");
  EXPECT_TRUE(fs::is_empty(d / "dir"));
  EXPECT_FALSE(fs::exists(d / "dir.model"));
  // Existing outputs are kept, byte for byte.
  std::ofstream(d / "mine.model") << "my own file";
  refused((d / "mine").string(), "mine.model' exists already");
  std::ofstream(d / "other.vocab") << "my vocab";
  refused((d / "other").string(), "other.vocab' exists already");
  EXPECT_EQ(read_file(d / "mine.model"), "my own file");
  EXPECT_EQ(read_file(d / "other.vocab"), "my vocab");
  EXPECT_FALSE(fs::exists(d / "mine.vocab"));
  EXPECT_FALSE(fs::exists(d / "other.model"));
  // --force replaces them; a new prefix works without it.
  o.output_prefix = (d / "mine").string();
  o.overwrite = true;
  train_tokenizer(o);
  EXPECT_EQ(Tokenizer::load((d / "mine.model").string()).vocab_size(), 300);
  o.overwrite = false;
  o.output_prefix = (d / "dir" / "tokenizer").string();
  train_tokenizer(o);
  EXPECT_TRUE(fs::exists(d / "dir" / "tokenizer.model"));
  for (const auto& e : fs::directory_iterator(d / "dir"))
    EXPECT_EQ(e.path().filename().string().rfind("tokenizer.", 0), 0u) << "left behind: " << e.path();
  // The command: exit 1 and the message.
  const std::string cmd = std::string(MOETRON_BINARY) + " tokenizer train --input " + (d / "corpus.jsonl").string() +
                          " --vocab-size 300 --output " + (d / "dir").string() + "/ > " + (d / "out.txt").string() +
                          " 2>&1";
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_NE(read_file(d / "out.txt").find("--output"), std::string::npos) << read_file(d / "out.txt");
  EXPECT_FALSE(fs::exists(d / "dir" / ".model"));
  fs::remove_all(d);
}

TEST(TokenizerTrain, CliWritesAWorkingModel) {
  const fs::path d = temp_dir("train_cli");
  write_corpus(d / "corpus.jsonl");
  const std::string cmd = std::string(MOETRON_BINARY) + " tokenizer train --input " + (d / "corpus.jsonl").string() +
                          " --vocab-size 320 --output " + (d / "cli").string() + " > " + (d / "out.txt").string() +
                          " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const Tokenizer t = Tokenizer::load((d / "cli.model").string());
  EXPECT_EQ(t.vocab_size(), 320);
  EXPECT_EQ(t.decode(t.encode("mixture of experts")), "mixture of experts");
  // A missing input is a clean failure naming the file.
  const std::string bad = std::string(MOETRON_BINARY) + " tokenizer train --input " + (d / "missing.jsonl").string() +
                          " --vocab-size 320 --output " + (d / "bad").string() + " > " + (d / "err.txt").string() +
                          " 2>&1";
  const int status = std::system(bad.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 1);
  std::ifstream ef(d / "err.txt");
  const std::string err((std::istreambuf_iterator<char>(ef)), {});
  EXPECT_NE(err.find("missing.jsonl"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(d / "bad.model"));
  fs::remove_all(d);
}
