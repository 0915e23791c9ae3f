#!/usr/bin/env python3
"""Peer benchmark: one training step of transformers' MixtralForCausalLM on CPU, float32.

A step is: zero_grad, forward with output_router_logits=True (loss = CE + router_aux_loss_coef * aux),
loss.backward(), clip_grad_norm_ (unless --grad-clip 0), AdamW step. Random token ids, labels = ids.
One warm-up step, then --steps timed steps; tokens per step = micro_batch * seq.

Prints each step's time, then a JSON line starting {"hf_tokens_per_s" and, last,
`hf_tokens_per_s: <median tokens/s>`.

    python3 bench/hf_train_step.py --threads 2 --steps 5
"""

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps, after 1 warm-up step")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="clip_grad_norm_ max norm; 0 disables")
    ap.add_argument("--aux-coef", type=float, default=0.02, help="router_aux_loss_coef")
    ap.add_argument("--experts-implementation", default=None,
                    help="transformers experts kernel (eager, grouped_mm, batched_mm); default: transformers' choice")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    return args


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()

    config = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, num_local_experts=args.experts,
                           num_experts_per_tok=args.top_k, max_position_embeddings=max(4096, args.seq),
                           router_aux_loss_coef=args.aux_coef, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None)
    config._attn_implementation = "eager"
    if args.experts_implementation:
        config._experts_implementation = args.experts_implementation
    model = MixtralForCausalLM(config).float().train()
    n_params = sum(p.numel() for p in model.parameters())
    experts_impl = getattr(model.config, "_experts_implementation", None)

    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen)
    tokens = args.micro_batch * args.seq
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"params {n_params / 1e6:.1f}M, experts_implementation {experts_impl}, attn eager, fp32, "
          f"tokens/step {tokens}", flush=True)

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True)
        out.loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        return time.perf_counter() - t0, out.loss.item()

    dt, loss = step()
    print(f"warm-up: {dt:.3f} s  loss {loss:.4f}", flush=True)
    times = []
    for i in range(args.steps):
        dt, loss = step()
        times.append(dt)
        print(f"step {i + 1}: {dt:.3f} s  {tokens / dt:.1f} tokens/s  loss {loss:.4f}", flush=True)

    median = statistics.median(times)
    tps = tokens / median
    result = {"hf_tokens_per_s": round(tps, 2), "median_step_s": round(median, 4),
              "step_s": [round(t, 4) for t in times], "tokens_per_step": tokens, "threads": torch.get_num_threads(),
              "params": n_params, "experts_implementation": experts_impl, "attn_implementation": "eager",
              "dtype": "float32", "grad_clip": args.grad_clip,
              "config": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "experts", "top_k",
                                                       "intermediate", "vocab", "seq", "micro_batch")},
              "torch": torch.__version__, "transformers": transformers.__version__,
              "machine": platform.processor() or platform.machine()}
    print(json.dumps(result))
    print(f"hf_tokens_per_s: {tps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
