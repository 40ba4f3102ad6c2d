#!/usr/bin/env bash
# scripts/gpu-perf --prefill --no-tune --cache FILE --prebuilt DIR on a stand-in binary, no GPU: the
# stand-in answers `bench --mode MODE ... --json FILE` with the committed prefill table of record of that
# mode (8488342). The run must check the targets (10/60 rows meet them), list the 50 misses and pack
# its output folder into results.tgz. A run killed during its second set (the stand-in kills gpu-perf
# when asked for the decode tokens) must leave the first set packed.
#
#   tests/tools/gpu_perf_prebuilt_test.sh REPO_ROOT WORK_DIR
set -euo pipefail
root="$1" work="$2"
rm -rf "$work" && mkdir -p "$work/pre/base"
cat >"$work/fp4moe.sh" <<EOF
#!/usr/bin/env bash
[ "\$1" = bench ] || { echo "stand-in: only bench" >&2; exit 2; }
[ -f "\$FP4MOE_TUNE_CACHE" ] || { echo "stand-in: FP4MOE_TUNE_CACHE is not the given cache" >&2; exit 2; }
json="" csv="" mode="" tokens=""
while [ \$# -gt 0 ]; do
  case "\$1" in --json) json="\$2"; shift ;; --csv) csv="\$2"; shift ;; --mode) mode="\$2"; shift ;; --tokens) tokens="\$2"; shift ;; esac
  shift
done
[ "\$tokens" != 1,2,4,8,16,32,64,128,256 ] || kill -9 \$PPID
cp "$root/docs/bench/prefill-8488342-\$mode.json" "\$json"
echo "model,mode,tokens" >"\$csv"
EOF
xz -c "$work/fp4moe.sh" >"$work/pre/base/fp4moe.xz"
"$root/scripts/gpu-perf" --prefill --no-tune --cache "$root/bench/h200-tune-cache.json" --prebuilt "$work/pre" \
  "$work/out" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
fail=0
expect() {  # expect FILE PATTERN
  grep -qE "$2" "$1" || { echo "FAIL: no line matching '$2' in $1"; fail=1; }
}
expect "$work/out/targets-prefill.txt" '^prefill \(T >= 512\): 10/60 rows meet the target$'
expect "$work/out/misses-prefill.md" '^Prefill rows that miss \(50\):$'
tar -tzf "$work/out/results.tgz" >"$work/packed" || { echo "FAIL: no readable results.tgz"; fail=1; }
for f in targets-prefill.txt misses-prefill.md bench-prefill-w4a16.json bench-prefill-w4a4_scalar.json; do
  grep -qx "./$f" "$work/packed" || { echo "FAIL: results.tgz lacks $f"; fail=1; }
done
# Killed in its second set (decode): the first set's files are packed already.
TMPDIR="$work" "$root/scripts/gpu-perf" --prefill --decode --no-tune --cache "$root/bench/h200-tune-cache.json" --prebuilt "$work/pre" \
  "$work/out-killed" >"$work/log-killed" 2>&1 && { echo "FAIL: the stand-in did not kill gpu-perf"; fail=1; }
tar -tzf "$work/out-killed/results.tgz" >"$work/packed-killed" || { echo "FAIL: the killed run left no results.tgz"; fail=1; }
grep -qx "./misses-prefill.md" "$work/packed-killed" || { echo "FAIL: the killed run's results.tgz lacks the prefill set"; fail=1; }
# A missing prebuilt folder is a usage error, before anything runs.
if "$root/scripts/gpu-perf" --prefill --prebuilt "$work/none" "$work/out2" >/dev/null 2>&1; then
  echo "FAIL: gpu-perf accepted a folder without base/fp4moe.xz"; fail=1
fi
exit $fail
