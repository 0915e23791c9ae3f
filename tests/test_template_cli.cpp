// moetron template render: texts, token ids and assistant masks as transformers gives them.
// References: tests/data/chat_templates/refs (texts, tools/chat_template_refs.py) and
// tests/data/chat_templates/ids (ids and masks of HF's apply_chat_template(tokenize=True) and the
// prefix rule computed with transformers, with the Qwen vocabulary: tools/chat_template_ids_refs.py).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/indexed_dataset.h"
#include "temp_dir.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::ordered_json;

namespace {

const fs::path kData = fs::path(MOETRON_SOURCE_DIR) / "tests" / "data" / "chat_templates";
const fs::path kShared = fs::path(MOETRON_SOURCE_DIR) / ".." / "shared" / "data";

struct CliRun {
  int code = -1;
  std::string out, err;
};

CliRun run(const std::string& args) {
  moetron::testing::TempDir tmp("template_cli");
  const std::string out = tmp.file("out.txt"), err = tmp.file("err.txt");
  const std::string cmd = std::string(MOETRON_BINARY) + " template render " + args + " > " + out + " 2> " + err;
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = moetron::testing::read_text(out);
  r.err = moetron::testing::read_text(err);
  return r;
}

std::vector<ordered_json> lines_of(const std::string& text) {
  std::vector<ordered_json> out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line))
    if (!line.empty()) out.push_back(ordered_json::parse(line));
  return out;
}

std::vector<ordered_json> read_jsonl(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return lines_of(ss.str());
}

// A model directory: the Qwen tokenizer.json, and a tokenizer_config.json with `specials` and the
// shared template `tfile`.
void make_model(const fs::path& dir, const std::string& tfile, const ordered_json& specials) {
  fs::copy_file(kShared / "qwen-tokenizer.json", dir / "tokenizer.json");
  std::ifstream t(kShared / "templates" / tfile);
  std::stringstream ss;
  ss << t.rdbuf();
  ordered_json cfg = specials;
  cfg["chat_template"] = ss.str();
  std::ofstream(dir / "tokenizer_config.json") << cfg.dump();
}

// The cases of tools/chat_template_ids_refs.py: name -> (shared template, special tokens).
std::map<std::string, std::pair<std::string, ordered_json>> ref_cases() {
  return {
      {"qwen3", {"Qwen-Qwen3-0.6B.jinja", {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}}}},
      {"qwen25", {"Qwen-Qwen2.5-7B-Instruct.jinja", {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}}}},
      {"lfm25",
       {"LFM2.5-8B-A1B.jinja",
        {{"bos_token", "<|endoftext|>"}, {"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}}}},
  };
}

}  // namespace

TEST(TemplateCli, IdsAndMasksEqualTransformers) {
  if (!fs::exists(kShared / "qwen-tokenizer.json") || !fs::exists(kShared / "templates"))
    GTEST_SKIP() << "../shared/data (Qwen tokenizer, templates) is absent";
  for (const auto& [name, c] : ref_cases()) {
    SCOPED_TRACE(name);
    moetron::testing::TempDir dir("template_model");
    make_model(dir.path(), c.first, c.second);
    const CliRun r = run("--model " + dir.path().string() + " --input " + (kData / "conversations.jsonl").string() +
                         " --ids --now 2026-12-07T12:00:00");
    const std::vector<ordered_json> got = lines_of(r.out), want = read_jsonl(kData / "ids" / (name + ".jsonl"));
    ASSERT_EQ(got.size(), want.size()) << r.err;
    size_t masks = 0;
    for (size_t k = 0; k < want.size(); ++k) {
      SCOPED_TRACE(want[k]["conversation"].get<std::string>());
      if (want[k].contains("error")) {
        EXPECT_TRUE(got[k].contains("error")) << got[k].dump();
        continue;
      }
      ASSERT_TRUE(got[k].contains("ids")) << got[k].dump();
      EXPECT_EQ(got[k]["ids"], want[k]["ids"]);
      // generation: HF's assistant_masks; prefix: the rule computed by the script with transformers.
      EXPECT_EQ(got[k]["mask_rule"], want[k]["mask_rule"]);
      EXPECT_EQ(got[k].contains("assistant_mask"), want[k].contains("assistant_mask"));
      if (want[k].contains("assistant_mask")) {
        EXPECT_EQ(got[k]["assistant_mask"], want[k]["assistant_mask"]);
        for (const auto& b : want[k]["assistant_mask"]) masks += b == 1;
      }
    }
    EXPECT_EQ(r.code, 1) << "the conversations the template refuses make the exit status 1";
    EXPECT_GE(masks, 20u) << "masked tokens compared";
  }
}

TEST(TemplateCli, PrefixRuleMasksTheAssistantTurns) {
  if (!fs::exists(kShared / "qwen-tokenizer.json")) GTEST_SKIP() << "../shared/data is absent";
  // A ChatML template without generation blocks (Qwen2.5's): each assistant turn is
  // "CONTENT<|im_end|>\n" after its "<|im_start|>assistant\n" header.
  moetron::testing::TempDir dir("template_prefix");
  make_model(dir.path(), "Qwen-Qwen2.5-7B-Instruct.jinja", {{"eos_token", "<|im_end|>"}});
  std::ofstream(dir.file("in.jsonl"))
      << R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]})"
      << "\n";
  const CliRun r = run("--model " + dir.path().string() + " --input " + dir.file("in.jsonl") + " --ids");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto got = lines_of(r.out);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0]["mask_rule"], "prefix");
  // The masked tokens, decoded piece by piece, spell the two replies with their end-of-turn markup.
  const auto& ids = got[0]["ids"];
  const auto& mask = got[0]["assistant_mask"];
  ASSERT_EQ(ids.size(), mask.size());
  std::vector<int> masked;
  for (size_t k = 0; k < ids.size(); ++k)
    if (mask[k] == 1) masked.push_back(ids[k]);
  // Exactly the tokens of "Yo<|im_end|>\n" and then "Ciao<|im_end|>\n" (each turn encodes on its
  // own here: "\n" before and "<|im_end|>" after are pre-token boundaries).
  const moetron::Tokenizer tok = moetron::Tokenizer::load((kShared / "qwen-tokenizer.json").string());
  std::vector<int> want;
  for (const char* turn : {"Yo<|im_end|>\n", "Ciao<|im_end|>\n"})
    for (int32_t id : tok.encode(turn)) want.push_back(id);
  EXPECT_EQ(masked, want);
}

TEST(TemplateCli, TemplateFileAndVariables) {
  moetron::testing::TempDir dir("template_file");
  std::ofstream(dir.file("t.jinja")) << "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                                        "{% if add_generation_prompt %}[assistant]{% endif %}{{ strftime_now('%d %b %Y') }}";
  std::ofstream(dir.file("in.jsonl")) << R"({"messages": [{"role": "user", "content": "héllo"}]})" << "\n";
  const CliRun r = run("--template " + dir.file("t.jinja") + " --input " + dir.file("in.jsonl") +
                       " --var bos_token=\"<s>\" --add-generation-prompt --now 2026-12-07");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto got = lines_of(r.out);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0]["text"], "<s>[user] héllo\n[assistant]07 Dec 2026");
}

TEST(TemplateCli, BadInputNamesTheLine) {
  moetron::testing::TempDir dir("template_bad");
  std::ofstream(dir.file("t.jinja")) << "{% for m in messages %}{{ m.content }}{% endfor %}";
  std::ofstream(dir.file("in.jsonl")) << R"({"messages": []})" << "\n" << R"({"messages": "hi"})" << "\n";
  CliRun r = run("--template " + dir.file("t.jinja") + " --input " + dir.file("in.jsonl"));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("in.jsonl:2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\"messages\""), std::string::npos) << r.err;
  // A template that does not parse: the error names its line and column.
  std::ofstream(dir.file("bad.jinja")) << "line one\n{% if x %}never closed";
  r = run("--template " + dir.file("bad.jinja") + " --input " + dir.file("in.jsonl"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("bad.jinja:2:"), std::string::npos) << r.err;
  // --ids without a model, a missing input.
  EXPECT_EQ(run("--template " + dir.file("t.jinja") + " --input " + dir.file("in.jsonl") + " --ids").code, 2);
  EXPECT_EQ(run("--template " + dir.file("t.jinja") + " --input " + dir.file("none.jsonl")).code, 2);
  // A model directory without a template.
  EXPECT_EQ(run("--model " + dir.path().string() + " --input " + dir.file("in.jsonl")).code, 2);
}

// data prepare with a model directory's own template (the default --template auto): token ids and
// loss masks equal the references (HF's ids; HF's assistant_masks for a generation template, the
// prefix rule for the others); conversations the template refuses or cannot mask are counted.
TEST(TemplateDataPrepare, ModelTemplateIdsAndMasksEqualTheReferences) {
  if (!fs::exists(kShared / "qwen-tokenizer.json") || !fs::exists(kShared / "templates"))
    GTEST_SKIP() << "../shared/data (Qwen tokenizer, templates) is absent";
  for (const auto& [name, c] : ref_cases()) {
    SCOPED_TRACE(name);
    moetron::testing::TempDir dir("template_prepare");
    const fs::path model = dir.path() / "model", out = dir.path() / "out";
    fs::create_directories(model);
    make_model(model, c.first, c.second);
    const std::string cmd = std::string(MOETRON_BINARY) + " data prepare --input " +
                            (kData / "conversations.jsonl").string() + " --tokenizer " + (model / "tokenizer.json").string() +
                            " --output " + out.string() + " --valid-fraction 0 --quiet > " + dir.file("log") + " 2>&1";
    const int status = std::system(cmd.c_str());
    ASSERT_EQ(WEXITSTATUS(status), 0) << moetron::testing::read_text(dir.file("log"));
    // The documents expected, in input order: those with a mask holding a 1.
    std::vector<ordered_json> want;
    size_t refused = 0, unstable = 0, no_loss = 0;
    for (const ordered_json& r : read_jsonl(kData / "ids" / (name + ".jsonl"))) {
      if (r.contains("error")) {
        ++refused;
      } else if (r["mask_rule"] == "unstable") {
        ++unstable;
      } else {
        bool any = false;
        for (const auto& b : r["assistant_mask"]) any = any || b == 1;
        if (any)
          want.push_back(r);
        else
          ++no_loss;
      }
    }
    const moetron::IndexedDataset ds = moetron::IndexedDataset::open((out / "train").string());
    const moetron::IndexedDataset ms = moetron::IndexedDataset::open((out / "train_mask").string());
    ASSERT_EQ(ds.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE(want[i]["conversation"].get<std::string>());
      std::vector<int32_t> t(ds.length(i)), m(ms.length(i));
      ds.read(i, t.data());
      ms.read(i, m.data());
      EXPECT_EQ(ordered_json(t), want[i]["ids"]);
      EXPECT_EQ(ordered_json(m), want[i]["assistant_mask"]);
    }
    std::ifstream dj(out / "dataset.json");
    const nlohmann::json j = nlohmann::json::parse(dj);
    EXPECT_EQ(j["template"], "jinja");
    EXPECT_EQ(j["skipped"]["by_reason"]["template_error"], refused);
    EXPECT_EQ(j["skipped"]["by_reason"]["not_prefix_stable"], unstable);
    EXPECT_EQ(j["skipped"]["by_reason"]["no_loss_tokens"], no_loss);
  }
}

// generate --chat with a model directory whose tokenizer_config.json holds a Jinja template (the tiny
// Qwen3-MoE): the prompt is the template's rendering, transformers' apply_chat_template ids.
TEST(TemplateGenerate, ChatPromptIsTheModelTemplates) {
  const fs::path golden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate";
  std::ifstream in(golden / "expected.json");
  const nlohmann::json t = nlohmann::json::parse(in)["cases"][2]["text"]["chat"];
  moetron::testing::TempDir dir("template_generate");
  std::ofstream(dir.file("prompt.txt")) << t["user"].get<std::string>();
  const std::string cmd = std::string(MOETRON_BINARY) + " generate --model " + (golden / "qwen3_moe").string() +
                          " --prompt \"$(cat " + dir.file("prompt.txt") + ")\" --chat --max-new-tokens 4 --stats > " +
                          dir.file("out") + " 2> " + dir.file("err");
  ASSERT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 0) << moetron::testing::read_text(dir.file("err"));
  const std::string err = moetron::testing::read_text(dir.file("err"));
  EXPECT_NE(err.find(fmt::format("prompt {} tokens", t["prompt_ids"].size())), std::string::npos) << err;
}
