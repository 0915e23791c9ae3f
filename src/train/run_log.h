// The run's text log (RUN/log.txt and the terminal) and the housekeeping of metrics.jsonl.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

namespace moetron {

// RUN/log.txt and the terminal: a live progress line on a TTY, plain lines otherwise.  Only the
// root rank of a distributed run writes; the others' RunLog is inactive (default-built).
class RunLog {
 public:
  RunLog() = default;
  explicit RunLog(const std::filesystem::path& path);
  void line(const std::string& text);
  void progress(const std::string& text);
  void end_progress();

 private:
  std::ofstream file_;
  bool tty_ = false;
  bool active_ = false;
  bool progress_open_ = false;
};

// Keeps metrics.jsonl lines up to `step` (after a resume, lines of steps that were redone go).
void truncate_metrics(const std::filesystem::path& path, long step);

// "1h02m", "3m05s", "42s" ("?" when not finite).
std::string format_duration(double seconds);

}  // namespace moetron
