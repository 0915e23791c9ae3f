// The tree walk: scopes, output, limits, and the helpers builtins share (errors at the current
// position, attribute and item lookup, calls).  Internal to src/jinja.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "jinja/ast.h"
#include "jinja/jinja.h"

namespace moetron::jinja {

// One scope: the template's top level, a loop iteration, a macro call.  Names not found here are
// looked up in the parent (a macro's parent is the scope it was defined in, read at call time).
struct Closure;

struct Frame {
  std::shared_ptr<Frame> parent;
  Object vars;
};

class Interp {
 public:
  Interp(const Program& prog, const RenderOptions& opts, Spans* spans);
  std::string run(const Value& context);

  const RenderOptions& opts;
  Pos pos;  // where the expression being evaluated is (errors raised by builtins name it)

  [[noreturn]] void error(ErrorKind kind, const std::string& msg) const;
  [[noreturn]] void type_error(const std::string& msg) const { error(ErrorKind::type, msg); }
  // Counts work against the limits.
  void tick(size_t iterations);
  void check_size(size_t bytes) const;

  Value call(const Value& fn, Args& args);
  // A namespace made during this render: emptied at its end, which breaks the reference cycles a
  // namespace holding itself makes (values are reference-counted).
  void track_namespace(const std::shared_ptr<Object>& ns) { namespaces_.push_back(ns); }
  Value getattr(const Value& obj, const std::string& name);
  Value getitem(const Value& obj, const Value& key);
  Value eval(const Expr& e);

 private:
  friend struct Closure;
  enum class Flow : uint8_t { normal, brk, cont };

  const Program& prog_;
  Spans* spans_;
  // Made during this render, released at its end: a macro stored in the scope it closes over is a cycle.
  std::vector<std::shared_ptr<Object>> namespaces_;
  std::vector<std::shared_ptr<Closure>> closures_;
  void release();
  std::shared_ptr<Frame> globals_, frame_;
  std::vector<std::string> out_;  // output, and the captures of set blocks, macros, filters
  size_t iterations_ = 0;
  int depth_ = 0;

  std::string& out() { return out_.back(); }
  void emit(const std::string& s);
  Flow exec(const Body& body);
  Flow exec(const Stmt& s);
  void exec_for(const Stmt& s);
  void set_attr(const Stmt& s, Value v);  // {% set ns.attr = ... %}
  void assign(const std::string& name, Value v);
  Value lookup(const std::string& name) const;
  std::string capture(const Body& body);
  Value binary(const Expr& e);
  Value compare(Op op, const Value& a, const Value& b);
  Value filter(const Expr& e, const Value& operand);
  void args(const Expr& e, Args& a);
  Value call_macro(const Stmt& def, const std::shared_ptr<Frame>& closure, Args& args, const Value* caller);
};

}  // namespace moetron::jinja
