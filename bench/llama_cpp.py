#!/usr/bin/env python3
"""moetron beside llama.cpp on the same model and CPU: prefill and decode tokens/s and peak RSS.

llama.cpp is built from the llama-cpp-python sdist on PyPI (it vendors the whole llama.cpp tree, with
convert_hf_to_gguf.py and llama-bench) into --work (default /tmp/moetron-llama.cpp), once; the HF
model is converted to GGUF there, once per type.  Then, alternating in every round, for each thread
count: `moetron bench generate` (prompt P, then N new tokens, greedy) and llama-bench (pp P; tg N at
depth P, i.e. after a P-token prompt, as moetron's decode), each in its own process, whose peak RSS is
read from wait4(), and how much of its memory is on 2 MiB pages (sampled from /proc: moetron asks the
kernel for them, llama.cpp gets what the page cache holds).  Prints medians and the median of per-round
ratios (moetron / llama.cpp).

  python3 bench/llama_cpp.py --model DIR [--types bf16,q8_0] [--threads 1,2] [--rounds 5]
  python3 bench/llama_cpp.py --make-small DIR   # the issue's small model (hidden 256, 4 layers, 8 experts)

moetron runs, like for like: for bf16 the model's own (bf16) files, for f16 an f16 copy of them
(`moetron convert --dtype fp16`, made once in --work), both used in place; for q8_0 the bf16 files with
--quantize q8_0 (quantized at load, as llama.cpp's Q8_0).  A benchmark and reference tool only: nothing in moetron's
build or tests needs llama.cpp.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def huge_bytes(pid):
    """Bytes of process pid's memory on 2 MiB pages now (FilePmdMapped + AnonHugePages); 0 if gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("FilePmdMapped:", "AnonHugePages:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


def measure(cmd):
    """Runs cmd with wait4 to get its own peak RSS; returns (stdout, peak_rss_bytes, huge_bytes): the most
    of its memory seen on 2 MiB pages (sampled every 0.1 s) -- how much of the weights each program
    reads through 2 MiB pages (moetron asks for them; the TLB then misses once per 2 MiB)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(w, 1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(r)
        try:
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    os.close(w)
    chunks, huge, done = [], [0], threading.Event()

    def sample():
        while not done.wait(0.1):
            huge[0] = max(huge[0], huge_bytes(pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    done.set()
    sampler.join()
    _, status, ru = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"command failed: {' '.join(cmd)}")
    return b"".join(chunks).decode(), ru.ru_maxrss * 1024, huge[0]


def ggml_isa_flags():
    """-DGGML_NATIVE=ON, except on a CPU that lists AMX: -march=native then compiles llama.cpp's AMX
    kernels, which die with SIGILL (tileloadd) on VMs that advertise AMX without enabling its tile
    state; there the same instruction sets are named one by one, AMX left out."""
    flags = set(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split(":", 1)[1].split())
    if not any(f.startswith("amx") for f in flags):
        return ["-DGGML_NATIVE=ON"]
    isa = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
           "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
           "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}
    return ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if f in flags else 'OFF'}" for f, opt in isa.items()]


def build_llama(work):
    """Builds llama-bench from the llama-cpp-python sdist; returns the llama.cpp source tree."""
    bins = None
    for d in sorted(os.listdir(work)) if os.path.isdir(work) else []:
        tree = os.path.join(work, d, "vendor", "llama.cpp")
        if os.path.exists(os.path.join(tree, "build", "bin", "llama-bench")):
            bins = tree
    if bins:
        return bins
    os.makedirs(work, exist_ok=True)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "llama-cpp-python", "-d", work])
    sdist = [f for f in os.listdir(work) if f.startswith("llama_cpp_python-") and f.endswith(".tar.gz")][0]
    with tarfile.open(os.path.join(work, sdist)) as t:
        t.extractall(work, filter="data")
    tree = os.path.join(work, sdist[: -len(".tar.gz")], "vendor", "llama.cpp")
    subprocess.check_call(["cmake", "-S", tree, "-B", os.path.join(tree, "build"), "-G", "Ninja",
                           "-DCMAKE_BUILD_TYPE=Release", *ggml_isa_flags(), "-DLLAMA_CURL=OFF",
                           "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    subprocess.check_call(["cmake", "--build", os.path.join(tree, "build"), "-j", str(os.cpu_count()),
                           "--target", "llama-bench", "llama-completion", "llama-simple", "llama-quantize",
                           "llama-perplexity"])
    return tree


def to_gguf(tree, model, typ, work, moetron):
    """The model as a GGUF of `typ`, made once: by llama.cpp's convert_hf_to_gguf.py when torch (which it
    imports) is installed; otherwise by `moetron export gguf` for bf16 / f16 and, for q8_0, by
    llama.cpp's own llama-quantize from that bf16 file."""
    out = os.path.join(work, f"{os.path.basename(os.path.normpath(model))}-{typ}.gguf")
    if os.path.exists(out):
        return out
    try:
        import torch  # noqa: F401
        env = dict(os.environ, PYTHONPATH=os.path.join(tree, "gguf-py"))
        subprocess.check_call([sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), model, "--outtype", typ,
                               "--outfile", out], env=env, stdout=subprocess.DEVNULL)
    except ImportError:
        if typ == "q8_0":
            src = to_gguf(tree, model, "bf16", work, moetron)
            subprocess.check_call([os.path.join(tree, "build", "bin", "llama-quantize"), src, out, "q8_0"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            subprocess.check_call([moetron, "export", "gguf", "--model", model, "--output", out, "--type", typ],
                                  stdout=subprocess.DEVNULL)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (bf16; needs a tokenizer for the GGUF conversion)")
    ap.add_argument("--make-small", help="write the issue's small random Mixtral (bf16) to this directory, exit")
    ap.add_argument("--types", default="bf16", help="comma list of bf16, f16, q8_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--work", default="/tmp/moetron-llama.cpp")
    ap.add_argument("--moetron", default=os.environ.get("MOETRON_BINARY", os.path.join(ROOT, "build", "moetron")))
    ap.add_argument("--json-out", help="append every round's figures to this JSONL file")
    a = ap.parse_args()
    tokenizer = os.path.join(ROOT, "..", "shared", "data", "mixtral-tokenizer.model")
    if a.make_small:
        shape = ["--hidden", "256", "--layers", "4", "--experts", "8", "--vocab", "32000"]
        try:  # transformers' random init when torch is here; else moetron's (the same shape)
            import torch  # noqa: F401
            subprocess.check_call([sys.executable, os.path.join(HERE, "hf_generate.py"), "--save-model", a.make_small]
                                  + shape)
        except ImportError:
            subprocess.check_call([a.moetron, "bench", "checkpoint", "--make-model", a.make_small, "--intermediate",
                                   "512", "--heads", "8", "--kv-heads", "2"] + shape)
        shutil.copy(tokenizer, os.path.join(a.make_small, "tokenizer.model"))
        return
    if not a.model:
        sys.exit("--model DIR (or --make-small DIR) is required")
    if not any(os.path.exists(os.path.join(a.model, f)) for f in ("tokenizer.model", "tokenizer.json")):
        if not os.path.exists(tokenizer):
            sys.exit(f"{a.model} has no tokenizer (llama.cpp's converter needs one) and {tokenizer} is absent")
        shutil.copy(tokenizer, os.path.join(a.model, "tokenizer.model"))  # a random bench model: vocab 32000
    tree = build_llama(a.work)
    bench = os.path.join(tree, "build", "bin", "llama-bench")
    types = a.types.split(",")
    for t in types:
        if t not in ("bf16", "f16", "q8_0"):
            sys.exit(f"--types: {t} is not one of bf16, f16, q8_0")
    ggufs = {t: to_gguf(tree, a.model, t, a.work, a.moetron) for t in types}
    moetron_dirs = {t: a.model for t in types}
    if "f16" in types:  # moetron's f16 run reads f16 files, as llama.cpp's f16 GGUF
        f16_dir = os.path.join(a.work, os.path.basename(os.path.normpath(a.model)) + "-f16")
        if not os.path.exists(os.path.join(f16_dir, "config.json")):
            subprocess.check_call([a.moetron, "convert", "--input", a.model, "--output", f16_dir, "--dtype", "fp16", "--drop-optimizer"])
        moetron_dirs["f16"] = f16_dir
    threads = [int(t) for t in a.threads.split(",")]
    rows = []
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; model {a.model}; prompt {a.prompt}, new {a.new}")
    for rnd in range(1, a.rounds + 1):
        for t in threads:
            for typ in types:
                cmd = [a.moetron, "bench", "generate", "--model", moetron_dirs[typ], "--threads", str(t), "--prompt-tokens",
                       str(a.prompt), "--new-tokens", str(a.new), "--runs", "3", "--json"]
                if typ == "q8_0":
                    cmd += ["--quantize", "q8_0"]
                out, m_rss, m_huge = measure(cmd)
                m = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
                pp, l_rss1, l_huge1 = measure([bench, "-m", ggufs[typ], "-p", str(a.prompt), "-n", "0", "-t", str(t),
                                               "-r", "3", "-o", "json"])
                tg, l_rss2, l_huge2 = measure([bench, "-m", ggufs[typ], "-p", "0", "-n", str(a.new), "-d",
                                               str(a.prompt), "-t", str(t), "-r", "3", "-o", "json"])
                row = {"round": rnd, "threads": t, "type": typ, "moetron": m, "moetron_rss": m_rss,
                       "llama_prefill": json.loads(pp)[0]["avg_ts"], "llama_decode": json.loads(tg)[0]["avg_ts"],
                       "llama_rss": max(l_rss1, l_rss2), "moetron_huge": m_huge, "llama_huge": max(l_huge1, l_huge2)}
                rows.append(row)
                print(f"round {rnd} threads {t} {typ}: moetron {m['prefill_tokens_per_s']:.0f} / "
                      f"{m['decode_tokens_per_s']:.1f} tok/s, RSS {m_rss / 2**20:.0f} MiB ({m_huge / 2**20:.0f} on "
                      f"2 MiB pages); llama.cpp {row['llama_prefill']:.0f} / {row['llama_decode']:.1f}, RSS "
                      f"{row['llama_rss'] / 2**20:.0f} MiB ({row['llama_huge'] / 2**20:.0f} on 2 MiB pages)", flush=True)
                if a.json_out:
                    with open(a.json_out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print("\nmedians (moetron / llama.cpp ratios: median of per-round ratios)")
    print("| threads | type | moetron prefill / decode tok/s | llama.cpp | ratio prefill / decode | "
          "peak RSS moetron / llama.cpp MiB | moetron RSS / (weights + KV) | MiB on 2 MiB pages moetron / llama.cpp |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in threads:
        for typ in types:
            rs = [r for r in rows if r["threads"] == t and r["type"] == typ]
            med = lambda f: statistics.median(f(r) for r in rs)
            mp, md = med(lambda r: r["moetron"]["prefill_tokens_per_s"]), med(lambda r: r["moetron"]["decode_tokens_per_s"])
            lp, ld = med(lambda r: r["llama_prefill"]), med(lambda r: r["llama_decode"])
            rp = med(lambda r: r["moetron"]["prefill_tokens_per_s"] / r["llama_prefill"])
            rd = med(lambda r: r["moetron"]["decode_tokens_per_s"] / r["llama_decode"])
            mr, lr = med(lambda r: r["moetron_rss"]), med(lambda r: r["llama_rss"])
            budget = med(lambda r: r["moetron_rss"] / (r["moetron"]["weight_bytes"] + r["moetron"]["kv_cache_bytes"]))
            mh, lh = med(lambda r: r["moetron_huge"]), med(lambda r: r["llama_huge"])
            print(f"| {t} | {typ} | {mp:.0f} / {md:.1f} | {lp:.0f} / {ld:.1f} | {rp:.2f} / {rd:.2f} | "
                  f"{mr / 2**20:.0f} / {lr / 2**20:.0f} | {budget:.3f} | {mh / 2**20:.0f} / {lh / 2**20:.0f} |")


if __name__ == "__main__":
    main()
