#!/usr/bin/env python3
"""TensorBoard references for moetron's event-file writer (src/train/tensorboard.h).

1. `--out DIR`: writes DIR/reference.tfevents with TensorBoard's own protobuf classes and record
   writer: a version event, then scalar events with fixed wall times (the fixed values are listed
   in SCALARS below and mirrored in tests/test_tensorboard.cpp, which must produce the same bytes).
2. `--check FILE`: reads an event file written by moetron with TensorBoard's EventAccumulator and
   prints every scalar it finds (run on a real run's RUN/tb/ directory).

    pip install tensorboard
    python3 tools/make_tensorboard_reference.py --out tests/golden/tensorboard
"""

import argparse
import os
import struct

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

VERSION_WALL_TIME = 1700000000.25
SCALARS = [  # (wall_time, step, tag, value)
    (1700000001.5, 1, "loss", 2.5),
    (1700000002.75, 2, "loss", 2.25),
    (1700000002.75, 2, "lr", 3.0e-4),
    (1700000003.0, 300, "moe/layer_0/max_share", 0.3125),
    (1700000004.0, 123456789, "val_loss", -1.0e-3),
]


def write_reference(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "reference.tfevents")
    with open(path, "wb") as f:
        w = RecordWriter(f)
        w.write(event_pb2.Event(wall_time=VERSION_WALL_TIME, file_version="brain.Event:2").SerializeToString())
        for wall, step, tag, value in SCALARS:
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            w.write(event_pb2.Event(wall_time=wall, step=step, summary=summary).SerializeToString())
    print("wrote", path, os.path.getsize(path), "bytes")


def check(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(path)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    print(f"{path}: {len(tags)} scalar tags")
    for tag in sorted(tags):
        events = acc.Scalars(tag)
        print(f"  {tag}: {len(events)} points, first step {events[0].step} = {events[0].value:.6g}, "
              f"last step {events[-1].step} = {events[-1].value:.6g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--check")
    args = ap.parse_args()
    if args.out:
        write_reference(args.out)
    if args.check:
        check(args.check)


if __name__ == "__main__":
    main()
