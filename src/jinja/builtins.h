// Jinja's built-in filters and tests, the Python methods of str/dict/list that templates call, and
// the globals transformers adds (builtins.cpp).  Internal to src/jinja.
#pragma once

#include <string_view>

#include "jinja/value.h"

namespace moetron::jinja {

struct Filter;
struct Test;
// The definitions by name; null for an unknown one (an error when it is evaluated, as in Jinja).
const Filter* find_filter(std::string_view name);
const Test* find_test(std::string_view name);

Value apply_filter(Interp& in, const Filter* f, const Value& v, Args& args);
bool apply_test(Interp& in, const Test* t, const Value& v, Args& args);

// obj.name for a Python method of a str, dict or list (bound to obj), or Undefined when obj's type
// has no such method.  Methods that would change a container raise a security error when called
// (the immutable sandbox).
Value method(const Value& obj, const std::string& name);

// The globals: range, namespace, dict, raise_exception, strftime_now, cycler, joiner.
void add_globals(Object& globals);

// Python's iter(): the items a for loop or filter sees (dict: keys; str: code points); Undefined
// iterates as empty; TypeError for the rest.
std::vector<Value> iterate(Interp& in, const Value& v);
// Python's len().
int64_t length(Interp& in, const Value& v);
// Python's <, for sort and comparisons; TypeError for unorderable operands.
bool less(Interp& in, const Value& a, const Value& b);

}  // namespace moetron::jinja
