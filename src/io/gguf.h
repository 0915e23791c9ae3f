// GGUF, llama.cpp's model file (version 3): a writer that streams tensors to disk one at a time,
// and a bounds-checked reader (used by the tests and the export's own checks).
//
// Byte layout (every integer little-endian, as the host is):
//   uint32 magic 0x46554747 (the bytes "GGUF"), uint32 version = 3
//   uint64 n_tensors, uint64 n_kv
//   n_kv    x { string key, uint32 value type, value }
//   n_tensors x { string name, uint32 n_dims (1..4), uint64 ne[n_dims], uint32 tensor type, uint64 offset }
//   zero bytes up to a multiple of the alignment (general.alignment, u32; 32 when absent)
//   the tensor data: tensor i at data_start + offset_i, each offset a multiple of the alignment,
//   zero bytes between tensors.
// A string is uint64 length + bytes (no terminator). An array is uint32 element type + uint64
// count + the elements (arrays of arrays are not used by llama.cpp and refused here).
// `ne` is ggml's shape: ne[0] is the fastest-varying dimension, so a PyTorch [rows, cols] matrix has
// ne = {cols, rows} (llama.cpp writes shapes this way: token_embd {n_embd, n_vocab}).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/mmap.h"

namespace moetron::gguf {

constexpr uint32_t kMagic = 0x46554747;
constexpr uint32_t kVersion = 3;
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;

enum class ValueType : uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};
const char* value_type_name(ValueType t);

// One metadata value. Numbers are held widened by kind -- unsigned integers and booleans in `u`,
// signed integers in `i`, floats in `f` -- and written back at `type`'s width (the writer refuses a
// value that does not fit). Arrays hold their elements the same way in ua / ia / fa / sa.
struct Value {
  ValueType type = ValueType::u32;
  ValueType elem_type = ValueType::u8;  // of an array
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<uint64_t> ua;
  std::vector<int64_t> ia;
  std::vector<double> fa;
  std::vector<std::string> sa;

  static Value u32(uint32_t v);
  static Value i32(int32_t v);
  static Value f32(float v);
  static Value boolean(bool v);
  static Value str(std::string v);
  static Value strings(std::vector<std::string> v);
  static Value f32s(const std::vector<float>& v);
  static Value i32s(const std::vector<int32_t>& v);
  // Elements of an array (0 for a scalar).
  size_t size() const;
};

using KeyValues = std::vector<std::pair<std::string, Value>>;

// Tensor element types, numbered as ggml's ggml_type. A block-quantised type stores `block_elems`
// values in `block_bytes` bytes (Q8_0: 32 values as one fp16 scale + 32 int8, 34 bytes); the plain
// types are blocks of one. Adding such a type means a row in the traits table and an encoder /
// decoder in gguf.cpp; ne[0] (a row) must then be a multiple of block_elems.
enum class TensorType : uint32_t { F32 = 0, F16 = 1, Q8_0 = 8, BF16 = 30 };

struct TensorTypeTraits {
  TensorType type;
  const char* name;  // as llama.cpp prints it: "f32", "f16", "bf16", "q8_0"
  int64_t block_elems;
  size_t block_bytes;
};
// Error naming the number when the type is not one of the above.
const TensorTypeTraits& tensor_type_traits(uint32_t type);
inline const TensorTypeTraits& tensor_type_traits(TensorType t) { return tensor_type_traits(static_cast<uint32_t>(t)); }
// Bytes of a tensor of shape ne (Error when ne[0] is not a multiple of the block or the size overflows).
uint64_t tensor_bytes(TensorType type, const std::vector<int64_t>& ne);
// n fp32 values (n a multiple of the block) encoded into dst; round to nearest even for F16 / BF16;
// Q8_0 by core/dtype.h's rule (Error when a block's scale is beyond f16 or a value is not finite).
void encode_f32(TensorType type, const float* src, size_t n, void* dst);
// n encoded values back to fp32.
void decode_f32(TensorType type, const void* src, size_t n, float* out);

// ---------------------------------------------------------------------------------------------
// Writing.

// What a tensor's fill callback hands its values to: fp32 values in the tensor's element order
// (ne[0] fastest), any number at a time (a multiple of the block for block types), encoded and
// written as they come.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  virtual void put(const float* values, size_t n) = 0;
};

struct TensorToWrite {
  std::string name;
  std::vector<int64_t> ne;
  TensorType type = TensorType::F32;
  // Called once, while the file is written, in tensor order; must put exactly numel(ne) values.
  std::function<void(TensorSink&)> fill;
};

// Writes a GGUF v3 file at `path`: the header (kv in the given order, then the tensor infos), then
// each tensor's data from its fill callback, so at most one tensor's values are in memory at a time.
// The file is written as PATH_DIR/.NAME.tmp-PID, fsynced and renamed onto `path`; on any error
// (a callback throwing included) the temporary file is removed and `path` is left as it was.
// Errors: duplicate keys or tensor names, a value that does not fit its type, a tensor given more or
// fewer values than its shape holds, I/O failures (naming the path).
void write_file(const std::string& path, const KeyValues& kv, const std::vector<TensorToWrite>& tensors);

// ---------------------------------------------------------------------------------------------
// Reading.

struct TensorInfo {
  std::string name;
  std::vector<int64_t> ne;
  TensorType type = TensorType::F32;
  uint64_t offset = 0;  // from the start of the data section
  uint64_t bytes = 0;
  int64_t numel() const;
};

class File {
 public:
  // Maps and parses `path`. Error naming the path and the byte offset for anything malformed: bad
  // magic or version, a length or count running past the end of the file, an unknown value or tensor
  // type, nested arrays, duplicate keys or tensor names, more than 4 dims or a dimension < 1, an
  // alignment that is not a power of two, a tensor offset that is unaligned or whose data runs past
  // the end of the file, tensors that overlap.
  static File open(const std::string& path);

  uint32_t version() const { return version_; }
  const KeyValues& kv() const { return kv_; }
  const Value* find(const std::string& key) const;  // null when absent
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(const std::string& name) const;  // null when absent
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // file offset of the data section
  uint64_t file_size() const { return map_.size(); }
  // The tensor's bytes inside the mapping (t.bytes of them).
  const uint8_t* data(const TensorInfo& t) const { return map_.data() + data_offset_ + t.offset; }
  // The tensor's values as fp32.
  std::vector<float> to_f32(const TensorInfo& t) const;

 private:
  MappedFile map_;
  uint32_t version_ = 0;
  KeyValues kv_;
  std::vector<TensorInfo> tensors_;
  uint64_t alignment_ = kDefaultAlignment;
  uint64_t data_offset_ = 0;
};

}  // namespace moetron::gguf
