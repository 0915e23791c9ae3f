#!/usr/bin/env python3
"""`moetron serve` under 1, 4, 8, 16 concurrent streaming clients: total generated tokens/s, beside the
same requests sent one at a time, and whether every reply equals what that request gets alone (greedy).

  python3 bench/serve_concurrency.py --model DIR [--clients 1,4,8,16] [--tokens 64] [--rounds 3] [--quantize q8_0]
                                    [--same-prompts]

Each client sends one streaming /v1/completions request (a different prompt per client, temperature
0, max_tokens --tokens; the tokens counted are the usage the server reports); a round runs, for each
concurrency level in turn, the sequential baseline (the requests one at a time) and then the same
requests at once. The server keeps each finished request's KV cache and reuses a cache that shares a
prompt's prefix, so every timed run starts from prompts no cache holds: each round and level has its
own prompts (the client's number and one unique to the run first), and before the concurrent run as
many filler requests as the server has caches, all at once, take every cache (untimed; the first
such run, before round 1, is the server's warm-up). Both sides thus prefill their prompts, and the
concurrent replies are compared with the baseline's, computed alone from scratch.
--same-prompts sends the same prompts in every round, without fillers: from round 2 on every timed run
finds its prompts cached on both sides (a chat's follow-ups), so it measures decoding without prefill.
Needs only the Python standard library; the model directory needs a tokenizer.
"""
import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def prompt(i, tag):
    """Client i's prompt in the run tagged `tag`: i and the tag first, so two prompts share at most the
    tokens of those numbers' common leading digits."""
    return f"{i} {tag} " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12 + i % 5))


def filler(i):
    """A prompt sharing no word with prompt(): it takes a KV cache without matching anything there."""
    return "Zebras yawn " + " ".join(["loudly", "often", "near", "ponds"][(i + k) % 4] for k in range(6)) + f" {i}"


def complete(port, text, tokens):
    """One streaming completion; returns (text, generated token count)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": text, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]}")
    text, usage = "", None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("choices"):
            text += ev["choices"][0].get("text", "")
        if ev.get("usage"):
            usage = ev["usage"]["completion_tokens"]
    c.close()
    return text, usage


def run_level(port, texts, tokens):
    """The prompts at once, a client each; returns (wall seconds, total tokens, replies)."""
    out = [None] * len(texts)
    def client(i):
        out[i] = complete(port, texts[i], tokens)
    th = [threading.Thread(target=client, args=(i,)) for i in range(len(texts))]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    return time.perf_counter() - t0, sum(o[1] for o in out), [o[0] for o in out]


def run_sequential(port, texts, tokens):
    t0 = time.perf_counter()
    out = [complete(port, t, tokens) for t in texts]
    return time.perf_counter() - t0, sum(o[1] for o in out), [o[0] for o in out]


def take_every_cache(port, caches, tokens):
    """`caches` filler requests at once, each long enough to be running while the others are admitted,
    so each holds a KV cache of its own: afterwards no cache holds a benchmark prompt."""
    run_level(port, [filler(i) for i in range(caches)], tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quantize", default="none", help="the server's --quantize (none | q8_0)")
    ap.add_argument("--same-prompts", action="store_true",
                    help="the same prompts every round and no fillers: later rounds find them cached")
    ap.add_argument("--moetron", default=os.environ.get("MOETRON_BINARY", os.path.join(ROOT, "build", "moetron")))
    a = ap.parse_args()
    levels = [int(c) for c in a.clients.split(",")]
    cmd = [a.moetron, "serve", "--model", a.model, "--port", "0", "--quiet", "--max-batch", str(max(levels)),
           "--quantize", a.quantize,
           "--queue-size", str(max(levels)), "--max-tokens-limit", str(a.tokens)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = srv.stdout.readline()
        if "listening on" not in line:
            sys.exit(f"moetron serve did not start: {line!r}")
        port = int(line.rsplit(":", 1)[1])
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
        print(f"CPU: {cpu}, {os.cpu_count()} cores; model {a.model}; {a.tokens} tokens a reply")
        # Warm-up, untimed: the first batch of a fresh server touches its scratch and KV caches for the
        # first time (on the 2-core Xeon VM those page faults cost the first 8-client run ~0.3 s of
        # its ~2 s), which a server pays once, not per request.
        take_every_cache(port, max(levels), a.tokens)
        rows = {n: [] for n in levels}
        for rnd in range(1, a.rounds + 1):
            for n in levels:
                prompts = [prompt(i, 1 if a.same_prompts else 100 * rnd + n) for i in range(n)]
                ws, toks, texts = run_sequential(port, prompts, a.tokens)
                if not a.same_prompts:
                    take_every_cache(port, max(levels), min(16, a.tokens))
                wc, tokc, textc = run_level(port, prompts, a.tokens)
                same = textc == texts
                rows[n].append((toks / ws, tokc / wc, same))
                print(f"round {rnd}, {n} clients: one at a time {toks / ws:.1f} tok/s, concurrent {tokc / wc:.1f} "
                      f"tok/s (x{(tokc / wc) / (toks / ws):.2f}), replies equal to alone: {same}", flush=True)
        print("\n| clients | one at a time tok/s | concurrent tok/s | ratio (median of rounds) | replies equal |")
        print("| --- | --- | --- | --- | --- |")
        for n in levels:
            r = rows[n]
            print(f"| {n} | {statistics.median(x[0] for x in r):.1f} | {statistics.median(x[1] for x in r):.1f} | "
                  f"{statistics.median(x[1] / x[0] for x in r):.2f} | {all(x[2] for x in r)} |")
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    main()
