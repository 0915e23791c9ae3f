// Fuzz target: a safetensors file (header JSON + tensor views), as `forward`, `generate`, `convert`
// and checkpoint loading open it; then every accessor the model loaders use on each tensor.
#include <algorithm>

#include "fuzz_common.h"
#include "io/model_files.h"
#include "io/safetensors.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Scratch& s = fuzz::scratch();
  s.write("model.safetensors", fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const SafetensorsFile f = SafetensorsFile::open(s.path("model.safetensors"));
    for (const std::string& name : f.names()) {
      const TensorView& t = f.get(name);
      const int64_t n = t.numel();
      fuzz::expect_ok_or_error([&] {
        if (dtype_is_float(t.dtype)) {
          std::vector<float> v = to_f32(t);
          if ((int64_t)v.size() != n) std::abort();
          if (!t.shape.empty() && t.shape[0] > 0) {
            std::vector<float> row((size_t)(n / t.shape[0]));
            read_f32_rows(t, 0, 1, row.data());
            const TensorView first = select_index(t, 0);
            if (first.numel() * t.shape[0] != n) std::abort();
            read_f32_slice(t, (int)t.shape.size() - 1, 0, std::min<int64_t>(1, t.shape.back()),
                           std::vector<float>((size_t)(t.shape.back() ? n / t.shape.back() : 0) + 1).data());
          }
        } else {
          (void)to_i64(t);
        }
      });
    }
  });
  // The same file as a model directory (the single-file layout).
  fuzz::expect_ok_or_error([&] {
    const ModelTensors m = ModelTensors::open(s.dir());
    for (const std::string& name : m.names()) (void)m.get(name).numel();
  });
  return 0;
}
