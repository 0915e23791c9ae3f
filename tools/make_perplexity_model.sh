#!/usr/bin/env bash
# Makes tests/golden/perplexity: a tiny Mixtral (hidden 64, 2 layers, 4 experts top-2, vocab 384)
# trained by moetron on licence texts (GPL-2/3, LGPL-2.1/3, GFDL-1.3, MPL-2.0, Artistic, from
# /usr/share/common-licenses, in every Debian), stored in bf16, with its SentencePiece tokenizer.  Its perplexity on tests/data/apache-2.0.txt (a held-out text
# of the same kind) is low enough that weight quantization shows in it: test_infer_q8 measures the
# change Q8_0 makes.  Usage: tools/make_perplexity_model.sh [BUILD_DIR]  (run from the repository root)
set -euo pipefail
M=${1:-build}/moetron
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
OUT=tests/golden/perplexity
# One JSONL document per paragraph of the licence text.
python3 - "$W/train.jsonl" <<'PY'
import json, sys
paras = []
for name in ["GPL-2", "GPL-3", "LGPL-2.1", "LGPL-3", "GFDL-1.3", "MPL-2.0", "Artistic"]:
    text = open("/usr/share/common-licenses/" + name, encoding="utf-8").read()
    paras += [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
with open(sys.argv[1], "w") as f:
    for p in paras * 2:  # repeated: one epoch is short
        f.write(json.dumps({"text": p}) + "\n")
PY
$M tokenizer train --input "$W/train.jsonl" --vocab-size 384 --output "$W/tokenizer"
$M data prepare --input "$W/train.jsonl" --tokenizer "$W/tokenizer.model" --output "$W/data" --format text \
  --valid-fraction 0.02 --quiet
cat > "$W/train.yaml" <<YAML
run_dir: $W/run
device: cpu
seed: 7
model:
  init: random
  config:
    architectures: [MixtralForCausalLM]
    model_type: mixtral
    vocab_size: 384
    hidden_size: 64
    intermediate_size: 128
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    num_local_experts: 4
    num_experts_per_tok: 2
    max_position_embeddings: 1024
    rms_norm_eps: 1.0e-5
    rope_theta: 10000.0
    router_aux_loss_coef: 0.02
    tie_word_embeddings: false
    bos_token_id: 1
    eos_token_id: 2
data: {path: $W/data, seq_length: 128}
train: {global_batch_size: 16, micro_batch_size: 16, max_steps: 300, lr: 3.0e-3, min_lr: 3.0e-4,
        warmup_steps: 30, schedule: cosine, weight_decay: 0.01}
checkpoint: {every_steps: 300, keep_last: 1}
eval: {every_steps: 0}
log: {every_steps: 50, tensorboard: false}
YAML
$M train -c "$W/train.yaml"
CKPT="$W/run/checkpoints/$(cat "$W/run/checkpoints/latest")"
rm -rf "$OUT"
$M convert --input "$CKPT" --output "$OUT" --dtype bf16 --drop-optimizer
cp "$W/tokenizer.model" "$OUT/tokenizer.model"
# Only what inference reads (the optimizer state and training records stay behind).
find "$OUT" -mindepth 1 -maxdepth 1 ! -name config.json ! -name 'model*.safetensors*' ! -name tokenizer.model \
  ! -name generation_config.json -exec rm -rf {} +
ls -l "$OUT"
