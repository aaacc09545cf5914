"""PNG of a results JSON: TFLOP/s per grid point per implementation, one panel per mode, and the
small-call latency as bars.

    python -m benchmarks.plot results.json out.png
"""
from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import report  # noqa: E402

STYLE = {  # ours solid and bold, peers thinner/dashed
    "cute": dict(color="tab:red", lw=2.5, marker="o"),
    "pallas": dict(color="tab:orange", lw=2.5, marker="s"),
    "xla": dict(color="tab:brown", lw=1.5, marker="v"),
    "cudnn": dict(color="black", lw=2.0, marker="D", ls="--"),
    "pallas-triton": dict(color="tab:blue", lw=1.2, marker="^", ls="--"),
    "tokamax": dict(color="tab:green", lw=1.2, marker="P", ls="--"),
    "jax-xla": dict(color="tab:gray", lw=1.2, marker="x", ls=":"),
}


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    modes = [m for m in ("fwd", "fwdbwd") if any(r["mode"] == m for r in rows)]
    lat = [r for r in rows if r["mode"] == "latency" and r["status"] == "ok"]
    panels = len(modes) + (1 if lat else 0)
    ratios = [1.0] * len(modes) + ([0.55] if lat else [])
    fig, axes = plt.subplots(panels or 1, 1, figsize=(13, 4.2 * sum(ratios or [1])),
                             squeeze=False, gridspec_kw={"height_ratios": ratios or [1]})
    axes = list(axes[:, 0])
    env = data["env"]
    for ax, mode in zip(axes, modes):
        pts = report._points(rows, mode)
        idx = report._index(rows)
        x = list(range(len(pts)))
        for name in report._impls([r for r in rows if r["mode"] == mode]):
            ys = []
            for (D, S, c) in pts:
                r = idx.get((name, mode, D, S, c))
                ys.append(r["tflops"] if r is not None and r["status"] == "ok" else float("nan"))
            if all(y != y for y in ys):  # nothing measured
                continue
            ax.plot(x, ys, label=name, **STYLE.get(name, {}))
        ax.set_xticks(x)
        ax.set_xticklabels([f"D{D}\nS{S // 1024}k\n{'causal' if c else ''}" if S >= 1024
                            else f"D{D}\nS{S}\n{'causal' if c else ''}" for (D, S, c) in pts],
                           fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(f"{report.MODE_TITLE[mode]}, bf16 — {env.get('device')}, "
                     f"jax {env.get('jax')}, cuDNN {env.get('cudnn')}, {env.get('date_utc')}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, ncol=4, loc="lower right")
    if lat:
        ax = axes[len(modes)]
        names = [r["impl"] for r in lat]
        ax.bar(names, [r["ms"] * 1e3 for r in lat],
               color=[STYLE.get(n, {}).get("color", "tab:gray") for n in names])
        ax.set_ylabel("µs per call (median)")
        ax.set_title("small call B=1, N=1, T=S=128, D=64: wall time per call, dispatch included")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
