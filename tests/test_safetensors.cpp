// Tests for core/mmap, io/safetensors (reader, writer, validation of malformed files built by
// hand byte by byte) and io/model_files (single-file and sharded HF model directories).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/huge_pages.h"
#include "core/mmap.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "temp_dir.h"
#include "train/checkpoint.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

using TempDir = moetron::testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

// A safetensors file from a literal header and data section.
std::string st_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// Expects `fn` to throw Error whose message contains every one of `parts`.
template <typename Fn>
void expect_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
  }
}

// Writes `header`+`data` to a file and expects opening it to fail naming the file and `parts`.
void expect_bad_file(const std::string& header, const std::string& data,
                     std::initializer_list<std::string> parts) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_bytes(path, st_bytes(header, data));
  try {
    SafetensorsFile::open(path);
    ADD_FAILURE() << "expected an Error for header " << header;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "message lacks the path: " << msg;
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
  }
}

const std::string k8(8, '\x01');  // 8 data bytes

}  // namespace

// ---------------------------------------------------------------------------------------------
// MappedFile

TEST(MappedFile, MapsContents) {
  TempDir dir;
  write_bytes(dir.file("a"), "hello");
  MappedFile m = MappedFile::open(dir.file("a"));
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.data()), 5), "hello");
  EXPECT_EQ(m.path(), dir.file("a"));
  MappedFile moved = std::move(m);
  EXPECT_EQ(moved.size(), 5u);
  EXPECT_EQ(moved.data()[4], 'o');
}

TEST(MappedFile, KeepFdHoldsTheMappedFileOpenUntilReleased) {
  TempDir dir;
  write_bytes(dir.file("a"), "hello");
  EXPECT_EQ(MappedFile::open(dir.file("a")).fd(), -1);
  int fd = -1;
  {
    MappedFile m = MappedFile::open(dir.file("a"), /*keep_fd=*/true);
    fd = m.fd();
    ASSERT_GE(fd, 0);
    MappedFile moved = std::move(m);
    EXPECT_EQ(m.fd(), -1);
    EXPECT_EQ(moved.fd(), fd);
    char c = 0;
    EXPECT_EQ(::pread(fd, &c, 1, 1), 1);
    EXPECT_EQ(c, 'e');
  }
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);  // closed with the mapping
  EXPECT_EQ(errno, EBADF);
}

TEST(MappedFile, EmptyFileIsFine) {
  TempDir dir;
  write_bytes(dir.file("empty"), "");
  MappedFile m = MappedFile::open(dir.file("empty"));
  EXPECT_EQ(m.size(), 0u);
}

TEST(MappedFile, MissingFileNamesPathAndReason) {
  TempDir dir;
  expect_error([&] { MappedFile::open(dir.file("nope")); },
               {dir.file("nope"), "No such file or directory"});
}

TEST(MappedFile, DirectoryIsAnError) {
  TempDir dir;
  expect_error([&] { MappedFile::open(dir.path().string()); },
               {dir.path().string(), "directory"});
}

// Bytes mapped by 2 MiB pages, counted from smaps text: only the mappings inside the range, and
// only their FilePmdMapped lines (not AnonHugePages, not a path that looks like a field).
TEST(MappedFile, FileHugeMappedBytesCountsTheMappingsInsideTheRange) {
  const std::string smaps =
      "7f0000000000-7f0000400000 r--p 00000000 fe:00 123   /models/a b/model.safetensors\n"
      "Size:               4096 kB\n"
      "FilePmdMapped:      2048 kB\n"
      "AnonHugePages:      2048 kB\n"
      "7f0000400000-7f0000600000 r--p 00400000 fe:00 123   /models/FilePmdMapped: 9 kB\n"
      "FilePmdMapped:      2048 kB\n"
      "7f0000600000-7f0000800000 rw-p 00000000 00:00 0\n"
      "FilePmdMapped:      4096 kB\n"
      "VmFlags: rd mr mw me hg\n";
  EXPECT_EQ(file_huge_mapped_bytes(smaps, 0x7f0000000000, 0x7f0000600000), size_t{4} << 20);
  EXPECT_EQ(file_huge_mapped_bytes(smaps, 0x7f0000000000, 0x7f0000400000), size_t{2} << 20);
  EXPECT_EQ(file_huge_mapped_bytes(smaps, 0x7f0000400000, 0x7f0000800000), size_t{6} << 20);
  EXPECT_EQ(file_huge_mapped_bytes(smaps, 0x7f0000100000, 0x7f0000500000), 0u);  // no mapping wholly inside
  EXPECT_EQ(file_huge_mapped_bytes("", 0, ~uintptr_t{0}), 0u);
}

// Advice, counting and (where the kernel gives this file 2 MiB pages) dropping and re-reading the
// windows change no byte of the mapping; the windows counted are the whole, aligned 2 MiB ones the
// ranges touch, short of the file's partial last one.
TEST(MappedFile, HugePagesKeepEveryByte) {
  TempDir dir;
  constexpr size_t kMiB = size_t{1} << 20;
  std::string bytes(9 * kMiB + 123, '\0');
  for (size_t i = 0; i < bytes.size(); i++) bytes[i] = static_cast<char>((i * 2654435761u) >> 13);
  write_bytes(dir.file("w"), bytes);
  {  // written back and dropped, then read in small pieces: the page cache holds small folios
    const int fd = ::open(dir.file("w").c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    char page[4096];
    for (size_t at = 0; at < bytes.size(); at += sizeof(page)) ASSERT_GT(::pread(fd, page, sizeof(page), (off_t)at), 0);
    ::close(fd);
  }
  MappedFile m = MappedFile::open(dir.file("w"), /*keep_fd=*/true);
  m.advise_huge_pages();
  EXPECT_EQ(std::memcmp(m.data(), bytes.data(), bytes.size()), 0);
  // Two ranges: [1 MiB, 3 MiB) touches windows 0-1, [5 MiB + 1, end) windows 2-3 (window 4 is partial).
  const std::pair<size_t, size_t> ranges[] = {{kMiB, 2 * kMiB}, {5 * kMiB + 1, bytes.size() - 5 * kMiB - 1}};
  const MappedFile::HugePages h = m.back_with_huge_pages(ranges);
  EXPECT_EQ(h.windows, 8 * kMiB);
  EXPECT_LE(h.huge, size_t{10} * kMiB);
  EXPECT_EQ(h.huge % (2 * kMiB), 0u);
  if (h.reread) {
    EXPECT_GE(h.huge, 2 * kMiB);
  }
  std::printf("2 MiB pages: %zu of %zu bytes%s\n", h.huge, h.windows, h.reread ? " (re-read)" : "");
  EXPECT_EQ(std::memcmp(m.data(), bytes.data(), bytes.size()), 0);
  // Without the descriptor it only counts: nothing dropped.
  MappedFile plain = MappedFile::open(dir.file("w"));
  EXPECT_FALSE(plain.back_with_huge_pages(ranges).reread);
  EXPECT_EQ(std::memcmp(plain.data(), bytes.data(), bytes.size()), 0);
  // Ranges past the end, or empty, count nothing.
  const std::pair<size_t, size_t> bad[] = {{bytes.size(), 1}, {0, 0}, {kMiB, ~size_t{0}}};
  EXPECT_EQ(m.back_with_huge_pages(bad).windows, 0u);
}

// Buffers from 2 MiB up start on a 2 MiB boundary (where a 2 MiB page can map them); a vector of
// them value-initializes and copies as any vector.
TEST(HugePageAllocator, LargeBuffersAreAlignedAndZeroed) {
  HugeVector<int8_t> big(3 * (size_t{1} << 20) + 5);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % (size_t{2} << 20), 0u);
  EXPECT_TRUE(std::all_of(big.begin(), big.end(), [](int8_t v) { return v == 0; }));
  for (size_t i = 0; i < big.size(); i++) big[i] = static_cast<int8_t>(i);
  const HugeVector<int8_t> copy = big;
  EXPECT_EQ(copy[big.size() - 1], static_cast<int8_t>(big.size() - 1));
  HugeVector<uint16_t> small(100, 7);
  EXPECT_EQ(small[99], 7);
  small.resize(2 << 20, 1);  // crosses to the mapped kind
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % (size_t{2} << 20), 0u);
  EXPECT_EQ(small[99], 7);
  EXPECT_EQ(small.back(), 1);
}

// ---------------------------------------------------------------------------------------------
// Writer -> reader

TEST(Safetensors, RoundTripAllDTypes) {
  TempDir dir;
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, 7.0f};
  const std::vector<uint16_t> f16 = {0x3C00, 0xC000, 0x7C00};
  const std::vector<uint16_t> bf16 = {0x3F80, 0xBF80, 0x7FC0, 0x0001};
  const std::vector<int32_t> i32 = {-1, 2, 2147483647};
  const std::vector<int64_t> i64 = {-5, int64_t{1} << 50};
  const std::vector<uint8_t> u8 = {0, 200, 255};
  const std::vector<uint8_t> b = {1, 0};
  SafetensorsWriter w;
  w.add("w.f32", DType::F32, {2, 3}, f32.data());
  w.add("w.f16", DType::F16, {3}, f16.data());
  w.add("w.bf16", DType::BF16, {2, 1, 2}, bf16.data());
  w.add("ids.i32", DType::I32, {3}, i32.data());
  w.add("ids.i64", DType::I64, {2}, i64.data());
  w.add("u8", DType::U8, {3, 1}, u8.data());
  w.add("mask", DType::BOOL, {2}, b.data());
  w.set_metadata("format", "pt");
  w.set_metadata("note", "héllo \"quoted\"");
  const std::string path = dir.file("all.safetensors");
  w.write(path);

  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "héllo \"quoted\"");
  const std::vector<std::string> expected_names = {"ids.i32", "ids.i64", "mask", "u8",
                                                   "w.bf16",  "w.f16",   "w.f32"};
  EXPECT_EQ(f.names(), expected_names);

  auto check = [&](const std::string& name, DType dt, std::vector<int64_t> shape,
                   const void* data, size_t nbytes) {
    const TensorView& t = f.get(name);
    EXPECT_EQ(t.name, name);
    EXPECT_EQ(t.dtype, dt) << name;
    EXPECT_EQ(t.shape, shape) << name;
    ASSERT_EQ(t.nbytes, nbytes) << name;
    EXPECT_EQ(std::memcmp(t.data, data, nbytes), 0) << name;
    EXPECT_EQ(t.file, path);
  };
  check("w.f32", DType::F32, {2, 3}, f32.data(), 24);
  check("w.f16", DType::F16, {3}, f16.data(), 6);
  check("w.bf16", DType::BF16, {2, 1, 2}, bf16.data(), 8);
  check("ids.i32", DType::I32, {3}, i32.data(), 12);
  check("ids.i64", DType::I64, {2}, i64.data(), 16);
  check("u8", DType::U8, {3, 1}, u8.data(), 3);
  check("mask", DType::BOOL, {2}, b.data(), 2);
  EXPECT_EQ(f.get("w.f32").numel(), 6);

  EXPECT_EQ(to_f32(f.get("w.f32")), f32);
  EXPECT_EQ(to_f32(f.get("w.f16")),
            (std::vector<float>{1.0f, -2.0f, std::numeric_limits<float>::infinity()}));
  EXPECT_EQ(to_i64(f.get("ids.i32")), (std::vector<int64_t>{-1, 2, 2147483647}));
  EXPECT_EQ(to_i64(f.get("ids.i64")), i64);
  EXPECT_EQ(to_i64(f.get("u8")), (std::vector<int64_t>{0, 200, 255}));
  EXPECT_EQ(to_i64(f.get("mask")), (std::vector<int64_t>{1, 0}));
}

TEST(Safetensors, AddF32ConvertsToStorage) {
  TempDir dir;
  std::vector<float> v(3000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * static_cast<float>(i) - 1.3f;
  SafetensorsWriter w;
  w.add_f32("a", {3000}, v.data(), DType::BF16);
  w.add_f32("b", {30, 100}, v.data(), DType::F16);
  w.add_f32("c", {3, 1000}, v.data());
  EXPECT_EQ(w.data_bytes(), 3000u * 8);
  w.write(dir.file("x.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(dir.file("x.safetensors"));
  EXPECT_EQ(f.get("a").dtype, DType::BF16);
  EXPECT_EQ(f.get("b").dtype, DType::F16);
  EXPECT_EQ(f.get("c").dtype, DType::F32);
  const std::vector<float> a = to_f32(f.get("a")), b = to_f32(f.get("b")), c = to_f32(f.get("c"));
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(a[i], bf16_to_f32(f32_to_bf16(v[i])));
    ASSERT_EQ(b[i], f16_to_f32(f32_to_f16(v[i])));
    ASSERT_EQ(c[i], v[i]);
  }
}

TEST(Safetensors, ScalarAndEmptyTensors) {
  TempDir dir;
  const float loss = 2.5f;
  SafetensorsWriter w;
  w.add("loss", DType::F32, {}, &loss);
  w.add("empty", DType::F32, {0, 4}, nullptr);
  w.add("empty2", DType::I64, {3, 0}, nullptr);
  w.write(dir.file("s.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(dir.file("s.safetensors"));
  const TensorView& s = f.get("loss");
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(to_f32(s), std::vector<float>{2.5f});
  EXPECT_EQ(f.get("empty").numel(), 0);
  EXPECT_EQ(f.get("empty").nbytes, 0u);
  EXPECT_EQ(f.get("empty").shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(to_f32(f.get("empty")).empty());
  EXPECT_TRUE(to_i64(f.get("empty2")).empty());
}

TEST(Safetensors, NoTensorsAtAll) {
  TempDir dir;
  SafetensorsWriter().write(dir.file("none.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(dir.file("none.safetensors"));
  EXPECT_TRUE(f.names().empty());
  EXPECT_TRUE(f.metadata().empty());
}

TEST(Safetensors, HeaderLayoutMatchesTheReferenceLibrary) {
  TempDir dir;
  const float x[2] = {1, 2}, y[1] = {3};
  SafetensorsWriter w;
  w.add("zeta", DType::F32, {2}, x);
  w.add("Alpha", DType::F32, {1}, y);
  w.set_metadata("format", "pt");
  w.write(dir.file("h.safetensors"));
  const std::string bytes = read_bytes(dir.file("h.safetensors"));
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1),
            R"({"__metadata__":{"format":"pt"},"Alpha":{"dtype":"F32","shape":[1],)"
            R"("data_offsets":[0,4]},"zeta":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})");
  EXPECT_EQ(bytes.size(), 8 + n + 12);
  float data[3];
  std::memcpy(data, bytes.data() + 8 + n, 12);
  EXPECT_EQ(data[0], 3.0f);  // "Alpha" sorts first, so its data comes first
  EXPECT_EQ(data[2], 2.0f);
  EXPECT_FALSE(fs::exists(dir.file("h.safetensors.tmp")));
}

TEST(Safetensors, ReadsHandWrittenFileWithUnpaddedHeader) {
  // As another writer might produce it: no padding, no metadata, keys in any order.
  TempDir dir;
  const std::string header =
      R"({"b":{"data_offsets":[4,6],"shape":[1],"dtype":"BF16"},)"
      R"("a":{"dtype":"I32","shape":[],"data_offsets":[0,4]}})";
  std::string data(6, '\0');
  const int32_t seven = 7;
  std::memcpy(data.data(), &seven, 4);
  data[4] = '\x80';
  data[5] = '\x3f';  // bf16 1.0 little-endian
  write_bytes(dir.file("h.safetensors"), st_bytes(header, data));
  SafetensorsFile f = SafetensorsFile::open(dir.file("h.safetensors"));
  EXPECT_EQ(to_i64(f.get("a")), std::vector<int64_t>{7});
  EXPECT_EQ(to_f32(f.get("b")), std::vector<float>{1.0f});
}

TEST(Safetensors, OverwriteAndMovedFileKeepViews) {
  TempDir dir;
  const float a[1] = {1}, b[1] = {2};
  SafetensorsWriter w1;
  w1.add("t", DType::F32, {1}, a);
  w1.write(dir.file("o.safetensors"));
  SafetensorsWriter w2;
  w2.add("t", DType::F32, {1}, b);
  w2.write(dir.file("o.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(dir.file("o.safetensors"));
  const TensorView* view = f.find("t");
  SafetensorsFile moved = std::move(f);
  EXPECT_EQ(moved.find("t"), view);
  EXPECT_EQ(to_f32(*view), std::vector<float>{2.0f});
}

TEST(Safetensors, AddCopyOwnsItsBytes) {
  TempDir dir;
  SafetensorsWriter w;
  {
    std::vector<int32_t> tmp = {4, 5};
    w.add_copy("t", DType::I32, {2}, tmp.data());
    tmp.assign({0, 0});
  }
  w.write(dir.file("c.safetensors"));
  EXPECT_EQ(to_i64(SafetensorsFile::open(dir.file("c.safetensors")).get("t")),
            (std::vector<int64_t>{4, 5}));
}

TEST(Safetensors, WriterRejectsBadInput) {
  const float x[1] = {0};
  SafetensorsWriter w;
  w.add("a", DType::F32, {1}, x);
  expect_error([&] { w.add("a", DType::F32, {1}, x); }, {"'a'", "twice"});
  expect_error([&] { w.add("neg", DType::F32, {-1}, x); }, {"'neg'", "negative"});
  expect_error([&] { w.add("null", DType::F32, {1}, nullptr); }, {"'null'", "null"});
  expect_error([&] { w.add("__metadata__", DType::F32, {1}, x); }, {"__metadata__"});
  expect_error([&] { w.add("", DType::F32, {1}, x); }, {"empty"});
  expect_error([&] { w.add_f32("i", {1}, x, DType::I32); }, {"'i'", "I32"});
  expect_error([&] { w.add("big", DType::F32, {int64_t{1} << 40, int64_t{1} << 40}, x); },
               {"'big'", "overflow"});
}

TEST(Safetensors, WriteToMissingDirectoryFailsCleanly) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/x.safetensors");
  SafetensorsWriter w;
  expect_error([&] { w.write(path); }, {path});
  EXPECT_FALSE(fs::exists(path));
}

// ---------------------------------------------------------------------------------------------
// Reader helpers

TEST(Safetensors, GetMissingTensorNamesFileAndTensor) {
  TempDir dir;
  SafetensorsWriter().write(dir.file("e.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(dir.file("e.safetensors"));
  EXPECT_EQ(f.find("x"), nullptr);
  expect_error([&] { f.get("x"); }, {dir.file("e.safetensors") + ": tensor 'x' not found"});
}

TEST(Safetensors, ReadF32ChecksDTypeAndNumel) {
  TempDir dir;
  const float v[6] = {0, 1, 2, 3, 4, 5};
  const int32_t ids[2] = {1, 2};
  SafetensorsWriter w;
  w.add_f32("w", {3, 2}, v, DType::BF16);
  w.add("ids", DType::I32, {2}, ids);
  w.write(dir.file("r.safetensors"));
  const std::string path = dir.file("r.safetensors");
  SafetensorsFile f = SafetensorsFile::open(path);
  float out[6];
  read_f32(f.get("w"), out, 6);
  EXPECT_EQ(out[5], 5.0f);
  expect_error([&] { read_f32(f.get("w"), out, 5); }, {path, "'w'", "6", "5"});
  expect_error([&] { read_f32(f.get("ids"), out, 2); }, {path, "'ids'", "I32"});
  expect_error([&] { to_f32(f.get("ids")); }, {path, "'ids'", "I32"});
  expect_error([&] { to_i64(f.get("w")); }, {path, "'w'", "BF16"});
}

TEST(Safetensors, ReadF32Rows) {
  TempDir dir;
  std::vector<float> v(4 * 3);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  const float s = 1;
  SafetensorsWriter w;
  w.add_f32("m", {4, 3}, v.data(), DType::F16);
  w.add_f32("s", {}, &s);
  w.write(dir.file("rows.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(dir.file("rows.safetensors"));
  float out[6] = {};
  read_f32_rows(f.get("m"), 1, 3, out);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], static_cast<float>(3 + i));
  read_f32_rows(f.get("m"), 4, 4, out);  // empty range is fine
  expect_error([&] { read_f32_rows(f.get("m"), 2, 5, out); }, {"'m'", "[2, 5)"});
  expect_error([&] { read_f32_rows(f.get("m"), -1, 1, out); }, {"'m'"});
  expect_error([&] { read_f32_rows(f.get("s"), 0, 1, out); }, {"'s'", "0-d"});
}

TEST(Safetensors, ReadStoredBytes) {
  TempDir dir;
  std::vector<uint16_t> a(3 * 1000), b(7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint16_t>(i * 7 + 1);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(60000 + i);
  SafetensorsWriter w;
  w.add("b", DType::BF16, {7}, b.data());  // first in the file: "a" starts at a non-zero offset
  w.add("a", DType::BF16, {3, 1000}, a.data());
  const std::string path = dir.file("bytes.safetensors");
  w.write(path);
  SafetensorsFile f = SafetensorsFile::open(path);
  const TensorView va = f.get("a");
  ASSERT_TRUE(va.mapped);
  // A sub-range read from the file equals the mapped bytes, and the caller's bytes beyond n stay.
  std::vector<uint8_t> out(1000, 0xAB);
  read_stored_bytes(va, 10, 900, out.data());
  EXPECT_EQ(std::memcmp(out.data(), va.data + 10, 900), 0);
  EXPECT_EQ(std::memcmp(out.data(), reinterpret_cast<const uint8_t*>(a.data()) + 10, 900), 0);
  EXPECT_EQ(out[900], 0xAB);
  // A select_index view keeps its place in the file.
  const TensorView row2 = select_index(va, 2);
  std::vector<uint16_t> r(3000);
  read_stored_bytes(row2, 0, row2.nbytes, r.data());
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(r[i], a[2000 + i]) << i;
  read_stored_bytes(f.get("b"), 0, 14, r.data());
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(r[i], b[i]);
  // Ranges: n = 0 anywhere inside is fine (dst untouched), beyond the tensor is an error.
  read_stored_bytes(va, va.nbytes, 0, nullptr);
  expect_error([&] { read_stored_bytes(va, va.nbytes - 1, 2, out.data()); }, {"'a'", "outside its 6000 bytes"});
  expect_error([&] { read_stored_bytes(row2, 1, 2000, out.data()); }, {"'a[2]'", "2000 bytes at offset 1", "outside its 2000 bytes"});
  expect_error([&] { read_stored_bytes(va, SIZE_MAX, 1, out.data()); }, {"'a'", "outside"});
  // A view that is not mapped is copied from memory.
  TensorView heap = va;
  heap.data = reinterpret_cast<const uint8_t*>(a.data());
  heap.mapped = false;
  heap.map_base = nullptr;
  read_stored_bytes(heap, 2, 4, out.data());
  EXPECT_EQ(std::memcmp(out.data(), heap.data + 2, 4), 0);
  heap.map_fd = -1;
  // The path replaced (a new save over it) or removed: the bytes are still the mapped file's, as
  // the mapping's are, not the new file's.
  std::vector<uint16_t> other(a.size(), 7);
  SafetensorsWriter w2;
  w2.add("b", DType::BF16, {7}, b.data());
  w2.add("a", DType::BF16, {3, 1000}, other.data());
  w2.write(path);
  read_stored_bytes(va, 0, 6000, r.data());  // r holds 3000 values now
  EXPECT_EQ(std::memcmp(r.data(), a.data(), 6000), 0);
  EXPECT_EQ(std::memcmp(va.data, a.data(), 6000), 0);
  {
    // The file truncated under its mapping: an error naming it, not a short read (or a SIGBUS).
    const std::string p2 = dir.file("short.safetensors");
    w.write(p2);
    SafetensorsFile g = SafetensorsFile::open(p2);
    std::filesystem::resize_file(p2, 100);
    expect_error([&] { read_stored_bytes(g.get("a"), 5000, 1000, out.data()); }, {p2, "'a'", "ended early"});
  }
  std::filesystem::remove(path);
  read_stored_bytes(va, 4000, 2000, r.data());
  EXPECT_EQ(std::memcmp(r.data(), reinterpret_cast<const uint8_t*>(a.data()) + 4000, 2000), 0);
}

// ---------------------------------------------------------------------------------------------
// Malformed files, one case per test.

TEST(SafetensorsBad, FileShorterThan8Bytes) {
  TempDir dir;
  for (const std::string& bytes : {std::string(), std::string("\x02\0\0", 3)}) {
    write_bytes(dir.file("short.safetensors"), bytes);
    expect_error([&] { SafetensorsFile::open(dir.file("short.safetensors")); },
                 {dir.file("short.safetensors"), "too short"});
  }
}

TEST(SafetensorsBad, HeaderLengthBeyondFile) {
  TempDir dir;
  write_bytes(dir.file("b.safetensors"), le64(100) + "{}");
  expect_error([&] { SafetensorsFile::open(dir.file("b.safetensors")); },
               {dir.file("b.safetensors"), "header length 100"});
  write_bytes(dir.file("b.safetensors"), le64(~uint64_t{0}) + "{}");  // must not overflow
  expect_error([&] { SafetensorsFile::open(dir.file("b.safetensors")); },
               {dir.file("b.safetensors"), "header length"});
}

TEST(SafetensorsBad, HeaderNotJson) { expect_bad_file("{\"a\": ", "", {"not valid JSON"}); }

TEST(SafetensorsBad, HeaderNotObject) { expect_bad_file("[1, 2]  ", "", {"JSON object"}); }

TEST(SafetensorsBad, EntryNotObject) { expect_bad_file(R"({"t": 5})", "", {"'t'", "object"}); }

TEST(SafetensorsBad, MissingDtype) {
  expect_bad_file(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", k8, {"'t'", "missing 'dtype'"});
}

TEST(SafetensorsBad, MissingShape) {
  expect_bad_file(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", k8, {"'t'", "missing 'shape'"});
}

TEST(SafetensorsBad, MissingDataOffsets) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[2]}})", k8, {"'t'", "missing 'data_offsets'"});
}

TEST(SafetensorsBad, DtypeNotString) {
  expect_bad_file(R"({"t":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", k8,
                  {"'t'", "'dtype' must be a string"});
}

TEST(SafetensorsBad, ShapeNotArray) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", k8,
                  {"'t'", "'shape' must be an array"});
}

TEST(SafetensorsBad, ShapeElementNotInteger) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", k8,
                  {"'t'", "'shape'", "2.0"});
  expect_bad_file(R"({"t":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", k8,
                  {"'t'", "'shape'"});
}

TEST(SafetensorsBad, DataOffsetsWrongType) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", k8,
                  {"'t'", "'data_offsets'"});
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":"0,8"}})", k8,
                  {"'t'", "'data_offsets'"});
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", k8,
                  {"'t'", "'data_offsets'"});
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}})", k8,
                  {"'t'", "'data_offsets'"});
}

TEST(SafetensorsBad, UnknownDtype) {
  expect_bad_file(R"({"t":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", k8,
                  {"'t'", "'F64'"});
}

TEST(SafetensorsBad, NegativeDimension) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", k8,
                  {"'t'", "negative dimension -2"});
}

TEST(SafetensorsBad, OffsetsBeginAfterEnd) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", k8,
                  {"'t'", "begin 8 > end 0"});
}

TEST(SafetensorsBad, OffsetsEndBeyondData) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", k8,
                  {"'t'", "end 16", "beyond the data section"});
}

TEST(SafetensorsBad, ByteSizeMismatch) {
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", k8,
                  {"'t'", "span 8 bytes", "needs 12 bytes"});
}

TEST(SafetensorsBad, OverlappingTensors) {
  expect_bad_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  k8, {"'b'", "overlaps", "'a'"});
}

TEST(SafetensorsBad, GapBetweenTensors) {
  expect_bad_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})",
                  k8, {"[4, 6)", "'b'", "not covered"});
}

TEST(SafetensorsBad, GapAtStart) {
  expect_bad_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", k8,
                  {"[0, 4)", "not covered"});
}

TEST(SafetensorsBad, TrailingUncoveredBytes) {
  expect_bad_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", k8,
                  {"4 trailing bytes"});
}

TEST(SafetensorsBad, DuplicateTensorNames) {
  expect_bad_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  k8, {"duplicate tensor name 'a'"});
}

TEST(SafetensorsBad, DuplicateKeyInsideEntry) {
  expect_bad_file(R"({"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})", k8,
                  {"duplicate key 'dtype'"});
}

TEST(SafetensorsBad, MetadataValueNotString) {
  expect_bad_file(R"({"__metadata__":{"format":"pt","n":3}})", "",
                  {"'__metadata__'", "'n'", "must be a string"});
}

TEST(SafetensorsBad, MetadataNotObject) {
  expect_bad_file(R"({"__metadata__":["pt"]})", "", {"'__metadata__'", "object"});
}

TEST(SafetensorsBad, NumelOverflow) {
  // 2^32 * 2^32 elements overflows int64; also 2^62 * 4 bytes overflows the byte count.
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                  k8, {"'t'", "overflows"});
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]}})",
                  k8, {"'t'", "overflows"});
  expect_bad_file(R"({"t":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})",
                  k8, {"'t'", "too large"});
}

// ---------------------------------------------------------------------------------------------
// Model directories

namespace {

struct Model {
  std::vector<std::vector<float>> data;
  std::vector<ModelTensorToWrite> tensors;
};

// Four tensors of 40 / 24 / 400 / 8 bytes in F32, plus one BF16.
Model small_model() {
  Model m;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
      {"model.embed_tokens.weight", {5, 2}},
      {"model.layers.0.input_layernorm.weight", {6}},
      {"model.layers.0.self_attn.q_proj.weight", {10, 10}},
      {"model.norm.weight", {2}},
      {"lm_head.weight", {5, 2}}};
  for (size_t k = 0; k < specs.size(); ++k) {
    int64_t n = 1;
    for (int64_t d : specs[k].second) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    // k + i/4 needs at most 7 significant bits here, so it is exact in bf16 too.
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(k) + 0.25f * static_cast<float>(i);
    m.data.push_back(std::move(v));
  }
  for (size_t k = 0; k < specs.size(); ++k)
    m.tensors.push_back({specs[k].first, k == 4 ? DType::BF16 : DType::F32, specs[k].second,
                         m.data[k].data()});
  return m;
}

void expect_model_matches(const ModelTensors& mt, const Model& m) {
  std::vector<std::string> names;
  for (const auto& t : m.tensors) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(mt.names(), names);
  for (size_t k = 0; k < m.tensors.size(); ++k) {
    const TensorView& t = mt.get(m.tensors[k].name);
    EXPECT_EQ(t.dtype, m.tensors[k].storage);
    EXPECT_EQ(t.shape, m.tensors[k].shape);
    EXPECT_EQ(to_f32(t), m.data[k]) << t.name;  // exact: the values need at most 7 mantissa bits
  }
}

nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(read_bytes(path));
}

}  // namespace

TEST(ModelFiles, SingleFile) {
  TempDir dir;
  const Model m = small_model();
  write_model_safetensors(dir.path().string(), m.tensors);
  EXPECT_TRUE(fs::exists(dir.file("model.safetensors")));
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors.index.json")));
  ModelTensors mt = ModelTensors::open(dir.path().string());
  EXPECT_EQ(mt.num_files(), 1u);
  expect_model_matches(mt, m);
  EXPECT_EQ(SafetensorsFile::open(dir.file("model.safetensors")).metadata().at("format"), "pt");
  EXPECT_EQ(mt.find("nope"), nullptr);
  expect_error([&] { mt.get("nope"); }, {dir.path().string(), "'nope'", "not found"});
}

TEST(ModelFiles, Sharded) {
  TempDir dir;
  const Model m = small_model();
  // Sizes in order: 40, 24, 400, 8, 20 bytes. Limit 64: [40,24] [400 alone] [8,20].
  write_model_safetensors(dir.path().string(), m.tensors, 64);
  for (const char* f : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                        "model-00003-of-00003.safetensors", "model.safetensors.index.json"})
    EXPECT_TRUE(fs::exists(dir.file(f))) << f;
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors")));
  const nlohmann::json index = read_json(dir.file("model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), 40u + 24 + 400 + 8 + 20);
  const auto& wm = index["weight_map"];
  EXPECT_EQ(wm.size(), 5u);
  EXPECT_EQ(wm["model.embed_tokens.weight"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(wm["model.layers.0.input_layernorm.weight"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(wm["model.layers.0.self_attn.q_proj.weight"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(wm["model.norm.weight"], "model-00003-of-00003.safetensors");
  EXPECT_EQ(wm["lm_head.weight"], "model-00003-of-00003.safetensors");

  ModelTensors mt = ModelTensors::open(dir.path().string());
  EXPECT_EQ(mt.num_files(), 3u);
  expect_model_matches(mt, m);
  ModelTensors moved = std::move(mt);
  expect_model_matches(moved, m);
}

TEST(ModelFiles, ResavingRemovesStaleFiles) {
  TempDir dir;
  const Model m = small_model();
  write_model_safetensors(dir.path().string(), m.tensors, 64);
  write_bytes(dir.file("config.json"), "{}");
  write_model_safetensors(dir.path().string(), m.tensors);  // now a single file
  EXPECT_TRUE(fs::exists(dir.file("model.safetensors")));
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(dir.file("model-00001-of-00003.safetensors")));
  EXPECT_TRUE(fs::exists(dir.file("config.json")));  // not ours to touch
  write_model_safetensors(dir.path().string(), m.tensors, 450);  // [40,24] [400,8,20]
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors")));
  EXPECT_TRUE(fs::exists(dir.file("model-00002-of-00002.safetensors")));
  expect_model_matches(ModelTensors::open(dir.path().string()), m);
}

TEST(ModelFiles, DuplicateNameInWriteIsAnError) {
  TempDir dir;
  Model m = small_model();
  m.tensors.push_back(m.tensors[0]);
  expect_error([&] { write_model_safetensors(dir.path().string(), m.tensors); },
               {"'model.embed_tokens.weight'", "twice"});
}

TEST(ModelFiles, NeitherFilePresent) {
  TempDir dir;
  expect_error([&] { ModelTensors::open(dir.path().string()); },
               {dir.path().string(), "model.safetensors", "model.safetensors.index.json"});
}

TEST(ModelFiles, PickleCheckpointGetsConversionHint) {
  TempDir dir;
  write_bytes(dir.file("pytorch_model.bin"), "PK");
  expect_error([&] { ModelTensors::open(dir.path().string()); },
               {dir.path().string(), "pytorch_model.bin", "pickle", "safe_serialization=True"});
}

TEST(ModelFiles, IndexNamesMissingShard) {
  TempDir dir;
  const Model m = small_model();
  write_model_safetensors(dir.path().string(), m.tensors, 64);
  fs::remove(dir.file("model-00002-of-00003.safetensors"));
  expect_error([&] { ModelTensors::open(dir.path().string()); },
               {"model.safetensors.index.json", "model-00002-of-00003.safetensors", "not found"});
}

TEST(ModelFiles, IndexListsTensorMissingFromShard) {
  TempDir dir;
  const Model m = small_model();
  write_model_safetensors(dir.path().string(), m.tensors, 64);
  nlohmann::json index = read_json(dir.file("model.safetensors.index.json"));
  index["weight_map"]["model.extra.weight"] = "model-00001-of-00003.safetensors";
  write_bytes(dir.file("model.safetensors.index.json"), index.dump());
  expect_error([&] { ModelTensors::open(dir.path().string()); },
               {"model.safetensors.index.json", "'model.extra.weight'",
                "model-00001-of-00003.safetensors", "does not contain"});
}

TEST(ModelFiles, MalformedIndex) {
  TempDir dir;
  write_bytes(dir.file("model.safetensors.index.json"), "{not json");
  expect_error([&] { ModelTensors::open(dir.path().string()); },
               {"model.safetensors.index.json", "not valid JSON"});
  write_bytes(dir.file("model.safetensors.index.json"), R"({"metadata":{}})");
  expect_error([&] { ModelTensors::open(dir.path().string()); }, {"missing 'weight_map'"});
  write_bytes(dir.file("model.safetensors.index.json"), R"({"weight_map":{"a":1}})");
  expect_error([&] { ModelTensors::open(dir.path().string()); }, {"'a'", "file name"});
  write_bytes(dir.file("model.safetensors.index.json"), R"({"weight_map":{"a":"../x"}})");
  expect_error([&] { ModelTensors::open(dir.path().string()); }, {"'a'", "../x"});
}

// A weight map names files inside the model directory only: not absolute paths, not paths through
// "..", not empty names (each would read a file the directory's owner did not put there).
TEST(ModelFiles, WeightMapNamesOutsideTheDirectoryAreRefused) {
  TempDir dir;
  const Model m = small_model();
  write_model_safetensors((dir.path() / "model").string(), m.tensors, 64);
  const std::string model = (dir.path() / "model").string();
  for (const std::string bad : {"/etc/passwd", "../model/model-00001-of-00003.safetensors",
                                "sub/../../x.safetensors", ""}) {
    const nlohmann::json index = {{"weight_map", {{"model.norm.weight", bad}}}};
    write_bytes(model + "/model.safetensors.index.json", index.dump());
    expect_error([&] { ModelTensors::open(model); }, {"'model.norm.weight'", "not a file inside the model directory"});
    expect_error([&] { ShardedSafetensors::open(model, "model"); }, {"'model.norm.weight'", "must name a file inside"});
  }
}

// The Hugging Face hub cache keeps every file of a snapshot as a symlink into ../../blobs/ (named by
// content hash): following symlinks is what makes a downloaded model load, so it must keep working.
TEST(ModelFiles, HubCacheSnapshotOfSymlinksLoads) {
  TempDir dir;
  const Model m = small_model();
  const fs::path staging = dir.path() / "staging";
  write_model_safetensors(staging.string(), m.tensors, 64);
  const fs::path repo = dir.path() / "hub" / "models--org--tiny";
  const fs::path snap = repo / "snapshots" / "0123456789abcdef";
  fs::create_directories(repo / "blobs");
  fs::create_directories(snap);
  int k = 0;
  for (const auto& e : fs::directory_iterator(staging)) {
    const std::string blob = "blob" + std::to_string(k++);
    fs::rename(e.path(), repo / "blobs" / blob);
    fs::create_symlink(fs::path("../..") / "blobs" / blob, snap / e.path().filename());
  }
  ASSERT_TRUE(fs::is_symlink(snap / "model.safetensors.index.json"));
  const ModelTensors mt = ModelTensors::open(snap.string());
  EXPECT_EQ(mt.names().size(), m.tensors.size());
  for (const auto& t : m.tensors) {  // values exact in every storage type (small_model's contract)
    const std::vector<float> got = to_f32(mt.get(t.name));
    EXPECT_EQ(mt.get(t.name).shape, t.shape) << t.name;
    EXPECT_EQ(got, std::vector<float>(t.data, t.data + got.size())) << t.name;
  }
  const ShardedSafetensors sh = ShardedSafetensors::open(snap.string(), "model");
  EXPECT_EQ(sh.names().size(), m.tensors.size());
}

TEST(ModelFiles, MissingDirectory) {
  TempDir dir;
  expect_error([&] { ModelTensors::open(dir.file("nope")); }, {dir.file("nope"), "not found"});
}

// The committed golden models were written by transformers' save_pretrained (safetensors 0.8):
// reading them checks the reader against the reference writer; rewriting them checks that our
// writer preserves every byte of every tensor.
TEST(ModelFiles, ReadsAndRewritesTransformersCheckpoint) {
  const std::string golden = std::string(MOETRON_SOURCE_DIR) + "/tests/golden/mixtral_gqa";
  ModelTensors mt = ModelTensors::open(golden);
  // embed, norm, head + 2 layers x (4 attention + 2 norms + gate + 4 experts x 3)
  EXPECT_EQ(mt.names().size(), 41u);
  EXPECT_EQ(mt.get("model.embed_tokens.weight").shape, (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(mt.get("model.layers.1.block_sparse_moe.gate.weight").shape,
            (std::vector<int64_t>{4, 32}));
  EXPECT_EQ(mt.get("model.layers.0.block_sparse_moe.experts.3.w1.weight").shape,
            (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(mt.get("model.layers.0.block_sparse_moe.experts.3.w2.weight").shape,
            (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(mt.get("model.layers.0.self_attn.k_proj.weight").shape, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(SafetensorsFile::open(golden + "/model.safetensors").metadata().at("format"), "pt");

  TempDir dir;
  std::vector<std::vector<float>> values;
  std::vector<ModelTensorToWrite> tensors;
  for (const std::string& name : mt.names()) values.push_back(to_f32(mt.get(name)));
  size_t k = 0;
  for (const std::string& name : mt.names())
    tensors.push_back({name, DType::F32, mt.get(name).shape, values[k++].data()});
  write_model_safetensors(dir.path().string(), tensors, 100'000);
  ModelTensors back = ModelTensors::open(dir.path().string());
  EXPECT_GT(back.num_files(), 1u);
  EXPECT_EQ(back.names(), mt.names());
  for (const std::string& name : mt.names()) {
    const TensorView& a = mt.get(name);
    const TensorView& b = back.get(name);
    ASSERT_EQ(a.nbytes, b.nbytes) << name;
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << name;
  }
}
