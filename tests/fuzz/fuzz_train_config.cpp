// Fuzz target: a training config (YAML) with `key=value` overrides, as `train` and `plan` read it.
// Input: the YAML text, then optionally a line "#overrides" followed by one override per line.
// A config that loads must also survive what `train` does with it: written back to the run
// directory's config.yaml and read again on resume, unchanged.
#include <vector>

#include "fuzz_common.h"
#include "train/config.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_once(fuzz::as_text(data, size), "\n#overrides\n");
  const std::string yaml(parts.first);
  const std::string_view rest = parts.second;
  std::vector<std::string> overrides;
  for (std::string_view r = rest; !r.empty();) {
    const auto [line, tail] = fuzz::split_once(r, "\n");
    overrides.emplace_back(line);
    r = tail;
  }
  fuzz::expect_ok_or_error([&] {
    const TrainConfig cfg = train_config_from_yaml_text(yaml, "fuzz.yaml", overrides);
    validate_train_config(cfg, "fuzz.yaml");
    const std::string written = train_config_to_yaml(cfg);
    TrainConfig again;
    try {  // what moetron wrote must read back (resume reads it): an Error here is a finding too
      again = train_config_from_yaml_text(written, "written config.yaml", {});
    } catch (const Error& e) {
      std::fprintf(stderr, "config.yaml does not read back: %s\n%s\n", e.what(), written.c_str());
      std::abort();
    }
    if (!(again == cfg)) {
      std::fprintf(stderr, "config.yaml does not round-trip:\n%s\nread: %s\nread again: %s\n", written.c_str(),
                   train_config_to_json(cfg).dump().c_str(), train_config_to_json(again).dump().c_str());
      std::abort();
    }
  });
  return 0;
}
