#!/usr/bin/env bash
# Coverage-guided fuzzing of moetron's parsers (tests/fuzz, libFuzzer + ASan + UBSan).
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]
# Builds the targets with clang into build-fuzz/, then runs each for SECONDS (default 60), FUZZ_JOBS
# at a time (default: the number of cores).  The corpus grows in build-fuzz/corpus/<target>/ (kept
# between runs, started from the committed seeds, tests/fuzz/seeds/<target>/).  A crash, leak,
# sanitizer report, timeout (-timeout, seconds per input) or out-of-memory (-rss_limit_mb) is saved
# in build-fuzz/findings/<target>/ and makes the script fail; to keep a fixed finding as a regression
# test, copy the file into tests/fuzz/regressions/<target>/ (CTest replays those, FuzzReplay.*).
# Prints one line per target: executions, coverage (edges), features, corpus files.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift || true
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${FUZZ_JOBS:-$(nproc)}

command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (scripts/setup.sh installs it)" >&2; exit 2; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
CC=clang CXX=clang++ cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOETRON_FUZZ=ON \
  -DMOETRON_NATIVE=OFF >/dev/null
cmake --build "$BUILD" -j "$(nproc)"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in tests/fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi

run_one() {
  local t=$1 corpus="$BUILD/corpus/$1" findings="$BUILD/findings/$1" log="$BUILD/logs/$1.log"
  mkdir -p "$corpus" "$findings" "$BUILD/logs"
  local extra=()
  [ -d "tests/fuzz/regressions/$t" ] && extra+=("tests/fuzz/regressions/$t")
  # -close_fd_mask=1: the targets' stdout is noise; stderr keeps the reports.
  if ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
      "$BUILD/tests/fuzz/$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -close_fd_mask=1 -artifact_prefix="$findings/" "$corpus" "tests/fuzz/seeds/$t" "${extra[@]}" >"$log" 2>&1; then
    status=ok
  else
    status=FAILED
  fi
  local execs cov ft files
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}' | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  files=$(find "$corpus" -type f | wc -l)
  printf 'fuzz %-22s %-6s %6ss  executions %-10s cov %-6s ft %-6s corpus %s files\n' "$t" "$status" "$SECONDS_EACH" \
    "${execs:-?}" "${cov:-?}" "${ft:-?}" "$files"
  if [ "$status" != ok ]; then
    echo "fuzz $t: see $log; findings in $findings/:" && ls "$findings" | sed 's/^/  /'
    grep -m1 -E 'ERROR|runtime error|terminate called|Timeout|out-of-memory' "$log" | sed 's/^/  /' || true
    return 1
  fi
}

failed=0
pids=()
for t in "${targets[@]}"; do
  [ -x "$BUILD/tests/fuzz/$t" ] || { echo "fuzz: no target $t" >&2; exit 2; }
  run_one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$JOBS" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
[ $failed -eq 0 ] && echo "fuzz: ${#targets[@]} targets, ${SECONDS_EACH}s each, no findings" || echo "fuzz: FINDINGS (above)"
exit $failed
