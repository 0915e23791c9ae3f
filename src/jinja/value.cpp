// Values with Python's semantics; see value.h.
#include "jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace moetron::jinja {

Value Value::undefined(std::string what) {
  Value v;
  v.kind = Kind::undefined;
  v.s = std::make_shared<const std::string>(std::move(what));
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::none;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::boolean;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::integer;
  v.i = x;
  return v;
}
Value Value::floating(double x) {
  Value v;
  v.kind = Kind::floating;
  v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::string;
  v.s = std::make_shared<const std::string>(std::move(x));
  return v;
}
int nesting(const Value& v) {
  if (v.kind == Kind::list) return v.arr->depth;
  if (v.kind == Kind::dict) return v.obj->depth;
  return 0;
}

namespace {
void check_depth(int depth) {
  if (depth > kMaxValueDepth) throw Error(fmt::format("a value nested more than {} levels deep", kMaxValueDepth));
}
}  // namespace

Value Value::list(std::vector<Value> items, bool tuple) {
  Value v;
  v.kind = Kind::list;
  v.arr = std::make_shared<Array>();
  int d = 0;
  for (const Value& x : items) d = std::max(d, nesting(x));
  check_depth(d + 1);
  v.arr->depth = d + 1;
  v.arr->items = std::move(items);
  v.arr->tuple = tuple;
  return v;
}
Value Value::dict() {
  Value v;
  v.kind = Kind::dict;
  v.obj = std::make_shared<Object>();
  return v;
}
Value Value::callable(std::shared_ptr<Callable> c) {
  Value v;
  v.kind = Kind::callable;
  v.fn = std::move(c);
  return v;
}

const char* Value::type_name() const {
  switch (kind) {
    case Kind::undefined: return "Undefined";
    case Kind::none: return "NoneType";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::floating: return "float";
    case Kind::string: return "str";
    case Kind::list: return arr->generator ? "generator" : arr->tuple ? "tuple" : "list";
    case Kind::dict: return obj->kind == ObjectKind::ns ? "Namespace" : obj->kind == ObjectKind::loop ? "LoopContext" : "dict";
    case Kind::callable: return "function";
  }
  return "object";
}

// Non-string keys: "\xff" (a byte UTF-8 text never holds) + a type letter + the value; Python's
// dict treats 1, 1.0 and True as one key, so integral numbers share the "i" form.
constexpr char kKeyTag = '\xff';

std::string key_string(const Value& key) {
  switch (key.kind) {
    case Kind::string: return *key.s;
    case Kind::none: return std::string(1, kKeyTag) + "n";
    case Kind::boolean: return std::string(1, kKeyTag) + "i" + std::to_string((int)key.b);
    case Kind::integer: return std::string(1, kKeyTag) + "i" + std::to_string(key.i);
    case Kind::floating:
      if (std::isfinite(key.f) && key.f == std::trunc(key.f) && std::fabs(key.f) < 9e18) return std::string(1, kKeyTag) + "i" + std::to_string((int64_t)key.f);
      return std::string(1, kKeyTag) + "f" + float_repr(key.f);
    default: throw Error(fmt::format("unhashable type: '{}'", key.type_name()));
  }
}

Value key_value(const std::string& k) {
  if (k.empty() || k[0] != kKeyTag) return Value::string(k);
  if (k.size() >= 2 && k[1] == 'i') return Value::integer(std::stoll(k.substr(2)));
  if (k.size() >= 2 && k[1] == 'f') return Value::floating(std::stod(k.substr(2)));
  return Value::none();
}

const Value* Object::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}
Value* Object::find(std::string_view key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}
void Object::set(std::string_view key, Value v) {
  check_depth(nesting(v) + 1);
  depth = std::max(depth, nesting(v) + 1);
  if (Value* p = find(key)) {
    *p = std::move(v);
    return;
  }
  items.emplace_back(std::string(key), std::move(v));
}

const Value* Args::kwarg(std::string_view name) const {
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
    case Kind::none: return false;
    case Kind::boolean: return v.b;
    case Kind::integer: return v.i != 0;
    case Kind::floating: return v.f != 0;
    case Kind::string: return !v.s->empty();
    case Kind::list: return v.arr->generator || !v.arr->items.empty();
    case Kind::dict: return v.obj->kind != ObjectKind::dict || !v.obj->items.empty();
    case Kind::callable: return true;
  }
  return false;
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Kind::floating && b.kind != Kind::floating) {
      const int64_t x = a.kind == Kind::integer ? a.i : a.b, y = b.kind == Kind::integer ? b.i : b.b;
      return x == y;
    }
    return a.as_double() == b.as_double();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::undefined:
    case Kind::none: return true;
    case Kind::string: return *a.s == *b.s;
    case Kind::list: {
      if (a.arr == b.arr) return true;
      if (a.arr->tuple != b.arr->tuple || a.arr->items.size() != b.arr->items.size()) return false;
      for (size_t k = 0; k < a.arr->items.size(); ++k)
        if (!equal(a.arr->items[k], b.arr->items[k])) return false;
      return true;
    }
    case Kind::dict: {
      if (a.obj == b.obj) return true;
      if (a.obj->kind != ObjectKind::dict || b.obj->kind != ObjectKind::dict) return false;
      if (a.obj->items.size() != b.obj->items.size()) return false;
      for (const auto& [k, v] : a.obj->items) {
        const Value* o = b.obj->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    }
    case Kind::callable: return a.fn == b.fn;
    default: return false;
  }
}

std::optional<int64_t> parse_int64(std::string_view digits, int base) {  // base 2, 8, 10 or 16
  int64_t v = 0;
  const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
  if (digits.empty() || r.ec != std::errc() || r.ptr != digits.data() + digits.size()) return std::nullopt;
  return v;
}

// ---- UTF-8 ----

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t k = 0; k < s.size();) {
    const unsigned char c = (unsigned char)s[k];
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || k + n > s.size()) {
      out.push_back(0xDC00 + c);  // an invalid byte: one unit (Python's surrogateescape)
      ++k;
      continue;
    }
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    bool ok = true;
    for (int j = 1; j < n; ++j) {
      const unsigned char d = (unsigned char)s[k + j];
      if ((d & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (!ok) {
      out.push_back(0xDC00 + c);
      ++k;
      continue;
    }
    out.push_back(cp);
    k += n;
  }
  return out;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp >= 0xDC80 && cp <= 0xDCFF)  // an invalid byte kept as it was
    out += (char)(cp - 0xDC00);
  else
    unicode::append_utf8(out, (char32_t)cp);
}

size_t utf8_length(std::string_view s) {
  bool ascii = true;
  for (char c : s)
    if ((unsigned char)c >= 0x80) ascii = false;
  return ascii ? s.size() : utf8_decode(s).size();
}

bool py_isspace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ---- printing ----

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // "-d.ddde+XX": the shortest digits that read back as v
  const bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  const size_t epos = sci.find('e');
  std::string digits = sci.substr(0, epos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(epos + 1));
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {  // Python's repr switches to exponent notation here
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return out + e;
  }
  if (exp < 0) return out + "0." + std::string(-exp - 1, '0') + digits;
  if ((int)digits.size() <= exp + 1) return out + digits + std::string(exp + 1 - digits.size(), '0') + ".0";
  return out + digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
}

namespace {

bool printable(uint32_t c) {
  if (c < 0x20 || c == 0x7F || (c >= 0x80 && c <= 0xA0) || c == 0xAD) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F))
    return false;
  if (c == 0x3000 || c == 0xFEFF || (c >= 0xD800 && c <= 0xF8FF) || (c >= 0xFFF9 && c <= 0xFFFB)) return false;
  if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x180E) return false;
  return c <= 0x10FFFF && (c & 0xFFFE) != 0xFFFE;
}

void append_str_repr(std::string& out, const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  out += q;
  for (uint32_t c : utf8_decode(s)) {
    if (c == (uint32_t)q || c == '\\') {
      out += '\\';
      out += (char)c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c >= 0xDC80 && c <= 0xDCFF) {
      char b[16];
      std::snprintf(b, sizeof b, "\\udc%02x", c - 0xDC00);
      out += b;
    } else if (!printable(c)) {
      char b[16];
      if (c < 0x100)
        std::snprintf(b, sizeof b, "\\x%02x", c);
      else if (c < 0x10000)
        std::snprintf(b, sizeof b, "\\u%04x", c);
      else
        std::snprintf(b, sizeof b, "\\U%08x", c);
      out += b;
    } else {
      utf8_append(out, c);
    }
  }
  out += q;
}

void append_repr(std::string& out, const Value& v, int depth);

void append_items_repr(std::string& out, const std::vector<std::pair<std::string, Value>>& items, int depth) {
  out += '{';
  bool first = true;
  for (const auto& [k, x] : items) {
    if (!first) out += ", ";
    first = false;
    append_repr(out, key_value(k), depth + 1);
    out += ": ";
    append_repr(out, x, depth + 1);
  }
  out += '}';
}

void append_repr(std::string& out, const Value& v, int depth) {
  if (depth > 200) throw Error("a value nested more than 200 levels deep cannot be printed");
  switch (v.kind) {
    case Kind::undefined: out += "Undefined"; return;
    case Kind::string: append_str_repr(out, *v.s); return;
    case Kind::list: {
      if (v.arr->generator) {
        out += "<generator object>";
        return;
      }
      const bool t = v.arr->tuple;
      out += t ? '(' : '[';
      for (size_t k = 0; k < v.arr->items.size(); ++k) {
        if (k) out += ", ";
        append_repr(out, v.arr->items[k], depth + 1);
      }
      if (t && v.arr->items.size() == 1) out += ',';
      out += t ? ')' : ']';
      return;
    }
    case Kind::dict:
      if (v.obj->kind == ObjectKind::ns) {
        out += "<Namespace ";
        append_items_repr(out, v.obj->items, depth);
        out += '>';
      } else if (v.obj->kind == ObjectKind::loop) {
        out += "<LoopContext>";
      } else {
        append_items_repr(out, v.obj->items, depth);
      }
      return;
    case Kind::callable: out += "<function " + v.fn->name + ">"; return;
    default: append_str(out, v);
  }
}

}  // namespace

void append_str(std::string& out, const Value& v) {
  switch (v.kind) {
    case Kind::undefined: return;
    case Kind::none: out += "None"; return;
    case Kind::boolean: out += v.b ? "True" : "False"; return;
    case Kind::integer: out += std::to_string(v.i); return;
    case Kind::floating: out += float_repr(v.f); return;
    case Kind::string: out += *v.s; return;
    default: append_repr(out, v, 0);
  }
}

std::string to_str(const Value& v) {
  if (v.kind == Kind::string) return *v.s;
  std::string out;
  append_str(out, v);
  return out;
}

std::string repr(const Value& v) {
  std::string out;
  append_repr(out, v, 0);
  return out;
}

// ---- JSON ----

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (uint32_t c : utf8_decode(s)) {
    char b[16];
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
      if (c >= 0x10000) {
        const uint32_t u = c - 0x10000;
        std::snprintf(b, sizeof b, "\\u%04x\\u%04x", 0xD800 + (u >> 10), 0xDC00 + (u & 0x3FF));
      } else {
        std::snprintf(b, sizeof b, "\\u%04x", c);
      }
      out += b;
    } else {
      utf8_append(out, c);
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, const JsonStyle& st, int level) {
  if (level > 200) throw Error("tojson: a value nested more than 200 levels deep");
  const auto newline = [&](int lv) {
    out += '\n';
    for (int k = 0; k < lv; ++k) out += st.indent;
  };
  switch (v.kind) {
    case Kind::none: out += "null"; return;
    case Kind::boolean: out += v.b ? "true" : "false"; return;
    case Kind::integer: out += std::to_string(v.i); return;
    case Kind::floating:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f < 0 ? "-Infinity" : "Infinity";
      else
        out += float_repr(v.f);
      return;
    case Kind::string: json_string(out, *v.s, st.ensure_ascii); return;
    case Kind::list: {
      if (v.arr->generator) break;
      const auto& items = v.arr->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += st.item_sep;
        if (st.pretty) newline(level + 1);
        json_value(out, items[k], st, level + 1);
      }
      if (st.pretty) newline(level);
      out += ']';
      return;
    }
    case Kind::dict: {
      if (v.obj->kind != ObjectKind::dict) break;
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.obj->items) items.push_back(&kv);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += st.item_sep;
        if (st.pretty) newline(level + 1);
        const Value key = key_value(items[k]->first);
        if (key.is_string())
          json_string(out, key.str(), st.ensure_ascii);
        else  // json.dumps writes numbers, None and booleans as strings
          json_string(out, key.is_none() ? "null" : key.kind == Kind::floating ? float_repr(key.f) : std::to_string(key.i), st.ensure_ascii);
        out += st.key_sep;
        json_value(out, items[k]->second, st, level + 1);
      }
      if (st.pretty) newline(level);
      out += '}';
      return;
    }
    default: break;
  }
  throw Error(fmt::format("tojson: Object of type {} is not JSON serializable", v.type_name()));
}

}  // namespace

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_value(out, v, style, 0);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  using T = nlohmann::ordered_json::value_t;
  switch (j.type()) {
    case T::null: return Value::none();
    case T::boolean: return Value::boolean(j.get<bool>());
    case T::number_integer: return Value::integer(j.get<int64_t>());
    case T::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u <= (uint64_t)INT64_MAX ? Value::integer((int64_t)u) : Value::floating((double)u);
    }
    case T::number_float: return Value::floating(j.get<double>());
    case T::string: return Value::string(j.get<std::string>());
    case T::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(from_json(x));
      return Value::list(std::move(items));
    }
    case T::object: {
      Value d = Value::dict();
      d.obj->items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        d.obj->items.emplace_back(it.key(), from_json(it.value()));
        d.obj->depth = std::max(d.obj->depth, nesting(d.obj->items.back().second) + 1);
      }
      check_depth(d.obj->depth);
      return d;
    }
    default: return Value::none();
  }
}

}  // namespace moetron::jinja
