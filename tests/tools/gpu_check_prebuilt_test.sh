#!/usr/bin/env bash
# scripts/gpu-check --prebuilt DIR on stand-in binaries, no GPU: the stand-in GPU test binary logs its
# arguments and exits with STATUS, a stand-in compute-sanitizer on PATH logs its tool and runs the
# binary. The summary must give the GPU tests, memcheck, racecheck and the demo each a line, the
# sanitizers the default subset (the ragged-expert cases among it), OUTPUT_DIR/results.tgz the logs,
# and a failing test binary a FAIL line and exit status 1; a run killed in the sanitizer step (the
# stand-in kills gpu-check when given a filter) must leave the GPU tests' log packed.
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
for s in gpu-tests memcheck racecheck demo; do
  grep -qE "^$s +PASS" "$summary" || { echo "FAIL: no PASS line for $s"; fail=1; }
done
grep -qE "^(configure|build|cpu-tests) " "$summary" && { echo "FAIL: --prebuilt must not configure, build or run CPU tests"; fail=1; }
grep -qx "sanitizer memcheck" "$work/calls" || { echo "FAIL: memcheck not run"; fail=1; }
grep -qx "sanitizer racecheck" "$work/calls" || { echo "FAIL: racecheck not run"; fail=1; }
grep -q '^tests --gtest_filter=.*\*Ragged\*' "$work/calls" || { echo "FAIL: the sanitizer subset lacks the ragged cases"; fail=1; }
grep -qx "fp4moe demo --device cuda" "$work/calls" || { echo "FAIL: demo not run"; fail=1; }
tar -tzf "$work/out/results.tgz" | grep -qx "./summary.txt" || { echo "FAIL: results.tgz lacks summary.txt"; fail=1; }
if PATH="$work/bin:$PATH" "$root/scripts/gpu-check" --prebuilt "$work/pre-1" "$work/out1" >"$work/log1" 2>&1; then
  echo "FAIL: gpu-check --prebuilt exited 0 with a failing test binary"; fail=1
fi
grep -qE "^gpu-tests +FAIL" "$work/out1/summary.txt" || { echo "FAIL: no FAIL line for the failing tests"; fail=1; }
PATH="$work/bin:$PATH" TMPDIR="$work" "$root/scripts/gpu-check" --prebuilt "$work/pre-0kill" "$work/out-killed" \
  >"$work/log-killed" 2>&1 && { echo "FAIL: the stand-in did not kill gpu-check"; fail=1; }
tar -tzf "$work/out-killed/results.tgz" 2>/dev/null | grep -qx "./gpu-tests.log" ||
  { echo "FAIL: the killed run's results.tgz lacks gpu-tests.log"; fail=1; }
if "$root/scripts/gpu-check" --prebuilt "$work/none" "$work/out2" >/dev/null 2>&1; then
  echo "FAIL: gpu-check accepted a folder without base/fp4moe_gpu_tests.xz"; fail=1
fi
exit $fail
