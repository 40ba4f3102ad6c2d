#!/usr/bin/env bash
# scripts/gpu-check --prebuilt DIR on stand-in binaries, no GPU: the stand-in GPU test binary logs its
# arguments and exits with STATUS, a stand-in compute-sanitizer on PATH logs its tool and runs the
# binary, a stand-in Python (FP4MOE_CHECK_PYTHON) logs its pip and pytest calls and answers pytest
# with counts and the status FAKE_PYTEST_STATUS. The summary must give the GPU tests, the Python GPU
# tests (with pytest's counts, after the C++ GPU tests), memcheck, racecheck and the demo each a line,
# the sanitizers the default subset (the ragged-expert cases among it), OUTPUT_DIR/results.tgz the logs,
# and a failing test binary or failing pytest a FAIL line and exit status 1; a run killed in the
# sanitizer step (the stand-in kills gpu-check, its parent, when given a filter: a known point, no
# timing) must leave the GPU tests' log packed. Archive listings go to files before grep reads them:
# grep -q closing a pipe early would kill tar with SIGPIPE, a failure under pipefail.
#
#   tests/tools/gpu_check_prebuilt_test.sh REPO_ROOT WORK_DIR
set -euo pipefail
root="$1" work="$2"
rm -rf "$work" && mkdir -p "$work/bin"
cat >"$work/bin/compute-sanitizer" <<EOF
#!/usr/bin/env bash
echo "sanitizer \$2" >>"$work/calls"
shift 4  # --tool NAME --error-exitcode 1
exec "\$@"
EOF
chmod +x "$work/bin/compute-sanitizer"
cat >"$work/bin/python" <<EOF
#!/usr/bin/env bash
echo "python \$*" >>"$work/calls"
case "\$1 \$2" in
  "-m pip") [ "\$3" = install ] ;;
  "-m pytest") echo "pytest PYTHONPATH=\$PYTHONPATH" >>"$work/calls"
               echo "3 passed, 1 skipped in 0.10s"; exit "\${FAKE_PYTEST_STATUS:-0}" ;;
  *) exit 2 ;;
esac
EOF
chmod +x "$work/bin/python"
export FP4MOE_CHECK_PYTHON="$work/bin/python"
# prebuilt STATUS [KILL]: WORK/pre-STATUS/base/{fp4moe,fp4moe_gpu_tests}.xz; with KILL the test binary
# kills its parent when given a --gtest_filter.
prebuilt() {
  local kill="${2:-}"
  mkdir -p "$work/pre-$1$kill/base"
  printf '#!/usr/bin/env bash\necho "tests $*" >>"%s/calls"\n' "$work" >"$work/tests.sh"
  [ -z "$kill" ] || printf '[ -z "$1" ] || kill -9 $PPID\n' >>"$work/tests.sh"
  printf 'exit %s\n' "$1" >>"$work/tests.sh"
  printf '#!/usr/bin/env bash\necho "fp4moe $*" >>"%s/calls"\n' "$work" >"$work/fp4moe.sh"
  xz -c "$work/tests.sh" >"$work/pre-$1$kill/base/fp4moe_gpu_tests.xz"
  xz -c "$work/fp4moe.sh" >"$work/pre-$1$kill/base/fp4moe.xz"
}
prebuilt 0
prebuilt 1
prebuilt 0 kill
fail=0
PATH="$work/bin:$PATH" "$root/scripts/gpu-check" --prebuilt "$work/pre-0" "$work/out" >"$work/log" 2>&1 ||
  { cat "$work/log"; echo "FAIL: gpu-check --prebuilt with passing stand-ins exited non-zero"; fail=1; }
summary="$work/out/summary.txt"
cat "$summary" "$work/calls"
for s in gpu-tests python-gpu memcheck racecheck demo; do
  grep -qE "^$s +PASS" "$summary" || { echo "FAIL: no PASS line for $s"; fail=1; }
done
grep -qE "^(configure|build|cpu-tests) " "$summary" && { echo "FAIL: --prebuilt must not configure, build or run CPU tests"; fail=1; }
grep -qx "sanitizer memcheck" "$work/calls" || { echo "FAIL: memcheck not run"; fail=1; }
grep -qx "sanitizer racecheck" "$work/calls" || { echo "FAIL: racecheck not run"; fail=1; }
grep -q '^tests --gtest_filter=.*\*Ragged\*' "$work/calls" || { echo "FAIL: the sanitizer subset lacks the ragged cases"; fail=1; }
grep -qx "fp4moe demo --device cuda" "$work/calls" || { echo "FAIL: demo not run"; fail=1; }
grep -qxE "tests ?" "$work/calls" || { echo "FAIL: the gpu-tests step must run every test without FP4MOE_GPU_TEST_FILTER"; fail=1; }
grep -qE "^python-gpu +PASS .*; 3 passed, 1 skipped in 0.10s$" "$summary" || { echo "FAIL: no pytest counts in the python-gpu row"; fail=1; }
target="$(sed -n 's/^python -m pip install --no-build-isolation --no-deps --no-index .*--target \([^ ]*\) .* \/.*$/\1/p' "$work/calls")"
grep -qE "^python -m pip install --no-build-isolation --no-deps --no-index .* $root\$" "$work/calls" && [ -n "$target" ] ||
  { echo "FAIL: the package is not pip-installed from the tree (no isolation, no index, a --target folder)"; fail=1; }
grep -qx "pytest PYTHONPATH=$target" "$work/calls" || { echo "FAIL: pytest does not import the installed package"; fail=1; }
grep -qE "^python -m pytest -q -rs -p no:cacheprovider $root/tests/python\$" "$work/calls" || { echo "FAIL: pytest tests/python (every test) not run"; fail=1; }
first="$(grep -m 1 -E '^(tests|python -m pytest)' "$work/calls" | cut -d' ' -f1)"
[ "$first" = tests ] || { echo "FAIL: the Python GPU tests must run after the C++ GPU tests"; fail=1; }
tar -tzf "$work/out/results.tgz" >"$work/packed" || { echo "FAIL: no readable results.tgz"; fail=1; }
for f in summary.txt python-gpu.log gpu-tests.log; do
  grep -qx "./$f" "$work/packed" || { echo "FAIL: results.tgz lacks $f"; fail=1; }
done
if PATH="$work/bin:$PATH" "$root/scripts/gpu-check" --prebuilt "$work/pre-1" "$work/out1" >"$work/log1" 2>&1; then
  echo "FAIL: gpu-check --prebuilt exited 0 with a failing test binary"; fail=1
fi
grep -qE "^gpu-tests +FAIL" "$work/out1/summary.txt" || { echo "FAIL: no FAIL line for the failing tests"; fail=1; }
if FAKE_PYTEST_STATUS=1 PATH="$work/bin:$PATH" "$root/scripts/gpu-check" --prebuilt "$work/pre-0" "$work/out-py" \
  >"$work/log-py" 2>&1; then
  echo "FAIL: gpu-check --prebuilt exited 0 with failing Python GPU tests"; fail=1
fi
grep -qE "^python-gpu +FAIL" "$work/out-py/summary.txt" || { echo "FAIL: no FAIL line for the failing Python tests"; fail=1; }
PATH="$work/bin:$PATH" TMPDIR="$work" "$root/scripts/gpu-check" --prebuilt "$work/pre-0kill" "$work/out-killed" \
  >"$work/log-killed" 2>&1 && { echo "FAIL: the stand-in did not kill gpu-check"; fail=1; }
tar -tzf "$work/out-killed/results.tgz" >"$work/packed-killed" 2>/dev/null || { echo "FAIL: the killed run left no results.tgz"; fail=1; }
grep -qx "./gpu-tests.log" "$work/packed-killed" || { echo "FAIL: the killed run's results.tgz lacks gpu-tests.log"; fail=1; }
FP4MOE_GPU_TEST_FILTER='-ExpertParallel*' PATH="$work/bin:$PATH" "$root/scripts/gpu-check" --prebuilt "$work/pre-0" \
  "$work/out-filter" >"$work/log-filter" 2>&1 || { echo "FAIL: gpu-check with FP4MOE_GPU_TEST_FILTER exited non-zero"; fail=1; }
grep -qx -- "tests --gtest_filter=-ExpertParallel\*" "$work/calls" ||
  { echo "FAIL: FP4MOE_GPU_TEST_FILTER does not reach the gpu-tests step"; fail=1; }
if "$root/scripts/gpu-check" --prebuilt "$work/none" "$work/out2" >/dev/null 2>&1; then
  echo "FAIL: gpu-check accepted a folder without base/fp4moe_gpu_tests.xz"; fail=1
fi
exit $fail
