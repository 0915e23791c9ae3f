// moetron data prepare: the streaming read -> parse/template/tokenize (parallel) -> write pipeline.
#include "data/prepare.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>

#include <omp.h>

#include "core/error.h"
#include "core/json_limits.h"
#include "core/rng.h"
#include "io/indexed_dataset.h"
#include "jinja/chat_context.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace moetron {

namespace {

using Clock = std::chrono::steady_clock;

struct Line {
  std::string text;
  uint64_t number = 0;
  uint64_t too_long_bytes = 0;  // > 0: the line had this many bytes, more than the limit (text empty)
};

enum class Outcome : uint8_t { document, blank, skipped, fatal };

struct LineResult {
  Outcome outcome = Outcome::blank;
  TokenizedDocument doc;
  SkipReason reason = SkipReason::invalid_json;
  std::string message;
};

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\n\f\v") == std::string::npos; }

void skip(LineResult& r, SkipReason why, std::string message) {
  r.outcome = Outcome::skipped;
  r.reason = why;
  r.message = std::move(message);
  r.doc.clear();
}

// A line through the model's Jinja template (PrepareOptions::jinja); the caller has handled too-long
// and blank lines.  Any role is accepted (the template decides); prompt/completion lines become a
// user and an assistant message.
void jinja_line(const std::string& text, RecordFormat format, const Tokenizer& tok, const JinjaChat& jc,
                bool train_on_prompt, LineResult& r) {
  if (!is_valid_utf8(text)) return skip(r, SkipReason::invalid_utf8, "the line is not valid UTF-8");
  nlohmann::ordered_json j;
  try {
    j = parse_ordered_json(text, "the line");
  } catch (const Error& e) {
    return skip(r, SkipReason::invalid_json, e.what());
  }
  if (!j.is_object()) return skip(r, SkipReason::invalid_json, fmt::format("expected a JSON object, got {}", j.type_name()));
  const bool has_msgs = j.contains("messages"), has_pc = j.contains("prompt") && j.contains("completion"),
             has_text = j.contains("text");
  RecordFormat f = format;
  if (f == RecordFormat::auto_detect)
    f = has_msgs ? RecordFormat::chat : has_pc ? RecordFormat::prompt_completion : has_text ? RecordFormat::text : f;
  jinja::ChatInput in;
  switch (f) {
    case RecordFormat::text:
      if (!has_text || !j["text"].is_string()) return skip(r, SkipReason::missing_field, "expected a string field \"text\"");
      tokenize_text(tok, j["text"].get<std::string>(), r.doc);
      r.outcome = Outcome::document;
      return;
    case RecordFormat::prompt_completion:
      if (!has_pc || !j["prompt"].is_string() || !j["completion"].is_string())
        return skip(r, SkipReason::missing_field, "expected string fields \"prompt\" and \"completion\"");
      in.messages.push_back({{"role", "user"}, {"content", j["prompt"]}});
      in.messages.push_back({{"role", "assistant"}, {"content", j["completion"]}});
      break;
    case RecordFormat::chat:
      if (!has_msgs || !j["messages"].is_array())
        return skip(r, SkipReason::missing_field, "expected an array field \"messages\"");
      for (size_t k = 0; k < j["messages"].size(); ++k) {
        const auto& m = j["messages"][k];
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
          return skip(r, SkipReason::missing_field, fmt::format("messages[{}]: expected an object with a string \"role\"", k));
      }
      in.messages = j["messages"];
      break;
    default:
      return skip(r, SkipReason::missing_field, "expected \"messages\", \"prompt\" and \"completion\", or \"text\"");
  }
  if (j.contains("tools") && j["tools"].is_array()) in.tools = j["tools"];
  if (j.contains("chat_template_kwargs") && j["chat_template_kwargs"].is_object()) in.kwargs = j["chat_template_kwargs"];
  in.special_tokens = jc.special_tokens;
  std::string rendered;
  jinja::Spans gen;
  jinja::AssistantSpans spans;
  try {
    rendered = jinja::render_chat(*jc.tmpl, in, {}, &gen);
    if (!train_on_prompt) spans = jinja::assistant_spans(*jc.tmpl, in, rendered, gen);
  } catch (const jinja::TemplateError& e) {
    return skip(r, SkipReason::template_error, e.what());
  }
  if (!train_on_prompt && spans.rule == jinja::MaskRule::unstable)
    return skip(r, SkipReason::not_prefix_stable,
                "the template renders earlier turns differently once later ones exist, and has no {% generation %} "
                "blocks: the assistant turns cannot be masked (--train-on-prompt would keep it)");
  r.doc.tokens = tok.encode(rendered);
  r.doc.loss_mask.assign(r.doc.tokens.size(), train_on_prompt ? 1 : 0);
  if (!train_on_prompt) {
    std::vector<std::pair<size_t, size_t>> offs;
    if (!tok.token_offsets(r.doc.tokens, rendered, offs))
      throw Error("the tokenizer's pieces do not spell the rendered conversation back (a normaliser changed it): "
                  "the assistant mask cannot be placed");
    for (size_t k = 0; k < offs.size(); ++k)
      for (const auto& [s, e] : spans.spans)
        if (offs[k].first < e && offs[k].second > s) r.doc.loss_mask[k] = 1;
  }
  r.outcome = Outcome::document;
}

// One line -> a document or the reason it is unusable.  Never throws: an unexpected Error (not a
// property of the line) becomes Outcome::fatal and stops the run after the chunk.
void process_line(const Line& line, RecordFormat format, const Tokenizer& tok, ChatTemplate tmpl,
                  const ChatOptions& copts, size_t max_line_bytes, LineResult& r, const JinjaChat* jinja) {
  r.doc.clear();
  r.message.clear();
  if (line.too_long_bytes > 0) {
    r.outcome = Outcome::skipped;
    r.reason = SkipReason::line_too_long;
    r.message = fmt::format("the line is {} bytes, more than --max-line-bytes {}", line.too_long_bytes,
                            max_line_bytes);
    return;
  }
  if (is_blank(line.text)) {
    r.outcome = Outcome::blank;
    return;
  }
  try {
    if (jinja) {
      jinja_line(line.text, format, tok, *jinja, copts.train_on_prompt, r);
      if (r.outcome == Outcome::document && r.doc.loss_tokens() == 0)
        skip(r, SkipReason::no_loss_tokens, "no token is in the loss (no assistant message; --train-on-prompt would keep it)");
      return;
    }
    Record rec;
    RecordError err;
    if (!parse_record(line.text, format, rec, err)) {
      r.outcome = Outcome::skipped;
      r.reason = err.reason;
      r.message = std::move(err.message);
      return;
    }
    if (rec.format == RecordFormat::text)
      tokenize_text(tok, rec.text, r.doc);
    else
      apply_chat_template(tmpl, tok, rec.messages, copts, r.doc);
    if (r.doc.loss_tokens() == 0) {
      r.outcome = Outcome::skipped;
      r.reason = SkipReason::no_loss_tokens;
      r.message = "no token is in the loss (no assistant message; --train-on-prompt would keep it)";
      r.doc.clear();
      return;
    }
    r.outcome = Outcome::document;
  } catch (const ChatError& e) {
    r.outcome = Outcome::skipped;
    r.reason = skip_reason_of(e.kind());
    r.message = e.what();
    r.doc.clear();
  } catch (const std::exception& e) {
    r.outcome = Outcome::fatal;
    r.message = e.what();
  }
}

// The token and mask writers of one split.
struct SplitWriter {
  IndexedDatasetWriter tokens, mask;
  SplitWriter(const fs::path& dir, const std::string& name, IndexedDType token_dtype)
      : tokens((dir / name).string(), token_dtype), mask((dir / (name + "_mask")).string(), IndexedDType::u8) {}
  void add(const TokenizedDocument& d) {
    tokens.add_sequence(d.tokens.data(), d.tokens.size());
    tokens.end_document();
    mask.add_sequence(d.loss_mask.data(), d.loss_mask.size());
    mask.end_document();
  }
  void finalize() {
    tokens.finalize();
    mask.finalize();
  }
};

// Removes an output directory this run created, unless the run completed.
struct DirGuard {
  fs::path dir;
  bool created = false, committed = false;
  ~DirGuard() {
    if (created && !committed) {
      std::error_code ec;
      fs::remove(dir, ec);  // only if empty: the writers have removed their temporary files
    }
  }
};

enum class SourceSplit { by_fraction, train, valid };

struct Source {
  std::string path;
  SourceSplit split = SourceSplit::by_fraction;
  RecordFormat format = RecordFormat::auto_detect;
  uint64_t lines = 0, blank = 0, documents = 0, skipped = 0;
};

const char* split_name(SourceSplit s) {
  switch (s) {
    case SourceSplit::by_fraction: return "train+valid";
    case SourceSplit::train: return "train";
    case SourceSplit::valid: return "valid";
  }
  return "?";
}

void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) {
      std::error_code ec;
      fs::remove(tmp, ec);
      fail("{}: cannot write", tmp.string());
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    fail("{}: cannot rename to {}: {}", tmp.string(), path.string(), ec.message());
  }
}

nlohmann::json split_json(const std::string& prefix, const SplitCounts& c) {
  return {{"prefix", prefix},
          {"mask_prefix", prefix + "_mask"},
          {"documents", c.documents},
          {"tokens", c.tokens},
          {"loss_tokens", c.loss_tokens}};
}

}  // namespace

PrepareReport prepare_dataset(const PrepareOptions& o) {
  if (o.inputs.empty()) fail("data prepare: no --input files");
  if (o.valid_fraction < 0.0 || o.valid_fraction >= 1.0)
    fail("data prepare: --valid-fraction {} must be in [0, 1)", o.valid_fraction);
  if (o.chunk_lines == 0 || o.chunk_bytes == 0) fail("data prepare: chunk sizes must be positive");
  if (o.max_line_bytes == 0) fail("data prepare: --max-line-bytes must be at least 1");
  const bool dry = o.output_dir.empty();
  const Tokenizer tok = Tokenizer::load(o.tokenizer_path);
  const IndexedDType token_dtype = tok.vocab_size() <= 65536 ? IndexedDType::u16 : IndexedDType::i32;
  ChatOptions copts;
  copts.train_on_prompt = o.train_on_prompt;

  std::vector<Source> sources;
  const bool by_fraction = o.valid_inputs.empty();
  for (const auto& p : o.inputs) sources.push_back({p, by_fraction ? SourceSplit::by_fraction : SourceSplit::train});
  for (const auto& p : o.valid_inputs) sources.push_back({p, SourceSplit::valid});
  uint64_t total_bytes = 0;
  for (Source& s : sources) {
    LineReader check(s.path);  // Error naming a missing input before anything is written
    total_bytes += check.file_size();
    s.format = o.format == RecordFormat::auto_detect ? detect_file_format(s.path, 10000, o.max_line_bytes) : o.format;
  }

  DirGuard guard;
  std::optional<SplitWriter> train_w, valid_w;
  const fs::path dir = o.output_dir;
  if (!dry) {
    if (fs::exists(dir) && !fs::is_directory(dir)) fail("data prepare: --output '{}' exists and is not a directory", o.output_dir);
    // The output directory is new, empty, or a previous `data prepare` output (replaced): never a
    // directory holding anything else, which this command did not create.
    if (fs::is_directory(dir)) {
      static const std::set<std::string> kOwn = {"train.bin", "train.idx", "train_mask.bin", "train_mask.idx",
                                                 "valid.bin", "valid.idx", "valid_mask.bin", "valid_mask.idx",
                                                 "dataset.json"};
      for (const auto& e : fs::directory_iterator(dir))
        if (!kOwn.count(e.path().filename().string()))
          fail("data prepare: --output '{}' holds '{}', which is not a dataset file this command writes; choose a new "
               "or empty directory (or one a previous `data prepare` wrote)",
               o.output_dir, e.path().filename().string());
    }
    if (!fs::exists(dir)) {
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec) fail("data prepare: cannot create --output '{}': {}", o.output_dir, ec.message());
      guard.dir = dir;
      guard.created = true;
    }
    train_w.emplace(dir, "train", token_dtype);
    valid_w.emplace(dir, "valid", token_dtype);
  }

  PrepareReport rep;
  rep.threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  rep.input_bytes = total_bytes;
  const auto t0 = Clock::now();
  uint64_t bytes_done = 0;
  std::vector<Line> lines(o.chunk_lines);
  std::vector<LineResult> results(o.chunk_lines);
  const uint64_t split_key = hash_name("data prepare valid split");

  for (size_t fi = 0; fi < sources.size(); fi++) {
    Source& src = sources[fi];
    LineReader reader(src.path, o.max_line_bytes);
    bool eof = false;
    while (!eof) {
      // Read a chunk.
      size_t n = 0, bytes = 0;
      const uint64_t read_before = reader.bytes_read();
      while (n < o.chunk_lines && bytes < o.chunk_bytes) {
        if (!reader.next(lines[n].text)) {
          eof = true;
          break;
        }
        lines[n].number = reader.line_number();
        lines[n].too_long_bytes = reader.too_long() ? reader.line_bytes() : 0;
        bytes += lines[n].text.size() + 1;  // held in memory (a too-long line is not)
        n++;
      }
      if (n == 0) break;
      // Parse, template and tokenize it in parallel.
      const RecordFormat fmt = src.format;
      const auto tp = Clock::now();
#pragma omp parallel for num_threads(rep.threads) schedule(dynamic, 8)
      for (size_t i = 0; i < n; i++)
        process_line(lines[i], fmt, tok, o.chat_template, copts, o.max_line_bytes, results[i], o.jinja ? &*o.jinja : nullptr);
      rep.parallel_seconds += std::chrono::duration<double>(Clock::now() - tp).count();
      // Write it in input order.
      for (size_t i = 0; i < n; i++) {
        LineResult& r = results[i];
        src.lines++;
        rep.lines++;
        switch (r.outcome) {
          case Outcome::blank:
            src.blank++;
            rep.blank_lines++;
            break;
          case Outcome::fatal:
            fail("{}:{}: {}", src.path, lines[i].number, r.message);
          case Outcome::skipped: {
            if (o.strict)
              fail("{}:{}: {}: {} (--strict stops at the first unusable line)", src.path, lines[i].number,
                   skip_reason_name(r.reason), r.message);
            src.skipped++;
            rep.skipped++;
            rep.skipped_by_reason[(int)r.reason]++;
            if (rep.skipped_lines.size() < o.max_listed_skips) {
              rep.skipped_lines.push_back({src.path, lines[i].number, r.reason, r.message});
              if (o.log)
                std::fprintf(o.log, "%sskipped %s:%llu: %s: %s\n", o.progress ? "\r\033[K" : "", src.path.c_str(),
                             (unsigned long long)lines[i].number, skip_reason_name(r.reason), r.message.c_str());
              if (o.log && rep.skipped_lines.size() == o.max_listed_skips)
                std::fprintf(o.log, "(further skipped lines are counted in dataset.json but not listed)\n");
            }
            break;
          }
          case Outcome::document: {
            bool valid = src.split == SourceSplit::valid;
            if (src.split == SourceSplit::by_fraction && o.valid_fraction > 0)
              valid = uniform_at(o.seed, split_key, fi, lines[i].number) < o.valid_fraction;
            SplitCounts& c = valid ? rep.valid : rep.train;
            c.documents++;
            c.tokens += r.doc.tokens.size();
            c.loss_tokens += r.doc.loss_tokens();
            src.documents++;
            if (!dry) (valid ? *valid_w : *train_w).add(r.doc);
            break;
          }
        }
      }
      // Bounded memory: the chunk's buffers are freed, not kept for the next chunk.  Kept, each slot
      // would grow to the longest line it ever held, and the footprint would creep up with the input
      // size (measured: +80% from 10 MB to 150 MB); freed, the peak is one chunk's data.
      for (size_t i = 0; i < n; i++) {
        std::string().swap(lines[i].text);
        results[i] = LineResult{};
      }
      bytes_done += reader.bytes_read() - read_before;
      if (o.progress) {
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        const double frac = total_bytes ? std::min(1.0, (double)bytes_done / (double)total_bytes) : 1.0;
        std::fprintf(stderr, "\r\033[Kdata prepare: %5.1f%%  %.1f/%.1f MB  %llu documents  %.2fM tokens/s", 100 * frac,
                     bytes_done / 1e6, total_bytes / 1e6, (unsigned long long)(rep.train.documents + rep.valid.documents),
                     (rep.train.tokens + rep.valid.tokens) / std::max(s, 1e-9) / 1e6);
      }
    }
  }
  if (o.progress) std::fprintf(stderr, "\n");
  rep.seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  if (rep.train.documents == 0)
    fail("data prepare: no usable training documents ({} lines read, {} blank, {} skipped, {} in valid)", rep.lines,
         rep.blank_lines, rep.skipped, rep.valid.documents);
  if (o.log && rep.valid.documents == 0 && (by_fraction ? o.valid_fraction > 0 : true))
    std::fprintf(o.log, "warning: the valid split is empty\n");

  // dataset.json: only facts that do not depend on the machine, the thread count or the time.
  nlohmann::json j;
  j["format"] = "moetron-dataset";
  j["version"] = 1;
  j["tokenizer"] = {{"path", tok.path()},           {"sha256", tok.sha256()},   {"vocab_size", tok.vocab_size()},
                    {"bos_id", tok.bos_id()},       {"eos_id", tok.eos_id()},   {"unk_id", tok.unk_id()},
                    {"pad_id", tok.pad_id()}};
  if (o.jinja) {  // the model's own template: serving reads the same one from the model directory
    j["template"] = "jinja";
    j["chat_template"] = {{"origin", o.jinja->origin}, {"sha256", o.jinja->sha256}};
  } else {
    j["template"] = chat_template_name(o.chat_template);
  }
  j["train_on_prompt"] = o.train_on_prompt;
  j["token_dtype"] = indexed_dtype_name(token_dtype);
  j["mask_dtype"] = indexed_dtype_name(IndexedDType::u8);
  if (by_fraction)
    j["split"] = {{"method", "valid_fraction"}, {"valid_fraction", o.valid_fraction}, {"seed", o.seed}};
  else
    j["split"] = {{"method", "valid_input"}};
  j["sources"] = nlohmann::json::array();
  for (const Source& s : sources)
    j["sources"].push_back({{"path", s.path},
                            {"split", split_name(s.split)},
                            {"format", record_format_name(s.format)},
                            {"lines", s.lines},
                            {"blank_lines", s.blank},
                            {"documents", s.documents},
                            {"skipped", s.skipped}});
  j["train"] = split_json("train", rep.train);
  j["valid"] = split_json("valid", rep.valid);
  nlohmann::json by_reason = nlohmann::json::object();
  for (int k = 0; k < kSkipReasonCount; k++) by_reason[skip_reason_name((SkipReason)k)] = rep.skipped_by_reason[k];
  nlohmann::json listed = nlohmann::json::array();
  for (const SkippedLine& s : rep.skipped_lines)
    listed.push_back({{"file", s.file}, {"line", s.line}, {"reason", skip_reason_name(s.reason)}, {"message", s.message}});
  j["skipped"] = {{"total", rep.skipped},
                  {"by_reason", by_reason},
                  {"lines", listed},
                  {"lines_truncated", rep.skipped > rep.skipped_lines.size()}};
  rep.dataset_json = j;

  if (!dry) {
    train_w->finalize();
    valid_w->finalize();
    write_file_atomic(dir / "dataset.json", j.dump(2) + "\n");
    guard.committed = true;
  }
  return rep;
}

}  // namespace moetron
