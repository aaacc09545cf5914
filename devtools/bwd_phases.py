"""Where a backward call's time goes outside the main kernel (GPU probe, not a test).

At S = 1k the anchor grid's backward moves the same O(T) bytes as at 16k (B * S is fixed) for
1/16 of the work: the preprocessing (delta = rowsum(dO * O), log2 LSE), the zero fill of the
float32 dQ accumulator and the dQ postprocessing (un-permute, scale, cast) are a larger share
there. This times each piece alone, by the same functions `kernels.call.backward` runs,
beside the whole call:

    python3 -m devtools.bwd_phases --only 128:1024:0,128:4096:1 --out phases.json

`--ncu-loop N` instead runs the dispatch-level forward+backward N times (after one warm-up
call), for `ncu --metrics gpu__time_duration.sum` to list every kernel of a call; with
`--forward`, our forward and cuDNN's (kernel against kernel).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from devtools.devrun import _gpu_name, _time


def _problem_config(q, k, v, causal):
    """The BwdConfig dispatch picks for these arrays (what `kernels.call.backward` runs)."""
    from jaxflash._types import Problem
    from jaxflash.api import _prepare_abstract
    from jaxflash.dispatch import current_platform
    from jaxflash.kernels.policy import choose
    qq, kk, vv, arrays, statics, _ = _prepare_abstract(q, k, v, None, None,
                                                       implementation="cute", is_causal=causal)
    return choose.backward_config(Problem.from_arrays(qq, kk, vv, arrays, statics,
                                                      current_platform()))


def _inputs(D, S, causal):
    import jax
    import jax.numpy as jnp
    B, N = 16384 // S, 2048 // D
    ks = jax.random.split(jax.random.key(S + D + causal), 4)
    return [jax.random.normal(kk, (B, S, N, D), jnp.float32).astype(jnp.bfloat16) for kk in ks]


def phases(out_path: str, only) -> None:
    import jax
    import jax.numpy as jnp
    import jaxflash
    from jaxflash.kernels.call import bwd_finish, bwd_prepare
    from jaxflash.kernels.variants.bwd_launch import dq_acc_shape, padded_len
    rows = []
    for (D, S, causal) in only:
        q, k, v, do = _inputs(D, S, causal)
        B, T, N, H = q.shape
        scale = 1.0 / np.sqrt(D)
        cfg = _problem_config(q, k, v, causal)
        f = lambda q, k, v: jaxflash.flash_attention(  # noqa: E731
            q, k, v, scale=scale, is_causal=causal, implementation="cute")
        g = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
        fr = jax.jit(lambda q, k, v: jaxflash.flash_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="cute", return_residual=True))
        out, lse = fr(q, k, v)
        lse = lse.transpose(0, 2, 1)  # the API's [B, T, N] -> the kernel's [B, N, T]
        Tp = padded_len(T, cfg)
        shape = dq_acc_shape(B, T, N, H, cfg)
        acc = jax.random.normal(jax.random.key(7), shape, jnp.float32)
        prep = jax.jit(lambda lse, do, out: bwd_prepare(lse, do, out, None, Tp))
        fin = jax.jit(lambda a: bwd_finish(a, T, cfg, scale, q.dtype))
        zeros = jax.jit(lambda a: jnp.zeros_like(a) + a[0, 0, 0, 0])  # a memset-sized write
        t = {"fwd": _time(jax.jit(f), (q, k, v)), "fwd_bwd": _time(g, (q, k, v, do)),
             "prepare": _time(prep, (lse, do, out)), "finish": _time(fin, (acc,)),
             "acc_fill": _time(zeros, (acc,))}
        row = {"D": D, "S": S, "causal": int(causal), "B": B, "N": N, "config": cfg.key,
               "acc_mb": int(np.prod(shape)) * 4 / 2**20}
        row.update({f"{n}_us": v * 1e6 for n, v in t.items()})
        bwd = t["fwd_bwd"] - t["fwd"]
        row["bwd_us"] = bwd * 1e6
        row["outside_share"] = (t["prepare"] + t["finish"] + t["acc_fill"]) / bwd
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                          for k, v in row.items()}), flush=True)
    with open(out_path, "w") as fh:
        json.dump({"gpu": _gpu_name(), "jax": jax.__version__, "rows": rows}, fh, indent=1)


def ncu_loop(point, n: int, forward_only: bool = False) -> None:
    """The dispatch-level forward+backward (or, `forward_only`, our forward then cuDNN's) of
    one grid point, once to warm up and n more times, for ncu to time kernel by kernel."""
    import jax
    import jaxflash
    D, S, causal = point
    q, k, v, do = _inputs(D, S, causal)
    f = lambda q, k, v: jaxflash.flash_attention(  # noqa: E731
        q, k, v, scale=1.0 / np.sqrt(D), is_causal=causal, implementation="cute")
    if forward_only:
        c = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, scale=1.0 / np.sqrt(D), is_causal=causal, implementation="cudnn")
        fns = [(jax.jit(f), (q, k, v)), (jax.jit(c), (q, k, v))]
    else:
        fns = [(jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)), (q, k, v, do))]
    for fn, args in fns:
        jax.block_until_ready(fn(*args))
    for _ in range(n):
        for fn, args in fns:
            jax.block_until_ready(fn(*args))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="128:1024:0,128:1024:1,128:4096:0")
    p.add_argument("--out", default="bwd-phases.json")
    p.add_argument("--ncu-loop", type=int, default=0)
    p.add_argument("--forward", action="store_true", help="with --ncu-loop: ours and cuDNN's")
    a = p.parse_args(argv)
    only = [tuple(int(x) for x in s.split(":")) for s in a.only.split(",") if s]
    only = [(D, S, bool(c)) for D, S, c in only]
    if a.ncu_loop:
        ncu_loop(only[0], a.ncu_loop, a.forward)
    else:
        phases(a.out, only)


if __name__ == "__main__":
    main()
