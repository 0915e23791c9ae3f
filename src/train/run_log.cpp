#include "train/run_log.h"
#include "core/json_limits.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"

namespace fs = std::filesystem;

namespace moetron {

RunLog::RunLog(const fs::path& path) : file_(path, std::ios::app), tty_(isatty(fileno(stdout))), active_(true) {
  if (!file_) fail("{}: cannot open for writing", path.string());
}

void RunLog::line(const std::string& text) {
  if (!active_) return;
  end_progress();
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
  file_ << text << '\n';
  file_.flush();
}

void RunLog::progress(const std::string& text) {
  if (!active_) return;
  file_ << text << '\n';
  file_.flush();
  if (tty_) {
    std::printf("\r\033[K%s", text.c_str());
    progress_open_ = true;
  } else {
    std::printf("%s\n", text.c_str());
  }
  std::fflush(stdout);
}

void RunLog::end_progress() {
  if (progress_open_) std::printf("\n");
  progress_open_ = false;
}

void truncate_metrics(const fs::path& path, long step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::vector<std::string> keep;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = parse_json_or_discarded(line);
    if (j.is_object() && j.contains("step") && j["step"].is_number() && j["step"].get<long>() <= step)
      keep.push_back(line);
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  for (const auto& l : keep) out << l << '\n';
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = (long)s;
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

}  // namespace moetron
