#!/usr/bin/env bash
# The one script to run on the H100/H200 machine, from the repository root:
#   bash bench/gpu_check.sh [suite ...]        (default: all suites)
# Phases, each one's failure reported but never stopping the next:
#   1. install: pip install --no-build-isolation --no-deps -e . (builds tlt_kernels._C for sm_90a);
#   2. nvidia-smi + versions;
#   3. tests:   python -m pytest on the GPU, one process per test file (GPU_CHECK_TEST_FILES picks files)   (GPU_CHECK_TESTS=0 skips);
#   4. bench:   python -m bench <suites> (FlashInfer as a peer when .peer/setup_flashinfer.sh exists;
#               GPU_CHECK_BENCH=0 skips).
# Results land in $OUT (at most 6 files): install.log, nvidia-smi.log, pytest.log, flashinfer.log,
# bench.tar.gz (every suite's .json/.md) and summary.md (phase table + every suite's table).
# Knobs: TLT_GIT_COMMIT (the commit measured: the GPU copy has no .git), GPU_CHECK_INSTALL=0 (reuse an earlier install on a warm machine; the built
# tlt_kernels/_C*.so lives in the tree, so a copy of the tree sent again through the device tool's `carry` loses it: the
# suites then fall back to Triton, and the install row says '_C NOT built'), GPU_CHECK_TEST_TIMEOUT (seconds per test, default 300), GPU_CHECK_PYTEST_ARGS (extra
# pytest arguments, e.g. a test file), GPU_CHECK_BENCH_ARGS (extra bench arguments, e.g. --small),
# GPU_CHECK_BENCH_FIRST=1 (benchmarks before tests), GPU_CHECK_DEADLINE (seconds from the start: no test file or
# benchmark starts after it, and a running one is stopped at it (a suite's report keeps the rows it measured), so the summary and the partial logs still come back
# inside a device call's limit; the benchmark's printed rows are kept in bench.tar.gz's bench/bench.log).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export TLT_BENCH_PROGRESS=${TLT_BENCH_PROGRESS:-1} TLT_CUDA_ARCHS=${TLT_CUDA_ARCHS:-90a} PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
PY=$(command -v python || command -v python3)
SUITES=("$@")
[ ${#SUITES[@]} -eq 0 ] && SUITES=(all)

declare -a SUMMARY=()
FAILED=0
record() {  # record PHASE STATUS SECONDS DETAIL
  SUMMARY+=("| $1 | $2 | $3 | $4 |")
  [ "$2" = "FAILED" ] && FAILED=1
  echo "=== $1: $2 ($3 s) $4"
}

# Seconds left before GPU_CHECK_DEADLINE (a large number without one).
left() {
  if [ -n "${GPU_CHECK_DEADLINE:-}" ]; then echo $((GPU_CHECK_DEADLINE - SECONDS)); else echo 1000000; fi
}

# 1. install --------------------------------------------------------------------------------
t0=$SECONDS
rc=0
if [ "${GPU_CHECK_INSTALL:-1}" != "0" ]; then
  "$PY" -m pip install --no-build-isolation --no-deps -e . 2>&1 | tee "$OUT/install.log"
  rc=${PIPESTATUS[0]}
fi
ext=$("$PY" -c "import tlt_kernels; print('built' if tlt_kernels.cuda_extension_available() else 'NOT built')" 2>&1 | tail -n 1)
if [ "${GPU_CHECK_INSTALL:-1}" = "0" ]; then record install skipped 0 "GPU_CHECK_INSTALL=0; tlt_kernels._C $ext"
elif [ "$rc" -eq 0 ]; then record install ok $((SECONDS - t0)) "tlt_kernels._C $ext"
else record install FAILED $((SECONDS - t0)) "pip exit $rc; tlt_kernels._C $ext; see install.log"; fi

# 2. machine --------------------------------------------------------------------------------
{
  nvidia-smi
  "$PY" - <<'PY'
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__}")
print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, cc {p.major}.{p.minor}")
PY
} > "$OUT/nvidia-smi.log" 2>&1
GPU=$(grep -m1 ' SMs, ' "$OUT/nvidia-smi.log" || echo "no GPU visible (see nvidia-smi.log)")
echo "=== $GPU"

# 3. tests ----------------------------------------------------------------------------------
run_tests() {
if [ "${GPU_CHECK_TESTS:-1}" != "0" ]; then
  t0=$SECONDS
  # One pytest process per test file: a crash (a fatal CUDA error, an abort) in one file cannot hide
  # the results of the others. Each file's summary line goes into the phase table.
  : > "$OUT/pytest.log"
  files=${GPU_CHECK_TEST_FILES:-$(ls tests/test_*.py tests/*/test_*.py)}
  nfail=0
  timeout_arg=""
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_arg="--timeout ${GPU_CHECK_TEST_TIMEOUT:-300}"
  for f in $files; do
    if [ "$(left)" -le 5 ]; then
      echo "$f: not started (GPU_CHECK_DEADLINE)" | tee -a "$OUT/pytest.log"
      nfail=$((nfail + 1)); SUMMARY+=("| tests: $f | FAILED | | not started: GPU_CHECK_DEADLINE reached |")
      continue
    fi
    echo "##### $f" | tee -a "$OUT/pytest.log"
    # shellcheck disable=SC2086
    timeout "$(left)" "$PY" -m pytest -q -rfE --tb=short -p no:cacheprovider $timeout_arg ${GPU_CHECK_PYTEST_ARGS:-} "$f" > "$OUT/.pytest_one.log" 2>&1
    frc=$?
    [ "$frc" -eq 124 ] && echo "(stopped at GPU_CHECK_DEADLINE)" >> "$OUT/.pytest_one.log"
    if [ "$frc" -eq 0 ]; then tail -n 3 "$OUT/.pytest_one.log"; else tail -n "${GPU_CHECK_LOG_LINES:-150}" "$OUT/.pytest_one.log"; fi >> "$OUT/pytest.log"
    fline=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/.pytest_one.log" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    echo "$f: exit $frc: $fline" | tee -a "$OUT/pytest.log"
    if [ "$frc" -ne 0 ] && [ "$frc" -ne 5 ]; then nfail=$((nfail + 1)); SUMMARY+=("| tests: $f | FAILED | | exit $frc: ${fline:-crashed, see pytest.log} |"); fi
  done
  rm -f "$OUT/.pytest_one.log"
  if [ "$nfail" -eq 0 ]; then record tests ok $((SECONDS - t0)) "every test file passed on the GPU"
  else record tests FAILED $((SECONDS - t0)) "$nfail test files failed; see pytest.log"; fi
else
  record tests skipped 0 "GPU_CHECK_TESTS=0"
fi
}

# 4. benchmarks -----------------------------------------------------------------------------
run_bench() {
if [ "${GPU_CHECK_BENCH:-1}" != "0" ] && [ "$(left)" -le 5 ]; then
  record bench FAILED 0 "not started: GPU_CHECK_DEADLINE reached"
elif [ "${GPU_CHECK_BENCH:-1}" != "0" ]; then
  BENCH_ENV=()
  if [ -f .peer/setup_flashinfer.sh ]; then
    t0=$SECONDS
    if bash .peer/setup_flashinfer.sh > "$OUT/flashinfer.log" 2>&1; then
      record flashinfer-setup ok $((SECONDS - t0)) "peer available to the suites"
    else
      record flashinfer-setup FAILED $((SECONDS - t0)) "see flashinfer.log; suites run without it"
    fi
    BENCH_ENV=(env "PYTHONPATH=/tmp/fi/flashinfer_python-0.2.14.post1:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16)
  fi
  t0=$SECONDS
  rm -rf "$OUT/bench"
  mkdir -p "$OUT/bench"
  # At the deadline `timeout` sends SIGTERM: the running suite stops, its report keeps the rows it measured
  # (status "stopped"), no further suite starts, and python -m bench exits 124. The printed rows
  # (TLT_BENCH_PROGRESS) are also kept in bench/bench.log.
  # shellcheck disable=SC2086
  timeout "$(left)" ${BENCH_ENV[@]+"${BENCH_ENV[@]}"} "$PY" -m bench "${SUITES[@]}" --out "$OUT/bench" ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench/bench.log"
  rc=${PIPESTATUS[0]}
  n=$(ls "$OUT"/bench/*.json 2>/dev/null | wc -l)
  if [ "$rc" -eq 0 ]; then record bench ok $((SECONDS - t0)) "$n suite reports (${SUITES[*]})"
  else record bench FAILED $((SECONDS - t0)) "exit $rc, $n suite reports; failed suites are marked in summary.md"; fi
else
  record bench skipped 0 "GPU_CHECK_BENCH=0"
fi
}

if [ "${GPU_CHECK_BENCH_FIRST:-0}" != "0" ]; then run_bench; run_tests; else run_tests; run_bench; fi

# summary -----------------------------------------------------------------------------------
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "$GPU; commit ${TLT_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}$([ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && echo ' (+ uncommitted changes)')"
  echo
  echo "| phase | status | seconds | detail |"
  echo "|---|---|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
  echo
  if [ -f "$OUT/bench/summary.md" ]; then tail -n +2 "$OUT/bench/summary.md"; fi
} > "$OUT/summary.md"
# Few files come back from the machine: the per-suite reports travel as one archive.
if [ -d "$OUT/bench" ]; then tar -C "$OUT" -czf "$OUT/bench.tar.gz" bench && rm -rf "$OUT/bench"; fi

echo
echo "=== gpu_check summary ($GPU)"
echo "| phase | status | seconds | detail |"
echo "|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
echo "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$FAILED"
