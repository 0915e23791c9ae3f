#!/usr/bin/env bash
# `moetron bench generate` beside transformers' generate (bench/hf_generate.py) on the same bf16
# checkpoint, the same prompt ids and thread count, alternating rounds; prints the median prefill and
# decode tokens/s of each and the median decode ratio (issue #9's figure).  Needs torch + transformers.
#   bash bench/generate.sh            ROUNDS=3 THREADS="1 2" MODEL=/tmp/bench-moe
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${MOETRON_BINARY:-$here/build/moetron}"
model="${MODEL:-/tmp/bench-moe}"
rounds="${ROUNDS:-3}"
out="${OUT:-/tmp/bench_generate}"
shape=(--hidden 256 --layers 4 --experts 8 --vocab 32000)
lengths=(--prompt-tokens 128 --new-tokens 64)
[[ -f "$model/config.json" ]] || python3 "$here/bench/hf_generate.py" --save-model "$model" "${shape[@]}"
mkdir -p "$out"
: > "$out/results.jsonl"
for round in $(seq 1 "$rounds"); do
  for threads in ${THREADS:-1 2}; do
    m=$("$bin" bench generate --model "$model" --threads "$threads" "${lengths[@]}" --runs 3 --json | grep '^{')
    h=$(python3 "$here/bench/hf_generate.py" --model "$model" --threads "$threads" "${lengths[@]}" --runs 3 --json |
        grep '^{')
    echo "{\"round\": $round, \"threads\": $threads, \"moetron\": $m, \"transformers\": $h}" | tee -a "$out/results.jsonl"
  done
done
python3 - "$out/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for t in sorted({r["threads"] for r in rows}):
    rs = [r for r in rows if r["threads"] == t]
    med = lambda who, k: statistics.median(r[who][k] for r in rs)
    ratio = statistics.median(r["moetron"]["decode_tokens_per_s"] / r["transformers"]["decode_tokens_per_s"] for r in rs)
    print(f"threads {t} ({len(rs)} rounds): moetron prefill {med('moetron', 'prefill_tokens_per_s'):.0f} / decode "
          f"{med('moetron', 'decode_tokens_per_s'):.1f} tok/s; transformers prefill "
          f"{med('transformers', 'prefill_tokens_per_s'):.0f} / decode {med('transformers', 'decode_tokens_per_s'):.1f} tok/s; "
          f"decode ratio (median of rounds) {ratio:.1f}x")
PY
