#!/usr/bin/env bash
# Data- and pipeline-parallel training throughput on this machine (issues #7 and #8): the demo model
# (configs/demo.yaml, 3.4M parameters, 4 layers, global batch 32 x 256 tokens) for STEPS steps at
#   dp=1, one process with 2 threads   and   dp=2, mpirun -np 2 with 1 thread each (ZeRO-1),
# and, with micro-batches of 4 (8 per step, so the pipeline fills: bubble 1/9),
#   dp=1 mb4, one process with 2 threads   and   pp=2 mb4, mpirun -np 2 (2 layers per stage, 1F1B),
# alternating, ROUNDS rounds; prints the median tokens/s of each (steps after the fifth) and the
# communication bytes rank 0 sent per step beside the theory:
#   dp=2: reduce-scatter of the fp32 gradients + all-gather of the fp32 parameters = 2 (dp-1)/dp * 4 P
#   pp=2: stage 0 sends each micro-batch's hidden states forward (B x T x C fp32) with the pooled
#         router statistics (2E + 1 fp64): m (4 B T C + 8 (2E + 1)).
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
  $M tokenizer train --input "$D/raw/train.jsonl" --vocab-size 320 --output "$D/tokenizer" --force \
    --user-defined-symbols 0 1 2 3 4 5 6 7 8 9
  $M data prepare --input "$D/raw/train.jsonl" --tokenizer "$D/tokenizer.model" --output "$D/data" \
    --valid-fraction 0.02 --quiet
fi
out=${OUT:-/tmp/bench_dist}
rm -rf "$out"
mkdir -p "$out"
common=(train.max_steps="$steps" eval.every_steps=0 checkpoint.every_steps=0 log.every_steps=1 log.tensorboard=false)
two=(mpirun --oversubscribe --allow-run-as-root --bind-to none -np 2 -x OMP_NUM_THREADS)
for r in $(seq 1 "$rounds"); do
  OMP_NUM_THREADS=2 $M train -c configs/demo.yaml run_dir="$out/dp1-$r" "${common[@]}" > "$out/dp1-$r.log" 2>&1
  OMP_NUM_THREADS=1 "${two[@]}" $M train -c configs/demo.yaml run_dir="$out/dp2-$r" "${common[@]}" \
    > "$out/dp2-$r.log" 2>&1
  OMP_NUM_THREADS=2 $M train -c configs/demo.yaml run_dir="$out/dp1mb4-$r" "${common[@]}" train.micro_batch_size=4 \
    > "$out/dp1mb4-$r.log" 2>&1
  OMP_NUM_THREADS=1 "${two[@]}" $M train -c configs/demo.yaml run_dir="$out/pp2mb4-$r" "${common[@]}" \
    train.micro_batch_size=4 parallel.pp=2 > "$out/pp2mb4-$r.log" 2>&1
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
B, T, m = 4, 256, 8  # the pipeline runs: micro-batches of 4, 8 per step
theory = {"dp1": 0, "dp2": 2 * (2 - 1) / 2 * 4 * P, "dp1mb4": 0, "pp2mb4": m * (4 * B * T * C + 8 * (2 * E + 1))}
label = {"dp1": "dp=1", "dp2": "dp=2", "dp1mb4": "dp=1 mb4", "pp2mb4": "pp=2 mb4"}
for name in ("dp1", "dp2", "dp1mb4", "pp2mb4"):
    tps = [statistics.median(r["tokens_per_s"] for r in steps(f"{name}-{k}")) for k in range(1, rounds + 1)]
    comm = statistics.median(r.get("comm_bytes", 0) for k in range(1, rounds + 1) for r in steps(f"{name}-{k}"))
    print(f"{label[name]}: {statistics.median(tps):.0f} tokens/s (rounds: {', '.join(f'{t:.0f}' for t in tps)}); "
          f"rank 0 sent {comm / 1e6:.3f} MB/step, theory {theory[name] / 1e6:.3f} MB/step ({P} parameters)")
PY
