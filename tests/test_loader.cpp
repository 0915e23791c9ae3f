// Tests for data/loader: packing (whole documents, counted splits, segment and position ids,
// labels), exactly-once coverage per epoch, per-epoch shuffling, exact resume from any step,
// data-parallel sharding, packing: false, and bad inputs.
//
// The test datasets encode provenance in the tokens: document d's token at position p is
// d * kStride + p + 1, so every token in a batch says which document and position it came from.
// The loss mask of (d, p) is mask_of(d, p).
#include <gtest/gtest.h>

#include "temp_dir.h"
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/loader.h"
#include "io/indexed_dataset.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

constexpr int32_t kStride = 100000;

using TempDir = moetron::testing::TempDir;

int32_t mask_of(int d, int p) { return p == 0 ? 0 : ((d + p) % 3 != 0); }

// Writes DIR/train (int32 tokens) and DIR/train_mask (uint8) for documents of the given lengths.
void write_docs(const TempDir& dir, const std::vector<int>& lengths, const std::string& name = "train") {
  IndexedDatasetWriter tok(dir.file(name), IndexedDType::i32), mask(dir.file(name + "_mask"), IndexedDType::u8);
  for (size_t d = 0; d < lengths.size(); d++) {
    std::vector<int32_t> t(lengths[d]), m(lengths[d]);
    for (int p = 0; p < lengths[d]; p++) {
      t[p] = (int32_t)d * kStride + p + 1;
      m[p] = mask_of((int)d, p);
    }
    tok.add_sequence(t.data(), t.size());
    tok.end_document();
    mask.add_sequence(m.data(), m.size());
    mask.end_document();
  }
  tok.finalize();
  mask.finalize();
}

// A varied set of lengths for seq_length 16: short, exactly 16, over-long (17, 40, 33), one empty.
std::vector<int> varied_lengths() {
  std::vector<int> len;
  for (int d = 0; d < 37; d++) len.push_back(1 + (d * 7 + 3) % 15);
  len[5] = 16;
  len[9] = 17;
  len[13] = 40;
  len[20] = 33;
  len[22] = 0;
  return len;
}

struct Piece {  // one segment of one row: document d, positions [start, start + len)
  int doc, start, len;
  bool operator<(const Piece& o) const { return std::tie(doc, start, len) < std::tie(o.doc, o.start, o.len); }
  bool operator==(const Piece& o) const { return doc == o.doc && start == o.start && len == o.len; }
};
void PrintTo(const Piece& p, std::ostream* os) { *os << "(doc " << p.doc << " @" << p.start << " +" << p.len << ")"; }

// Checks every invariant of one row and returns its segments in order (empty for an empty row).
std::vector<Piece> check_row(const Batch& b, int r, const std::vector<int>& lengths) {
  std::vector<Piece> pieces;
  const int T = b.T;
  int t = 0;
  while (t < T && b.attention_mask[(size_t)r * T + t] == 1) {
    const size_t i0 = (size_t)r * T + t;
    const int32_t seg = b.segment_ids[i0];
    EXPECT_EQ(seg, (int32_t)pieces.size()) << "segments number 0, 1, 2 ... within a row";
    const int doc = b.input_ids[i0] / kStride, start = b.input_ids[i0] % kStride - 1;
    int len = 0;
    while (t < T && b.attention_mask[(size_t)r * T + t] == 1 && b.segment_ids[(size_t)r * T + t] == seg) {
      const size_t i = (size_t)r * T + t;
      EXPECT_EQ(b.input_ids[i], doc * kStride + start + len + 1) << "row " << r << " t " << t;
      EXPECT_EQ(b.position_ids[i], len) << "positions restart per segment";
      EXPECT_EQ(b.labels[i], mask_of(doc, start + len) ? b.input_ids[i] : -100) << "row " << r << " t " << t;
      len++, t++;
    }
    // A piece is a whole document or a seq_length-aligned chunk of an over-long one.
    EXPECT_GE(doc, 0);
    EXPECT_LT(doc, (int)lengths.size());
    EXPECT_EQ(start % T, 0);
    EXPECT_EQ(len, std::min(T, lengths[doc] - start)) << "doc " << doc << " start " << start;
    pieces.push_back({doc, start, len});
  }
  const int32_t pad_seg = (int32_t)pieces.size();
  for (; t < T; t++) {
    const size_t i = (size_t)r * T + t;
    EXPECT_EQ(b.attention_mask[i], 0);
    EXPECT_EQ(b.labels[i], -100);
    EXPECT_EQ(b.input_ids[i], 0);
    EXPECT_EQ(b.position_ids[i], 0);
    EXPECT_EQ(b.segment_ids[i], pad_seg) << "padding has its own segment id";
  }
  return pieces;
}

// Runs `steps` micro-batches and returns the rows' pieces in stream order.
std::vector<std::vector<Piece>> collect(DataLoader& dl, uint64_t steps, const std::vector<int>& lengths) {
  std::vector<std::vector<Piece>> rows;
  for (uint64_t s = 0; s < steps; s++) {
    const Batch b = dl.next();
    EXPECT_EQ(b.B, dl.config().micro_batch_size);
    EXPECT_EQ(b.T, dl.config().seq_length);
    for (int r = 0; r < b.B; r++) rows.push_back(check_row(b, r, lengths));
  }
  return rows;
}

// Every usable document exactly once: whole (len <= T) or as all of its chunks (split).
void expect_exactly_once(const std::vector<std::vector<Piece>>& rows, const std::vector<int>& lengths, int T,
                         bool drop) {
  std::vector<Piece> all;
  for (const auto& row : rows) all.insert(all.end(), row.begin(), row.end());
  std::sort(all.begin(), all.end());
  std::vector<Piece> expected;
  for (int d = 0; d < (int)lengths.size(); d++) {
    if (lengths[d] == 0 || (drop && lengths[d] > T)) continue;
    for (int s = 0; s < lengths[d]; s += T) expected.push_back({d, s, std::min(T, lengths[d] - s)});
  }
  EXPECT_EQ(all, expected);
}

LoaderConfig config(int T, int mbs, uint64_t seed) {
  LoaderConfig c;
  c.seq_length = T;
  c.micro_batch_size = mbs;
  c.seed = seed;
  return c;
}

std::vector<Piece> flatten(const std::vector<std::vector<Piece>>& rows) {
  std::vector<Piece> out;
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}

bool same_batch(const Batch& a, const Batch& b) {
  return a.B == b.B && a.T == b.T && a.input_ids == b.input_ids && a.labels == b.labels &&
         a.attention_mask == b.attention_mask && a.position_ids == b.position_ids && a.segment_ids == b.segment_ids;
}

}  // namespace

TEST(Loader, PackingWholeDocumentsGreedyAndCounted) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  const int T = 16;
  DataLoader dl(dir.file("train"), dir.file("train_mask"), config(T, 1, 7));
  const LoaderStats st = dl.stats();
  EXPECT_EQ(st.documents, lengths.size());
  EXPECT_EQ(st.empty_documents, 1u);
  EXPECT_EQ(st.split_documents, 3u);                 // 17, 40, 33
  EXPECT_EQ(st.split_chunks, 2u + 3u + 3u);
  EXPECT_EQ(st.dropped_documents, 0u);
  uint64_t total = 0;
  for (int l : lengths) total += (uint64_t)l;
  EXPECT_EQ(st.tokens, total);
  EXPECT_EQ(st.padded_rows, st.blocks);              // global batch 1: no empty rows
  EXPECT_EQ(st.padding_tokens, st.blocks * T - total);

  const auto rows = collect(dl, dl.micro_batches_per_epoch(), lengths);
  ASSERT_EQ(rows.size(), st.blocks);
  expect_exactly_once(rows, lengths, T, false);
  EXPECT_EQ(dl.epoch(), 1u);
  // Greedy: each row starts with a piece that did not fit in the previous row's free space, and
  // several documents do share rows.
  size_t shared = 0;
  for (size_t r = 0; r < rows.size(); r++) {
    ASSERT_FALSE(rows[r].empty());
    shared += rows[r].size() > 1;
    if (r == 0) continue;
    int used = 0;
    for (const Piece& p : rows[r - 1]) used += p.len;
    EXPECT_GT(used + rows[r].front().len, T) << "row " << r << " could have gone into row " << r - 1;
  }
  EXPECT_GT(shared, 5u);
}

TEST(Loader, DropCountsOverLongDocuments) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  LoaderConfig c = config(16, 2, 3);
  c.over_long = LoaderConfig::OverLong::drop;
  DataLoader dl(dir.file("train"), dir.file("train_mask"), c);
  EXPECT_EQ(dl.stats().dropped_documents, 3u);
  EXPECT_EQ(dl.stats().dropped_tokens, 17u + 40u + 33u);
  EXPECT_EQ(dl.stats().split_documents, 0u);
  EXPECT_EQ(dl.stats().split_chunks, 0u);
  EXPECT_EQ(dl.stats().empty_documents, 1u);
  const auto rows = collect(dl, dl.micro_batches_per_epoch(), lengths);
  expect_exactly_once(rows, lengths, 16, true);
}

TEST(Loader, NoPackingOneDocumentPerRow) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  LoaderConfig c = config(16, 4, 11);
  c.packing = false;
  DataLoader dl(dir.file("train"), dir.file("train_mask"), c);
  const uint64_t units = 37 - 1 - 3 + 8;  // non-empty whole documents + chunks of the split ones
  EXPECT_EQ(dl.stats().blocks, units);
  EXPECT_EQ(dl.stats().padded_rows, (units + 3) / 4 * 4);
  const auto rows = collect(dl, dl.micro_batches_per_epoch(), lengths);
  ASSERT_EQ(rows.size(), dl.stats().padded_rows);
  size_t empty = 0;
  for (const auto& row : rows) {
    EXPECT_LE(row.size(), 1u);  // check_row verified right padding with segment 1 after the document
    empty += row.empty();
  }
  EXPECT_EQ(empty, dl.stats().padded_rows - units);
  expect_exactly_once(rows, lengths, 16, false);
  // Empty rows complete only the last micro-batch, after every real row.
  for (size_t r = 0; r < units; r++) EXPECT_EQ(rows[r].size(), 1u);
}

TEST(Loader, ShuffleDiffersPerEpochAndIsReproducible) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  DataLoader a(dir.file("train"), dir.file("train_mask"), config(16, 1, 42));
  const auto a0 = collect(a, a.micro_batches_per_epoch(), lengths);
  ASSERT_EQ(a.epoch(), 1u);
  const auto a1 = collect(a, a.micro_batches_per_epoch(), lengths);
  expect_exactly_once(a0, lengths, 16, false);
  expect_exactly_once(a1, lengths, 16, false);
  EXPECT_NE(flatten(a0), flatten(a1)) << "epochs 0 and 1 have the same order";

  DataLoader b(dir.file("train"), dir.file("train_mask"), config(16, 1, 42));
  EXPECT_EQ(flatten(collect(b, b.micro_batches_per_epoch(), lengths)), flatten(a0));
  EXPECT_EQ(flatten(collect(b, b.micro_batches_per_epoch(), lengths)), flatten(a1));

  DataLoader c(dir.file("train"), dir.file("train_mask"), config(16, 1, 43));
  EXPECT_NE(flatten(collect(c, c.micro_batches_per_epoch(), lengths)), flatten(a0)) << "seed ignored";

  LoaderConfig nc = config(16, 1, 42);
  nc.shuffle = false;
  DataLoader d(dir.file("train"), dir.file("train_mask"), nc);
  const auto d0 = flatten(collect(d, d.micro_batches_per_epoch(), lengths));
  for (size_t k = 1; k < d0.size(); k++) EXPECT_TRUE(d0[k - 1] < d0[k]) << "shuffle: false keeps file order";
}

TEST(Loader, ResumeFromEveryStepGivesIdenticalStream) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  LoaderConfig c = config(16, 2, 5);
  c.global_batch_size = 8;  // 4 micro-batches per step; the last step of each epoch is padded
  DataLoader ref(dir.file("train"), dir.file("train_mask"), c);
  EXPECT_GT(ref.stats().padded_rows, ref.stats().blocks) << "want a padded final global batch in this test";
  const uint64_t steps = ref.micro_batches_per_epoch() + ref.micro_batches_per_epoch() / 2 + 4;  // past epoch 1
  std::vector<Batch> stream;
  std::vector<LoaderState> states;
  for (uint64_t s = 0; s < steps; s++) {
    states.push_back(ref.state());
    stream.push_back(ref.next());
  }
  for (uint64_t stop = 0; stop < steps; stop++) {
    DataLoader first(dir.file("train"), dir.file("train_mask"), c);
    for (uint64_t s = 0; s < stop; s++) ASSERT_TRUE(same_batch(first.next(), stream[s]));
    const LoaderState saved = first.state();
    EXPECT_EQ(saved, states[stop]);
    const nlohmann::json j = saved;  // through JSON, as a checkpoint stores it
    DataLoader resumed(dir.file("train"), dir.file("train_mask"), c);
    resumed.restore(nlohmann::json::parse(j.dump()).get<LoaderState>());
    EXPECT_EQ(resumed.state(), saved);
    for (uint64_t s = stop; s < steps; s++)
      ASSERT_TRUE(same_batch(resumed.next(), stream[s])) << "stopped at " << stop << ", differs at " << s;
  }
}

TEST(Loader, DataParallelShardsAreDisjointAndCover) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  const int T = 16;
  // Single-process reference: the global row order with micro-batch 1.
  LoaderConfig one = config(T, 1, 9);
  one.global_batch_size = 8;
  DataLoader ref(dir.file("train"), dir.file("train_mask"), one);
  const auto global_rows = collect(ref, ref.micro_batches_per_epoch(), lengths);

  std::vector<std::vector<std::vector<Piece>>> shard(2);
  for (int r = 0; r < 2; r++) {
    LoaderConfig c = config(T, 2, 9);
    c.dp_rank = r;
    c.dp_size = 2;
    c.global_batch_size = 8;
    DataLoader dl(dir.file("train"), dir.file("train_mask"), c);
    EXPECT_EQ(dl.micro_batches_per_epoch() * 4, ref.stats().padded_rows);
    EXPECT_EQ(dl.steps_per_epoch(0), ref.stats().padded_rows / 8);
    shard[r] = collect(dl, dl.micro_batches_per_epoch(), lengths);
    EXPECT_EQ(dl.epoch(), 1u);
    EXPECT_EQ(dl.state(), ref.state()) << "every rank saves the same (global) position";
  }
  EXPECT_EQ(shard[0].size(), shard[1].size());
  std::set<Piece> seen0, seen1;
  for (const auto& row : shard[0]) seen0.insert(row.begin(), row.end());
  for (const auto& row : shard[1]) seen1.insert(row.begin(), row.end());
  for (const Piece& p : seen0) EXPECT_EQ(seen1.count(p), 0u) << "doc " << p.doc << " on both ranks";
  auto all = shard[0];
  all.insert(all.end(), shard[1].begin(), shard[1].end());
  expect_exactly_once(all, lengths, T, false);
  // The dealing: rank r's micro-batch k holds global rows (2k + r) * 2 + j.
  for (int r = 0; r < 2; r++)
    for (size_t k = 0; k < shard[r].size() / 2; k++)
      for (int j = 0; j < 2; j++) EXPECT_EQ(shard[r][2 * k + j], global_rows[(2 * k + r) * 2 + j]);
}

TEST(Loader, ResumeUnderAnotherLayoutAtStepBoundary) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  LoaderConfig a = config(16, 4, 21);
  a.global_batch_size = 4;
  DataLoader single(dir.file("train"), dir.file("train_mask"), a);
  single.next();
  single.next();
  const LoaderState s = single.state();
  const Batch expect = single.next();  // rows 8..11
  for (int r = 0; r < 2; r++) {
    LoaderConfig c = config(16, 2, 21);
    c.dp_rank = r;
    c.dp_size = 2;
    c.global_batch_size = 4;
    DataLoader dl(dir.file("train"), dir.file("train_mask"), c);
    dl.restore(s);
    const Batch got = dl.next();
    const size_t half = (size_t)2 * 16;
    EXPECT_TRUE(std::equal(got.input_ids.begin(), got.input_ids.end(), expect.input_ids.begin() + r * half));
    EXPECT_TRUE(std::equal(got.labels.begin(), got.labels.end(), expect.labels.begin() + r * half));
    EXPECT_TRUE(std::equal(got.segment_ids.begin(), got.segment_ids.end(), expect.segment_ids.begin() + r * half));
  }
}

TEST(Loader, StepsPerEpochMatchesTheStream) {
  TempDir dir;
  const auto lengths = varied_lengths();
  write_docs(dir, lengths);
  LoaderConfig c = config(16, 1, 77);
  c.global_batch_size = 3;
  DataLoader dl(dir.file("train"), dir.file("train_mask"), c);
  uint64_t total = 0;
  for (uint64_t e = 0; e < 3; e++) {
    ASSERT_EQ(dl.epoch(), e);
    EXPECT_EQ(dl.blocks_per_epoch(e), dl.stats().blocks);
    EXPECT_EQ(dl.steps_per_epoch(e) * 3, dl.micro_batches_per_epoch());
    total += dl.steps_per_epoch(e);
    for (uint64_t k = dl.micro_batches_per_epoch(); k > 0; k--) dl.next();
  }
  DataLoader fresh(dir.file("train"), dir.file("train_mask"), c);
  EXPECT_EQ(fresh.total_steps(3), total);
}

TEST(Loader, NoMaskMeansEveryTokenIsALabel) {
  TempDir dir;
  write_docs(dir, {3, 4});
  LoaderConfig c = config(8, 1, 1);
  c.shuffle = false;
  DataLoader dl(dir.file("train"), "", c);
  const Batch b = dl.next();
  for (int t = 0; t < 7; t++) EXPECT_EQ(b.labels[t], b.input_ids[t]);
  EXPECT_EQ(b.labels[7], -100);
}

TEST(Loader, BadInputs) {
  TempDir dir;
  write_docs(dir, {3, 4, 5});
  write_docs(dir, {3, 4, 6}, "other");
  write_docs(dir, {3, 4}, "short");
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string tok = dir.file("train"), mask = dir.file("train_mask");
  expect_error([&] { DataLoader x(tok, dir.file("other_mask"), config(8, 1, 0)); }, dir.file("other_mask.idx"));
  expect_error([&] { DataLoader x(tok, dir.file("short_mask"), config(8, 1, 0)); }, dir.file("short_mask.idx"));
  expect_error([&] { DataLoader x(tok, dir.file("missing"), config(8, 1, 0)); }, dir.file("missing.idx"));
  expect_error([&] { DataLoader x(tok, mask, config(0, 1, 0)); }, "seq_length");
  LoaderConfig c = config(8, 2, 0);
  c.dp_size = 2;
  c.global_batch_size = 6;
  expect_error([&] { DataLoader x(tok, mask, c); }, "global_batch_size");
  c.global_batch_size = 0;
  c.dp_rank = 2;
  expect_error([&] { DataLoader x(tok, mask, c); }, "dp_rank");
  LoaderConfig drop = config(2, 1, 0);
  drop.over_long = LoaderConfig::OverLong::drop;
  expect_error([&] { DataLoader x(tok, mask, drop); }, "no usable documents");

  // A mask value other than 0/1 is reported with the mask file when read.
  {
    IndexedDatasetWriter m(dir.file("bad_mask"), IndexedDType::u8);
    for (int len : {3, 4, 5}) {
      std::vector<int32_t> v(len, 1);
      v[1] = 2;
      m.add_sequence(v.data(), v.size());
      m.end_document();
    }
    m.finalize();
  }
  DataLoader bad(tok, dir.file("bad_mask"), config(8, 1, 0));
  expect_error([&] { bad.next(); }, dir.file("bad_mask.bin"));

  // States that do not belong to this loader.
  DataLoader dl(tok, mask, config(8, 1, 0));
  LoaderState s = dl.state();
  s.seed = 1;
  expect_error([&] { dl.restore(s); }, "does not match");
  s = dl.state();
  s.next_block = 1000;
  expect_error([&] { dl.restore(s); }, "beyond");
  nlohmann::json j = dl.state();
  j.erase("next_block");
  expect_error([&] { (void)j.get<LoaderState>(); }, "next_block");
  j = dl.state();
  j["epoch"] = -1;
  expect_error([&] { (void)j.get<LoaderState>(); }, "epoch");
}
