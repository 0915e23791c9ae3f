// Tests for io/indexed_dataset: round trips through the writer and the mmap reader, agreement with
// an independent reader written here from Megatron's MMIDIDX v1 byte layout (plain fread/memcpy),
// and an Error naming the file for every kind of malformed file.
#include <gtest/gtest.h>

#include "temp_dir.h"
#include <stdlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "io/indexed_dataset.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

using TempDir = moetron::testing::TempDir;

// ---- The independent reader: Megatron's layout, parsed field by field with fread. ----
struct RawIndex {
  char magic[9];
  uint64_t version;
  uint8_t code;
  uint64_t n, d;
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers, doc_idx;
  long file_size;
};

template <typename T>
T read_le(FILE* f) {
  unsigned char b[sizeof(T)];
  if (std::fread(b, 1, sizeof(T), f) != sizeof(T)) throw std::runtime_error("short read");
  // Assemble little-endian explicitly, independent of the host's byte order.
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); i++) v |= (uint64_t)b[i] << (8 * i);
  using U = std::conditional_t<sizeof(T) == 1, uint8_t,
                               std::conditional_t<sizeof(T) == 2, uint16_t,
                                                  std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>>;
  const U u = (U)v;
  T out;
  std::memcpy(&out, &u, sizeof(T));
  return out;
}

RawIndex raw_read_index(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path);
  RawIndex r;
  if (std::fread(r.magic, 1, 9, f) != 9) throw std::runtime_error("short read");
  r.version = read_le<uint64_t>(f);
  r.code = read_le<uint8_t>(f);
  r.n = read_le<uint64_t>(f);
  r.d = read_le<uint64_t>(f);
  for (uint64_t i = 0; i < r.n; i++) r.sizes.push_back(read_le<int32_t>(f));
  for (uint64_t i = 0; i < r.n; i++) r.pointers.push_back(read_le<int64_t>(f));
  for (uint64_t i = 0; i < r.d; i++) r.doc_idx.push_back(read_le<int64_t>(f));
  r.file_size = std::ftell(f);
  std::fseek(f, 0, SEEK_END);
  EXPECT_EQ(std::ftell(f), r.file_size) << "index has trailing bytes";
  std::fclose(f);
  return r;
}

// Sequence i of PREFIX.bin decoded per the dtype code (Megatron's numbering).
std::vector<double> raw_read_sequence(const std::string& bin, const RawIndex& idx, size_t i) {
  FILE* f = std::fopen(bin.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + bin);
  std::fseek(f, (long)idx.pointers[i], SEEK_SET);
  std::vector<double> out;
  for (int32_t k = 0; k < idx.sizes[i]; k++) {
    switch (idx.code) {
      case 1: out.push_back(read_le<uint8_t>(f)); break;
      case 2: out.push_back(read_le<int8_t>(f)); break;
      case 3: out.push_back(read_le<int16_t>(f)); break;
      case 4: out.push_back(read_le<int32_t>(f)); break;
      case 5: out.push_back((double)read_le<int64_t>(f)); break;
      case 6: out.push_back(read_le<double>(f)); break;
      case 7: out.push_back(read_le<float>(f)); break;
      case 8: out.push_back(read_le<uint16_t>(f)); break;
      default: throw std::runtime_error("bad code");
    }
  }
  std::fclose(f);
  return out;
}

long file_size(const std::string& path) { return (long)fs::file_size(path); }

// Deterministic test sequences whose values lie in [lo, hi]; includes an empty sequence.
std::vector<std::vector<int32_t>> make_sequences(int count, int64_t lo, int64_t hi, uint64_t salt) {
  std::vector<std::vector<int32_t>> seqs;
  uint64_t x = 0x12345678u + salt;
  auto rnd = [&]() {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return x >> 33;
  };
  for (int s = 0; s < count; s++) {
    const size_t len = s == 3 ? 0 : 1 + rnd() % 37;
    std::vector<int32_t> v(len);
    for (size_t k = 0; k < len; k++) v[k] = (int32_t)(lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)));
    if (len > 0) v[0] = (int32_t)lo, v[len - 1] = (int32_t)hi;  // the extremes of the range
    seqs.push_back(v);
  }
  return seqs;
}

void write_dataset(const std::string& prefix, IndexedDType dtype, const std::vector<std::vector<int32_t>>& seqs) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& s : seqs) {
    w.add_sequence(s.data(), s.size());
    w.end_document();
  }
  w.finalize();
}

void round_trip(IndexedDType dtype, int64_t lo, int64_t hi) {
  SCOPED_TRACE(indexed_dtype_name(dtype));
  TempDir dir;
  const std::string prefix = dir.file("data");
  const auto seqs = make_sequences(20, lo, hi, (uint64_t)dtype);
  write_dataset(prefix, dtype, seqs);
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
  EXPECT_FALSE(fs::exists(prefix + ".idx.tmp"));

  // Independent reader: every header field and array as Megatron defines them.
  const RawIndex raw = raw_read_index(prefix + ".idx");
  EXPECT_EQ(std::memcmp(raw.magic, "MMIDIDX\0\0", 9), 0);
  EXPECT_EQ(raw.version, 1u);
  EXPECT_EQ(raw.code, (uint8_t)dtype);
  ASSERT_EQ(raw.n, seqs.size());
  ASSERT_EQ(raw.d, seqs.size() + 1);
  const size_t item = indexed_dtype_size(dtype);
  int64_t ptr = 0;
  for (size_t i = 0; i < seqs.size(); i++) {
    EXPECT_EQ(raw.sizes[i], (int32_t)seqs[i].size());
    EXPECT_EQ(raw.pointers[i], ptr);
    ptr += (int64_t)seqs[i].size() * (int64_t)item;
  }
  EXPECT_EQ(file_size(prefix + ".bin"), ptr);
  EXPECT_EQ(raw.file_size, (long)(34 + 12 * raw.n + 8 * raw.d));
  for (size_t k = 0; k < raw.d; k++) EXPECT_EQ(raw.doc_idx[k], (int64_t)k);

  const IndexedDataset ds = IndexedDataset::open(prefix);
  ASSERT_EQ(ds.size(), seqs.size());
  EXPECT_EQ(ds.dtype(), dtype);
  EXPECT_EQ(ds.document_index(), raw.doc_idx);
  for (size_t i = 0; i < seqs.size(); i++) {
    ASSERT_EQ(ds.length(i), seqs[i].size());
    std::vector<int32_t> got(ds.length(i), -7);
    ds.read(i, got.data());
    EXPECT_EQ(got, seqs[i]) << "sequence " << i;
    const std::vector<double> indep = raw_read_sequence(prefix + ".bin", raw, i);
    ASSERT_EQ(indep.size(), got.size());
    for (size_t k = 0; k < got.size(); k++) EXPECT_EQ(indep[k], (double)got[k]) << i << "," << k;
  }
}

}  // namespace

TEST(IndexedDataset, RoundTripUint16) { round_trip(IndexedDType::u16, 0, 65535); }
TEST(IndexedDataset, RoundTripInt32) { round_trip(IndexedDType::i32, INT32_MIN, INT32_MAX); }
TEST(IndexedDataset, RoundTripUint8) { round_trip(IndexedDType::u8, 0, 255); }
TEST(IndexedDataset, RoundTripOtherDtypes) {
  round_trip(IndexedDType::i8, -128, 127);
  round_trip(IndexedDType::i16, -32768, 32767);
  round_trip(IndexedDType::i64, INT32_MIN, INT32_MAX);
  round_trip(IndexedDType::f32, -(1 << 24), 1 << 24);
  round_trip(IndexedDType::f64, INT32_MIN, INT32_MAX);
}

TEST(IndexedDataset, MultiSequenceDocumentsAndRanges) {
  TempDir dir;
  const std::string prefix = dir.file("docs");
  IndexedDatasetWriter w(prefix, IndexedDType::u16);
  const std::vector<int32_t> a{1, 2, 3}, b{4, 5}, c{6};
  w.add_sequence(a.data(), a.size());
  w.add_sequence(b.data(), b.size());
  w.end_document();
  w.add_sequence(c.data(), c.size());
  w.end_document();
  EXPECT_EQ(w.sequences(), 3u);
  EXPECT_EQ(w.elements(), 6u);
  EXPECT_EQ(w.documents(), 2u);
  w.finalize();
  const IndexedDataset ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.document_index(), (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(ds.elements(), 6u);
  int32_t out[2] = {0, 0};
  ds.read(0, 1, 2, out);
  EXPECT_EQ(out[0], 2);
  EXPECT_EQ(out[1], 3);
  EXPECT_THROW(ds.read(0, 2, 2, out), Error);
  EXPECT_THROW(ds.read(3, out), Error);
  EXPECT_THROW(ds.length(3), Error);
}

// A sequence larger than the writer's 1 MiB buffer, between small ones: the byte stream stays in order.
TEST(IndexedDataset, LargeSequenceBypassesBuffer) {
  TempDir dir;
  const std::string prefix = dir.file("large");
  std::vector<std::vector<int32_t>> seqs{{7, 8, 9}, std::vector<int32_t>(700000), {10, 11}};
  for (size_t k = 0; k < seqs[1].size(); k++) seqs[1][k] = (int32_t)(k * 7919 % 65536);
  write_dataset(prefix, IndexedDType::u16, seqs);
  const IndexedDataset ds = IndexedDataset::open(prefix);
  const RawIndex raw = raw_read_index(prefix + ".idx");
  for (size_t i = 0; i < seqs.size(); i++) {
    std::vector<int32_t> got(ds.length(i));
    ds.read(i, got.data());
    EXPECT_EQ(got, seqs[i]);
    const std::vector<double> indep = raw_read_sequence(prefix + ".bin", raw, i);
    ASSERT_EQ(indep.size(), seqs[i].size());
    for (size_t k = 0; k < indep.size(); k++) ASSERT_EQ(indep[k], (double)seqs[i][k]);
  }
}

// uint8 values (loss masks) are written as they are, without an int32 copy; a long uint8 sequence
// crosses the 1 MiB buffer several times; a value that does not fit leaves the file unchanged.
TEST(IndexedDataset, Uint8SequencesAndLongOnesInPieces) {
  TempDir dir;
  const std::string prefix = dir.file("mask");
  std::vector<uint8_t> a(3u << 20), b = {0, 1, 1};
  for (size_t k = 0; k < a.size(); k++) a[k] = (uint8_t)(k * 31 % 251);
  {
    IndexedDatasetWriter w(prefix, IndexedDType::u8);
    w.add_sequence(b.data(), b.size());
    w.end_document();
    w.add_sequence(a.data(), a.size());
    w.end_document();
    IndexedDatasetWriter narrow(dir.file("i8"), IndexedDType::i8);
    const std::vector<uint8_t> big = {1, 200};
    EXPECT_THROW(narrow.add_sequence(big.data(), big.size()), Error);
    EXPECT_EQ(narrow.elements(), 0u);
    w.finalize();
  }
  const IndexedDataset ds = IndexedDataset::open(prefix);
  ASSERT_EQ(ds.size(), 2u);
  std::vector<int32_t> got(ds.length(1));
  ds.read(1, got.data());
  ASSERT_EQ(got.size(), a.size());
  for (size_t k = 0; k < a.size(); k++) ASSERT_EQ(got[k], a[k]) << k;
  got.resize(3);
  ds.read(0, got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 1}));
}

TEST(IndexedDataset, EmptyDataset) {
  TempDir dir;
  const std::string prefix = dir.file("empty");
  IndexedDatasetWriter(prefix, IndexedDType::u16).finalize();
  const IndexedDataset ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.size(), 0u);
  EXPECT_EQ(ds.document_index(), (std::vector<int64_t>{0}));
  EXPECT_EQ(file_size(prefix + ".bin"), 0);
}

TEST(IndexedDataset, ValueOutOfRangeIsError) {
  TempDir dir;
  struct Case {
    IndexedDType dtype;
    int32_t value;
  };
  for (const Case c : {Case{IndexedDType::u16, 65536}, Case{IndexedDType::u16, -1}, Case{IndexedDType::u8, 256},
                       Case{IndexedDType::i8, -129}, Case{IndexedDType::i16, 40000},
                       Case{IndexedDType::f32, (1 << 24) + 1}}) {
    const std::string prefix = dir.file(std::string("range_") + indexed_dtype_name(c.dtype));
    IndexedDatasetWriter w(prefix, c.dtype);
    const std::vector<int32_t> v{1, 2, c.value};
    try {
      w.add_sequence(v.data(), v.size());
      ADD_FAILURE() << "no error for " << c.value << " as " << indexed_dtype_name(c.dtype);
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(prefix + ".bin"), std::string::npos) << msg;
      EXPECT_NE(msg.find("element 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("does not fit"), std::string::npos) << msg;
    }
    EXPECT_EQ(w.sequences(), 0u);  // the bad sequence was not recorded
  }
}

TEST(IndexedDataset, WriterLifecycle) {
  TempDir dir;
  const std::string prefix = dir.file("life");
  {
    IndexedDatasetWriter w(prefix, IndexedDType::i32);
    const std::vector<int32_t> v{1, 2, 3};
    w.add_sequence(v.data(), v.size());
    w.end_document();
    EXPECT_TRUE(fs::exists(prefix + ".bin.tmp"));
    EXPECT_FALSE(fs::exists(prefix + ".bin"));
    EXPECT_FALSE(fs::exists(prefix + ".idx"));
  }  // abandoned: temporaries removed, nothing published
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
  EXPECT_FALSE(fs::exists(prefix + ".bin"));
  EXPECT_FALSE(fs::exists(prefix + ".idx"));

  IndexedDatasetWriter w(prefix, IndexedDType::i32);
  w.finalize();
  EXPECT_THROW(w.finalize(), Error);
  const std::vector<int32_t> v{1};
  EXPECT_THROW(w.add_sequence(v.data(), 1), Error);
  EXPECT_THROW(IndexedDatasetWriter(dir.file("no/such/dir/x"), IndexedDType::i32), Error);
}

// ---- Malformed files: each gives an Error naming the offending file. ----
namespace {

void patch(const std::string& path, long offset, const void* bytes, size_t n) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  f.seekp(offset);
  f.write(static_cast<const char*>(bytes), (std::streamsize)n);
}

template <typename T>
void patch_value(const std::string& path, long offset, T v) {
  patch(path, offset, &v, sizeof(T));
}

void expect_open_error(const std::string& prefix, const std::string& file, const std::string& reason) {
  try {
    IndexedDataset::open(prefix);
    ADD_FAILURE() << "no error; expected one naming " << file << " with '" << reason << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find(reason), std::string::npos) << msg;
  }
}

// 3 sequences of 4, 5, 6 uint16 elements: sizes at 34, pointers at 46, doc_idx at 70, 102 bytes.
struct Malformed : ::testing::Test {
  TempDir dir;
  std::string prefix = dir.file("bad"), idx = prefix + ".idx", bin = prefix + ".bin";
  void SetUp() override {
    write_dataset(prefix, IndexedDType::u16, {{1, 2, 3, 4}, {5, 6, 7, 8, 9}, {10, 11, 12, 13, 14, 15}});
    ASSERT_EQ(file_size(idx), 34 + 12 * 3 + 8 * 4);
    ASSERT_NO_THROW(IndexedDataset::open(prefix));
  }
};

}  // namespace

TEST_F(Malformed, BadMagic) {
  patch(idx, 0, "XMIDIDX", 7);
  expect_open_error(prefix, idx, "bad magic");
}
TEST_F(Malformed, WrongVersion) {
  patch_value<uint64_t>(idx, 9, 2);
  expect_open_error(prefix, idx, "version 2");
}
TEST_F(Malformed, UnknownDtype) {
  patch_value<uint8_t>(idx, 17, 9);
  expect_open_error(prefix, idx, "unknown dtype code 9");
  patch_value<uint8_t>(idx, 17, 0);
  expect_open_error(prefix, idx, "unknown dtype code 0");
}
TEST_F(Malformed, TruncatedIndex) {
  fs::resize_file(idx, file_size(idx) - 1);
  expect_open_error(prefix, idx, "truncated");
  fs::resize_file(idx, 20);
  expect_open_error(prefix, idx, "truncated header");
}
TEST_F(Malformed, HugeCounts) {
  patch_value<uint64_t>(idx, 18, ~uint64_t(0));
  expect_open_error(prefix, idx, "sequence count");
}
TEST_F(Malformed, TrailingBytes) {
  std::ofstream(idx, std::ios::app | std::ios::binary) << "xyz";
  expect_open_error(prefix, idx, "trailing bytes");
}
TEST_F(Malformed, PointerBeyondBin) {
  patch_value<int64_t>(idx, 46 + 8 * 2, 1000);
  expect_open_error(prefix, idx, "outside");
  patch_value<int64_t>(idx, 46 + 8 * 2, -2);
  expect_open_error(prefix, idx, "outside");
}
TEST_F(Malformed, SequenceEndsBeyondBin) {
  patch_value<int32_t>(idx, 34 + 4 * 2, 100);  // last sequence claims 100 elements
  expect_open_error(prefix, idx, "beyond the end");
}
TEST_F(Malformed, SizesPointersInconsistent) {
  patch_value<int32_t>(idx, 34, 3);  // sizes[0] = 3, but pointers[1] still says 8 bytes
  expect_open_error(prefix, idx, "inconsistent");
}
TEST_F(Malformed, NegativeSize) {
  patch_value<int32_t>(idx, 34 + 4, -5);
  expect_open_error(prefix, idx, "negative");
}
TEST_F(Malformed, BinSizeMismatch) {
  std::ofstream(bin, std::ios::app | std::ios::binary) << "zz";
  expect_open_error(prefix, bin, "expected 30");
  fs::resize_file(bin, 28);
  expect_open_error(prefix, bin, "beyond the end");  // the last sequence no longer fits
}
TEST_F(Malformed, MissingBin) {
  fs::remove(bin);
  expect_open_error(prefix, bin, "cannot open");
}
TEST_F(Malformed, DocumentIndex) {
  patch_value<int64_t>(idx, 70, 1);
  expect_open_error(prefix, idx, "doc_idx[0] = 1");
  patch_value<int64_t>(idx, 70, 0);
  patch_value<int64_t>(idx, 70 + 8 * 2, 4);
  expect_open_error(prefix, idx, "outside");
  patch_value<int64_t>(idx, 70 + 8 * 2, 0);
  expect_open_error(prefix, idx, "non-decreasing");
}

TEST(IndexedDataset, Int64ValueOutsideInt32IsReadError) {
  TempDir dir;
  const std::string prefix = dir.file("wide");
  write_dataset(prefix, IndexedDType::i64, {{1, 2, 3}});
  patch_value<int64_t>(prefix + ".bin", 8, int64_t(1) << 40);
  const IndexedDataset ds = IndexedDataset::open(prefix);
  std::vector<int32_t> out(3);
  try {
    ds.read(0, out.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(prefix + ".bin"), std::string::npos) << e.what();
  }
}
