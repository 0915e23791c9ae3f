// Fuzz target: a Hugging Face `config.json`, read as every model loader reads it (load_model_config:
// parse with the depth limit, the architecture's fields, validate_model_config's bounds), then the
// parameter table built from it (the shapes and the parameter total the allocator will be asked
// for) and the config written back as `convert` and checkpoints write it.
#include "fuzz_common.h"
#include "io/hf_config.h"
#include "model/params.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Scratch& s = fuzz::scratch();
  const std::string path = s.write("config.json", fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const ModelConfig cfg = load_model_config(path);
    const ParamTable table(cfg);
    if (table.total() == 0) std::abort();
    // What moetron writes must read back as the same model.
    const nlohmann::json written = model_config_to_json(cfg);
    const ModelConfig again = model_config_from_json(written, "written config.json");
    if (model_config_to_json(again) != written) {
      std::fprintf(stderr, "config.json does not round-trip\n");
      std::abort();
    }
  });
  return 0;
}
