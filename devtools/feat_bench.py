"""Forward speed of the masked calls outside the anchor grid (windows, per-batch key lengths):
the variant dispatch runs for them beside the default schedule and beside the dispatched one
with `mask_select` flipped, reps interleaved (`columns`).

The anchor grid holds plain dense / causal calls only, and `choose.schedule_for` picks only from
what was measured. This measured (two runs on the H200, 2026-12-02 ~03:58 UTC,
`benchmarks/results/h200-2026-12-02-cute-fwd-featsel{a,b}.json`) the plain calls' schedule
(persistent loop, 192-row tiles at hd 64, paired causal tiles, mask_select / mask_skip) on
these calls at 1.03-1.26x the default schedule each, so dispatch now gives it to windows and
key lengths; the columns keep that comparison for the next change.
Runs on the H200 (`python -m devtools.feat_bench --out F`; `run.sh featsel`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from jaxflash.kernels.variants.fwd import FwdConfig

B, S, N = 4, 4096, 16
_LENS = {"kv_seqlen": [4096, 3001, 2049, 1000]}
# (name, FwdConfig features, runtime extras); the query length is S everywhere.
FEAT_BENCH = [
    ("causal kv lengths hd128", dict(head_dim=128, is_causal=True, has_kv_seqlen=True), _LENS),
    ("causal kv lengths hd64", dict(head_dim=64, is_causal=True, has_kv_seqlen=True), _LENS),
    ("causal kv lengths hd256", dict(head_dim=256, is_causal=True, has_kv_seqlen=True), _LENS),
    ("causal window 1k hd128", dict(head_dim=128, is_causal=True, has_window=True),
     {"window": (1024, 0)}),
    ("window 512+512 hd128", dict(head_dim=128, has_window=True), {"window": (512, 512)}),
    ("dense kv lengths hd128", dict(head_dim=128, has_kv_seqlen=True), _LENS),
]


def _dispatched(features: dict, extras: dict) -> FwdConfig:
    """What dispatch (`choose.forward_config`, the one place that decides) runs for the call."""
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.policy.choose import forward_config
    D = features["head_dim"]
    statics = AttentionStatics(scale=D ** -0.5, is_causal=features.get("is_causal", False),
                               window=extras.get("window"))
    return forward_config(Problem(batch=B, q_len=S, kv_len=S, num_heads=N, num_kv_heads=N,
                                  head_dim=D, head_dim_v=D, dtype="bfloat16", statics=statics,
                                  has_kv_seqlen="kv_seqlen" in extras))


def columns(features: dict, extras: dict) -> dict:
    """The variants timed for one call: what dispatch runs ("dispatched"), the call's features
    with the default schedule ("default": what these calls ran before 2026-12-02), and the
    dispatched one with `mask_select` flipped ("flipped"; None where the tile refuses the
    flag: 192-row tiles have it built in)."""
    base = _dispatched(features, extras)
    cols = {"dispatched": base, "default": FwdConfig(**features)}
    try:
        cols["flipped"] = dataclasses.replace(base, mask_select=not base.mask_select)
    except ValueError:
        cols["flipped"] = None
    return cols


def feat_configs() -> list:
    """Every config `main` times (for the artifact build)."""
    return [c for _, kw, ex in FEAT_BENCH for c in columns(kw, ex).values() if c is not None]


def main(argv=None) -> None:
    import jax
    import jax.numpy as jnp

    from devtools.devrun import _gpu_name, _time_all, ours
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = []
    for name, kw, ex in FEAT_BENCH:
        cols = {n: c for n, c in columns(kw, ex).items() if c is not None}
        D = cols["dispatched"].head_dim
        ks = jax.random.split(jax.random.key(D + len(name)), 3)
        q, k, v = (jax.random.normal(kk, (B, S, N, D), jnp.float32).astype(jnp.bfloat16)
                   for kk in ks)
        kvs = jnp.asarray(ex["kv_seqlen"], jnp.int32) if "kv_seqlen" in ex else None
        scale = 1.0 / np.sqrt(D)
        fns = {n: jax.jit(lambda q, k, v, c=c: ours(q, k, v, c, scale, None, ex.get("window"),
                                                    None, kvs)[0])
               for n, c in cols.items()}
        row = {"name": name, "shape": [B, S, S, N, D], **{n: c.key for n, c in cols.items()},
               **{k_: v_ for k_, v_ in ex.items()}}
        try:
            outs = {n: np.asarray(f(q, k, v).astype(jnp.float32)) for n, f in fns.items()}
            # recorded, not required: the columns differ in tiles, and so may in rounding
            row["bitwise_equal"] = {n: bool(np.array_equal(o, outs["dispatched"]))
                                    for n, o in outs.items() if n != "dispatched"}
            row["nan"] = int(sum(np.isnan(o).sum() for o in outs.values()))
            ts = _time_all(fns, (q, k, v))
            row.update({f"{n}_ms": t * 1e3 for n, t in ts.items()})
            row.update({f"{n}_speedup": ts["dispatched"] / t for n, t in ts.items()
                        if n != "dispatched"})
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"gpu": _gpu_name(), "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
