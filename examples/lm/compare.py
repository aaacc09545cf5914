"""Train the example LM from the same initialization and the same batches with one or more
jaxflash backends (``--candidate auto,cute,pallas``; default: the best available) and once with
``implementation="xla"`` (the float32 reference), and report every loss curve, the validation
losses and tokens/s. Writes ``<out>/lm_compare.json`` (and ``lm_compare.png`` when
matplotlib is present).

    python -m examples.lm.compare --out /tmp/cmp                      # CPU: small and short
    python -m examples.lm.compare --out $OUT --size full --steps 400 --batch 16 --mesh 1,1 \
        --candidate cute --baseline-runs 2                                              # GPU

Every other flag is the training script's (see ``python -m examples.lm.train --help``). Passes
(exit 0) when every candidate's final loss is within ``--rtol`` (default 1%) of the baseline's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
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
    p.add_argument("--candidate", default="auto",
                   help="backend(s) under test, comma-separated: auto (best available), cute, "
                        "pallas (default auto); each is compared with one 'xla' baseline run")
    p.add_argument("--rtol", type=float, default=0.01)
    p.add_argument("--xla-deterministic", action="store_true",
                   help="set XLA_FLAGS=--xla_gpu_deterministic_ops=true before JAX starts (the "
                        "xla baseline did not reproduce itself on the H200 without it; not yet "
                        "run there with it)")
    p.add_argument("--baseline-runs", type=int, default=1,
                   help="train the xla baseline this many times: on a GPU XLA's own scatter-adds "
                        "are not deterministic, so repeats measure the run-to-run spread that "
                        "any comparison sits in")
    args, rest = p.parse_known_args(argv)
    if "--implementation" in rest:
        raise SystemExit("use --candidate for the backend under test; the baseline is 'xla'")
    if args.xla_deterministic:
        # Read when the backend starts, which no code above has triggered yet.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_deterministic_ops=true").strip()
    cands = [c.strip() for c in args.candidate.split(",") if c.strip()]
    bad = [c for c in cands if c not in ("auto", "cute", "pallas", "xla")]
    if bad or not cands:
        raise SystemExit(f"--candidate: {bad or args.candidate!r} not in auto, cute, pallas, xla")
    if not any(r.startswith("--sample") for r in rest):
        rest += ["--sample", "0"]
    # A comparison needs a training run that is not chaotic, or it measures the chaos instead of
    # the attention. With the training script's own defaults (lr 3e-3, 10 warmup steps) the loss
    # rose during warmup (steps 9-10) and two xla runs on the H200, differing only in the order
    # of XLA's float atomics, ended 5% apart after 500 steps (1.204 vs 1.142, 2026-11-30). So the
    # comparison defaults to a gentler schedule; either flag given explicitly wins.
    for flag, value in (("--lr", "1e-3"), ("--warmup", "50")):
        if not any(r == flag or r.startswith(flag + "=") for r in rest):
            rest += [flag, value]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs = {}
    repeats = [f"xla#{i + 1}" for i in range(1, args.baseline_runs)]
    for label in cands + ["xla"] + repeats:
        if label in runs:
            continue
        impl = None if label == "auto" else label.partition("#")[0]
        argv_run = rest + ([] if impl is None else ["--implementation", impl])
        print(f"=== {label}: implementation={impl!r}", flush=True)
        runs[label] = train.train(train.parse_args(argv_run))

    b = runs["xla"]
    last = str(max(int(k) for k in b["losses"]))
    compared = {}
    for label in cands:
        a = runs[label]
        fa, fb = a["losses"][last], b["losses"][last]
        compared[label] = {
            "final_loss": fa, "final_loss_rel_diff": abs(fa - fb) / abs(fb),
            "last10_mean_rel_diff": abs(_tail_mean(a["losses"]) - _tail_mean(b["losses"]))
            / abs(_tail_mean(b["losses"])),
            "val_loss": a.get("val_loss"),
            "val_loss_rel_diff": (abs(a["val_loss"] - b["val_loss"]) / abs(b["val_loss"])
                                  if a.get("val_loss") and b.get("val_loss") else None),
            "tokens_per_s": a["tokens_per_s"],
            "speedup_vs_xla": (a["tokens_per_s"] / b["tokens_per_s"]
                               if a["tokens_per_s"] and b["tokens_per_s"] else None),
            "backend": a["backend"]}
        compared[label]["pass"] = bool(compared[label]["final_loss_rel_diff"] <= args.rtol)
    result = {
        "what": "examples/lm trained from the same init and batches with jaxflash backends and "
                "with implementation='xla' (the float32 reference)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "platform": jax.devices()[0].platform, "jax": jax.__version__,
        "argv": rest, "final_step": int(last), "rtol": args.rtol,
        "xla": {"final_loss": b["losses"][last], "val_loss": b.get("val_loss"),
                "tokens_per_s": b["tokens_per_s"], "backend": b["backend"]},
        "candidates": compared, "pass": all(c["pass"] for c in compared.values()),
        "baseline_repeats": {r: {"final_loss": runs[r]["losses"][last],
                                 "final_loss_rel_diff": abs(runs[r]["losses"][last]
                                                            - b["losses"][last])
                                 / abs(b["losses"][last]),
                                 "val_loss": runs[r].get("val_loss")} for r in repeats},
        "runs": runs,
    }
    (out / "lm_compare.json").write_text(json.dumps(result, indent=1))
    _plot(runs, out / "lm_compare.png", result)
    fmt = lambda x: f"{x:,.0f}" if x else "n/a"
    print(f"xla: final loss (step {last}) {b['losses'][last]:.4f}, {fmt(b['tokens_per_s'])} tok/s")
    for label, c in compared.items():
        print(f"{label}: final loss {c['final_loss']:.4f} rel diff {c['final_loss_rel_diff']:.2%} "
              f"({'PASS' if c['pass'] else 'FAIL'} at {args.rtol:.0%}); "
              f"{fmt(c['tokens_per_s'])} tok/s"
              + (f" ({c['speedup_vs_xla']:.2f}x)" if c["speedup_vs_xla"] else ""))
    for r, c in result["baseline_repeats"].items():
        print(f"{r} (the baseline again): final loss {c['final_loss']:.4f} rel diff "
              f"{c['final_loss_rel_diff']:.2%}")
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
    for label, ls in runs.items():
        steps = sorted(ls["losses"], key=int)
        tps = ls["tokens_per_s"]
        ax.plot([int(s) for s in steps], [ls["losses"][s] for s in steps],
                "-" if label == "xla" else "--",
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
