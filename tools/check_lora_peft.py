#!/usr/bin/env python3
"""Check a moetron LoRA adapter directory against PEFT and transformers.

  1. PEFT loads the adapter onto the base with no missing and no unexpected keys (the state dict
     is applied with set_peft_model_state_dict to read its load result; PeftModel.from_pretrained,
     the user's path, must give the same logits);
  2. PEFT's logits equal `moetron forward --lora` within --tol (max |a - b| / max |b|);
  3. `moetron convert --merge-lora` writes a model transformers loads (no missing or unexpected
     keys) whose logits equal PEFT's within --tol.

Development tool (needs torch, transformers, peft). Usage:
    python3 tools/check_lora_peft.py --base BASE_DIR --adapter ADAPTER_DIR --input INPUT.safetensors \\
        --moetron build/moetron [--tol 1e-5]
"""

import argparse
import os
import subprocess
import sys
import tempfile

import peft
import torch
import transformers
from safetensors.torch import load_file


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--input", required=True, help="safetensors with input_ids [B,T] (and attention_mask)")
    ap.add_argument("--moetron", required=True)
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    inputs = load_file(args.input)
    kw = {"input_ids": inputs["input_ids"].long()}
    if "attention_mask" in inputs:
        kw["attention_mask"] = inputs["attention_mask"].long()
    load = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    ok = True

    # 1. keys
    base = transformers.AutoModelForCausalLM.from_pretrained(args.base, **load)
    cfg = peft.LoraConfig.from_pretrained(args.adapter)
    pm = peft.get_peft_model(base, cfg)
    res = peft.set_peft_model_state_dict(pm, peft.utils.load_peft_weights(args.adapter))
    missing = [k for k in res.missing_keys if "lora_" in k]
    print(f"PEFT {peft.__version__}: r {cfg.r}, alpha {cfg.lora_alpha}, target_modules {sorted(cfg.target_modules)}, "
          f"target_parameters {cfg.target_parameters}; missing adapter keys {len(missing)}, unexpected keys "
          f"{len(res.unexpected_keys)}")
    if missing or res.unexpected_keys:
        print("  missing:", missing[:5], " unexpected:", res.unexpected_keys[:5])
        ok = False
    with torch.no_grad():
        peft_logits = pm(**kw).logits
        user = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(args.base, **load), args.adapter)
        user_logits = user(**kw).logits
        base_logits = transformers.AutoModelForCausalLM.from_pretrained(args.base, **load)(**kw).logits
    if not torch.equal(user_logits, peft_logits):
        print(f"  PeftModel.from_pretrained differs from the checked load: {rel(user_logits, peft_logits):.3e}")
        ok = False
    print(f"adapter moves the logits by {rel(peft_logits, base_logits):.3e} (relative to the base's)")

    with tempfile.TemporaryDirectory() as tmp:
        # 2. moetron forward --lora
        out = os.path.join(tmp, "out.safetensors")
        subprocess.run([args.moetron, "forward", "--model", args.base, "--lora", args.adapter, "--input", args.input,
                        "--output", out], check=True, stdout=subprocess.DEVNULL)
        e = rel(load_file(out)["logits"], peft_logits)
        print(f"moetron forward --lora vs PEFT: logits {e:.3e} (tol {args.tol:g})")
        ok &= e <= args.tol
        # 3. merged
        merged = os.path.join(tmp, "merged")
        subprocess.run([args.moetron, "convert", "--input", args.base, "--merge-lora", args.adapter, "--output",
                        merged], check=True, stdout=subprocess.DEVNULL)
        m, info = transformers.AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True, **load)
        bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        with torch.no_grad():
            e = rel(m(**kw).logits, peft_logits)
        print(f"moetron convert --merge-lora in transformers vs PEFT: logits {e:.3e}; loading problems {bad or 'none'}")
        ok &= e <= args.tol and not bad
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
