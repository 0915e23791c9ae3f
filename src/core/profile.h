// Wall-clock time per named section, for `moetron bench ... --profile`.  Owned by whoever asks for
// it (no global registry); a null Profile* makes every timer a no-op.
#pragma once

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moetron {

class Profile {
 public:
  void add(const std::string& section, double seconds) {
    Entry& e = sections_[section];
    e.seconds += seconds;
    e.calls++;
  }
  void clear() { sections_.clear(); }
  struct Entry {
    double seconds = 0;
    long calls = 0;
  };
  const std::map<std::string, Entry>& sections() const { return sections_; }
  // (seconds / per, name) for every section, the largest first (per: the steps timed, say).
  std::vector<std::pair<double, std::string>> largest_first(double per) const {
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [name, e] : sections_) rows.emplace_back(e.seconds / per, name);
    std::sort(rows.rbegin(), rows.rend());
    return rows;
  }

 private:
  std::map<std::string, Entry> sections_;
};

class ScopedTimer {
 public:
  ScopedTimer(Profile* profile, const char* section) : profile_(profile), section_(section) {
    if (profile_) t0_ = std::chrono::steady_clock::now();
  }
  ~ScopedTimer() { stop(); }
  // Ends the section now (later calls and the destructor then add nothing).
  void stop() {
    if (profile_)
      profile_->add(section_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
    profile_ = nullptr;
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  Profile* profile_;
  const char* section_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace moetron
