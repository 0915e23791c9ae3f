#!/usr/bin/env bash
# The Slurm CI stage: installs Slurm and munge (Debian: slurm-wlm, munge) when missing, starts a
# private one-node cluster on this machine (munged, slurmctld, slurmd on ports 16817/16818, state
# and logs in a temporary directory; /etc/slurm is not touched), then
#   1. sbatch --ntasks 2 launch/slurm/plan.sbatch  CONFIG   -> the layout check passes
#   2. sbatch --ntasks 2 launch/slurm/train.sbatch CONFIG   -> 2 ranks (srun + PMIx) train a tiny
#      Mixtral to the end and leave a complete checkpoint
# and stops everything it started.  Needs root (apt-get, daemons).  Takes about a minute once the
# packages are installed.  Usage: bash scripts/slurm-test.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
BUILD_DIR=${1:-build}
MOETRON=$REPO/$BUILD_DIR/moetron
[ -x "$MOETRON" ] || { echo "slurm-test: no binary at $MOETRON (bash scripts/build.sh first)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "slurm-test: needs root (daemons, apt-get)" >&2; exit 1; }

missing=()
for p in slurm-wlm munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "slurm-test: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

T=$(mktemp -d /tmp/moetron-slurm-XXXXXX)
chmod 755 "$T"
HOST=$(hostname -s)
pids=()
cleanup() {
  set +e
  if [ -n "${SLURM_CONF:-}" ]; then scancel --quiet --user root 2>/dev/null; fi
  for f in "$T/slurmd.pid" "$T/slurmctld.pid" "$T/munge-key/munged.pid"; do
    [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
  sleep 1
  rm -rf "$T"
}
trap cleanup EXIT

# munge: its own socket and key in $T, so a system munged (if any) is left alone.
mkdir -p "$T/munge" "$T/munge-key"
chown munge:munge "$T/munge" "$T/munge-key"
chmod 755 "$T/munge"      # the socket's directory: reachable by every user
chmod 700 "$T/munge-key"  # the key's: munge only
dd if=/dev/urandom of="$T/munge-key/munge.key" bs=1 count=1024 status=none
chown munge:munge "$T/munge-key/munge.key"
chmod 400 "$T/munge-key/munge.key"
runuser -u munge -- /usr/sbin/munged --key-file="$T/munge-key/munge.key" --socket="$T/munge/munge.socket" \
  --pid-file="$T/munge-key/munged.pid" --log-file="$T/munge-key/munged.log" --seed-file="$T/munge-key/munge.seed"

mkdir -p "$T/state" "$T/spool"
CPUS=$(nproc)
MEM=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
cat > "$T/slurm.conf" <<EOF
ClusterName=moetron-ci
SlurmctldHost=$HOST
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$T/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=ci Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$T/slurm.conf
/usr/sbin/slurmctld -f "$SLURM_CONF"
/usr/sbin/slurmd -f "$SLURM_CONF"
for i in $(seq 60); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  sleep 1
  if [ "$i" = 60 ]; then
    echo "slurm-test: the node did not come up" >&2
    tail -20 "$T/slurmctld.log" "$T/slurmd.log" >&2
    exit 1
  fi
done
echo "slurm-test: cluster up ($(sinfo -h -o '%P %D %c %t'))"

# A tiny run: synthetic chats, a 320-piece tokenizer, a 2-layer Mixtral (E=4, K=2), 6 steps.
W=$T/work
mkdir -p "$W"
"$MOETRON" data synthetic --output "$W/syn" > /dev/null
"$MOETRON" tokenizer train --input "$W/syn/train.jsonl" --vocab-size 320 --output "$W/tok" > /dev/null
"$MOETRON" data prepare --input "$W/syn/train.jsonl" --tokenizer "$W/tok.model" --output "$W/data" > /dev/null
cat > "$W/tiny.yaml" <<EOF
run_dir: $W/run
seed: 5
model:
  init: random
  config: {architectures: [MixtralForCausalLM], model_type: mixtral, vocab_size: 320, hidden_size: 32,
           intermediate_size: 48, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
           num_local_experts: 4, num_experts_per_tok: 2, router_aux_loss_coef: 0.02, max_position_embeddings: 256}
data: {path: $W/data, seq_length: 64}
train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 6, lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 1}
checkpoint: {every_steps: 3, keep_last: 2}
log: {every_steps: 1, tensorboard: false}
eval: {every_steps: 0}
EOF

export MOETRON
cd "$W"  # sbatch's submit directory: the job's outputs land here
t0=$(date +%s)
if ! sbatch --wait --ntasks 2 --ntasks-per-node 2 --output "$W/plan-%j.out" "$REPO/launch/slurm/plan.sbatch" "$W/tiny.yaml" \
    > "$W/plan.submit" 2>&1; then
  echo "slurm-test: plan job failed" >&2; cat "$W/plan.submit" "$W"/plan-*.out >&2; exit 1
fi
grep -q "world 2" "$W"/plan-*.out || { echo "slurm-test: plan output lacks the layout" >&2; cat "$W"/plan-*.out >&2; exit 1; }
if ! sbatch --wait --ntasks 2 --ntasks-per-node 2 --output "$W/train-%j.out" "$REPO/launch/slurm/train.sbatch" \
    "$W/tiny.yaml" > "$W/train.submit" 2>&1; then
  echo "slurm-test: train job failed" >&2; cat "$W/train.submit" "$W"/train-*.out >&2; tail -20 "$T/slurmd.log" >&2; exit 1
fi
out=$(cat "$W"/train-*.out)
echo "$out" | grep -q "distributed: 2 ranks over mpi" || { echo "slurm-test: not 2 MPI ranks:" >&2; echo "$out" >&2; exit 1; }
echo "$out" | grep -q "finished at step 6 of 6" || { echo "slurm-test: training did not finish:" >&2; echo "$out" >&2; exit 1; }
latest=$(cat "$W/run/checkpoints/latest")
[ "$latest" = "step-000006" ] || { echo "slurm-test: latest checkpoint is '$latest', expected step-000006" >&2; exit 1; }
for f in model.safetensors optimizer/optimizer.safetensors trainer_state.json config.json; do
  [ -s "$W/run/checkpoints/$latest/$f" ] || { echo "slurm-test: checkpoint lacks $f" >&2; exit 1; }
done
echo "$out" | grep -v "^step " | sed 's/^/  | /'
echo "slurm-test: OK: plan and 2-rank training jobs completed under Slurm with checkpoint $latest ($(($(date +%s) - t0)) s for both jobs)"
