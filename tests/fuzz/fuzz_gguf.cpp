// Fuzz target: a GGUF file (io/gguf.h gguf::File), as the GGUF export's tests and tools read it
// back.  The input is the whole file; every tensor the header admits is converted to fp32, so the
// offsets, sizes and types it accepted must hold.
#include "fuzz_common.h"
#include "io/gguf.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Scratch& s = fuzz::scratch();
  s.write("model.gguf", fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const gguf::File f = gguf::File::open(s.path("model.gguf"));
    uint64_t bytes = 0;
    for (const gguf::TensorInfo& t : f.tensors()) {
      bytes += t.bytes;
      if (f.data_offset() + t.offset + t.bytes > f.file_size()) std::abort();  // the reader let it run past the end
      (void)f.to_f32(t);  // within the file (checked above), so bounded by the input
    }
    if (bytes > f.file_size()) std::abort();
  });
  return 0;
}
