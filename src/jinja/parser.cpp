// Jinja2's parser (jinja2/parser.py): the statements chat templates use (if, for, set, macro, call,
// filter, break, continue, generation) and the full expression grammar, with Jinja's precedence:
// condexpr < or < and < not < compare < + - < ~ < * / // % < ** < unary < postfix, filters, tests.
#include <algorithm>
#include <cmath>
#include <set>

#include "jinja/ast.h"
#include "jinja/builtins.h"
#include "jinja/jinja.h"

namespace moetron::jinja {

namespace {

constexpr int kMaxNesting = 200;  // statements and expressions; deeper templates are refused
// The depth of one expression's tree, left-associative chains (a ~ b ~ c ..., x.a.b..., x|f|g...)
// included: deeper could not be evaluated (RenderLimits::max_depth) and would recurse when destroyed.
constexpr int kMaxExprDepth = 256;

class Parser {
 public:
  Parser(std::vector<Token> toks, const std::string& name) : t_(std::move(toks)), name_(name) {}

  Body top() {
    Body b = body({});
    if (cur().type != Tok::eof) fail_at(cur().pos, "unexpected end tag");
    return b;
  }

 private:
  std::vector<Token> t_;
  size_t k_ = 0;
  const std::string& name_;
  int depth_ = 0;
  int loops_ = 0;  // for-loop bodies around the statement being parsed (a macro's body starts at 0)
  std::vector<std::string> open_blocks_;  // for "unclosed block" messages

  struct Guard {
    Parser& p;
    explicit Guard(Parser& pp) : p(pp) {
      if (++p.depth_ > kMaxNesting) p.fail_at(p.cur().pos, fmt::format("nested more than {} levels deep", kMaxNesting));
    }
    ~Guard() { --p.depth_; }
  };

  [[noreturn]] void fail_at(Pos p, const std::string& msg) {
    throw TemplateError(ErrorKind::syntax, fmt::format("{}:{}:{}: syntax error: {}", name_, p.line, p.col, msg), msg);
  }
  // Sets e's depth from its children; refuses a tree deeper than kMaxExprDepth.
  ExprPtr seal(ExprPtr e) {
    int d = 0;
    for (const Expr* c : {e->a.get(), e->b.get(), e->c.get()})
      if (c) d = std::max(d, c->depth);
    for (const auto& x : e->args) d = std::max(d, x->depth);
    for (const auto& kw : e->kwargs) d = std::max(d, kw.value->depth);
    e->depth = d + 1;
    if (e->depth > kMaxExprDepth) fail_at(e->pos, fmt::format("an expression nested more than {} levels deep", kMaxExprDepth));
    return e;
  }
  const Token& cur() const { return t_[k_]; }
  const Token& peek(size_t n = 1) const { return t_[std::min(k_ + n, t_.size() - 1)]; }
  bool is_op(const char* o) const { return cur().type == Tok::op && cur().text == o; }
  bool is_name(const char* n) const { return cur().type == Tok::name && cur().text == n; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::eof: return "end of template";
      case Tok::var_end: return "end of print statement";
      case Tok::block_end: return "end of statement block";
      case Tok::text: return "template data";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(const char* o) {
    if (!is_op(o)) fail_at(cur().pos, fmt::format("expected '{}', got {}", o, describe(cur())));
    ++k_;
  }
  std::string expect_name() {
    if (cur().type != Tok::name) fail_at(cur().pos, fmt::format("expected a name, got {}", describe(cur())));
    return t_[k_++].text;
  }
  void expect_block_end() {
    if (cur().type != Tok::block_end) fail_at(cur().pos, fmt::format("expected end of statement block, got {}", describe(cur())));
    ++k_;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    ++k_;
    return true;
  }
  bool skip_op(const char* o) {
    if (!is_op(o)) return false;
    ++k_;
    return true;
  }

  // Statements up to one of `ends` (a block tag whose name is in it; left unconsumed: the caller
  // reads the "{%" already skipped and the name).
  Body body(const std::set<std::string>& ends) {
    Guard g(*this);
    Body out;
    while (true) {
      const Token& tk = cur();
      if (tk.type == Tok::eof) {
        if (!ends.empty())
          fail_at(tk.pos, fmt::format("unexpected end of template: the '{}' block was never closed (expected {})",
                                      open_blocks_.empty() ? "?" : open_blocks_.back(), *ends.begin()));
        return out;
      }
      if (tk.type == Tok::text) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::text;
        s->pos = tk.pos;
        s->text = tk.text;
        out.push_back(std::move(s));
        ++k_;
      } else if (tk.type == Tok::var_begin) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::output;
        s->pos = tk.pos;
        ++k_;
        s->expr = tuple_expr(true, {});
        if (cur().type != Tok::var_end) fail_at(cur().pos, fmt::format("expected end of print statement, got {}", describe(cur())));
        ++k_;
        out.push_back(std::move(s));
      } else if (tk.type == Tok::block_begin) {
        const Token& nm = peek();
        if (nm.type != Tok::name) fail_at(nm.pos, fmt::format("expected a tag name, got {}", describe(nm)));
        if (ends.count(nm.text)) {
          ++k_;  // "{%"; the name stays for the caller
          return out;
        }
        out.push_back(statement());
      } else {
        fail_at(tk.pos, fmt::format("unexpected {}", describe(tk)));
      }
    }
  }

  std::unique_ptr<Stmt> statement() {
    const Pos at = cur().pos;
    ++k_;  // {%
    const std::string tag = cur().text;
    ++k_;
    auto s = std::make_unique<Stmt>();
    s->pos = at;
    open_blocks_.push_back(tag);
    if (tag == "if") {
      s->kind = StmtKind::if_;
      s->conds.push_back(tuple_expr(false, {}));
      expect_block_end();
      while (true) {
        s->bodies.push_back(body({"elif", "else", "endif"}));
        const std::string end = expect_name();
        if (end == "elif") {
          s->conds.push_back(tuple_expr(false, {}));
          expect_block_end();
          continue;
        }
        if (end == "else") {
          expect_block_end();
          s->bodies.push_back(body({"endif"}));
          expect_name();
        }
        expect_block_end();
        break;
      }
    } else if (tag == "for") {
      s->kind = StmtKind::for_;
      targets(s->names, "in");
      if (!skip_name("in")) fail_at(cur().pos, fmt::format("expected 'in', got {}", describe(cur())));
      s->expr = tuple_expr(false, {"recursive"}, false);
      if (skip_name("if")) s->cond = expression(true);
      if (skip_name("recursive")) s->recursive = true;
      expect_block_end();
      ++loops_;
      s->bodies.push_back(body({"endfor", "else"}));
      --loops_;
      if (expect_name() == "else") {
        expect_block_end();
        s->bodies.push_back(body({"endfor"}));
        expect_name();
      }
      expect_block_end();
    } else if (tag == "set") {
      const Pos tp = cur().pos;
      std::string first = expect_name();
      if (is_op(".")) {
        ++k_;
        s->kind = StmtKind::set;
        s->text = first;
        s->attr = expect_name();
        if (skip_op("=")) {
          s->expr = tuple_expr(true, {});
          expect_block_end();
        } else {  // {% set ns.attr %}...{% endset %}
          s->kind = StmtKind::set_block;
          while (skip_op("|")) s->filters.push_back(filter_call(nullptr));
          expect_block_end();
          s->bodies.push_back(body({"endset"}));
          expect_name();
          expect_block_end();
        }
      } else if (is_op(",") || is_op("=")) {
        s->kind = StmtKind::set;
        s->names.push_back(first);
        while (skip_op(",")) {
          if (is_op("=")) break;
          s->names.push_back(expect_name());
        }
        expect_op("=");
        s->expr = tuple_expr(true, {});
        expect_block_end();
      } else {
        s->kind = StmtKind::set_block;
        s->text = first;
        while (skip_op("|")) s->filters.push_back(filter_call(nullptr));
        if (cur().type != Tok::block_end) fail_at(tp, fmt::format("expected '=' or end of statement after 'set {}'", first));
        expect_block_end();
        s->bodies.push_back(body({"endset"}));
        expect_name();
        expect_block_end();
      }
    } else if (tag == "macro") {
      s->kind = StmtKind::macro;
      s->text = expect_name();
      params(s->params);
      expect_block_end();
      const int outer_loops = loops_;
      loops_ = 0;
      s->bodies.push_back(body({"endmacro"}));
      loops_ = outer_loops;
      s->uses_varargs = reads(s->bodies[0], "varargs");
      s->uses_kwargs = reads(s->bodies[0], "kwargs");
      s->uses_caller = reads(s->bodies[0], "caller");
      expect_name();
      if (cur().type == Tok::name) ++k_;  // {% endmacro name %}
      expect_block_end();
    } else if (tag == "call") {
      s->kind = StmtKind::call_block;
      if (is_op("(")) params(s->params);
      s->expr = expression(true);
      if (s->expr->kind != ExprKind::call) fail_at(at, "expected a call after 'call'");
      expect_block_end();
      const int outer_loops = loops_;
      loops_ = 0;
      s->bodies.push_back(body({"endcall"}));
      loops_ = outer_loops;
      s->uses_varargs = reads(s->bodies[0], "varargs");
      s->uses_kwargs = reads(s->bodies[0], "kwargs");
      s->uses_caller = reads(s->bodies[0], "caller");
      expect_name();
      expect_block_end();
    } else if (tag == "filter") {
      s->kind = StmtKind::filter_block;
      s->filters.push_back(filter_call(nullptr));
      while (skip_op("|")) s->filters.push_back(filter_call(nullptr));
      expect_block_end();
      s->bodies.push_back(body({"endfilter"}));
      expect_name();
      expect_block_end();
    } else if (tag == "break" || tag == "continue") {
      s->kind = tag == "break" ? StmtKind::break_ : StmtKind::continue_;
      if (loops_ == 0) fail_at(at, fmt::format("'{}' outside a loop", tag));
      expect_block_end();
    } else if (tag == "with") {  // {% with a = 1, b = x %}...{% endwith %}: a scope
      s->kind = StmtKind::with_;
      while (cur().type != Tok::block_end) {
        if (!s->names.empty()) expect_op(",");
        s->names.push_back(expect_name());
        expect_op("=");
        s->conds.push_back(expression(true));
      }
      expect_block_end();
      s->bodies.push_back(body({"endwith"}));
      expect_name();
      expect_block_end();
    } else if (tag == "generation") {
      s->kind = StmtKind::generation;
      expect_block_end();
      s->bodies.push_back(body({"endgeneration"}));
      expect_name();
      expect_block_end();
    } else {
      fail_at(at, fmt::format("Encountered unknown tag '{}'", tag));
    }
    open_blocks_.pop_back();
    return s;
  }

  // Whether any expression under `b` reads the name `n` (a macro's varargs / kwargs / caller).
  static bool reads(const Expr* e, const std::string& n) {
    if (!e) return false;
    if (e->kind == ExprKind::name && e->name == n) return true;
    if (reads(e->a.get(), n) || reads(e->b.get(), n) || reads(e->c.get(), n)) return true;
    for (const auto& x : e->args)
      if (reads(x.get(), n)) return true;
    for (const auto& kw : e->kwargs)
      if (reads(kw.value.get(), n)) return true;
    return false;
  }
  static bool reads(const Body& b, const std::string& n) {
    for (const auto& s : b) {
      if (reads(s->expr.get(), n) || reads(s->cond.get(), n)) return true;
      for (const auto& x : s->conds)
        if (reads(x.get(), n)) return true;
      for (const auto& x : s->filters)
        if (reads(x.get(), n)) return true;
      for (const auto& p : s->params)
        if (reads(p.def.get(), n)) return true;
      for (const Body& c : s->bodies)
        if (reads(c, n)) return true;
    }
    return false;
  }

  // for-loop targets: a name, or names separated by commas (optionally in parentheses).
  void targets(std::vector<std::string>& names, const char* end) {
    const bool paren = skip_op("(");
    names.push_back(expect_name());
    while (skip_op(",")) {
      if (is_name(end) || is_op(")")) break;
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
  }

  void params(std::vector<Param>& out) {
    expect_op("(");
    while (!is_op(")")) {
      if (!out.empty()) expect_op(",");
      if (is_op(")")) break;
      Param p;
      p.name = expect_name();
      if (skip_op("=")) p.def = expression(true);
      out.push_back(std::move(p));
    }
    expect_op(")");
  }

  ExprPtr node(ExprKind k, Pos p) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = p;
    return e;
  }

  bool tuple_end(const std::set<std::string>& extra) const {
    const Token& t = cur();
    if (t.type == Tok::var_end || t.type == Tok::block_end || t.type == Tok::eof) return true;
    if (t.type == Tok::op && (t.text == ")")) return true;
    return t.type == Tok::name && extra.count(t.text);
  }

  // Expressions separated by commas: one, or a tuple.
  ExprPtr tuple_expr(bool condexpr, const std::set<std::string>& extra, bool allow_cond = true,
                     bool explicit_paren = false) {
    const Pos at = cur().pos;
    std::vector<ExprPtr> items;
    bool comma = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        comma = true;
      }
      if (tuple_end(extra)) break;
      items.push_back(allow_cond ? expression(condexpr) : expression(false));
      if (!is_op(",")) break;
    }
    if (!comma && items.size() == 1) return std::move(items[0]);
    if (items.empty() && !explicit_paren) fail_at(at, fmt::format("expected an expression, got {}", describe(cur())));
    auto t = node(ExprKind::tuple, at);
    t->args = std::move(items);
    return seal(std::move(t));
  }

  ExprPtr expression(bool condexpr) {
    Guard g(*this);
    if (!condexpr) return or_expr();
    ExprPtr e = or_expr();
    while (is_name("if")) {
      const Pos at = cur().pos;
      ++k_;
      auto c = node(ExprKind::cond, at);
      c->a = or_expr();
      c->b = std::move(e);
      if (skip_name("else")) c->c = expression(true);
      e = seal(std::move(c));
    }
    return e;
  }

  ExprPtr binary(Op op, ExprPtr l, ExprPtr r, Pos at) {
    auto e = node(ExprKind::binary, at);
    e->op = op;
    e->a = std::move(l);
    e->b = std::move(r);
    return seal(std::move(e));
  }

  ExprPtr or_expr() {
    ExprPtr l = and_expr();
    while (is_name("or")) {
      const Pos at = cur().pos;
      ++k_;
      l = binary(Op::or_, std::move(l), and_expr(), at);
    }
    return l;
  }
  ExprPtr and_expr() {
    ExprPtr l = not_expr();
    while (is_name("and")) {
      const Pos at = cur().pos;
      ++k_;
      l = binary(Op::and_, std::move(l), not_expr(), at);
    }
    return l;
  }
  ExprPtr not_expr() {
    if (is_name("not")) {
      Guard g(*this);
      const Pos at = cur().pos;
      ++k_;
      auto e = node(ExprKind::unary, at);
      e->op = Op::not_;
      e->a = not_expr();
      return seal(std::move(e));
    }
    return compare();
  }
  ExprPtr compare() {
    const Pos at = cur().pos;
    ExprPtr l = math1();
    // Chained comparisons (a < b < c) are "and"-ed pairs; each operand is evaluated as written.
    std::vector<std::pair<Op, ExprPtr>> ops;
    while (true) {
      Op op = Op::none;
      if (cur().type == Tok::op) {
        const std::string& o = cur().text;
        op = o == "==" ? Op::eq : o == "!=" ? Op::ne : o == "<" ? Op::lt : o == "<=" ? Op::le : o == ">" ? Op::gt : o == ">=" ? Op::ge : Op::none;
        if (op != Op::none) ++k_;
      } else if (is_name("in")) {
        op = Op::in;
        ++k_;
      } else if (is_name("not") && peek().type == Tok::name && peek().text == "in") {
        op = Op::not_in;
        k_ += 2;
      }
      if (op == Op::none) break;
      ops.emplace_back(op, math1());
    }
    if (ops.empty()) return l;
    if (ops.size() == 1) return binary(ops[0].first, std::move(l), std::move(ops[0].second), at);
    // a < b < c: the tree holds the comparisons in a compare node (op none) with all operands.
    auto e = node(ExprKind::binary, at);
    e->op = Op::none;
    e->args.push_back(std::move(l));
    for (auto& [op, r] : ops) {
      auto o = node(ExprKind::literal, at);
      o->op = op;
      e->args.push_back(std::move(o));
      e->args.push_back(std::move(r));
    }
    return seal(std::move(e));
  }
  ExprPtr math1() {
    ExprPtr l = concat();
    while (is_op("+") || is_op("-")) {
      const Pos at = cur().pos;
      const Op op = cur().text == "+" ? Op::add : Op::sub;
      ++k_;
      l = binary(op, std::move(l), concat(), at);
    }
    return l;
  }
  ExprPtr concat() {
    ExprPtr l = math2();
    while (is_op("~")) {
      const Pos at = cur().pos;
      ++k_;
      l = binary(Op::concat, std::move(l), math2(), at);
    }
    return l;
  }
  ExprPtr math2() {
    ExprPtr l = pow_expr();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Pos at = cur().pos;
      const std::string o = cur().text;
      ++k_;
      const Op op = o == "*" ? Op::mul : o == "/" ? Op::div : o == "//" ? Op::floordiv : Op::mod;
      l = binary(op, std::move(l), pow_expr(), at);
    }
    return l;
  }
  ExprPtr pow_expr() {
    ExprPtr l = unary(true);
    while (is_op("**")) {
      const Pos at = cur().pos;
      ++k_;
      l = binary(Op::pow, std::move(l), unary(true), at);
    }
    return l;
  }
  ExprPtr unary(bool with_filter) {
    Guard g(*this);
    const Pos at = cur().pos;
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Op op = cur().text == "-" ? Op::neg : Op::pos;
      ++k_;
      e = node(ExprKind::unary, at);
      e->op = op;
      e->a = unary(false);
      e = seal(std::move(e));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filter) e = filter_expr(std::move(e));
    return e;
  }

  ExprPtr primary() {
    const Token& t = cur();
    const Pos at = t.pos;
    if (t.type == Tok::name) {
      ++k_;
      if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
        auto e = node(ExprKind::literal, at);
        e->value = Value::boolean(t.text[0] == 't' || t.text[0] == 'T');
        return e;
      }
      if (t.text == "none" || t.text == "None") {
        auto e = node(ExprKind::literal, at);
        e->value = Value::none();
        return e;
      }
      auto e = node(ExprKind::name, at);
      e->name = t.text;
      return e;
    }
    if (t.type == Tok::string) {
      std::string s;
      while (cur().type == Tok::string) s += t_[k_++].text;  // adjacent literals join
      auto e = node(ExprKind::literal, at);
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::integer || t.type == Tok::floating) {
      ++k_;
      auto e = node(ExprKind::literal, at);
      if (t.type == Tok::integer) {
        const auto v = parse_int64(t.text);
        if (!v) fail_at(at, fmt::format("integer literal '{}' is out of range (64 bits)", t.text.substr(0, 40)));
        e->value = Value::integer(*v);
      } else {
        try {
          e->value = Value::floating(std::stod(t.text));
        } catch (const std::exception&) {  // out of double's range: Python gives inf
          e->value = Value::floating(t.text.find("e-") != std::string::npos || t.text.find("E-") != std::string::npos ? 0.0 : HUGE_VAL);
        }
      }
      return e;
    }
    if (is_op("(")) {
      ++k_;
      ExprPtr e = tuple_expr(true, {}, true, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++k_;
      auto e = node(ExprKind::list, at);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(expression(true));
      }
      expect_op("]");
      return seal(std::move(e));
    }
    if (is_op("{")) {
      ++k_;
      auto e = node(ExprKind::dict, at);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(expression(true));
        expect_op(":");
        e->args.push_back(expression(true));
      }
      expect_op("}");
      return seal(std::move(e));
    }
    fail_at(at, fmt::format("unexpected {}", describe(t)));
  }

  ExprPtr postfix(ExprPtr e) {
    while (true) {
      const Pos at = cur().pos;
      if (is_op(".")) {
        ++k_;
        if (cur().type == Tok::name) {
          auto a = node(ExprKind::attr, at);
          a->a = std::move(e);
          a->name = t_[k_++].text;
          e = seal(std::move(a));
        } else if (cur().type == Tok::integer) {
          auto a = node(ExprKind::item, at);
          a->a = std::move(e);
          auto lit = node(ExprKind::literal, cur().pos);
          const auto v = parse_int64(cur().text);
          if (!v) fail_at(cur().pos, fmt::format("index '{}' is out of range (64 bits)", cur().text.substr(0, 40)));
          ++k_;
          lit->value = Value::integer(*v);
          a->b = std::move(lit);
          e = seal(std::move(a));
        } else {
          fail_at(cur().pos, "expected a name or number after '.'");
        }
      } else if (is_op("[")) {
        ++k_;
        auto a = node(ExprKind::item, at);
        a->a = std::move(e);
        std::vector<ExprPtr> subs;
        while (!is_op("]")) {
          if (!subs.empty()) expect_op(",");
          if (is_op("]")) break;
          subs.push_back(subscribed());
        }
        expect_op("]");
        if (subs.empty()) fail_at(at, "expected a subscript");
        if (subs.size() == 1) {
          a->b = std::move(subs[0]);
        } else {
          auto t = node(ExprKind::tuple, at);
          t->args = std::move(subs);
          a->b = seal(std::move(t));
        }
        e = seal(std::move(a));
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr subscribed() {
    const Pos at = cur().pos;
    ExprPtr first;
    if (!is_op(":")) {
      first = expression(true);
      if (!is_op(":")) return first;
    }
    auto s = node(ExprKind::slice, at);
    s->a = std::move(first);
    expect_op(":");
    if (!is_op("]") && !is_op(",") && !is_op(":")) s->b = expression(true);
    if (skip_op(":"))
      if (!is_op("]") && !is_op(",")) s->c = expression(true);
    return seal(std::move(s));
  }

  void call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (cur().type == Tok::name && peek().type == Tok::op && peek().text == "=") {
        Kwarg kw;
        kw.name = t_[k_].text;
        k_ += 2;
        kw.value = expression(true);
        e.kwargs.push_back(std::move(kw));
      } else {
        if (!e.kwargs.empty()) fail_at(cur().pos, "positional argument follows keyword argument");
        e.args.push_back(expression(true));
      }
    }
    expect_op(")");
  }

  ExprPtr call(ExprPtr callee) {
    auto c = node(ExprKind::call, cur().pos);
    c->a = std::move(callee);
    call_args(*c);
    return seal(std::move(c));
  }

  // name[(args)] after "|"; the operand is set by the caller (null for filter blocks).
  ExprPtr filter_call(ExprPtr operand) {
    const Pos at = cur().pos;
    auto f = node(ExprKind::filter, at);
    f->a = std::move(operand);
    f->name = expect_name();
    while (is_op(".")) {  // dotted filter names
      ++k_;
      f->name += "." + expect_name();
    }
    f->builtin = find_filter(f->name);  // unknown: an error when (if ever) it runs, as in Jinja
    if (is_op("(")) call_args(*f);
    return seal(std::move(f));
  }

  ExprPtr filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        ++k_;
        e = filter_call(std::move(e));
      } else if (is_name("is")) {
        const Pos at = cur().pos;
        ++k_;
        auto t = node(ExprKind::test, at);
        t->negated = skip_name("not");
        t->name = expect_name();
        while (is_op(".")) {
          ++k_;
          t->name += "." + expect_name();
        }
        t->a = std::move(e);
        t->builtin = find_test(t->name);
        if (is_op("(")) {
          call_args(*t);
        } else {
          const Token& c = cur();
          const bool arg = (c.type == Tok::name || c.type == Tok::string || c.type == Tok::integer ||
                            c.type == Tok::floating || (c.type == Tok::op && (c.text == "(" || c.text == "[" || c.text == "{"))) &&
                           !(c.type == Tok::name && (c.text == "else" || c.text == "or" || c.text == "and"));
          if (arg) {
            if (is_name("is")) fail_at(c.pos, "You cannot chain multiple tests with is");
            t->args.push_back(postfix(primary()));
          }
        }
        e = seal(std::move(t));
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }
};

}  // namespace

std::unique_ptr<Program> parse(const std::string& source, const LexOptions& opts, const std::string& name) {
  auto prog = std::make_unique<Program>();
  prog->name = name;
  Parser p(lex(source, opts, name), name);
  prog->body = p.top();
  return prog;
}

}  // namespace moetron::jinja
