#!/usr/bin/env bash
# LoRA beside full fine-tuning on the `moetron bench train` default shape (hidden 512, 4 layers, 8
# experts top-2, vocab 32000; seq 512, micro-batch 4): trainable parameters, optimizer state bytes,
# peak RSS and tokens/s of full fine-tuning, LoRA over an fp32 base and LoRA over a bf16 base, one
# process per run (RSS is per process), ROUNDS alternating rounds, medians and the medians of the
# per-round ratios to full fine-tuning.  Usage: bash bench/lora_train.sh [ROUNDS] [RANK]
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
  $M bench train --steps 3 --warmup 1 --json --lora-rank "$RANK" --base-bf16 | tail -1 > "$OUT/lora_bf16.$r.json"
done
python3 - "$OUT" "$ROUNDS" "$RANK" <<'PY'
import json, statistics, sys
out, rounds, rank = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kinds = ("full", "lora", "lora_bf16")
runs = {k: [json.load(open(f"{out}/{k}.{r}.json")) for r in range(1, rounds + 1)] for k in kinds}
med = lambda k, f: statistics.median(x[f] for x in runs[k])
ratio = lambda k, f: statistics.median(l[f] / f_[f] for l, f_ in zip(runs[k], runs["full"]))
print(f"{'':24}{'full':>14}{'LoRA r' + rank:>14}{'/ full':>9}{'+ bf16 base':>14}{'/ full':>9}")
for f, fmt in (("trainable_params", "{:,.0f}"), ("optimizer_state_bytes", "{:,.0f}"), ("peak_rss_mib", "{:.0f}"),
               ("tokens_per_s", "{:.0f}")):
    print(f"{f:24}{fmt.format(med('full', f)):>14}{fmt.format(med('lora', f)):>14}{ratio('lora', f):>9.4f}"
          f"{fmt.format(med('lora_bf16', f)):>14}{ratio('lora_bf16', f):>9.4f}")
print(f"medians of {rounds} alternating rounds; ratios are medians of per-round ratios")
PY
