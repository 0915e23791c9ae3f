#!/usr/bin/env python3
"""Peer benchmark: one training step of transformers' MixtralForCausalLM (CPU float32, or one CUDA GPU).

A step is: zero_grad, --grad-accum micro-batches of forward with output_router_logits=True
(loss = CE + router_aux_loss_coef * aux) and loss.backward(), clip_grad_norm_ (unless --grad-clip 0),
AdamW step. Random token ids, labels = ids. One warm-up step, then --steps timed steps; tokens per step =
micro_batch * seq * grad_accum.

--device cuda builds the model on the GPU (no CPU init) and, with the default --dtype autocast, trains
fp32 master weights with bf16 autocast (the mixed-precision recipe moetron's CUDA backend follows);
--dtype bf16 trains a pure bf16 model; float32 is the CPU default. Attention is eager (the naive
T x T implementation) unless --attn-implementation says otherwise.

Prints each step's time, then a JSON line starting {"hf_tokens_per_s" and, last,
`hf_tokens_per_s: <median tokens/s>`.

    python3 bench/hf_train_step.py --threads 2 --steps 5
    python3 bench/hf_train_step.py --device cuda --hidden 2048 --layers 16 --heads 16 --kv-heads 8 \
        --intermediate 5632 --seq 4096 --micro-batch 1 --grad-accum 4 --steps 3 --experts-implementation eager
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
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bf16", "autocast"], default=None,
                    help="float32 | bf16 (pure) | autocast (fp32 weights, bf16 compute); default: float32 on cpu, "
                         "autocast on cuda")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--attn-implementation", default="eager", help="eager (default), sdpa, ...")
    args = ap.parse_args()
    if args.dtype is None:
        args.dtype = "autocast" if args.device == "cuda" else "float32"
    if args.grad_accum < 1:
        ap.error("--grad-accum must be >= 1")
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
    config._attn_implementation = args.attn_implementation
    if args.experts_implementation:
        config._experts_implementation = args.experts_implementation
    device = torch.device(args.device)
    param_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with device:  # build directly on the device: no multi-GB CPU initialisation
        model = MixtralForCausalLM(config).to(param_dtype).train()
    n_params = sum(p.numel() for p in model.parameters())
    experts_impl = getattr(model.config, "_experts_implementation", None)
    use_autocast = args.dtype == "autocast"

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen).to(device)
               for _ in range(args.grad_accum)]
    tokens = args.micro_batch * args.seq * args.grad_accum
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or
                                                                                  platform.machine())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device} ({dev_name}), "
          f"threads {torch.get_num_threads()}, params {n_params / 1e6:.1f}M, experts_implementation {experts_impl}, "
          f"attn {args.attn_implementation}, dtype {args.dtype}, grad_accum {args.grad_accum}, tokens/step {tokens}",
          flush=True)

    def step():
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                out = model(input_ids=ids, labels=ids, output_router_logits=True)
            (out.loss / args.grad_accum).backward()
            total += out.loss.detach() / args.grad_accum
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        loss = total.item()  # synchronises
        sync()
        return time.perf_counter() - t0, loss

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
              "params": n_params, "experts_implementation": experts_impl,
              "attn_implementation": args.attn_implementation, "dtype": args.dtype, "device": args.device,
              "grad_accum": args.grad_accum, "grad_clip": args.grad_clip,
              "config": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "experts", "top_k",
                                                       "intermediate", "vocab", "seq", "micro_batch")},
              "torch": torch.__version__, "transformers": transformers.__version__,
              "machine": dev_name}
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    print(json.dumps(result))
    print(f"hf_tokens_per_s: {tps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
