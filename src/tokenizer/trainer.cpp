#include "tokenizer/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <unordered_map>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include "core/error.h"
#include "io/line_reader.h"

// Defined in libsentencepiece but not declared in its installed headers: the seed of the trainer's
// sentence sampling (otherwise drawn from std::random_device).
namespace sentencepiece {
void SetRandomGeneratorSeed(unsigned int seed);
}

namespace moetron {

namespace {

// Streams the texts of JSONL files into SentencePiece, one line of text per sentence.
class JsonlSentences : public sentencepiece::SentenceIterator {
 public:
  JsonlSentences(const std::vector<std::string>& paths, RecordFormat format) : paths_(paths), format_(format) {
    advance();
  }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return current_; }
  sentencepiece::util::Status status() const override { return status_; }
  size_t texts() const { return texts_; }
  size_t skipped() const { return skipped_; }

 private:
  void push_lines(const std::string& s) {
    size_t b = 0;
    while (b <= s.size()) {
      size_t e = s.find('\n', b);
      if (e == std::string::npos) e = s.size();
      if (e > b) pending_.emplace_back(s, b, e - b);
      b = e + 1;
    }
  }

  // Fills pending_ from the next usable record; false at the end of all files.
  bool refill() {
    std::string line;
    Record rec;
    RecordError err;
    while (true) {
      if (!reader_) {
        if (file_ == paths_.size()) return false;
        const std::string& path = paths_[file_++];
        file_format_ = format_ == RecordFormat::auto_detect ? detect_file_format(path) : format_;
        reader_ = std::make_unique<LineReader>(path);
      }
      if (!reader_->next(line)) {
        reader_.reset();
        continue;
      }
      if (reader_->too_long()) {  // longer than kDefaultMaxLineBytes: passed over unread, counted
        skipped_++;
        continue;
      }
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      if (!parse_record(line, file_format_, rec, err)) {
        skipped_++;
        continue;
      }
      if (rec.format == RecordFormat::text)
        push_lines(rec.text);
      else
        for (const ChatMessage& m : rec.messages) push_lines(m.content);
      if (!pending_.empty()) return true;
    }
  }

  void advance() {
    try {
      if (pending_.empty() && !refill()) {
        done_ = true;
        return;
      }
    } catch (const Error& e) {
      status_ = sentencepiece::util::Status(sentencepiece::util::StatusCode::kInternal, e.what());
      done_ = true;
      return;
    }
    current_ = std::move(pending_.front());
    pending_.pop_front();
    texts_++;
  }

  std::vector<std::string> paths_;
  RecordFormat format_, file_format_ = RecordFormat::auto_detect;
  size_t file_ = 0;
  std::unique_ptr<LineReader> reader_;
  std::deque<std::string> pending_;
  std::string current_;
  bool done_ = false;
  sentencepiece::util::Status status_;
  size_t texts_ = 0, skipped_ = 0;
};

namespace fs = std::filesystem;

// --output is a prefix (SentencePiece's model_prefix): PREFIX.model and PREFIX.vocab.  A directory
// ("dir/", or an existing "dir") would mean the hidden files dir/.model and dir/.vocab, or files
// beside the directory; both are refused, as are outputs that exist already (unless overwrite).
void check_output_prefix(const TokenizerTrainOptions& o) {
  const std::string& prefix = o.output_prefix;
  if (prefix.empty()) fail("tokenizer train: no --output prefix");
  const fs::path p(prefix);
  const std::string name = p.filename().string();
  std::error_code ec;
  if (prefix.back() == '/' || name.empty() || name == "." || name == ".." || fs::is_directory(p, ec))
    fail("tokenizer train: --output '{}' names a directory, but it is a prefix: the command writes PREFIX.model and "
         "PREFIX.vocab (e.g. --output {}/tokenizer)",
         prefix, (prefix.back() == '/' ? prefix.substr(0, prefix.find_last_not_of('/') + 1) : prefix));
  const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec))
    fail("tokenizer train: --output '{}': the directory '{}' does not exist", prefix, parent.string());
  if (!o.overwrite)
    for (const char* ext : {".model", ".vocab"})
      if (fs::exists(fs::symlink_status(prefix + ext, ec)))
        fail("tokenizer train: '{}{}' exists already (nothing was changed); pass --force to replace it, or choose "
             "another --output",
             prefix, ext);
}

// Writes `bytes` to a temporary file beside `path`, then moves it to `path`: replacing what is there
// only with overwrite (otherwise by link(), which fails when `path` appeared in the meantime).
void publish(const std::string& path, const std::string& bytes, bool overwrite) {
  const std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), (std::streamsize)bytes.size());
    f.flush();
    if (!f) {
      std::error_code ec;
      fs::remove(tmp, ec);
      fail("tokenizer train: cannot write '{}'", tmp);
    }
  }
  std::error_code ec;
  if (overwrite) {
    fs::rename(tmp, path, ec);
  } else if (::link(tmp.c_str(), path.c_str()) == 0) {
    fs::remove(tmp, ec);
    return;
  } else if (errno == EEXIST) {
    fs::remove(tmp, ec);
    fail("tokenizer train: '{}' appeared while training; it was left as it is (pass --force to replace it)", path);
  } else if (fs::exists(fs::symlink_status(path, ec))) {  // no hard links on this filesystem
    fs::remove(tmp, ec);
    fail("tokenizer train: '{}' appeared while training; it was left as it is (pass --force to replace it)", path);
  } else {
    fs::rename(tmp, path, ec);
  }
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    fail("tokenizer train: cannot rename '{}' to '{}': {}", tmp, path, ec.message());
  }
}

std::string join(const std::vector<std::string>& v, char sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); i++) {
    if (i) s += sep;
    s += v[i];
  }
  return s;
}

}  // namespace

TokenizerTrainResult train_tokenizer(const TokenizerTrainOptions& o) {
  if (o.inputs.empty()) fail("tokenizer train: no --input files");
  check_output_prefix(o);  // before the (long) training
  if (o.model_type != "bpe" && o.model_type != "unigram")
    fail("tokenizer train: unknown model type '{}' (expected bpe or unigram)", o.model_type);
  const int min_vocab = 3 + (o.byte_fallback ? 256 : 0) + (int)o.user_defined_symbols.size() + 1;
  if (o.vocab_size < min_vocab)
    fail("tokenizer train: --vocab-size {} is too small: needs more than {} (3 special tokens{}{})", o.vocab_size,
         min_vocab - 1, o.byte_fallback ? ", 256 byte pieces" : "",
         o.user_defined_symbols.empty() ? "" : ", the user-defined symbols");
  for (const std::string& p : o.inputs) LineReader check(p);  // Error naming a missing file now

  std::unordered_map<std::string, std::string> args = {
      {"vocab_size", std::to_string(o.vocab_size)},
      {"model_type", o.model_type},
      {"character_coverage", fmt::format("{}", o.character_coverage)},
      {"byte_fallback", o.byte_fallback ? "true" : "false"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"hard_vocab_limit", "true"},
      {"input_sentence_size", std::to_string(o.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", "65536"},
      {"num_threads", std::to_string(o.threads > 0 ? o.threads : omp_get_max_threads())},
      {"minloglevel", o.verbose ? "0" : "2"},
  };
  if (!o.user_defined_symbols.empty()) args["user_defined_symbols"] = join(o.user_defined_symbols, ',');
  sentencepiece::SetRandomGeneratorSeed(o.seed);

  JsonlSentences sentences(o.inputs, o.format);
  std::string model;
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &sentences, &model);
  if (!sentences.status().ok()) fail("tokenizer train: {}", sentences.status().ToString());
  if (!st.ok()) fail("tokenizer train: SentencePiece failed: {}", st.ToString());
  if (sentences.texts() == 0) fail("tokenizer train: the inputs hold no usable text");

  sentencepiece::SentencePieceProcessor sp;
  if (!sp.LoadFromSerializedProto(model).ok()) fail("tokenizer train: SentencePiece returned an unreadable model");
  TokenizerTrainResult r;
  r.model_path = o.output_prefix + ".model";
  r.vocab_path = o.output_prefix + ".vocab";
  r.texts = sentences.texts();
  r.skipped_lines = sentences.skipped();
  std::string vocab;
  for (int i = 0; i < sp.GetPieceSize(); i++) vocab += fmt::format("{}\t{}\n", sp.IdToPiece(i), sp.GetScore(i));
  publish(r.vocab_path, vocab, o.overwrite);
  try {
    publish(r.model_path, model, o.overwrite);
  } catch (...) {
    if (!o.overwrite) {  // the .vocab just placed is this run's own: take it back
      std::error_code ec;
      fs::remove(r.vocab_path, ec);
    }
    throw;
  }
  return r;
}

}  // namespace moetron
