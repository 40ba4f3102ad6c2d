#!/usr/bin/env bash
# scripts/bench-ab --prebuilt --rebase on stand-in binaries, no GPU: each stand-in is a shell script
# that answers `bench ... --json FILE` with a committed bench table whose times it scales (1.0 for the
# base, 1.5 for a variant). The summary must name the variant at geomean 1.500 and the second base run
# (--rebase) at 1.000, each with its rows line and its stage geomeans; bench/ab_table.py makes the
# run one Markdown table.
#
#   tests/tools/bench_ab_prebuilt_test.sh REPO_ROOT WORK_DIR
set -euo pipefail
root="$1" work="$2"
table="$root/docs/bench/prefill-8488342-w4a16.json"
rm -rf "$work" && mkdir -p "$work/pre"
# stand-in NAME SCALE: WORK/pre/NAME/fp4moe.xz
stand_in() {
  mkdir -p "$work/pre/$1"
  cat >"$work/$1.sh" <<EOF
#!/usr/bin/env bash
out=""
while [ \$# -gt 0 ]; do [ "\$1" = --json ] && { out="\$2"; shift; }; shift; done
python3 - "$table" "\$out" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
f = float(sys.argv[3])
for r in d["rows"]:
    r["median_us"] *= f
    r["stages_us"] = {k: v * f for k, v in r["stages_us"].items()}
json.dump(d, open(sys.argv[2], "w"))
PY
EOF
  xz -c "$work/$1.sh" >"$work/pre/$1/fp4moe.xz"
}
stand_in base 1.0
stand_in slower 1.5
"$root/scripts/bench-ab" --prebuilt "$work/pre" --models qwen3-30b-a3b --tokens 4096 --modes w4a16 --rebase \
  "$work/out" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
summary="$work/out/summary.txt"
cat "$summary"
fail=0
expect() { grep -qE "$1" "$summary" || { echo "FAIL: no line matching '$1' in the summary"; fail=1; }; }
expect '^slower vs base, w4a16: [0-9]+ rows: .*geomean ratio 1\.500'
expect '^base-again vs base, w4a16: [0-9]+ rows: .*geomean ratio 1\.000'
expect '^  stage geomean ratios .*gemm1 1\.500!'
[ "$(grep -c '^== bench ' "$summary")" = 3 ] || { echo "FAIL: three bench runs expected (base, slower, base-again)"; fail=1; }
# bench/ab_table.py: the run as one Markdown table, the variants in the run's order.
python3 "$root/bench/ab_table.py" "$work/out" >"$work/table.md" || { echo "FAIL: ab_table.py"; fail=1; }
cat "$work/table.md"
grep -q '^| preset | T | base | slower | base-again |$' "$work/table.md" || { echo "FAIL: table header"; fail=1; }
grep -qE '^\| qwen3-30b-a3b \| 4096 \| [0-9.]+ \| [0-9.]+ \(1\.500\) \[g1 1\.50 g2 1\.50\] \| [0-9.]+ \(1\.000\)' "$work/table.md" ||
  { echo "FAIL: qwen3-30b-a3b T = 4096 row"; fail=1; }
grep -q '^| geomean | | | \*\*1\.500\*\* | \*\*1\.000\*\* |$' "$work/table.md" || { echo "FAIL: geomean row"; fail=1; }
exit $fail
