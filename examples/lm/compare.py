"""Train the example LM twice from the same initialization and the same batches, once with the
default jaxflash backend and once with ``implementation="xla"`` (the reference), and report both
loss curves and tokens/s. Writes ``<out>/lm_compare.json`` (and ``lm_compare.png`` when
matplotlib is present).

    python -m examples.lm.compare --out /tmp/cmp                      # CPU: small and short
    python -m examples.lm.compare --out $OUT --size full --steps 300 --batch 16 --mesh 1,1  # GPU

Every other flag is the training script's (see ``python -m examples.lm.train --help``). Passes
(exit 0) when the final losses agree within ``--rtol`` (default 1%).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax
import numpy as np

from examples.lm import train


def _tail_mean(losses: dict, n: int = 10) -> float:
    vals = [losses[k] for k in sorted(losses, key=int)]
    return float(np.mean(vals[-n:]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for lm_compare.json (created)")
    p.add_argument("--candidate", default=None, choices=[None, "cute", "pallas", "xla"],
                   help="backend under test (default: best available)")
    p.add_argument("--rtol", type=float, default=0.01)
    args, rest = p.parse_known_args(argv)
    if "--implementation" in rest:
        raise SystemExit("use --candidate for the backend under test; the baseline is 'xla'")
    if not any(r.startswith("--sample") for r in rest):
        rest += ["--sample", "0"]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs = {}
    for label, impl in (("jaxflash", args.candidate), ("xla", "xla")):
        argv_run = rest + ([] if impl is None else ["--implementation", impl])
        print(f"=== {label}: implementation={impl!r}", flush=True)
        runs[label] = train.train(train.parse_args(argv_run))

    a, b = runs["jaxflash"], runs["xla"]
    last = str(max(int(k) for k in a["losses"]))
    fa, fb = a["losses"][last], b["losses"][last]
    rel = abs(fa - fb) / abs(fb)
    rel_tail = abs(_tail_mean(a["losses"]) - _tail_mean(b["losses"])) / abs(
        _tail_mean(b["losses"]))
    speedup = (a["tokens_per_s"] / b["tokens_per_s"]
               if a["tokens_per_s"] and b["tokens_per_s"] else None)
    result = {
        "what": "examples/lm trained from the same init and batches with two jaxflash backends",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "platform": jax.devices()[0].platform, "jax": jax.__version__,
        "argv": rest, "final_step": int(last),
        "final_loss": {"jaxflash": fa, "xla": fb}, "final_loss_rel_diff": rel,
        "last10_mean_rel_diff": rel_tail, "rtol": args.rtol, "pass": bool(rel <= args.rtol),
        "tokens_per_s": {"jaxflash": a["tokens_per_s"], "xla": b["tokens_per_s"]},
        "speedup_vs_xla": speedup,
        "backend": {"jaxflash": a["backend"], "xla": b["backend"]},
        "runs": runs,
    }
    (out / "lm_compare.json").write_text(json.dumps(result, indent=1))
    _plot(runs, out / "lm_compare.png", result)
    ts = result["tokens_per_s"]
    fmt = lambda x: f"{x:,.0f}" if x else "n/a"
    print(f"final loss (step {last}): jaxflash {fa:.4f}  xla {fb:.4f}  rel diff {rel:.2%} "
          f"({'PASS' if result['pass'] else 'FAIL'} at {args.rtol:.0%})")
    print(f"tokens/s: jaxflash {fmt(ts['jaxflash'])}  xla {fmt(ts['xla'])}"
          + (f"  ({speedup:.2f}x)" if speedup else ""))
    print(f"wrote {out / 'lm_compare.json'}")
    return 0 if result["pass"] else 1


def _plot(runs, path, result):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, style in (("xla", "-"), ("jaxflash", "--")):
        ls = runs[label]["losses"]
        steps = sorted(ls, key=int)
        tps = result["tokens_per_s"][label]
        ax.plot([int(s) for s in steps], [ls[s] for s in steps], style,
                label=f"{label} ({tps:,.0f} tok/s)" if tps else label)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title(f"examples/lm on {result['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
