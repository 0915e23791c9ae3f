#!/usr/bin/env bash
# The bundled example: install dependencies, build, then train a tiny random Mixtral for a few
# steps on CPU (moetron bench train on a small shape) and run one forward pass of the bundled tiny
# golden model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=build bash scripts/build.sh
./build/moetron bench train --hidden 128 --layers 2 --heads 4 --kv-heads 2 --experts 4 --top-k 2 \
  --intermediate 256 --vocab 1000 --seq 128 --micro-batch 2 --steps 5 --sgemm-size 512
mkdir -p runs/demo
./build/moetron forward --model tests/golden/mixtral_gqa --input tests/golden/mixtral_gqa/input.safetensors \
  --output runs/demo/forward.safetensors --grads runs/demo/grads.safetensors
echo "wrote runs/demo/forward.safetensors and runs/demo/grads.safetensors"
