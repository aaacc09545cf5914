"""The P path's instruction budget: our sm_100a FP4 Direct-P forward beside FlashAttention-4's
bf16 forward, both compiled here (static SASS counts, by op class).

    python -m devtools.fp4_sass_budget LABEL=DIR[:SITES] ...

DIR holds one *.cubin (ours: ``DUMP=DIR python -m devtools.sm100_fp4_compile fast 128``;
FlashAttention-4's: the shared compile-only recipe with CUTE_DSL_KEEP=cubin). SITES (optional)
is how many copies of the per-tile softmax step the binary holds (ours: 2, the loop body and
the last tile); with it the table adds per-tile and per-score-pair columns (128 rows x 128 keys
a tile; per row 64 score pairs). Needs nvdisasm and cuobjdump ($NVDISASM / $CUOBJDUMP or PATH).
"""
from __future__ import annotations

import collections
import glob
import os
import re
import subprocess
import sys

from devtools.sm100_sass_table import _OP, tool

CLASSES = (
    ("FFMA2", lambda k: k == "FFMA2"),
    ("F2FP E2M1", lambda k: k.startswith("F2FP") and "E2M1" in k),
    ("F2FP BF16", lambda k: k.startswith("F2FP") and "BF16" in k),
    ("MUFU.EX2", lambda k: k == "MUFU.EX2"),
    ("FADD2", lambda k: k.startswith("FADD2")),
    ("FMNMX", lambda k: k.startswith("FMNMX")),
    ("IDP.4A", lambda k: k.startswith("IDP.4A")),
    ("PRMT", lambda k: k == "PRMT"),
    ("LDTM", lambda k: k.startswith("LDTM")),
    ("STTM", lambda k: k.startswith("STTM")),
    ("UTCCP", lambda k: k.startswith("UTCCP")),
    ("MMA", lambda k: bool(re.match(r"UTC\w*MMA", k))),
)


def counts(cubin: str) -> dict:
    sass = subprocess.run([tool("nvdisasm"), cubin], capture_output=True, text=True,
                          check=True).stdout
    ops = collections.Counter(_OP.findall(sass))
    res = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", cubin],
                         capture_output=True, text=True, check=True).stdout
    out = {name: sum(v for k, v in ops.items() if pred(k)) for name, pred in CLASSES}
    out["MMA kinds"] = ",".join(sorted(k for k in ops if re.match(r"UTC\w*MMA", k)))
    m = re.search(r"REG:(\d+)", res)
    out["REG"] = int(m.group(1)) if m else -1
    out["instructions"] = sum(ops.values())
    return out


def main(args) -> None:
    cols = [c for c, _ in CLASSES] + ["MMA kinds", "REG", "instructions"]
    print("| build | " + " | ".join(cols) + " | per tile: FFMA2 / F2FP / EX2 / IDP.4A "
          "| per score pair |")
    print("|---|" + "---|" * (len(cols) + 2))
    for arg in args:
        label, _, rest = arg.partition("=")
        d, _, sites = rest.partition(":")
        cubin = sorted(glob.glob(os.path.join(d, "*.cubin")))[0]
        c = counts(cubin)
        tile = pair = "-"
        if sites:
            n = int(sites)
            f2 = c["F2FP E2M1"] or c["F2FP BF16"]
            tile = f"{c['FFMA2'] / n:g} / {f2 / n:g} / {c['MUFU.EX2'] / n:g} / {c['IDP.4A'] / n:g}"
            pair = (f"{c['FFMA2'] / n / 64:g} FFMA2, {f2 / n / 64:g} F2FP, "
                    f"{c['MUFU.EX2'] / n / 64:g} EX2")
        print(f"| {label} | " + " | ".join(str(c[k]) for k in cols) + f" | {tile} | {pair} |")


if __name__ == "__main__":
    main(sys.argv[1:])
