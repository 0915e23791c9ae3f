#!/usr/bin/env python3
"""moetron bench train beside transformers' MixtralForCausalLM training step, side by side.

Runs the two alternately (A B A B ...) `--rounds` times on the same model shape and thread count,
parses each run's own median tokens/s, and prints the median of each and the median of the
per-round ratios (moetron / transformers), so machine drift between rounds cancels out.

    python3 bench/compare_train.py --moetron build/moetron --threads 2 --rounds 3

Needs torch and transformers (development machines only; never needed by the tests).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

SHAPE_FLAGS = ["--hidden", "--layers", "--heads", "--kv-heads", "--experts", "--top-k", "--intermediate", "--vocab",
               "--seq", "--micro-batch"]


def json_line(output, prefix):
    for line in output.splitlines():
        if line.startswith(prefix):
            return json.loads(line)
    raise RuntimeError(f"no line starting {prefix!r} in output:\n{output}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moetron", default="build/moetron")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (each after 1 warm-up step)")
    ap.add_argument("--shape", nargs="*", default=[], help="shape flags passed to both, e.g. --shape --layers 2")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    ours_cmd = [args.moetron, "bench", "train", "--threads", str(args.threads), "--steps", str(args.steps),
                "--json"] + args.shape
    hf_cmd = [sys.executable, os.path.join(here, "hf_train_step.py"), "--threads", str(args.threads), "--steps",
              str(args.steps)] + args.shape
    ours, hf, ratios, mfu = [], [], [], []
    for r in range(args.rounds):
        a = json_line(subprocess.run(ours_cmd, env=env, check=True, capture_output=True, text=True).stdout,
                      '{"tokens_per_s"')
        b = json_line(subprocess.run(hf_cmd, env=env, check=True, capture_output=True, text=True).stdout,
                      '{"hf_tokens_per_s"')
        ours.append(a["tokens_per_s"])
        mfu.append(a["mfu"])
        hf.append(b["hf_tokens_per_s"])
        ratios.append(a["tokens_per_s"] / b["hf_tokens_per_s"])
        print(f"round {r + 1}: moetron {a['tokens_per_s']:.1f} tok/s (MFU {100 * a['mfu']:.1f}% of "
              f"{a['sgemm_peak_gflops']:.0f} GFLOP/s sgemm), transformers {b['hf_tokens_per_s']:.1f} tok/s, "
              f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"median over {args.rounds} rounds, {args.threads} threads: moetron {statistics.median(ours):.1f} tok/s "
          f"(MFU {100 * statistics.median(mfu):.1f}%), transformers {statistics.median(hf):.1f} tok/s, "
          f"ratio {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
