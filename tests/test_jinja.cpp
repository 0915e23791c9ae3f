// Semantics of the chat-template interpreter (src/jinja), case by case against Jinja2: every expected
// string below is what jinja2 3.1.6 renders in transformers' environment (ImmutableSandboxedEnvironment
// with trim_blocks, lstrip_blocks, loopcontrols and {% generation %}; transformers' tojson, raise_exception,
// strftime_now, namespace and dict), produced by running Python and pasted here.  Then the hostile
// inputs: each fails with a TemplateError of the right kind, naming a line, quickly, with memory bounded.
// Tests marked GTEST_SKIP("not supported: ...") hold Jinja's output for what the interpreter does not
// implement (the README's list: no real chat template uses them); remove the skip with the feature.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include "jinja/jinja.h"

using nlohmann::ordered_json;
using namespace moetron::jinja;

namespace {

const char* kind_name(ErrorKind k) {
  static const char* names[] = {"syntax", "undefined", "type", "security", "raised", "limit"};
  return names[(int)k];
}

std::string render(const std::string& src, const std::string& ctx = "{}", const RenderOptions& opts = {},
                   Spans* spans = nullptr) {
  return Template(src, "t.jinja").render(from_json(ordered_json::parse(ctx)), opts, spans);
}

struct Case {
  std::string tmpl, expected, ctx = "{}";
};

void expect_renders(const std::vector<Case>& cases, const RenderOptions& opts = {}) {
  for (const Case& c : cases) {
    SCOPED_TRACE("template: " + ordered_json(c.tmpl).dump());
    try {
      EXPECT_EQ(render(c.tmpl, c.ctx, opts), c.expected);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw: " << e.what();
    }
  }
}

// Small limits for the hostile templates (a runaway template fails in milliseconds).
RenderOptions tight() {
  RenderOptions o;
  o.limits.max_output = 1u << 20;
  o.limits.max_iterations = 100'000;
  o.limits.max_depth = 100;
  return o;
}

// Parses and renders `src`, which must fail with a TemplateError of `kind` whose what() is
// "t.jinja:LINE:COL: ..." (LINE == line unless line is 0).  Returns the error text.  (A runaway
// template is caught by the limits; a hang would be the test's timeout, not a timed assertion.)
std::string expect_error(const std::string& src, ErrorKind kind, int line, const RenderOptions& opts = {},
                         const std::string& ctx = "{}") {
  SCOPED_TRACE("template: " + ordered_json(src.size() > 200 ? src.substr(0, 200) + "..." : src).dump());
  std::string what;
  try {
    const std::string out = render(src, ctx, opts);
    ADD_FAILURE() << "rendered without an error (" << out.size() << " bytes): " << out.substr(0, 200);
    return "";
  } catch (const TemplateError& e) {
    what = e.what();
    EXPECT_STREQ(kind_name(e.kind()), kind_name(kind)) << what;
    std::smatch m;
    const bool located = std::regex_search(what, m, std::regex("^t\\.jinja:([0-9]+):([0-9]+): "));
    EXPECT_TRUE(located) << "the message names no line: " << what;
    if (located && line > 0) {
      EXPECT_EQ(std::stoi(m[1].str()), line) << what;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than a TemplateError: " << e.what();
  }
  return what;
}

std::string repeat(const std::string& s, size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (size_t k = 0; k < n; ++k) out += s;
  return out;
}

}  // namespace

TEST(JinjaWhitespace, DashStripsWhitespaceOnThatSide) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"a  {{- 'b' -}}  c\n  {%- if true -%}  d  {%- endif -%}  e", "abcde"},
      {"a {#- c -#} b", "ab"},
      {"a\n\n{%- if true -%}\n\nb\n\n{%- endif -%}\n\nc", "abc"},
      {"\n\n  {{- 'a' }}", "a"},
      {"{{ 'a' }}\n{{ 'b' -}}\n\n c", "a\nbc"},
  });
}

TEST(JinjaWhitespace, TrimBlocksDropsOneNewlineAfterTagsNotAfterExpressions) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% if true %}\nx\n{% endif %}\ny\n", "x\ny"},
      {"{{ 'a' }}\nb", "a\nb"},
      {"a\n{# c #}\nb\n  {# d #}\nc", "a\nb\nc"},
      {"{% if true %}\n\nx{% endif %}", "\nx"},
  });
}

TEST(JinjaWhitespace, LstripBlocksIncludingTemplateStartAndAfterExpressions) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"  {% if true %}\n  x\n    {% endif %}\nz", "  x\nz"},
      {"   {% set a = 1 %}\nA{{ a }}", "A1"},
      {"{{ 'a' }}  {% if true %}b{% endif %}", "a  b"},
      {"x\n\t {% if true %}y{% endif %}", "x\ny"},
      {"a  {% if true %}b{% endif %}\n  {{ 'c' }}", "a  b  c"},
      {"  {{ 'a' }}\n  {% if true %}b{% endif %}", "  a\nb"},
      {"x\n\u00a0 {% if true %}y{% endif %}", "x\ny"},
      {"<\n    {% for x in [1, 2] %}\n    {{ x }}\n    {% endfor %}\n>", "<\n    1\n    2\n>"},
      {"x\n  {%- if true %}y{% endif %}", "xy"},
  });
}

TEST(JinjaWhitespace, PlusSignKeepsWhitespace) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"  {%+ if true %}\nx{% endif +%}\ny", "  x\ny"},
      {"{% if true +%}\nx{% endif %}", "\nx"},
  });
}

TEST(JinjaWhitespace, CommentsAndRawBlocks) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"a\n  {# note #}\nb{#- x -#}  c", "a\nbc"},
      {"{% raw %}{{ x }} {% if %}{% endraw %}\n!", "{{ x }} {% if %}!"},
      {"{% raw %}x{% endraw %}\ny", "xy"},
      {"{%raw%}{{x}}{%endraw%}", "{{x}}"},
      {"  {%- raw -%}  a  {%- endraw -%}  b", "ab"},
  });
}

TEST(JinjaWhitespace, RawBlockAfterText) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"a{% raw %}b{% endraw %}c", "abc"},
      {"x\n{% raw %}{{ y }}{% endraw %}", "x\n{{ y }}"},
      {"a\n    {% raw %}\n  b\n    {% endraw %}\nc", "a\n\n  b\nc"},
  });
}

TEST(JinjaWhitespace, OneTrailingNewlineDropped) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"a\n", "a"},
      {"a\n\n", "a\n"},
      {"{{ 'a' }}\n", "a"},
  });
}

TEST(JinjaWhitespace, LineEndingsNormalised) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", "a\nb\nc"},
      {"a\rb\r{% if true %}\rc{% endif %}", "a\nb\nc"},
      {"{{ 'x\r\ny' }}", "x\ny"},
      {"a\r\n", "a"},
  });
}

TEST(JinjaWhitespace, DelimitersInsideStringsAndStrayBraces) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {R"({{ '}}' }}{{ "%}" }}{% if '%}' %}y{% endif %})", "}}%}y"},
      {"{ } {{ '{' }} %} #} }}", "{ } { %} #} }}"},
      {"a\000b{{ 'c\000' }}", "a\000bc\000"},
  });
}

TEST(JinjaScope, SetInsideForDoesNotLeak) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% set x = 1 %}{% for i in [1,2] %}{% set x = x + i %}{{ x }}{% endfor %}|{{ x }}", "23|1"},
      {"{% for x in [1, 2] %}{% endfor %}[{{ x }}]", "[]"},
      {"{% set x = 5 %}{% for i in [1,2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}", "5152"},
  });
}

TEST(JinjaScope, EachIterationHasItsOwnScope) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% for i in [1,2,3] %}{% if i == 1 %}{% set y = 'one' %}{% endif %}[{{ y }}]{% endfor %}", "[one][][]"},
      {"{% for i in [1,2] %}{% for j in 'ab' %}{{ i }}{{ j }}{{ loop.index }} {% endfor %}{{ loop.index }};{% endfor "
       "%}",
       "1a1 1b2 1;2a1 2b2 2;"},
      {"{% for a in [1, 2] %}{% set outer = loop %}{% for b in [1] %}{{ outer.index }}{{ loop.index }}{% endfor %}{% "
       "endfor %}",
       "1121"},
  });
}

TEST(JinjaScope, NamespaceCarriesStateOutOfLoops) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% set ns = namespace(t=0, s='') %}{% for i in [1,2,3] %}{% set ns.t = ns.t + i %}{% set ns.s = ns.s ~ i %}{% "
       "endfor %}{{ ns.t }} {{ ns.s }}",
       "6 123"},
      {"{% set ns = namespace(found=false) %}{% for m in msgs %}{% if m.role == 'user' %}{% set ns.found = loop.index0 "
       "%}{% endif %}{% endfor %}{{ ns.found }}",
       "2", R"({"msgs": [{"role": "user"}, {"role": "bot"}, {"role": "user"}]})"},
      {"{% set ns = namespace(n=0) %}{% for x in range(3) if x > 0 %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}",
       "3"},
      {"{% set ns = namespace(a=1) %}{% set ns.b = 2 %}{{ ns.a }}{{ ns.b }}{{ ns.c }}", "12"},
      {"{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}", "12"},
  });
}

TEST(JinjaScope, IfDoesNotOpenAScope) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% if true %}{% set z = 5 %}{% endif %}{{ z }}", "5"},
  });
}

TEST(JinjaScope, MacrosSeeGlobalsAtCallTime) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% macro m() %}{{ g }}{% endmacro %}{% set g = 'late' %}{{ m() }}", "late"},
      {"{% macro m() %}{{ who }}{% endmacro %}{{ m() }}", "ctx", R"({"who": "ctx"})"},
      {"{% for i in [1,2] %}{% macro m() %}{{ i }}{% endmacro %}{{ m() }}{% endfor %}", "12"},
      {"{% macro m() %}{% set q = 1 %}{{ q }}{% endmacro %}{{ m() }}[{{ q }}]", "1[]"},
  });
}

TEST(JinjaScope, MacroDefaultsKeywordsVarargs) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% macro m(a, b=2, c='x') %}{{ a }}-{{ b }}-{{ c }}{% endmacro %}{{ m(1) }} {{ m(1, 3) }} {{ m(1, c='y') }} {{ "
       "m(b=5, a=0) }}",
       "1-2-x 1-3-x 1-2-y 0-5-x"},
      {"{% macro m(a, b) %}[{{ a }}][{{ b }}]{% endmacro %}{{ m(1) }}", "[1][]"},
      {"{% macro m(a, b=a ~ '!') %}{{ b }}{% endmacro %}{{ m('x') }}", "x!"},
      {"{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k=4) }}", "1(2, 3){'k': 4}"},
      {"{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}", "54321"},
  });
}

TEST(JinjaScope, CallBlockPassesCaller) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% macro box(t) %}[{{ t }}:{{ caller() }}]{% endmacro %}{% call box('k') %}in{{ 1 + 1 }}{% endcall %}",
       "[k:in2]"},
      {"{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(v) each([1,2]) %}<{{ v "
       "}}>{% endcall %}",
       "<1><2>"},
      {"{% macro m() %}{{ caller() }}{% endmacro %}{{ m(caller=none) if false else 'x' }}", "x"},
  });
}

TEST(JinjaScope, SetBlocksFilterBlocksAndUnpacking) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% set b %}x{{ 1 }}y{% endset %}{{ b | upper }}", "X1Y"},
      {"{% filter upper %}ab{{ 'c' }}{% endfilter %}", "ABC"},
      {"{% set a, b = [1, 2] %}{{ b }}{{ a }}{% for k, v in [['x', 1], ['y', 2]] %}{{ k }}={{ v }};{% endfor %}",
       "21x=1;y=2;"},
      {"{% set a, b = 'xy' %}{{ b }}{{ a }}", "yx"},
      {"{% set t = 1, 2 %}{{ t }}", "(1, 2)"},
      {"{{ 1, 2 }}", "(1, 2)"},
  });
}

TEST(JinjaScope, NamespaceAttributeSetBlock) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% set ns = namespace(x='') %}{% set ns.x %}a{{ 1 }}{% endset %}{{ ns.x }}", "a1"},
  });
}

TEST(JinjaScope, WithBlock) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% with a = 1, b = 2 %}{{ a }}{{ b }}{% endwith %}[{{ a }}]", "12[]"},
  });
}

TEST(JinjaLoop, LoopVariables) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% for x in ['a','b','c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ "
       "loop.first }}{{ loop.last }}{{ loop.length }} {% endfor %}",
       "1032TrueFalse3 2121FalseFalse3 3210FalseTrue3 "},
      {"{% for x in [1,2,3] %}({{ loop.previtem }},{{ loop.nextitem }}){% if loop.previtem is defined %}p{% endif %}{% "
       "endfor %}",
       "(,2)(1,3)p(2,)p"},
      {"{% for x in [1] %}{{ loop.depth }}{{ loop.depth0 }}{% endfor %}", "10"},
  });
}

TEST(JinjaLoop, Cycle) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% for x in range(5) %}{{ loop.cycle('a', 'b', 'c') }}{% endfor %}", "abcab"},
  });
}

TEST(JinjaLoop, ForIfFilterAndElse) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% for x in range(10) if x is odd %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% endfor %}",
       "1:1/5 3:2/5 5:3/5 7:4/5 9:5/5 "},
      {"{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in [1] if x > 5 %}x{% else %}none{% endfor %}",
       "empty|none"},
      {"{% for x in [1, 2, 3] | select('odd') %}{{ x }}{{ loop.length }}{{ loop.last }}{% endfor %}", "12False32True"},
  });
}

TEST(JinjaLoop, BreakAndContinue) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% for x in range(10) %}{% if x is even %}{% continue %}{% endif %}{% if x > 6 %}{% break %}{% endif %}{{ x "
       "}}{% endfor %}",
       "135"},
      {"{% for x in [1, 2] %}{% for y in [1, 2] %}{% if y == 2 %}{% break %}{% endif %}{{ x }}{{ y }}{% endfor %}{% "
       "endfor %}",
       "1121"},
  });
}

TEST(JinjaLoop, IteratesDictsStringsRanges) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}{{ v }}{% "
       "endfor %}",
       "bab1a2"},
      {"{% for ch in 'héllo' %}{{ ch }}.{% endfor %}", "h.é.l.l.o."},
      {"{{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ range(5, 0, -2) | list }}",
       "[0, 1, 2] [1, 4, 7] [5, 3, 1]"},
      {"{% for k, v in d | dictsort %}{{ k }}{{ v }}{% endfor %}", "a2b1", R"({"d": {"b": 1, "a": 2}})"},
  });
}

TEST(JinjaLoop, LoopChanged) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% for x in [1, 1, 2] %}{{ loop.changed(x) }}{% endfor %}", "TrueFalseTrue"},
  });
}

TEST(JinjaExpr, ArithmeticAndPrecedence) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 "
       "/ 2 }} {{ 6 / 3 }} {{ 7.5 // 2 }} {{ 2 ** -1 }}",
       "7 9 64 4 3 -4 2 3.5 2.0 3.0 0.5"},
      {"{{ 3 * 1.5 }} {{ 2 ** 10 }} {{ 2.0 ** 3 }} {{ 10 / 5 }} {{ 9 // 2 }} {{ -9 // 2 }} {{ 9 % -2 }} {{ 2 ** -2 }} "
       "{{ (-8) ** (1/3) if false else 1 }}",
       "4.5 1024 8.0 2.0 4 -5 -1 0.25 1"},
      {"{{ -7.5 % 2 }} {{ 7.5 % -2 }} {{ -7.5 // 2 }}", "0.5 -0.5 -4.0"},
      {"{{ (-2) ** 3 }} {{ -2 ** 2 }} {{ 0 ** 0 }}", "-8 4 1"},
      {"{{ true + true }} {{ true * 3 }} {{ true / 2 }} {{ -true }} {{ true ~ false }}", "2 3 0.5 -1 TrueFalse"},
  });
}

TEST(JinjaExpr, TildeConcatenates) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 1 ~ 'a' ~ none ~ true ~ [1] }} {{ 'a' ~ 2 * 3 }} {{ ('a' ~ 2) ~ 3 }}", "1aNoneTrue[1] a6 a23"},
  });
}

TEST(JinjaExpr, ComparisonsChainsAndIn) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 1 == 1.0 }} {{ 3 > 2 >= 2 }} {{ 'a' < 'b' }}", "True False True True True"},
      {"{{ 'a' in 'cat' }} {{ 'x' not in ['x'] }} {{ 'k' in {'k': 1} }} {{ 2 in [1, 2] }} {{ not 'z' in 'abc' }}",
       "True False True True True"},
      {"{{ [1,2] == [1,2] }} {{ (1,2) == [1,2] }} {{ {'a':1} == {'a':1} }} {{ 1 in [true] }} {{ none == false }} {{ "
       "'ab' in ['ab'] }} {{ (1, 2) == (1, 2) }}",
       "True False True True False True True"},
      {"{{ 'B' < 'a' }} {{ 'é' > 'z' }} {{ [1, 2] < [1, 3] }} {{ (1, 'a') < (1, 'b') }}", "True True True True"},
      {"{{ 1 in [1, 2] | select }} {{ [1, 2] | select | sum }}", "True 3"},
  });
}

TEST(JinjaExpr, ConditionalExpressions) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"[{{ 'y' if false }}][{{ 'y' if true }}][{{ 1 if 0 else 2 }}]", "[][y][2]"},
      {"{{ 'a' if false else 'b' if false else 'c' }}", "c"},
      {"{{ 'a' if true else 'b' | upper }} {{ ('a' if true else 'b') | upper }}", "a A"},
  });
}

TEST(JinjaExpr, SlicingCountsCodePoints) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 'héllo wörld'[::-1] }} {{ 'héllo'[1:3] }} {{ 'héllo'[-2:] }} {{ 'abcdef'[::2] }} {{ 'abcdef'[-1:0:-2] }} {{ "
       "[1,2,3,4][::-1] }} {{ 'ñ'[5:] }}|{{ 'héllo'[1] }}",
       "dlröw olléh él lo ace fdb [4, 3, 2, 1] |é"},
      {"{{ [1, 2, 3, 4, 5][-2::-2] }} {{ [1,2,3][5:] }} {{ [1,2,3][:-5] }} {{ 'abc'[10:-10:-1] }}", "[4, 2] [] [] cba"},
      {"{{ [1,2,3][-1] }} {{ 'abc'[-3] }}", "3 a"},
      {"{{ 'abc'[-10**18:10**18:10**17] }} {{ 'abc'[::-9223372036854775807] }}", " c"},
      {"{{ 'abc'[::-9223372036854775807 - 1] }}", "c"},
      {"{{ 'abc'[-9223372036854775807 - 1] }} {{ [1][-9223372036854775807 - 1] }}", " "},
  });
}

TEST(JinjaExpr, IsTestsWithAndWithoutParentheses) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ x is defined }} {{ y is not defined }} {{ 3 is divisibleby 3 }} {{ 3 is divisibleby(2) }} {{ none is none "
       "}} {{ 'a' is string }} {{ 1 is number }} {{ {} is mapping }} {{ [] is iterable }} {{ 2 is eq(2) }} {{ x is "
       "sameas true }} {{ [] is sequence }}",
       "True True True False True True True True True True True True", R"({"x": true})"},
      {"{{ 4 is divisibleby 2 }} {{ x is sameas false }} {{ 2 is in [1, 2] }} {{ 'a' is in 'cat' }} {{ 3 is gt 2 }} {{ "
       "3 is eq 3 }} {{ none is none }} {{ true is true }} {{ x is false }} {{ 1 is true }}",
       "True True True True True True True True True False", R"({"x": false})"},
      {"{{ x is defined() }}", "False"},
  });
}

TEST(JinjaExpr, LogicLiteralsAndEscapes) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 0 or 'b' }} {{ 1 and 'c' }} {{ '' and 1 }} {{ not [] }} {{ none or false }}", "b c  True False"},
      {R"({{ 0x1f if false else 10 }} {{ 1_000 }} {{ 1e3 }} {{ 'a' 'b' }} {{ "q'" }} {{ 'esc\n' | length }})",
       "10 1000 1000.0 ab q' 4"},
      {R"({{ '\u00e9\x41\t|' }}{{ '\'' }})", "éA\t|'"},
      {"{{ -1 | abs }} {{ - 'a' | length if false else 'ok' }} {{ not 1 == 2 }}", "1 ok True"},
      {"{{ 1.2.3 }}", ""},
  });
}

TEST(JinjaExpr, NonStringDictKeys) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ {512: 1}[512] }} {{ {1: 'a', 'x': 2} }} {{ {true: 1}[1] }}", "1 {1: 'a', 'x': 2} 1"},
      {"{{ {1.0: 'a'}[1] }} {{ {1: 'a'}['1'] }}|{{ {none: 'n'}[none] }} {{ {1: 'a', 1.0: 'b'} }} {{ {'a': 1, 'a': 2} "
       "}}",
       "a |n {1: 'b'} {'a': 2}"},
  });
}

TEST(JinjaExpr, SequenceRepetitionAndConcatenation) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 'ab' * 3 }} {{ [0] * 3 }} {{ 3 * 'x' }}", "ababab [0, 0, 0] xxx"},
      {"[{{ 'ab' * -1 }}][{{ 'ab' * 0 }}][{{ [1] * -2 }}]", "[][][[]]"},
      {"{{ [1] + [2] }} {{ (1,) + (2,) }} {{ 'a' + 'b' }}", "[1, 2] (1, 2) ab"},
  });
}

TEST(JinjaExpr, AttributesAndItems) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ d.items is callable }}|{{ d['items'] }}|{{ d.k }}|{{ d['k'] }}", "True|I|v|v",
       R"({"d": {"k": "v", "items": "I"}})"},
      {"{{ x.0 }} {{ x.1.a }}", "5 6", R"({"x": [5, {"a": 6}]})"},
      {"{{ m.content[0].text }} {{ m['content'][-1]['type'] }}", "hi image",
       R"({"m": {"content": [{"type": "text", "text": "hi"}, {"type": "image"}]}})"},
      {"[{{ none.x }}][{{ [1].y }}][{{ 5.y }}]", "[][][]"},
      {"{{ 'tools' in x }} {{ 'x' in x.tools[0] }}", "True True", R"({"x": {"tools": [{"x": 1}]}})"},
      {"{% for m in ms %}{{ m['items'] }}{% endfor %}", "K", R"({"ms": [{"items": "K"}]})"},
  });
}

TEST(JinjaExpr, UndefinedIsEmptyFalseAndIterable) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"[{{ missing }}][{{ missing is defined }}][{{ missing | default('x') }}][{{ d.nope }}][{{ d.nope is defined "
       "}}][{% for x in missing %}{% endfor %}][{{ missing | length if false }}]",
       "[][False][x][][False][][]", R"({"d": {}})"},
      {"[{{ x | length }}][{{ x ~ 'a' }}][{{ x == none }}][{{ x | string }}][{{ x is string }}][{{ x | list }}][{{ x | "
       "join }}]",
       "[0][a][False][][False][[]][]"},
  });
}

TEST(JinjaExpr, IntegersBeyond64Bits) {
  GTEST_SKIP() << "not supported: ints are int64: results beyond it turn into floats (10 ** 20 prints 1e+20, "
                  "-INT64_MIN and abs(INT64_MIN) print 9.223372036854776e+18) and larger literals or .N indices are "
                  "syntax errors; Python ints are unbounded";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 10 ** 20 }}", "100000000000000000000"},
      {"{{ 9223372036854775807 + 1 }}", "9223372036854775808"},
      {"{{ 2 ** 63 }} {{ 2 ** 62 }}", "9223372036854775808 4611686018427387904"},
      {"{{ -(-9223372036854775807 - 1) }}", "9223372036854775808"},
      {"{{ (-9223372036854775807 - 1) | abs }}", "9223372036854775808"},
      {"{{ (-9223372036854775807 - 1) % -1 }}", "0"},
      {"{{ -9223372036854775807 - 1 }} {{ (-9223372036854775807 - 1) // -1 }}",
       "-9223372036854775808 9223372036854775808"},
      {"{{ 99999999999999999999 }}", "99999999999999999999"},
      {"{{ 0xFFFFFFFFFFFFFFFFFFFF }}", "1208925819614629174706175"},
      {"{{ x.99999999999999999999 }}", "", R"({"x": [1]})"},
  });
}

TEST(JinjaExpr, OctalAndBinaryLiterals) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 0x10 }} {{ 0o17 }} {{ 0b101 }} {{ 1_0 }} {{ 1e-3 }} {{ 10.5e1 }}", "16 15 5 10 0.001 105.0"},
  });
}

TEST(JinjaExpr, FailedSubscriptIsUndefined) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ [1, 2, 3][1.0] }}", ""},
      {"[{{ 'abc'['x'] }}][{{ 'abc'[1.5] }}]", "[][]"},
  });
}

TEST(JinjaExpr, SubscriptOfAGenerator) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ ([1, 2] | select)[0] }}", ""},
  });
}

TEST(JinjaExpr, StarArgumentsInCalls) {
  GTEST_SKIP() << "not supported: f(*args) and f(**kwargs) in calls are syntax errors";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ dict(*[[('a', 1)]]) }}", "{'a': 1}"},
      {"{{ dict(**{'b': 2}) }}", "{'b': 2}"},
  });
}

TEST(JinjaRepr, ListsDictsTuplesNoneBools) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ [1, 'a', none, true, 1.5, [2]] }} {{ {'a': 1, 'b': [none]} }} {{ (1,) }} {{ (1, 'x') }} {{ () }}",
       "[1, 'a', None, True, 1.5, [2]] {'a': 1, 'b': [None]} (1,) (1, 'x') ()"},
      {"{{ none }} {{ true }} {{ false }} {{ [none, false] }}", "None True False [None, False]"},
      {"{{ d }} {{ l }}", "{'a': 1.0, 'b': 'x', 'c': None} [1.5, True, 3]",
       R"({"d": {"a": 1.0, "b": "x", "c": null}, "l": [1.5, true, 3]})"},
      {R"({{ ["it's", 'say "hi"', 'a\nb', 'é'] }})", R"(["it's", 'say "hi"', 'a\nb', 'é'])"},
      {R"({{ ['\u200b', '\x07', 'a\\b', '\u00a0', '\x7f', '\U0001F600', '\u0300'] }})",
       "['\\u200b', '\\x07', 'a\\\\b', '\\xa0', '\\x7f', '😀', '\u0300']"},
      {"{{ (1, 'a') | string }}", "(1, 'a')"},
      {"{{ [[1], (2,)] | join(',') }}", "[1],(2,)"},
  });
}

TEST(JinjaRepr, Floats) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 1e-05 }} {{ 1e16 }} {{ 0.1 }} {{ 1.0 }} {{ 10 / 4 }} {{ 1/3 }} {{ 1e15 }} {{ 123456789.0 * 10 }} {{ 2 ** "
       "0.5 }} {{ 0.1 + 0.2 }}",
       "1e-05 1e+16 0.1 1.0 2.5 0.3333333333333333 1000000000000000.0 1234567890.0 1.4142135623730951 "
       "0.30000000000000004"},
      {"{{ 7 // 2.0 }} {{ -7 % 2.5 }} {{ 5 % -3 }} {{ 1e22 }} {{ 123456789012345678.0 }} {{ 0.1 * 3 }} {{ 1e-7 | "
       "tojson }} {{ 'inf' | float }} {{ -0.0 }} {{ 1e308 * 10 }}",
       "3.0 0.5 -1 1e+22 1.2345678901234568e+17 0.30000000000000004 1e-07 inf -0.0 inf"},
      {"{{ x }} {{ x | tojson }} {{ y }} {{ y | tojson }} {{ z }} {{ w }}", "1.0 1.0 1e-07 1e-07 1e+20 2.5e-05",
       R"({"x": 1.0, "y": 1e-07, "z": 1e+20, "w": 2.5e-05})"},
      {"{{ big }} {{ big + 1 }} {{ big | tojson }}", "9007199254740993 9007199254740994 9007199254740993",
       R"({"big": 9007199254740993})"},
  });
}

TEST(JinjaRepr, RecursiveNamespace) {
  GTEST_SKIP() << "not supported: printing a namespace that contains itself throws a plain moetron::Error ('a value "
                  "nested more than 200 levels deep cannot be printed', no template position) instead of printing "
                  "{...}/[...] as Python's repr does";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% set ns = namespace() %}{% set ns.x = ns %}{{ ns }}", "<Namespace {'x': <Namespace {...}>}>"},
      {"{% set ns = namespace(l=[]) %}{% set ns.l = [ns] %}{{ ns.l }}", "[<Namespace {'l': [...]}>]"},
      {"{% set ns = namespace(d={}) %}{% set ns.d = {'k': ns} %}{{ ns.d }}", "{'k': <Namespace {'d': {...}}>}"},
  });
}

TEST(JinjaRepr, ViewsAndRanges) {
  GTEST_SKIP() << "not supported: dict.keys() prints as a list (Python: dict_keys(['a'])) and range(3) prints as [0, "
                  "1, 2] (Python: range(0, 3))";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ {'a': 1}.keys() }}", "dict_keys(['a'])"},
      {"{{ range(3) }}", "range(0, 3)"},
  });
}

TEST(JinjaFilter, TojsonIndentSeparatorsSortKeys) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(separators=(',', ':')) }}|{{ d | "
       "tojson(sort_keys=true) }}",
       "{\"b\": [1, 2.5, null, true], \"a\": \"é\\\"<>&\"}|{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  "
       "],\n  \"a\": \"é\\\"<>&\"\n}|{\"b\":[1,2.5,null,true],\"a\":\"é\\\"<>&\"}|{\"a\": \"é\\\"<>&\", \"b\": [1, "
       "2.5, null, true]}",
       R"({"d": {"b": [1, 2.5, null, true], "a": "é\"<>&"}})"},
      {R"({{ [1, {'a': []}, {}] | tojson(indent='\t') }})", "[\n\t1,\n\t{\n\t\t\"a\": []\n\t},\n\t{}\n]"},
      {"{{ {'b': 1, 'a': {'d': 1, 'c': 2}} | tojson(sort_keys=true, indent=1) }}",
       "{\n \"a\": {\n  \"c\": 2,\n  \"d\": 1\n },\n \"b\": 1\n}"},
      {"{{ [1, [2]] | tojson(indent=0) }}", "[\n1,\n[\n2\n]\n]"},
  });
}

TEST(JinjaFilter, TojsonScalarsNonAsciiAndMarkup) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {R"({{ 'x' | tojson }} {{ 1.0 | tojson }} {{ none | tojson }} {{ (1, 2) | tojson }} {{ '\u2028\t' | tojson }} {{ 1e16 | tojson }})",
       "\"x\" 1.0 null [1, 2] \"\u2028\\t\" 1e+16"},
      {"{{ 'é😀' | tojson(ensure_ascii=true) }}", R"("\u00e9\ud83d\ude00")"},
      {"{{ ('<b>' | safe) | tojson }} {{ [('x' | safe)] | tojson }}", R"("<b>" ["x"])"},
      {"{{ {'a': 1}.items() | list | tojson }}", R"([["a", 1]])"},
      {"{{ {1: 'a'} | tojson }} {{ {none: 1} | tojson }} {{ {1.5: 1} | tojson }}",
       R"({"1": "a"} {"null": 1} {"1.5": 1})"},
  });
}

TEST(JinjaFilter, TojsonBooleanKeysAndViews) {
  GTEST_SKIP() << "not supported: a True dict key is dumped as \"1\" (json.dumps writes \"true\")";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ {true: 1} | tojson }}", R"({"true": 1})"},
  });
}

TEST(JinjaFilter, TrimAndJoin) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {R"([{{ '  a b \n' | trim }}][{{ 'xxaxx' | trim('x') }}])", "[a b][a]"},
      {"{{ [1, 'a', none] | join }}|{{ ['a','b'] | join(', ') }}|{{ users | join('/', attribute='n') }}",
       "1aNone|a, b|u1/u2", R"({"users": [{"n": "u1"}, {"n": "u2"}]})"},
      {R"([{{ '\u3000a\u00a0' | trim }}][{{ '\u3000a\u00a0'.strip() }}][{{ 'a\u2003b'.split() }}])",
       "[a][a][['a', 'b']]"},
  });
}

TEST(JinjaFilter, MapSelectattrRejectattr) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ users | map(attribute='n') | join(',') }} {{ ['a','b'] | map('upper') | list }} {{ users | "
       "map(attribute='missing', default='d') | list }}",
       "u1,u2 ['A', 'B'] ['d', 'd']", R"({"users": [{"n": "u1"}, {"n": "u2"}]})"},
      {"{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | list }} {{ ms | rejectattr('role', 'eq', "
       "'user') | list | length }} {{ ms | selectattr('tool') | list }}",
       "[1, 3] 1 [{'role': 'bot', 'c': 2, 'tool': True}]",
       R"({"ms": [{"role": "user", "c": 1}, {"role": "bot", "c": 2, "tool": true}, {"role": "user", "c": 3}]})"},
      {"{{ [1, 2, 3, 4] | select('odd') | list }} {{ [0, 1, '', 'a'] | select | list }} {{ [1,2,3] | reject('gt', 1) | "
       "list }}",
       "[1, 3] [1, 'a'] [1]"},
      {"{{ ['ab', 'cb'] | map('replace', 'b', 'x') | list }} {{ [{'r': 'user'}] | selectattr('r', 'in', ['user']) | "
       "list | length }} {{ [{'r': 'user'}] | selectattr('r', '==', 'user') | list | length }} {{ [1, 2] | "
       "select('equalto', 1) | list }}",
       "['ax', 'cx'] 1 1 [1]"},
      {"{{ ms | selectattr('tool_calls', 'defined') | list | length }} {{ ms | selectattr('tool_calls', 'undefined') | "
       "list | length }} {{ ms | rejectattr('tool_calls') | list | length }}",
       "2 1 2", R"({"ms": [{"a": 1}, {"tool_calls": []}, {"tool_calls": [1]}]})"},
      {"{{ ms | map(attribute='f.name') | list }} {{ ms | map(attribute='l.0') | list }}", "['n1'] [7]",
       R"({"ms": [{"f": {"name": "n1"}, "l": [7]}]})"},
  });
}

TEST(JinjaFilter, DictsortUniqueSort) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ {'b': 1, 'A': 2, 'c': 0} | dictsort }} {{ {'b': 1, 'A': 2} | dictsort(true) }} {{ {'b': 1, 'a': 2, 'c': 0} "
       "| dictsort(by='value') }} {{ {'b': 1, 'a': 2} | dictsort(reverse=true) }}",
       "[('A', 2), ('b', 1), ('c', 0)] [('A', 2), ('b', 1)] [('c', 0), ('b', 1), ('a', 2)] [('b', 1), ('a', 2)]"},
      {"{{ ['a', 'A', 'b', 'a'] | unique | list }} {{ ['a', 'A'] | unique(case_sensitive=true) | list }} {{ [1, 1.0, "
       "true, 2] | unique | list }}",
       "['a', 'b'] ['a', 'A'] [1, 2]"},
      {"{{ us | sort(attribute='a') | map(attribute='n') | join }}", "yx",
       R"({"us": [{"a": 2, "n": "x"}, {"a": 1, "n": "y"}]})"},
      {"{{ us | unique(attribute='n') | list }}", "[{'n': 1, 'k': 'a'}, {'n': 2}]",
       R"({"us": [{"n": 1, "k": "a"}, {"n": 1, "k": "b"}, {"n": 2}]})"},
      {"{{ [1, 2] | reverse | list }} {{ 'ab' | reverse }}", "[2, 1] ba"},
  });
}

TEST(JinjaFilter, DefaultWithBoolean) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"[{{ x | default('d') }}][{{ false | default('d') }}][{{ false | default('d', true) }}][{{ '' | d('e', "
       "boolean=true) }}][{{ none | default('n') }}]",
       "[d][False][d][e][None]"},
      {"{{ d.x | default('dx') }} {{ none | default('n', true) }}", "dx n", R"({"d": {}})"},
  });
}

TEST(JinjaFilter, IntAndFloatParsing) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} {{ '0x1A' | int(0, 16) "
       "}} {{ '3.5' | float }} {{ 'a' | float }} {{ 2 | float }} {{ ' 12 ' | int }} {{ '1_0' | int }} {{ true | int }}",
       "42 4 0 7 3 26 3.5 0.0 2.0 12 10 1"},
      {"{{ 'nan' | int }} {{ 'inf' | int }}", "0 0"},
      {R"({{ '-5' | int }} {{ '+5' | int }} {{ '011' | int }} {{ '  7\n' | int }} {{ '1.9e1' | int }} {{ '1e3' | int }} {{ '3.0' | int }})",
       "-5 5 11 7 19 1000 3"},
      {"{{ '1_0.5' | float }} {{ ' 2.5 ' | float }} {{ '-inf' | float }} {{ '.5' | float }} {{ 'Infinity' | float }} "
       "{{ 'nan' | float }}",
       "10.5 2.5 -inf 0.5 inf nan"},
  });
}

TEST(JinjaFilter, IntAndFloatParsingEdgeCases) {
  GTEST_SKIP() << "not supported: int(base=0) prefixes ('0b11' | int(0, 0)) and Unicode digits ('٣' | int) give 0, "
                  "'1e400' | float gives 0.0 (Python: inf), and |int of a value beyond int64 (a string or a float) "
                  "gives 0 (Python ints are unbounded)";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ '0b11' | int(0, 0) }} {{ '٣' | int }} {{ '1e400' | float }}", "3 3 inf"},
      {"{{ '99999999999999999999999' | int }}", "99999999999999999999999"},
      {"{{ 1e300 | int }}",
       "100000000000000005250476025520442024870446858110815915491585411551180245798890819578637137508044786404370444383"
       "288387817694252323536043057564479218478670698284838720092657580373783023379478809005936895323497079994508111903"
       "8967640880074652742780142494579258788820056842838115669472196386865459400540160"},
  });
}

TEST(JinjaFilter, IndentReplaceTitleCapitalize) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {R"({{ 'a\nb\n\nc' | indent }}|{{ 'a\nb' | indent(2, true) }}|{{ 'a\n\nb' | indent(1, blank=true) }}|{{ 'x\ny' | indent('> ') }})",
       "a\n    b\n\n    c|  a\n  b|a\n \n b|x\n> y"},
      {"{{ 'aaa' | replace('a', 'b') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ 'héé' | replace('é', 'e') }} {{ 'ab' | "
       "replace('', '-') }}",
       "bbb bba hee -a-b-"},
      {R"({{ 'a\nb' | indent(-5) }})", "a\nb"},
      {R"({{ 'hello wORLD-foo bar_baz' | title }} {{ 'hELLO wORLD' | capitalize }} {{ "it's o'neil" | title }})",
       "Hello World-Foo Bar_baz Hello world It's O'neil"},
  });
}

TEST(JinjaFilter, FirstLastLengthItemsList) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ [3, 4] | first }} {{ [3, 4] | last }} {{ 'héllo' | first }} {{ 'héllo' | last }} [{{ [] | first }}]",
       "3 4 h o []"},
      {"{{ 'héllo😀' | length }} {{ [1,2] | count }} {{ {'a': 1} | length }} {{ 'héllo😀' | reverse }}", "6 2 1 😀olléh"},
      {"{{ {'a': 1, 'b': 2} | items | list }} {% for k, v in {'x': 1} | items %}{{ k }}{{ v }}{% endfor %}",
       "[('a', 1), ('b', 2)] x1"},
      {"{{ 'hé' | list }} {{ {'a': 1} | list }}", "['h', 'é'] ['a']"},
      {"{{ [3, 4] | select | first }} {{ [] | last }}|", "3 |"},
      {"{{ 'ab' | count }} {{ ({'a': 1}.items()) | length }}", "2 1"},
  });
}

TEST(JinjaFilter, OtherBuiltinFilters) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 'Hi' | lower }}{{ 'hi' | upper }} {{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }} {{ ['b', 'A', "
       "'c'] | sort }} {{ [1, 2] | sum }} {{ [1, 5, 3] | max }} {{ [2, 1] | min }} {{ -3 | abs }} {{ 2.567 | round(2) "
       "}} {{ 2.5 | round }} {{ 'a b  c' | wordcount }} {{ 'hello world foo' | truncate(9) }} {{ 'x' | center(5) }}|",
       "hiHI [1, 2, 3] [3, 2, 1] ['A', 'b', 'c'] 3 5 1 3 2.57 2.0 3 hello...   x  |"},
      {"{{ 1 | string }} {{ [1] | string }} {{ none | string }} {{ 1.5 | string | length }}", "1 [1] None 3"},
      {"{{ us | sum(attribute='n') }} {{ [0.5, 0.25] | sum }} {{ us | map(attribute='n') | max }} {{ us | "
       "max(attribute='n') }}",
       "6 0.75 5 {'n': 5}", R"({"us": [{"n": 1}, {"n": 5}]})"},
      {"{{ 'hello world foo' | truncate(9, true) }}|{{ 'hello world' | truncate(11) }}|{{ 'hello world!' | "
       "truncate(11) }}|{{ 'hello world foo' | truncate(5, end='>') }}",
       "hello ...|hello world|hello world!|hell>"},
      {"{{ 'abc' | center(-3) }}", "abc"},
      {"{{ 1.5 | round(0, 'floor') }} {{ 3.5 | round }} {{ 0.125 | round(2) }} {{ 2.567 | round(1, 'ceil') }} {{ ['b', "
       "'A', 'c'] | max }} {{ ['B', 'a'] | max }} {{ {'a': 1, 'B': 2} | dictsort }} {{ {'a': 1, 'B': 2} | "
       "dictsort(true) }}",
       "1.0 4.0 0.12 2.6 c B [('a', 1), ('B', 2)] [('B', 2), ('a', 1)]"},
  });
}

TEST(JinjaFilter, RoundOfAnInt) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 2 | round }} {{ 12345 | round(-2) }} {{ 2.567 | round(1, 'ceil') }}", "2 12300 2.6"},
  });
}

TEST(JinjaFilter, PercentFormatting) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ '%s-%d-%.2f' | format('a', 3, 1.5) }} {{ '%s and %r' % ('x', 'y') }} {{ '%x %o %e' % (255, 8, 12345.678) }}",
       "a-3-1.50 x and 'y' ff 10 1.234568e+04"},
      {"{{ '%05d|' % 42 }}", "00042|"},
      {"{{ '%+d|' % 3 }}", "+3|"},
      {"{{ '%%|' % () }}", "%|"},
  });
}

TEST(JinjaFilter, PercentFormattingWidthPrecisionMapping) {
  GTEST_SKIP() << "not supported: printf-style % formatting ignores width and precision on %s ('%5s' % 'ab' gives "
                  "'ab'), and %(name)s, %c and %* are refused";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ '%5s|' % 'ab' }}", "   ab|"},
      {"{{ '%-5s|' % 'ab' }}", "ab   |"},
      {"{{ '%.3s|' % 'abcdef' }}", "abc|"},
      {"{{ '%(a)s|' % {'a': 1} }}", "1|"},
      {"{{ '%s' % [1, 2] }} {{ '%s' % none }} {{ '%d' % 3.7 }} {{ '%i' % 2 }} {{ '%.1f%%' % 12.34 }} {{ '%c' % 65 }}",
       "[1, 2] None 3 2 12.3% A"},
      {"{{ '%*d' % (5, 1) }}", "    1"},
  });
}

TEST(JinjaFilter, UnicodeCaseMapping) {
  GTEST_SKIP() << "not supported: upper/lower/title/capitalize (filters and str methods) only map ASCII letters";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 'éß' | upper }} {{ 'ÉA' | lower }} {{ 'élan vital' | title }} {{ 'éa' | capitalize }} {{ 'ÉA'.lower() }} {{ "
       "'éa'.upper() }} {{ 'éa'.capitalize() }} {{ 'élan vital'.title() }}",
       "ÉSS éa Élan Vital Éa éa ÉA Éa Élan Vital"},
  });
}

TEST(JinjaFilter, LessCommonBuiltinFilters) {
  GTEST_SKIP() << "not supported: Jinja's groupby, batch, slice, striptags and wordwrap filters are missing ('No "
                  "filter named ...')";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ [{'a': 1}] | groupby('a') | list }}", "[(1, [{'a': 1}])]"},
      {"{{ [1, 2, 3] | batch(2) | list }}", "[[1, 2], [3]]"},
      {"{{ [1, 2, 3] | slice(2) | list }}", "[[1, 2], [3]]"},
      {"{{ '<b>x</b>' | striptags }}", "x"},
      {"{{ 'a b' | wordwrap(1) }}", "a\nb"},
  });
}

TEST(JinjaMethod, StrSplitAndRsplit) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 'a b  c'.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ 'a b c'.split(none, 1) }} {{ "
       "'a,b,c'.rsplit(',', 1) }} {{ '  a b  '.split() }} {{ ''.split(',') }} {{ ''.split() }} {{ 'a  b c "
       "'.rsplit(none, 1) }}",
       "['a', 'b', 'c'] ['a', 'b', '', 'c'] ['a', 'b,c'] ['a', 'b c'] ['a,b', 'c'] ['a', 'b'] [''] [] ['a  b', 'c']"},
      {"{{ 'abc'.count('') }} {{ 'abc'.startswith('b', 1) }} {{ 'a,b,c'.split(',', maxsplit=1) }} {{ "
       "'aaa'.replace('a', 'b', 1) }}",
       "4 True ['a', 'b,c'] baa"},
  });
}

TEST(JinjaMethod, StrStripStartswithFind) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"[{{ '  x  '.strip() }}][{{ 'xxhixx'.strip('x') }}][{{ '<<a>>'.lstrip('<') }}][{{ '<<a>>'.rstrip('>') }}][{{ "
       "'éaé'.strip('é') }}][{{ 'abcba'.strip('ab') }}]",
       "[x][hi][a>>][<<a][a][c]"},
      {"{{ 'hello'.startswith('he') }} {{ 'hello'.startswith(('x', 'h')) }} {{ 'hello'.endswith(('lo', 'z')) }} {{ "
       "'héllo'.startswith('hé') }}",
       "True True True True"},
      {"{{ 'héllo'.find('l') }} {{ 'héllo'.find('z') }} {{ 'héllo'.index('o') }} {{ 'héllo'.rfind('l') }} {{ "
       "'abcabc'.count('b') }}",
       "2 -1 4 3 2"},
      {"{{ s | length }} {{ s[2:] }} {{ s.find('😀') }} {{ s.split('é') }}", "5 😀b€ 2 ['a', '😀b€']",
       R"({"s": "aé😀b€"})"},
  });
}

TEST(JinjaMethod, StrFormat) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ '{} is {}'.format('a', 1) }} {{ '{0}{1}{0}'.format('x', 'y') }} {{ '{name}!'.format(name='n') }} {{ "
       "'{{}}'.format() }} {{ '{!r}'.format('x') }}",
       "a is 1 xyx n! {} 'x'"},
      {"{{ '{0[a]}'.format({'a': 5}) }} {{ '{0.a}'.format({'a': 6}) }}", "5 6"},
      {"{{ '{0.__class__}'.format('') }}", ""},
  });
}

TEST(JinjaMethod, StrFormatSpecs) {
  GTEST_SKIP() << "not supported: format specs in str.format ('{:>5}', '{:.2f}', '{:03d}') raise a type error";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ '{:>5}'.format('a') }}|{{ '{:.2f}'.format(3.14159) }}|{{ '{:03d}'.format(7) }}|{{ '{!r}'.format('x') }}",
       "    a|3.14|007|'x'"},
  });
}

TEST(JinjaMethod, OtherStrMethods) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ '12'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }} {{ 'Ab'.islower() }} {{ 'AB'.isupper() }} {{ "
       "'a1'.isalnum() }}",
       "True True True False True True"},
      {R"({{ 'a\nb\r\nc'.splitlines() }})", "['a', 'b', 'c']"},
      {"{{ 'ab'.removeprefix('a') }} {{ 'ab'.removesuffix('b') }}", "b a"},
      {"{{ 'Hello'.lower() }} {{ 'a-b'.replace('-', '+') }} {{ 'ab'.upper() }} {{ 'hello world'.title() }} {{ "
       "'x'.join(['1','2']) }} {{ 'ab'.capitalize() }}",
       "hello a+b AB Hello World 1x2 Ab"},
  });
}

TEST(JinjaMethod, MissingStrMethods) {
  GTEST_SKIP()
      << "not supported: str.center, zfill, partition, rpartition, ljust, rjust and swapcase are missing (undefined)";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ 'x'.center(3, '*') }}", "*x*"},
      {"{{ 'ab'.zfill(4) }}", "00ab"},
      {"{{ 'aXbX'.partition('X') }} {{ 'aXbX'.rpartition('X') }}", "('a', 'X', 'bX') ('aXb', 'X', '')"},
      {"[{{ 'a'.ljust(3) }}][{{ 'a'.rjust(3, '.') }}]", "[a  ][..a]"},
      {"{{ 'Ab'.swapcase() }}", "aB"},
  });
}

TEST(JinjaMethod, DictAndListMethods) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 'def') }} {{ d.items() | list }} {{ d.keys() | list }} {{ "
       "d.values() | list }} {% for k in d.keys() %}{{ k }}{% endfor %} {{ d.a }} {{ d['b'] }}",
       "1 None def [('a', 1), ('b', [2])] ['a', 'b'] [1, [2]] ab 1 [2]", R"({"d": {"a": 1, "b": [2]}})"},
      {"{{ dict(a=1, b='x') }} {{ dict() }} {{ dict(a=1).a }} {{ dict([('k', 1)]) }}",
       "{'a': 1, 'b': 'x'} {} 1 {'k': 1}"},
      {"{% for k, v in d.items() %}{{ k }}{% endfor %}{{ d.items() | length }} {{ 'a' in d.keys() }} {{ 1 in "
       "d.values() }}",
       "a1 True True", R"({"d": {"a": 1}})"},
      {"{{ [1, 2, 1].count(1) }} {{ [1, 2].index(2) }}", "2 1"},
  });
}

TEST(JinjaMarkup, SafePlusStrEscapesTheStr) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {R"({{ '<a href="x">&\'' | e }} {{ ('<b>' | safe) + '<i>' }} {{ '<i>' + ('<b>' | safe) }} {{ ('x' | safe) ~ '<y>' }} {{ ('<x>' | escape) | length }})",
       "&lt;a href=&#34;x&#34;&gt;&amp;&#39; <b>&lt;i&gt; &lt;i&gt;<b> x<y> 9"},
      {"{{ (' <b> ' | safe | trim) + '<' }} {{ ('<b>' | safe | replace('b', 'i')) + '<' }} {{ ('<b>' | safe | string) "
       "+ '<' }}",
       "<b>&lt; <i>< <b>&lt;"},
      {"{{ ('<b>' | escape) + '&' }} {{ ('<b>' | safe) * 2 }} {{ ['<a>' | safe, '<b>'] | join }}",
       "&lt;b&gt;&amp; <b><b> <a><b>"},
  });
}

TEST(JinjaMarkup, MarkupMethodsAndFiltersKeepEscaping) {
  GTEST_SKIP() << "not supported: Markup loses its escaping through |upper, % and .format/.replace (Python: "
                  "'<b>'|safe|upper + '<' is '<B>&lt;', ('%s'|safe) % '<x>' is '&lt;x&gt;')";
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ ('<b>' | safe | upper) + '<' }}", "<B>&lt;"},
      {"{{ ('%s' | safe) % '<x>' }}", "&lt;x&gt;"},
      {"{{ ('a{}' | safe).format('<x>') }} {{ ('<b>'|safe).replace('b', '<i>') }}", "a&lt;x&gt; <&lt;i&gt;>"},
  });
}

TEST(JinjaGenerator, ListJoinFirstAndIterationWork) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{{ [1, 2] | map('string') | list }} {{ [1, 2] | select('odd') | list | tojson }}", "['1', '2'] [1]"},
      {"{{ [1, 2] | map('string') | join('-') }} {{ [3, 1] | map('int') | sort }} {{ [1, 2] | map('int') | first }}",
       "1-2 [1, 3] 1"},
      {"{% set g = [1, 2] | map('string') %}{{ g | list }}{{ g | list }}", "['1', '2'][]"},
      {"{{ ([1, 2] | select('odd')) is iterable }}{{ [] | select | list | length }}", "True0"},
  });
}

TEST(JinjaGlobals, NamespaceAndDict) {
  // Expected: jinja2 3.1.6's outputs (transformers' environment).
  expect_renders({
      {"{% set ns = namespace(a=1) %}{% set ns.b = 2 %}{{ ns.a }}{{ ns.b }}{{ ns.c }}", "12"},
      {"{{ dict(a=1, b='x') }} {{ dict() }} {{ dict(a=1).a }} {{ dict([('k', 1)]) }}",
       "{'a': 1, 'b': 'x'} {} 1 {'k': 1}"},
      {"{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}", "12"},
  });
}

// ---- generators, globals, {% generation %} ----

TEST(JinjaGenerator, TojsonAndLengthOfAGeneratorAreTypeErrors) {
  // jinja2 3.1.6 raises TypeError: "Object of type generator is not JSON serializable" and
  // "object of type 'generator' has no len()".
  expect_error("{{ [1, 2] | map('string') | tojson }}", ErrorKind::type, 1);
  expect_error("{{ [1, 2] | select('odd') | length }}", ErrorKind::type, 1);
  // ... while |list first makes it a list.
  expect_renders({{"{{ [1, 2] | map('string') | list | tojson }}", R"(["1", "2"])"}});
}

TEST(JinjaGlobals, GenerationSpansAreByteOffsets) {
  // Expected: jinja2 3.1.6 with transformers' AssistantTracker (its code-point indices, as UTF-8 bytes).
  const std::string src =
      "<s>{% for m in ms %}{% if m.r == 'a' %}{% generation %}{{ m.c }}</s>{% endgeneration %}"
      "{% else %}[{{ m.c }}]{% endif %}{% endfor %}";
  const Template t(src, "t.jinja");
  EXPECT_TRUE(t.has_generation());
  Spans spans;
  const std::string out = t.render(
      from_json(ordered_json::parse(
          R"({"ms": [{"r": "u", "c": "é?"}, {"r": "a", "c": "ça"}, {"r": "u", "c": "x"}, {"r": "a", "c": "b"}]})")),
      {}, &spans);
  EXPECT_EQ(out, "<s>[é?]ça</s>[x]b</s>");
  EXPECT_EQ(spans, (Spans{{8, 15}, {18, 23}}));
  EXPECT_EQ(out.substr(8, 7), "ça</s>");

  spans.clear();
  EXPECT_EQ(render("a{% for i in [1, 2] %}{% generation %}é{{ i }}{% endgeneration %}-{% endfor %}", "{}", {}, &spans),
            "aé1-é2-");
  EXPECT_EQ(spans, (Spans{{1, 4}, {5, 8}}));
  spans.clear();
  EXPECT_EQ(render("{% generation -%}\n  x  {%- endgeneration %}", "{}", {}, &spans), "x");
  EXPECT_EQ(spans, (Spans{{0, 1}}));
  EXPECT_FALSE(Template("{{ 1 }}", "t.jinja").has_generation());
}

TEST(JinjaGlobals, RaiseExceptionCarriesItsMessage) {
  // jinja2 3.1.6 raises TemplateError("bad role: x") (line 2 of the template).
  const std::string what =
      expect_error("a\n{{ raise_exception('bad role: ' ~ r) }}", ErrorKind::raised, 2, {}, R"({"r": "x"})");
  EXPECT_NE(what.find("bad role: x"), std::string::npos) << what;
  try {
    render(
        "{% macro check(r) %}{% if r not in ['a'] %}{{ raise_exception('Bad: ' + r) }}{% endif %}{% endmacro %}"
        "{{ check('a') }}{{ check('z') }}");
    ADD_FAILURE() << "no error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::raised);
    EXPECT_EQ(e.message(), "Bad: z");
  }
}

TEST(JinjaGlobals, StrftimeNowUsesTheGivenTime) {
  RenderOptions o;
  std::tm t{};
  t.tm_year = 2026 - 1900;
  t.tm_mon = 11;
  t.tm_mday = 7;
  t.tm_hour = 12;
  t.tm_wday = 1;  // a Monday
  t.tm_yday = 340;
  o.now = t;
  // Expected: jinja2 3.1.6 with datetime.now() frozen at 2026-12-07 12:00:00.
  expect_renders(
      {{"{{ strftime_now('%Y-%m-%d %H:%M %a %b %d %B %A %j') }}", "2026-12-07 12:00 Mon Dec 07 December Monday 341"},
       {"{{ strftime_now('%d %b %Y') }}", "07 Dec 2026"},
       {"{{ strftime_now('%I %p %y %e %U %w %%') }}", "12 PM 26  7 49 1 %"}},
      o);
}

// ---- errors: kind, location ----

TEST(JinjaErrors, UnclosedBlocksAndExpressions) {
  // jinja2 3.1.6: TemplateSyntaxError for each (lines 2, 2, 2 as it reports them).
  expect_error("a\n{% if true %}b", ErrorKind::syntax, 2);
  expect_error("{% for x in y %}\n\nx", ErrorKind::syntax, 0);  // Jinja says line 2, the interpreter line 3
  expect_error("line1\n{{ x ", ErrorKind::syntax, 2);
  expect_error("a{# b", ErrorKind::syntax, 1);
  expect_error("{{ 'abc }}", ErrorKind::syntax, 1);
  expect_error("{% raw %}abc", ErrorKind::syntax, 1);
  expect_error("{% if true %}{% endfor %}", ErrorKind::syntax, 1);
  expect_error("{% endif %}", ErrorKind::syntax, 1);
  expect_error("{{ }}", ErrorKind::syntax, 1);
  expect_error("{{ 1 @ 2 }}", ErrorKind::syntax, 1);
  expect_error("{% for x %}{% endfor %}", ErrorKind::syntax, 1);
  expect_error("{% if true junk %}{% endif %}", ErrorKind::syntax, 1);
}

TEST(JinjaErrors, UnknownTag) {
  // jinja2 3.1.6: "Encountered unknown tag 'frobnicate'." (line 2); extends/include/import need a
  // loader transformers does not give, so they never render there either.
  expect_error("x\n  {% frobnicate %}", ErrorKind::syntax, 2);
  expect_error("{% include 'x' %}", ErrorKind::syntax, 1);
}

TEST(JinjaErrors, UnknownFilterOrTestOnlyWhenEvaluated) {
  // jinja2 3.1.6: "No filter named 'nosuchfilter'." where reached; a branch not taken renders.
  expect_error("a\n{{ 1 | nosuchfilter }}", ErrorKind::type, 2);
  expect_error("{{ none is None }}", ErrorKind::type, 1);
  expect_renders({{"a{% if false %}{{ 1 | nosuchfilter }}{% endif %}b", "ab"},
                  {"a{% if false %}{{ 1 is nosuchtest }}{% endif %}b", "ab"}});
}

TEST(JinjaErrors, SandboxForbidsMutation) {
  // jinja2 3.1.6: SecurityError "access to attribute 'append' of 'list' object is unsafe." etc.
  expect_error("{% set l = [] %}\n{{ l.append(1) }}", ErrorKind::security, 2);
  expect_error("{% set d = {} %}{{ d.update({'a': 1}) }}", ErrorKind::security, 1);
  expect_error("{% set ns = namespace() %}{% set ns._x = 1 %}", ErrorKind::security, 1);
  // An unsafe attribute read alone is Undefined (prints nothing) in the sandbox.
  expect_renders({{"{{ ''.__class__ }}|{{ namespace.__init__ }}|{{ '{0.__class__}'.format('') }}", "||"}});
}

TEST(JinjaErrors, UndefinedAttributeOfUndefined) {
  // jinja2 3.1.6: UndefinedError "'a' is undefined" (line 3), "'dict object' has no attribute 'missing'".
  expect_error("\n\n{{ a.b }}", ErrorKind::undefined, 3);
  expect_error("{{ a.b.c }}", ErrorKind::undefined, 1);
  expect_error("{{ d.missing.x }}", ErrorKind::undefined, 1, {}, R"({"d": {}})");
  expect_error("{{ nope() }}", ErrorKind::undefined, 1);
  expect_error("{{ x + 1 }}", ErrorKind::undefined, 1);
  expect_error("{% if x.y is defined %}a{% endif %}", ErrorKind::undefined, 1);
  expect_error("{{ loop.index }}", ErrorKind::undefined, 1);
}

TEST(JinjaErrors, TypeErrorsOfOperatorsFiltersAndMethods) {
  // jinja2 3.1.6 raises TypeError / ValueError / ZeroDivisionError for each.
  expect_error("{{ x }}\n{% if true %}\n{{ 1 + 'a' }}{% endif %}", ErrorKind::type, 3, {}, R"({"x": 1})");
  expect_error("{{ 'a' ~ 2 + 3 }}", ErrorKind::type, 1);  // ~ binds tighter than +
  expect_error("{{ 1 / 0 }}", ErrorKind::type, 1);
  expect_error("{{ 1 % 0 }}", ErrorKind::type, 1);
  expect_error("{{ 1 < 'a' }}", ErrorKind::type, 1);
  expect_error("{{ none < 1 }}", ErrorKind::type, 1);
  expect_error("{{ [1, 'a'] | sort }}", ErrorKind::type, 1);
  expect_error("{{ x | tojson }}", ErrorKind::type, 1);  // Undefined is not JSON
  expect_error("{{ namespace(a=1) | tojson }}", ErrorKind::type, 1);
  expect_error("{{ 'hello'.index('z') }}", ErrorKind::type, 1);
  expect_error("{{ 'a'.split('') }}", ErrorKind::type, 1);
  expect_error("{{ 'abc'[::0] }}", ErrorKind::type, 1);
  expect_error("{{ range(1, 2, 0) }}", ErrorKind::type, 1);
  expect_error("{% for x in [1] %}{{ loop.cycle() }}{% endfor %}", ErrorKind::type, 1);
  expect_error("{{ '%s %s' % ('a',) }}", ErrorKind::type, 1);
  expect_error("{{ '{' .format(1) }}", ErrorKind::type, 1);
  expect_error("{{ 'abcdef' | truncate(-3) }}", ErrorKind::type, 1);
}

TEST(JinjaErrors, MacroArgumentChecks) {
  // (Macros used to accept extra positional arguments, unknown keywords and an unused caller.)
  // jinja2 3.1.6: "macro 'm' takes not more than 1 argument(s)", "macro 'm' takes no keyword argument 'b'",
  // "macro 'm' was invoked with two values for the special caller argument".
  expect_error("{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}", ErrorKind::type, 1);
  expect_error("{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, b=2) }}", ErrorKind::type, 1);
  expect_error("{% macro m() %}x{% endmacro %}{% call m() %}y{% endcall %}", ErrorKind::type, 1);
}

TEST(JinjaErrors, BreakOutsideALoopEvenWhenNotReached) {
  // Jinja refuses the whole template, even when the break is in a branch not taken or in a macro defined
  // inside a loop.  (The interpreter used to refuse it only when executed.)
  expect_error("{% break %}", ErrorKind::syntax, 1);
  expect_error("{% if false %}{% break %}{% endif %}ok", ErrorKind::syntax, 1);
  expect_error("{% for x in [1, 2] %}{% macro m() %}{% break %}{% endmacro %}{{ x }}{% endfor %}", ErrorKind::syntax,
               1);
}

TEST(JinjaErrors, DunderAttributeChainIsASecurityError) {
  // jinja2 3.1.6: SecurityError "access to attribute '__class__' of 'str' object is unsafe."  (It used to be
  // ErrorKind::undefined.)
  expect_error("{{ ''.__class__.__mro__ }}", ErrorKind::security, 1);
  expect_error("{{ {}.__class__.__subclasses__() }}", ErrorKind::security, 1);
}

// ---- hostile templates: bounded time, memory and stack ----

TEST(JinjaHostile, InfiniteMacroRecursionHitsTheDepthLimit) {
  // jinja2 3.1.6: RecursionError for each.  Default limits (the depth a real render gets) and tight ones.
  expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}\n{{ f(0) }}", ErrorKind::limit, 0);
  expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ErrorKind::limit, 1, tight());
  expect_error("{% macro f() %}{{ caller() }}{% call f() %}{% endcall %}{% endmacro %}{% call f() %}{% endcall %}",
               ErrorKind::limit, 1, tight());
}

TEST(JinjaHostile, NestedHugeLoopsHitTheIterationLimit) {
  expect_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", ErrorKind::limit, 1,
               tight());
  // jinja2 3.1.6: OverflowError "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000)."
  expect_error("{{ range(10**9) | length }}", ErrorKind::limit, 1);
  expect_error("{% for i in range(10**9) %}{% endfor %}", ErrorKind::limit, 1);
  expect_error("{{ ([1] * 10**12) | length }}", ErrorKind::limit, 1, tight());
  expect_error(
      "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length "
      "}}",
      ErrorKind::limit, 1, tight());
}

TEST(JinjaHostile, HugeStringsHitTheOutputLimitBeforeAllocating) {
  // Default limits: the check comes before the allocation (a terabyte is never asked for).
  expect_error("{{ 'x' * 10**12 }}", ErrorKind::limit, 1);
  expect_error("{{ 'ab' * 9223372036854775807 }}", ErrorKind::limit, 1);
  expect_error("{{ 'x' | center(10**9) }}", ErrorKind::limit, 1, tight());
  // Doubling a string in a namespace: stops at the limit, memory bounded by it.
  expect_error("{% set ns = namespace(s='x') %}\n{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
               ErrorKind::limit, 2, tight());
  expect_error("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
               ErrorKind::limit, 1, tight());
  // Output built from many small pieces, and other string builders.
  expect_error("{% macro m() %}{{ 'x' * 1000 }}{% endmacro %}{% for i in range(10000) %}{{ m() }}{% endfor %}",
               ErrorKind::limit, 1, tight());
  expect_error("{{ ('a\\n' * 100000) | indent(1000) | length }}", ErrorKind::limit, 1, tight());
  expect_error("{{ ('x' * 1000) | replace('x', 'y' * 10000) | length }}", ErrorKind::limit, 1, tight());
  expect_error("{{ ('x' * 2000) | replace('', 'y' * 1000) | length }}", ErrorKind::limit, 1, tight());
  expect_error("{{ [[[[1]]]] | tojson(indent=10**8) | length }}", ErrorKind::limit, 1, tight());
  expect_error("{{ '%s%s' % ('x' * 900000, 'y' * 900000) }}", ErrorKind::limit, 1, tight());
}

TEST(JinjaHostile, DeepNestingIsASyntaxErrorNotAStackOverflow) {
  const size_t n = 100000;
  expect_error("{{ " + repeat("(", n) + "1" + repeat(")", n) + " }}", ErrorKind::syntax, 1);
  expect_error("{{ " + repeat("[", n) + repeat("]", n) + " }}", ErrorKind::syntax, 1);
  expect_error("{{ " + repeat("{'a': ", n) + "1" + repeat("}", n) + " }}", ErrorKind::syntax, 1);
  expect_error("{{ " + repeat("not ", n) + "1 }}", ErrorKind::syntax, 1);
  expect_error("{{ " + repeat("-", n) + "1 }}", ErrorKind::syntax, 1);
  expect_error("{{ " + repeat("1 if 1 else ", n) + "1 }}", ErrorKind::syntax, 1);
  expect_error(repeat("{% if true %}", n) + "x" + repeat("{% endif %}", n), ErrorKind::syntax, 1);
  expect_error(repeat("{% for a in [1] %}", n), ErrorKind::syntax, 1);
  expect_error(repeat("{% macro m() %}", n), ErrorKind::syntax, 1);
  // Flat repetition is fine: long outputs, long tuples, many adjacent strings.
  EXPECT_EQ(render(repeat("x{{ 1 }}", n)).size(), 2 * n);
  EXPECT_EQ(render("{{ " + repeat("'a' ", n) + "}}").size(), n);
}

TEST(JinjaHostile, LongOperatorChainsDoNotOverflowTheStack) {
  // Left-associative chains are not nested brackets, yet their trees are as deep as they are long.  (Destroying
  // such a 200000-deep Expr tree used to overflow the stack: SIGSEGV.)
  const size_t n = 200000;
  const std::vector<std::string> chains = {"{{ 1" + repeat(" ~ 1", n) + " }}",     "{{ 1" + repeat("+1", n) + " }}",
                                           "{{ x" + repeat(".a", n) + " }}",       "{{ x" + repeat("[0]", n) + " }}",
                                           "{{ 'a'" + repeat("|upper", n) + " }}", "{{ x" + repeat("()", n) + " }}",
                                           "{{ 1" + repeat(" and 1", n) + " }}",   "{{ 1" + repeat("**1", n) + " }}"};
  for (const std::string& src : chains)  // refused when parsed: deeper than 256 levels
    expect_error(src, ErrorKind::syntax, 1, tight());
}

TEST(JinjaHostile, DeeplyNestedValuesDoNotOverflowTheStack) {
  // A namespace loop nests values as deep as the iteration limit allows.  (equal()/less() on 100000 levels
  // and destroying a 1000000-deep list used to overflow the stack: SIGSEGV.)
  const std::string build =
      "{% set ns = namespace(l=[], m=[]) %}{% for i in range(1000) %}{% for j in range(100) %}"
      "{% set ns.l = [ns.l] %}{% set ns.m = [ns.m] %}{% endfor %}{% endfor %}";
  // Refused when built: values nest at most 1000 levels (kMaxValueDepth).
  for (const char* tail : {"{{ ns.l == ns.m }}", "{{ ns.l < ns.m }}", "{{ ns.l in [ns.m] }}",
                           "{{ [ns.l, ns.m] | unique | list | length }}", "{{ [ns.l, ns.m] | sort | length }}"})
    expect_error(build + std::string(tail), ErrorKind::limit, 1);
  expect_error(
      "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% for j in range(1000) %}{% set ns.l = [ns.l] %}"
      "{% endfor %}{% endfor %}done",
      ErrorKind::limit, 1);
  // Below the limit they compare and print.
  EXPECT_EQ(render("{% set ns = namespace(l=[], m=[]) %}{% for i in range(150) %}{% set ns.l = [ns.l] %}"
                   "{% set ns.m = [ns.m] %}{% endfor %}{{ ns.l == ns.m }}"),
            "True");
}

TEST(JinjaHostile, PowersWithHugeExponentsAreQuick) {
  // Found by fuzz_jinja: 1 ** 223372036854775807 multiplied 2 * 10^17 times (a hang).  Expected: jinja2 3.1.6's
  // outputs.
  expect_renders({{"{{ 1 ** 9223372036854775807 }} {{ 0 ** 4000000000000000000 }} {{ (-1) ** 10**18 }}", "1 0 1"},
                  {"{{ 3 ** 39 }} {{ (-3) ** 39 }} {{ 2 ** 62 }}",
                   "4052555153018976267 -4052555153018976267 4611686018427387904"}});
}

TEST(JinjaHostile, RangeNearInt64MaxTerminates) {
  // (range() used to step with 'k += step', which overflowed int64 and never ended.)
  // Expected: jinja2 3.1.6's outputs.
  expect_renders({{"{{ range(9223372036854775800, 9223372036854775807, 3) | list }}",
                   "[9223372036854775800, 9223372036854775803, 9223372036854775806]"},
                  {"{{ range(9223372036854775806, -9223372036854775807 - 1, -9223372036854775807) | list }}",
                   "[9223372036854775806, -1]"}});
}

TEST(JinjaHostile, RangeWithAStepNearInt64Max) {
  // (Computing an item as start + k * step used to overflow in k * step although the item fits.)
  // Expected: jinja2 3.1.6's output.
  expect_renders({{"{{ range(-9223372036854775807, 9223372036854775807, 4611686018427387904) | list }}",
                   "[-9223372036854775807, -4611686018427387903, 1, 4611686018427387905]"}});
}

TEST(JinjaHostile, HugeNumbersInTheSourceFailCleanly) {
  // Numbers beyond int64 where the interpreter reads an index or a literal: a TemplateError or a
  // rendering, never std::out_of_range (the fuzz target found these; see tests/fuzz/regressions/fuzz_jinja).
  // jinja2 3.1.6: 1208925819614629174706175, '', [Undefined], ValueError, ValueError.
  const std::vector<std::string> srcs = {
      "{{ 0xFFFFFFFFFFFFFFFFFFFF }}",
      "{{ x.99999999999999999999 }}",
      "{{ [[1]] | map(attribute='99999999999999999999') | list }}",
      "{{ '{99999999999999999999}'.format(1) }}",
      "{{ '{0[99999999999999999999]}'.format([1]) }}",
  };
  for (const std::string& src : srcs) {
    SCOPED_TRACE(src);
    try {
      render(src, R"({"x": [1]})");
    } catch (const TemplateError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("t.jinja:1:", 0), 0u) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a TemplateError: " << e.what();
    }
  }
  expect_renders({{"{{ [[1]] | map(attribute='99999999999999999999') | list }}", "[Undefined]"}});
}

TEST(JinjaHostile, PrintingDeeplyNestedValuesThrowsATemplateError) {
  // Every error out of render() is a TemplateError with a position.  (Printing these used to throw a plain
  // moetron::Error.)
  const std::string deep = "{% set ns = namespace(l=[]) %}{% for i in range(300) %}{% set ns.l = [ns.l] %}{% endfor %}";
  for (const std::string& src : {deep + "{{ ns.l }}", deep + "{{ [ns.l] | join }}", deep + "{{ 'a' ~ ns.l }}",
                                 std::string("{% set ns = namespace() %}{% set ns.x = ns %}{{ ns }}")}) {
    SCOPED_TRACE(src);
    try {
      render(src);
    } catch (const TemplateError&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a TemplateError: " << e.what();
    }
  }
}
