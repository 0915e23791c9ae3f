// Every real chat template in ../shared/data/templates rendered over the committed conversations
// (tests/data/chat_templates/conversations.jsonl) equals transformers' apply_chat_template byte for
// byte: the references are tests/data/chat_templates/refs/<template>.jsonl, made by
// tools/chat_template_refs.py (transformers 5.24, jinja2 3.1.6; clock frozen at 2026-12-07 12:00).
// Where transformers raised, the interpreter must raise too (raise_exception: the same message).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "jinja/chat_context.h"
#include "jinja/jinja.h"

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using namespace moetron::jinja;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<ordered_json> read_jsonl(const fs::path& p) {
  std::vector<ordered_json> out;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(ordered_json::parse(line));
  return out;
}

fs::path templates_dir() { return fs::path(MOETRON_SOURCE_DIR) / ".." / "shared" / "data" / "templates"; }
fs::path refs_dir() { return fs::path(MOETRON_SOURCE_DIR) / "tests" / "data" / "chat_templates" / "refs"; }

RenderOptions frozen() {
  RenderOptions o;
  std::tm t{};
  t.tm_year = 2026 - 1900;
  t.tm_mon = 11;
  t.tm_mday = 7;
  t.tm_hour = 12;
  t.tm_wday = 1;  // a Monday
  t.tm_yday = 340;
  o.now = t;
  return o;
}

ChatInput input_of(const ordered_json& conv, bool agp) {
  ChatInput in;
  in.messages = conv.at("messages");
  if (conv.contains("tools")) in.tools = conv.at("tools");
  in.add_generation_prompt = agp;
  in.special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"unk_token", "<unk>"}, {"pad_token", "<pad>"}};
  if (conv.contains("chat_template_kwargs")) in.kwargs = conv.at("chat_template_kwargs");
  return in;
}

// Where two texts first differ, for a readable failure.
std::string first_difference(const std::string& a, const std::string& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  const size_t from = k > 60 ? k - 60 : 0;
  return "at byte " + std::to_string(k) + "\n  expected: ..." + ordered_json(a.substr(from, 160)).dump() +
         "\n  rendered: ..." + ordered_json(b.substr(from, 160)).dump();
}

}  // namespace

TEST(JinjaRealTemplates, EveryTemplateRendersAsTransformers) {
  if (!fs::exists(templates_dir())) GTEST_SKIP() << "../shared/data/templates is absent";
  std::map<std::string, ordered_json> convs;
  for (auto& c : read_jsonl(fs::path(MOETRON_SOURCE_DIR) / "tests/data/chat_templates/conversations.jsonl"))
    convs[c.at("name").get<std::string>()] = c;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(templates_dir()))
    if (e.path().extension() == ".jinja") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_EQ(files.size(), 70u);
  const RenderOptions opts = frozen();
  size_t renders = 0, errors = 0, failed_templates = 0;
  for (const fs::path& tf : files) {
    const fs::path rf = refs_dir() / (tf.stem().string() + ".jsonl");
    ASSERT_TRUE(fs::exists(rf)) << rf;
    std::unique_ptr<Template> t;
    try {
      t = std::make_unique<Template>(read_file(tf), tf.filename().string());
    } catch (const TemplateError& e) {
      ADD_FAILURE() << tf.filename() << " does not parse: " << e.what();
      ++failed_templates;
      continue;
    }
    int bad = 0;
    for (const ordered_json& ref : read_jsonl(rf)) {
      const std::string name = ref.at("conversation");
      const bool agp = ref.at("add_generation_prompt");
      SCOPED_TRACE(tf.filename().string() + " / " + name + (agp ? " / add_generation_prompt" : ""));
      ++renders;
      Spans spans;
      std::string text, err;
      ErrorKind kind = ErrorKind::syntax;
      try {
        text = render_chat(*t, input_of(convs.at(name), agp), opts, &spans);
      } catch (const TemplateError& e) {
        err = e.what();
        kind = e.kind();
        if (kind == ErrorKind::raised) err = e.message();
      }
      if (ref.contains("error")) {
        ++errors;
        // The same kind of error: raise_exception with its message; a missing name or attribute; a
        // type error (Python's TypeError and Jinja's runtime errors); the sandbox's refusal.
        const std::string type = ref.at("error_type");
        const ErrorKind want = type == "TemplateError"   ? ErrorKind::raised
                               : type == "UndefinedError" ? ErrorKind::undefined
                               : type == "SecurityError"  ? ErrorKind::security
                                                          : ErrorKind::type;
        if (err.empty()) {
          ADD_FAILURE() << "transformers raised (" << type << ": " << ref.at("error").get<std::string>()
                        << ") but the interpreter rendered";
          ++bad;
        } else if (kind != want) {
          ADD_FAILURE() << "transformers raised " << type << " (" << ref.at("error").get<std::string>()
                        << "), the interpreter: " << err;
          ++bad;
        } else if (want == ErrorKind::raised && err != ref.at("error").get<std::string>()) {
          ADD_FAILURE() << "raise_exception message differs: " << err << " vs " << ref.at("error");
          ++bad;
        }
        continue;
      }
      if (!err.empty()) {
        ADD_FAILURE() << "the interpreter raised: " << err;
        ++bad;
        continue;
      }
      const std::string want = ref.at("text");
      if (text != want) {
        ADD_FAILURE() << "rendering differs " << first_difference(want, text);
        ++bad;
        continue;
      }
      if (ref.contains("generation")) {
        Spans want_spans;
        for (const auto& s : ref.at("generation")) want_spans.emplace_back(s.at(0).get<size_t>(), s.at(1).get<size_t>());
        EXPECT_EQ(spans, want_spans) << "generation spans";
      }
    }
    if (bad) ++failed_templates;
  }
  EXPECT_EQ(failed_templates, 0u);
  EXPECT_EQ(renders, 1960u);
  std::printf("rendered %zu conversations over %zu templates (%zu where transformers raises)\n", renders, files.size(), errors);
}
