#!/usr/bin/env bash
# `moetron bench data` at 1 and 2 threads beside the Python pipeline doing the same
# template-and-tokenize job, in one run (issue #3's figure). Needs: pip install sentencepiece.
#   bash bench/data.sh [INPUT.jsonl] [TOKENIZER.model]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${MOETRON_BINARY:-$here/build/moetron}"
input="${1:-/tmp/chat50.jsonl}"
tok="${2:-$here/../shared/data/mixtral-tokenizer.model}"
repeats="${REPEATS:-5}"
[[ -f "$input" ]] || python3 "$here/bench/make_chat_jsonl.py" --out "$input" --mb 50
echo "input: $(du -h "$input" | cut -f1) $input"
for threads in 1 2; do
  /usr/bin/time -f "  peak RSS %M KiB" "$bin" bench data --input "$input" --tokenizer "$tok" \
    --threads "$threads" --repeats "$repeats" --json | tee "/tmp/bench_data_$threads.txt"
done
python3 "$here/bench/python_data_pipeline.py" --input "$input" --tokenizer "$tok" \
  --impl sentencepiece --workers 1 --repeats "$repeats" | tee /tmp/bench_data_py.txt
python3 - <<'PY'
import json
def last_json(p):
    return [json.loads(l) for l in open(p) if l.startswith("{")][-1]
one, two, py = (last_json(f"/tmp/bench_data_{x}.txt") for x in ("1", "2", "py"))
k = "tokens_per_s"
print(f"moetron 1 thread {one[k]:.0f} tok/s, 2 threads {two[k]:.0f} tok/s: scaling {two[k] / one[k]:.2f}x")
print(f"python (1 process) {py[k]:.0f} tok/s: moetron per core / python per core = {one[k] / py[k]:.2f}x")
PY
