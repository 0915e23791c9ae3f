#!/usr/bin/env bash
# The main job on a bundled example, from a fresh clone: install, build, generate a synthetic chat
# dataset (two-digit addition; the test questions never occur in training), train a tokenizer on
# it, prepare the data, measure the untrained model's held-out accuracy, train a small MoE on the
# CPU (a few minutes), measure the accuracy again, and answer a few prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
echo "== 0. setup and build: the Debian packages, then the moetron binary only (about 5 minutes on 2"
echo "   cores; scripts/test.sh builds the tests too)"
bash scripts/setup.sh
# The build's progress every 10%, and any error or warning in full.
BUILD_DIR=build BUILD_TARGETS=moetron bash scripts/build.sh 2>&1 | awk '
  /^\[[0-9]+\/[0-9]+\]/ {
    split(substr($1, 2, length($1) - 2), a, "/")
    pct = int(100 * a[1] / a[2])
    if (pct >= shown + 10 || a[1] == a[2]) { printf "   build: %3d%% (%d of %d steps)\n", pct, a[1], a[2]; shown = pct - pct % 10 }
    next
  }
  /[Ee]rror|FAILED|[Ww]arning/ { print }
  fflush()'
echo "   built ./build/moetron in $(( $(date +%s) - start )) s"
M=./build/moetron
D=runs/demo
rm -rf "$D"
mkdir -p "$D"

echo "== 1. synthetic chat data: two-digit addition, 200 held-out questions"
$M data synthetic --task addition --train-examples 30000 --test-examples 200 --output "$D/raw"
echo "== 2. tokenizer (SentencePiece BPE, digits as single pieces)"
$M tokenizer train --input "$D/raw/train.jsonl" --vocab-size 320 --output "$D/tokenizer" \
  --user-defined-symbols 0 1 2 3 4 5 6 7 8 9
echo "== 3. data prepare (mistral [INST] template, only the answers in the loss)"
$M data prepare --input "$D/raw/train.jsonl" --tokenizer "$D/tokenizer.model" --output "$D/data" \
  --valid-fraction 0.02 --quiet
echo "== 4. held-out accuracy of the untrained model"
# A one-step run at learning rate 0 saves the initial weights as a checkpoint.
$M train -c configs/demo.yaml run_dir="$D/untrained" train.max_steps=1 train.lr=0 train.min_lr=0 \
  train.warmup_steps=0 eval.every_steps=0 log.tensorboard=false > "$D/untrained.log"
$M generate --model "$D/untrained/checkpoints/step-000001" --tokenizer "$D/tokenizer.model" \
  --eval-chat "$D/raw/test.jsonl" --max-new-tokens 6 | tail -1
echo "== 5. training (configs/demo.yaml)"
$M train -c configs/demo.yaml
CKPT="$D/run/checkpoints/$(cat "$D/run/checkpoints/latest")"
echo "== 6. held-out accuracy after training ($CKPT)"
$M generate --model "$CKPT" --tokenizer "$D/tokenizer.model" \
  --eval-chat "$D/raw/test.jsonl" --max-new-tokens 6
echo "== 7. a few prompts"
for q in "What is 12 + 30?" "Add 45 and 27." "What is the sum of 99 and 99?"; do
  printf '%s -> ' "$q"
  $M generate --model "$CKPT" --tokenizer "$D/tokenizer.model" --chat --prompt "$q" \
    --max-new-tokens 6
done
echo "== run directory: $D/run (metrics.jsonl, tb/, checkpoints/, log.txt); $(( $(date +%s) - start )) s in all"
