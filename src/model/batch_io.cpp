#include "model/batch_io.h"

#include <limits>

#include "core/error.h"
#include "io/safetensors.h"
#include "ops/cross_entropy.h"

namespace moetron {

namespace {

std::vector<int32_t> read_ids(const SafetensorsFile& f, const TensorView& t, int B, int T) {
  if (t.shape.size() != 2 || t.shape[0] != B || t.shape[1] != T)
    fail("{}: tensor '{}' must have shape [B, T] = [{}, {}]", f.path(), t.name, B, T);
  if (t.dtype != DType::I32 && t.dtype != DType::I64)
    fail("{}: tensor '{}' has dtype {}, expected I32 or I64", f.path(), t.name, dtype_name(t.dtype));
  const std::vector<int64_t> v = to_i64(t);
  std::vector<int32_t> out(v.size());
  for (size_t i = 0; i < v.size(); i++) {
    if (v[i] < std::numeric_limits<int32_t>::min() || v[i] > std::numeric_limits<int32_t>::max())
      fail("{}: {}[{}][{}] = {} does not fit in 32 bits", f.path(), t.name, i / T, i % T, v[i]);
    out[i] = (int32_t)v[i];
  }
  return out;
}

}  // namespace

Batch read_batch_safetensors(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  const TensorView* ids = f.find("input_ids");
  if (!ids) fail("{}: required tensor 'input_ids' [B, T] is missing", path);
  if (ids->shape.size() != 2 || ids->shape[0] <= 0 || ids->shape[1] <= 0)
    fail("{}: 'input_ids' must have shape [B, T] with B, T > 0", path);
  Batch b;
  b.B = (int)ids->shape[0];
  b.T = (int)ids->shape[1];
  b.input_ids = read_ids(f, *ids, b.B, b.T);
  if (const TensorView* t = f.find("labels")) b.labels = read_ids(f, *t, b.B, b.T);
  if (const TensorView* t = f.find("attention_mask")) b.attention_mask = read_ids(f, *t, b.B, b.T);
  if (const TensorView* t = f.find("position_ids")) b.position_ids = read_ids(f, *t, b.B, b.T);
  if (const TensorView* t = f.find("segment_ids")) b.segment_ids = read_ids(f, *t, b.B, b.T);
  static const char* known[] = {"input_ids", "labels", "attention_mask", "position_ids", "segment_ids"};
  for (const std::string& name : f.names()) {
    bool ok = false;
    for (const char* k : known) ok |= name == k;
    if (!ok)
      fail("{}: unknown tensor '{}'; expected input_ids, labels, attention_mask, position_ids, segment_ids", path,
           name);
  }
  return b;
}

void validate_batch(const Batch& b, int vocab_size) {
  if (b.B <= 0 || b.T <= 0) fail("batch: B and T must be positive (got B={}, T={})", b.B, b.T);
  const size_t n = (size_t)b.B * b.T;
  auto check = [&](const std::vector<int32_t>& v, const char* name, bool required) {
    if (v.empty() && !required) return;
    if (v.size() != n) fail("batch: '{}' has {} values, expected B*T = {}x{} = {}", name, v.size(), b.B, b.T, n);
  };
  check(b.input_ids, "input_ids", true);
  check(b.labels, "labels", false);
  check(b.attention_mask, "attention_mask", false);
  check(b.position_ids, "position_ids", false);
  check(b.segment_ids, "segment_ids", false);
  for (size_t i = 0; i < n; i++) {
    const int32_t id = b.input_ids[i];
    if (id < 0 || id >= vocab_size)
      fail("batch: input_ids[{}][{}] = {} is outside the vocabulary [0, {})", i / b.T, i % b.T, id, vocab_size);
    if (!b.labels.empty() && b.labels[i] != ops::IGNORE_INDEX && (b.labels[i] < 0 || b.labels[i] >= vocab_size))
      fail("batch: labels[{}][{}] = {} is neither -100 nor inside the vocabulary [0, {})", i / b.T, i % b.T,
           b.labels[i], vocab_size);
    if (!b.position_ids.empty() && b.position_ids[i] < 0)
      fail("batch: position_ids[{}][{}] = {} is negative", i / b.T, i % b.T, b.position_ids[i]);
    if (!b.attention_mask.empty() && b.attention_mask[i] != 0 && b.attention_mask[i] != 1)
      fail("batch: attention_mask[{}][{}] = {}, expected 0 or 1", i / b.T, i % b.T, b.attention_mask[i]);
  }
}

}  // namespace moetron
