#include "infer/text_stream.h"

#include <algorithm>

namespace moetron {

namespace {

const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD, SentencePiece's text for unfinished bytes

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

size_t incomplete_utf8_tail(const std::string& s) {
  // Look back at most 3 bytes for a lead byte whose sequence runs past the end.
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; back++) {
    const unsigned char c = (unsigned char)s[n - back];
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    const size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > back ? back : 0;
  }
  return 0;
}

TextStream::TextStream(const Tokenizer& tok, std::span<const int32_t> context, std::vector<std::string> stop)
    : tok_(tok), ids_(context.begin(), context.end()), prefix_(0), read_(context.size()) {
  for (std::string& s : stop)
    if (!s.empty()) stop_.push_back(std::move(s));
}

std::string TextStream::push(int32_t id) {
  if (stopped_) return "";
  // An id past the tokenizer's vocabulary: a padding row of the model's embedding (Qwen's config
  // vocab_size 151936 exceeds its 151665 tokens).  It has no text (HF's decode skips it too).
  if (id < 0 || id >= tok_.vocab_size()) return "";
  ids_.push_back(id);
  const std::span<const int32_t> all(ids_);
  const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_));
  const std::string now = tok_.decode(all.subspan(prefix_));
  if (now.size() <= before.size() || now.compare(0, before.size(), before) != 0 || ends_with(now, kReplacement) ||
      incomplete_utf8_tail(now) > 0)
    return "";  // nothing new yet, or an unfinished character: wait for more tokens
  prefix_ = read_;
  read_ = ids_.size();
  return release(now.substr(before.size()), false);
}

std::string TextStream::finish() {
  if (stopped_) return "";
  const std::span<const int32_t> all(ids_);
  std::string more;
  if (read_ < ids_.size()) {
    const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_));
    const std::string now = tok_.decode(all.subspan(prefix_));
    if (now.size() > before.size() && now.compare(0, before.size(), before) == 0) more = now.substr(before.size());
    read_ = ids_.size();
  }
  return release(std::move(more), true);
}

// Appends `more` to the held-back text; returns what can be released.
std::string TextStream::release(std::string more, bool final) {
  pending_ += more;
  // The first complete stop string ends the reply.
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    stopped_ = true;
    emitted_ += out;
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  if (!final)
    for (const std::string& s : stop_)
      for (size_t len = std::min(s.size() - 1, pending_.size()); len > hold; len--)
        if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
          hold = len;
          break;
        }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  emitted_ += out;
  return out;
}

}  // namespace moetron
