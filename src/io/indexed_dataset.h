// Megatron-LM indexed datasets ("MMIDIDX" version 1): a PREFIX.bin / PREFIX.idx pair, the format
// Megatron-LM's and NeMo's `preprocess_data.py` write and `megatron.core.datasets.IndexedDataset`
// reads.  moetron stores token ids and per-token loss masks this way (DESIGN §7).
//
// PREFIX.idx, byte by byte (all integers little-endian; the arrays are NOT aligned):
//   [0, 9)             magic "MMIDIDX\x00\x00"
//   [9, 17)            u64 version, = 1
//   [17, 18)           u8 dtype code of the .bin elements (Megatron's DType enum):
//                        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
//   [18, 26)           u64 n: number of sequences
//   [26, 34)           u64 d: number of entries of the document index (documents + 1)
//   [34, 34+4n)        int32 sizes[n]: elements in sequence i (>= 0)
//   [.., +8n)          int64 pointers[n]: byte offset of sequence i in PREFIX.bin;
//                        pointers[0] = 0, pointers[i+1] = pointers[i] + sizes[i] * itemsize
//   [.., +8d)          int64 doc_idx[d]: the sequence index at which each document starts, then n.
//                        Megatron's builder starts it as [0] and appends len(sizes) at each
//                        end_document(), so it is non-decreasing, doc_idx[0] = 0, all <= n, and
//                        (for files written by end_document after every document) doc_idx[d-1] = n.
//   EOF                (the multimodal variant appends int8 modes[n]; not supported here)
// PREFIX.bin: the elements of all sequences concatenated, little-endian, no header, no padding;
//   its size is exactly sum(sizes) * itemsize.
//
// The reader checks every field above and fails with an Error naming the file and field.  In
// moetron's own datasets every document is exactly one sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/mmap.h"

namespace moetron {

enum class IndexedDType : uint8_t { u8 = 1, i8 = 2, i16 = 3, i32 = 4, i64 = 5, f64 = 6, f32 = 7, u16 = 8 };

// Bytes per element; Error for an unknown code.
size_t indexed_dtype_size(IndexedDType dtype);
// "uint16", "int32", ... (Megatron's numpy names); "unknown(N)" for an unknown code.
const char* indexed_dtype_name(IndexedDType dtype);
// True when `code` is one of the eight codes above.
bool indexed_dtype_valid(uint8_t code);

// Streaming writer: elements go straight to PREFIX.bin.tmp through a small buffer; memory holds
// only the index (4 bytes per sequence, 8 per document).  finalize() writes PREFIX.idx.tmp, fsyncs
// both files, renames PREFIX.bin.tmp -> PREFIX.bin and then PREFIX.idx.tmp -> PREFIX.idx (so a
// PREFIX.idx exists only beside a complete PREFIX.bin) and fsyncs the directory.  A writer
// destroyed without finalize() removes its temporary files.  Move-only; not thread-safe.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, IndexedDType dtype);
  IndexedDatasetWriter(IndexedDatasetWriter&& other) noexcept;
  IndexedDatasetWriter& operator=(IndexedDatasetWriter&& other) noexcept;
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;
  ~IndexedDatasetWriter();

  // Appends one sequence, converted to the dataset's dtype.  Error (naming the file, the sequence
  // and the element) if a value does not fit the dtype exactly; nothing is written then.
  void add_sequence(const int32_t* values, size_t n);
  void add_sequence(const uint8_t* values, size_t n);  // e.g. a loss mask
  // Ends the current document (appends the sequence count to doc_idx).  In moetron's use every
  // document is one sequence: add_sequence(); end_document().
  void end_document();
  // Writes the index and moves both files into place.  Error on any I/O failure (temporaries are
  // removed).  Further calls to add_sequence/end_document/finalize are errors.
  void finalize();

  size_t sequences() const { return sizes_.size(); }
  size_t elements() const { return elements_; }
  size_t documents() const { return doc_idx_.size() - 1; }
  const std::string& prefix() const { return prefix_; }
  IndexedDType dtype() const { return dtype_; }

 private:
  void flush_buffer();
  void write_all(int fd, const std::string& path, const void* data, size_t n);
  void discard() noexcept;

  std::string prefix_;
  IndexedDType dtype_ = IndexedDType::i32;
  int bin_fd_ = -1;
  bool finalized_ = false;
  size_t elements_ = 0;
  std::vector<int32_t> sizes_;
  std::vector<int64_t> doc_idx_{0};
  std::vector<uint8_t> buffer_;  // pending .bin bytes (at most 1 MiB)
  template <typename T>
  void append(const T* values, size_t n);
};

// Read-only reader over mmap'd PREFIX.idx and PREFIX.bin.  open() validates the whole index (one
// pass, O(sequences)); reads after that only bounds-check the sequence number.  Move-only.
class IndexedDataset {
 public:
  static IndexedDataset open(const std::string& prefix);

  size_t size() const { return n_; }                      // sequences
  size_t length(size_t i) const;                          // elements of sequence i
  int64_t pointer(size_t i) const;                        // byte offset of sequence i in .bin
  IndexedDType dtype() const { return dtype_; }
  size_t elements() const { return elements_; }           // sum of all lengths
  // Sequence i converted to int32 (every dtype; an int64 or float element that is not an int32
  // value is an Error naming the .bin file, sequence and element).
  void read(size_t i, int32_t* out) const;
  // Elements [offset, offset + count) of sequence i; Error if the range is outside the sequence.
  void read(size_t i, size_t offset, size_t count, int32_t* out) const;
  // The document index as stored (d entries: 0, ..., n).
  const std::vector<int64_t>& document_index() const { return doc_idx_; }
  const std::string& idx_path() const { return idx_.path(); }
  const std::string& bin_path() const { return bin_.path(); }

 private:
  MappedFile idx_, bin_;
  IndexedDType dtype_ = IndexedDType::i32;
  size_t itemsize_ = 4;
  size_t n_ = 0;
  size_t elements_ = 0;
  const uint8_t* sizes_ = nullptr;     // into idx_: int32[n], unaligned
  const uint8_t* pointers_ = nullptr;  // into idx_: int64[n], unaligned
  std::vector<int64_t> doc_idx_;
};

}  // namespace moetron
