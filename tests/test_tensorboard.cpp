// The TensorBoard event writer against bytes written by TensorBoard's own protobuf classes and
// record writer (tools/make_tensorboard_reference.py -> tests/golden/tensorboard/reference.tfevents),
// and the CRC32C used by the TFRecord framing against its published check value.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "train/tensorboard.h"

using namespace moetron;

TEST(TensorBoard, Crc32cCheckValue) {
  // The CRC-32C (Castagnoli) check value of "123456789" is 0xE3069283 (RFC 3720, B.4).
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(reinterpret_cast<const uint8_t*>(s.data()), s.size()), 0xE3069283u);
}

TEST(TensorBoard, EventsAreByteIdenticalToTensorBoardsWriter) {
  // The same events as tools/make_tensorboard_reference.py's SCALARS.
  std::string ours = tfrecord(tensorboard_version_event(1700000000.25));
  ours += tfrecord(tensorboard_scalar_event(1700000001.5, 1, "loss", 2.5f));
  ours += tfrecord(tensorboard_scalar_event(1700000002.75, 2, "loss", 2.25f));
  ours += tfrecord(tensorboard_scalar_event(1700000002.75, 2, "lr", 3.0e-4f));
  ours += tfrecord(tensorboard_scalar_event(1700000003.0, 300, "moe/layer_0/max_share", 0.3125f));
  ours += tfrecord(tensorboard_scalar_event(1700000004.0, 123456789, "val_loss", -1.0e-3f));
  const std::filesystem::path ref =
      std::filesystem::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "tensorboard" / "reference.tfevents";
  std::ifstream f(ref, std::ios::binary);
  ASSERT_TRUE(f) << ref;
  const std::string expected((std::istreambuf_iterator<char>(f)), {});
  ASSERT_EQ(ours.size(), expected.size());
  for (size_t i = 0; i < ours.size(); i++) ASSERT_EQ((int)(uint8_t)ours[i], (int)(uint8_t)expected[i]) << "byte " << i;
}

TEST(TensorBoard, WriterCreatesAFileStartingWithTheVersionRecord) {
  const auto dir = std::filesystem::temp_directory_path() / ("moetron_tb_" + std::to_string(::getpid()));
  {
    TensorBoardWriter w(dir.string());
    w.scalar("loss", 1, 3.0);
    w.flush();
    std::ifstream f(w.path(), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), {});
    EXPECT_NE(bytes.find("brain.Event:2"), std::string::npos);
    EXPECT_NE(bytes.find("loss"), std::string::npos);
  }
  std::filesystem::remove_all(dir);
}
