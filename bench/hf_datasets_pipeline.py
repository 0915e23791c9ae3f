#!/usr/bin/env python3
"""The Hugging Face counterpart of `moetron bench data --template chatml` with a tokenizer.json: chat
JSONL -> ChatML tokens and assistant loss mask, through `datasets` (load_dataset("json") + map,
batched) and the Rust `tokenizers` library, timed.

Per batch, every message's "<|im_start|>ROLE\\n" + content + "<|im_end|>" and the "\\n" after it go
through Tokenizer.encode_batch (the text HF's apply_chat_template renders, tokenized as it does: the
added tokens split it); the mask marks the assistant messages' tokens that hold content bytes
(offsets), as moetron does.  Run with RAYON_NUM_THREADS=1 for one core; the figure reported per core
is tokens per CPU-second of the process (all its threads), the median of --repeats runs.  The
tokenizer is loaded before the clock starts; datasets' cache is off (in memory).

    pip install datasets tokenizers
    RAYON_NUM_THREADS=1 python3 bench/hf_datasets_pipeline.py --input /tmp/chat50.jsonl \\
        --tokenizer ../shared/data/qwen-tokenizer.json
"""
import argparse
import json
import resource
import statistics
import time


def cpu_seconds():
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime


def run_once(args, tok):
    import datasets

    def fn(batch):
        texts, owners = [], []  # owners: (row, is_assistant, head_chars) per text
        for row, msgs in enumerate(batch["messages"]):
            for m in msgs:
                head = "<|im_start|>" + m["role"] + "\n"
                texts.append(head + m["content"] + "<|im_end|>")
                owners.append((row, m["role"] == "assistant", len(head)))
                texts.append("\n")
                owners.append((row, False, 1 << 30))
        encs = tok.encode_batch_fast(texts, add_special_tokens=False) if args.fast_batch else \
            tok.encode_batch(texts, add_special_tokens=False)
        ids = [[] for _ in batch["messages"]]
        mask = [[] for _ in batch["messages"]]
        for (row, assistant, head), e in zip(owners, encs):
            ids[row] += e.ids
            if assistant:
                mask[row] += [1 if end > head else 0 for (_start, end) in e.offsets]
            else:
                mask[row] += [0] * len(e.ids)
        return {"input_ids": ids, "loss_mask": mask}

    t0, c0 = time.perf_counter(), cpu_seconds()
    ds = datasets.load_dataset("json", data_files=args.input, split="train", keep_in_memory=True)
    out = ds.map(fn, batched=True, batch_size=args.batch_size, remove_columns=ds.column_names, keep_in_memory=True)
    tokens = sum(len(x) for x in out["input_ids"])
    return time.perf_counter() - t0, cpu_seconds() - c0, tokens, len(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--fast-batch", action="store_true", help="encode_batch_fast (no offsets; mask left approximate)")
    args = ap.parse_args()
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_caching()
    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(args.tokenizer)
    rates, per_cpu = [], []
    for i in range(args.repeats):
        secs, cpu, tokens, docs = run_once(args, tok)
        rates.append(tokens / secs)
        per_cpu.append(tokens / cpu)
        print(f"  run {i + 1}: {secs:.2f} s, {tokens / secs:.0f} tokens/s, {tokens / cpu:.0f} tokens per CPU-second "
              f"({docs} documents, {tokens} tokens)", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"hf datasets.map + tokenizers: tokens/s (median of {args.repeats}) {statistics.median(rates):.0f}, "
          f"tokens per CPU-second {statistics.median(per_cpu):.0f}; peak RSS {rss:.0f} MiB")
    print(json.dumps({"impl": "hf-datasets-tokenizers", "tokens_per_s": round(statistics.median(rates), 1),
                      "tokens_per_cpu_s": round(statistics.median(per_cpu), 1), "peak_rss_mib": round(rss, 1)}))


if __name__ == "__main__":
    main()
