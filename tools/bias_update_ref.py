#!/usr/bin/env python3
"""Check a moetron run's aux-loss-free balancing against DeepSeek-V3's rule, computed here on its own.

DeepSeek-V3 (arXiv 2412.19437, section 2.1.2, "Auxiliary-Loss-Free Load Balancing"): each routed
expert has a bias b_e added to its affinity score for the top-K selection only; at the end of each
step, b_e is decreased by gamma if the expert is overloaded and increased by gamma if underloaded
(gamma: the bias update speed, moetron's moe.bias_update_rate).  "Overloaded" is read as above the
mean load over the experts of the layer, loads counted over the whole global batch.

This script takes a run directory trained with log.every_steps 1, rebuilds every MoE layer's bias from
the expert shares metrics.jsonl logged at each step (share_e = load_e / total, so the sign of
mean - load_e is the sign of 1/E - share_e), in float32 like the model's parameters, and compares
it with the `model.layers.N.mlp.gate.e_score_correction_bias` tensors of each checkpoint in
RUN/checkpoints (bitwise).  tests/test_dist_train.cpp (Glm4MoeBiasUpdateFollowsTheRuleUnderDp2Ep2)
runs the same check in C++ under dp 2 x ep 2.  Exit 0 when every checkpoint matches.

Usage: python3 tools/bias_update_ref.py RUN --rate 0.01
"""
import argparse
import glob
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run directory (metrics.jsonl, checkpoints/step-*)")
    ap.add_argument("--rate", type=float, required=True, help="moe.bias_update_rate of the run")
    args = ap.parse_args()
    steps = {}
    with open(os.path.join(args.run, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if "moe" in j:
                steps[j["step"]] = j["moe"]
    bias = {}
    expected = {}  # step -> {name: array}
    for step in sorted(steps):
        for layer in steps[step]:
            shares = np.array(layer["shares"], dtype=np.float64)
            e = len(shares)
            name = f"model.layers.{layer['layer']}.mlp.gate.e_score_correction_bias"
            b = bias.setdefault(name, np.zeros(e, dtype=np.float32))
            b += np.float32(args.rate) * np.sign(1.0 / e - shares).astype(np.float32)
        expected[step] = {k: v.copy() for k, v in bias.items()}
    failures = 0
    checked = 0
    for ckpt in sorted(glob.glob(os.path.join(args.run, "checkpoints", "step-*"))):
        step = int(os.path.basename(ckpt).split("-")[1])
        if step not in expected:
            print(f"{ckpt}: no metrics for step {step}; skipped")
            continue
        tensors = {}
        for path in glob.glob(os.path.join(ckpt, "model*.safetensors")):
            tensors.update(load_file(path))
        for name, want in expected[step].items():
            got = tensors.get(name)
            ok = got is not None and got.dtype == np.float32 and np.array_equal(got, want)
            failures += not ok
            checked += 1
            print(f"step {step} {name}: {'OK' if ok else 'DIFFERS'} max|b| {np.abs(want).max():.4f}"
                  + ("" if ok else f" got {got} want {want}"))
    if checked == 0:
        print("nothing checked: no checkpoint with logged steps")
        return 1
    print(f"{checked} biases checked, {failures} differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
