// moetron data prepare end to end: counts in dataset.json, the .bin/.idx files read back, each kind of
// bad line with its line number, --strict, zero usable documents, the split, and identical output
// whatever the thread count.  A small tokenizer is trained once for these tests, so they do not need
// ../shared; one test additionally checks the mistral template through the pipeline against
// mistral-common's tokens when ../shared/data/mixtral-tokenizer.model is present.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/prepare.h"
#include "io/indexed_dataset.h"
#include "io/line_reader.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const std::string kSource = MOETRON_SOURCE_DIR;
const std::string kMixtral = kSource + "/../shared/data/mixtral-tokenizer.model";

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string chat_line(const std::vector<std::pair<std::string, std::string>>& msgs) {
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [role, content] : msgs) m.push_back({{"role", role}, {"content", content}});
  return nlohmann::json{{"messages", m}}.dump();
}

class DataPrepare : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("moetron_prep_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    // A small corpus to train the test tokenizer on.
    std::ofstream f(root_ / "corpus.jsonl");
    const char* words[] = {"router", "expert", "token", "mixture", "sparse", "gate", "layer", "東京", "🙂", "data"};
    for (int i = 0; i < 300; i++) {
      std::string t;
      for (int k = 0; k < 15; k++) t += std::string(words[(i * 3 + k * 7) % 10]) + " ";
      f << nlohmann::json{{"text", t}}.dump() << "\n";
    }
    f.close();
    TokenizerTrainOptions o;
    o.inputs = {(root_ / "corpus.jsonl").string()};
    o.output_prefix = (root_ / "tok").string();
    o.vocab_size = 300;
    train_tokenizer(o);
    tok_path_ = (root_ / "tok.model").string();
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  void SetUp() override {
    dir_ = root_ / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  fs::path write(const std::string& name, const std::vector<std::string>& lines) {
    const fs::path p = dir_ / name;
    std::ofstream f(p, std::ios::binary);
    for (const auto& l : lines) f << l << "\n";
    return p;
  }

  PrepareOptions options(std::vector<fs::path> inputs, const fs::path& out) {
    PrepareOptions o;
    for (const auto& p : inputs) o.inputs.push_back(p.string());
    o.tokenizer_path = tok_path_;
    o.output_dir = out.string();
    o.valid_fraction = 0.0;
    o.log = nullptr;
    return o;
  }

  nlohmann::json dataset_json(const fs::path& out) { return nlohmann::json::parse(read_file(out / "dataset.json")); }

  struct Cli {
    int exit_code = -1;
    std::string out, err;
  };
  Cli cli(const std::string& args) {
    const fs::path o = dir_ / "cli_stdout.txt", e = dir_ / "cli_stderr.txt";
    const std::string cmd = std::string(MOETRON_BINARY) + " data prepare " + args + " > " + o.string() + " 2> " + e.string();
    const int status = std::system(cmd.c_str());
    Cli r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(o);
    r.err = read_file(e);
    return r;
  }

  static inline fs::path root_;
  static inline std::string tok_path_;
  fs::path dir_;
};

std::vector<std::string> good_chats() {
  return {
      chat_line({{"user", "What is a router?"}, {"assistant", "It sends each token to experts."}}),
      chat_line({{"system", "Be brief."}, {"user", "Name a layer."}, {"assistant", "The gate."}}),
      chat_line({{"user", "東京?"}, {"assistant", "東京 🙂"}, {"user", "More data"}, {"assistant", "sparse mixture"}}),
  };
}

}  // namespace

// A line serve answers is a line data prepare keeps (data/chat_content.h, parse_role): content as a
// list of text parts (concatenated) and OpenAI's "developer" role (the system message) give the
// same messages as the plain form; they were skipped as missing_field / unknown_role.  Parts that are
// not text are still skipped, naming the part.
TEST(ChatRecords, ContentPartsAndTheDeveloperRoleAreReadAsServeReadsThem) {
  Record plain, parts;
  RecordError err;
  ASSERT_TRUE(parse_record(
      R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok"}]})",
      RecordFormat::auto_detect, plain, err))
      << err.message;
  ASSERT_TRUE(parse_record(
      R"({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}, {"role": "assistant", "content": "ok"}]})",
      RecordFormat::auto_detect, parts, err))
      << err.message;
  ASSERT_EQ(parts.messages.size(), plain.messages.size());
  for (size_t i = 0; i < plain.messages.size(); i++) {
    EXPECT_EQ(parts.messages[i].role, plain.messages[i].role) << i;
    EXPECT_EQ(parts.messages[i].content, plain.messages[i].content) << i;
  }
  Record r;
  EXPECT_FALSE(parse_record(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
                            RecordFormat::chat, r, err));
  EXPECT_EQ(err.reason, SkipReason::missing_field);
  EXPECT_NE(err.message.find("messages[0].content[0].type must be \"text\""), std::string::npos) << err.message;
  EXPECT_FALSE(parse_record(R"({"messages": [{"role": "user", "content": 7}]})", RecordFormat::chat, r, err));
  EXPECT_NE(err.message.find("messages[0].content must be a string or an array of text parts"), std::string::npos)
      << err.message;
}

TEST_F(DataPrepare, EndToEndCountsAndReadBack) {
  const Tokenizer tok = Tokenizer::load(tok_path_);
  const fs::path chat = write("chat.jsonl", good_chats());
  const fs::path pc = write("pc.jsonl", {R"({"prompt": "token router", "completion": "expert gate"})",
                                         R"({"prompt": "", "completion": "data"})"});
  const fs::path text = write("text.jsonl", {R"({"text": "sparse mixture of experts"})", R"({"text": ""})"});
  const fs::path out = dir_ / "out";
  const PrepareReport r = prepare_dataset(options({chat, pc, text}, out));

  // What the pipeline must have produced, document by document, in input order.
  std::vector<TokenizedDocument> want;
  for (const std::string& l : good_chats()) {
    Record rec;
    RecordError err;
    ASSERT_TRUE(parse_record(l, RecordFormat::chat, rec, err));
    want.push_back(apply_chat_template(ChatTemplate::mistral, tok, rec.messages));
  }
  want.push_back(apply_chat_template(ChatTemplate::mistral, tok, std::vector<ChatMessage>{{Role::user, "token router"}, {Role::assistant, "expert gate"}}));
  want.push_back(apply_chat_template(ChatTemplate::mistral, tok, std::vector<ChatMessage>{{Role::user, ""}, {Role::assistant, "data"}}));
  for (const char* t : {"sparse mixture of experts", ""}) {
    TokenizedDocument d;
    tokenize_text(tok, t, d);
    want.push_back(d);
  }
  uint64_t tokens = 0, loss = 0;
  for (const auto& d : want) tokens += d.tokens.size(), loss += d.loss_tokens();

  EXPECT_EQ(r.train.documents, 7u);
  EXPECT_EQ(r.valid.documents, 0u);
  EXPECT_EQ(r.skipped, 0u);
  const auto j = dataset_json(out);
  EXPECT_EQ(j["train"]["documents"], 7);
  EXPECT_EQ(j["train"]["tokens"], tokens);
  EXPECT_EQ(j["train"]["loss_tokens"], loss);
  EXPECT_EQ(j["valid"]["documents"], 0);
  EXPECT_EQ(j["tokenizer"]["sha256"], tok.sha256());
  EXPECT_EQ(j["template"], "mistral");
  EXPECT_EQ(j["token_dtype"], "uint16");
  ASSERT_EQ(j["sources"].size(), 3u);
  EXPECT_EQ(j["sources"][0]["format"], "chat");
  EXPECT_EQ(j["sources"][1]["format"], "prompt_completion");
  EXPECT_EQ(j["sources"][2]["format"], "text");
  EXPECT_EQ(j["sources"][1]["documents"], 2);

  // Read back: same documents, same lengths in tokens and mask, dtype codes as in Megatron's enum.
  const IndexedDataset ds = IndexedDataset::open((out / "train").string());
  const IndexedDataset ms = IndexedDataset::open((out / "train_mask").string());
  EXPECT_EQ(ds.dtype(), IndexedDType::u16);
  EXPECT_EQ(ms.dtype(), IndexedDType::u8);
  EXPECT_EQ((uint8_t)read_file(out / "train.idx").at(17), 8);       // uint16, byte 17 of the header
  EXPECT_EQ((uint8_t)read_file(out / "train_mask.idx").at(17), 1);  // uint8
  ASSERT_EQ(ds.size(), want.size());
  ASSERT_EQ(ms.size(), want.size());
  EXPECT_EQ(ds.elements(), tokens);
  EXPECT_EQ(ds.document_index().size(), want.size() + 1);
  for (size_t i = 0; i < want.size(); i++) {
    ASSERT_EQ(ds.length(i), want[i].tokens.size()) << i;
    ASSERT_EQ(ms.length(i), ds.length(i)) << i;
    std::vector<int32_t> t(ds.length(i)), m(ms.length(i));
    ds.read(i, t.data());
    ms.read(i, m.data());
    EXPECT_EQ(t, want[i].tokens) << i;
    EXPECT_EQ(std::vector<uint8_t>(m.begin(), m.end()), want[i].loss_mask) << i;
  }
  EXPECT_EQ(IndexedDataset::open((out / "valid").string()).size(), 0u);
  EXPECT_FALSE(fs::exists(out / "dataset.json.tmp"));
}

TEST_F(DataPrepare, TrainOnPromptPutsEveryTokenInTheLoss) {
  const fs::path chat = write("chat.jsonl", good_chats());
  PrepareOptions o = options({chat}, dir_ / "out");
  o.train_on_prompt = true;
  const PrepareReport r = prepare_dataset(o);
  EXPECT_EQ(r.train.loss_tokens, r.train.tokens);
  const PrepareReport masked = prepare_dataset(options({chat}, dir_ / "out2"));
  EXPECT_EQ(masked.train.tokens, r.train.tokens);
  EXPECT_LT(masked.train.loss_tokens, masked.train.tokens);
  EXPECT_EQ(dataset_json(dir_ / "out")["train_on_prompt"], true);
}

TEST_F(DataPrepare, EachBadLineKindIsCountedWithItsLineNumber) {
  std::vector<std::string> lines = {
      good_chats()[0],                                                                  // 1 ok
      R"({"messages": [{"role": "user", "content": "x"}, )",                           // 2 invalid_json
      R"({"text": "a text line in a chat file"})",                                      // 3 missing_field
      chat_line({{"user", "hi"}, {"tool", "result"}, {"assistant", "ok"}}),             // 4 unknown_role
      chat_line({{"user", "hi"}, {"assistant", "ok"}, {"system", "late"}, {"user", "x"}}),  // 5 bad_role_order
      std::string(R"({"messages": [{"role": "user", "content": "bad )") + "\xff\xfe" + R"("}]})",  // 6 invalid_utf8
      "",                                                                               // 7 blank
      chat_line({{"user", "hi"}, {"assistant", ""}}),                                   // 8 empty_assistant
      chat_line({{"user", "only a prompt"}}),                                           // 9 no_loss_tokens
      R"({"messages": "not an array"})",                                                // 10 missing_field
      R"([1, 2, 3])",                                                                   // 11 invalid_json
      good_chats()[1],                                                                  // 12 ok
  };
  const fs::path in = write("bad.jsonl", lines);
  const PrepareReport r = prepare_dataset(options({in}, dir_ / "out"));
  EXPECT_EQ(r.train.documents, 2u);
  EXPECT_EQ(r.blank_lines, 1u);
  EXPECT_EQ(r.skipped, 9u);
  const auto j = dataset_json(dir_ / "out");
  const auto& sk = j["skipped"];
  EXPECT_EQ(sk["total"], 9);
  EXPECT_EQ(sk["by_reason"]["invalid_json"], 2);
  EXPECT_EQ(sk["by_reason"]["missing_field"], 2);
  EXPECT_EQ(sk["by_reason"]["unknown_role"], 1);
  EXPECT_EQ(sk["by_reason"]["bad_role_order"], 1);
  EXPECT_EQ(sk["by_reason"]["invalid_utf8"], 1);
  EXPECT_EQ(sk["by_reason"]["empty_assistant"], 1);
  EXPECT_EQ(sk["by_reason"]["no_loss_tokens"], 1);
  const std::vector<std::pair<int, std::string>> want = {
      {2, "invalid_json"},   {3, "missing_field"},   {4, "unknown_role"},   {5, "bad_role_order"}, {6, "invalid_utf8"},
      {8, "empty_assistant"}, {9, "no_loss_tokens"}, {10, "missing_field"}, {11, "invalid_json"}};
  ASSERT_EQ(sk["lines"].size(), want.size());
  for (size_t i = 0; i < want.size(); i++) {
    EXPECT_EQ(sk["lines"][i]["file"], in.string());
    EXPECT_EQ(sk["lines"][i]["line"], want[i].first);
    EXPECT_EQ(sk["lines"][i]["reason"], want[i].second);
  }
  EXPECT_EQ(sk["lines_truncated"], false);
  EXPECT_EQ(j["sources"][0]["lines"], 12);
  EXPECT_EQ(j["sources"][0]["skipped"], 9);

  // The CLI reports each one on stderr as FILE:LINE and still succeeds.
  const Cli c = cli("--input " + in.string() + " --tokenizer " + tok_path_ + " --output " + (dir_ / "cli").string());
  EXPECT_EQ(c.exit_code, 0) << c.err;
  for (const auto& [line, reason] : want)
    EXPECT_NE(c.err.find(in.string() + ":" + std::to_string(line) + ": " + reason), std::string::npos)
        << "stderr lacks line " << line << ": " << c.err;
  EXPECT_NE(c.out.find("train 2 documents"), std::string::npos) << c.out;
}

TEST_F(DataPrepare, StrictStopsAtTheFirstBadLineAndLeavesNothing) {
  const fs::path in = write("bad.jsonl", {good_chats()[0], good_chats()[1], "{oops", good_chats()[2]});
  const fs::path out = dir_ / "out";
  const Cli c = cli("--input " + in.string() + " --tokenizer " + tok_path_ + " --output " + out.string() + " --strict");
  EXPECT_EQ(c.exit_code, 1) << c.err;
  EXPECT_NE(c.err.find(in.string() + ":3: invalid_json"), std::string::npos) << c.err;
  EXPECT_FALSE(fs::exists(out)) << "no output may be left behind";
  // Into an existing directory: nothing is added to it.
  fs::create_directories(out);
  PrepareOptions o = options({in}, out);
  o.strict = true;
  EXPECT_THROW(prepare_dataset(o), Error);
  EXPECT_TRUE(fs::is_empty(out));
  // Without --strict the same input succeeds.
  EXPECT_EQ(cli("--input " + in.string() + " --tokenizer " + tok_path_ + " --output " + out.string()).exit_code, 0);
  EXPECT_TRUE(fs::exists(out / "dataset.json"));
}

// A line longer than --max-line-bytes is skipped without being held (reason line_too_long, listed
// with file:line like any unusable line; --strict: an error).  A 200 MB line used to take 4 GB: its
// JSON DOM, copies of its strings and the tokenizer's arrays.
TEST_F(DataPrepare, LinesLongerThanTheLimitAreSkippedUnread) {
  const std::string long_text = nlohmann::json{{"text", std::string(100000, 'x')}}.dump();
  const fs::path in = write("long.jsonl", {good_chats()[0], chat_line({{"user", "q"}, {"assistant", long_text}}),
                                           good_chats()[1]});
  PrepareOptions o = options({in}, dir_ / "out");
  o.max_line_bytes = 4096;
  const PrepareReport r = prepare_dataset(o);
  EXPECT_EQ(r.train.documents, 2u);
  EXPECT_EQ(r.skipped, 1u);
  EXPECT_EQ(r.skipped_by_reason[(int)SkipReason::line_too_long], 1u);
  const auto j = dataset_json(dir_ / "out");
  ASSERT_EQ(j["skipped"]["lines"].size(), 1u);
  EXPECT_EQ(j["skipped"]["lines"][0]["line"], 2);
  EXPECT_EQ(j["skipped"]["lines"][0]["reason"], "line_too_long");
  EXPECT_NE(j["skipped"]["lines"][0]["message"].get<std::string>().find("more than --max-line-bytes 4096"),
            std::string::npos);
  EXPECT_EQ(j["skipped"]["by_reason"]["line_too_long"], 1);
  // The CLI: the option, the report on stderr, --strict.
  const std::string args = "--input " + in.string() + " --tokenizer " + tok_path_ + " --max-line-bytes 4096 --output ";
  Cli c = cli(args + (dir_ / "cli").string());
  EXPECT_EQ(c.exit_code, 0) << c.err;
  EXPECT_NE(c.err.find(in.string() + ":2: line_too_long"), std::string::npos) << c.err;
  c = cli(args + (dir_ / "strict").string() + " --strict");
  EXPECT_EQ(c.exit_code, 1) << c.err;
  EXPECT_NE(c.err.find(in.string() + ":2: line_too_long"), std::string::npos) << c.err;
  EXPECT_FALSE(fs::exists(dir_ / "strict"));
  c = cli(args + (dir_ / "zero").string() + " --max-line-bytes 0");
  EXPECT_NE(c.exit_code, 0);
  EXPECT_NE(c.err.find("--max-line-bytes"), std::string::npos) << c.err;
  // Under the default 16 MiB the line is a document.
  EXPECT_EQ(prepare_dataset(options({in}, dir_ / "default")).train.documents, 3u);
}

// Runs `moetron data prepare ARGS...` (no shell) and returns that process's own peak RSS in KiB
// (wait4), -1 if it did not exit 0.
long prepare_peak_rss_kib(const std::vector<std::string>& args) {
  std::vector<std::string> argv_s = {MOETRON_BINARY, "data", "prepare"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    freopen("/dev/null", "w", stdout);
    freopen("/dev/null", "w", stderr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  rusage ru{};
  if (pid < 0 || wait4(pid, &status, 0, &ru) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return ru.ru_maxrss;
}

// The default limit through the command: a 24 MB line is passed over in a few MB of memory.  The
// bound is relative to the same command on a small file, since the binary's own footprint differs
// between builds.  (Until cuBLASLt was loaded lazily, its ~210 MB in this test process -- a forked
// child's ru_maxrss starts at its parent's RSS -- hid that the first 16 MiB of the line were held.)
TEST_F(DataPrepare, AnOverlongLineIsNeverHeldInMemory) {
#if defined(__SANITIZE_ADDRESS__)
  // ASan keeps freed memory in quarantine (up to 256 MB), so peak RSS follows the bytes allocated
  // over time rather than those live at once: the bound is checked in the Release run.
  GTEST_SKIP() << "peak RSS is not a measure of live memory under AddressSanitizer";
#endif
  const fs::path in = dir_ / "huge.jsonl", small = dir_ / "small.jsonl";
  {
    std::ofstream f(in, std::ios::binary);
    f << good_chats()[0] << "\n{\"text\": \"" << std::string(24u << 20, 'a') << "\"}\n" << good_chats()[1] << "\n";
    std::ofstream g(small, std::ios::binary);
    g << good_chats()[0] << "\n{\"text\": \"a\"}\n" << good_chats()[1] << "\n";
  }
  const Cli c = cli("--input " + in.string() + " --tokenizer " + tok_path_ + " --output " + (dir_ / "out").string());
  EXPECT_EQ(c.exit_code, 0) << c.err;
  EXPECT_NE(c.err.find(in.string() + ":2: line_too_long: the line is 25165836 bytes"), std::string::npos) << c.err;
  EXPECT_EQ(dataset_json(dir_ / "out")["train"]["documents"], 2);
  const long base = prepare_peak_rss_kib({"--input", small.string(), "--tokenizer", tok_path_, "--output",
                                          (dir_ / "small_out").string()});
  const long huge = prepare_peak_rss_kib({"--input", in.string(), "--tokenizer", tok_path_, "--output",
                                          (dir_ / "huge_out").string()});
  ASSERT_GT(base, 0);
  ASSERT_GT(huge, 0);
  EXPECT_LT(huge, base + 16L * 1024) << "peak RSS, KiB, of the run with the 24 MiB line vs. without it (" << base
                                      << "): the line must not be held";
}

// LineReader: lines across its 1 MiB read buffer, the limit exactly, a final line without '\n'.
TEST(LineReader, LinesAcrossBufferBoundsAndTheLimit) {
  const fs::path p = fs::temp_directory_path() / ("moetron_linereader_" + std::to_string(::getpid()));
  const size_t M = size_t{1} << 20;
  const std::vector<size_t> lens = {0, 5, M - 7, M, M + 1, 3 * M, 0, 10, 3};
  {
    std::ofstream f(p, std::ios::binary);
    for (size_t i = 0; i < lens.size(); i++) f << std::string(lens[i], (char)('a' + i)) << (i + 1 < lens.size() ? "\n" : "");
  }
  LineReader r(p.string(), M);
  std::string line;
  for (size_t i = 0; i < lens.size(); i++) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(r.next(line));
    EXPECT_EQ(r.line_number(), i + 1);
    EXPECT_EQ(r.line_bytes(), lens[i]);
    EXPECT_EQ(r.too_long(), lens[i] > M);
    EXPECT_EQ(line, lens[i] > M ? std::string() : std::string(lens[i], (char)('a' + i)));
  }
  EXPECT_FALSE(r.next(line));
  EXPECT_EQ(r.bytes_read(), fs::file_size(p));
  fs::remove(p);
  EXPECT_THROW(LineReader(p.string()), Error);
}

TEST_F(DataPrepare, ZeroUsableDocumentsIsAnError) {
  const fs::path in = write("none.jsonl", {"not json", "", chat_line({{"user", "prompt only"}})});
  const fs::path out = dir_ / "out";
  const Cli c = cli("--input " + in.string() + " --tokenizer " + tok_path_ + " --output " + out.string());
  EXPECT_EQ(c.exit_code, 1);
  EXPECT_NE(c.err.find("no usable training documents"), std::string::npos) << c.err;
  EXPECT_FALSE(fs::exists(out));
  const fs::path empty = write("empty.jsonl", {});
  EXPECT_THROW(prepare_dataset(options({empty}, out)), Error);
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(DataPrepare, MissingInputOrTokenizerIsACleanError) {
  const fs::path out = dir_ / "out";
  Cli c = cli("--input " + (dir_ / "nope.jsonl").string() + " --tokenizer " + tok_path_ + " --output " + out.string());
  EXPECT_EQ(c.exit_code, 1);
  EXPECT_NE(c.err.find("nope.jsonl"), std::string::npos) << c.err;
  const fs::path in = write("ok.jsonl", good_chats());
  c = cli("--input " + in.string() + " --tokenizer " + (dir_ / "no.model").string() + " --output " + out.string());
  EXPECT_EQ(c.exit_code, 1);
  EXPECT_NE(c.err.find("no.model"), std::string::npos) << c.err;
  EXPECT_FALSE(fs::exists(out));
}

// Many documents, small chunks: the bytes of every output file are the same for 1 and 2 threads.
TEST_F(DataPrepare, OutputIdenticalForOneAndTwoThreads) {
  std::vector<std::string> lines;
  for (int i = 0; i < 500; i++) {
    std::string u = "question " + std::to_string(i) + " about the router", a;
    for (int k = 0; k < i % 37; k++) a += "expert " + std::to_string(k * i) + " ";
    lines.push_back(i % 50 == 7 ? "broken {" : chat_line({{"user", u}, {"assistant", a.empty() ? "ok" : a}}));
  }
  const fs::path in = write("many.jsonl", lines);
  std::vector<std::string> files = {"train.bin", "train.idx", "train_mask.bin", "train_mask.idx", "valid.bin",
                                    "valid.idx", "valid_mask.bin", "valid_mask.idx", "dataset.json"};
  std::vector<std::string> first;
  for (int threads : {1, 2}) {
    PrepareOptions o = options({in}, dir_ / ("t" + std::to_string(threads)));
    o.threads = threads;
    o.valid_fraction = 0.1;
    o.chunk_lines = 7;
    const PrepareReport r = prepare_dataset(o);
    EXPECT_EQ(r.threads, threads);
    EXPECT_EQ(r.skipped, 10u);
    std::vector<std::string> bytes;
    for (const auto& f : files) bytes.push_back(read_file(dir_ / ("t" + std::to_string(threads)) / f));
    if (first.empty())
      first = bytes;
    else
      for (size_t k = 0; k < files.size(); k++) EXPECT_EQ(bytes[k], first[k]) << files[k] << " differs";
  }
  // The CLI with default chunks agrees with the small-chunk run.
  ASSERT_EQ(cli("--input " + in.string() + " --tokenizer " + tok_path_ + " --output " + (dir_ / "cli").string() +
                " --threads 2 --valid-fraction 0.1")
                .exit_code,
            0);
  for (size_t k = 0; k < files.size(); k++) EXPECT_EQ(read_file(dir_ / "cli" / files[k]), first[k]) << files[k];
}

TEST_F(DataPrepare, SplitIsDeterministicAndFollowsTheSeed) {
  std::vector<std::string> lines;
  for (int i = 0; i < 400; i++) lines.push_back(chat_line({{"user", fmt::format("q{}", i)}, {"assistant", "a"}}));
  const fs::path in = write("split.jsonl", lines);
  auto run = [&](uint64_t seed, const std::string& name) {
    PrepareOptions o = options({in}, dir_ / name);
    o.valid_fraction = 0.25;
    o.seed = seed;
    return prepare_dataset(o);
  };
  const PrepareReport a = run(1, "a"), b = run(1, "b"), c = run(2, "c");
  EXPECT_EQ(a.train.documents + a.valid.documents, 400u);
  // 400 Bernoulli(0.25) draws: mean 100, sd ~8.7; 60..140 is more than 4.5 sd either side.
  EXPECT_GT(a.valid.documents, 60u);
  EXPECT_LT(a.valid.documents, 140u);
  EXPECT_EQ(read_file(dir_ / "a" / "valid.bin"), read_file(dir_ / "b" / "valid.bin"));
  EXPECT_NE(read_file(dir_ / "a" / "valid.bin"), read_file(dir_ / "c" / "valid.bin"));
  EXPECT_EQ(dataset_json(dir_ / "a")["split"]["seed"], 1);

  // --valid-input: every input line is train, every valid-input line is valid.
  const fs::path v = write("valid.jsonl", {good_chats()[0], good_chats()[1]});
  PrepareOptions o = options({in}, dir_ / "vi");
  o.valid_inputs = {v.string()};
  const PrepareReport r = prepare_dataset(o);
  EXPECT_EQ(r.train.documents, 400u);
  EXPECT_EQ(r.valid.documents, 2u);
  const auto j = dataset_json(dir_ / "vi");
  EXPECT_EQ(j["split"]["method"], "valid_input");
  EXPECT_EQ(j["sources"][1]["split"], "valid");
}

// The mistral template through the whole pipeline equals mistral-common on the committed cases.
TEST_F(DataPrepare, MistralPipelineMatchesMistralCommon) {
  if (!fs::exists(kMixtral)) GTEST_SKIP() << "the Mixtral tokenizer is not at " << kMixtral << " (../shared is absent)";
  const fs::path out = dir_ / "out";
  PrepareOptions o = options({kSource + "/tests/data/chat_cases.jsonl"}, out);
  o.tokenizer_path = kMixtral;
  o.threads = 2;
  const PrepareReport r = prepare_dataset(o);
  const auto golden = nlohmann::json::parse(read_file(kSource + "/tests/golden/chat/mistral_v1.json"));
  // Conversations without an assistant message have no loss token and are skipped.
  std::vector<const nlohmann::json*> kept;
  for (const auto& c : golden["cases"]) {
    bool any = false;
    for (int m : c["loss_mask"].is_null() ? std::vector<int>{1} : c["loss_mask"].get<std::vector<int>>()) any |= m;
    if (any) kept.push_back(&c);
  }
  EXPECT_EQ(r.skipped, golden["cases"].size() - kept.size());
  EXPECT_EQ(r.skipped_by_reason[(int)SkipReason::no_loss_tokens], r.skipped);
  const IndexedDataset ds = IndexedDataset::open((out / "train").string());
  const IndexedDataset ms = IndexedDataset::open((out / "train_mask").string());
  ASSERT_EQ(ds.size(), kept.size());
  for (size_t i = 0; i < kept.size(); i++) {
    std::vector<int32_t> t(ds.length(i)), m(ms.length(i));
    ds.read(i, t.data());
    ms.read(i, m.data());
    EXPECT_EQ(t, (*kept[i])["tokens"].get<std::vector<int32_t>>()) << (*kept[i])["name"];
    if (!(*kept[i])["loss_mask"].is_null()) {
      EXPECT_EQ(m, (*kept[i])["loss_mask"].get<std::vector<int32_t>>());
    }
  }
}
