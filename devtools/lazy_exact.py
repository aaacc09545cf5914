"""Device check that `FwdConfig.lazy_rescale` (threshold 0) changes no bit of the output: the
same inputs through the kernel with and without it, O and LSE compared bitwise (plain random
inputs and keys ramped so rows raise their max block after block). Run on the GPU:
``python3 -m devtools.lazy_exact --out FILE``."""
from __future__ import annotations

import argparse
import json

import numpy as np

from jaxflash.kernels.variants.fwd import FwdConfig

CASES = [  # (config kwargs without lazy_rescale, (B, T, S, N, K), extras)
    (dict(head_dim=64, tile_m=192, persistent=True), (4, 1000, 1100, 12, 4), {}),
    (dict(head_dim=64, tile_m=192, persistent=True, is_causal=True, wg_epilogue=True),
     (4, 1000, 1000, 8, 8), {"k_ramp": 5.0}),
    (dict(head_dim=128, is_causal=True), (2, 2048, 2048, 8, 2), {"k_ramp": 4.0}),
    (dict(head_dim=128, persistent=True, tile_pipe=True, wg_epilogue=True), (2, 1000, 1111, 12, 4),
     {}),
    (dict(head_dim=256), (2, 700, 900, 8, 4), {"k_ramp": 4.0}),
    (dict(head_dim=128, dtype="float16"), (1, 4096, 4096, 4, 4), {}),
]


def configs():
    """Every variant `main` runs (devrun's build compiles them with the rest)."""
    return [FwdConfig(**kw, lazy_rescale=lz) for kw, _, _ in CASES for lz in (False, True)]


def main(argv=None):
    import jax.numpy as jnp
    from devtools.devrun import fresh_inputs, ours
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows, ok = [], True
    for kw, (B, T, S, N, K), ex in CASES:
        base = FwdConfig(**kw)
        lazy = FwdConfig(**kw, lazy_rescale=True)
        q, k, v, _, _, _ = fresh_inputs(B, T, S, N, K, base.head_dim, base.dtype, ex)
        scale = 1.0 / np.sqrt(base.head_dim)
        o0, l0 = (np.asarray(x.astype(jnp.float32)) for x in ours(q, k, v, base, scale))
        o1, l1 = (np.asarray(x.astype(jnp.float32)) for x in ours(q, k, v, lazy, scale))
        same = bool(np.array_equal(o0, o1, equal_nan=True) and np.array_equal(l0, l1,
                                                                             equal_nan=True))
        row = {"config": lazy.key, "shape": [B, T, S, N, K], "extras": ex, "bitwise_equal": same,
               "max_abs_diff": float(np.nanmax(np.abs(o0 - o1))), "nan": int(np.isnan(o1).sum())}
        print(json.dumps(row), flush=True)
        rows.append(row)
        ok = ok and same and row["nan"] == 0
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "ok": ok}, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
