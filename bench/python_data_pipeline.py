#!/usr/bin/env python3
"""The Python counterpart of `moetron bench data`: chat JSONL -> Mixtral-instruct tokens, timed.

Two implementations of the same template-and-tokenize job (read lines, parse JSON, apply the
Mixtral-8x7B-Instruct v1 chat template, tokenize):

  --impl mistral-common  mistral-common's MistralTokenizer (v1) encode_chat_completion per line, in
                         finetuning validation mode: the reference moetron's `mistral` template matches.
                         Produces tokens only (mistral-common has no loss mask).
  --impl sentencepiece   the same template written in Python over sentencepiece's encode (one call per
                         piece, as mistral-common does), producing tokens and the loss mask like moetron.
                         The fastest plain-Python way to do the job.

--workers N runs N processes (multiprocessing, chunks of lines in order).  Prints tokens/s, the median
of --repeats runs, and the peak RSS of the process and its workers.

    pip install mistral-common sentencepiece
    python3 bench/python_data_pipeline.py --input /tmp/chat50.jsonl \\
        --tokenizer ../shared/data/mixtral-tokenizer.model --impl sentencepiece --workers 1
"""

import argparse
import hashlib
import itertools
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time

_state = {}


def _init(impl, tokenizer_path):
    if impl == "mistral-common":
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        packaged = str(MistralTokenizer._data_path() / "tokenizer.model.v1")
        with open(packaged, "rb") as a, open(tokenizer_path, "rb") as b:
            if hashlib.sha256(a.read()).digest() != hashlib.sha256(b.read()).digest():
                sys.exit(f"{tokenizer_path} is not mistral-common's tokenizer.model.v1")
        _state["tok"] = MistralTokenizer.from_file(packaged, mode=ValidationMode.finetuning)
        _state["req"] = ChatCompletionRequest
    else:
        import sentencepiece as spm

        _state["sp"] = spm.SentencePieceProcessor(model_file=tokenizer_path)
    _state["impl"] = impl


def _mistral_template(sp, messages):
    """mistral-common v1's encode_chat_completion, as moetron's `mistral` template: tokens and mask."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    turns = []
    for role, group in itertools.groupby(messages, key=lambda m: m["role"]):
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"unknown role {role}")
        if role != "system":
            turns.append((role, "\n\n".join(m["content"] for m in group if m["content"])))
    if not turns or turns[0][0] != "user":
        turns.insert(0, ("user", ""))
    tokens, mask = [sp.bos_id()], [0]
    for i, (role, content) in enumerate(turns):
        if role == "user":
            text = "[INST] " + (system + "\n\n" if i == 0 and system else "") + content + " [/INST]"
            ids = sp.encode(text)
            tokens += ids
            mask += [0] * len(ids)
        else:
            if not content:
                raise ValueError("empty assistant message")
            ids = sp.encode(content) + [sp.eos_id()]
            tokens += ids
            mask += [1] * len(ids)
    return tokens, mask


def _work(lines):
    tokens = docs = skipped = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            if _state["impl"] == "mistral-common":
                ids = _state["tok"].encode_chat_completion(_state["req"](messages=messages)).tokens
            else:
                ids, _mask = _mistral_template(_state["sp"], messages)
        except Exception:  # noqa: BLE001 - counted like moetron's skipped lines
            skipped += 1
            continue
        tokens += len(ids)
        docs += 1
    return tokens, docs, skipped


def _chunks(path, size, max_lines):
    with open(path, encoding="utf-8") as f:
        lines = itertools.islice(f, max_lines) if max_lines else f
        while True:
            chunk = list(itertools.islice(lines, size))
            if not chunk:
                return
            yield chunk


def cpu_seconds():
    """CPU seconds of this process and its waited-for children (the pool's workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def run_once(args):
    t0 = time.perf_counter()
    totals = [0, 0, 0]
    if args.workers == 1:
        _init(args.impl, args.tokenizer)
        results = map(_work, _chunks(args.input, args.chunk, args.max_lines))
        for r in results:
            totals = [a + b for a, b in zip(totals, r)]
    else:
        with mp.Pool(args.workers, initializer=_init, initargs=(args.impl, args.tokenizer)) as pool:
            for r in pool.imap(_work, _chunks(args.input, args.chunk, args.max_lines)):
                totals = [a + b for a, b in zip(totals, r)]
    return time.perf_counter() - t0, totals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--impl", choices=["mistral-common", "sentencepiece"], default="sentencepiece")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=500, help="lines per task")
    ap.add_argument("--max-lines", type=int, default=0, help="only the first N lines (0: all)")
    args = ap.parse_args()
    rates, per_cpu = [], []
    for i in range(args.repeats):
        c0 = cpu_seconds()
        seconds, (tokens, docs, skipped) = run_once(args)
        cpu = cpu_seconds() - c0
        rates.append(tokens / seconds)
        per_cpu.append(tokens / cpu)
        print(f"  run {i + 1}: {seconds:.2f} s, {tokens / seconds:.0f} tokens/s, {tokens / cpu:.0f} tokens per "
              f"CPU-second ({docs} documents, {tokens} tokens, {skipped} skipped)", flush=True)
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    med, med_cpu = statistics.median(rates), statistics.median(per_cpu)
    print(f"python {args.impl}: {args.workers} worker(s), tokens/s (median of {args.repeats}): {med:.0f} "
          f"({med / args.workers:.0f} per worker), tokens per CPU-second {med_cpu:.0f}; "
          f"peak RSS {rss / 1024:.0f} MiB (largest single process)")
    print(json.dumps({"impl": args.impl, "workers": args.workers, "tokens_per_s": round(med, 1),
                      "tokens_per_cpu_s": round(med_cpu, 1), "peak_rss_mib": round(rss / 1024, 1)}))


if __name__ == "__main__":
    main()
