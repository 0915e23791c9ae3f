// safetensors reader (zero-copy over mmap) and writer (atomic).
//
// File layout, byte by byte:
//   [0, 8)        N: u64 little-endian, the length of the JSON header
//   [8, 8+N)      JSON object, UTF-8, possibly padded with trailing spaces:
//                   { "__metadata__": {"key": "value", ...},            (optional; string values)
//                     "tensor.name": {"dtype": "BF16", "shape": [d0, d1, ...],
//                                     "data_offsets": [begin, end]}, ... }
//   [8+N, EOF)    data section. Offsets are relative to its start; each tensor is row-major,
//                 little-endian, end - begin == numel * dtype_size. The tensors cover the data
//                 section exactly: no overlaps, no gaps, no trailing bytes (as the reference
//                 library enforces).
// A shape of [] is a 0-d scalar (numel 1); a shape containing 0 is an empty tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mmap.h"

namespace moetron {

// One tensor inside an open SafetensorsFile. `data` points into the file's mapping (valid while
// the SafetensorsFile lives, also across moves of it) and need not be aligned.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  std::string file;  // path of the file holding the tensor, for error messages
  bool mapped = false;  // `data` points into a SafetensorsFile's read-only mapping
  const uint8_t* map_base = nullptr;  // mapped: the mapping's first byte (data - map_base: the file offset)
  int map_fd = -1;                     // mapped: the mapped file, open for pread (the mapping's lifetime)

  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`; throws Error naming the file (and tensor) on any malformed input.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Null when absent.
  const TensorView* find(const std::string& name) const;
  // Throws Error "FILE: tensor 'NAME' not found" when absent.
  const TensorView& get(const std::string& name) const;
  // All tensor names, sorted.
  std::vector<std::string> names() const;
  size_t size() const { return tensors_.size(); }
  const MappedFile& mapping() const { return file_; }  // opened with keep_fd

 private:
  MappedFile file_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorView> tensors_;
};

// Converts a F32/F16/BF16 tensor to fp32 into out[expected_numel]. Throws Error (naming tensor and
// file) for other dtypes or when the tensor's numel differs from expected_numel.
void read_f32(const TensorView& t, float* out, size_t expected_numel);
std::vector<float> to_f32(const TensorView& t);
// I32/I64/U8/BOOL tensor -> int64 values; Error for other dtypes.
std::vector<int64_t> to_i64(const TensorView& t);
// Rows [row_begin, row_end) of dim 0 of a F32/F16/BF16 tensor (ndim >= 1) as fp32 into
// out[(row_end - row_begin) * row_numel], row_numel = numel / shape[0].
void read_f32_rows(const TensorView& t, int64_t row_begin, int64_t row_end, float* out);
// The slice [begin, end) of dimension `dim` of a F32/F16/BF16 tensor as fp32, row-major in the
// sliced shape (shape with shape[dim] = end - begin): rows (dim 0), columns (the last dim) or any
// other dimension. Only the bytes of the slice are read. Throws Error naming tensor and file for a
// bad dim or range.
void read_f32_slice(const TensorView& t, int dim, int64_t begin, int64_t end, float* out);
// The sub-tensor t[index] (dim 0 fixed), e.g. one expert of a stacked [E, ...] tensor. Error for a
// 0-d tensor or an index outside [0, shape[0]).
TensorView select_index(const TensorView& t, int64_t index);
// Drops the tensor's pages from the process's resident set when it lives in a mapping (see
// release_mapped_pages); a no-op for other views. read_f32 / read_f32_slice do this themselves.
void release_pages(const TensorView& t);
// Copies bytes [at, at + n) of the tensor's data to dst. A mapped tensor's bytes are read from the
// mapped file (pread on its descriptor: the same file when the path has since been replaced), so they
// never enter the process's resident set: a fault on a file mapping maps the whole page-cache folios
// around the page (several MiB on kernels with large folios), pages released before included. Other
// views are copied. Throws Error naming the file and tensor on a range outside the tensor or a failed
// or short read (the file truncated under the mapping).
void read_stored_bytes(const TensorView& t, size_t at, size_t n, void* dst);

// Builds a safetensors file. add() and add_f32() only REFERENCE the caller's data, which must stay
// alive and unchanged until write() returns; add_copy() copies. write() emits the header with
// "__metadata__" first and tensors sorted by name (data in the same order), the header padded with
// spaces to a multiple of 8 bytes, into PATH.tmp, fsyncs it, renames it to PATH and fsyncs the
// directory. A writer may be written more than once.
class SafetensorsWriter {
 public:
  // `data` holds numel(shape) elements of `dtype` (may be null when numel is 0).
  void add(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
           const void* data);
  // Same, but copies the bytes now.
  void add_copy(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                const void* data);
  // fp32 values stored as `storage` (F32, F16 or BF16), converted (round to nearest even) at write.
  void add_f32(const std::string& name, const std::vector<int64_t>& shape, const float* data,
               DType storage = DType::F32);
  void set_metadata(const std::string& key, const std::string& value);
  // Bytes of tensor data added so far.
  size_t data_bytes() const;
  void write(const std::string& path) const;

 private:
  struct Entry {
    DType dtype;  // storage dtype
    std::vector<int64_t> shape;
    size_t nbytes;
    const void* data;      // raw bytes of `dtype`, or fp32 values when `from_f32`
    bool from_f32;
    std::vector<uint8_t> owned;  // backing store for add_copy
  };
  Entry& insert(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                const void* data, bool from_f32);

  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moetron
