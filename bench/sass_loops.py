#!/usr/bin/env python3
"""Instruction counts of the loops of CUDA kernels, from their SASS (cuobjdump).

    python3 bench/sass_loops.py FILE [--kernel SUBSTRING] [--need OPCODE] [--max-share F]

FILE is a cubin, an object file or a library that cuobjdump can read (e.g. the `.cu.o` of
kernels/expert_gemm.cu in a CUDA build folder, or a cubin from `nvcc -cubin`). Where the toolkit has
no cuobjdump, `--nvdisasm PATH` reads a cubin with nvdisasm instead (`scripts/bootstrap --sass-tools
DIR` puts the one of the PyPI package nvidia-cuda-nvdisasm in DIR/bin; it needs no GPU). A cubin of one
source file: `nvcc -cubin -gencode arch=compute_90a,code=sm_90a` with the flags of its build line
(`ninja -t commands` in the build folder). For every kernel whose
mangled name contains SUBSTRING, every loop (a backward branch and the code from its target to it)
that contains at least one instruction whose opcode starts with OPCODE is printed with its length and
an opcode histogram. Out-of-line retry paths (an mbarrier try-wait branching back into the main loop
from the end of the function) look like loops spanning most of the function; loops longer than
--max-share of the function (default 0.5) are left out.

Gives the instruction counts of the performance analysis (e.g. `--need HGMMA` for the wgmma consumer loop,
`--need LDGSTS` for its producer loops, `--need HMMA` for the streaming kernel's main loop).
"""
import argparse
import collections
import re
import subprocess
import sys

INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
FUNC = re.compile(r"\s*Function\s*:\s*(\S+)")
# nvdisasm: a kernel starts at its `.text.<name>:` label; branch targets are labels (`.L_x_12`).
NVD_FUNC = re.compile(r"^\.text\.(\S+):\s*$")
NVD_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")


def parse(sass_text):
    """{kernel name: [(address, opcode, operands)]} from `cuobjdump --dump-sass` or `nvdisasm -c` output.
    A kernel starts at cuobjdump's `Function : <name>` or nvdisasm's `.text.<name>:`; nvdisasm's label
    operands (`.L_x_12`) become the 0x addresses that cuobjdump prints."""
    kernels, current, labels, pending = {}, None, {}, []
    for line in sass_text.splitlines():
        m = FUNC.match(line) or NVD_FUNC.match(line)
        if m:
            current = kernels.setdefault(m.group(1), [])
            continue
        m = NVD_LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSTR.match(line)
        if m and current is not None:
            addr = int(m.group(1), 16)
            for label in pending:
                labels[label] = addr
            pending = []
            current.append((addr, m.group(2), m.group(3)))
    resolve = lambda rest: re.sub(r"\.L_x_\d+", lambda t: f"0x{labels.get(t.group(0), 0):x}", rest)
    return {k: [(a, op, resolve(rest)) for a, op, rest in v] for k, v in kernels.items()}


def loops(instructions, need, max_share):
    """[(target, branch address, [instructions of the body])] of the loops that contain `need`."""
    if not instructions:
        return []
    span = instructions[-1][0] - instructions[0][0] + 16
    found = []
    for addr, op, rest in instructions:
        if not op.startswith("BRA") or ".DIV" in op:
            continue
        m = re.search(r"0x([0-9a-f]+)", rest)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr or (addr - target) > max_share * span:
            continue
        body = [i for i in instructions if target <= i[0] <= addr]
        if any(i[1].startswith(need) for i in body):
            found.append((target, addr, body))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--kernel", default="", help="substring of the mangled kernel name")
    ap.add_argument("--need", default="", help="opcode prefix a loop must contain (e.g. HGMMA, HMMA, LDGSTS)")
    ap.add_argument("--max-share", type=float, default=0.5, help="longest loop, as a share of the function")
    ap.add_argument("--top", type=int, default=12, help="opcodes shown per loop")
    ap.add_argument("--nvdisasm", default="", help="read FILE (a cubin) with this nvdisasm instead of cuobjdump")
    a = ap.parse_args()
    cmd = [a.nvdisasm, "-c", a.file] if a.nvdisasm else ["cuobjdump", "--dump-sass", a.file]
    try:
        sass = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"sass_loops: {' '.join(cmd)} failed: {e}")
    kernels = {k: v for k, v in parse(sass).items() if a.kernel in k}
    if not kernels:
        sys.exit(f"sass_loops: no kernel matching '{a.kernel}' in {a.file}")
    for name, instructions in kernels.items():
        print(f"{name}: {len(instructions)} instructions")
        for target, addr, body in loops(instructions, a.need, a.max_share):
            hist = collections.Counter(i[1].split(".")[0] for i in body)
            top = ", ".join(f"{op} {n}" for op, n in hist.most_common(a.top))
            print(f"  loop {target:#07x}..{addr:#07x}: {len(body):5d} instructions | {top}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the output piped into head
        sys.exit(0)
