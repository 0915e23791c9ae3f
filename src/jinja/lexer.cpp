// Jinja2's lexer (jinja2/lexer.py) for the default delimiters: data, {{ }}, {% %}, {# #} and raw
// blocks, with its whitespace rules: "-" strips all whitespace on that side, lstrip_blocks drops the
// spaces before a block or comment tag that starts its line ("+" keeps them), trim_blocks drops the
// one newline after a block or comment tag.
#include <cstring>

#include "jinja/ast.h"
#include "jinja/jinja.h"

namespace moetron::jinja {

namespace {

[[noreturn]] void syntax(const std::string& name, Pos p, const std::string& msg) {
  throw TemplateError(ErrorKind::syntax, fmt::format("{}:{}:{}: syntax error: {}", name, p.line, p.col, msg), msg);
}

// Python's \s on one code point of UTF-8 text at s[k]; sets `len` to its byte length.
bool space_at(const std::string& s, size_t k, size_t& len) {
  const unsigned char c = (unsigned char)s[k];
  len = 1;
  if (c < 0x80) return py_isspace(c);
  size_t n = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (k + n > s.size()) return false;
  const std::vector<uint32_t> cp = utf8_decode(std::string_view(s).substr(k, n));
  len = n;
  return cp.size() == 1 && py_isspace(cp[0]);
}

// Python's str.rstrip() (whitespace).
std::string rstrip_space(const std::string& s) {
  size_t end = 0, k = 0;
  while (k < s.size()) {
    size_t len;
    const bool sp = space_at(s, k, len);
    k += len;
    if (!sp) end = k;
  }
  return s.substr(0, end);
}

// Length of the whitespace run at s[k].
size_t space_run(const std::string& s, size_t k) {
  size_t start = k, len;
  while (k < s.size() && space_at(s, k, len)) k += len;
  return k - start;
}

bool all_space(const std::string& s, size_t from) {
  if (from >= s.size()) return false;  // Jinja's \s+ needs one character
  size_t len;
  for (size_t k = from; k < s.size(); k += len)
    if (!space_at(s, k, len)) return false;
  return true;
}

class Lexer {
 public:
  Lexer(const std::string& src, const LexOptions& o, const std::string& name) : opts_(o), name_(name) {
    // Newlines normalised; the one trailing newline dropped (keep_trailing_newline=False).
    s_.reserve(src.size());
    for (size_t k = 0; k < src.size(); ++k) {
      if (src[k] == '\r') {
        s_ += '\n';
        if (k + 1 < src.size() && src[k + 1] == '\n') ++k;
      } else {
        s_ += src[k];
      }
    }
    if (!opts_.keep_trailing_newline && !s_.empty() && s_.back() == '\n') s_.pop_back();
  }

  std::vector<Token> run() {
    while (pos_ < s_.size()) root();
    push(Tok::eof, "", pos_);
    return std::move(out_);
  }

 private:
  const LexOptions& opts_;
  const std::string& name_;
  std::string s_;
  size_t pos_ = 0;
  bool line_starting_ = true;
  std::vector<Token> out_;

  Pos where(size_t at) const {
    Pos p;
    for (size_t k = 0; k < at && k < s_.size(); ++k) {
      if (s_[k] == '\n') {
        ++p.line;
        p.col = 1;
      } else if (((unsigned char)s_[k] & 0xC0) != 0x80) {
        ++p.col;
      }
    }
    return p;
  }
  // Positions are computed incrementally: `at` only grows.
  size_t pos_at_ = 0;
  Pos pos_cur_;
  Pos where_inc(size_t at) {
    for (; pos_at_ < at && pos_at_ < s_.size(); ++pos_at_) {
      if (s_[pos_at_] == '\n') {
        ++pos_cur_.line;
        pos_cur_.col = 1;
      } else if (((unsigned char)s_[pos_at_] & 0xC0) != 0x80) {
        ++pos_cur_.col;
      }
    }
    return pos_cur_;
  }
  void push(Tok t, std::string text, size_t at) { out_.push_back(Token{t, std::move(text), where_inc(at)}); }

  // Data before a tag, with the tag's whitespace sign applied (OptionalLStrip).
  void data(std::string text, size_t at, char sign, bool block_like) {
    if (sign == '-') {
      text = rstrip_space(text);
    } else if (sign != '+' && opts_.lstrip_blocks && block_like) {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting_) && all_space(text, l_pos)) text.resize(l_pos);
    }
    if (!text.empty()) push(Tok::text, std::move(text), at);
  }

  // The end of a block or comment tag at pos_ (after "%" / "#" was found at `close`): "+X}", "-X}\s*",
  // "X}\n?".  Returns the position after it and sets line_starting_.
  size_t tag_end(size_t close, bool trim) {
    size_t end = close + 2;
    char sign = close > 0 ? s_[close - 1] : 0;
    (void)sign;
    return end + (trim && opts_.trim_blocks && end < s_.size() && s_[end] == '\n' ? 1 : 0);
  }

  void root() {
    // The next tag start.
    size_t k = pos_;
    size_t found = std::string::npos;
    char kind = 0;
    while ((k = s_.find('{', k)) != std::string::npos) {
      if (k + 1 < s_.size() && (s_[k + 1] == '{' || s_[k + 1] == '%' || s_[k + 1] == '#')) {
        found = k;
        kind = s_[k + 1];
        break;
      }
      ++k;
    }
    if (found == std::string::npos) {
      push(Tok::text, s_.substr(pos_), pos_);
      pos_ = s_.size();
      return;
    }
    const char sign = found + 2 < s_.size() && (s_[found + 2] == '-' || s_[found + 2] == '+') ? s_[found + 2] : 0;
    const std::string text = s_.substr(pos_, found - pos_);
    const size_t text_at = pos_;
    size_t after = found + 2 + (sign ? 1 : 0);
    if (kind == '%' && raw_begin(after, text, text_at, sign)) return;
    data(text, text_at, sign, kind != '{');
    line_starting_ = false;
    if (kind == '#') {
      comment(found, after);
    } else {
      push(kind == '{' ? Tok::var_begin : Tok::block_begin, "", found);
      pos_ = after;
      tag(kind == '{');
    }
  }

  void comment(size_t start, size_t from) {
    const size_t q = s_.find("#}", from);
    if (q == std::string::npos) syntax(name_, where(start), "Missing end of comment tag");
    const char sign = q > from && (s_[q - 1] == '-' || s_[q - 1] == '+') ? s_[q - 1] : 0;
    size_t end = q + 2;
    if (sign == '-')
      end += space_run(s_, end);
    else if (sign != '+' && opts_.trim_blocks && end < s_.size() && s_[end] == '\n')
      ++end;
    line_starting_ = end > 0 && s_[end - 1] == '\n';
    pos_ = end;
  }

  // "{% raw %}" (the tag's "{%" and sign already read up to `at`): the text before it (`before`,
  // with the tag's sign), then its content as data up to "{% endraw %}".
  bool raw_begin(size_t at, const std::string& before, size_t before_at, char before_sign) {
    size_t k = at + space_run(s_, at);
    if (s_.compare(k, 3, "raw") != 0) return false;
    k += 3;
    if (k < s_.size() && (isalnum((unsigned char)s_[k]) || s_[k] == '_')) return false;
    k += space_run(s_, k);
    if (s_.compare(k, 3, "-%}") == 0) {
      k += 3;
      k += space_run(s_, k);
    } else if (s_.compare(k, 2, "%}") == 0) {
      k += 2;
    } else {
      return false;
    }
    data(before, before_at, before_sign, true);  // the text before the tag comes first
    // Find the endraw tag.
    size_t search = k;
    while (true) {
      const size_t b = s_.find("{%", search);
      if (b == std::string::npos) syntax(name_, where(at), "Missing end of raw directive");
      size_t e = b + 2;
      const char sign = e < s_.size() && (s_[e] == '-' || s_[e] == '+') ? s_[e] : 0;
      if (sign) ++e;
      e += space_run(s_, e);
      if (s_.compare(e, 6, "endraw") != 0) {
        search = b + 2;
        continue;
      }
      e += 6;
      e += space_run(s_, e);
      size_t end;
      if (s_.compare(e, 3, "+%}") == 0) {
        end = e + 3;
      } else if (s_.compare(e, 3, "-%}") == 0) {
        end = e + 3 + space_run(s_, e + 3);
      } else if (s_.compare(e, 2, "%}") == 0) {
        end = e + 2 + (opts_.trim_blocks && e + 2 < s_.size() && s_[e + 2] == '\n' ? 1 : 0);
      } else {
        search = b + 2;
        continue;
      }
      line_starting_ = false;
      data(s_.substr(k, b - k), k, sign, true);
      line_starting_ = s_[end - 1] == '\n';
      pos_ = end;
      return true;
    }
  }

  // Tokens of one {{ }} or {% %} up to its end.
  void tag(bool var) {
    std::vector<char> balance;
    const size_t start = pos_;
    while (true) {
      if (pos_ >= s_.size()) syntax(name_, where(start), var ? "unexpected end of template, expected '}}'" : "unexpected end of template, expected '%}'");
      // The end of the tag (only when brackets are balanced).
      if (balance.empty()) {
        const char* e = var ? "}}" : "%}";
        if (s_.compare(pos_, 3, std::string("+") + e) == 0 && !var) {
          push(Tok::block_end, "", pos_);
          pos_ += 3;
          line_starting_ = false;
          return;
        }
        if (s_.compare(pos_, 3, std::string("-") + e) == 0) {
          push(var ? Tok::var_end : Tok::block_end, "", pos_);
          pos_ += 3;
          pos_ += space_run(s_, pos_);
          line_starting_ = s_[pos_ - 1] == '\n';
          return;
        }
        if (s_.compare(pos_, 2, e) == 0) {
          push(var ? Tok::var_end : Tok::block_end, "", pos_);
          pos_ += 2;
          if (!var && opts_.trim_blocks && pos_ < s_.size() && s_[pos_] == '\n') ++pos_;
          line_starting_ = s_[pos_ - 1] == '\n';
          return;
        }
      }
      const size_t ws = space_run(s_, pos_);
      if (ws) {
        pos_ += ws;
        continue;
      }
      const char c = s_[pos_];
      if (isdigit((unsigned char)c)) {
        number();
      } else if (isalpha((unsigned char)c) || c == '_') {
        size_t e = pos_;
        while (e < s_.size() && (isalnum((unsigned char)s_[e]) || s_[e] == '_')) ++e;
        push(Tok::name, s_.substr(pos_, e - pos_), pos_);
        pos_ = e;
      } else if (c == '\'' || c == '"') {
        string_literal();
      } else {
        op(balance);
      }
    }
  }

  void number() {
    const size_t start = pos_;
    size_t e = pos_;
    const auto digits = [&](size_t& k) {
      const size_t s = k;
      while (k < s_.size() && (isdigit((unsigned char)s_[k]) || (s_[k] == '_' && k > s && k + 1 < s_.size() && isdigit((unsigned char)s_[k + 1]))))
        ++k;
      return k > s;
    };
    const char p = e + 1 < s_.size() ? (char)tolower((unsigned char)s_[e + 1]) : 0;
    if (s_[e] == '0' && (p == 'x' || p == 'o' || p == 'b')) {  // 0x1F, 0o17, 0b101
      const int base = p == 'x' ? 16 : p == 'o' ? 8 : 2;
      e += 2;
      while (e < s_.size() && (isxdigit((unsigned char)s_[e]) || s_[e] == '_')) ++e;
      std::string h;
      for (size_t k = start + 2; k < e; ++k)
        if (s_[k] != '_') h += s_[k];
      const auto v = parse_int64(h, base);
      if (!v) syntax(name_, where(start), fmt::format("integer literal '{}' is out of range (64 bits)", s_.substr(start, std::min<size_t>(e - start, 40))));
      push(Tok::integer, std::to_string(*v), start);
      pos_ = e;
      return;
    }
    digits(e);
    bool is_float = false;
    // Not after a '.' (so "x.0.1" is items 0 and 1).
    const bool after_dot = start > 0 && s_[start - 1] == '.';
    if (!after_dot && e + 1 < s_.size() && s_[e] == '.' && isdigit((unsigned char)s_[e + 1])) {
      ++e;
      digits(e);
      is_float = true;
    }
    if (!after_dot && e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
      size_t k = e + 1;
      if (k < s_.size() && (s_[k] == '+' || s_[k] == '-')) ++k;
      if (k < s_.size() && isdigit((unsigned char)s_[k])) {
        digits(k);
        e = k;
        is_float = true;
      }
    }
    std::string t;
    for (size_t k = start; k < e; ++k)
      if (s_[k] != '_') t += s_[k];
    push(is_float ? Tok::floating : Tok::integer, t, start);
    pos_ = e;
  }

  void string_literal() {
    const char q = s_[pos_];
    const size_t start = pos_;
    size_t k = pos_ + 1;
    std::string out;
    while (true) {
      if (k >= s_.size()) syntax(name_, where(start), "unexpected end of string");
      const char c = s_[k];
      if (c == q) break;
      if (c != '\\') {
        out += c;
        ++k;
        continue;
      }
      // Python's unicode-escape decoding of the literal.
      if (k + 1 >= s_.size()) syntax(name_, where(start), "unexpected end of string");
      const char d = s_[k + 1];
      k += 2;
      switch (d) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t n = d == 'x' ? 2 : d == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (size_t j = 0; j < n; ++j) {
            if (k + j >= s_.size() || !isxdigit((unsigned char)s_[k + j]))
              syntax(name_, where(start), fmt::format("truncated \\{} escape in a string", d));
            const char h = s_[k + j];
            cp = cp * 16 + (uint32_t)(isdigit((unsigned char)h) ? h - '0' : (tolower(h) - 'a' + 10));
          }
          if (cp > 0x10FFFF) syntax(name_, where(start), "illegal Unicode character in a string");
          k += n;
          utf8_append(out, cp);
          break;
        }
        default:
          if (d >= '0' && d <= '7') {
            uint32_t cp = (uint32_t)(d - '0');
            for (int j = 0; j < 2 && k < s_.size() && s_[k] >= '0' && s_[k] <= '7'; ++j) cp = cp * 8 + (uint32_t)(s_[k++] - '0');
            utf8_append(out, cp);
          } else {
            out += '\\';
            out += d;
          }
      }
    }
    push(Tok::string, std::move(out), start);
    pos_ = k + 1;
  }

  void op(std::vector<char>& balance) {
    static const char* two[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* t : two)
      if (s_.compare(pos_, 2, t) == 0) {
        push(Tok::op, t, pos_);
        pos_ += 2;
        return;
      }
    const char c = s_[pos_];
    if (!std::strchr("+-/*%~[](){}><=.:|,;", c))
      syntax(name_, where(pos_), fmt::format("unexpected char '{}'", std::string(1, c)));
    if (c == '(' || c == '[' || c == '{') balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) syntax(name_, where(pos_), fmt::format("unexpected '{}'", c));
      if (balance.back() != c) syntax(name_, where(pos_), fmt::format("unexpected '{}', expected '{}'", c, balance.back()));
      balance.pop_back();
    }
    push(Tok::op, std::string(1, c), pos_);
    ++pos_;
  }
};

}  // namespace

std::vector<Token> lex(const std::string& source, const LexOptions& opts, const std::string& name) {
  return Lexer(source, opts, name).run();
}

}  // namespace moetron::jinja
