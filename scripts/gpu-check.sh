#!/usr/bin/env bash
# The GPU check: one run on one H100 80 GB or H200 141 GB, in under 9 minutes, of the bundle
# scripts/gpu-bundle.sh made on a build machine (.gpu-bundle/: nothing is compiled here).
#   here (the build machine):  bash scripts/gpu-bundle.sh
#   there (the GPU machine):   bash scripts/gpu-check.sh        from the repository root, .gpu-bundle/ beside
#   anywhere:                  bash scripts/gpu-check.sh --plan the stages and their caps, nothing run
# What the GPU machine must have: the NVIDIA driver, python3 with torch and transformers (the peer
# benchmark), cuDNN / NCCL / cuBLAS as the image's `nvidia-*` wheels or under /usr/local/cuda (loaded at
# run time: their site-packages/nvidia/*/lib folders join LD_LIBRARY_PATH), compute-sanitizer (else
# that stage is skipped), mpirun for the 2-rank stage (else skipped).
#
# Stages, correctness first (each gated), then performance; each has a cap (its time limit), the caps
# sum to under 540 s, and the whole run stops at DEADLINE_S (540):
#   env, probe (a tiny training step on the GPU), the op-case table and the CUDA kernel tests with
#   CUDA_LAUNCH_BLOCKING=1, goldens in bf16, the 20-step curve beside the CPU, resume CPU -> GPU -> CPU,
#   compute-sanitizer memcheck over the op cases, LoRA goldens, the CLI, inference (library and
#   `generate --device cuda`), 2 ranks sharing the GPU (MPI), then the kernels -- attention and the
#   grouped expert GEMM at Mixtral-8x7B's and Qwen3-30B-A3B's layer shapes, ours (`bench kernels`)
#   and torch's (SDPA, grouped matmul: reported) -- then `bench train --device cuda` on a
#   Mixtral-shaped model sized to the card (nvidia-smi), transformers' eager step on the same model
#   (reported, not gating), and a profile of our step.
# Output (<= 8 files, as the device runner brings back): $OUT/summary.txt, appended after every
# stage and completed at the end, and $OUT/logs.tar.gz, every stage's log, re-packed after every
# stage (so a run cut short still returns what it did).  $OUT defaults to gpu-check-out/.
# Exit status: 0 when every gated stage passed (MFU and speed-ups are targets, reported).
# Environment: BUNDLE (.gpu-bundle), OUT, DEADLINE_S (540), SEQ (4096), GRAD_ACCUM (2), STEPS (2),
# LAYERS (sized to the card), MEMORY_GIB (the card's, from nvidia-smi; --plan: both cards).
set -uo pipefail
cd "$(dirname "$0")/.."

BUNDLE=${BUNDLE:-.gpu-bundle}
OUT=${OUT:-gpu-check-out}
DEADLINE_S=${DEADLINE_S:-540}
SEQ=${SEQ:-4096}
GRAD_ACCUM=${GRAD_ACCUM:-2}
STEPS=${STEPS:-2}
BIN=$BUNDLE/bin

# Bench model: hidden 2048, 16/8 heads of 128, 8 experts top-2 of width 5632, vocab 32000:
# 289.4M parameters a layer, 131.1M in the embedding and head; 18 bytes a parameter on the GPU (bf16
# GEMM copy, fp32 master, fp32 gradient, Adam m and v).  Half the card goes to the parameters (the
# rest: activations at seq 4096, transformers' own copy when it runs after us).
layers_for() {  # MEMORY_GIB -> layers (1..16)
  awk -v g="$1" 'BEGIN { n = int((0.5 * g * 1073741824 - 18 * 131.1e6) / (18 * 289.4e6)); if (n < 1) n = 1;
    if (n > 16) n = 16; print n }'
}

# The stages: name, cap (s), gated (1) or reported (0), and what runs (a function below).
STAGES=(
  "env 10 1 st_env"
  "probe 20 1 st_probe"
  "optable 35 1 st_optable"
  "ops 35 1 st_ops"
  "golden 30 1 st_golden"
  "train20 35 1 st_train20"
  "resume 30 1 st_resume"
  "memcheck 40 1 st_memcheck"
  "lora 20 1 st_lora"
  "cli 25 1 st_cli"
  "infer 20 1 st_infer"
  "infer-cli 20 1 st_infer_cli"
  "dist2 35 1 st_dist2"
  "kernels 25 1 st_kernels"
  "kernels-torch 30 0 st_kernels_torch"
  "bench 45 1 st_bench"
  "hf 45 0 st_hf"
  "profile 20 0 st_profile"
)

if [[ ${1:-} == --plan ]]; then
  total=0
  printf '%-14s %6s  %s\n' stage cap gated
  for s in "${STAGES[@]}"; do
    read -r name cap gated _ <<<"$s"
    printf '%-14s %5ss  %s\n' "$name" "$cap" "$([[ $gated == 1 ]] && echo yes || echo "no (reported)")"
    total=$((total + cap))
  done
  for card in "H100 80GB:79.6" "H200 141GB:139.8"; do
    echo "${card%%:*}: bench model $(layers_for "${card##*:}") layers (hidden 2048, 8 experts top-2, seq $SEQ);" \
      "caps sum to ${total} s (deadline ${DEADLINE_S} s)"
  done
  ((total < DEADLINE_S)) || { echo "the caps exceed the deadline" >&2; exit 1; }
  exit 0
fi

[[ -x $BIN/moetron ]] || { echo "gpu-check: no $BIN/moetron: make the bundle first (bash scripts/gpu-bundle.sh)" >&2; exit 2; }
BIN=$(cd "$BIN" && pwd)
mkdir -p "$OUT"
LOGS=$(mktemp -d)
: >"$OUT/summary.txt"
T_START=$(date +%s)
ALL_OK=1
elapsed() { echo $(($(date +%s) - T_START)); }

# The libraries loaded at run time from the image (cuBLASLt, cuDNN, NCCL), and the tests' paths.
NV_LIBS=$(python3 - <<'EOF' 2>/dev/null
import glob, os, site
dirs = []
for base in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib")))
print(":".join(dirs))
EOF
)
export LD_LIBRARY_PATH="${NV_LIBS:+$NV_LIBS:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOETRON_TEST_SOURCE_DIR=$PWD MOETRON_TEST_BINARY=$BIN/moetron
MEMORY_GIB=${MEMORY_GIB:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null |
  head -1 | awk '{ printf "%.1f", $1 / 1024 }')}
LAYERS=${LAYERS:-$(layers_for "${MEMORY_GIB:-79.6}")}
# The bench model's flags (a string: the stages run in child shells, which get no arrays).
MODEL_FLAGS="--hidden 2048 --heads 16 --kv-heads 8 --experts 8 --top-k 2 --intermediate 5632 --vocab 32000 --seq $SEQ
  --micro-batch 1 --layers $LAYERS"

# ---- the stages ---------------------------------------------------------------------------------
st_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || return 1
  echo "cores: $(nproc); bundle: $(du -sh "$BUNDLE" | cut -f1); LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  command -v compute-sanitizer mpirun || true
  echo "bench model: $LAYERS layers for ${MEMORY_GIB} GiB"
}
st_probe() {
  "$BIN/moetron" bench train --device cuda --layers 1 --hidden 128 --heads 4 --kv-heads 2 --experts 4 --top-k 2 \
    --intermediate 256 --vocab 512 --seq 256 --micro-batch 2 --steps 2 --recompute selective
}
st_optable() { CUDA_LAUNCH_BLOCKING=1 "$BIN/test_backend_ops" --gtest_filter='*Cuda*:BackendOpsExact.*'; }
st_ops() { CUDA_LAUNCH_BLOCKING=1 "$BIN/test_cuda_ops"; }
st_golden() { "$BIN/test_cuda_model" --gtest_filter='Transformers/CudaGolden.*'; }
st_train20() { "$BIN/test_cuda_model" --gtest_filter='CudaTraining.*:CudaTrain.TwentyStepsBesideTheCpu'; }
st_resume() { "$BIN/test_cuda_model" --gtest_filter='CudaTrain.CheckpointsResumeAcrossDevices'; }
st_memcheck() {
  command -v compute-sanitizer >/dev/null || { echo "SKIP: no compute-sanitizer"; return 0; }
  compute-sanitizer --tool memcheck --error-exitcode 3 "$BIN/test_backend_ops" --gtest_filter='*Cuda*'
}
st_lora() { "$BIN/test_cuda_model" --gtest_filter='Peft/CudaLoraGolden.*'; }
st_cli() { "$BIN/test_cuda_model" --gtest_filter='CudaCli.*'; }
st_infer() { "$BIN/test_model_infer" --gtest_filter='ModelInfer.Cuda*'; }
st_infer_cli() { "$BIN/test_infer_cli" --gtest_filter='GenerateCli.DeviceCuda*'; }
st_dist2() {
  command -v mpirun >/dev/null || { echo "SKIP: no MPI runtime on this machine"; return 0; }
  "$BIN/test_cuda_model" --gtest_filter='CudaTrain.TwoRanksSharingTheGpuMatchOneProcess'
}
# Attention and the grouped expert GEMM at Mixtral-8x7B's and Qwen3-30B-A3B's layer shapes, ours and
# torch's (SDPA, torch._grouped_mm) on the same GPU.
st_kernels() {
  "$BIN/moetron" bench kernels --device cuda --shape mixtral-8x7b --seq "$SEQ" --json &&
    "$BIN/moetron" bench kernels --device cuda --shape qwen3-30b-a3b --seq "$SEQ" --json
}
st_kernels_torch() {
  python3 bench/torch_kernels.py --device cuda --shape mixtral-8x7b --seq "$SEQ" &&
    python3 bench/torch_kernels.py --device cuda --shape qwen3-30b-a3b --seq "$SEQ"
}
st_bench() {
  "$BIN/moetron" bench train --device cuda $MODEL_FLAGS --grad-accum "$GRAD_ACCUM" --steps "$STEPS" --warmup 1 \
    --recompute selective --json
}
st_hf() {
  python3 bench/hf_train_step.py --device cuda --dtype autocast $MODEL_FLAGS --grad-accum "$GRAD_ACCUM" \
    --steps "$STEPS" --experts-implementation eager
}
st_profile() {
  "$BIN/moetron" bench train --device cuda $MODEL_FLAGS --grad-accum 1 --steps 1 --warmup 1 --recompute selective \
    --profile
}

# Runs one stage with its cap (cut to the deadline), its log in $LOGS; appends its line to the summary
# and re-packs the logs.
run_stage() {
  local name=$1 cap=$2 gated=$3 fn=$4
  local left=$((DEADLINE_S - $(elapsed) - 5)) status note="" rc
  local log="$LOGS/$name.log"
  if ((left < 10)); then
    status="NO TIME"
    note="the ${DEADLINE_S} s deadline is near"
    rc=99
  else
    ((cap > left)) && cap=$left
    echo "== [$name] (cap ${cap} s, at $(elapsed) s)"
    local t0=$(date +%s)
    export -f "$fn"
    timeout -k 5 "$cap" bash -c "$fn" >"$log" 2>&1
    rc=$?
    note="$(($(date +%s) - t0)) s"
    tail -n 15 "$log" | sed 's/^/    /'
    status=PASS
    if ((rc == 124 || rc == 137)); then
      status=TIMEOUT
      note="$note, killed at the cap"
    elif ((rc != 0)); then
      status=FAIL
      note="$note, exit $rc"
    elif grep -q "CUDA test skipped" "$log"; then  # a skipped CUDA test means no usable GPU
      status=FAIL
      note="$note, $(grep -m1 -o 'CUDA test skipped: .*' "$log")"
    elif grep -q "^SKIP: " "$log"; then
      status=SKIP
      note="$note, $(grep -m1 '^SKIP: ' "$log" | cut -c7-)"
    fi
    if grep -qE "^\[  (PASSED|FAILED)  \]" "$log"; then
      note="$note; $(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr -s ' ' | paste -sd' ')"
    fi
  fi
  if [[ $status != PASS && $status != SKIP ]] && ((gated)); then ALL_OK=0; fi
  printf '%-14s %-8s %s%s\n' "$name" "$status" "$note" "$([[ $gated == 0 ]] && echo ' (reported)')" |
    tee -a "$OUT/summary.txt"
  tar czf "$OUT/logs.tar.gz" -C "$LOGS" .
}

export BIN BUNDLE LAYERS SEQ GRAD_ACCUM STEPS MEMORY_GIB MODEL_FLAGS
{
  echo "GPU check $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null |
    head -1); bench model $LAYERS layers"
} | tee -a "$OUT/summary.txt"
for s in "${STAGES[@]}"; do
  read -r name cap gated fn <<<"$s"
  run_stage "$name" "$cap" "$gated" "$fn"
done

# ---- figures ------------------------------------------------------------------------------------
{
  echo
  echo "== after $(elapsed) s"
  if [[ -s $LOGS/train20.log ]]; then
    echo "20-step loss, CPU fp32 vs CUDA bf16 (within 2%):"
    grep -E "^step +[0-9]+ " "$LOGS/train20.log" | sed 's/^/  /'
  fi
  python3 - "$LOGS" "$LAYERS" <<'EOF' || echo "(no figures: python3 failed)"
import json, os, sys
logs, layers = sys.argv[1], sys.argv[2]
def last_json(name, key):
    try:
        lines = open(os.path.join(logs, name)).read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{") and key in line:
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None
def all_json(name, key):
    try:
        return [json.loads(l) for l in open(os.path.join(logs, name)).read().splitlines()
                if l.startswith("{") and key in l]
    except (OSError, ValueError):
        return []
mine = {j["shape"]: j for j in all_json("kernels.log", "attention_forward_tflops")}
peer = {j["shape"]: j for j in all_json("kernels-torch.log", "torch_attention_forward_tflops")}
for shape in ("mixtral-8x7b", "qwen3-30b-a3b"):
    if shape not in mine:
        print(f"kernels at {shape}: no result")
        continue
    parts = []
    for k in ("attention_forward", "attention_backward", "grouped_gemm_forward", "grouped_gemm_backward"):
        ours_k, theirs = mine[shape][k + "_tflops"], peer.get(shape, {}).get("torch_" + k + "_tflops")
        parts.append(f"{k} {ours_k:.0f}" + (f" vs torch {theirs:.0f} TFLOP/s ({ours_k / theirs:.2f}x, target >= 0.9x)"
                                            if theirs else " TFLOP/s"))
    print(f"kernels at {shape} (seq {mine[shape]['seq']}): " + "; ".join(parts))
ours, hf = last_json("bench.log", "tokens_per_s"), last_json("hf.log", "hf_tokens_per_s")
print(f"Mixtral-shaped model, {layers} layers (hidden 2048, 16/8 heads, 8 experts top-2, I 5632, V 32000):")
if ours:
    print(f"  moetron --device cuda: {ours['tokens_per_s']:.0f} tokens/s, {ours['tflops']:.1f} TFLOP/s, "
          f"MFU {100 * ours['mfu']:.1f}% of {ours['peak_tflops']:.0f} (target >= 40%), recompute "
          f"{ours.get('recompute', '?')}; memory: state {ours['state_gib']:.1f} GiB, AdamW "
          f"{ours.get('optimizer_gib', 0):.1f} GiB, activations {ours['activation_gib']:.1f} GiB")
else:
    print("  moetron --device cuda: no result")
if hf:
    print(f"  transformers eager: {hf['hf_tokens_per_s']:.0f} tokens/s, peak memory "
          f"{hf.get('peak_memory_gib', '?')} GiB")
if ours and hf:
    print(f"  speed-up over transformers eager: {ours['tokens_per_s'] / hf['hf_tokens_per_s']:.2f}x (target >= 2x)")
EOF
  if ((ALL_OK)); then echo "RESULT: PASS (every gated stage passed)"; else echo "RESULT: FAIL (see the stages above)"; fi
} | tee -a "$OUT/summary.txt"
tar czf "$OUT/logs.tar.gz" -C "$LOGS" .
rm -rf "$LOGS"
((ALL_OK))
