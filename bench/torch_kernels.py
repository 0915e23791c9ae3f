#!/usr/bin/env python3
"""Peer kernel benchmark: torch's SDPA and grouped matmul at the shapes `moetron bench kernels` times.

The same kernels, FLOP counts and balanced routing as src/cli/bench_kernels.cpp: causal GQA attention
(forward; backward = 2.5x the forward's FLOPs) through torch.nn.functional.scaled_dot_product_attention
(whatever backend torch picks: FlashAttention / cuDNN on an H100), and the gate/up projection of the
experts as one grouped GEMM (torch._grouped_mm where this torch has it, else one matmul per expert,
named in the output) with its backward (d input and d weight). bf16 on cuda, float32 on cpu. Prints a
table, then one JSON line starting {"torch_attention_forward_tflops".

    python3 bench/torch_kernels.py --device cuda --shape mixtral-8x7b --seq 4096
"""

import argparse
import json
import statistics
import time

import torch

PRESETS = {  # C, NH, NKV, HD, E, K, I: one decoder layer (HF config.json values)
    "mixtral-8x7b": (4096, 32, 8, 128, 8, 2, 14336),
    "qwen3-30b-a3b": (2048, 32, 4, 128, 128, 8, 768),
}


def timed(fn, runs, device):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--shape", choices=sorted(PRESETS), default="mixtral-8x7b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    for flag in ("hidden", "heads", "kv-heads", "head-dim", "experts", "top-k", "intermediate"):
        ap.add_argument("--" + flag, type=int, default=0)
    a = ap.parse_args()
    C, NH, NKV, HD, E, K, I = PRESETS[a.shape]
    C, NH, NKV, HD, E, K, I = [o or p for o, p in zip(
        (a.hidden, a.heads, a.kv_heads, a.head_dim, a.experts, a.top_k, a.intermediate), (C, NH, NKV, HD, E, K, I))]
    B, T, dev = a.micro_batch, a.seq, a.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape, grad=False):
        return (torch.rand(*shape, generator=g, device=dev, dtype=dtype) - 0.5).requires_grad_(grad)

    q, k, v = rnd(B, NH, T, HD, grad=True), rnd(B, NKV, T, HD, grad=True), rnd(B, NKV, T, HD, grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = None

    def attn_fwd():
        nonlocal out
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)

    attn_fwd()
    dout = torch.rand_like(out)
    attn_flops = 2 * 2 * B * NH * T * T * HD / 2
    t_af = timed(attn_fwd, a.runs, dev)

    def attn_bwd():
        o = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), dout)

    t_fb = timed(attn_bwd, a.runs, dev)  # forward + backward: the backward is the difference
    t_ab = max(t_fb - t_af, 1e-9)

    # Balanced routing: row i goes to expert i mod E, rows grouped by expert.
    N = B * T
    M = N * K
    counts = [M // E + (1 if e < M % E else 0) for e in range(E)]
    offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
    x, w = rnd(M, C, grad=True), rnd(E, 2 * I, C, grad=True)
    dy = rnd(M, 2 * I)
    grouped = getattr(torch, "_grouped_mm", None)
    impl = "torch._grouped_mm"

    def gemm(xx, ww):
        return grouped(xx, ww.transpose(-2, -1), offs=offs)

    try:
        if grouped is None or dev != "cuda":
            raise RuntimeError("no torch._grouped_mm here")
        gemm(x, w)
    except Exception:  # older torch, or a GPU / dtype it does not take: one matmul per expert
        impl = "matmul per expert"
        bounds = [0] + torch.tensor(counts).cumsum(0).tolist()

        def gemm(xx, ww):  # noqa: F811
            return torch.cat([xx[bounds[e]:bounds[e + 1]] @ ww[e].t() for e in range(E)])

    gemm_flops = 2 * M * C * 2 * I
    t_gf = timed(lambda: gemm(x, w), a.runs, dev)

    def gemm_fb():
        y = gemm(x, w)
        torch.autograd.grad(y, (x, w), dy)

    t_gb = max(timed(gemm_fb, a.runs, dev) - t_gf, 1e-9)

    res = {
        "torch_attention_forward_tflops": attn_flops / t_af / 1e12,
        "torch_attention_backward_tflops": 2.5 * attn_flops / t_ab / 1e12,
        "torch_grouped_gemm_forward_tflops": gemm_flops / t_gf / 1e12,
        "torch_grouped_gemm_backward_tflops": 2 * gemm_flops / t_gb / 1e12,
        "grouped_impl": impl, "torch": torch.__version__, "device": dev, "shape": a.shape, "seq": T,
        "micro_batch": B,
    }
    print(f"torch kernels ({dev}, {dtype}): C {C}, {NH} heads ({NKV} kv) of {HD}, {E} experts top-{K} of width {I};"
          f" B {B} x T {T}; grouped GEMM: {impl}")
    for name, key, t in (("attention forward", "torch_attention_forward_tflops", t_af),
                         ("attention backward", "torch_attention_backward_tflops", t_ab),
                         ("grouped GEMM forward (w13)", "torch_grouped_gemm_forward_tflops", t_gf),
                         ("grouped GEMM backward (w13)", "torch_grouped_gemm_backward_tflops", t_gb)):
        print(f"  {name:28s} {1e3 * t:10.3f} ms  {res[key]:8.2f} TFLOP/s")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
