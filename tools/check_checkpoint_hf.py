#!/usr/bin/env python3
"""Check that a moetron checkpoint is a Hugging Face model: transformers loads it with from_pretrained
(no missing, unexpected or misshapen tensors) and gives the same logits as `moetron forward` on the same
directory and input.

Development tool (needs torch and transformers); the C++ tests pin the format without Python. Usage:

    python3 tools/check_checkpoint_hf.py RUN/checkpoints/step-000100 [--moetron build/moetron]
        [--input IN.safetensors] [--tol 1e-4]

Without --input, a random batch (2 x 16 token ids, fixed seed) is used. Both sides compute in float32
(a bf16/fp16 checkpoint is widened exactly on both sides), so the only differences are fp32 summation
orders: the logits must agree to max|a-b| / max|b| <= --tol (default 1e-4, the golden tests' bound).
Exit status 0 when they do, 1 otherwise.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="checkpoint (or any HF model) directory")
    ap.add_argument("--moetron", default=os.path.join(os.path.dirname(__file__), "..", "build", "moetron"),
                    help="the moetron binary (default: build/moetron)")
    ap.add_argument("--input", help="safetensors with input_ids [B,T] (default: random ids)")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()

    with open(os.path.join(args.checkpoint, "config.json")) as f:
        cfg = json.load(f)
    print(f"checkpoint {args.checkpoint}: {cfg.get('architectures')} torch_dtype={cfg.get('torch_dtype')} "
          f"(transformers {transformers.__version__}, torch {torch.__version__})")

    kwargs = {"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5 else {
        "torch_dtype": torch.float32}
    model, info = AutoModelForCausalLM.from_pretrained(args.checkpoint, output_loading_info=True, **kwargs)
    model.eval()
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        print(f"FAIL: from_pretrained reported {problems}")
        return 1
    print(f"from_pretrained: {type(model).__name__}, no missing / unexpected / mismatched tensors")

    with tempfile.TemporaryDirectory() as tmp:
        inp = args.input
        if inp is None:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=g, dtype=torch.int64)
            inp = os.path.join(tmp, "input.safetensors")
            save_file({"input_ids": ids}, inp)
        batch = load_file(inp)
        out = os.path.join(tmp, "out.safetensors")
        cmd = [args.moetron, "forward", "--model", args.checkpoint, "--input", inp, "--output", out]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"FAIL: {' '.join(cmd)} exited {res.returncode}:\n{res.stderr}")
            return 1
        ours = load_file(out)["logits"].to(torch.float32)

    hf_kwargs = {"input_ids": batch["input_ids"].to(torch.int64)}
    for k in ("attention_mask", "position_ids"):
        if k in batch:
            hf_kwargs[k] = batch[k].to(torch.int64)
    with torch.no_grad():
        ref = model(**hf_kwargs).logits.to(torch.float32)
    if ref.shape != ours.shape:
        print(f"FAIL: logits shape {tuple(ours.shape)} from moetron, {tuple(ref.shape)} from transformers")
        return 1
    if "attention_mask" in batch:  # padded positions are not compared
        keep = batch["attention_mask"].bool()
        ref, ours = ref[keep], ours[keep]
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"logits {tuple(ref.shape)}: max|moetron - transformers| / max|transformers| = {err:.3e} (tol {args.tol:g})")
    if not err <= args.tol:
        print("FAIL")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
