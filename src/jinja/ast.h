// The parsed template: tokens (lexer.cpp) and the syntax tree (parser.cpp) the interpreter walks.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "jinja/value.h"

namespace moetron::jinja {

struct Pos {
  int line = 1, col = 1;
};

// ---- tokens ----
enum class Tok : uint8_t { text, var_begin, var_end, block_begin, block_end, name, integer, floating, string, op, eof };
struct Token {
  Tok type = Tok::eof;
  std::string text;  // text: the data; string: the decoded literal; op/name/numbers: as written
  Pos pos;
};

struct LexOptions {
  bool trim_blocks = true;    // drop the first newline after a block tag
  bool lstrip_blocks = true;  // drop spaces and tabs before a block tag at the start of a line
  bool keep_trailing_newline = false;
};
// Jinja2's lexer: newlines normalised to "\n", the template's one trailing newline dropped (unless
// kept), whitespace control ("-", "+"), raw blocks, comments dropped.  Throws TemplateError.
std::vector<Token> lex(const std::string& source, const LexOptions& opts, const std::string& name);

// ---- expressions ----
enum class ExprKind : uint8_t {
  literal, name, list, tuple, dict, attr, item, slice, call, filter, test, unary, binary, cond
};
enum class Op : uint8_t {
  none, add, sub, mul, div, floordiv, mod, pow, concat, eq, ne, lt, le, gt, ge, in, not_in, and_, or_, not_, neg, pos
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
struct Kwarg {
  std::string name;
  ExprPtr value;
};
struct Expr {
  ExprKind kind = ExprKind::literal;
  Pos pos;
  Op op = Op::none;
  Value value;                // literal
  std::string name;           // name, attr, filter, test
  bool negated = false;       // test: "is not"
  ExprPtr a, b, c;            // operands: object/left/condition, index/right/then, else; slice: a:b:c
  std::vector<ExprPtr> args;  // list/tuple items, dict keys and values interleaved, call/filter/test arguments
  std::vector<Kwarg> kwargs;
  // Resolved at parse time for filters and tests (null: unknown, an error when evaluated, as in Jinja).
  const void* builtin = nullptr;
  int depth = 1;  // of the tree below (bounded by the parser: destroying and walking it recurse)
};

// ---- statements ----
enum class StmtKind : uint8_t {
  text, output, if_, for_, set, set_block, macro, call_block, filter_block, break_, continue_, generation, with_
};
struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;
struct Param {
  std::string name;
  ExprPtr def;  // null: required
};
struct Stmt {
  StmtKind kind = StmtKind::text;
  Pos pos;
  std::string text;                // text; set/set_block/macro: the name; set: "ns.attr" splits as name + attr
  std::string attr;                // set ns.attr
  std::vector<std::string> names;  // for: targets; set: unpacking targets
  ExprPtr expr;                    // output, set value, for iterable, call_block's call
  ExprPtr cond;                    // for: the "if" filter
  std::vector<ExprPtr> conds;      // if: one per branch; with: the values of `names`
  std::vector<Body> bodies;        // if: one per branch (+ else); for: body, else; others: body
  std::vector<Param> params;       // macro, call_block's caller
  std::vector<ExprPtr> filters;    // set_block, filter_block: filter chain, applied in order (operand null)
  bool recursive = false;
  // macro: whether its body reads varargs / kwargs / caller (else extra arguments are refused, as in Jinja)
  bool uses_varargs = false, uses_kwargs = false, uses_caller = false;
};

struct Program {
  std::string name;
  Body body;
};

// Tokens -> tree.  Throws TemplateError naming the line and column.
std::unique_ptr<Program> parse(const std::string& source, const LexOptions& opts, const std::string& name);

}  // namespace moetron::jinja
