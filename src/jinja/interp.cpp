// The tree walk; see interp.h.  Jinja's scoping: a for loop's body runs in a fresh scope per
// iteration (its sets vanish with it; namespaces carry state out), a macro call in a scope under
// the one it was defined in, if/elif/else in the enclosing scope.
#include "jinja/interp.h"

#include <cmath>

#include "jinja/builtins.h"

namespace moetron::jinja {

namespace {

struct DepthGuard {
  Interp& in;
  int& depth;
  DepthGuard(Interp& i, int& d, int max) : in(i), depth(d) {
    if (++depth > max) {
      --depth;
      in.error(ErrorKind::limit, fmt::format("evaluation nested deeper than {} levels (recursion?)", max));
    }
  }
  ~DepthGuard() { --depth; }
};

struct FrameGuard {
  std::shared_ptr<Frame>& slot;
  std::shared_ptr<Frame> saved;
  FrameGuard(std::shared_ptr<Frame>& s, std::shared_ptr<Frame> f) : slot(s), saved(s) { slot = std::move(f); }
  ~FrameGuard() { slot = saved; }
};

}  // namespace

// A macro, or the body of a {% call %} block (called by the macro as caller()): its definition and
// the scope it was defined in.
struct Closure : Callable {
  const Stmt* def = nullptr;
  std::shared_ptr<Frame> closure;
  Value call(Interp& in, Args& args) override {
    if (!closure) in.type_error("a macro called after its template finished");
    return in.call_macro(*def, closure, args, nullptr);
  }
};

Interp::Interp(const Program& prog, const RenderOptions& o, Spans* spans) : opts(o), prog_(prog), spans_(spans) {}

void Interp::error(ErrorKind kind, const std::string& msg) const {
  static const char* names[] = {"syntax error", "undefined", "type error", "security error", "raised", "limit"};
  const std::string what = kind == ErrorKind::raised
                               ? fmt::format("{}:{}:{}: the template raised: {}", prog_.name, pos.line, pos.col, msg)
                               : fmt::format("{}:{}:{}: {}: {}", prog_.name, pos.line, pos.col, names[(int)kind], msg);
  throw TemplateError(kind, what, msg);
}

void Interp::tick(size_t n) {
  iterations_ += n;
  if (iterations_ > opts.limits.max_iterations || n > opts.limits.max_iterations)
    error(ErrorKind::limit, fmt::format("more than {} loop iterations and list items", opts.limits.max_iterations));
}

void Interp::check_size(size_t bytes) const {
  if (bytes > opts.limits.max_output)
    error(ErrorKind::limit, fmt::format("a string of {} bytes is over the limit of {} bytes", bytes, opts.limits.max_output));
}

void Interp::emit(const std::string& s) {
  check_size(out().size() + s.size());
  out() += s;
}

std::string Interp::run(const Value& context) {
  globals_ = std::make_shared<Frame>();
  add_globals(globals_->vars);
  if (context.is_dict())
    for (const auto& [k, v] : context.obj->items) globals_->vars.set(k, v);
  frame_ = std::make_shared<Frame>();
  frame_->parent = globals_;
  out_.assign(1, std::string());
  struct Release {
    Interp& in;
    ~Release() { in.release(); }
  } release_at_end{*this};
  try {
    if (exec(prog_.body) != Flow::normal) error(ErrorKind::syntax, "'break' or 'continue' outside a loop");
  } catch (const TemplateError&) {
    throw;
  } catch (const Error& e) {  // from a value (printing or nesting limits): at the current position
    error(ErrorKind::limit, e.what());
  }
  return std::move(out_[0]);
}

void Interp::release() {
  for (auto& ns : namespaces_) ns->items.clear();
  for (auto& c : closures_) c->closure.reset();
  namespaces_.clear();
  closures_.clear();
  frame_.reset();
  globals_.reset();
}

Value Interp::lookup(const std::string& name) const {
  for (const Frame* f = frame_.get(); f; f = f->parent.get())
    if (const Value* v = f->vars.find(name)) return *v;
  return Value::undefined(fmt::format("'{}' is undefined", name));
}

void Interp::assign(const std::string& name, Value v) { frame_->vars.set(name, std::move(v)); }

std::string Interp::capture(const Body& body) {
  out_.emplace_back();
  struct Pop {
    std::vector<std::string>& o;
    ~Pop() { o.pop_back(); }
  } pop{out_};
  if (exec(body) != Flow::normal) error(ErrorKind::syntax, "'break' or 'continue' outside a loop");
  return std::move(out_.back());
}

Interp::Flow Interp::exec(const Body& body) {
  for (const auto& s : body) {
    const Flow f = exec(*s);
    if (f != Flow::normal) return f;
  }
  return Flow::normal;
}

Interp::Flow Interp::exec(const Stmt& s) {
  DepthGuard g(*this, depth_, opts.limits.max_depth);
  switch (s.kind) {
    case StmtKind::text: pos = s.pos; emit(s.text); return Flow::normal;
    case StmtKind::output: {
      const Value v = eval(*s.expr);
      pos = s.pos;
      if (v.is_string()) {
        emit(v.str());
      } else {
        std::string t;
        append_str(t, v);
        emit(t);
      }
      return Flow::normal;
    }
    case StmtKind::if_:
      for (size_t k = 0; k < s.conds.size(); ++k)
        if (truthy(eval(*s.conds[k]))) return exec(s.bodies[k]);
      if (s.bodies.size() > s.conds.size()) return exec(s.bodies.back());
      return Flow::normal;
    case StmtKind::for_: exec_for(s); return Flow::normal;
    case StmtKind::set: {
      Value v = eval(*s.expr);
      pos = s.pos;
      if (!s.attr.empty()) {
        set_attr(s, std::move(v));
      } else if (s.names.size() == 1) {
        assign(s.names[0], std::move(v));
      } else {
        std::vector<Value> items = iterate(*this, v);
        pos = s.pos;
        if (items.size() != s.names.size())
          type_error(fmt::format("cannot unpack {} values into {} names", items.size(), s.names.size()));
        for (size_t k = 0; k < items.size(); ++k) assign(s.names[k], std::move(items[k]));
      }
      return Flow::normal;
    }
    case StmtKind::set_block: {
      Value v = Value::string(capture(s.bodies[0]));
      for (const auto& f : s.filters) v = filter(*f, v);
      if (!s.attr.empty()) {  // {% set ns.attr %}
        pos = s.pos;
        set_attr(s, std::move(v));
      } else {
        assign(s.text, std::move(v));
      }
      return Flow::normal;
    }
    case StmtKind::with_: {
      std::vector<Value> vals;  // evaluated in the enclosing scope, then bound in a new one
      for (const auto& e : s.conds) vals.push_back(eval(*e));
      FrameGuard fg(frame_, std::make_shared<Frame>());
      frame_->parent = fg.saved;
      for (size_t k = 0; k < vals.size(); ++k) frame_->vars.set(s.names[k], std::move(vals[k]));
      return exec(s.bodies[0]);
    }
    case StmtKind::macro: {
      auto m = std::make_shared<Closure>();
      m->name = s.text;
      m->def = &s;
      m->closure = frame_;
      closures_.push_back(m);
      assign(s.text, Value::callable(std::move(m)));
      return Flow::normal;
    }
    case StmtKind::call_block: {
      const Expr& c = *s.expr;
      const Value fn = c.a->kind == ExprKind::attr ? getattr(eval(*c.a->a), c.a->name) : eval(*c.a);
      Args a;
      args(c, a);
      auto caller = std::make_shared<Closure>();
      caller->name = "caller";
      caller->def = &s;
      caller->closure = frame_;
      closures_.push_back(caller);
      a.kw.emplace_back("caller", Value::callable(std::move(caller)));
      pos = s.pos;
      emit(to_str(call(fn, a)));
      return Flow::normal;
    }
    case StmtKind::filter_block: {
      Value v = Value::string(capture(s.bodies[0]));
      for (const auto& f : s.filters) v = filter(*f, v);
      emit(to_str(v));
      return Flow::normal;
    }
    case StmtKind::break_: return Flow::brk;
    case StmtKind::continue_: return Flow::cont;
    case StmtKind::generation: {
      const bool root = out_.size() == 1;
      const size_t start = out().size();
      const Flow f = exec(s.bodies[0]);
      if (spans_ && root) spans_->emplace_back(start, out().size());
      return f;
    }
  }
  return Flow::normal;
}

void Interp::set_attr(const Stmt& s, Value v) {
  const Value ns = lookup(s.text);
  if (!ns.is_dict() || ns.obj->kind != ObjectKind::ns)
    error(ErrorKind::type, fmt::format("cannot assign attribute '{}' on '{}': not a namespace", s.attr, s.text));
  if (s.attr[0] == '_')
    error(ErrorKind::security, fmt::format("a namespace cannot hold underscore-prefixed attributes ('{}')", s.attr));
  ns.obj->set(s.attr, std::move(v));
}

void Interp::exec_for(const Stmt& s) {
  if (s.recursive) {
    pos = s.pos;
    error(ErrorKind::syntax, "recursive for loops are not supported");
  }
  const Value seq = eval(*s.expr);
  pos = s.expr->pos;
  std::vector<Value> items = iterate(*this, seq);
  const auto bind = [&](Frame& f, const Value& item) {
    if (s.names.size() == 1) {
      f.vars.set(s.names[0], item);
      return;
    }
    std::vector<Value> parts = iterate(*this, item);
    if (parts.size() != s.names.size()) {
      pos = s.pos;
      type_error(fmt::format("cannot unpack {} values into {} loop variables", parts.size(), s.names.size()));
    }
    for (size_t k = 0; k < parts.size(); ++k) f.vars.set(s.names[k], parts[k]);
  };
  if (s.cond) {  // {% for x in xs if cond %}: the loop sees only the items that pass
    std::vector<Value> kept;
    for (const Value& item : items) {
      tick(1);
      FrameGuard fg(frame_, std::make_shared<Frame>());
      frame_->parent = fg.saved;
      bind(*frame_, item);
      if (truthy(eval(*s.cond))) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    if (s.bodies.size() > 1) {
      const Flow f = exec(s.bodies[1]);
      (void)f;
    }
    return;
  }
  const int64_t n = (int64_t)items.size();
  auto changed_state = std::make_shared<std::optional<std::vector<Value>>>();
  for (int64_t k = 0; k < n; ++k) {
    tick(1);
    FrameGuard fg(frame_, std::make_shared<Frame>());
    frame_->parent = fg.saved;
    bind(*frame_, items[k]);
    Value loop = Value::dict();
    loop.obj->kind = ObjectKind::loop;
    Object& l = *loop.obj;
    l.set("index", Value::integer(k + 1));
    l.set("index0", Value::integer(k));
    l.set("revindex", Value::integer(n - k));
    l.set("revindex0", Value::integer(n - k - 1));
    l.set("first", Value::boolean(k == 0));
    l.set("last", Value::boolean(k == n - 1));
    l.set("length", Value::integer(n));
    l.set("depth", Value::integer(1));
    l.set("depth0", Value::integer(0));
    l.set("previtem", k > 0 ? items[k - 1] : Value::undefined("there is no previous item"));
    l.set("nextitem", k + 1 < n ? items[k + 1] : Value::undefined("there is no next item"));
    struct Cycle : Callable {
      int64_t index = 0;
      Value call(Interp& in, Args& a) override {
        if (a.pos.empty()) in.type_error("no items for cycling given");
        return a.pos[(size_t)(index % (int64_t)a.pos.size())];
      }
    };
    auto cyc = std::make_shared<Cycle>();
    cyc->name = "cycle";
    cyc->index = k;
    l.set("cycle", Value::callable(std::move(cyc)));
    // loop.changed(*values): true when the values differ from this loop's previous call's.
    struct Changed : Callable {
      std::shared_ptr<std::optional<std::vector<Value>>> last;
      Value call(Interp&, Args& a) override {
        bool same = last->has_value() && (*last)->size() == a.pos.size();
        for (size_t j = 0; same && j < a.pos.size(); ++j) same = equal((**last)[j], a.pos[j]);
        *last = a.pos;
        return Value::boolean(!same);
      }
    };
    auto ch = std::make_shared<Changed>();
    ch->name = "changed";
    ch->last = changed_state;
    l.set("changed", Value::callable(std::move(ch)));
    frame_->vars.set("loop", std::move(loop));
    const Flow f = exec(s.bodies[0]);
    if (f == Flow::brk) break;
  }
}

Value Interp::call_macro(const Stmt& def, const std::shared_ptr<Frame>& closure, Args& a, const Value* caller) {
  (void)caller;
  DepthGuard g(*this, depth_, opts.limits.max_depth);
  FrameGuard fg(frame_, std::make_shared<Frame>());
  frame_->parent = closure;
  const std::string& mname = def.kind == StmtKind::call_block ? std::string("caller") : def.text;
  size_t used_kw = 0;
  for (size_t k = 0; k < def.params.size(); ++k) {
    const Param& p = def.params[k];
    const Value* kw = a.kwarg(p.name);
    if (k < a.pos.size()) {
      if (kw) type_error(fmt::format("macro '{}' got multiple values for argument '{}'", mname, p.name));
      frame_->vars.set(p.name, a.pos[k]);
    } else if (kw) {
      frame_->vars.set(p.name, *kw);
      ++used_kw;
    } else if (p.def) {
      frame_->vars.set(p.name, eval(*p.def));
    } else {
      frame_->vars.set(p.name, Value::undefined(fmt::format("parameter '{}' was not provided", p.name)));
    }
  }
  // Arguments the macro has no place for are refused, as Jinja does, unless its body reads
  // varargs / kwargs / caller.
  if (a.pos.size() > def.params.size() && !def.uses_varargs)
    type_error(fmt::format("macro '{}' takes not more than {} argument(s)", mname, def.params.size()));
  std::vector<Value> varargs;
  for (size_t k = def.params.size(); k < a.pos.size(); ++k) varargs.push_back(a.pos[k]);
  Value kwargs = Value::dict();
  for (const auto& [k, v] : a.kw) {
    if (k == "caller") {
      if (!def.uses_caller) type_error(fmt::format("macro '{}' takes no keyword argument 'caller'", mname));
      frame_->vars.set("caller", v);
      continue;
    }
    bool param = false;
    for (const Param& p : def.params) param = param || p.name == k;
    if (param) continue;
    if (!def.uses_kwargs) type_error(fmt::format("macro '{}' takes no keyword argument '{}'", mname, k));
    kwargs.obj->set(k, v);
  }
  (void)used_kw;
  frame_->vars.set("varargs", Value::list(std::move(varargs), true));
  frame_->vars.set("kwargs", std::move(kwargs));
  return Value::string(capture(def.bodies[0]));
}

Value Interp::call(const Value& fn, Args& a) {
  if (fn.kind != Kind::callable) {
    if (fn.is_undefined() && fn.b) error(ErrorKind::security, fn.str());
    if (fn.is_undefined()) error(ErrorKind::undefined, fn.str().empty() ? "an undefined value was called" : fn.str());
    type_error(fmt::format("'{}' object is not callable", fn.type_name()));
  }
  return fn.fn->call(*this, a);
}

Value Interp::getattr(const Value& obj, const std::string& name) {
  // Python's special attributes (__class__, __mro__, __globals__, ...) exist on every object and are
  // what sandbox escapes go through: the sandbox refuses them.
  // As Jinja's sandbox, the attribute reads as an Undefined that prints as "" and raises a security
  // error when used further (an attribute of it, an item, a call).
  if (obj.is_undefined() && obj.b) error(ErrorKind::security, obj.str());
  if (name.size() > 4 && name.compare(0, 2, "__") == 0 && name.compare(name.size() - 2, 2, "__") == 0 && !obj.is_undefined()) {
    Value u = Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, obj.type_name()));
    u.b = true;  // unsafe
    return u;
  }
  switch (obj.kind) {
    case Kind::undefined: error(ErrorKind::undefined, obj.str().empty() ? "attribute of an undefined value" : obj.str());
    case Kind::dict:
      if (obj.obj->kind == ObjectKind::dict) {
        // Python attribute first (dict methods), then the key, as Jinja's getattr does.
        Value m = method(obj, name);
        if (!m.is_undefined()) return m;
      }
      if (const Value* v = obj.obj->find(name)) return *v;
      return Value::undefined(fmt::format("'{}' object has no attribute '{}'", obj.obj->kind == ObjectKind::dict ? "dict" : obj.type_name(), name));
    case Kind::string:
    case Kind::list: {
      Value m = method(obj, name);
      if (!m.is_undefined()) return m;
      return Value::undefined(fmt::format("'{}' object has no attribute '{}'", obj.type_name(), name));
    }
    default: return Value::undefined(fmt::format("'{}' has no attribute '{}'", repr(obj), name));
  }
}

namespace {

// Python's index normalisation; false when out of range.
bool norm_index(int64_t& i, int64_t n) {
  if (i < 0) i += n;
  return i >= 0 && i < n;
}

// Python's slice.indices(n) and the picked positions.
std::vector<int64_t> slice_positions(Interp& in, const Value& start, const Value& stop, const Value& step, int64_t n) {
  const auto as_int = [&](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) return std::nullopt;
    if (v.kind == Kind::integer) return v.i;
    if (v.kind == Kind::boolean) return (int64_t)v.b;
    in.type_error(fmt::format("slice {} must be an integer or None", what));
  };
  const int64_t st = as_int(step, "step").value_or(1);
  if (st == 0) in.error(ErrorKind::type, "slice step cannot be zero");
  const auto clamp = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  const int64_t a = clamp(as_int(start, "start"), st < 0 ? n - 1 : 0), b = clamp(as_int(stop, "stop"), st < 0 ? -1 : n);
  std::vector<int64_t> out;
  if (st > 0)
    for (int64_t k = a; k < b; k += st) out.push_back(k);
  else
    for (int64_t k = a; k > b; k += st) out.push_back(k);
  return out;
}

}  // namespace

Value Interp::getitem(const Value& obj, const Value& key) {
  if (obj.is_undefined() && obj.b) error(ErrorKind::security, obj.str());
  switch (obj.kind) {
    case Kind::undefined: error(ErrorKind::undefined, obj.str().empty() ? "item of an undefined value" : obj.str());
    case Kind::dict:
      if (key.kind != Kind::list && key.kind != Kind::dict && key.kind != Kind::callable && !key.is_undefined())
        if (const Value* v = obj.obj->find(key_string(key))) return *v;
      if (key.is_string()) {
        if (obj.obj->kind == ObjectKind::dict) {
          Value m = method(obj, key.str());
          if (!m.is_undefined()) return m;
        }
      }
      return Value::undefined(fmt::format("'{}' object has no attribute {}", obj.type_name(), repr(key)));
    case Kind::list:
      if (obj.arr->generator) return Value::undefined("'generator' object is not subscriptable");
      if (key.kind == Kind::integer || key.kind == Kind::boolean) {
        int64_t i = key.kind == Kind::integer ? key.i : key.b;
        if (!norm_index(i, (int64_t)obj.arr->items.size()))
          return Value::undefined(fmt::format("{} object has no element {}", obj.type_name(), key.i));
        return obj.arr->items[(size_t)i];
      }
      if (key.is_string()) return getattr(obj, key.str());
      return Value::undefined(fmt::format("{} indices must be integers or slices, not {}", obj.type_name(), key.type_name()));
    case Kind::string:
      if (key.kind == Kind::integer || key.kind == Kind::boolean) {
        const std::vector<uint32_t> cps = utf8_decode(obj.str());
        int64_t i = key.kind == Kind::integer ? key.i : key.b;
        if (!norm_index(i, (int64_t)cps.size())) return Value::undefined("string index out of range");
        std::string out;
        utf8_append(out, cps[(size_t)i]);
        return Value::string(std::move(out));
      }
      if (key.is_string()) return getattr(obj, key.str());
      return Value::undefined(fmt::format("string indices must be integers, not '{}'", key.type_name()));
    default: return Value::undefined(fmt::format("'{}' object is not subscriptable", obj.type_name()));
  }
}

void Interp::args(const Expr& e, Args& a) {
  a.pos.reserve(e.args.size());
  for (const auto& x : e.args) a.pos.push_back(eval(*x));
  for (const auto& kw : e.kwargs) a.kw.emplace_back(kw.name, eval(*kw.value));
}

Value Interp::filter(const Expr& e, const Value& operand) {
  Args a;
  args(e, a);
  pos = e.pos;
  if (!e.builtin) error(ErrorKind::type, fmt::format("No filter named '{}' found.", e.name));
  return apply_filter(*this, static_cast<const Filter*>(e.builtin), operand, a);
}

Value Interp::eval(const Expr& e) {
  DepthGuard g(*this, depth_, opts.limits.max_depth);
  pos = e.pos;
  switch (e.kind) {
    case ExprKind::literal: return e.value;
    case ExprKind::name: return lookup(e.name);
    case ExprKind::list:
    case ExprKind::tuple: {
      tick(e.args.size());
      std::vector<Value> items;
      items.reserve(e.args.size());
      for (const auto& x : e.args) items.push_back(eval(*x));
      return Value::list(std::move(items), e.kind == ExprKind::tuple);
    }
    case ExprKind::dict: {
      tick(e.args.size() / 2);
      Value d = Value::dict();
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
        const Value key = eval(*e.args[k]);
        pos = e.args[k]->pos;
        std::string ks;
        try {
          ks = key_string(key);
        } catch (const TemplateError&) {
          throw;
        } catch (const Error& err) {
          type_error(err.what());
        }
        d.obj->set(ks, eval(*e.args[k + 1]));
      }
      return d;
    }
    case ExprKind::attr: {
      const Value o = eval(*e.a);
      pos = e.pos;
      return getattr(o, e.name);
    }
    case ExprKind::item: {
      const Value o = eval(*e.a);
      if (e.b->kind == ExprKind::slice) {
        const Expr& sl = *e.b;
        const Value a = sl.a ? eval(*sl.a) : Value::none(), b = sl.b ? eval(*sl.b) : Value::none(),
                    c = sl.c ? eval(*sl.c) : Value::none();
        pos = e.pos;
        if (o.is_undefined()) error(ErrorKind::undefined, o.str().empty() ? "slice of an undefined value" : o.str());
        if (o.is_string()) {
          const std::vector<uint32_t> cps = utf8_decode(o.str());
          std::string out;
          for (int64_t k : slice_positions(*this, a, b, c, (int64_t)cps.size())) utf8_append(out, cps[(size_t)k]);
          return Value::string(std::move(out));
        }
        if (o.is_list()) {
          std::vector<Value> out;
          for (int64_t k : slice_positions(*this, a, b, c, (int64_t)o.arr->items.size())) out.push_back(o.arr->items[(size_t)k]);
          return Value::list(std::move(out), o.arr->tuple);
        }
        type_error(fmt::format("'{}' object is not subscriptable", o.type_name()));
      }
      const Value k = eval(*e.b);
      pos = e.pos;
      return getitem(o, k);
    }
    case ExprKind::slice: type_error("a slice outside a subscript");
    case ExprKind::call: {
      const Value fn = e.a->kind == ExprKind::attr ? [&] {
        const Value o = eval(*e.a->a);
        pos = e.a->pos;
        return getattr(o, e.a->name);
      }()
                                                   : eval(*e.a);
      Args a;
      args(e, a);
      pos = e.pos;
      return call(fn, a);
    }
    case ExprKind::filter: {
      const Value v = eval(*e.a);
      return filter(e, v);
    }
    case ExprKind::test: {
      const Value v = eval(*e.a);
      Args a;
      args(e, a);
      pos = e.pos;
      if (!e.builtin) error(ErrorKind::type, fmt::format("No test named '{}' found.", e.name));
      const bool r = apply_test(*this, static_cast<const Test*>(e.builtin), v, a);
      return Value::boolean(r != e.negated);
    }
    case ExprKind::unary: {
      const Value v = eval(*e.a);
      pos = e.pos;
      if (e.op == Op::not_) return Value::boolean(!truthy(v));
      if (v.is_undefined()) error(ErrorKind::undefined, v.str().empty() ? "an undefined value in arithmetic" : v.str());
      if (v.kind == Kind::integer || v.kind == Kind::boolean) {
        const int64_t x = v.kind == Kind::integer ? v.i : v.b;
        if (e.op == Op::neg && x == INT64_MIN) return Value::floating(-(double)x);  // beyond 64 bits
        return Value::integer(e.op == Op::neg ? -x : x);
      }
      if (v.kind == Kind::floating) return Value::floating(e.op == Op::neg ? -v.f : v.f);
      type_error(fmt::format("bad operand type for unary {}: '{}'", e.op == Op::neg ? '-' : '+', v.type_name()));
    }
    case ExprKind::binary: return binary(e);
    case ExprKind::cond:
      if (truthy(eval(*e.a))) return eval(*e.b);
      return e.c ? eval(*e.c) : Value::undefined("the condition was false and there is no else");
  }
  return Value::undefined();
}

Value Interp::compare(Op op, const Value& a, const Value& b) {
  switch (op) {
    case Op::eq: return Value::boolean(equal(a, b));
    case Op::ne: return Value::boolean(!equal(a, b));
    case Op::lt: return Value::boolean(less(*this, a, b));
    case Op::gt: return Value::boolean(less(*this, b, a));
    case Op::le: return Value::boolean(!less(*this, b, a));
    case Op::ge: return Value::boolean(!less(*this, a, b));
    case Op::in:
    case Op::not_in: {
      bool found = false;
      if (b.is_string()) {
        if (!a.is_string()) type_error(fmt::format("'in <string>' requires string as left operand, not {}", a.type_name()));
        found = b.str().find(a.str()) != std::string::npos;
      } else if (b.is_dict()) {
        found = !a.is_list() && !a.is_dict() && !a.is_undefined() && a.kind != Kind::callable && b.obj->find(key_string(a)) != nullptr;
      } else if (b.is_list()) {
        for (const Value& x : b.arr->items)
          if (equal(a, x)) {
            found = true;
            break;
          }
      } else if (!b.is_undefined()) {
        type_error(fmt::format("argument of type '{}' is not iterable", b.type_name()));
      }
      return Value::boolean(found == (op == Op::in));
    }
    default: return Value::undefined();
  }
}

namespace {

int64_t as_int(const Value& v) { return v.kind == Kind::integer ? v.i : (int64_t)v.b; }
bool is_intlike(const Value& v) { return v.kind == Kind::integer || v.kind == Kind::boolean; }

}  // namespace

Value Interp::binary(const Expr& e) {
  if (e.op == Op::none) {  // a chained comparison: a op1 b op2 c ...
    Value left = eval(*e.args[0]);
    for (size_t k = 1; k + 1 < e.args.size(); k += 2) {
      const Value right = eval(*e.args[k + 1]);
      pos = e.pos;
      if (!truthy(compare(e.args[k]->op, left, right))) return Value::boolean(false);
      left = right;
    }
    return Value::boolean(true);
  }
  if (e.op == Op::and_) {
    Value l = eval(*e.a);
    return truthy(l) ? eval(*e.b) : l;
  }
  if (e.op == Op::or_) {
    Value l = eval(*e.a);
    return truthy(l) ? l : eval(*e.b);
  }
  const Value a = eval(*e.a), b = eval(*e.b);
  pos = e.pos;
  switch (e.op) {
    case Op::eq:
    case Op::ne:
    case Op::lt:
    case Op::le:
    case Op::gt:
    case Op::ge:
    case Op::in:
    case Op::not_in: return compare(e.op, a, b);
    case Op::concat: {
      std::string s = to_str(a);
      append_str(s, b);
      check_size(s.size());
      return Value::string(std::move(s));
    }
    default: break;
  }
  for (const Value* v : {&a, &b})
    if (v->is_undefined()) error(ErrorKind::undefined, v->str().empty() ? "an undefined value in arithmetic" : v->str());
  static const char* sym[] = {"", "+", "-", "*", "/", "//", "%", "**"};
  const auto unsupported = [&]() {
    type_error(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", sym[(int)e.op], a.type_name(), b.type_name()));
  };
  if (a.is_number() && b.is_number()) {
    const bool ints = is_intlike(a) && is_intlike(b);
    const int64_t x = ints ? as_int(a) : 0, y = ints ? as_int(b) : 0;
    const double p = a.as_double(), q = b.as_double();
    switch (e.op) {
      case Op::add:
        if (ints) {
          int64_t r;
          if (!__builtin_add_overflow(x, y, &r)) return Value::integer(r);
        }
        return Value::floating(p + q);
      case Op::sub:
        if (ints) {
          int64_t r;
          if (!__builtin_sub_overflow(x, y, &r)) return Value::integer(r);
        }
        return Value::floating(p - q);
      case Op::mul:
        if (ints) {
          int64_t r;
          if (!__builtin_mul_overflow(x, y, &r)) return Value::integer(r);
        }
        return Value::floating(p * q);
      case Op::div:
        if (q == 0) error(ErrorKind::type, "division by zero");
        return Value::floating(p / q);
      case Op::floordiv:
      case Op::mod:
        if (q == 0) error(ErrorKind::type, "integer division or modulo by zero");
        if (ints && !(x == INT64_MIN && y == -1)) {
          int64_t d = x / y, m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) {
            --d;
            m += y;
          }
          return Value::integer(e.op == Op::floordiv ? d : m);
        } else {
          const double d = std::floor(p / q), m = p - d * q;
          return Value::floating(e.op == Op::floordiv ? d : m);
        }
      case Op::pow:
        if (ints && y >= 0) {  // by squaring; beyond 64 bits: a float
          int64_t r = 1, b = x;
          bool over = false;
          for (int64_t k = y; k > 0 && !over; k >>= 1) {
            if (k & 1) over = __builtin_mul_overflow(r, b, &r);
            if (k > 1 && !over) over = __builtin_mul_overflow(b, b, &b);
          }
          if (!over) return Value::integer(r);
          return Value::floating(std::pow(p, q));
        }
        return Value::floating(std::pow(p, q));
      default: unsupported();
    }
  }
  if (e.op == Op::add) {
    if (a.is_string() && b.is_string()) {
      check_size(a.str().size() + b.str().size());
      if (a.safe != b.safe) {  // Markup + str escapes the str (and str + Markup, by Markup.__radd__)
        Value r = Value::string((a.safe ? a.str() : html_escape(a.str())) + (b.safe ? b.str() : html_escape(b.str())));
        check_size(r.str().size());
        r.safe = true;
        return r;
      }
      Value r = Value::string(a.str() + b.str());
      r.safe = a.safe;
      return r;
    }
    if (a.safe || (b.safe && b.is_string())) {  // Markup + other: the other escaped via str()
      Value r = Value::string((a.safe ? a.str() : html_escape(to_str(a))) + (b.safe ? b.str() : html_escape(to_str(b))));
      check_size(r.str().size());
      r.safe = true;
      return r;
    }
    if (a.is_list() && b.is_list() && a.arr->tuple == b.arr->tuple) {
      tick(a.arr->items.size() + b.arr->items.size());
      std::vector<Value> items = a.arr->items;
      items.insert(items.end(), b.arr->items.begin(), b.arr->items.end());
      return Value::list(std::move(items), a.arr->tuple);
    }
    if (a.is_string()) type_error(fmt::format("can only concatenate str (not \"{}\") to str", b.type_name()));
    unsupported();
  }
  if (e.op == Op::mul && (is_intlike(a) || is_intlike(b)) && (a.is_string() || b.is_string() || a.is_list() || b.is_list())) {
    const Value& seq = is_intlike(a) ? b : a;
    const int64_t n = std::max<int64_t>(0, as_int(is_intlike(a) ? a : b));
    if (seq.is_string()) {
      if (n > 0 && seq.str().size() > 0) check_size((size_t)std::min<int64_t>(n, INT64_MAX / (int64_t)std::max<size_t>(1, seq.str().size())) * seq.str().size());
      if (n > 0 && (uint64_t)n > opts.limits.max_output) check_size((size_t)n);
      std::string out;
      for (int64_t k = 0; k < n; ++k) out += seq.str();
      return Value::string(std::move(out));
    }
    tick((size_t)std::min<int64_t>(n, (int64_t)opts.limits.max_iterations + 1) * std::max<size_t>(1, seq.arr->items.size()));
    std::vector<Value> items;
    for (int64_t k = 0; k < n; ++k) items.insert(items.end(), seq.arr->items.begin(), seq.arr->items.end());
    return Value::list(std::move(items), seq.arr->tuple);
  }
  if (e.op == Op::mod && a.is_string()) {
    // printf-style formatting: the "format" filter's rule.
    Args fa;
    if (b.is_list() && b.arr->tuple)
      fa.pos = b.arr->items;
    else
      fa.pos.push_back(b);
    return apply_filter(*this, find_filter("format"), a, fa);
  }
  unsupported();
  return Value::undefined();
}

// ---- Template ----

Template::Template(const std::string& source, std::string name) : source_(source) {
  prog_ = parse(source, LexOptions{}, name);
  // {% generation %} anywhere in the tree.
  std::function<bool(const Body&)> gen = [&](const Body& b) {
    for (const auto& s : b) {
      if (s->kind == StmtKind::generation) return true;
      for (const Body& c : s->bodies)
        if (gen(c)) return true;
    }
    return false;
  };
  has_generation_ = gen(prog_->body);
}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

const std::string& Template::name() const { return prog_->name; }

std::string Template::render(const Value& context, const RenderOptions& opts, Spans* generation) const {
  if (generation) generation->clear();
  Interp in(*prog_, opts, generation);
  return in.run(context);
}

}  // namespace moetron::jinja
