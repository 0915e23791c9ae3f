#!/usr/bin/env bash
# The whole test suite: install dependencies, build (Release), run every test with CTest; then
# rebuild the tests with AddressSanitizer + UndefinedBehaviorSanitizer and run them again.
# Between the two, the Slurm stage (scripts/slurm-test.sh: a private one-node Slurm cluster, a 2-rank
# training job through launch/slurm/train.sbatch) and a short fuzzing pass (scripts/fuzz.sh: every
# libFuzzer target of tests/fuzz for MOETRON_FUZZ_SECONDS, default 20, each).
# MOETRON_SKIP_SANITIZE=1 / MOETRON_SKIP_SLURM=1 / MOETRON_SKIP_FUZZ=1 skip those stages.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=build bash scripts/build.sh
(cd build && ctest --output-on-failure -j 2 --timeout 600)
if [ "${MOETRON_SKIP_SLURM:-0}" != 1 ]; then
  echo "== Slurm stage =="
  bash scripts/slurm-test.sh build
fi
if [ "${MOETRON_SKIP_FUZZ:-0}" != 1 ]; then
  echo "== fuzz stage =="
  bash scripts/fuzz.sh "${MOETRON_FUZZ_SECONDS:-20}"
fi
if [ "${MOETRON_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "== sanitizer build (ASan + UBSan) =="
  # Release (the library at -O3, no debug info; the tests and the CLI at -O1: CMakeLists.txt) keeps the
  # compile and the sanitized tests fast enough for CI.
  BUILD_DIR=build-asan BUILD_TYPE=Release bash scripts/build.sh -DMOETRON_SANITIZE=ON
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j 2 --timeout 900)
fi
