#!/usr/bin/env python3
"""transformers' generate() on CPU: prefill and decode tokens/s, for comparison with
`moetron bench generate` on the same model directory and thread count.

    # a random small Mixtral saved as an HF directory in bf16, as published checkpoints are (both tools
    # then load the same weights; both compute in fp32 on them)
    python3 bench/hf_generate.py --save-model /tmp/bench-moe --hidden 256 --layers 4 --experts 8 --vocab 32000
    python3 bench/hf_generate.py --model /tmp/bench-moe --threads 2 --prompt-tokens 128 --new-tokens 64
    ./build/moetron bench generate --model /tmp/bench-moe --threads 2 --prompt-tokens 128 --new-tokens 64

--dtype float32 (default) runs transformers in fp32, moetron's numerics (moetron computes in fp32 and,
for a bf16 checkpoint, reads the weights as bf16 while decoding: the same values, half the bytes);
--dtype bfloat16 runs transformers in bf16 (the checkpoint's dtype, transformers' "auto").

Method (greedy, do_sample=False, min_new_tokens = max_new_tokens so EOS never ends a run early; the
prompt is the same pseudo-random token ids moetron uses): t1 = time of generate(max_new_tokens=1) (the
prompt's forward pass plus choosing one token), tN = time of generate(max_new_tokens=N); prefill tokens/s
= P / t1, decode tokens/s = (N - 1) / (tN - t1). Medians over --runs after one untimed warm-up.
"""

import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, MistralConfig, MixtralConfig


def mix64(x):
    """SplitMix64 finaliser, as core/rng.h (the prompt ids match moetron bench generate's)."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def prompt_ids(n, vocab):
    return [1] + [3 + mix64(i * 7919 + 17) % (vocab - 3) for i in range(1, n)]


def save_model(args):
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if args.experts > 0:
        cfg = MixtralConfig(**common, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                            sliding_window=None)
    else:
        cfg = MistralConfig(**common, sliding_window=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.to(getattr(torch, args.save_dtype)).save_pretrained(args.save_model, safe_serialization=True)
    print(f"saved a random {type(model).__name__} ({args.save_dtype}) to {args.save_model}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF model directory to time")
    ap.add_argument("--save-model", help="write a random model of the shape below to this directory and exit")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8, help="0: a dense Mistral")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="transformers' compute dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    args = ap.parse_args()
    if args.save_model:
        save_model(args)
        return
    if not args.model:
        ap.error("give --model DIR (or --save-model DIR)")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    cfg = model.config
    ids = torch.tensor([prompt_ids(args.prompt_tokens, cfg.vocab_size)])
    mask = torch.ones_like(ids)

    def timed(n):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=cfg.eos_token_id)
        dt = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + n
        return dt

    timed(2)  # warm-up
    t1s, tns = [], []
    for _ in range(args.runs):
        t1s.append(timed(1))
        tns.append(timed(args.new_tokens))
    t1, tn = statistics.median(t1s), statistics.median(tns)
    prefill = args.prompt_tokens / t1
    decode = (args.new_tokens - 1) / max(tn - t1, 1e-9)
    print(f"transformers {transformers.__version__} generate: {type(model).__name__} ({args.dtype}), {args.threads} threads, "
          f"prompt {args.prompt_tokens}, new tokens {args.new_tokens}, runs {args.runs}")
    print(f"prefill tokens/s: {prefill:.1f}")
    print(f"decode tokens/s: {decode:.1f}")
    if args.json:
        print(json.dumps({"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "threads": args.threads}))


if __name__ == "__main__":
    main()
