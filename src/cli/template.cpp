// moetron template render: a model's chat template applied to conversations, as transformers'
// apply_chat_template does it (the probe to compare against it).
//   moetron template render (--model DIR | --template F.jinja) --input chats.jsonl
//       [--add-generation-prompt] [--ids] [--template-name NAME] [--var NAME=VALUE]... [--now DATE]
// Each input line: {"messages": [...], "tools": [...], "chat_template_kwargs": {...}} (tools and
// kwargs optional: an OpenAI chat request's shapes).  Each output line (stdout): {"text": ...}, with
// --ids also "ids" (the model's tokenizer, HF's encode without added BOS/EOS), "assistant_mask" (1 on
// the assistant turns' tokens) and "mask_rule" (generation | prefix | unstable: jinja/chat_context.h;
// unstable gives no mask); {"error": ...} for a conversation the template refuses (exit 1 at the end).
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/json_limits.h"
#include "jinja/chat_context.h"
#include "jinja/model_template.h"
#include "tokenizer/tokenizer.h"

namespace moetron::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

// "2026-12-07" or "2026-12-07T12:00:00".
std::tm parse_now(const std::string& s) {
  std::tm t{};
  int y, mo, d, h = 0, mi = 0, se = 0;
  const int n = std::sscanf(s.c_str(), "%d-%d-%dT%d:%d:%d", &y, &mo, &d, &h, &mi, &se);
  if ((n != 3 && n != 6) || mo < 1 || mo > 12 || d < 1 || d > 31 || h < 0 || h > 23 || mi < 0 || mi > 59 || se < 0 || se > 60)
    throw InputError(fmt::format("--now {}: expected YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS", s));
  t.tm_year = y - 1900;
  t.tm_mon = mo - 1;
  t.tm_mday = d;
  t.tm_hour = h;
  t.tm_min = mi;
  t.tm_sec = se;
  std::tm copy = t;
  timegm(&copy);  // fills the weekday and day of the year
  t.tm_wday = copy.tm_wday;
  t.tm_yday = copy.tm_yday;
  return t;
}

int run_template_render(int argc, char** argv) {
  CLI::App app{"Apply a chat template to conversations exactly as transformers' apply_chat_template does: one "
               "JSON object per input line in, one per line out ({\"text\"}, with --ids also \"ids\" and "
               "\"assistant_mask\").",
               "moetron template render"};
  std::string model, template_file, input, template_name, now;
  std::vector<std::string> vars;
  bool agp = false, ids = false;
  auto* m = app.add_option("--model", model, "model directory: chat_template.jinja or tokenizer_config.json (and the tokenizer, for --ids)");
  auto* t = app.add_option("--template", template_file, "a .jinja template file");
  m->excludes(t);
  app.add_option("--input", input, "JSONL: {\"messages\": [...], \"tools\": [...], \"chat_template_kwargs\": {...}} per line")->required();
  app.add_flag("--add-generation-prompt", agp, "end with the template's assistant header (a prompt to generate from)");
  app.add_flag("--ids", ids, "also the token ids and assistant mask (needs --model with a tokenizer.json)");
  app.add_option("--template-name", template_name, "a named template of tokenizer_config.json (e.g. tool_use)");
  app.add_option("--var", vars, "NAME=VALUE: a string variable the template sees (e.g. bos_token=<s>)");
  app.add_option("--now", now, "the date strftime_now() sees: YYYY-MM-DD[THH:MM:SS] (default: now)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (model.empty() && template_file.empty()) throw InputError("give --model DIR or --template F.jinja");
  if (ids && model.empty()) throw InputError("--ids needs --model DIR (its tokenizer encodes the text)");
  std::string source, origin;
  std::vector<std::pair<std::string, std::string>> specials;
  if (!model.empty()) {
    auto mt = jinja::load_model_template(model, template_name);
    if (!mt) throw InputError(fmt::format("--model {}: no chat template (neither chat_template.jinja nor a \"chat_template\" in tokenizer_config.json)", model));
    source = std::move(mt->source);
    origin = mt->origin;
    specials = std::move(mt->special_tokens);
  } else {
    jinja::ModelTemplate mt = jinja::load_template_file(template_file, "");
    source = std::move(mt.source);
    origin = mt.origin;
  }
  for (const std::string& v : vars) {
    const size_t eq = v.find('=');
    if (eq == std::string::npos || eq == 0) throw InputError(fmt::format("--var {}: expected NAME=VALUE", v));
    specials.emplace_back(v.substr(0, eq), v.substr(eq + 1));
  }
  jinja::RenderOptions opts;
  if (!now.empty()) opts.now = parse_now(now);
  const jinja::Template tmpl(source, fs::path(origin).filename().string());
  std::unique_ptr<Tokenizer> tok;
  if (ids) {
    const fs::path tj = fs::path(model) / "tokenizer.json";
    if (!fs::exists(tj)) throw InputError(fmt::format("--ids: {} not found (--ids needs a byte-level BPE tokenizer.json)", tj.string()));
    tok = std::make_unique<Tokenizer>(Tokenizer::load(tj.string()));
  }

  std::ifstream in(input);
  if (!in) throw InputError(fmt::format("--input {}: cannot open", input));
  std::string line;
  size_t lineno = 0, failed = 0, rendered = 0, unstable = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", input, lineno);
    ordered_json j;
    try {
      j = parse_ordered_json(line, where);
    } catch (const Error& e) {
      throw InputError(e.what());
    }
    if (!j.is_object()) throw InputError(fmt::format("{}: expected a JSON object with \"messages\", got {}", where, j.type_name()));
    if (!j.contains("messages") || !j["messages"].is_array())
      throw InputError(fmt::format("{}: field \"messages\" must be an array of messages", where));
    jinja::ChatInput ci;
    ci.messages = j["messages"];
    for (size_t k = 0; k < ci.messages.size(); ++k)
      if (!ci.messages[k].is_object()) throw InputError(fmt::format("{}: messages[{}] must be an object", where, k));
    if (j.contains("tools") && !j["tools"].is_null()) {
      if (!j["tools"].is_array()) throw InputError(fmt::format("{}: field \"tools\" must be an array", where));
      ci.tools = j["tools"];
    }
    if (j.contains("chat_template_kwargs") && !j["chat_template_kwargs"].is_null()) {
      if (!j["chat_template_kwargs"].is_object())
        throw InputError(fmt::format("{}: field \"chat_template_kwargs\" must be an object", where));
      ci.kwargs = j["chat_template_kwargs"];
    }
    ci.add_generation_prompt = agp;
    ci.special_tokens = specials;
    ordered_json out = ordered_json::object();
    try {
      jinja::Spans gen;
      const std::string text = jinja::render_chat(tmpl, ci, opts, &gen);
      out["text"] = text;
      if (tok) {
        const std::vector<int32_t> tids = tok->encode(text);
        out["ids"] = tids;
        const jinja::AssistantSpans as = jinja::assistant_spans(tmpl, ci, text, gen, opts);
        out["mask_rule"] = jinja::mask_rule_name(as.rule);
        if (as.rule == jinja::MaskRule::unstable) {
          ++unstable;
        } else {
          std::vector<std::pair<size_t, size_t>> offs;
          if (!tok->token_offsets(tids, text, offs))
            throw Error(fmt::format("{}: the tokenizer's pieces do not spell the rendered text back (a normaliser changed it); no assistant mask", where));
          std::vector<int> mask(tids.size(), 0);
          for (size_t k = 0; k < offs.size(); ++k)
            for (const auto& [s, e] : as.spans)
              if (offs[k].first < e && offs[k].second > s) mask[k] = 1;
          out["assistant_mask"] = mask;
        }
      }
      ++rendered;
    } catch (const jinja::TemplateError& e) {
      out = ordered_json::object();
      out["error"] = e.what();
      ++failed;
    }
    std::printf("%s\n", out.dump(-1, ' ', false, ordered_json::error_handler_t::replace).c_str());
  }
  std::fprintf(stderr, "moetron template render: %zu rendered with %s, %zu refused by the template%s\n", rendered,
               origin.c_str(), failed,
               ids ? fmt::format(", {} not prefix-stable (no assistant mask)", unstable).c_str() : "");
  return failed ? 1 : 0;
}

}  // namespace

int run_template(int argc, char** argv) {
  const std::string sub = argc > 1 ? argv[1] : "";
  if (sub == "render") return run_template_render(argc - 1, argv + 1);
  std::fprintf(stderr, "usage: moetron template render (--model DIR | --template F.jinja) --input chats.jsonl "
                       "[--add-generation-prompt] [--ids]\n");
  return sub == "-h" || sub == "--help" ? 0 : 2;
}

}  // namespace moetron::cli
