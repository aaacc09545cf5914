"""The loops of a compiled kernel, from its SASS: per loop, its instructions (static count per
iteration of one warp), the opcode mix, and the sum of the scheduler's stall counts (the
fixed-latency cycles ptxas placed between consecutive instructions of one warp: a lower bound
on one iteration's issue time that ignores variable-latency waits and other warps).

    python -m devtools.sass_loops KERNEL.cubin [--min 200] [--top 18]

A cubin comes from ptxas on the PTX the DSL dumps (`devtools.ptx_digest.ptx_of`, then
``ptxas -arch=sm_90a``, as `tests.common.ptxas_report` does). Needs nvdisasm (the test
extra's pip wheel, $NVDISASM or PATH). Decodes the Volta-and-later control word: the stall
count is bits 105-108 of each 128-bit instruction.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]{16}) \*/")
_HIGH = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")
_LABEL = re.compile(r"\s*\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\(\.(L_x_\d+)\)")
_OP = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def instructions(cubin: str):
    """[(address, text, stall cycles)] and {label: address} of every instruction."""
    from tests.common import cuda_tool
    nvdisasm = cuda_tool("nvdisasm")
    if nvdisasm is None:
        raise SystemExit("nvdisasm not found (pip install nvidia-cuda-nvdisasm, or $NVDISASM)")
    lines = subprocess.run([nvdisasm, "-hex", cubin], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    out, labels, pending = [], {}, []
    for i, line in enumerate(lines):
        lab = _LABEL.match(line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _INSTR.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for name in pending:
            labels[name] = addr
        pending = []
        high = int(_HIGH.search(lines[i + 1]).group(1), 16)
        out.append((addr, m.group(2).strip(), (high >> 41) & 0xF))
    return out, labels


def loops(instrs, labels):
    """(first, last) instruction indices of each backward branch's loop."""
    index = {a: n for n, (a, _, _) in enumerate(instrs)}
    found = []
    for n, (addr, text, _) in enumerate(instrs):
        b = _BRANCH.search(text)
        if b and labels.get(b.group(1), addr + 1) <= addr:
            found.append((index[labels[b.group(1)]], n))
    return found


def opcode(text: str) -> str:
    return _OP.match(text).group(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin")
    ap.add_argument("--min", type=int, default=200, help="smallest loop shown (instructions)")
    ap.add_argument("--top", type=int, default=18, help="opcodes listed per loop")
    a = ap.parse_args(argv)
    instrs, labels = instructions(a.cubin)
    for first, last in sorted(loops(instrs, labels), key=lambda fl: fl[1] - fl[0]):
        body = instrs[first:last + 1]
        if len(body) < a.min:
            continue
        mix = collections.Counter(opcode(t) for _, t, _ in body)
        stall = collections.Counter()
        for _, t, s in body:
            stall[opcode(t)] += s
        print(f"loop {body[0][0]:#x}-{body[-1][0]:#x}: {len(body)} instructions, stall sum "
              f"{sum(s for _, _, s in body)}")
        print("  mix:  ", ", ".join(f"{k} {v}" for k, v in mix.most_common(a.top)))
        print("  stall:", ", ".join(f"{k} {v}" for k, v in stall.most_common(a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
