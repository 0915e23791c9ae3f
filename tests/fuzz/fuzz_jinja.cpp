// Fuzz target: the chat-template interpreter (src/jinja) on an untrusted template, as `serve` and
// `data prepare` render a model's chat_template: parse, then render over a JSON context with tight
// limits.  Every failure must be a moetron::Error (TemplateError: syntax, undefined, type, security,
// raised, limit); a crash, a hang, a sanitizer report or another exception is a finding.
// Input: the first line is the context (a JSON object, parsed with the JSON bounds untrusted
// documents get; anything else gives an empty context), the rest is the template.
#include <ctime>

#include "core/json_limits.h"
#include "fuzz_common.h"
#include "jinja/jinja.h"

using namespace moetron;
using namespace moetron::jinja;

namespace {

void render_and_check(const std::string& source, const Value& context, const RenderOptions& opts) {
  const Template t{source, "fuzz.jinja"};
  Spans spans;
  const std::string out = t.render(context, opts, &spans);
  if (out.size() > opts.limits.max_output) {
    std::fprintf(stderr, "output of %zu bytes is over max_output\n", out.size());
    std::abort();
  }
  size_t prev_end = 0;
  for (const auto& [b, e] : spans) {  // {% generation %} spans: ordered byte ranges of the output
    if (b > e || e > out.size() || b < prev_end) {
      std::fprintf(stderr, "bad generation span [%zu, %zu) of %zu bytes\n", b, e, out.size());
      std::abort();
    }
    prev_end = e;
  }
  if (!t.has_generation() && !spans.empty()) std::abort();
  // A render is a pure function of template, context and options: the same again.
  Spans again_spans;
  if (t.render(context, opts, &again_spans) != out || again_spans != spans) {
    std::fprintf(stderr, "a second render differs from the first\n");
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [first, rest] = fuzz::split_once(fuzz::as_text(data, size), "\n");
  const std::string source(rest);
  Value context = Value::dict();
  try {
    const nlohmann::ordered_json j = parse_ordered_json(first, "context");
    if (j.is_object()) context = from_json(j);
  } catch (const Error&) {
  }

  RenderOptions opts;
  opts.limits.max_output = 1u << 20;
  opts.limits.max_iterations = 100'000;
  opts.limits.max_depth = 100;
  std::tm now{};  // strftime_now is deterministic: 2026-12-07 12:00, a Monday
  now.tm_year = 2026 - 1900;
  now.tm_mon = 11;
  now.tm_mday = 7;
  now.tm_hour = 12;
  now.tm_wday = 1;
  now.tm_yday = 340;
  opts.now = now;

  fuzz::expect_ok_or_error([&] {
    try {
      render_and_check(source, context, opts);
    } catch (const TemplateError& e) {  // "NAME:LINE:COL: ..." with the position of the failure
      if (std::strncmp(e.what(), "fuzz.jinja:", 11) != 0 || e.what()[11] < '1' || e.what()[11] > '9') {
        std::fprintf(stderr, "a TemplateError without a position: '%s'\n", e.what());
        std::abort();
      }
      throw;
    }
  });
  return 0;
}

