#!/usr/bin/env python3
"""tests/kernels/finalize_ptx_check.py — the finalize kernel issues every slot's y loads before its first add.

The separate finalize (kernels/finalize.cu, nvfp4::finalize_token8) is bound by its L2/DRAM round trips:
with the y loads of all 8 slots in flight it reads fp32 y at about the copy rate. A floating-point use of
a loaded y inside the load loop (as the expert-bias add once was, predicated on `bias != nullptr`)
makes every slot's loads wait for the previous slot's, and the stage ran 1.3-1.6x slower with no bias
at all. This check compiles finalize.cu to PTX with the build's nvcc and
asserts that the kernel's first 16 y loads (ld.global.cg.v4.f32: 2 per slot, 8 slots) come before its
first fp32 add or multiply. No GPU needed.

  finalize_ptx_check.py NVCC SOURCE_ROOT
"""
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def kernel_body(ptx: str, name_part: str) -> str:
    m = re.search(r"\.entry\s+(\S*" + name_part + r"\S*)\(", ptx)
    if not m:
        raise SystemExit(f"finalize_ptx_check: no .entry containing '{name_part}' in the PTX")
    start = ptx.index("{", m.end())
    depth = 0
    for i in range(start, len(ptx)):
        depth += ptx[i] == "{"
        depth -= ptx[i] == "}"
        if depth == 0:
            return ptx[start:i]
    raise SystemExit("finalize_ptx_check: unbalanced braces in the kernel body")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    nvcc, root = sys.argv[1], Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "finalize.ptx"
        cmd = [nvcc, "-ptx", "-std=c++20", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
               "-gencode=arch=compute_90a,code=compute_90a", f"-I{root}", f"-I{root / 'include'}",
               "-x", "cu", str(root / "kernels" / "finalize.cu"), "-o", str(out)]
        subprocess.run(cmd, check=True)
        body = kernel_body(out.read_text(), "finalize_kernel")
    loads_before = 0
    for line in body.splitlines():
        if "ld.global.cg.v4.f32" in line:
            loads_before += 1
        elif re.search(r"\b(add|mul|fma)\.rn(\.ftz)?\.f32\b", line):
            break
    print(f"finalize_kernel: {loads_before} y loads (ld.global.cg.v4.f32) before the first fp32 add/mul")
    if loads_before < 16:
        print("FAIL: the y loads of the 8 slots are not all issued before the first add "
              "(a use of a loaded y inside nvfp4::finalize_token8's load loop?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
