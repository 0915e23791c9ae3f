// Outputs never replace inputs: a command that writes checks each output path against everything it
// reads before the first byte is written, with or without --force.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace moetron {

// What a command reads.  `files`: single files (a model's shards, wherever its index puts them; a
// tokenizer and the tokenizer_config.json beside it).  `dirs`: directories read as a whole (an
// adapter): nothing may be written into them.
struct InputPaths {
  std::vector<std::filesystem::path> files;
  std::vector<std::filesystem::path> dirs;
  // Every regular file below `dir` (its subdirectories included, where an index may place shards),
  // except those whose extension is `skip_ext` (e.g. ".gguf": what export writes, never reads).
  void add_tree(const std::filesystem::path& dir, const std::string& skip_ext = "");
  // `file` and the regular files beside it (a tokenizer's config and special tokens are read with it).
  void add_with_siblings(const std::filesystem::path& file, const std::string& skip_ext = "");
};

// Throws InputError naming `flag` when `output`, resolved through symlinks (and hard links, when both
// exist), is one of in.files, lies inside one of in.dirs, or is a directory that holds an input
// (replacing it would delete that input).
void refuse_output_over_inputs(const std::filesystem::path& output, const InputPaths& in, const std::string& flag);

}  // namespace moetron
