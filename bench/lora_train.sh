#!/usr/bin/env bash
# LoRA beside full fine-tuning on the `moetron bench train` default shape (hidden 512, 4 layers, 8
# experts top-2, vocab 32000; seq 512, micro-batch 4): trainable parameters, optimizer state bytes,
# peak RSS and tokens/s, one process per run (RSS is per process), ROUNDS alternating rounds,
# medians and the median of the per-round ratios.  Usage: bash bench/lora_train.sh [ROUNDS] [RANK]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
RANK=${2:-16}
M=./build/moetron
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
for r in $(seq 1 "$ROUNDS"); do
  $M bench train --steps 3 --warmup 1 --json | tail -1 > "$OUT/full.$r.json"
  $M bench train --steps 3 --warmup 1 --json --lora-rank "$RANK" | tail -1 > "$OUT/lora.$r.json"
done
python3 - "$OUT" "$ROUNDS" "$RANK" <<'PY'
import json, statistics, sys
out, rounds, rank = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {k: [json.load(open(f"{out}/{k}.{r}.json")) for r in range(1, rounds + 1)] for k in ("full", "lora")}
med = lambda k, f: statistics.median(x[f] for x in runs[k])
ratio = lambda f: statistics.median(l[f] / f_[f] for l, f_ in zip(runs["lora"], runs["full"]))
print(f"{'':24}{'full':>16}{'LoRA r' + rank:>16}{'LoRA / full':>14}")
for f, fmt in (("trainable_params", "{:,.0f}"), ("optimizer_state_bytes", "{:,.0f}"), ("peak_rss_mib", "{:.0f}"),
               ("tokens_per_s", "{:.0f}")):
    print(f"{f:24}{fmt.format(med('full', f)):>16}{fmt.format(med('lora', f)):>16}{ratio(f):>14.4f}")
print(f"medians of {rounds} alternating rounds; ratios are medians of per-round ratios")
PY
