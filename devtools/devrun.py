"""Build, check and time the Hopper forward kernel on the device machine (no DSL needed there).

  # here (DSL installed): compile every variant the device run needs into a kernel directory
  python -m devtools.devrun build --out .device/kernels
  # on the H200 (JAXFLASH_KERNEL_DIR=.device/kernels, CUTE_DSL_RUNTIME_LIB=<unpacked lib>)
  python -m devtools.devrun check --out $OUT/check.json
  python -m devtools.devrun bench --out $OUT/bench.json
  python -m devtools.devrun segbench --out $OUT/segbench.json  # ALiBi / segment ids

`check` compares output and LSE with the float32 reference (fresh random inputs, odd lengths,
GQA/MQA, causal with T != S, windows, softcap, per-batch lengths including empty rows) and also
records cuDNN's error on the same inputs. ALiBi cases draw slopes per head; segment cases give
ids as runs ``(id, length)`` per batch (or random small ids, ``"random_segs": n``). `bench`
times the kernel beside ``jax.nn.dot_product_attention(implementation="cudnn")`` in the same
process on the anchor grid (B*S = 16384, N*D = 2048, bf16, D in {64, 128, 256}, S in {1k, 4k,
16k}, causal in {0, 1}).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import numpy as np

from jaxflash.kernels.variants.fwd import FwdConfig
from devtools.fwd_cases import CHECKS  # noqa: F401 (the case list: fwd_cases.py)
from jaxflash.kernels.variants.fwd_launch import fwd_launch

BENCH_DIMS = (64, 128, 256)
BENCH_S = (1024, 4096, 16384)


# Scheduling variants timed beside the picks (same run, same inputs): the picks' neighbours.
# Variants that are invalid for a head dim (e.g. tile_m 192 above hdim 64) are skipped; a
# "head_dim" / "is_causal" entry restricts a column. What lost and was removed (the no-overlap
# schedule, wider key tiles, end-aligned tiles, three K / V stages, another L2 section size)
# is in docs/design.md.
VARIANTS = {"persist2": dict(persistent=True, tile_pipe=True),
            "m192_ps": dict(head_dim=64, tile_m=192, persistent=True),
            # per-warpgroup epilogue on the persistent picks (hd 128 and hd 64 at S <= 1k)
            "p2_we": dict(head_dim=128, persistent=True, tile_pipe=True, wg_epilogue=True),
            "m192_ps_we": dict(head_dim=64, tile_m=192, persistent=True, wg_epilogue=True),
            # lazy_rescale on top of each head dim's pick (FA4's conditional O rescale)
            "lazy": dict(lazy_rescale=True),
            "p2_we_lazy": dict(head_dim=128, persistent=True, tile_pipe=True, wg_epilogue=True,
                               lazy_rescale=True),
            "m192_lazy": dict(head_dim=64, tile_m=192, lazy_rescale=True)}
# 64-row tiles, two CTAs per SM (`FwdConfig.ctas_per_sm`): one K / V stage of 128 keys ("s1"),
# two of 64 keys ("n64"; half the SM's shared memory each), hd 64's two stages of 128 ("d64");
# each dense and, "_pairs", causal with paired tiles.
for _name, _shape in (("m64c2_s1", dict(num_stages=1)), ("m64c2_n64", dict(tile_n=64)),
                      ("m64c2_d64", dict(head_dim=64))):
    _c2 = dict(tile_m=64, ctas_per_sm=2, persistent=True, tile_pipe=True, **_shape)
    VARIANTS[_name] = dict(_c2, is_causal=False)
    VARIANTS[_name + "_pairs"] = dict(_c2, is_causal=True, tile_order="pairs")
# 256-row tiles, hd 64 (four 64-row consumer warpgroups at 112 registers, 64-key stages): no
# partial tile at 1k, where 192 rows leave one of six tiles a third full
_M256 = dict(head_dim=64, tile_m=256, tile_n=64, persistent=True, tile_pipe=True)
VARIANTS["m256"] = dict(_M256, is_causal=False)
VARIANTS["m256_msk"] = dict(_M256, is_causal=False, mask_skip=True)
VARIANTS["m256_pairs"] = dict(_M256, is_causal=True, tile_order="pairs", mask_select=True)
VARIANT_POINTS = {(128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 4096, True),
                  (128, 16384, False), (128, 16384, True), (64, 1024, True), (64, 1024, False),
                  (64, 4096, False),
                  (64, 4096, True), (64, 16384, False), (64, 16384, True), (256, 1024, False),
                  (256, 1024, True), (256, 4096, False), (256, 16384, False),
                  (64, 2048, False)}  # (off the grid: where 256-row tiles stop paying)


def _variant(D, causal, kw):
    kw = dict(kw)
    if kw.pop("head_dim", D) != D or kw.pop("is_causal", causal) != causal:
        return None
    try:
        return FwdConfig(head_dim=D, is_causal=causal, **kw)
    except ValueError:
        return None


# `segbench`: ALiBi overhead and segment block skipping at one size (B=1, N=16, S=16k, D=128).
# "docs" = 8 packed documents of 2048 (skipping should cut the work to 1/8 of dense); "random" =
# unsorted ids (nothing can be skipped; every block takes the element compare: the worst case).
SEG_BENCH = [("dense", {}, None), ("alibi", dict(has_alibi=True), None),
             ("docs", dict(has_segments=True), "docs"),
             ("random", dict(has_segments=True), "random"),
             ("causal", dict(is_causal=True), None),
             ("causal docs", dict(is_causal=True, has_segments=True), "docs"),
             ("causal alibi docs", dict(is_causal=True, has_segments=True, has_alibi=True),
              "docs")]


def grid_problem(head_dim: int, seq: int, causal: bool, backward: bool = False):
    """A bf16 call of the anchor grid (`benchmarks.bench`: B*S = 16384, N*D = 2048) as a
    `Problem`, for asking `choose` which variants it runs."""
    from jaxflash._types import AttentionStatics, Problem
    b, n = max(1, 16384 // seq), 2048 // head_dim
    return Problem(batch=b, q_len=seq, kv_len=seq, num_heads=n, num_kv_heads=n,
                   head_dim=head_dim, head_dim_v=head_dim, dtype="bfloat16",
                   statics=AttentionStatics(scale=head_dim ** -0.5, is_causal=causal))


# The grid's sequence lengths and the small call's (B=1, N=1, S=128, D=64).
GRID_S = BENCH_S + (128,)


def grid_choices():
    """The forward variants dispatch picks on the anchor grid and the small call: built with
    the rest, so a device run of the grid finds every artifact it needs."""
    from jaxflash.kernels.policy.choose import forward_config
    return [forward_config(grid_problem(d, s, c)) for d in BENCH_DIMS for s in GRID_S
            for c in (False, True)]


def pick_columns(D: int, S: int, causal: bool) -> dict:
    """Bench columns timed at every grid point: the dispatch's pick ("pick"), the pick with
    `lazy_rescale` on top ("pick_lazy"), causal only, the pick on the persistent loop with
    paired tiles ("pick_pairs"), dense only, the pick with `mask_skip` flipped ("pick_msk"),
    causal only, the pick with `mask_select` flipped ("pick_sel"), so one run answers per point
    whether each pays there (None where the pick refuses it)."""
    from jaxflash.kernels.policy.choose import forward_config
    pick = forward_config(grid_problem(D, S, causal))
    try:
        lazy = dataclasses.replace(pick, lazy_rescale=True)
    except ValueError:
        lazy = None
    try:  # the pick on the persistent loop with paired tiles (causal only)
        pairs = dataclasses.replace(pick, persistent=True, tile_pipe=True, tile_order="pairs")
    except ValueError:
        pairs = None
    # the pick with `mask_skip` flipped (dense only: a causal pick's masked blocks all carry
    # the diagonal bound, so it would change nothing there)
    msk = None if causal else dataclasses.replace(pick, mask_skip=not pick.mask_skip)
    # the pick with `mask_select` flipped (where a tile has masked blocks: causal; 192-row
    # tiles with overlap have it always)
    try:
        sel = (dataclasses.replace(pick, mask_select=not pick.mask_select) if causal else None)
    except ValueError:
        sel = None
    return {"pick": pick, "pick_lazy": lazy, "pick_pairs": pairs, "pick_msk": msk,
            "pick_sel": sel}


def bench_configs():
    cfgs = [FwdConfig(head_dim=d, is_causal=c) for d in BENCH_DIMS for c in (False, True)]
    cfgs += grid_choices()  # the "pick" column; its lazy twin for the points `bench` times:
    cfgs += [c for d in BENCH_DIMS for s in BENCH_S for causal in (False, True)
             for name in ("pick_lazy", "pick_pairs", "pick_msk", "pick_sel")
             if (c := pick_columns(d, s, causal)[name]) is not None]
    cfgs += [FwdConfig(head_dim=128, **kw) for _, kw, _ in SEG_BENCH]
    from devtools.feat_bench import feat_configs
    cfgs += feat_configs()  # masked calls off the grid, with and without mask_select
    for d, _, c in VARIANT_POINTS:
        cfgs += [v for v in (_variant(d, c, kw) for kw in VARIANTS.values()) if v is not None]
    return cfgs


def all_configs(cases=None):
    from devtools import lazy_exact
    cfgs = {FwdConfig(**kw) for n, kw, _ in CHECKS if not cases or n in cases}
    cfgs.update(bench_configs())
    cfgs.update(lazy_exact.configs())
    return sorted(cfgs, key=lambda c: c.key)


# -- build (DSL machine) ---------------------------------------------------------------------
def build(out: str, cases=None) -> None:
    from jaxflash.ffi import cache
    from jaxflash.ffi.compiler import compile_launch, dsl_version
    for cfg in all_configs(cases):
        launch = fwd_launch(cfg)
        t0 = time.time()
        data, why = cache.read_entry(out, launch, dsl_version())
        if data is None:
            cache.write_entry(out, launch, compile_launch(launch), dsl_version())
        print(f"{cfg.key}: {'cached' if data is not None else 'built'} "
              f"{time.time() - t0:.1f}s", flush=True)


# -- device side -----------------------------------------------------------------------------
def ours(q, k, v, cfg, scale, softcap=None, window=None, q_seqlen=None, kv_seqlen=None,
         alibi_slopes=None, q_seg=None, kv_seg=None):
    import jax
    import jax.numpy as jnp
    from jaxflash import ffi
    from jaxflash.kernels.variants.fwd_launch import fwd_inputs
    B, T, N, _ = q.shape
    ins = fwd_inputs(cfg, q, k, v, q_seqlen, kv_seqlen, alibi_slopes, q_seg, kv_seg)
    outs = [jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), q.dtype),
            jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
    o, lse = ffi.call(fwd_launch(cfg), *ins, out_shapes=outs,
                      scalars=(scale, softcap if softcap else 1.0),
                      int_scalars=tuple(window) if window else ())
    return o, lse


def np_probs(q, k, scale, causal=False, window=None, softcap=None, q_seqlen=None,
             kv_seqlen=None, alibi_slopes=None, q_seg=None, kv_seg=None):
    """float64 softmax probabilities with the jaxflash semantics (top-left causal, window
    (l, r), softcap, then ALiBi -slope[n] * |i - j|, per-batch lengths, segment ids [B, T] /
    [B, S]), shared by the forward and gradient oracles. Returns (p [B,N,T,S], all zero on rows
    with no visible key; lse [B,N,T], -inf there; dcap = d(softcapped logit)/d(logit), 1.0
    without softcap; the keys repeated over the GQA group [B,S,N,H])."""
    q, k = (np.asarray(x, np.float64) for x in (q, k))
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    kr = np.repeat(k, N // K, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, kr, optimize=True) * scale
    dcap = 1.0
    if softcap:
        t = np.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes, np.float64)[None, :, None, None] * np.abs(i - j)
    mask = np.ones((B, 1, T, S), bool)
    if q_seg is not None:
        mask &= (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])[:, None]
    if causal:
        mask &= (j <= i)[None, None]
    if window is not None:
        mask &= ((j >= i - window[0]) & (j <= i + window[1]))[None, None]
    if q_seqlen is not None:
        mask &= (i[None] < np.asarray(q_seqlen)[:, None, None])[:, None]
    if kv_seqlen is not None:
        mask &= (j[None] < np.asarray(kv_seqlen)[:, None, None])[:, None]
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)),
                   -np.inf)
    return p / np.where(l > 0, l, 1.0), lse, dcap, kr


def np_reference(q, k, v, scale, causal=False, window=None, softcap=None, q_seqlen=None,
                 kv_seqlen=None, alibi_slopes=None, q_seg=None, kv_seg=None):
    """float64 numpy oracle (semantics: `np_probs`); empty rows give output 0 and LSE -inf.
    Returns (o, lse[B,N,T])."""
    p, lse, _, _ = np_probs(q, k, scale, causal, window, softcap, q_seqlen, kv_seqlen,
                            alibi_slopes, q_seg, kv_seg)
    N = np.shape(q)[2]
    v = np.repeat(np.asarray(v, np.float64), N // np.shape(v)[2], axis=2)
    return np.einsum("bnts,bsnh->btnh", p, v, optimize=True), lse


def _runs(runs, length):
    ids = np.concatenate([np.full(n, i, np.int32) for i, n in runs])
    if ids.shape != (length,):
        raise ValueError(f"segment runs {runs} cover {ids.shape[0]} positions, not {length}")
    return ids


# Which compiled feature each input of a check case needs (input key in `ex` -> config flag).
_CASE_FEATURES = {"q_seqlen": "has_q_seqlen", "kv_seqlen": "has_kv_seqlen", "alibi": "has_alibi",
                  "q_segs": "has_segments", "random_segs": "has_segments",
                  "window": "has_window", "softcap": "has_softcap"}


def case_mismatch(name, config, ex) -> str:
    """"" when the inputs of check case `name` and the features compiled into `config` agree;
    else what differs. A variant compiled without a feature ignores its input (the kernel has
    no argument for it), so a mismatched case would test a call dispatch can never make (one
    device run failed a case whose config lacked ``has_kv_seqlen`` while its inputs had
    lengths, a bug of the case, not of the kernel)."""
    wrong = []
    for key, flag in _CASE_FEATURES.items():
        if key in ex and not getattr(config, flag):
            wrong.append(f"input {key!r} given but config has {flag}=False")
    for flag in sorted(set(_CASE_FEATURES.values())):
        if getattr(config, flag) and not any(k in ex for k, f in _CASE_FEATURES.items()
                                             if f == flag):
            wrong.append(f"config has {flag}=True but the case gives no input for it")
    return f"check case {name!r}: " + "; ".join(wrong) if wrong else ""


def _alibi_and_segments(ex, B, T, S, N):
    """(slopes [N] or None, q_seg [B, T] or None, kv_seg [B, S] or None) of a check case, as
    numpy arrays (fresh slopes each run: the usual 2^(-8 h / N) ladder times a random factor
    in [0.5, 2), so the bias is visible next to the scores)."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    slopes = q_seg = kv_seg = None
    if ex.get("alibi"):
        ladder = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)
        slopes = (ladder * rng.uniform(0.5, 2.0, N)).astype(np.float32)
    if "q_segs" in ex:
        q_seg = np.stack([_runs(r, T) for r in ex["q_segs"]])
        kv_seg = np.stack([_runs(r, S) for r in ex["kv_segs"]])
    elif ex.get("random_segs"):
        q_seg = rng.integers(0, ex["random_segs"], (B, T)).astype(np.int32)
        kv_seg = rng.integers(0, ex["random_segs"], (B, S)).astype(np.int32)
    return slopes, q_seg, kv_seg


def _rel(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm((x - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


def _cudnn_error(q, k, v, scale, causal, ex, ref_o, o) -> dict:
    """rel-L2 of cuDNN's and our output against `ref_o` over the rows both define (rows past a
    query length are left out: jax.nn leaves them unspecified), and their ratio."""
    import jax
    import jax.numpy as jnp
    kw = {}
    if ex.get("window"):
        kw["local_window_size"] = tuple(ex["window"])
    if "q_seqlen" in ex or "kv_seqlen" in ex:
        B, T, S = q.shape[0], q.shape[1], k.shape[1]
        kw["query_seq_lengths"] = jnp.asarray(ex.get("q_seqlen", [T] * B), jnp.int32)
        kw["key_value_seq_lengths"] = jnp.asarray(ex.get("kv_seqlen", [S] * B), jnp.int32)
    try:
        c = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                         implementation="cudnn", **kw)
        c = np.asarray(c.astype(jnp.float32))
    except Exception as e:  # cuDNN refuses some cases (e.g. causal with T != S)
        return {"rel_out_cudnn": f"refused: {type(e).__name__}: {str(e)[:120]}"}
    rows = np.ones(ref_o.shape[:2], bool)
    if "q_seqlen" in ex:
        rows = np.arange(ref_o.shape[1])[None, :] < np.asarray(ex["q_seqlen"])[:, None]
    if "kv_seqlen" in ex:  # batches with no keys: cuDNN's output there is unspecified
        rows &= (np.asarray(ex["kv_seqlen"]) > 0)[:, None]
    ours_err, theirs = _rel(o[rows], ref_o[rows]), _rel(c[rows], ref_o[rows])
    return {"rel_out_valid_rows": ours_err, "rel_out_cudnn": theirs,
            "error_vs_cudnn": ours_err / max(theirs, 1e-30),
            "within_1p2_of_cudnn": bool(ours_err <= 1.2 * theirs)}


# -- the case loop of `check` (and bwd_devrun's check / determinism) ---------------------------
def start_watchdog(name: str, seconds: float = 60.0):
    """A kernel that deadlocks would eat the whole device call: after `seconds` say which case
    hung and exit (status 3); the rows written so far stay on disk. Returns the timer (cancel
    it when the case ends)."""
    import threading
    print(f"start {name}", flush=True)
    dog = threading.Timer(seconds, lambda: (print(f"HANG in {name}", flush=True), os._exit(3)))
    dog.start()
    return dog


def finish_case(dog, row: dict, rows: list, out_path: str) -> bool:
    """Cancel the case's watchdog, print its row and rewrite `out_path` with every row so far
    (a later hang loses nothing); returns the row's ok."""
    dog.cancel()
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(out_path, "w") as fh:
        json.dump(rows, fh, indent=1)
    return bool(row["ok"])


def record_row(row: dict, rows: list, out_path: str) -> None:
    """Print a bench row and rewrite `out_path` with every row so far ({"gpu", "rows"}; the
    bench's final write adds its metadata), so a later hang or timeout loses nothing."""
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(out_path, "w") as fh:
        json.dump({"gpu": _gpu_name(), "rows": rows}, fh, indent=1)


def fresh_inputs(B, T, S, N, K, H, dtype, ex, with_do=False):
    """A check case's inputs: q [B,T,N,H], k, v [B,S,K,H] (and dO like q) drawn from a fresh
    OS-random key (never zeros, never the same twice), plus the case's lengths as int32."""
    import jax
    import jax.numpy as jnp
    dt = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.key(int.from_bytes(os.urandom(4), "little")), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dt)
    k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32)
    if "k_ramp" in ex:
        # keys scaled from k_ramp (first) down to 1 (last): the kernel walks key blocks from
        # the last, so every earlier block raises the row max (lazy_rescale's rescale path)
        k = k * jnp.linspace(ex["k_ramp"], 1.0, S)[None, :, None, None]
    k = k.astype(dt)
    v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dt)
    do = jax.random.normal(ks[3], (B, T, N, H), jnp.float32).astype(dt) if with_do else None
    qs = jnp.asarray(ex["q_seqlen"], jnp.int32) if "q_seqlen" in ex else None
    kvs = jnp.asarray(ex["kv_seqlen"], jnp.int32) if "kv_seqlen" in ex else None
    return q, k, v, do, qs, kvs


def check(out_path: str, cases=None) -> bool:
    import jax
    import jax.numpy as jnp
    rows, ok_all = [], True
    for name, kw, (B, T, S, N, K, ex) in CHECKS:
        if cases and name not in cases:
            continue
        dog = start_watchdog(name)
        cfg = FwdConfig(**kw)
        if case_mismatch(name, cfg, ex):
            raise ValueError(case_mismatch(name, cfg, ex))
        H = cfg.head_dim
        q, k, v, _, qs, kvs = fresh_inputs(B, T, S, N, K, H, cfg.dtype, ex)
        scale = 1.0 / np.sqrt(H)
        slopes, q_seg, kv_seg = _alibi_and_segments(ex, B, T, S, N)
        row = {"name": name, "config": cfg.key, "shape": [B, T, S, N, K, H]}
        try:
            f = jax.jit(lambda q, k, v, qs, kvs, al, qsg, ksg: ours(
                q, k, v, cfg, scale, ex.get("softcap"), ex.get("window"), qs, kvs, al, qsg, ksg))
            o, lse = f(q, k, v, qs, kvs, slopes, q_seg, kv_seg)
            o = np.asarray(o.astype(jnp.float32))
            lse = np.asarray(lse)
            ref_o, ref_lse = np_reference(
                np.asarray(q.astype(jnp.float32)), np.asarray(k.astype(jnp.float32)),
                np.asarray(v.astype(jnp.float32)), scale, cfg.is_causal, ex.get("window"),
                ex.get("softcap"), ex.get("q_seqlen"), ex.get("kv_seqlen"), slopes, q_seg, kv_seg)
            fin = np.isfinite(ref_lse)
            row["nan_out"] = int(np.isnan(o).sum())
            row["rel_out"] = _rel(o, ref_o)
            row["rel_lse"] = _rel(lse[fin], ref_lse[fin]) if fin.any() else 0.0
            row["empty_rows"] = int((~fin).sum())
            row["empty_lse_ok"] = bool(np.all(np.isneginf(lse[~fin])))
            row["max_abs_out_where_empty"] = float(
                np.abs(np.transpose(o, (0, 2, 1, 3))[~fin]).max()) if (~fin).any() else 0.0
            tol = {"bfloat16": 2e-2, "float16": 4e-3}[cfg.dtype]
            row["ok"] = bool(row["nan_out"] == 0 and row["rel_out"] < tol
                             and row["rel_lse"] < 1e-3 and row["empty_lse_ok"]
                             and row["max_abs_out_where_empty"] == 0.0)
            if ex.get("repeat"):
                row["bitwise_equal"] = _repeats_equal(
                    lambda: f(q, k, v, qs, kvs, slopes, q_seg, kv_seg), o, lse, ex["repeat"])
                row["ok"] = row["ok"] and row["bitwise_equal"]
            # cuDNN's error against the same float64 oracle on the same inputs (the x1.2
            # criterion), wherever jax.nn's cuDNN path takes the case: it has no softcap, ALiBi
            # or segment ids, and without them it would compute another function (an early
            # result file still holds such meaningless ratios for its ALiBi/segment rows).
            if not (ex.get("softcap") or ex.get("alibi") or "q_segs" in ex
                    or ex.get("random_segs")):
                row.update(_cudnn_error(q, k, v, scale, cfg.is_causal, ex, ref_o, o))
        except Exception as e:
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        ok_all &= finish_case(dog, row, rows, out_path)
    return ok_all


def _repeats_equal(run, o, lse, n: int) -> bool:
    """Whether n - 1 more runs give O and LSE bit for bit equal to (o, lse) (float32 views of
    the outputs: bf16/fp16 -> float32 is exact, and uint32 views tell -0 from +0)."""
    import jax.numpy as jnp
    same = True
    for _ in range(n - 1):
        o2, lse2 = run()
        o2 = np.asarray(o2.astype(jnp.float32))
        same &= bool(np.array_equal(o.view(np.uint32), o2.view(np.uint32))
                     and np.array_equal(lse.view(np.uint32), np.asarray(lse2).view(np.uint32)))
    return same


def _time(fn, args, iters=None):  # iters: ignored (the harness picks n per rep)
    """Median seconds per call: the harness's throughput timing (`benchmarks/timing.py`; devrun
    runs from the repo root, where `benchmarks` imports)."""
    from benchmarks.timing import time_throughput
    return time_throughput(fn, args, reps=5).median_s


def _time_all(fns: dict, args) -> dict:
    """Median seconds per call of each of `fns`, their reps interleaved (`benchmarks/timing.py`)."""
    from benchmarks.timing import time_interleaved
    return {k: t.median_s for k, t in time_interleaved(fns, args, reps=5).items()}


def bench(out_path: str, only=None, columns=None) -> None:
    """Time the default config beside cuDNN at every grid point (or those in `only`), then
    the `pick_columns` everywhere and the `VARIANTS` at `VARIANT_POINTS`; `columns` (names)
    limits the extra columns to those."""
    import jax
    import jax.numpy as jnp
    rows = []
    lengths = sorted({s for _, s, _ in only}) if only else BENCH_S  # (`only` may leave the grid)
    for D in BENCH_DIMS:
        for S in lengths:
            for causal in (False, True):
                if only and (D, S, causal) not in only:
                    continue
                B, N = 16384 // S, 2048 // D
                key = jax.random.key(S + D + causal)
                ks = jax.random.split(key, 3)
                q, k, v = (jax.random.normal(kk, (B, S, N, D), jnp.float32).astype(jnp.bfloat16)
                           for kk in ks)
                cfg = FwdConfig(head_dim=D, is_causal=causal)
                scale = 1.0 / np.sqrt(D)
                f_ours = jax.jit(lambda q, k, v: ours(q, k, v, cfg, scale)[0])
                f_cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, scale=scale, is_causal=causal, implementation="cudnn"))
                flops = 4 * B * N * S * S * D / (2 if causal else 1)
                row = {"D": D, "S": S, "causal": int(causal), "B": B, "N": N}
                try:
                    a = np.asarray(f_ours(q, k, v).astype(jnp.float32))
                    b = np.asarray(f_cudnn(q, k, v).astype(jnp.float32))
                    row["rel_vs_cudnn"] = _rel(a, b)
                    extra = pick_columns(D, S, causal)
                    if (D, S, causal) in VARIANT_POINTS:
                        extra.update((n, _variant(D, causal, kw)) for n, kw in VARIANTS.items())
                    fns = {"ours": f_ours, "cudnn": f_cudnn}
                    for vname, vcfg in extra.items():
                        if vcfg is not None and (not columns or vname in columns):
                            fns[vname] = jax.jit(lambda q, k, v, c=vcfg: ours(q, k, v, c, scale)[0])
                    # reps in turn over every column: a drift over the run hits them alike
                    ts = _time_all(fns, (q, k, v))
                    t_o, t_c = ts.pop("ours"), ts.pop("cudnn")
                    row.update(config=cfg.key, ours_ms=t_o * 1e3, cudnn_ms=t_c * 1e3,
                               ours_tflops=flops / t_o / 1e12, cudnn_tflops=flops / t_c / 1e12,
                               ratio=t_c / t_o)
                    for vname, t_v in ts.items():
                        row[f"{vname}_tflops"] = flops / t_v / 1e12
                        row[f"{vname}_ratio"] = t_c / t_v
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                record_row(row, rows, out_path)
    # the tiny call: B=1, N=1, T=S=128, D=64, wall time including dispatch
    q, k, v = (jax.random.normal(kk, (1, 128, 1, 64), jnp.float32).astype(jnp.bfloat16)
               for kk in jax.random.split(jax.random.key(0), 3))
    cfg = FwdConfig(head_dim=64)
    f_ours = jax.jit(lambda q, k, v: ours(q, k, v, cfg, 0.125)[0])
    f_cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=0.125, implementation="cudnn"))
    tiny = {"tiny": True}
    for nm, f in (("ours", f_ours), ("cudnn", f_cudnn)):
        jax.block_until_ready(f(q, k, v))
        ts = []
        for _ in range(50):
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            ts.append(time.perf_counter() - t0)
        tiny[f"{nm}_us"] = float(np.median(ts) * 1e6)
    print(json.dumps(tiny), flush=True)
    rows.append(tiny)
    meta = {"gpu": _gpu_name(), "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
            "python": platform.python_version(), "rows": rows}
    with open(out_path, "w") as f:
        json.dump(meta, f, indent=1)


def segbench(out_path: str) -> None:
    """Time `SEG_BENCH` (XLA's block summaries included in the timed call)."""
    import jax
    import jax.numpy as jnp
    B, S, N, D = 1, 16384, 16, 128
    ks = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(kk, (B, S, N, D), jnp.float32).astype(jnp.bfloat16)
               for kk in ks)
    slopes = 2.0 ** (-jnp.arange(1, N + 1, dtype=jnp.float32) / 2)
    segs = {"docs": jnp.repeat(jnp.arange(8, dtype=jnp.int32), S // 8)[None],
            "random": jax.random.randint(jax.random.key(8), (B, S), 0, 8, jnp.int32)}
    scale = 1.0 / np.sqrt(D)
    rows = []
    for name, kw, seg in SEG_BENCH:
        cfg = FwdConfig(head_dim=D, **kw)
        sg = segs.get(seg)
        al = slopes if cfg.has_alibi else None
        f = jax.jit(lambda q, k, v, al, sg, cfg=cfg: ours(q, k, v, cfg, scale, alibi_slopes=al,
                                                          q_seg=sg, kv_seg=sg)[0])
        row = {"name": name, "config": cfg.key, "B": B, "S": S, "N": N, "D": D}
        try:
            t = _time(f, (q, k, v, al, sg), 10)
            row["ms"] = t * 1e3
            # FLOPs of the pairs that attend (what a perfect skip would cost).
            frac = 1.0 / 8 if seg == "docs" else 1.0
            frac *= 0.5 if cfg.is_causal else 1.0
            row["useful_tflops"] = 4 * B * N * S * S * D * frac / t / 1e12
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"gpu": _gpu_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                  indent=1)


def _gpu_name():
    try:
        import jax
        return jax.devices()[0].device_kind
    except Exception:
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["build", "check", "bench", "segbench"])
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="bench points 'D:S:causal,...'")
    p.add_argument("--cases", default="", help="check cases by name, ';'-separated")
    p.add_argument("--columns", default="", help="bench: only these extra columns, "
                   "','-separated (pick, pick_lazy, pick_pairs, VARIANTS names)")
    a = p.parse_args(argv)
    if a.cmd == "build":
        build(a.out, {c for c in a.cases.split(";") if c} or None)
    elif a.cmd == "segbench":
        segbench(a.out)
    elif a.cmd == "check":
        cases = {c for c in a.cases.split(";") if c}
        sys.exit(0 if check(a.out, cases or None) else 1)
    else:
        only = {tuple(int(x) for x in s.split(":")) for s in a.only.split(",") if s}
        bench(a.out, {(d, s, bool(c)) for d, s, c in only} or None,
              {c for c in a.columns.split(",") if c} or None)


if __name__ == "__main__":
    main()
