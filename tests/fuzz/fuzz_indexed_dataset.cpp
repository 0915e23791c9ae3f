// Fuzz target: a Megatron MMIDIDX dataset (`PREFIX.idx` + `PREFIX.bin`), as training opens it, then
// every sequence read back whole and in parts (the reads the loader's packer makes).
// Input: 4 bytes (little-endian) giving the .idx length, the .idx bytes, then the .bin bytes.
#include <vector>

#include "fuzz_common.h"
#include "io/indexed_dataset.h"

using namespace moetron;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const uint32_t idx_len = uint32_t(data[0]) | uint32_t(data[1]) << 8 | uint32_t(data[2]) << 16 | uint32_t(data[3]) << 24;
  const std::string_view rest = fuzz::as_text(data + 4, size - 4);
  const size_t n = std::min<size_t>(idx_len, rest.size());
  const fuzz::Scratch& s = fuzz::scratch();
  s.write("data.idx", rest.substr(0, n));
  s.write("data.bin", rest.substr(n));
  fuzz::expect_ok_or_error([&] {
    const IndexedDataset ds = IndexedDataset::open(s.path("data"));
    size_t total = 0;
    std::vector<int32_t> buf;
    for (size_t i = 0; i < ds.size(); i++) {
      const size_t len = ds.length(i);
      total += len;
      buf.assign(len + 1, -7);
      ds.read(i, buf.data());
      if (buf[len] != -7) std::abort();  // read() wrote past the sequence's length
      if (len >= 2) ds.read(i, 1, len - 2, buf.data());
      fuzz::expect_ok_or_error([&] { ds.read(i, len, 1, buf.data()); });  // past the end: an Error
    }
    if (total != ds.elements()) std::abort();
    const std::vector<int64_t>& docs = ds.document_index();
    for (size_t k = 1; k < docs.size(); k++)
      if (docs[k] < docs[k - 1] || docs[k] > (int64_t)ds.size()) std::abort();
  });
  return 0;
}
