// Jinja's filters and tests, Python's str/dict/list methods, and transformers' globals; see builtins.h.
// Each follows Jinja 3.1 / CPython: the same results, the same errors (types of), generators where
// Jinja returns generators (map, select, reject, selectattr, rejectattr, unique, reverse of a list).
#include "jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>

#include "jinja/interp.h"

namespace moetron::jinja {

using FilterFn = Value (*)(Interp&, const Value&, Args&);
using TestFn = bool (*)(Interp&, const Value&, Args&);
struct Filter {
  const char* name;
  FilterFn fn;
};
struct Test {
  const char* name;
  TestFn fn;
};

namespace {

// ---- argument helpers ----

// A float truncated to an int64 (Python's int(x)); nullopt when not finite or beyond 64 bits.
std::optional<int64_t> trunc_int64(double x) {
  if (!std::isfinite(x) || std::fabs(x) >= 9.2e18) return std::nullopt;
  return (int64_t)std::trunc(x);
}

// Positional k (counting after the operand) or keyword `name`; null when absent.
const Value* arg(const Args& a, size_t k, const char* name) {
  if (k < a.pos.size()) return &a.pos[k];
  return a.kwarg(name);
}
bool arg_bool(const Args& a, size_t k, const char* name, bool def) {
  const Value* v = arg(a, k, name);
  return v ? truthy(*v) : def;
}
std::string arg_str(Interp& in, const Args& a, size_t k, const char* name, const std::string& def) {
  const Value* v = arg(a, k, name);
  if (!v || v->is_none()) return def;
  if (!v->is_string()) in.type_error(fmt::format("argument '{}' must be a string, not {}", name, v->type_name()));
  return v->str();
}

Value gen(std::vector<Value> items) {
  Value v = Value::list(std::move(items));
  v.arr->generator = true;
  return v;
}

// ---- Python string helpers (code points) ----

std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = (char)(c - 'A' + 'a');
  return s;
}
std::string ascii_upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = (char)(c - 'a' + 'A');
  return s;
}
bool is_alpha_cp(uint32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= 0xC0 && c != 0xD7 && c != 0xF7 && !py_isspace(c)); }

std::string encode(const std::vector<uint32_t>& cps, size_t from = 0, size_t to = std::string::npos) {
  std::string out;
  to = std::min(to, cps.size());
  for (size_t k = from; k < to; ++k) utf8_append(out, cps[k]);
  return out;
}

// Python's str.strip family: `chars` null strips whitespace.
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  const std::vector<uint32_t> cps = utf8_decode(s);
  std::vector<uint32_t> set;
  if (chars) set = utf8_decode(*chars);
  const auto strip = [&](uint32_t c) { return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c); };
  size_t a = 0, b = cps.size();
  if (left)
    while (a < b && strip(cps[a])) ++a;
  if (right)
    while (b > a && strip(cps[b - 1])) --b;
  return encode(cps, a, b);
}

std::vector<Value> py_split(Interp& in, const std::string& s, const Value* sepv, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (!sepv || sepv->is_none()) {
    // Runs of whitespace; empty strings dropped.
    const std::vector<uint32_t> cps = utf8_decode(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t k = 0;
    while (k < cps.size()) {
      while (k < cps.size() && py_isspace(cps[k])) ++k;
      if (k >= cps.size()) break;
      size_t e = k;
      while (e < cps.size() && !py_isspace(cps[e])) ++e;
      words.emplace_back(k, e);
      k = e;
    }
    if (maxsplit < 0 || (size_t)maxsplit >= words.size()) {
      for (auto [a, b] : words) parts.push_back(encode(cps, a, b));
    } else if (!from_right) {
      for (int64_t w = 0; w < maxsplit; ++w) parts.push_back(encode(cps, words[w].first, words[w].second));
      size_t rest = words[(size_t)maxsplit].first, end = cps.size();
      while (end > rest && py_isspace(cps[end - 1])) --end;
      parts.push_back(encode(cps, rest, end));
    } else {
      const size_t first = words.size() - (size_t)maxsplit;
      size_t start = 0, end = words[first - 1].second;
      while (start < end && py_isspace(cps[start])) ++start;
      parts.push_back(encode(cps, start, end));
      for (size_t w = first; w < words.size(); ++w) parts.push_back(encode(cps, words[w].first, words[w].second));
    }
  } else {
    if (!sepv->is_string()) in.type_error(fmt::format("must be str or None, not {}", sepv->type_name()));
    const std::string& sep = sepv->str();
    if (sep.empty()) in.type_error("empty separator");
    std::vector<size_t> cuts;
    for (size_t p = s.find(sep); p != std::string::npos; p = s.find(sep, p + sep.size())) cuts.push_back(p);
    if (maxsplit >= 0 && (size_t)maxsplit < cuts.size()) {
      if (from_right)
        cuts.erase(cuts.begin(), cuts.end() - maxsplit);
      else
        cuts.resize((size_t)maxsplit);
    }
    size_t prev = 0;
    for (size_t c : cuts) {
      parts.push_back(s.substr(prev, c - prev));
      prev = c + sep.size();
    }
    parts.push_back(s.substr(prev));
  }
  in.tick(parts.size());
  std::vector<Value> out;
  out.reserve(parts.size());
  for (auto& p : parts) out.push_back(Value::string(std::move(p)));
  return out;
}

std::string py_replace(Interp& in, const std::string& s, const std::string& old, const std::string& neu, int64_t count) {
  std::string out;
  if (old.empty()) {  // inserts `neu` before every code point and at the end
    const std::vector<uint32_t> cps = utf8_decode(s);
    int64_t n = 0;
    for (uint32_t c : cps) {
      if (count < 0 || n < count) {
        out += neu;
        ++n;
      }
      utf8_append(out, c);
      in.check_size(out.size());
    }
    if (count < 0 || n < count) out += neu;
    return out;
  }
  size_t prev = 0;
  int64_t n = 0;
  for (size_t p = s.find(old); p != std::string::npos && (count < 0 || n < count); p = s.find(old, prev)) {
    out.append(s, prev, p - prev);
    out += neu;
    prev = p + old.size();
    ++n;
    in.check_size(out.size());
  }
  out.append(s, prev, std::string::npos);
  in.check_size(out.size());
  return out;
}

// Python's str.splitlines().
std::vector<std::string> splitlines(const std::string& s, bool keepends) {
  const std::vector<uint32_t> cps = utf8_decode(s);
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t k = 0; k < cps.size(); ++k) {
    const uint32_t c = cps[k];
    const bool br = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
                    c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) continue;
    size_t end = k + 1;
    if (c == '\r' && k + 1 < cps.size() && cps[k + 1] == '\n') end = k + 2;
    out.push_back(encode(cps, start, keepends ? end : k));
    start = end;
    k = end - 1;
  }
  if (start < cps.size()) out.push_back(encode(cps, start));
  return out;
}

// printf-style formatting (the format filter and str % args).
std::string printf_format(Interp& in, const std::string& f, const std::vector<Value>& args, const Value* mapping) {
  std::string out;
  size_t ai = 0;
  for (size_t k = 0; k < f.size(); ++k) {
    if (f[k] != '%') {
      out += f[k];
      continue;
    }
    if (++k >= f.size()) in.type_error("incomplete format");
    std::string key;
    if (f[k] == '(') {
      const size_t e = f.find(')', k);
      if (e == std::string::npos) in.type_error("incomplete format key");
      key = f.substr(k + 1, e - k - 1);
      k = e + 1;
    }
    std::string spec;
    while (k < f.size() && std::string("-+ #0123456789.").find(f[k]) != std::string::npos) spec += f[k++];
    if (k >= f.size()) in.type_error("incomplete format");
    const char conv = f[k];
    if (conv == '%') {
      out += '%';
      continue;
    }
    Value v;
    if (!key.empty()) {
      if (!mapping || !mapping->is_dict()) in.type_error("format requires a mapping");
      const Value* x = mapping->obj->find(key);
      if (!x) in.type_error(fmt::format("KeyError: '{}'", key));
      v = *x;
    } else {
      if (ai >= args.size()) in.type_error("not enough arguments for format string");
      v = args[ai++];
    }
    char buf[128];
    std::string cspec = "%" + spec;
    switch (conv) {
      case 's': out += to_str(v); break;
      case 'r': out += repr(v); break;
      case 'd':
      case 'i':
      case 'u':
        if (!v.is_number()) in.type_error(fmt::format("%{} format: a real number is required, not {}", conv, v.type_name()));
        if (v.kind == Kind::floating && !trunc_int64(v.f)) in.type_error("%d format: the number is beyond 64 bits");
        std::snprintf(buf, sizeof buf, (cspec + "lld").c_str(), (long long)(v.kind == Kind::floating ? *trunc_int64(v.f) : v.kind == Kind::integer ? v.i : v.b));
        out += buf;
        break;
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G':
        if (!v.is_number()) in.type_error(fmt::format("must be real number, not {}", v.type_name()));
        std::snprintf(buf, sizeof buf, (cspec + conv).c_str(), v.as_double());
        out += buf;
        break;
      case 'x':
      case 'X':
      case 'o':
        if (v.kind != Kind::integer && v.kind != Kind::boolean) in.type_error(fmt::format("%{} format: an integer is required", conv));
        std::snprintf(buf, sizeof buf, (cspec + "ll" + conv).c_str(), (long long)(v.kind == Kind::integer ? v.i : v.b));
        out += buf;
        break;
      default: in.type_error(fmt::format("unsupported format character '{}'", conv));
    }
    in.check_size(out.size());
  }
  if (ai < args.size() && !mapping) in.type_error("not all arguments converted during string formatting");
  return out;
}

// Python's str.format: {} {0} {name} {name[key]} {name.attr}, !r / !s, {{ }}; no format specs.
std::string str_format(Interp& in, const std::string& f, Args& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t k = 0; k < f.size(); ++k) {
    const char c = f[k];
    if (c == '}') {
      if (k + 1 < f.size() && f[k + 1] == '}') {
        out += '}';
        ++k;
        continue;
      }
      in.type_error("Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (k + 1 < f.size() && f[k + 1] == '{') {
      out += '{';
      ++k;
      continue;
    }
    const size_t e = f.find('}', k);
    if (e == std::string::npos) in.type_error("Single '{' encountered in format string");
    std::string field = f.substr(k + 1, e - k - 1);
    k = e;
    char conv = 0;
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conv = bang + 1 < field.size() ? field[bang + 1] : 0;
      field.resize(bang);
    }
    if (field.find(':') != std::string::npos) in.type_error("format specs in str.format are not supported");
    // The first name, then .attr / [key] parts.
    size_t p = 0;
    while (p < field.size() && field[p] != '.' && field[p] != '[') ++p;
    const std::string head = field.substr(0, p);
    Value v;
    if (head.empty()) {
      if (auto_index >= a.pos.size()) in.type_error("Replacement index out of range for positional args tuple");
      v = a.pos[auto_index++];
    } else if (std::all_of(head.begin(), head.end(), ::isdigit)) {
      const auto i = parse_int64(head);
      if (!i || *i >= (int64_t)a.pos.size()) in.type_error("Replacement index out of range for positional args tuple");
      v = a.pos[(size_t)*i];
    } else {
      const Value* kw = a.kwarg(head);
      if (!kw) in.type_error(fmt::format("KeyError: '{}'", head));
      v = *kw;
    }
    while (p < field.size()) {
      if (field[p] == '.') {
        size_t q = p + 1;
        while (q < field.size() && field[q] != '.' && field[q] != '[') ++q;
        v = in.getattr(v, field.substr(p + 1, q - p - 1));
        p = q;
      } else {
        const size_t q = field.find(']', p);
        if (q == std::string::npos) in.type_error("Missing ']' in format string");
        const std::string key = field.substr(p + 1, q - p - 1);
        const auto idx = parse_int64(key);  // digits: an index (too large: nothing there)
        v = idx ? in.getitem(v, Value::integer(*idx))
                : !key.empty() && std::all_of(key.begin(), key.end(), ::isdigit) ? Value::undefined("index out of range")
                                                                                 : in.getitem(v, Value::string(key));
        p = q + 1;
      }
    }
    out += conv == 'r' ? repr(v) : to_str(v);
    in.check_size(out.size());
  }
  return out;
}

// ---- attribute paths (map, selectattr, sort, ...): "a.b.0" read with getitem per part ----

Value attr_path(Interp& in, const Value& item, const std::string& path) {
  Value v = item;
  size_t p = 0;
  while (true) {
    const size_t q = path.find('.', p);
    const std::string part = path.substr(p, q == std::string::npos ? std::string::npos : q - p);
    const bool num = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    const auto idx = num ? parse_int64(part) : std::nullopt;
    v = idx ? in.getitem(v, Value::integer(*idx)) : num ? Value::undefined("index out of range") : in.getitem(v, Value::string(part));
    if (q == std::string::npos) return v;
    p = q + 1;
  }
}

// ---- filters ----

Value f_abs(Interp& in, const Value& v, Args&) {
  if (v.kind == Kind::integer) return v.i == INT64_MIN ? Value::floating(-(double)v.i) : Value::integer(v.i < 0 ? -v.i : v.i);
  if (v.kind == Kind::boolean) return Value::integer(v.b);
  if (v.kind == Kind::floating) return Value::floating(std::fabs(v.f));
  in.type_error(fmt::format("bad operand type for abs(): '{}'", v.type_name()));
}
Value f_attr(Interp& in, const Value& v, Args& a) { return in.getattr(v, arg_str(in, a, 0, "name", "")); }
Value f_capitalize(Interp&, const Value& v, Args&) {
  const std::string s = to_str(v);
  if (s.empty()) return Value::string(s);
  return Value::string(ascii_upper(s.substr(0, 1)) + ascii_lower(s.substr(1)));
}
Value f_center(Interp& in, const Value& v, Args& a) {
  const Value* w = arg(a, 0, "width");
  const int64_t width = w && w->kind == Kind::integer ? w->i : 80;
  const std::string s = to_str(v);
  const int64_t n = (int64_t)utf8_length(s);
  if (width <= n) return Value::string(s);
  in.check_size((size_t)width);
  const int64_t pad = width - n, left = pad / 2 + (pad & width & 1);
  return Value::string(std::string((size_t)left, ' ') + s + std::string((size_t)(pad - left), ' '));
}
Value f_default(Interp&, const Value& v, Args& a) {
  const Value* d = arg(a, 0, "default_value");
  const bool boolean = arg_bool(a, 1, "boolean", false);
  if (v.is_undefined() || (boolean && !truthy(v))) return d ? *d : Value::string("");
  return v;
}
Value f_dictsort(Interp& in, const Value& v, Args& a) {
  if (!v.is_dict()) in.type_error("dictsort: can only sort a mapping");
  const bool cs = arg_bool(a, 0, "case_sensitive", false);
  const std::string by = arg_str(in, a, 1, "by", "key");
  const bool rev = arg_bool(a, 2, "reverse", false);
  if (by != "key" && by != "value") in.type_error("You can only sort by either 'key' or 'value'");
  std::vector<Value> items;
  for (const auto& [k, x] : v.obj->items) items.push_back(Value::list({key_value(k), x}, true));
  const auto key = [&](const Value& t) {
    const Value& x = t.arr->items[by == "key" ? 0 : 1];
    return !cs && x.is_string() ? Value::string(ascii_lower(x.str())) : x;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& p, const Value& q) {
    return rev ? less(in, key(q), key(p)) : less(in, key(p), key(q));
  });
  return Value::list(std::move(items));
}
Value f_escape(Interp&, const Value& v, Args&) {
  if (v.is_string() && v.safe) return v;
  Value r = Value::string(html_escape(to_str(v)));
  r.safe = true;
  return r;
}
Value f_first(Interp& in, const Value& v, Args&) {
  std::vector<Value> items = iterate(in, v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}
Value f_last(Interp& in, const Value& v, Args&) {
  if (v.is_list() && v.arr->generator) in.type_error("'generator' object is not reversible");
  if (v.is_dict()) in.type_error("'dict' object is not reversible");
  std::vector<Value> items = iterate(in, v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}
std::optional<double> parse_float(const std::string& s) {
  const std::string t = py_strip(s, nullptr, true, true);
  if (t.empty()) return std::nullopt;
  std::string c;
  for (char ch : t)
    if (ch != '_') c += ch;
  try {
    size_t used = 0;
    const double d = std::stod(c, &used);
    if (used != c.size()) return std::nullopt;
    return d;
  } catch (...) {
    return std::nullopt;
  }
}
Value f_float(Interp&, const Value& v, Args& a) {
  const Value* d = arg(a, 0, "default");
  const Value def = d ? *d : Value::floating(0.0);
  if (v.is_number()) return Value::floating(v.as_double());
  if (v.is_string())
    if (auto f = parse_float(v.str())) return Value::floating(*f);
  return def;
}
Value f_format(Interp& in, const Value& v, Args& a) {
  if (!a.kw.empty() && !a.pos.empty()) in.type_error("can't handle positional and keyword arguments at the same time");
  Value mapping = Value::dict();
  for (const auto& [k, x] : a.kw) mapping.obj->set(k, x);
  return Value::string(printf_format(in, to_str(v), a.pos, a.kw.empty() ? nullptr : &mapping));
}
Value f_indent(Interp& in, const Value& v, Args& a) {
  const Value* w = arg(a, 0, "width");
  std::string ind = "    ";
  if (w && w->is_string())
    ind = w->str();
  else if (w && (w->kind == Kind::integer || w->kind == Kind::boolean))
    ind = std::string((size_t)std::max<int64_t>(0, std::min<int64_t>(w->kind == Kind::integer ? w->i : w->b, 1 << 20)), ' ');
  const bool first = arg_bool(a, 1, "first", false), blank = arg_bool(a, 2, "blank", false);
  std::string s = to_str(v) + "\n";  // Jinja's quirk: a final newline before splitlines
  std::vector<std::string> lines = splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + ind : "") + lines[k];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t k = 1; k < lines.size(); ++k) {
      rv += "\n";
      if (!lines[k].empty()) rv += ind;
      rv += lines[k];
      in.check_size(rv.size());
    }
  }
  if (first) rv = ind + rv;
  in.check_size(rv.size());
  return Value::string(std::move(rv));
}
Value f_int(Interp&, const Value& v, Args& a) {
  const Value* d = arg(a, 0, "default");
  const Value def = d ? *d : Value::integer(0);
  const Value* b = arg(a, 1, "base");
  const int base = b && b->kind == Kind::integer ? (int)b->i : 10;
  if (v.kind == Kind::integer) return v;
  if (v.kind == Kind::boolean) return Value::integer(v.b);
  if (v.kind == Kind::floating) return trunc_int64(v.f) ? Value::integer(*trunc_int64(v.f)) : def;
  if (v.is_string()) {
    std::string t = py_strip(v.str(), nullptr, true, true), c;
    for (char ch : t)
      if (ch != '_') c += ch;
    try {
      size_t used = 0;
      const long long x = std::stoll(c, &used, base);
      if (used == c.size() && !c.empty()) return Value::integer(x);
    } catch (...) {
    }
    if (auto f = parse_float(v.str())) return trunc_int64(*f) ? Value::integer(*trunc_int64(*f)) : def;
  }
  return def;
}
Value f_items(Interp& in, const Value& v, Args&) {
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict() || v.obj->kind != ObjectKind::dict) in.type_error("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, x] : v.obj->items) out.push_back(Value::list({key_value(k), x}, true));
  return Value::list(std::move(out));
}
Value f_join(Interp& in, const Value& v, Args& a) {
  const std::string d = arg_str(in, a, 0, "d", "");
  const Value* attr = arg(a, 1, "attribute");
  std::string out;
  bool first = true;
  for (const Value& x : iterate(in, v)) {
    if (!first) out += d;
    first = false;
    append_str(out, attr && !attr->is_none() ? attr_path(in, x, to_str(*attr)) : x);
    in.check_size(out.size());
  }
  return Value::string(std::move(out));
}
Value f_length(Interp& in, const Value& v, Args&) { return Value::integer(length(in, v)); }
Value f_list(Interp& in, const Value& v, Args&) { return Value::list(iterate(in, v)); }
Value f_lower(Interp&, const Value& v, Args&) { return Value::string(ascii_lower(to_str(v))); }
Value f_upper(Interp&, const Value& v, Args&) { return Value::string(ascii_upper(to_str(v))); }

// select/reject/selectattr/rejectattr/map share the "test or filter by name + arguments" call.
Args rest_args(const Args& a, size_t from) {
  Args r;
  for (size_t k = from; k < a.pos.size(); ++k) r.pos.push_back(a.pos[k]);
  r.kw = a.kw;
  return r;
}
Value select_like(Interp& in, const Value& v, Args& a, bool attr, bool keep) {
  std::string attribute;
  size_t k = 0;
  if (attr) {
    if (a.pos.empty()) in.type_error("selectattr/rejectattr need an attribute name");
    attribute = to_str(a.pos[0]);
    k = 1;
  }
  const Test* t = nullptr;
  if (k < a.pos.size()) {
    const std::string name = to_str(a.pos[k]);
    t = find_test(name);
    if (!t) in.type_error(fmt::format("No test named '{}'.", name));
    ++k;
  }
  Args targs = rest_args(a, k);
  targs.kw.clear();
  std::vector<Value> out;
  if (!truthy(v)) return gen({});  // Jinja: "if value:" first
  for (const Value& x : iterate(in, v)) {
    const Value item = attr ? attr_path(in, x, attribute) : x;
    Args ta = targs;
    const bool ok = t ? apply_test(in, t, item, ta) : truthy(item);
    if (ok == keep) out.push_back(x);
  }
  return gen(std::move(out));
}
Value f_select(Interp& in, const Value& v, Args& a) { return select_like(in, v, a, false, true); }
Value f_reject(Interp& in, const Value& v, Args& a) { return select_like(in, v, a, false, false); }
Value f_selectattr(Interp& in, const Value& v, Args& a) { return select_like(in, v, a, true, true); }
Value f_rejectattr(Interp& in, const Value& v, Args& a) { return select_like(in, v, a, true, false); }
Value f_map(Interp& in, const Value& v, Args& a) {
  std::vector<Value> out;
  if (!truthy(v)) return gen({});  // Jinja: "if value:" first
  if (const Value* at = a.kwarg("attribute"); at && a.pos.empty()) {
    const Value* def = a.kwarg("default");
    for (const Value& x : iterate(in, v)) {
      Value r = attr_path(in, x, to_str(*at));
      if (r.is_undefined() && def) r = *def;
      out.push_back(r);
    }
    return gen(std::move(out));
  }
  if (a.pos.empty()) in.type_error("map requires a filter argument");
  const std::string name = to_str(a.pos[0]);
  const Filter* f = find_filter(name);
  if (!f) in.type_error(fmt::format("No filter named '{}'.", name));
  const Args fa = rest_args(a, 1);
  for (const Value& x : iterate(in, v)) {
    Args c = fa;
    out.push_back(apply_filter(in, f, x, c));
  }
  return gen(std::move(out));
}
Value minmax(Interp& in, const Value& v, Args& a, bool max) {
  const bool cs = arg_bool(a, 0, "case_sensitive", false);
  const Value* at = arg(a, 1, "attribute");
  std::vector<Value> items = iterate(in, v);
  if (items.empty()) return Value::undefined(fmt::format("No aggregated item, sequence was empty."));
  const auto key = [&](const Value& x) {
    Value k = at && !at->is_none() ? attr_path(in, x, to_str(*at)) : x;
    return !cs && k.is_string() ? Value::string(ascii_lower(k.str())) : k;
  };
  size_t best = 0;
  for (size_t k = 1; k < items.size(); ++k)
    if (max ? less(in, key(items[best]), key(items[k])) : less(in, key(items[k]), key(items[best]))) best = k;
  return items[best];
}
Value f_max(Interp& in, const Value& v, Args& a) { return minmax(in, v, a, true); }
Value f_min(Interp& in, const Value& v, Args& a) { return minmax(in, v, a, false); }
Value f_replace(Interp& in, const Value& v, Args& a) {
  const Value* c = arg(a, 2, "count");
  return Value::string(py_replace(in, to_str(v), arg_str(in, a, 0, "old", ""), arg_str(in, a, 1, "new", ""),
                                  c && c->kind == Kind::integer ? c->i : -1));
}
Value f_reverse(Interp& in, const Value& v, Args&) {
  if (v.is_string()) {
    std::vector<uint32_t> cps = utf8_decode(v.str());
    std::reverse(cps.begin(), cps.end());
    return Value::string(encode(cps));
  }
  std::vector<Value> items = iterate(in, v);
  std::reverse(items.begin(), items.end());
  return gen(std::move(items));
}
Value f_round(Interp& in, const Value& v, Args& a) {
  const Value* p = arg(a, 0, "precision");
  const int64_t prec = p && p->kind == Kind::integer ? p->i : 0;
  const std::string method = arg_str(in, a, 1, "method", "common");
  if (!v.is_number()) in.type_error(fmt::format("type {} doesn't define __round__ method", v.type_name()));
  if (method == "common" && v.kind != Kind::floating) {  // Python's round(int, n): an int, half to even
    const int64_t x = v.kind == Kind::integer ? v.i : v.b;
    if (prec >= 0) return Value::integer(x);
    if (prec < -18) return Value::integer(0);
    int64_t f = 1;
    for (int64_t k = 0; k < -prec; ++k) f *= 10;
    int64_t q = x / f, r = x % f;
    if (r < 0) {  // floor division
      --q;
      r += f;
    }
    if (2 * r > f || (2 * r == f && (q & 1))) ++q;
    int64_t out;
    if (!__builtin_mul_overflow(q, f, &out)) return Value::integer(out);
  }
  const double scale = std::pow(10.0, (double)prec), x = v.as_double() * scale;
  double r;
  if (method == "common") {
    r = std::nearbyint(x);  // Python's round: half to even
  } else if (method == "ceil") {
    r = std::ceil(x);
  } else if (method == "floor") {
    r = std::floor(x);
  } else {
    in.type_error("method must be common, ceil or floor");
  }
  return Value::floating(r / scale);
}
Value f_safe(Interp&, const Value& v, Args&) {
  Value r = Value::string(to_str(v));
  r.safe = true;
  return r;
}
Value f_sort(Interp& in, const Value& v, Args& a) {
  const bool rev = arg_bool(a, 0, "reverse", false), cs = arg_bool(a, 1, "case_sensitive", false);
  const Value* at = arg(a, 2, "attribute");
  std::vector<Value> items = iterate(in, v);
  const auto key = [&](const Value& x) {
    Value k = at && !at->is_none() ? attr_path(in, x, to_str(*at)) : x;
    return !cs && k.is_string() ? Value::string(ascii_lower(k.str())) : k;
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Value& p, const Value& q) { return rev ? less(in, key(q), key(p)) : less(in, key(p), key(q)); });
  return Value::list(std::move(items));
}
Value f_string(Interp&, const Value& v, Args&) {
  if (v.is_string()) return v;  // a Markup stays one
  return Value::string(to_str(v));
}
Value f_sum(Interp& in, const Value& v, Args& a) {
  const Value* at = arg(a, 0, "attribute");
  const Value* st = arg(a, 1, "start");
  Value acc = st ? *st : Value::integer(0);
  for (const Value& x : iterate(in, v)) {
    const Value y = at && !at->is_none() ? attr_path(in, x, to_str(*at)) : x;
    if (!acc.is_number() || !y.is_number()) in.type_error(fmt::format("unsupported operand type(s) for +: '{}' and '{}'", acc.type_name(), y.type_name()));
    if (acc.kind != Kind::floating && y.kind != Kind::floating)
      acc = Value::integer((acc.kind == Kind::integer ? acc.i : acc.b) + (y.kind == Kind::integer ? y.i : y.b));
    else
      acc = Value::floating(acc.as_double() + y.as_double());
  }
  return acc;
}
Value f_title(Interp&, const Value& v, Args&) {
  // Jinja: words start after "-", whitespace, "(", "{", "[", "<".
  const std::vector<uint32_t> cps = utf8_decode(to_str(v));
  std::string out;
  bool start = true;
  for (uint32_t c : cps) {
    const bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
    uint32_t x = c;
    if (!sep) {
      if (start && x >= 'a' && x <= 'z') x -= 32;
      if (!start && x >= 'A' && x <= 'Z') x += 32;
    }
    utf8_append(out, x);
    start = sep;
  }
  return Value::string(std::move(out));
}
Value f_tojson(Interp& in, const Value& v, Args& a) {
  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
  JsonStyle st;
  st.ensure_ascii = arg_bool(a, 0, "ensure_ascii", false);
  const Value* ind = arg(a, 1, "indent");
  if (ind && !ind->is_none()) {
    st.pretty = true;
    st.item_sep = ",";
    if (ind->is_string())
      st.indent = ind->str();
    else if (ind->kind == Kind::integer || ind->kind == Kind::boolean)
      st.indent = std::string((size_t)std::max<int64_t>(0, std::min<int64_t>(ind->kind == Kind::integer ? ind->i : ind->b, 1 << 16)), ' ');
    else
      in.type_error("tojson: indent must be an int or a string");
  }
  const Value* sep = arg(a, 2, "separators");
  if (sep && !sep->is_none()) {
    if (!sep->is_list() || sep->arr->items.size() != 2 || !sep->arr->items[0].is_string() || !sep->arr->items[1].is_string())
      in.type_error("tojson: separators must be a pair of strings");
    st.item_sep = sep->arr->items[0].str();
    st.key_sep = sep->arr->items[1].str();
  }
  st.sort_keys = arg_bool(a, 3, "sort_keys", false);
  try {
    std::string s = to_json(v, st);
    in.check_size(s.size());
    return Value::string(std::move(s));
  } catch (const TemplateError&) {
    throw;
  } catch (const Error& e) {
    in.type_error(e.what());
  }
}
Value f_trim(Interp& in, const Value& v, Args& a) {
  const Value* c = arg(a, 0, "chars");
  if (c && !c->is_none() && !c->is_string()) in.type_error("trim: chars must be a string");
  Value r = Value::string(py_strip(to_str(v), c && c->is_string() ? &c->str() : nullptr, true, true));
  r.safe = v.is_string() && v.safe;
  return r;
}
Value f_truncate(Interp& in, const Value& v, Args& a) {
  const Value* l = arg(a, 0, "length");
  const int64_t len = l && l->kind == Kind::integer ? l->i : 255;
  const bool killwords = arg_bool(a, 1, "killwords", false);
  const std::string end = arg_str(in, a, 2, "end", "...");
  const Value* lv = arg(a, 3, "leeway");
  const int64_t leeway = lv && lv->kind == Kind::integer ? lv->i : 5;
  const std::vector<uint32_t> cps = utf8_decode(to_str(v));
  const int64_t elen = (int64_t)utf8_length(end);
  if ((int64_t)cps.size() <= len + leeway) return Value::string(encode(cps));
  if (len < elen) in.type_error("expected length >= len(end)");
  std::string cut = encode(cps, 0, (size_t)(len - elen));
  if (killwords) return Value::string(cut + end);
  const size_t sp = cut.rfind(' ');
  if (sp != std::string::npos) cut.resize(sp);
  return Value::string(cut + end);
}
Value f_unique(Interp& in, const Value& v, Args& a) {
  const bool cs = arg_bool(a, 0, "case_sensitive", false);
  const Value* at = arg(a, 1, "attribute");
  std::vector<Value> out, seen;
  for (const Value& x : iterate(in, v)) {
    Value k = at && !at->is_none() ? attr_path(in, x, to_str(*at)) : x;
    if (!cs && k.is_string()) k = Value::string(ascii_lower(k.str()));
    bool dup = false;
    for (const Value& s : seen) dup = dup || equal(s, k);
    if (!dup) {
      seen.push_back(k);
      out.push_back(x);
    }
  }
  return gen(std::move(out));
}
Value f_wordcount(Interp&, const Value& v, Args&) {
  int64_t n = 0;
  bool in_word = false;
  for (uint32_t c : utf8_decode(to_str(v))) {
    const bool w = c == '_' || (c >= '0' && c <= '9') || is_alpha_cp(c);
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value::integer(n);
}

const Filter kFilters[] = {
    {"abs", f_abs},         {"attr", f_attr},           {"capitalize", f_capitalize}, {"center", f_center},
    {"count", f_length},    {"d", f_default},           {"default", f_default},       {"dictsort", f_dictsort},
    {"e", f_escape},        {"escape", f_escape},       {"first", f_first},           {"float", f_float},
    {"forceescape", f_escape}, {"format", f_format},    {"indent", f_indent},         {"int", f_int},
    {"items", f_items},     {"join", f_join},           {"last", f_last},             {"length", f_length},
    {"list", f_list},       {"lower", f_lower},         {"map", f_map},               {"max", f_max},
    {"min", f_min},         {"reject", f_reject},       {"rejectattr", f_rejectattr}, {"replace", f_replace},
    {"reverse", f_reverse}, {"round", f_round},         {"safe", f_safe},             {"select", f_select},
    {"selectattr", f_selectattr}, {"sort", f_sort},     {"string", f_string},         {"sum", f_sum},
    {"title", f_title},     {"tojson", f_tojson},       {"trim", f_trim},             {"truncate", f_truncate},
    {"unique", f_unique},   {"upper", f_upper},         {"wordcount", f_wordcount},
};

// ---- tests ----

bool t_defined(Interp&, const Value& v, Args&) { return !v.is_undefined(); }
bool t_undefined(Interp&, const Value& v, Args&) { return v.is_undefined(); }
bool t_none(Interp&, const Value& v, Args&) { return v.is_none(); }
bool t_boolean(Interp&, const Value& v, Args&) { return v.kind == Kind::boolean; }
bool t_false(Interp&, const Value& v, Args&) { return v.kind == Kind::boolean && !v.b; }
bool t_true(Interp&, const Value& v, Args&) { return v.kind == Kind::boolean && v.b; }
bool t_integer(Interp&, const Value& v, Args&) { return v.kind == Kind::integer; }
bool t_float(Interp&, const Value& v, Args&) { return v.kind == Kind::floating; }
bool t_number(Interp&, const Value& v, Args&) { return v.is_number(); }
bool t_string(Interp&, const Value& v, Args&) { return v.is_string(); }
bool t_mapping(Interp&, const Value& v, Args&) { return v.is_dict() && v.obj->kind == ObjectKind::dict; }
bool t_sequence(Interp&, const Value& v, Args&) {
  return v.is_string() || (v.is_list() && !v.arr->generator) || (v.is_dict() && v.obj->kind == ObjectKind::dict);
}
bool t_iterable(Interp&, const Value& v, Args&) {
  return v.is_string() || v.is_list() || v.is_undefined() || (v.is_dict() && v.obj->kind == ObjectKind::dict);
}
bool t_callable(Interp&, const Value& v, Args&) { return v.kind == Kind::callable; }
const Value& other(Interp& in, Args& a) {
  if (a.pos.empty()) in.type_error("the test needs an argument");
  return a.pos[0];
}
bool t_eq(Interp& in, const Value& v, Args& a) { return equal(v, other(in, a)); }
bool t_ne(Interp& in, const Value& v, Args& a) { return !equal(v, other(in, a)); }
bool t_lt(Interp& in, const Value& v, Args& a) { return less(in, v, other(in, a)); }
bool t_gt(Interp& in, const Value& v, Args& a) { return less(in, other(in, a), v); }
bool t_le(Interp& in, const Value& v, Args& a) { return !less(in, other(in, a), v); }
bool t_ge(Interp& in, const Value& v, Args& a) { return !less(in, v, other(in, a)); }
bool t_sameas(Interp& in, const Value& v, Args& a) {
  const Value& o = other(in, a);
  if (v.kind != o.kind) return false;
  switch (v.kind) {
    case Kind::none:
    case Kind::undefined: return true;
    case Kind::boolean: return v.b == o.b;
    case Kind::integer: return v.i == o.i && v.i >= -5 && v.i <= 256;  // CPython's small-int cache
    case Kind::string: return v.s == o.s;
    case Kind::list: return v.arr == o.arr;
    case Kind::dict: return v.obj == o.obj;
    case Kind::callable: return v.fn == o.fn;
    default: return false;
  }
}
bool t_in(Interp& in, const Value& v, Args& a) {
  const Value& c = other(in, a);
  if (c.is_string()) return v.is_string() && c.str().find(v.str()) != std::string::npos;
  if (c.is_dict()) return v.is_string() && c.obj->find(v.str());
  for (const Value& x : iterate(in, c))
    if (equal(v, x)) return true;
  return false;
}
bool t_divisibleby(Interp& in, const Value& v, Args& a) {
  const Value& n = other(in, a);
  if (!v.is_number() || !n.is_number()) in.type_error("divisibleby needs numbers");
  if (n.as_double() == 0) in.error(ErrorKind::type, "integer division or modulo by zero");
  return std::fmod(v.as_double(), n.as_double()) == 0;
}
bool t_even(Interp& in, const Value& v, Args&) {
  if (v.kind != Kind::integer && v.kind != Kind::boolean) in.type_error("even needs an integer");
  return ((v.kind == Kind::integer ? v.i : v.b) % 2) == 0;
}
bool t_odd(Interp& in, const Value& v, Args& a) { return !t_even(in, v, a); }
bool t_lower(Interp&, const Value& v, Args&) {
  const std::string s = to_str(v);
  return ascii_lower(s) == s && ascii_upper(s) != s;
}
bool t_upper(Interp&, const Value& v, Args&) {
  const std::string s = to_str(v);
  return ascii_upper(s) == s && ascii_lower(s) != s;
}
bool t_escaped(Interp&, const Value&, Args&) { return false; }
bool t_filter(Interp&, const Value& v, Args&) { return v.is_string() && find_filter(v.str()); }
bool t_test(Interp&, const Value& v, Args&) { return v.is_string() && find_test(v.str()); }

const Test kTests[] = {
    {"defined", t_defined}, {"undefined", t_undefined}, {"none", t_none},       {"boolean", t_boolean},
    {"false", t_false},     {"true", t_true},           {"integer", t_integer}, {"float", t_float},
    {"number", t_number},   {"string", t_string},       {"mapping", t_mapping}, {"sequence", t_sequence},
    {"iterable", t_iterable}, {"callable", t_callable}, {"eq", t_eq},           {"equalto", t_eq},
    {"==", t_eq},           {"ne", t_ne},               {"!=", t_ne},           {"lt", t_lt},
    {"lessthan", t_lt},     {"<", t_lt},                {"le", t_le},           {"<=", t_le},
    {"gt", t_gt},           {"greaterthan", t_gt},      {">", t_gt},            {"ge", t_ge},
    {">=", t_ge},           {"sameas", t_sameas},       {"in", t_in},           {"divisibleby", t_divisibleby},
    {"even", t_even},       {"odd", t_odd},             {"lower", t_lower},     {"upper", t_upper},
    {"escaped", t_escaped}, {"filter", t_filter},       {"test", t_test},
};

// ---- methods ----

struct Method : Callable {
  Value self;
  Value (*fn)(Interp&, const Value& self, Args&);
  Value call(Interp& in, Args& a) override { return fn(in, self, a); }
};

int64_t int_arg(Interp& in, const Args& a, size_t k, const char* name, int64_t def) {
  const Value* v = arg(a, k, name);
  if (!v || v->is_none()) return def;
  if (v->kind != Kind::integer && v->kind != Kind::boolean) in.type_error(fmt::format("'{}' must be an integer", name));
  return v->kind == Kind::integer ? v->i : v->b;
}

bool affix(Interp& in, const Value& s, Args& a, bool prefix) {
  if (a.pos.empty()) in.type_error(fmt::format("{}() takes at least 1 argument", prefix ? "startswith" : "endswith"));
  std::vector<Value> options;
  if (a.pos[0].is_list() && a.pos[0].arr->tuple)
    options = a.pos[0].arr->items;
  else
    options.push_back(a.pos[0]);
  std::string text = s.str();
  if (a.pos.size() > 1) {  // start[, end] in code points
    const std::vector<uint32_t> cps = utf8_decode(text);
    int64_t n = (int64_t)cps.size(), b = int_arg(in, a, 1, "start", 0), e = int_arg(in, a, 2, "end", n);
    if (b < 0) b = std::max<int64_t>(0, b + n);
    if (e < 0) e = std::max<int64_t>(0, e + n);
    b = std::min(b, n);
    e = std::min(e, n);
    if (b > e) return false;
    text = encode(cps, (size_t)b, (size_t)e);
  }
  for (const Value& o : options) {
    if (!o.is_string()) in.type_error(fmt::format("{} first arg must be str or a tuple of str, not {}", prefix ? "startswith" : "endswith", o.type_name()));
    const std::string& p = o.str();
    if (p.size() <= text.size() && (prefix ? text.compare(0, p.size(), p) == 0 : text.compare(text.size() - p.size(), p.size(), p) == 0))
      return true;
  }
  return false;
}

const std::string* chars_arg(Interp& in, const Args& a) {
  const Value* c = arg(a, 0, "chars");
  if (!c || c->is_none()) return nullptr;
  if (!c->is_string()) in.type_error("strip arg must be None or str");
  return &c->str();
}

// Code-point index of `sub` in `s` (or -1), searching from the left or right.
int64_t find_cp(const std::string& s, const std::string& sub, bool right) {
  const size_t p = right ? s.rfind(sub) : s.find(sub);
  if (p == std::string::npos) return -1;
  return (int64_t)utf8_length(std::string_view(s).substr(0, p));
}

std::string str_arg0(Interp& in, const Args& a, const char* method) {
  if (a.pos.empty() || !a.pos[0].is_string()) in.type_error(fmt::format("{}() argument must be str", method));
  return a.pos[0].str();
}

Value unsafe(Interp& in, const Value& self, Args&) {
  in.error(ErrorKind::security, fmt::format("a chat template may not change a {} (the sandbox is immutable)", self.type_name()));
}

struct MethodDef {
  Kind kind;
  const char* name;
  Value (*fn)(Interp&, const Value&, Args&);
};

const MethodDef kMethods[] = {
    // str
    {Kind::string, "startswith", [](Interp& in, const Value& s, Args& a) { return Value::boolean(affix(in, s, a, true)); }},
    {Kind::string, "endswith", [](Interp& in, const Value& s, Args& a) { return Value::boolean(affix(in, s, a, false)); }},
    {Kind::string, "strip", [](Interp& in, const Value& s, Args& a) { return Value::string(py_strip(s.str(), chars_arg(in, a), true, true)); }},
    {Kind::string, "lstrip", [](Interp& in, const Value& s, Args& a) { return Value::string(py_strip(s.str(), chars_arg(in, a), true, false)); }},
    {Kind::string, "rstrip", [](Interp& in, const Value& s, Args& a) { return Value::string(py_strip(s.str(), chars_arg(in, a), false, true)); }},
    {Kind::string, "split", [](Interp& in, const Value& s, Args& a) {
       return Value::list(py_split(in, s.str(), arg(a, 0, "sep"), int_arg(in, a, 1, "maxsplit", -1), false));
     }},
    {Kind::string, "rsplit", [](Interp& in, const Value& s, Args& a) {
       return Value::list(py_split(in, s.str(), arg(a, 0, "sep"), int_arg(in, a, 1, "maxsplit", -1), true));
     }},
    {Kind::string, "splitlines", [](Interp& in, const Value& s, Args& a) {
       std::vector<Value> out;
       for (auto& l : splitlines(s.str(), arg_bool(a, 0, "keepends", false))) out.push_back(Value::string(std::move(l)));
       in.tick(out.size());
       return Value::list(std::move(out));
     }},
    {Kind::string, "replace", [](Interp& in, const Value& s, Args& a) {
       if (a.pos.size() < 2 || !a.pos[0].is_string() || !a.pos[1].is_string()) in.type_error("replace() takes two strings");
       return Value::string(py_replace(in, s.str(), a.pos[0].str(), a.pos[1].str(), int_arg(in, a, 2, "count", -1)));
     }},
    {Kind::string, "upper", [](Interp&, const Value& s, Args&) { return Value::string(ascii_upper(s.str())); }},
    {Kind::string, "lower", [](Interp&, const Value& s, Args&) { return Value::string(ascii_lower(s.str())); }},
    {Kind::string, "capitalize", [](Interp& in, const Value& s, Args& a) { return f_capitalize(in, s, a); }},
    {Kind::string, "title", [](Interp&, const Value& s, Args&) {
       // Python's str.title: a letter after a non-letter is upper-cased, the others lower-cased.
       std::string out;
       bool prev_letter = false;
       for (uint32_t c : utf8_decode(s.str())) {
         const bool letter = is_alpha_cp(c);
         uint32_t x = c;
         if (letter && !prev_letter && x >= 'a' && x <= 'z') x -= 32;
         if (letter && prev_letter && x >= 'A' && x <= 'Z') x += 32;
         utf8_append(out, x);
         prev_letter = letter;
       }
       return Value::string(std::move(out));
     }},
    {Kind::string, "find", [](Interp& in, const Value& s, Args& a) { return Value::integer(find_cp(s.str(), str_arg0(in, a, "find"), false)); }},
    {Kind::string, "rfind", [](Interp& in, const Value& s, Args& a) { return Value::integer(find_cp(s.str(), str_arg0(in, a, "rfind"), true)); }},
    {Kind::string, "index", [](Interp& in, const Value& s, Args& a) {
       const int64_t i = find_cp(s.str(), str_arg0(in, a, "index"), false);
       if (i < 0) in.type_error("substring not found");
       return Value::integer(i);
     }},
    {Kind::string, "count", [](Interp& in, const Value& s, Args& a) {
       const std::string sub = str_arg0(in, a, "count");
       if (sub.empty()) return Value::integer((int64_t)utf8_length(s.str()) + 1);
       int64_t n = 0;
       for (size_t p = s.str().find(sub); p != std::string::npos; p = s.str().find(sub, p + sub.size())) ++n;
       return Value::integer(n);
     }},
    {Kind::string, "join", [](Interp& in, const Value& s, Args& a) {
       if (a.pos.empty()) in.type_error("join() takes exactly one argument");
       std::string out;
       bool first = true;
       for (const Value& x : iterate(in, a.pos[0])) {
         if (!x.is_string()) in.type_error(fmt::format("sequence item: expected str instance, {} found", x.type_name()));
         if (!first) out += s.str();
         first = false;
         out += x.str();
         in.check_size(out.size());
       }
       return Value::string(std::move(out));
     }},
    {Kind::string, "format", [](Interp& in, const Value& s, Args& a) { return Value::string(str_format(in, s.str(), a)); }},
    {Kind::string, "removeprefix", [](Interp& in, const Value& s, Args& a) {
       const std::string p = str_arg0(in, a, "removeprefix");
       return Value::string(s.str().compare(0, p.size(), p) == 0 ? s.str().substr(p.size()) : s.str());
     }},
    {Kind::string, "removesuffix", [](Interp& in, const Value& s, Args& a) {
       const std::string p = str_arg0(in, a, "removesuffix");
       const std::string& t = s.str();
       return Value::string(!p.empty() && p.size() <= t.size() && t.compare(t.size() - p.size(), p.size(), p) == 0 ? t.substr(0, t.size() - p.size()) : t);
     }},
    {Kind::string, "isdigit", [](Interp&, const Value& s, Args&) {
       return Value::boolean(!s.str().empty() && std::all_of(s.str().begin(), s.str().end(), [](char c) { return c >= '0' && c <= '9'; }));
     }},
    {Kind::string, "isspace", [](Interp&, const Value& s, Args&) {
       const auto cps = utf8_decode(s.str());
       return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), py_isspace));
     }},
    {Kind::string, "isalpha", [](Interp&, const Value& s, Args&) {
       const auto cps = utf8_decode(s.str());
       return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), is_alpha_cp));
     }},
    {Kind::string, "isalnum", [](Interp&, const Value& s, Args&) {
       const auto cps = utf8_decode(s.str());
       return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), [](uint32_t c) { return is_alpha_cp(c) || (c >= '0' && c <= '9'); }));
     }},
    {Kind::string, "islower", [](Interp& in, const Value& s, Args& a) { return Value::boolean(t_lower(in, s, a)); }},
    {Kind::string, "isupper", [](Interp& in, const Value& s, Args& a) { return Value::boolean(t_upper(in, s, a)); }},
    // dict
    {Kind::dict, "get", [](Interp& in, const Value& d, Args& a) {
       if (a.pos.empty()) in.type_error("get expected at least 1 argument, got 0");
       const Value& key = a.pos[0];
       if (!key.is_list() && !key.is_dict() && !key.is_undefined() && key.kind != Kind::callable)
         if (const Value* v = d.obj->find(key_string(key))) return *v;
       return a.pos.size() > 1 ? a.pos[1] : Value::none();
     }},
    {Kind::dict, "items", [](Interp& in, const Value& d, Args& a) { return f_items(in, d, a); }},
    {Kind::dict, "keys", [](Interp&, const Value& d, Args&) {
       std::vector<Value> out;
       for (const auto& kv : d.obj->items) out.push_back(key_value(kv.first));
       return Value::list(std::move(out));
     }},
    {Kind::dict, "values", [](Interp&, const Value& d, Args&) {
       std::vector<Value> out;
       for (const auto& kv : d.obj->items) out.push_back(kv.second);
       return Value::list(std::move(out));
     }},
    {Kind::dict, "copy", [](Interp&, const Value& d, Args&) {
       Value c = Value::dict();
       c.obj->items = d.obj->items;
       c.obj->depth = d.obj->depth;
       return c;
     }},
    {Kind::dict, "pop", unsafe},
    {Kind::dict, "popitem", unsafe},
    {Kind::dict, "setdefault", unsafe},
    {Kind::dict, "update", unsafe},
    {Kind::dict, "clear", unsafe},
    // list
    {Kind::list, "index", [](Interp& in, const Value& l, Args& a) {
       if (a.pos.empty()) in.type_error("index expected 1 argument");
       for (size_t k = 0; k < l.arr->items.size(); ++k)
         if (equal(l.arr->items[k], a.pos[0])) return Value::integer((int64_t)k);
       in.type_error(fmt::format("{} is not in list", repr(a.pos[0])));
     }},
    {Kind::list, "count", [](Interp& in, const Value& l, Args& a) {
       if (a.pos.empty()) in.type_error("count expected 1 argument");
       int64_t n = 0;
       for (const Value& x : l.arr->items) n += equal(x, a.pos[0]);
       return Value::integer(n);
     }},
    {Kind::list, "copy", [](Interp&, const Value& l, Args&) { return Value::list(l.arr->items, l.arr->tuple); }},
    {Kind::list, "append", unsafe},
    {Kind::list, "extend", unsafe},
    {Kind::list, "insert", unsafe},
    {Kind::list, "pop", unsafe},
    {Kind::list, "remove", unsafe},
    {Kind::list, "reverse", unsafe},
    {Kind::list, "sort", unsafe},
    {Kind::list, "clear", unsafe},
};

// ---- globals ----

struct Global : Callable {
  Value (*fn)(Interp&, Args&);
  Value call(Interp& in, Args& a) override { return fn(in, a); }
};

Value g_range(Interp& in, Args& a) {
  if (a.pos.empty() || a.pos.size() > 3) in.type_error(fmt::format("range expected 1 to 3 arguments, got {}", a.pos.size()));
  for (const Value& v : a.pos)
    if (v.kind != Kind::integer && v.kind != Kind::boolean)
      in.type_error(fmt::format("'{}' object cannot be interpreted as an integer", v.type_name()));
  const auto iv = [&](size_t k) { return a.pos[k].kind == Kind::integer ? a.pos[k].i : (int64_t)a.pos[k].b; };
  const int64_t start = a.pos.size() > 1 ? iv(0) : 0, stop = a.pos.size() > 1 ? iv(1) : iv(0), step = a.pos.size() > 2 ? iv(2) : 1;
  if (step == 0) in.type_error("range() arg 3 must not be zero");
  const long double count = step > 0 ? std::ceil(((long double)stop - start) / step) : std::ceil(((long double)start - stop) / -step);
  // Jinja's sandbox refuses ranges of more than 100000 items (MAX_RANGE).
  if (count > 100000) in.error(ErrorKind::limit, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  std::vector<Value> out;
  if (count > 0) {  // n items, each within [start, stop); only a step past the last one may overflow
    const int64_t n = (int64_t)count;
    in.tick((size_t)n);
    out.reserve((size_t)n);
    int64_t v = start;
    for (int64_t k = 0; k < n; ++k) {
      out.push_back(Value::integer(v));
      if (__builtin_add_overflow(v, step, &v)) break;
    }
  }
  return Value::list(std::move(out));
}
Value fill_dict(Interp& in, Args& a, Value d, bool ns) {
  if (a.pos.size() > 1) in.type_error("expected at most 1 positional argument");
  if (!a.pos.empty()) {
    const Value& src = a.pos[0];
    if (src.is_dict()) {
      for (const auto& [k, v] : src.obj->items) d.obj->set(k, v);
    } else {
      for (const Value& pair : iterate(in, src)) {
        std::vector<Value> kv = iterate(in, pair);
        if (kv.size() != 2 || !kv[0].is_string()) in.type_error("dictionary update sequence element has the wrong length or key");
        d.obj->set(kv[0].str(), kv[1]);
      }
    }
  }
  for (const auto& [k, v] : a.kw) d.obj->set(k, v);
  if (ns)
    for (const auto& kv : d.obj->items)
      if (!kv.first.empty() && kv.first[0] == '_')
        in.error(ErrorKind::security, fmt::format("a namespace cannot hold underscore-prefixed attributes ('{}')", kv.first));
  return d;
}
Value g_namespace(Interp& in, Args& a) {
  Value d = Value::dict();
  d.obj->kind = ObjectKind::ns;
  in.track_namespace(d.obj);
  return fill_dict(in, a, d, true);
}
Value g_dict(Interp& in, Args& a) { return fill_dict(in, a, Value::dict(), false); }
Value g_raise(Interp& in, Args& a) { in.error(ErrorKind::raised, a.pos.empty() ? std::string() : to_str(a.pos[0])); }
Value g_strftime_now(Interp& in, Args& a) {
  if (a.pos.empty() || !a.pos[0].is_string()) in.type_error("strftime_now(format) needs a format string");
  std::tm t{};
  if (in.opts.now) {
    t = *in.opts.now;
  } else {
    const std::time_t now = std::time(nullptr);
    localtime_r(&now, &t);
  }
  const std::string& f = a.pos[0].str();
  if (f.size() > 4096) in.type_error("strftime_now: format too long");
  std::string buf(f.size() * 64 + 64, '\0');
  const size_t n = f.empty() ? 0 : std::strftime(buf.data(), buf.size(), f.c_str(), &t);
  buf.resize(n);
  return Value::string(std::move(buf));
}

}  // namespace

const Filter* find_filter(std::string_view name) {
  for (const Filter& f : kFilters)
    if (name == f.name) return &f;
  return nullptr;
}
const Test* find_test(std::string_view name) {
  for (const Test& t : kTests)
    if (name == t.name) return &t;
  return nullptr;
}

Value apply_filter(Interp& in, const Filter* f, const Value& v, Args& args) { return f->fn(in, v, args); }
bool apply_test(Interp& in, const Test* t, const Value& v, Args& args) { return t->fn(in, v, args); }

Value method(const Value& obj, const std::string& name) {
  const Kind k = obj.kind == Kind::dict && obj.obj->kind != ObjectKind::dict ? Kind::undefined : obj.kind;
  if (k == Kind::list && obj.arr->generator) return Value::undefined();
  for (const MethodDef& m : kMethods) {
    if (m.kind != k || name != m.name) continue;
    auto c = std::make_shared<Method>();
    c->name = name;
    c->self = obj;
    c->fn = m.fn;
    return Value::callable(std::move(c));
  }
  return Value::undefined();
}

void add_globals(Object& g) {
  const auto add = [&](const char* name, Value (*fn)(Interp&, Args&)) {
    auto c = std::make_shared<Global>();
    c->name = name;
    c->fn = fn;
    g.set(name, Value::callable(std::move(c)));
  };
  add("range", g_range);
  add("namespace", g_namespace);
  add("dict", g_dict);
  add("raise_exception", g_raise);
  add("strftime_now", g_strftime_now);
}

std::vector<Value> iterate(Interp& in, const Value& v) {
  switch (v.kind) {
    case Kind::undefined: return {};
    case Kind::list:
      if (v.arr->generator) {
        if (v.arr->consumed) return {};
        v.arr->consumed = true;
      }
      return v.arr->items;
    case Kind::dict: {
      if (v.obj->kind != ObjectKind::dict) break;
      std::vector<Value> keys;
      for (const auto& kv : v.obj->items) keys.push_back(key_value(kv.first));
      return keys;
    }
    case Kind::string: {
      std::vector<Value> out;
      for (uint32_t c : utf8_decode(v.str())) {
        std::string s;
        utf8_append(s, c);
        out.push_back(Value::string(std::move(s)));
      }
      in.tick(out.size());
      return out;
    }
    default: break;
  }
  in.type_error(fmt::format("'{}' object is not iterable", v.type_name()));
}

int64_t length(Interp& in, const Value& v) {
  switch (v.kind) {
    case Kind::undefined: return 0;
    case Kind::string: return (int64_t)utf8_length(v.str());
    case Kind::list:
      if (v.arr->generator) break;
      return (int64_t)v.arr->items.size();
    case Kind::dict:
      if (v.obj->kind != ObjectKind::dict) break;
      return (int64_t)v.obj->items.size();
    default: break;
  }
  in.type_error(fmt::format("object of type '{}' has no len()", v.type_name()));
}

bool less(Interp& in, const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Kind::floating && b.kind != Kind::floating)
      return (a.kind == Kind::integer ? a.i : a.b) < (b.kind == Kind::integer ? b.i : b.b);
    return a.as_double() < b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 order is code point order
  if (a.is_list() && b.is_list() && a.arr->tuple == b.arr->tuple && !a.arr->generator && !b.arr->generator) {
    const auto& x = a.arr->items;
    const auto& y = b.arr->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (equal(x[k], y[k])) continue;
      return less(in, x[k], y[k]);
    }
    return x.size() < y.size();
  }
  for (const Value* v : {&a, &b})
    if (v->is_undefined()) in.error(ErrorKind::undefined, v->str().empty() ? "an undefined value was compared" : v->str());
  in.type_error(fmt::format("'<' not supported between instances of '{}' and '{}'", a.type_name(), b.type_name()));
}

}  // namespace moetron::jinja
