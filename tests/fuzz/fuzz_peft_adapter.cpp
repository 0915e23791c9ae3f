// Fuzz target: a PEFT LoRA adapter directory (model/lora.h read_peft_adapter), as `generate --lora`,
// `convert --merge-lora`, `forward --lora` and LoRA checkpoints read it.  The input is
// adapter_config.json, optionally followed by "\n@@SAFETENSORS@@\n" and adapter_model.safetensors
// (else the golden tiny Mixtral adapter's); the base is the golden tiny Mixtral's config.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fuzz_common.h"
#include "io/hf_config.h"
#include "model/lora.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "lora" / "mixtral";

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ModelConfig cfg = load_model_config((kGolden / "config.json").string());
  static const std::string weights = read_all(kGolden / "adapter_init" / "adapter_model.safetensors");
  const fuzz::Scratch& s = fuzz::scratch();
  const auto [config, rest] = fuzz::split_once(fuzz::as_text(data, size), "\n@@SAFETENSORS@@\n");
  s.write("adapter_config.json", config);
  s.write("adapter_model.safetensors", rest.empty() ? std::string_view(weights) : rest);
  fuzz::expect_ok_or_error([&] {
    const PeftAdapter a = read_peft_adapter(s.dir(), cfg);
    // What the readers do next: the table of its spec must hold exactly the values read.
    if (ParamTable(cfg, a.spec).total() != a.values.size()) std::abort();
  });
  return 0;
}
