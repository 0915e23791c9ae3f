#!/usr/bin/env bash
# Data-parallel training throughput on this machine (issue #7's figure): the demo model
# (configs/demo.yaml, 3.4M parameters, global batch 32 x 256 tokens) for STEPS steps at
#   dp=1, one process with 2 threads   and   dp=2, mpirun -np 2 with 1 thread each (ZeRO-1),
# alternating, ROUNDS rounds; prints the median tokens/s of each (steps after the fifth) and the
# communication bytes rank 0 sent per step beside the theoretical ZeRO-1 volume
#   reduce-scatter of the fp32 gradients + all-gather of the fp32 parameters = 2 (dp-1)/dp * 4 P bytes.
# Needs the demo's data (runs/demo/data; made here with the demo's own commands when missing).
#   bash bench/dist.sh            STEPS=30 ROUNDS=2
set -euo pipefail
cd "$(dirname "$0")/.."
M=${MOETRON_BINARY:-./build/moetron}
steps=${STEPS:-30}
rounds=${ROUNDS:-2}
D=runs/demo
if [ ! -f "$D/data/dataset.json" ]; then
  $M data synthetic --task addition --train-examples 30000 --test-examples 200 --output "$D/raw"
  $M tokenizer train --input "$D/raw/train.jsonl" --vocab-size 320 --output "$D/tokenizer" \
    --user-defined-symbols 0 1 2 3 4 5 6 7 8 9
  $M data prepare --input "$D/raw/train.jsonl" --tokenizer "$D/tokenizer.model" --output "$D/data" \
    --valid-fraction 0.02 --quiet
fi
out=${OUT:-/tmp/bench_dist}
rm -rf "$out"
mkdir -p "$out"
common=(train.max_steps="$steps" eval.every_steps=0 checkpoint.every_steps=0 log.every_steps=1 log.tensorboard=false)
for r in $(seq 1 "$rounds"); do
  OMP_NUM_THREADS=2 $M train -c configs/demo.yaml run_dir="$out/dp1-$r" "${common[@]}" > "$out/dp1-$r.log" 2>&1
  OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root --bind-to none -np 2 -x OMP_NUM_THREADS \
    $M train -c configs/demo.yaml run_dir="$out/dp2-$r" "${common[@]}" > "$out/dp2-$r.log" 2>&1
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
C, L, V, E, I, NH, NKV = 128, 4, 320, 8, 256, 4, 2   # configs/demo.yaml
HD = C // NH
P = 2 * V * C + C + L * (C * NH * HD + 2 * C * NKV * HD + NH * HD * C + 2 * C + E * C + E * 3 * I * C)
def steps(run):
    rows = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl")]
    return [r for r in rows if "tokens_per_s" in r and r["step"] > 5]
for dp in (1, 2):
    tps = [statistics.median(r["tokens_per_s"] for r in steps(f"dp{dp}-{k}")) for k in range(1, rounds + 1)]
    comm = statistics.median(r.get("comm_bytes", 0) for k in range(1, rounds + 1) for r in steps(f"dp{dp}-{k}"))
    theory = 2 * (dp - 1) / dp * 4 * P
    print(f"dp={dp}: {statistics.median(tps):.0f} tokens/s (rounds: {', '.join(f'{t:.0f}' for t in tps)}); "
          f"rank 0 sent {comm / 1e6:.2f} MB/step, ZeRO-1 theory {theory / 1e6:.2f} MB/step ({P} parameters)")
PY
