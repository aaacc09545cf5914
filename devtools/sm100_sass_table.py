"""Side-by-side SASS counts: our sm_100a kernels vs FlashAttention-4's, both compiled here.

    python -m devtools.sm100_sass_table OURS_DIR FA4_DIR ...   (dirs holding *.cubin [+ *.ptx])

Our cubins come from `devtools.sm100_compile` / `devtools.sm100_bwd_compile` (DUMP=<dir>);
FlashAttention-4's from the shared
compile-only recipe (`anchors/blackwell/fa4_fake_compile.py` with CUTE_DSL_KEEP=ptx,cubin and
CUTE_DSL_DUMP_DIR). Counts are *static* (instructions in the binary), per kernel: registers and
stack / local bytes (cuobjdump), MMAs (UTCHMMA / UTCQMMA, 2-CTA marked), MUFU.EX2, FFMA2,
FADD2.RM (the polynomial exp2's split), LDTM / STTM, bulk reduce-adds (UTMAREDG / UBLKRED: the
backward's dQ), and the total. Needs nvdisasm and cuobjdump
($NVDISASM / $CUOBJDUMP or PATH).
"""
from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess
import sys

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def tool(name: str) -> str:
    path = os.environ.get(name.upper()) or shutil.which(name)
    if not path:
        raise SystemExit(f"{name} not found (set ${name.upper()})")
    return path


def summarize(cubin: str) -> dict:
    sass = subprocess.run([tool("nvdisasm"), cubin], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", cubin],
                         capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(_OP.findall(sass))
    num = lambda k: int(m.group(1)) if (m := re.search(rf"{k}:(\d+)", res)) else -1
    mma = {k: v for k, v in ops.items() if re.match(r"UTC\w*MMA", k)}
    return {"REG": num("REG"), "STACK": num("STACK"), "LOCAL": num("LOCAL"),
            "MMA": sum(mma.values()), "MMA kinds": ",".join(sorted(mma)),
            "MUFU.EX2": ops["MUFU.EX2"], "FFMA2": ops["FFMA2"], "FADD2.RM": ops["FADD2.RM"],
            "LDTM": sum(v for k, v in ops.items() if k.startswith("LDTM")),
            "STTM": sum(v for k, v in ops.items() if k.startswith("STTM")),
            "REDUCE": sum(v for k, v in ops.items() if k.startswith(("UTMAREDG", "UBLKRED"))),
            "instructions": sum(ops.values())}


def main(dirs) -> None:
    cols = ["REG", "STACK", "LOCAL", "MMA", "MMA kinds", "MUFU.EX2", "FFMA2", "FADD2.RM",
            "LDTM", "STTM", "REDUCE", "instructions"]
    print("| build | kernel | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for d in dirs:
        for cubin in sorted(glob.glob(os.path.join(d, "*.cubin"))):
            s = summarize(cubin)
            name = os.path.basename(cubin)
            short = re.sub(r"_object_at_.*|cutlass___call___", "", name)[:48]
            print(f"| {os.path.basename(d.rstrip('/'))} | {short} | "
                  + " | ".join(str(s[c]) for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
