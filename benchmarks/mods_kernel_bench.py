"""Mods in the CuTe kernels against the built-ins they reproduce, and the block-sparse mods'
throughput over the tiles they compute, on one GPU.

    python -m benchmarks.mods_kernel_bench --out mods-kernel-bench.json [--only causal,document]
    python -m benchmarks.mods_kernel_bench --ceiling --out ceiling.json  # short dense loops
    python -m benchmarks.mods_kernel_bench --build DIR   # (CuTe DSL machine) build the variants

Pairs (bf16, head dim 128, B x S = 16k tokens, 16 heads; forward, and forward + backward),
each timed interleaved with its built-in (`benchmarks.timing.time_interleaved`):

- causal as a mask_mod vs ``is_causal`` (S = 4k, 16k);
- sliding window 1024 as a mask_mod vs ``local_window_size=(1024, 0)`` (S = 16k, causal);
- softcap 30 as a score_mod vs ``softcap=30`` (S = 8k, causal);
- ALiBi as a score_mod (slopes as aux) vs ``alibi_slopes`` (S = 8k, causal).
  Target: the mod within 5% of the built-in.

Sparse: document masking (8 random-length documents per 16k sequence; also with the documents
starting on tile boundaries) and the 1024 window:
TFLOP/s counted over the tiles the kernel visits (the block table's visible tiles, 4 x tm x tn
x D flops each forward) against the dense kernel's TFLOP/s. Target: >= 85%.

Ceiling (``--ceiling``): a sparse row visits few tiles (the 1024 window: 9 of 128-key tiles),
so its loop is as short as a short dense sequence's. The dense forward at short key lengths
(B x S = 16k tokens) against 16k, ours and cuDNN's, and cuDNN's own windowed kernel against its
dense one, say what the >= 85% target asks of a short loop.

The mod variants are pending GPU checks: run with ``JAXFLASH_CUTE_UNVERIFIED=1`` (set here).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

os.environ.setdefault("JAXFLASH_CUTE_UNVERIFIED", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxflash  # noqa: E402
from jaxflash import mods  # noqa: E402
from jaxflash.mods import library as L  # noqa: E402

TOKENS, HEADS, D = 16384, 16, 128


def _docs(rng, B, S, n, align=1):
    cuts = [np.sort(rng.choice(np.arange(align, S, align), n - 1, replace=False))
            for _ in range(B)]
    return jnp.asarray(np.stack([np.searchsorted(c, np.arange(S), side="right")
                                 for c in cuts]).astype(np.int32))


def cases(rng):
    """name -> (S, built-in kwargs or None, mod kwargs, sparse: whether to count tiles)."""
    slopes = L.alibi_slopes(HEADS)
    docs = _docs(rng, 1, 16384, 8)
    return {
        "causal-4k": (4096, dict(is_causal=True), dict(mask_mod=L.causal()), False),
        "causal-16k": (16384, dict(is_causal=True), dict(mask_mod=L.causal()), False),
        "window-16k": (16384, dict(is_causal=True, local_window_size=(1024, 0)),
                       dict(mask_mod=L.sliding_window(1024, 0)), True),
        "softcap-8k": (8192, dict(is_causal=True, softcap=30.0),
                       dict(is_causal=True, score_mod=L.softcap(30.0)), False),
        "alibi-8k": (8192, dict(is_causal=True, alibi_slopes=slopes),
                     dict(is_causal=True, score_mod=L.alibi(), aux=(slopes,)), False),
        "document-16k": (16384, None, dict(mask_mod=L.document(), aux=(docs,)), True),
        # documents starting on tile boundaries: no partial tile, what the mask evaluation of
        # the boundary tiles costs the row above
        "document-aligned-16k": (16384, None,
                                 dict(mask_mod=L.document(),
                                      aux=(_docs(rng, 1, 16384, 8, align=128),)), True),
    }


def _fns(S, kw):
    B = TOKENS // S

    def fwd(q, k, v):
        return jaxflash.flash_attention(q, k, v, implementation="cute", **kw)

    def fwdbwd(q, k, v):
        return jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))(q, k, v)

    return B, jax.jit(fwd), jax.jit(fwdbwd)


# Forward schedules tried on the sparse calls (``--schedules``): the default grid, and the
# persistent loops that won on short dense key loops (`choose.schedule_for`'s list): a window or
# a block-sparse row visits as few tiles as a short dense sequence does.
SCHEDULES = {
    "default": None,
    "ps_tp": {"persistent": True, "tile_pipe": True},
    "ps_tp_we": {"persistent": True, "tile_pipe": True, "wg_epilogue": True},
    "ps_tp_pairs": {"persistent": True, "tile_pipe": True, "tile_order": "pairs"},
}


@contextlib.contextmanager
def forced_schedule(sched):
    """Every forward traced inside takes ``sched`` (plus the causal select, as the policy adds)
    instead of `choose.schedule_for`'s pick."""
    from jaxflash.kernels.policy import choose
    if sched is None:
        yield
        return
    orig = choose.schedule_for

    def fixed(head_dim, kv_len, causal, plain=True, softcap=False):
        return {**sched, **({"mask_select": True} if causal else {})}

    choose.schedule_for = fixed
    try:
        yield
    finally:
        choose.schedule_for = orig


def schedule_calls(rng):
    """(case, call kwargs, S, schedule names, the mask_mod's kwargs) of the schedule comparison: the window as built-in
    and as a mask_mod with its BlockMask, the documents with theirs, causal 16k as a mask_mod
    (a dense-ish table: where the default grid should keep winning)."""
    c = cases(rng)
    out = []
    for name, form in (("window-16k", "builtin"), ("window-16k", "modbm"),
                       ("document-16k", "modbm"), ("causal-16k", "mod")):
        S, builtin, mod, _ = c[name]
        kw = builtin if form == "builtin" else dict(mod)
        if form == "modbm":
            kw["block_mask"] = mods.create_block_mask(mod["mask_mod"], TOKENS // S, 1, S, S,
                                                      block=(128, 128), aux=mod.get("aux", ()))
        causal = bool(kw.get("is_causal"))
        names = [n for n in SCHEDULES if causal or n != "ps_tp_pairs"]
        out.append((f"{name}/{form}", kw, S, names, mod))
    return out


def run_schedules(rng):
    """Forward time of each sparse call under each schedule, interleaved with the dense
    kernel; TFLOP/s over the visited tiles as `main` counts them."""
    from benchmarks.timing import time_interleaved
    rows = []
    for case, kw, S, names, mask_kw in schedule_calls(rng):
        B = TOKENS // S
        x = jnp.asarray(rng.standard_normal((B, S, HEADS, D)).astype(np.float32), jnp.bfloat16)
        fns = {}
        for n in names:
            with forced_schedule(SCHEDULES[n]):
                fns[n] = _fns(S, kw)[1].lower(x, x, x).compile()
        fns["dense"] = _fns(S, {})[1].lower(x, x, x).compile()
        t = time_interleaved(fns, (x, x, x))
        tiles = visible_tiles(S, mask_kw)
        flops, dense_flops = 4.0 * 128 * 128 * D * tiles, 4.0 * S * S * D * B * HEADS
        dense_tf = dense_flops / t["dense"].median_s / 1e12
        row = {"case": case, "S": S, "B": B, "dense_fwd_ms": t["dense"].median_s * 1e3,
               "visible_tile_fraction": tiles / (B * HEADS * (S // 128) ** 2)}
        for n in names:
            tf = flops / t[n].median_s / 1e12
            row[n] = {"fwd_ms": t[n].median_s * 1e3, "sparse_over_dense_fwd": tf / dense_tf}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


CEILING_S = (1024, 1152, 2048, 16384)


def _cudnn(**kw):
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                                                **kw))


def run_ceiling(rng):
    """Dense forward TFLOP/s at short key loops over 16k's, ours and cuDNN's; the window 1024
    at 16k, ours built in and cuDNN's native, over the same visited tiles."""
    from benchmarks.timing import time_interleaved
    rows = []
    for S in CEILING_S:
        B = TOKENS // S
        x = jnp.asarray(rng.standard_normal((B, S, HEADS, D)).astype(np.float32), jnp.bfloat16)
        fns = {"ours": _fns(S, {})[1], "cudnn": _cudnn()}
        if S == 16384:
            win = dict(is_causal=True, local_window_size=(1024, 0))
            fns.update(ours_window=_fns(S, win)[1], cudnn_window=_cudnn(**win))
        t = time_interleaved(fns, (x, x, x))
        flops = 4.0 * S * S * D * B * HEADS
        row = {"S": S, "B": B, "key_tiles": S // 128,
               **{f"{k}_ms": v.median_s * 1e3 for k, v in t.items()},
               **{f"{k}_tflops": flops / t[k].median_s / 1e12 for k in ("ours", "cudnn")}}
        if S == 16384:
            tiles = visible_tiles(S, dict(mask_mod=L.sliding_window(1024, 0)))
            wflops = 4.0 * 128 * 128 * D * tiles
            for k in ("ours", "cudnn"):
                row[f"{k}_window_tiles_tflops"] = wflops / t[f"{k}_window"].median_s / 1e12
                row[f"{k}_window_over_dense"] = row[f"{k}_window_tiles_tflops"] / row[f"{k}_tflops"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    long_ = rows[-1]
    for r in rows:
        for k in ("ours", "cudnn"):
            r[f"{k}_over_16k"] = r[f"{k}_tflops"] / long_[f"{k}_tflops"]
    return rows


def visible_tiles(S, kw, tm=128, tn=128) -> float:
    """Tiles the forward computes (summed over batch and heads), from the kernel's table."""
    from jaxflash.kernels import mod_blocks
    from jaxflash.kernels.variants import mod_program as mp
    aux = kw.get("aux", ())
    text = mp.to_text(mp.mask_program(kw["mask_mod"], aux))
    B = TOKENS // S
    t = np.asarray(mod_blocks.forward_table(text, aux, B, HEADS, S, S, tm, tn))
    per = (t[..., 3] - t[..., 0]).sum(axis=-1)  # [Bb, Hb]
    return float(np.broadcast_to(per, (B, HEADS)).sum())


def main(argv=None):
    from benchmarks.timing import time_interleaved
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="-")
    ap.add_argument("--only", default="")
    ap.add_argument("--build", help="build the variants these calls reach into DIR instead")
    ap.add_argument("--ceiling", action="store_true",
                    help="short dense loops against 16k, ours and cuDNN's, instead")
    ap.add_argument("--schedules", action="store_true",
                    help="the sparse calls' forward under each of SCHEDULES instead")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    sel = cases(rng)
    if a.ceiling and not a.build:
        return _write(run_ceiling(rng), a.out)
    if a.schedules and not a.build:
        return _write(run_schedules(rng), a.out)
    if a.only:
        sel = {k: v for k, v in sel.items() if k in a.only.split(",")}
    if a.build:
        return _build(sel, a.build, schedules=a.schedules, ceiling=a.ceiling)
    rows = []
    for name, (S, builtin, mod, sparse) in sel.items():
        B, mfwd, mfb = _fns(S, mod)
        x = jnp.asarray(rng.standard_normal((B, S, HEADS, D)).astype(np.float32), jnp.bfloat16)
        args = (x, x, x)
        fns = {"mod_fwd": mfwd, "mod_fwdbwd": mfb}
        if builtin is not None:
            _, bfwd, bfb = _fns(S, builtin)
            fns.update(builtin_fwd=bfwd, builtin_fwdbwd=bfb)
        if sparse:
            _, dfwd, dfb = _fns(S, {})
            fns.update(dense_fwd=dfwd, dense_fwdbwd=dfb)
        if "mask_mod" in mod:  # the block mask built once, as a model reuses it across layers
            bm = mods.create_block_mask(mod["mask_mod"], B, 1, S, S, block=(128, 128),
                                        aux=mod.get("aux", ()))
            _, bfwd_, bfb_ = _fns(S, dict(mod, block_mask=bm))
            fns.update(modbm_fwd=bfwd_, modbm_fwdbwd=bfb_)
        t = time_interleaved(fns, args)
        row = {"case": name, "S": S, "B": B, **{f"{k}_ms": v.median_s * 1e3 for k, v in t.items()}}
        if builtin is not None and "modbm_fwd" in t:
            row["modbm_over_builtin_fwd"] = t["modbm_fwd"].median_s / t["builtin_fwd"].median_s
            row["modbm_over_builtin_fwdbwd"] = (t["modbm_fwdbwd"].median_s
                                                / t["builtin_fwdbwd"].median_s)
        if builtin is not None:
            row["mod_over_builtin_fwd"] = t["mod_fwd"].median_s / t["builtin_fwd"].median_s
            row["mod_over_builtin_fwdbwd"] = (t["mod_fwdbwd"].median_s
                                              / t["builtin_fwdbwd"].median_s)
        if sparse:
            tiles = visible_tiles(S, mod)
            flops = 4.0 * 128 * 128 * D * tiles
            dense_flops = 4.0 * S * S * D * B * HEADS
            row["visible_tile_fraction"] = tiles / (B * HEADS * (S // 128) ** 2)
            row["sparse_tflops_fwd"] = flops / t["mod_fwd"].median_s / 1e12
            row["dense_tflops_fwd"] = dense_flops / t["dense_fwd"].median_s / 1e12
            row["sparse_over_dense_fwd"] = row["sparse_tflops_fwd"] / row["dense_tflops_fwd"]
            # forward + backward: 2.5x the forward's flops either way
            row["sparse_over_dense_fwdbwd"] = ((flops / t["mod_fwdbwd"].median_s)
                                               / (dense_flops / t["dense_fwdbwd"].median_s))
            if "modbm_fwd" in t:
                # with the BlockMask built once (a mask reading aux otherwise evaluates its
                # block table in XLA in every call)
                row["modbm_sparse_over_dense_fwd"] = ((flops / t["modbm_fwd"].median_s)
                                                      / (dense_flops / t["dense_fwd"].median_s))
                row["modbm_sparse_over_dense_fwdbwd"] = (
                    (flops / t["modbm_fwdbwd"].median_s)
                    / (dense_flops / t["dense_fwdbwd"].median_s))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return _write(rows, a.out)


def _write(rows, out):
    from benchmarks import envinfo
    text = json.dumps({"env": envinfo.collect(), "device": str(jax.devices()[0]), "rows": rows},
                      indent=1)
    if out == "-":
        print(text)
    else:
        with open(out, "w") as f:
            f.write(text)
    return 0


def _build(sel, out, schedules=False, ceiling=False):
    """Lower every timed call for CUDA here (CuTe DSL, no GPU needed) with the FFI call
    recorded instead of compiled (as `tests.collect_variants`), then build what was reached."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from jaxflash import aot, ffi
    from jaxflash.ffi import primitive
    launches = {}

    def record(launch, *inputs, out_shapes, scalars=(), int_scalars=()):
        launches.setdefault(launch.name, launch)
        return tuple(jnp.zeros(tuple(int(d) for d in s.shape), s.dtype) for s in out_shapes)

    ffi.call = primitive.call = record
    with jaxflash.target_platform("cuda"):
        for name, (S, builtin, mod, sparse) in sel.items():
            for kw in [mod] + ([builtin] if builtin else []) + ([{}] if sparse else []):
                B, fwd, fb = _fns(S, kw)
                x = jax.ShapeDtypeStruct((B, S, HEADS, D), jnp.bfloat16)
                for f in (fwd, fb):
                    f.trace(x, x, x).lower(lowering_platforms=("cuda",))
        for _, kw, S, names, _ in (schedule_calls(np.random.default_rng(0)) if schedules else ()):
            x = jax.ShapeDtypeStruct((TOKENS // S, S, HEADS, D), jnp.bfloat16)
            for n in names:
                with forced_schedule(SCHEDULES[n]):
                    _fns(S, kw)[1].trace(x, x, x).lower(lowering_platforms=("cuda",))
        for S in (CEILING_S if ceiling else ()):
            x = jax.ShapeDtypeStruct((TOKENS // S, S, HEADS, D), jnp.bfloat16)
            kws = [{}] + ([dict(is_causal=True, local_window_size=(1024, 0))] if S == 16384 else [])
            for kw in kws:
                _fns(S, kw)[1].trace(x, x, x).lower(lowering_platforms=("cuda",))
    counts = aot.build(list(launches.values()), out, progress=False)
    print(f"{counts['built']} built, {counts['kept']} up to date in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
