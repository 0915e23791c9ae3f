// TensorBoard event files, written directly (no TensorFlow / protobuf dependency).
//
// File RUN/tb/events.out.tfevents.<unix time>.<host> is a sequence of TFRecord records:
//   uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data[length] |
//   uint32 masked_crc32c(data)
// masked_crc(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8, crc32c = Castagnoli polynomial.
// Each data is a serialized tensorflow.Event protobuf:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first record carries file_version "brain.Event:2"; then one Event per (step, scalar).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace moetron {

uint32_t crc32c(const uint8_t* data, size_t n);

// The serialized bytes of one Event (exposed for tests).
std::string tensorboard_scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
std::string tensorboard_version_event(double wall_time);
// One TFRecord around `data`.
std::string tfrecord(const std::string& data);

class TensorBoardWriter {
 public:
  // Creates DIR (and parents) and a new event file in it.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void scalar(const std::string& tag, int64_t step, double value);
  void flush();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FILE* file_ = nullptr;
};

}  // namespace moetron
