// The values a chat template computes with, with Python's semantics as Jinja2 gives them (what
// transformers' renderer does): None, bools, ints, floats, str (UTF-8; lengths, indices and slices
// count code points), lists and tuples, dicts (insertion-ordered, string keys), namespaces,
// callables, and Undefined (a missing name or key: prints as "", is false, iterates as empty).
// Containers are shared (Python's reference semantics); only namespaces change after creation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetron::jinja {

struct Value;
struct Array;
struct Object;
struct Callable;
class Interp;

enum class Kind : uint8_t { undefined, none, boolean, integer, floating, string, list, dict, callable };

struct Value {
  Kind kind = Kind::undefined;
  bool b = false;     // boolean; undefined: an unsafe attribute (the sandbox refuses any use but printing)
  bool safe = false;  // string: a Markup (|safe, |escape): "+" with it escapes the other operand
  int64_t i = 0;
  double f = 0;
  std::shared_ptr<const std::string> s;  // string; undefined: what was missing ("" when unknown)
  std::shared_ptr<Array> arr;            // list / tuple
  std::shared_ptr<Object> obj;           // dict / namespace / loop
  std::shared_ptr<Callable> fn;

  Value() = default;
  static Value undefined(std::string what = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value floating(double v);
  static Value string(std::string v);
  static Value list(std::vector<Value> items, bool tuple = false);
  static Value dict();  // empty
  static Value callable(std::shared_ptr<Callable> c);

  bool is_undefined() const { return kind == Kind::undefined; }
  bool is_none() const { return kind == Kind::none; }
  bool is_string() const { return kind == Kind::string; }
  bool is_number() const { return kind == Kind::integer || kind == Kind::floating || kind == Kind::boolean; }
  bool is_list() const { return kind == Kind::list; }
  bool is_dict() const { return kind == Kind::dict; }
  const std::string& str() const { return *s; }
  double as_double() const { return kind == Kind::floating ? f : kind == Kind::integer ? (double)i : (double)b; }

  // Python's type name ("str", "dict", "NoneType", ...), for error messages.
  const char* type_name() const;
};

struct Array {
  std::vector<Value> items;
  bool tuple = false;
  // A generator (what Jinja's map/select/... return): iterates once (then is empty), has no len(),
  // is always true, and is not JSON.
  bool generator = false;
  bool consumed = false;
  int depth = 1;  // levels of containers, this one included (bounded: kMaxValueDepth)
};

// Containers nest at most this deep (destroying, comparing and printing them recurse); deeper is an
// Error when built.
constexpr int kMaxValueDepth = 1000;
// The nesting of v: 0 for a scalar.
int nesting(const Value& v);

// Dict keys are strings; a key of another type (Jinja allows {512: 128}) is stored encoded by
// key_string() and read back by key_value().
std::string key_string(const Value& key);  // throws Error for an unhashable key
Value key_value(const std::string& stored);

enum class ObjectKind : uint8_t { dict, ns, loop };
struct Object {
  ObjectKind kind = ObjectKind::dict;
  std::vector<std::pair<std::string, Value>> items;  // insertion order
  int depth = 1;  // as Array's (set() keeps it; it never shrinks)
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(std::string_view key, Value v);  // replaces in place or appends
};

// Arguments of a call: positional then keyword.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* kwarg(std::string_view name) const;
};

struct Callable {
  std::string name;
  virtual ~Callable() = default;
  virtual Value call(Interp& in, Args& args) = 0;
};

// Truth value (Python's bool()): Undefined, None, False, 0, "", [], {} are false.
bool truthy(const Value& v);
// Python's == (1 == 1.0 == True; containers element-wise; Undefined equals only Undefined).
bool equal(const Value& a, const Value& b);
// Python's str() and repr() as Jinja prints them (Undefined -> "").
std::string to_str(const Value& v);
std::string repr(const Value& v);
void append_str(std::string& out, const Value& v);
// markupsafe's escape: & < > " ' as entities.
std::string html_escape(const std::string& s);
// Python's repr of a float ("1.0", "1e-05", "1e+20", "inf", "nan").
std::string float_repr(double v);
// Python's json.dumps(v, ensure_ascii, indent (<0: none; the indent string when indent_str is
// set), separators (empty: json.dumps's defaults), sort_keys).  Throws for values JSON cannot hold.
struct JsonStyle {
  bool ensure_ascii = false;
  bool pretty = false;
  std::string indent;  // per level, when pretty
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonStyle& style);

// JSON -> Value (objects keep their order; numbers stay ints when integral in the text).
Value from_json(const nlohmann::ordered_json& j);

// Digits (base 10 or 16, no sign) as an int64; nullopt when malformed or out of range (Python's ints
// are unbounded; moetron's stop at 64 bits).
std::optional<int64_t> parse_int64(std::string_view digits, int base = 10);

// Code point helpers for Python's str semantics over UTF-8 (invalid bytes count as one each).
std::vector<uint32_t> utf8_decode(std::string_view s);
void utf8_append(std::string& out, uint32_t cp);
size_t utf8_length(std::string_view s);
// Python's str.isspace() for one code point.
bool py_isspace(uint32_t cp);

}  // namespace moetron::jinja
