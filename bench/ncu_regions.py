#!/usr/bin/env python3
"""Where a kernel's warps stall, by region: the SASS source page of an Nsight Compute report.

    python3 bench/ncu_regions.py SOURCE_CSV [--mark OPCODE] [--top N]
    python3 bench/ncu_regions.py --self-test

SOURCE_CSV is `ncu --import REPORT --page source --csv --print-source sass` of a report recorded with
`--section SourceCounters` (scripts/gpu-profile --source writes it). For every kernel in it the
instructions are split at the first and the last instruction whose opcode starts with --mark (by
default per kernel: HGMMA where the kernel has one, the wgmma kernel; else HMMA, the streaming
kernel's mma.sync) into three regions:

    before  the prologue up to the first MMA (tile table, barrier set-up, the first data)
    main    from the first to the last MMA (the main loop)
    after   the epilogue (staging, activation, stores, split-K and finalize hand-offs)

and prints per region the warp samples, the instructions executed and the largest stall reasons,
then the --top instructions with the most samples. A sampler picks one warp per SM sub-partition and
interval, so a region that only one warp of a CTA runs counts about four times its sample share in
wall time.
"""
import argparse
import collections
import csv
import io
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels_of(text):
    """[(kernel name, header, rows)] of the source page's CSV (one block per kernel)."""
    out = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            out.append([row[1] if len(row) > 1 else "?", None, []])
        elif row[0] == "Address" and out:
            out[-1][1] = row
        elif out and out[-1][1] is not None and len(row) == len(out[-1][1]):
            out[-1][2].append(row)
    return [tuple(k) for k in out if k[1] is not None]


def opcode(source):
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def as_int(text):
    try:
        return int(float(text.replace(",", "")))
    except ValueError:
        return 0


def regions(header, rows, mark):
    """{region: (samples, executed, Counter of stall reasons)} and the split indices, or None without marks."""
    col = {name: i for i, name in enumerate(header)}
    stalls = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    marked = [i for i, r in enumerate(rows) if opcode(r[col["Source"]]).startswith(mark)]
    if not marked:
        return None, None
    first, last = marked[0], marked[-1]
    spans = {"before": rows[:first], "main": rows[first:last + 1], "after": rows[last + 1:]}
    result = {}
    for name, span in spans.items():
        reasons = collections.Counter()
        for r in span:
            for s in stalls:
                v = as_int(r[col[s]])
                if v:
                    reasons[s[len("stall_"):]] += v
        result[name] = (sum(as_int(r[col[SAMPLES]]) for r in span), sum(as_int(r[col[EXECUTED]]) for r in span),
                        reasons)
    return result, (first, last)


def auto_mark(header, rows):
    """HGMMA when the kernel has a wgmma instruction, else HMMA."""
    col = header.index("Source")
    return "HGMMA" if any(opcode(r[col]).startswith("HGMMA") for r in rows) else "HMMA"


def report(text, mark, top, out):
    found = kernels_of(text)
    if not found:
        print("ncu_regions: no kernel blocks in the CSV (expected `--page source --csv --print-source sass`)",
              file=sys.stderr)
        return 2
    for name, header, rows in found:
        missing = [c for c in ("Source", SAMPLES, EXECUTED) if c not in header]
        if missing:
            print(f"ncu_regions: {name}: no column {missing[0]!r} (record with --section SourceCounters)",
                  file=sys.stderr)
            return 2
        kernel_mark = mark or auto_mark(header, rows)
        split, at = regions(header, rows, kernel_mark)
        total = sum(as_int(r[header.index(SAMPLES)]) for r in rows)
        print(f"{name}\n  {len(rows)} instructions, {total} warp samples")
        if split is None:
            print(f"  no instruction with opcode {kernel_mark}*: no regions")
        else:
            print(f"  regions split at instructions {at[0]} and {at[1]} (first and last {kernel_mark})")
            for region, (samples, executed, reasons) in split.items():
                share = 100.0 * samples / total if total else 0.0
                common = ", ".join(f"{k} {v}" for k, v in reasons.most_common(5))
                print(f"  {region:<6} {samples:6d} samples ({share:5.1f}%)  {executed:10d} executed  {common}")
        col = header.index(SAMPLES)
        ranked = sorted(range(len(rows)), key=lambda i: -as_int(rows[i][col]))[:top]
        for i in ranked:
            r = rows[i]
            print(f"    #{i:<5d} {as_int(r[col]):5d} samples  {as_int(r[header.index(EXECUTED)]):8d} executed  "
                  f"{r[header.index('Source')].strip()[:72]}")
    return 0


def self_test():
    header = ["Address", "Source", SAMPLES, EXECUTED, "stall_wait", "stall_no_inst", "stall_wait (Not Issued)"]
    rows = [["0x0", "LDC R1, c[0x0][0x28]", "3", "8", "1", "2", "0"],
            ["0x10", "HMMA.16816.F32.BF16 R4, R8, R12, R4", "5", "64", "5", "0", "0"],
            ["0x20", "@!P0 BRA 0x10", "1", "64", "1", "0", "0"],
            ["0x30", "HMMA.16816.F32.BF16 R4, R8, R14, R4", "4", "64", "4", "0", "0"],
            ["0x40", "@P1 STG.E [R2], R4", "7", "8", "0", "7", "0"]]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["Kernel Name", "k0"])
    w.writerow(header)
    w.writerows(rows)
    found = kernels_of(buf.getvalue())
    assert len(found) == 1 and found[0][0] == "k0" and len(found[0][2]) == 5, found
    split, at = regions(found[0][1], found[0][2], "HMMA")
    assert at == (1, 3), at
    assert split["before"][:2] == (3, 8) and split["main"][:2] == (10, 192) and split["after"][:2] == (7, 8), split
    assert split["after"][2] == collections.Counter({"no_inst": 7}), split["after"]
    assert split["main"][2] == collections.Counter({"wait": 10}), split["main"]
    assert opcode("@!P0 BRA 0x10") == "BRA" and opcode("HMMA.16816.F32 R4") == "HMMA"
    none, _ = regions(found[0][1], found[0][2], "HGMMA")
    assert none is None
    assert auto_mark(found[0][1], found[0][2]) == "HMMA"
    wgmma_rows = [r[:] for r in rows]
    wgmma_rows[1][1] = "HGMMA.64x256x16.F32.BF16 R24, R168, gdesc[UR16], R24"
    assert auto_mark(header, wgmma_rows) == "HGMMA" and regions(header, wgmma_rows, "HGMMA")[1] == (1, 1)
    assert report(buf.getvalue(), "HMMA", 2, sys.stdout) == 0
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        assert report("no,kernels\n", "HMMA", 2, sys.stdout) == 2
        assert "no kernel blocks" in sys.stderr.getvalue()
    finally:
        sys.stderr = err
    print("ncu_regions self-test: PASS")
    return 0


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="?", help="the source page as CSV")
    ap.add_argument("--mark", default=None,
                    help="opcode prefix that opens and closes the main loop "
                         "(default: HGMMA where the kernel has one, else HMMA)")
    ap.add_argument("--top", type=int, default=10, help="instructions with the most samples to list (default 10)")
    ap.add_argument("--self-test", action="store_true", help="check the parser on a built-in example")
    args = ap.parse_args(argv[1:])
    if args.self_test:
        return self_test()
    if not args.csv:
        ap.error("SOURCE_CSV is required (or --self-test)")
    with open(args.csv, newline="") as f:
        return report(f.read(), args.mark, args.top, sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
