"""One screen from a device run's check / bench JSON files (devrun, bwd_devrun), so a run's
output tail says what passed and what won without fetching the files first.

    python3 -m benchmarks.device.summarize FILE.json...

Check files: the case count, every failing case, the error / cuDNN range. Bench files: per point
the ratio to cuDNN and every variant column's ratio (forward) or speedup over the default
(backward; > 1 = the variant is faster).
"""
from __future__ import annotations

import json
import sys


def _rows(path):
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, list) else data.get("rows", [])


def summarize(path: str) -> None:
    rows = _rows(path)
    print(f"== {path}: {len(rows)} rows")
    if rows and "name" in rows[0]:  # a check file
        bad = [r["name"] for r in rows if not r.get("ok")]
        print("  failed:", bad or "none")
        ratios = [r[k] for r in rows for k in r
                  if (k.startswith("ratio_") or k == "error_vs_cudnn") and r[k] is not None]
        if ratios:
            print(f"  error / cuDNN's: {min(ratios):.3f}-{max(ratios):.3f}")
        return
    for r in rows:
        if "D" not in r:
            print("  ", {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()})
            continue
        extra = {k.replace("_ratio", "").replace("_speedup", "+"): round(v, 3)
                 for k, v in r.items()
                 if isinstance(v, float) and (k.endswith("_ratio") or k.endswith("_speedup"))}
        print(f"  D{r['D']} S{r['S']} c{r['causal']}: {r.get('ratio', float('nan')):.3f} "
              f"({r.get('ours_tflops', 0):.0f} vs {r.get('cudnn_tflops', 0):.0f})", extra)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        try:
            summarize(p)
        except (OSError, ValueError, KeyError) as e:
            print(f"== {p}: unreadable ({e})")
