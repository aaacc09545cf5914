"""The example LM trained with bf16 attention and with FP8 attention (issue 25), and optionally
with the FP4 training attention (issue 27): same initialization, same batches, loss curves and
tokens/s, plus the dO flush fractions of FP8 casts.

    python -m benchmarks.lm_precision --out benchmarks/results            # the H200 run
    python -m benchmarks.lm_precision --preset cpu --steps 6              # a smoke run
    python -m benchmarks.lm_precision --plot benchmarks/results/lm-precision-gpu.json

Variants: ``bf16`` (attention in the compute dtype, the best backend), ``fp8``
(``flash_attention(precision="fp8")``: the FP8 kernel where one serves, else the emulated FP8
path; the JSON records which), ``fp4-e4m3`` / ``fp4-mxfp4`` (`jaxflash.fp4.training`'s
emulated FP4 attention with FP8 or MXFP4 P/V; MXFP4 P/V is the recipe that diverged in the FP4
paper, run here knowingly). Variants start in order while the time budget lasts.

Flush fractions: after training each variant, the attention output gradients dO of every layer
(one batch) are captured and the share of non-zero values an FP8 cast flushes to zero is
reported (`jaxflash.fp4.do_flush_fraction`) for E4M3 and E5M2, with per-tensor amax scaling
(the FP4 paper's setting) and with our per-block scales (128 rows per (batch, head)).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.lm import data as data_lib  # noqa: E402
from examples.lm import train as lm_train  # noqa: E402
from examples.lm.model import LMConfig, loss_fn  # noqa: E402
from jaxflash.flax import core as flax_core  # noqa: E402

PRESETS = {
    # H200: 400 steps of each variant in about a minute each (compile included).
    "gpu": dict(cfg=LMConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768,
                             seq_len=512, dtype="bfloat16"), batch=32),
    "cpu": dict(cfg=LMConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=192,
                             seq_len=128, dtype="float32"), batch=4),
}
VARIANTS = ("bf16", "fp8", "fp4-e4m3", "fp4-mxfp4")


def _fp4_attend(pv_format):
    """`jaxflash.flax.core.attend` replaced by the emulated FP4 training attention (causal,
    no other feature: the LM uses none)."""
    from jaxflash.fp4.training import fp4_training_attention

    def attend(q, k, v, opts, *, mask=None, q_segment_ids=None, kv_segment_ids=None):
        if mask is not None or q_segment_ids is not None or opts.local_window_size:
            raise NotImplementedError("the FP4 training attention serves plain causal calls")
        return fp4_training_attention(q, k, v, scale=opts.scale, causal=True,
                                      pv_format=pv_format,
                                      unstable_mxfp4_pv=pv_format == "mxfp4").astype(q.dtype)
    return attend


class _Patch:
    """Swap `jaxflash.flax.core.attend` for a variant (restored on exit)."""

    def __init__(self, fn):
        self.fn, self.saved = fn, None

    def __enter__(self):
        if self.fn is not None:
            self.saved = flax_core.attend
            flax_core.attend = self.fn

    def __exit__(self, *exc):
        if self.saved is not None:
            flax_core.attend = self.saved


def _dout_tap(record):
    """An attend wrapper whose output's cotangent (dO) is appended to `record` (host side)."""
    base = flax_core.attend

    @jax.custom_vjp
    def tap(o):
        return o

    def fwd(o):
        return o, None

    def bwd(_, g):
        jax.debug.callback(lambda x: record.append(np.asarray(x, np.float32)), g)
        return (g,)

    tap.defvjp(fwd, bwd)

    def attend(q, k, v, opts, **kw):
        return tap(base(q, k, v, opts, **kw))
    return attend


def _flush(douts):
    from jaxflash.fp4 import do_flush_fraction
    out = {}
    for fmt in ("e4m3", "e5m2"):
        per_tensor = [float(do_flush_fraction(d, fmt)) for d in douts]
        blocks = []
        for d in douts:  # [B, T, N, D] -> [B, N, T/128, 128, D]: per (batch, head, 128 rows)
            B, T, N, D = d.shape
            r = 128 if T % 128 == 0 else T
            x = d.transpose(0, 2, 1, 3).reshape(B, N, T // r, r, D)
            blocks.append(float(do_flush_fraction(x, fmt, scale_axes=(3, 4))))
        out[fmt] = dict(per_tensor=float(np.mean(per_tensor)), per_block=float(np.mean(blocks)),
                        per_layer_per_tensor=per_tensor)
    return out


def run_variant(name, cfg: LMConfig, args):
    cfg = dataclasses.replace(cfg, attention_precision="fp8" if name == "fp8" else None)
    patch = _fp4_attend(name.split("-")[1]) if name.startswith("fp4") else None
    mesh = lm_train.make_mesh("1,1")
    ns = argparse.Namespace(lr=args.lr, warmup=args.warmup, steps=args.steps,
                            weight_decay=0.1)
    tx = lm_train.make_optimizer(ns)
    train_tokens, val_tokens = data_lib.load_tokens()
    with _Patch(patch):
        graphdef, params, opt_state = lm_train.init_state(cfg, mesh, tx, args.seed)
        state_sh = (jax.tree.map(lambda x: x.sharding, params),
                    jax.tree.map(lambda x: x.sharding, opt_state))
        batch_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
        step_fn = lm_train.make_train_step(graphdef, tx, state_sh, batch_sh)
        backend = (lm_train.describe_backend(cfg, args.batch, mesh) if patch is None else
                   f"jaxflash.fp4.training.fp4_training_attention (emulated), P/V "
                   f"{name.split('-')[1]}")
        losses, t_train, t0_all = [], 0.0, time.perf_counter()
        for step in range(1, args.steps + 1):
            batch = jax.device_put(data_lib.batch(train_tokens, step, args.batch, cfg.seq_len,
                                                  args.seed), batch_sh)
            t0 = time.perf_counter()
            params, opt_state, loss = step_fn(params, opt_state, batch)
            loss = float(loss)
            if step > 1:
                t_train += time.perf_counter() - t0
            losses.append(loss)
            if not np.isfinite(loss):
                break
        wall = time.perf_counter() - t0_all
        model = jax.tree.map(lambda x: x, (graphdef, params))
        from flax import nnx
        m = nnx.merge(*model)
        vb = jnp.asarray(data_lib.batch(val_tokens, 0, args.batch, cfg.seq_len, args.seed + 1))
        val = float(jax.jit(loss_fn)(m, vb))
    # dO of every layer for one batch, with the variant's attention.
    douts = []
    with _Patch(patch):
        tapped = _dout_tap(douts)
        with _Patch(tapped):
            g = jax.jit(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), vb)))(params)
            jax.block_until_ready(g)
    tok = (len(losses) - 1) * args.batch * cfg.seq_len
    return dict(variant=name, backend=backend, losses=losses, val_loss=val,
                tokens_per_s=tok / t_train if t_train else None, wall_s=wall,
                flush=_flush(douts) if douts else None)


def lower_programs(names=("bf16", "fp8")):
    """Trace (never run) the gpu preset's train step and its gradient for each variant, so
    `tests.collect_variants --lower benchmarks.lm_precision:lower_programs` records the
    kernels an H200 run reaches and builds them here (the GPU machine has no CuTe DSL)."""
    from flax import nnx
    base = PRESETS["gpu"]
    for name in names:
        cfg = dataclasses.replace(base["cfg"],
                                  attention_precision="fp8" if name == "fp8" else None)
        mesh = lm_train.make_mesh("1,1")
        ns = argparse.Namespace(lr=1e-3, warmup=10, steps=10, weight_decay=0.1)
        tx = lm_train.make_optimizer(ns)
        graphdef, params, opt_state = lm_train.init_state(cfg, mesh, tx, 0)
        state_sh = (jax.tree.map(lambda x: x.sharding, params),
                    jax.tree.map(lambda x: x.sharding, opt_state))
        batch_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
        step_fn = lm_train.make_train_step(graphdef, tx, state_sh, batch_sh)
        batch = jax.ShapeDtypeStruct((base["batch"], cfg.seq_len + 1), jnp.int32)
        step_fn.trace(params, opt_state, batch).lower(lowering_platforms=("cuda",))
        vb = jax.ShapeDtypeStruct((base["batch"], cfg.seq_len + 1), jnp.int32)
        jax.jit(jax.grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), b))).trace(
            params, vb).lower(lowering_platforms=("cuda",))


def environment():
    from benchmarks.fp8_accuracy import environment as env
    return env()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="default: gpu on a GPU, else cpu")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="start no further variant after this many seconds")
    ap.add_argument("--out", default=None, help="folder for lm-precision-<backend>.json/.md")
    ap.add_argument("--plot", default=None, help="only write the PNG (and md) of this JSON")
    a = ap.parse_args(argv)
    if a.plot:
        res = json.loads(open(a.plot).read())
        stem = a.plot[:-5]
        plot(res, stem + ".png")
        open(stem + ".md", "w").write(markdown(res))
        return res
    preset = a.preset or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    cfg, a.batch = PRESETS[preset]["cfg"], a.batch or PRESETS[preset]["batch"]
    t0, rows, skipped = time.perf_counter(), [], []
    for name in a.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {VARIANTS}")
        if time.perf_counter() - t0 > a.budget_s:
            skipped.append(name)
            continue
        r = run_variant(name, cfg, a)
        rows.append(r)
        print(f"{name:10s} final loss {r['losses'][-1]:.4f}  val {r['val_loss']:.4f}  "
              f"{(r['tokens_per_s'] or 0):,.0f} tok/s  wall {r['wall_s']:.0f}s", flush=True)
    base = next((r for r in rows if r["variant"] == "bf16"), None)
    if base:
        for r in rows:
            r["final_loss_vs_bf16"] = r["losses"][-1] / base["losses"][-1] - 1.0
    res = dict(preset=preset, config=dataclasses.asdict(cfg), batch=a.batch, steps=a.steps,
               lr=a.lr, seed=a.seed, env=environment(), rows=rows, skipped=skipped)
    print(json.dumps({r["variant"]: dict(final=r["losses"][-1],
                                         vs_bf16=r.get("final_loss_vs_bf16"),
                                         flush=r["flush"] and {f: (v["per_tensor"], v["per_block"])
                                                               for f, v in r["flush"].items()})
                      for r in rows}, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, f"lm-precision-{jax.default_backend()}")
        open(stem + ".json", "w").write(json.dumps(res, indent=1))
        open(stem + ".md", "w").write(markdown(res))
        try:
            plot(res, stem + ".png")
        except ImportError:
            print("matplotlib missing: run --plot on the JSON elsewhere")
    return res


def _smooth(x, k=10):
    x = np.asarray(x, np.float64)
    if len(x) < k:
        return x
    return np.convolve(x, np.ones(k) / k, mode="valid")


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in res["rows"]:
        y = _smooth(r["losses"])
        ax.plot(np.arange(len(y)) + 1, y, label=f"{r['variant']} (final {r['losses'][-1]:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title(f"example LM, attention precision ({res['env']['backend']}, "
                 f"{res['env']['date'][:10]})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(res):
    e, c = res["env"], res["config"]
    lines = [f"# Example LM: bf16 vs FP8 (and FP4) attention ({e['backend']})", "",
             f"{res['steps']} steps, batch {res['batch']} x {c['seq_len']} tokens, d_model "
             f"{c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads "
             f"({c['n_kv_heads']} kv), compute {c['dtype']}; same init and batches (seed "
             f"{res['seed']}). {e['date']}, {e['host']}, {', '.join(e['devices'])}, jax "
             f"{e['jax']}. Command: `python -m benchmarks.lm_precision --out benchmarks/results`.",
             "", "| variant | final loss | vs bf16 | val loss | tokens/s | attention |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        vs = r.get("final_loss_vs_bf16")
        lines.append(f"| {r['variant']} | {r['losses'][-1]:.4f} | "
                     f"{'' if vs is None else f'{vs:+.2%}'} | {r['val_loss']:.4f} | "
                     f"{(r['tokens_per_s'] or 0):,.0f} | "
                     f"{r['backend'].splitlines()[0]}"
                     f"{'; emulated FP8 path' if 'emulated FP8 path' in r['backend'] else ''} |")
    lines += ["", "dO flush fractions (share of non-zero dO an FP8 cast flushes to 0; mean over "
              "layers):", "", "| variant | E4M3 per-tensor | E4M3 per-block | E5M2 per-tensor | "
              "E5M2 per-block |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        f = r.get("flush")
        if f:
            lines.append(f"| {r['variant']} | {f['e4m3']['per_tensor']:.2%} | "
                         f"{f['e4m3']['per_block']:.2%} | {f['e5m2']['per_tensor']:.2%} | "
                         f"{f['e5m2']['per_block']:.2%} |")
    if res.get("skipped"):
        lines += ["", f"Not run (time budget): {', '.join(res['skipped'])}."]
    lines += ["", "Tokens/s of an emulated path (the backend column says so) measure the "
              "emulation, not FP8 kernels.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
