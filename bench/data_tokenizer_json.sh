#!/usr/bin/env bash
# Data preparation with a Hugging Face tokenizer.json (byte-level BPE, ChatML): `moetron bench data`
# on one thread beside HF `datasets.map` + `tokenizers` on one core (bench/hf_datasets_pipeline.py,
# RAYON_NUM_THREADS=1) on the same chat JSONL, alternating, ROUNDS rounds; prints the medians of the
# tokens per CPU-second (the per-core rate, robust to other load on the machine) and of wall tokens/s.
# Needs: pip install datasets tokenizers.
#   bash bench/data_tokenizer_json.sh [INPUT.jsonl] [TOKENIZER.json]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${MOETRON_BINARY:-$here/build/moetron}"
input="${1:-/tmp/chat50.jsonl}"
tok="${2:-$here/../shared/data/qwen-tokenizer.json}"
rounds="${ROUNDS:-5}"
[[ -f "$input" ]] || python3 "$here/bench/make_chat_jsonl.py" --out "$input" --mb 50
echo "input: $(du -h "$input" | cut -f1) $input; tokenizer $tok"
echo "cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $(nproc) cores visible"
rm -f /tmp/bench_tj_moetron.txt /tmp/bench_tj_hf.txt
for r in $(seq "$rounds"); do
  "$bin" bench data --input "$input" --tokenizer "$tok" --template chatml --threads 1 --repeats 1 --json |
    grep '^{' >> /tmp/bench_tj_moetron.txt
  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python3 "$here/bench/hf_datasets_pipeline.py" --input "$input" \
    --tokenizer "$tok" --repeats 1 | grep '^{' >> /tmp/bench_tj_hf.txt
  echo "  round $r: moetron $(tail -1 /tmp/bench_tj_moetron.txt)"
  echo "           hf      $(tail -1 /tmp/bench_tj_hf.txt)"
done
python3 - <<'PY'
import json, statistics
def med(path, key):
    return statistics.median(json.loads(l)[key] for l in open(path))
m_cpu, h_cpu = med("/tmp/bench_tj_moetron.txt", "tokens_per_cpu_s"), med("/tmp/bench_tj_hf.txt", "tokens_per_cpu_s")
m_w, h_w = med("/tmp/bench_tj_moetron.txt", "tokens_per_s"), med("/tmp/bench_tj_hf.txt", "tokens_per_s")
print(f"moetron (1 thread): {m_cpu:.0f} tokens per CPU-second, {m_w:.0f} tokens/s wall")
print(f"hf datasets.map + tokenizers (1 core): {h_cpu:.0f} tokens per CPU-second, {h_w:.0f} tokens/s wall")
print(f"per core: moetron / hf = {m_cpu / h_cpu:.2f}x")
PY
