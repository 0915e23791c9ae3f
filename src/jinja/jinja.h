// A Jinja2 interpreter for chat templates: the subset real model templates use, rendering exactly as
// transformers' apply_chat_template does (Jinja2 3.1 in an immutable sandbox with trim_blocks,
// lstrip_blocks, loop controls, {% generation %}, and transformers' globals raise_exception,
// strftime_now, namespace, dict and its tojson filter).
//
// Rooms: value.{h,cpp} (Python values), lexer.cpp and parser.cpp (text -> ast.h), interp.cpp (the
// tree walk, scopes, limits), builtins.cpp (filters, tests, methods, globals).
//
// Hostile templates: every error is a TemplateError naming the template's line and column; parsing
// bounds nesting, rendering bounds call depth, loop iterations and output (RenderLimits), so a
// template cannot run away with time or memory.
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "jinja/value.h"

namespace moetron::jinja {

struct Program;

enum class ErrorKind : uint8_t { syntax, undefined, type, security, raised, limit };

class TemplateError : public Error {
 public:
  TemplateError(ErrorKind kind, const std::string& what, std::string message)
      : Error(what), kind_(kind), message_(std::move(message)) {}
  ErrorKind kind() const { return kind_; }
  // The message without the location (raise_exception's argument for ErrorKind::raised).
  const std::string& message() const { return message_; }

 private:
  ErrorKind kind_;
  std::string message_;
};

struct RenderLimits {
  size_t max_output = 64u << 20;          // bytes of any string built, the output included
  size_t max_iterations = 10'000'000;     // loop iterations and list elements built, in all
  int max_depth = 200;                    // nested macro calls and evaluation depth
};

struct RenderOptions {
  RenderLimits limits;
  std::optional<std::tm> now;  // what strftime_now() formats (unset: the local time)
};

// Byte ranges of the output rendered inside {% generation %} blocks.
using Spans = std::vector<std::pair<size_t, size_t>>;

class Template {
 public:
  // Parses `source`; `name` is used in error messages.  Throws TemplateError (ErrorKind::syntax).
  Template(const std::string& source, std::string name);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the variables of `context` (a dict).  Throws TemplateError.
  std::string render(const Value& context, const RenderOptions& opts = {}, Spans* generation = nullptr) const;

  const std::string& name() const;
  const std::string& source() const { return source_; }
  // Whether the template has {% generation %} blocks.
  bool has_generation() const { return has_generation_; }

 private:
  std::unique_ptr<Program> prog_;
  std::string source_;
  bool has_generation_ = false;
};

}  // namespace moetron::jinja
