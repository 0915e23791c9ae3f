#!/usr/bin/env bash
# A second bundled example: LoRA SFT on a CPU.  The demo's synthetic chat data (two-digit addition,
# held-out questions), a briefly trained base (configs/demo.yaml for 150 steps), its held-out
# accuracy; then rank-16 LoRA on attention and every expert over the frozen base
# (configs/demo-lora.yaml), the accuracy with the adapter applied (generate --lora), the adapter
# merged into a plain HF model (convert --merge-lora) and its accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=build bash scripts/build.sh > /dev/null
M=./build/moetron
D=runs/demo-lora
rm -rf "$D"
mkdir -p "$D"

echo "== 1. synthetic chat data, tokenizer, data prepare (as scripts/demo.sh)"
$M data synthetic --task addition --train-examples 30000 --test-examples 200 --output "$D/raw"
$M tokenizer train --input "$D/raw/train.jsonl" --vocab-size 320 --output "$D/tokenizer" \
  --user-defined-symbols 0 1 2 3 4 5 6 7 8 9
$M data prepare --input "$D/raw/train.jsonl" --tokenizer "$D/tokenizer.model" --output "$D/data" \
  --valid-fraction 0.02 --quiet
echo "== 2. a briefly trained base: configs/demo.yaml for 150 steps"
$M train -c configs/demo.yaml run_dir="$D/base" data.path="$D/data" train.max_steps=150 \
  checkpoint.every_steps=150 eval.every_steps=0 log.tensorboard=false > "$D/base.log"
BASE="$D/base/checkpoints/step-000150"
echo "== 3. held-out accuracy of the base"
$M generate --model "$BASE" --tokenizer "$D/tokenizer.model" --eval-chat "$D/raw/test.jsonl" --max-new-tokens 6 | tail -1
echo "== 4. LoRA SFT over the frozen base (configs/demo-lora.yaml)"
$M train -c configs/demo-lora.yaml
ADAPTER="$D/lora/checkpoints/$(cat "$D/lora/checkpoints/latest")"
echo "== 5. held-out accuracy with the adapter ($ADAPTER, a PEFT adapter directory)"
$M generate --model "$BASE" --lora "$ADAPTER" --tokenizer "$D/tokenizer.model" --eval-chat "$D/raw/test.jsonl" \
  --max-new-tokens 6 | tail -1
echo "== 6. the adapter merged into the base: a plain HF model"
$M convert --input "$BASE" --merge-lora "$ADAPTER" --output "$D/merged"
$M generate --model "$D/merged" --tokenizer "$D/tokenizer.model" --eval-chat "$D/raw/test.jsonl" --max-new-tokens 6 | tail -1
