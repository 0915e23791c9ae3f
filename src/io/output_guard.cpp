#include "io/output_guard.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetron {

namespace fs = std::filesystem;

namespace {

// A bound on the walk: a model or adapter directory holds tens of files, not millions.
constexpr size_t kMaxTreeEntries = 100000;

fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
  return ec ? fs::absolute(p).lexically_normal() : r;
}

// True when `inner` is `outer` or lies below it (both resolved).
bool within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

}  // namespace

void InputPaths::add_tree(const fs::path& dir, const std::string& skip_ext) {
  std::error_code ec;
  size_t seen = 0;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (++seen > kMaxTreeEntries)
      throw InputError(fmt::format("{}: more than {} entries; not a model directory", dir.string(), kMaxTreeEntries));
    std::error_code e2;
    if (it->is_regular_file(e2) && (skip_ext.empty() || it->path().extension() != skip_ext))
      files.push_back(it->path());
  }
}

void InputPaths::add_with_siblings(const fs::path& file, const std::string& skip_ext) {
  files.push_back(file);
  std::error_code ec;
  const fs::path parent = file.has_parent_path() ? file.parent_path() : fs::path(".");
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    std::error_code e2;
    if (e.is_regular_file(e2) && (skip_ext.empty() || e.path().extension() != skip_ext)) files.push_back(e.path());
  }
}

void refuse_output_over_inputs(const fs::path& output, const InputPaths& in, const std::string& flag) {
  const fs::path out = resolved(output);
  std::error_code ec;
  const bool out_exists = fs::exists(output, ec);
  auto refuse = [&](const fs::path& input, const char* how) {
    throw InputError(fmt::format("{} {}: {} {}; an input is never replaced, --force or not: write elsewhere", flag,
                                 output.string(), how, input.string()));
  };
  for (const fs::path& f : in.files) {
    const fs::path r = resolved(f);
    if (r == out || (out_exists && fs::equivalent(output, f, ec))) refuse(f, "is one of the input files,");
    if (within(r, out)) refuse(f, "is a directory holding one of the input files,");
  }
  for (const fs::path& d : in.dirs) {
    const fs::path r = resolved(d);
    if (within(out, r)) refuse(d, "lies inside the input directory");
    if (within(r, out)) refuse(d, "is a directory holding the input directory");
  }
}

}  // namespace moetron
