// Fuzz target: a checkpoint directory on a shared filesystem — `checkpoints/latest` and the step's
// `trainer_state.json` (format, checksum, the manifest of files with sizes and hashes) — as resume
// finds and verifies it.  Each input is tried twice: as it is, and resealed (its checksum
// recomputed, as someone who edits the file would), so the fields behind the checksum are reached.
// validate_trainer_state (what resume checks) runs on the parsed JSON too.
// Input: the first line is `latest`'s content, the rest is trainer_state.json.
#include <filesystem>

#include "core/json_limits.h"
#include "core/xxh64.h"
#include "fuzz_common.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

std::string make_run() {
  const fs::path run = fs::path(fuzz::scratch().dir()) / "run";
  const fs::path step = run / "checkpoints" / "step-000002";
  fs::create_directories(step);
  const float v[4] = {1, 2, 3, 4};
  SafetensorsWriter w;
  w.add_f32("model.norm.weight", {4}, v);
  w.write((step / "model.safetensors").string());
  write_file_atomic((step / "config.json").string(), "{}\n");
  write_file_atomic((fs::path(fuzz::scratch().dir()) / "outside.txt").string(), "not in the checkpoint\n");
  return run.string();
}

void check(const std::string& run, const std::string& step_dir) {
  fuzz::expect_ok_or_error([&] { (void)find_latest_checkpoint(run); });
  std::string why;
  const bool complete = is_complete_checkpoint(step_dir, &why);
  if (!complete && why.empty()) std::abort();
  fuzz::expect_ok_or_error([&] {
    const nlohmann::json state = read_trainer_state(step_dir);
    verify_checkpoint_files(step_dir, state);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string run = make_run();
  const std::string step_dir = run + "/checkpoints/step-000002";
  const auto [latest, state_text] = fuzz::split_once(fuzz::as_text(data, size), "\n");
  write_file_atomic(run + "/checkpoints/latest", std::string(latest));
  write_file_atomic(step_dir + "/trainer_state.json", std::string(state_text));
  check(run, step_dir);

  nlohmann::json j;
  try {
    j = parse_json(state_text, "trainer_state.json");
  } catch (const Error&) {
    return 0;
  }
  // What resume checks before it loads anything (pure: the JSON only).
  for (TrainerStateUse use : {TrainerStateUse::any, TrainerStateUse::resume})
    fuzz::expect_ok_or_error([&] { validate_trainer_state(j, "trainer_state.json", use); });
  if (!j.is_object()) return 0;
  j.erase("trainer_state_xxh64");
  const std::string body = j.dump();
  j["trainer_state_xxh64"] = xxh64_hex(xxh64(body.data(), body.size()));
  write_file_atomic(step_dir + "/trainer_state.json", j.dump());
  check(run, step_dir);
  return 0;
}
