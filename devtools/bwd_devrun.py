"""Build, check and time the Hopper backward kernel on the device machine (no DSL needed there).

  # here (DSL installed): compile every variant the device run needs (forward + backward)
  CUTE_DSL_ARCH=sm_90a python -m devtools.bwd_devrun build --out .device/kernels
  # on the H200 (JAXFLASH_KERNEL_DIR=.device/kernels, CUTE_DSL_RUNTIME_LIB=<unpacked lib>)
  python -m devtools.bwd_devrun check --out $OUT/bwd_check.json
  python -m devtools.bwd_devrun bench --out $OUT/bwd_bench.json
  python -m devtools.bwd_devrun determinism --out $OUT/bwd_det.json
  python -m devtools.bwd_devrun segbench --out $OUT/bwd_segbench.json  # 8 docs vs dense

`check`: fresh random inputs per case (odd T and S, GQA and MQA, causal with T != S, windows,
softcap, per-batch lengths with empty rows, fp16); our forward's (out, lse) then the CuTe
backward called directly (so a missing artifact is an error, never a silent Pallas fallback);
dq/dk/dv against a float64 numpy gradient oracle (rel L2), cuDNN's gradient error on the same
inputs where cuDNN takes the case (ratio recorded), NaN fails, 60 s watchdog per case. One case
goes through ``jax.grad(flash_attention(implementation="cute"))`` and checks that explain names
the CuTe backward.
`determinism`: the deterministic variant 10 times on the same inputs, bitwise equal (and the
default variant's run-to-run spread, for information).
`bench`: forward+backward of ``flash_attention(implementation="cute")`` vs cuDNN's, same process,
on the anchor grid (B*S = 16384, N*D = 2048, bf16, D 64/128/256, S 1k/4k/16k, causal 0/1).
TFLOP/s as `/work/shared/anchors/README.md` counts fwd+bwd: 3.5 x 4*B*N*S^2*D (x0.5 causal).
D 256 runs `FlashBwdSm90Wide` (head-dim split); the row says which backward ran.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from devtools.bwd_cases import CHECKS, DETERMINISM  # noqa: F401 (bwd_cases.py)
from jaxflash.kernels.variants.bwd import BwdConfig
from jaxflash.kernels.variants.bwd_launch import bwd_launch
from jaxflash.kernels.variants.fwd import FwdConfig
from devtools.devrun import (_alibi_and_segments, _gpu_name, _rel, _time, case_mismatch,
                                     finish_case, fresh_inputs, ours, record_row,
                                     start_watchdog)
from jaxflash.kernels.variants.fwd_launch import fwd_launch

# Bench points where the deterministic mode is timed too (same inputs, same process).
DET_POINTS = {(64, 4096, False), (128, 4096, False), (128, 4096, True), (128, 16384, True),
              (256, 4096, False), (256, 4096, True), (256, 16384, False), (256, 16384, True)}
# Variants timed beside the default (direct calls, same inputs): name -> BwdConfig kwargs, per
# head dim, at VARIANT_POINTS. hd 64's default is tile_m 128 (`choose.tile_m_for`): "m64"
# times the 64-query step beside it, "m128_det" the deterministic mode at tile_m 128; "m128" is
# hd 64's default (the direct default path builds tile_m 64). "edv" is hd 128's default. What
# lost and was removed (overlap_dq, dq_arrive, dq_writer, tile_m 80, dq_wg_flush, do_first,
# the per-element dQ atomics, ...) is in docs/design.md.
BENCH_VARIANTS = {
    64: {"m64": dict(tile_m=64), "m128": dict(tile_m=128),
         "m128_dqf": dict(tile_m=128, dq_flat=True),
         "m128_dqf_tl": dict(tile_m=128, dq_flat=True, tail_lpt=True),
         "m128_det": dict(tile_m=128, deterministic=True)},
    # "*_dqf": dq_flat (one bulk reduce of the fragment-ordered dQ tile per step)
    128: {"edv": dict(early_dv=True), "edv_dqf": dict(early_dv=True, dq_flat=True),
          # tail_lpt (causal points only): the last heads launched key-block-major
          "edv_dqf_tl": dict(early_dv=True, dq_flat=True, tail_lpt=True),
          # q_multicast: key-block pairs sharing their Q / dO loads (TMA multicast)
          "edv_dqf_qmc": dict(early_dv=True, dq_flat=True, q_multicast=True),
          "edv_dqf_tl_qmc": dict(early_dv=True, dq_flat=True, tail_lpt=True, q_multicast=True)},
    256: {"dqf": dict(dq_flat=True), "dqf_tl": dict(dq_flat=True, tail_lpt=True),
          # q_multicast (every point; with tail_lpt, the causal pick's order, in pairs)
          "dqf_qmc": dict(dq_flat=True, q_multicast=True),
          "dqf_tl_qmc": dict(dq_flat=True, tail_lpt=True, q_multicast=True)},
}
VARIANT_POINTS = {(64, 1024, False), (64, 1024, True), (64, 4096, False), (64, 4096, True),
                  (64, 16384, False), (64, 16384, True),
                  (128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 4096, True),
                  (128, 16384, False), (128, 16384, True),
                  (256, 1024, False), (256, 1024, True), (256, 4096, False), (256, 4096, True),
                  (256, 16384, False), (256, 16384, True)}

BENCH_DIMS = (64, 128, 256)
BENCH_S = (1024, 4096, 16384)
TOL = {"bfloat16": 1e-2, "float16": 2e-3}  # ~3x what bf16 / fp16 rounding of P and dS gives


# Backward-only config fields (FwdConfig has its own tile_m: the forward stays at its default).
_BWD_ONLY = ("num_stages", "deterministic", "early_dv", "tile_m", "dq_flat", "tail_lpt",
             "q_multicast")


def variant_config(D, causal, vkw):
    """The BwdConfig of a bench variant at a point, None where the variant refuses it
    (tail_lpt is causal only)."""
    try:
        return BwdConfig(head_dim=D, is_causal=causal, **vkw)
    except ValueError:
        return None


def _configs(kw):
    return (FwdConfig(**{k: v for k, v in kw.items() if k not in _BWD_ONLY}), BwdConfig(**kw))


def all_launches(cases=None):
    from jaxflash.kernels.policy.choose import backward_config
    from devtools.devrun import grid_problem
    launches = []
    for name, kw, (_, T, _, _, _, _) in CHECKS + DETERMINISM:
        if not cases or name in cases:
            f, b = _configs(kw)
            launches += [fwd_launch(f), bwd_launch(b)]
            if "via jax.grad" in name:  # runs what dispatch picks for it (plain bf16 calls)
                launches.append(bwd_launch(backward_config(
                    grid_problem(kw["head_dim"], T, kw.get("is_causal", False)))))
    if not cases:
        for d in BENCH_DIMS:
            for c in (False, True):
                launches.append(fwd_launch(FwdConfig(head_dim=d, is_causal=c)))
                launches.append(bwd_launch(BwdConfig(head_dim=d, is_causal=c)))
        from devtools.devrun import GRID_S, grid_choices
        launches += [fwd_launch(f) for f in grid_choices()]  # the forward the grad runs first
        launches += [bwd_launch(backward_config(grid_problem(d, s, c)))
                     for d in BENCH_DIMS for s in GRID_S for c in (False, True)]
        for d, _, c in DET_POINTS:
            launches.append(bwd_launch(BwdConfig(head_dim=d, is_causal=c, deterministic=True)))
        for d, _, c in VARIANT_POINTS:
            for vkw in BENCH_VARIANTS.get(d, {}).values():
                if variant_config(d, c, vkw) is not None:
                    launches.append(bwd_launch(variant_config(d, c, vkw)))
        launches += _seg_bench_launches()
    uniq = {l.key: l for l in launches}
    return list(uniq.values())


# -- build (DSL machine) ---------------------------------------------------------------------
def build(out: str, cases=None) -> None:
    from jaxflash.ffi import cache
    from jaxflash.ffi.compiler import compile_launch, dsl_version
    for launch in all_launches(cases):
        t0 = time.time()
        data, _ = cache.read_entry(out, launch, dsl_version())
        if data is None:
            cache.write_entry(out, launch, compile_launch(launch), dsl_version())
        print(f"{launch.config.key}: {'cached' if data is not None else 'built'} "
              f"{time.time() - t0:.1f}s", flush=True)


# -- oracle ------------------------------------------------------------------------------------
def np_grads(q, k, v, do, scale, causal=False, window=None, softcap=None, q_seqlen=None,
             kv_seqlen=None, alibi_slopes=None, q_seg=None, kv_seg=None):
    """float64 (dq, dk, dv) with the jaxflash semantics (rows with no visible key: zero
    gradient; GQA: dk/dv summed over the query heads of a group); with ALiBi a fourth entry,
    d(slopes) [N] = -sum over b, i, j of dlogit_ij |i - j|. The contractions go through BLAS
    (`optimize=True`): numpy's own einsum loop runs ~1.6 GFLOP/s, so the 8 x 16 x 1000^2 case
    outlasted the 60 s watchdog and read as a hang."""
    from devtools.devrun import np_probs
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    p, _, dcap, kr = np_probs(q, k, scale, causal, window, softcap, q_seqlen, kv_seqlen,
                              alibi_slopes, q_seg, kv_seg)
    vr = np.repeat(v, G, axis=2)
    dp = np.einsum("btnh,bsnh->bnts", do, vr, optimize=True)
    dlogit = p * (dp - (p * dp).sum(-1, keepdims=True))  # d loss / d (final logit)
    ds = dlogit * dcap
    dq = np.einsum("bnts,bsnh->btnh", ds, kr, optimize=True) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q, optimize=True) * scale
    dv = np.einsum("bnts,btnh->bsnh", p, do, optimize=True)
    dk = dk.reshape(B, S, K, G, -1).sum(3)
    dv = dv.reshape(B, S, K, G, -1).sum(3)
    if alibi_slopes is not None:
        dist = np.abs(np.arange(T)[:, None] - np.arange(S)[None, :]).astype(np.float64)
        return dq, dk, dv, -np.einsum("bnts,ts->n", dlogit, dist, optimize=True)
    return dq, dk, dv


def ours_grads(q, k, v, do, fcfg, bcfg, scale, softcap=None, window=None, q_seqlen=None,
               kv_seqlen=None, alibi_slopes=None, q_seg=None, kv_seg=None):
    """Our forward, then the CuTe backward called directly (no fallback possible); with ALiBi
    a fourth entry, d(slopes)."""
    from jaxflash._types import AttentionArrays, AttentionStatics
    from jaxflash.kernels.call import backward as cute_backward
    o, lse = ours(q, k, v, fcfg, scale, softcap, window, q_seqlen, kv_seqlen, alibi_slopes,
                  q_seg, kv_seg)
    st = AttentionStatics(scale=scale, is_causal=bcfg.is_causal,
                          window=tuple(window) if window else None, softcap=softcap)
    arrays = AttentionArrays(q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, alibi_slopes=alibi_slopes,
                             q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    dq, dk, dv, _, dslopes = cute_backward(bwd_launch(bcfg), q, k, v, arrays, st, o, lse, do)
    if bcfg.has_alibi:
        return dq, dk, dv, dslopes
    return dq, dk, dv


def _cudnn_grads(q, k, v, do, scale, causal, window, q_seqlen, kv_seqlen):
    import jax
    kw = dict(scale=scale, is_causal=causal, implementation="cudnn")
    if window is not None:
        kw["local_window_size"] = tuple(window)
    if q_seqlen is not None or kv_seqlen is not None:
        B, T, S = q.shape[0], q.shape[1], k.shape[1]
        import jax.numpy as jnp
        kw["query_seq_lengths"] = q_seqlen if q_seqlen is not None else jnp.full((B,), T,
                                                                                 jnp.int32)
        kw["key_value_seq_lengths"] = kv_seqlen if kv_seqlen is not None else jnp.full(
            (B,), S, jnp.int32)
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)
    return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))(q, k, v, do)


def check(out_path: str, cases=None) -> bool:
    import jax
    import jax.numpy as jnp
    rows, ok_all = [], True
    for name, kw, (B, T, S, N, K, ex) in CHECKS:
        if cases and name not in cases:
            continue
        dog = start_watchdog(name)
        fcfg, bcfg = _configs(kw)
        if case_mismatch(name, bcfg, ex):
            raise ValueError(case_mismatch(name, bcfg, ex))
        H = bcfg.head_dim
        q, k, v, do, qs, kvs = fresh_inputs(B, T, S, N, K, H, bcfg.dtype, ex, with_do=True)
        scale = 1.0 / np.sqrt(H)
        window, softcap = ex.get("window"), ex.get("softcap")
        slopes, q_seg, kv_seg = _alibi_and_segments(ex, B, T, S, N)
        row = {"name": name, "config": bcfg.key, "shape": [B, T, S, N, K, H]}
        try:
            if ex.get("api"):
                import jaxflash
                row["explain"] = str(jaxflash.explain(q, k, v, implementation="cute",
                                                      is_causal=bcfg.is_causal))
                attn = lambda q, k, v: jaxflash.flash_attention(
                    q, k, v, implementation="cute", is_causal=bcfg.is_causal, scale=scale)
                g = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))(q, k, v, do)
                row["cute_backward_named"] = "FlashBwdSm90" in row["explain"]
            else:
                f = jax.jit(lambda q, k, v, do, qs, kvs, sl, qg, kg: ours_grads(
                    q, k, v, do, fcfg, bcfg, scale, softcap, window, qs, kvs, sl, qg, kg))
                g = f(q, k, v, do, qs, kvs, slopes, q_seg, kv_seg)
            g = [np.asarray(x.astype(jnp.float32)) for x in g]
            f32 = lambda x: np.asarray(x.astype(jnp.float32))
            ref = np_grads(f32(q), f32(k), f32(v), f32(do), scale, bcfg.is_causal, window,
                           softcap, ex.get("q_seqlen"), ex.get("kv_seqlen"), slopes, q_seg,
                           kv_seg)
            tol = TOL[bcfg.dtype]
            ok = True
            for nm, x, r in zip(("dq", "dk", "dv", "dslopes"), g, ref):
                row[f"nan_{nm}"] = int(np.isnan(x).sum())
                row[f"rel_{nm}"] = _rel(x, r)
                ok &= row[f"nan_{nm}"] == 0 and row[f"rel_{nm}"] < tol
            if "q_seqlen" in ex:  # rows past q_seqlen: exactly zero dq
                dead = np.arange(T)[None, :] >= np.asarray(ex["q_seqlen"])[:, None]
                row["max_abs_dq_dead_rows"] = float(np.abs(g[0][dead]).max()) if dead.any() else 0.0
                ok &= row["max_abs_dq_dead_rows"] == 0.0
            if "kv_seqlen" in ex:  # keys past kv_seqlen: exactly zero dk, dv
                dead = np.arange(S)[None, :] >= np.asarray(ex["kv_seqlen"])[:, None]
                row["max_abs_dkv_dead_keys"] = float(max(np.abs(g[1][dead]).max(),
                                                         np.abs(g[2][dead]).max())) \
                    if dead.any() else 0.0
                ok &= row["max_abs_dkv_dead_keys"] == 0.0
            if q_seg is not None:  # queries whose segment meets no key: exactly zero dq
                dead = ~(q_seg[:, :, None] == kv_seg[:, None, :]).any(-1)
                row["max_abs_dq_segment_dead_rows"] = (float(np.abs(g[0][dead]).max())
                                                       if dead.any() else 0.0)
                ok &= row["max_abs_dq_segment_dead_rows"] == 0.0
            if ex.get("api"):
                ok &= row["cute_backward_named"]
            row["ok"] = bool(ok)
            if ex.get("cudnn"):
                try:
                    c = _cudnn_grads(q, k, v, do, scale, bcfg.is_causal, window, qs, kvs)
                    for nm, x, r in zip(("dq", "dk", "dv"), c, ref):
                        e = _rel(np.asarray(x.astype(jnp.float32)), r)
                        row[f"rel_{nm}_cudnn"] = e
                        row[f"ratio_{nm}_vs_cudnn"] = row[f"rel_{nm}"] / max(e, 1e-30)
                except Exception as e:  # cuDNN refuses some cases
                    row["cudnn"] = f"refused: {type(e).__name__}: {str(e)[:160]}"
        except Exception as e:
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        ok_all &= finish_case(dog, row, rows, out_path)
    return ok_all


def _direct_fwd_bwd(D, causal, scale, **variant):
    """Forward + CuTe backward of one variant (bypasses the backend's choice)."""
    import jax
    fcfg = FwdConfig(head_dim=D, is_causal=causal)
    bcfg = BwdConfig(head_dim=D, is_causal=causal, **variant)
    return jax.jit(lambda q, k, v, do: ours_grads(q, k, v, do, fcfg, bcfg, scale))


def bench(out_path: str, only=None) -> None:
    import jax
    import jax.numpy as jnp
    import jaxflash
    rows = []
    for D in BENCH_DIMS:
        for S in BENCH_S:
            for causal in (False, True):
                if only and (D, S, causal) not in only:
                    continue
                B, N = 16384 // S, 2048 // D
                ks = jax.random.split(jax.random.key(S + D + causal), 4)
                q, k, v, do = (jax.random.normal(kk, (B, S, N, D), jnp.float32)
                               .astype(jnp.bfloat16) for kk in ks)
                scale = 1.0 / np.sqrt(D)
                ours_f = lambda q, k, v: jaxflash.flash_attention(
                    q, k, v, scale=scale, is_causal=causal, implementation="cute")
                cudnn_f = lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, scale=scale, is_causal=causal, implementation="cudnn")
                g_ours = jax.jit(lambda q, k, v, do: jax.vjp(ours_f, q, k, v)[1](do))
                g_cudnn = jax.jit(lambda q, k, v, do: jax.vjp(cudnn_f, q, k, v)[1](do))
                flops = 3.5 * 4 * B * N * S * S * D / (2 if causal else 1)
                row = {"D": D, "S": S, "causal": int(causal), "B": B, "N": N}
                try:
                    notes = jaxflash.explain(q, k, v, implementation="cute",
                                             is_causal=causal).notes
                    row["backward"] = " ".join(notes)[:160]
                    a = g_ours(q, k, v, do)
                    b = g_cudnn(q, k, v, do)
                    row["rel_dq_vs_cudnn"] = _rel(np.asarray(a[0].astype(jnp.float32)),
                                                  np.asarray(b[0].astype(jnp.float32)))
                    iters = max(1, int(0.3 * 3e14 / flops))
                    t_o = _time(g_ours, (q, k, v, do), iters)
                    t_c = _time(g_cudnn, (q, k, v, do), iters)
                    # Forward alone, to read the backward's share (bwd_ms = ours_ms - fwd_ms).
                    t_f = _time(jax.jit(ours_f), (q, k, v), iters)
                    row.update(fwd_ms=t_f * 1e3, bwd_ms=(t_o - t_f) * 1e3,
                               bwd_tflops=flops * 2.5 / 3.5 / max(t_o - t_f, 1e-9) / 1e12)
                    row.update(ours_ms=t_o * 1e3, cudnn_ms=t_c * 1e3,
                               ours_tflops=flops / t_o / 1e12, cudnn_tflops=flops / t_c / 1e12,
                               ratio=t_c / t_o)
                    if (D, S, causal) in DET_POINTS:
                        t_t = _time(_direct_fwd_bwd(D, causal, scale), (q, k, v, do), iters)
                        # deterministic=True: what the ordered dQ adds cost
                        t_d = _time(_direct_fwd_bwd(D, causal, scale, deterministic=True),
                                    (q, k, v, do), iters)
                        row.update(dq_tma_tflops=flops / t_t / 1e12,
                                   deterministic_tflops=flops / t_d / 1e12)
                    if (D, S, causal) in VARIANT_POINTS and D in BENCH_VARIANTS:
                        # Default schedule by the same direct path, then each variant; the
                        # ratio > 1 means the variant is faster. A failing variant is recorded
                        # without losing the row.
                        if (D, S, causal) not in DET_POINTS:  # else timed just above
                            t_t = _time(_direct_fwd_bwd(D, causal, scale), (q, k, v, do),
                                        iters)
                        row["default_direct_ms"] = t_t * 1e3
                        for vn, vkw in BENCH_VARIANTS[D].items():
                            if variant_config(D, causal, vkw) is None:
                                continue  # refused at this point (tail_lpt: dense)
                            try:
                                t_v = _time(_direct_fwd_bwd(D, causal, scale, **vkw),
                                            (q, k, v, do), iters)
                                row[f"{vn}_ms"] = t_v * 1e3
                                row[f"{vn}_speedup"] = t_t / t_v
                                row[f"{vn}_bwd_speedup"] = (t_t - t_f) / max(t_v - t_f, 1e-9)
                            except Exception as e:
                                row[f"{vn}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                record_row(row, rows, out_path)
    meta = {"gpu": _gpu_name(), "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
            "python": platform.python_version(),
            "flops": "fwd+bwd = 3.5 * 4*B*N*S^2*D (x0.5 causal), as the anchors", "rows": rows}
    with open(out_path, "w") as fh:
        json.dump(meta, fh, indent=1)


def determinism(out_path: str, runs: int = 10) -> bool:
    """Each DETERMINISM case `runs` times on the same inputs: deterministic variants must give
    bitwise-identical dq/dk/dv (the default's spread is recorded, for information)."""
    import jax
    import jax.numpy as jnp
    rows, ok_all = [], True
    for name, kw, (B, T, S, N, K, ex) in DETERMINISM:
        dog = start_watchdog(name)
        fcfg, bcfg = _configs(kw)
        ks = jax.random.split(jax.random.key(int.from_bytes(os.urandom(4), "little")), 4)
        H = bcfg.head_dim
        q, do = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
                 for kk in (ks[0], ks[3]))
        k, v = (jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(jnp.bfloat16)
                for kk in (ks[1], ks[2]))
        row = {"name": name, "config": bcfg.key}
        try:
            f = jax.jit(lambda q, k, v, do: ours_grads(q, k, v, do, fcfg, bcfg, 1 / np.sqrt(H),
                                                       window=ex.get("window")))
            outs = [[np.asarray(x.astype(jnp.float32)) for x in f(q, k, v, do)]
                    for _ in range(runs)]
            for i, nm in enumerate(("dq", "dk", "dv")):
                row[f"{nm}_bitwise_equal"] = all(np.array_equal(o[i], outs[0][i]) for o in outs)
                row[f"{nm}_max_spread"] = float(max(np.abs(o[i] - outs[0][i]).max()
                                                    for o in outs))
                row[f"{nm}_nan"] = int(np.isnan(outs[0][i]).sum())
            row["ok"] = bool(not bcfg.deterministic or all(
                row[f"{nm}_bitwise_equal"] and row[f"{nm}_nan"] == 0 for nm in ("dq", "dk", "dv")))
        except Exception as e:
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        ok_all &= finish_case(dog, row, rows, out_path)
    return ok_all


# `segbench`: the backward with segment ids (8 equal documents) and with ALiBi vs the dense
# one at B=1, S=16k, N=16 (forward + backward of our kernels, direct calls, same inputs).
# The 8-document case does ~1/8 of the dense work (block skipping): its time should be well
# under the dense one's.
SEG_BENCH_SHAPE = (1, 16384, 16)  # B, S, N
SEG_BENCH = [("dense", 128, {}), ("docs8", 128, dict(has_segments=True)),
             ("dense", 64, {}), ("alibi", 64, dict(has_alibi=True)),
             ("docs8 alibi", 64, dict(has_segments=True, has_alibi=True))]


def _seg_bench_launches():
    out = []
    for _, D, kw in SEG_BENCH:
        for causal in (False, True):
            f, b = _configs(dict(head_dim=D, is_causal=causal, **kw))
            out += [fwd_launch(f), bwd_launch(b)]
    return out


def segbench(out_path: str) -> None:
    import jax
    import jax.numpy as jnp
    B, S, N = SEG_BENCH_SHAPE
    rows = []
    for name, D, kw in SEG_BENCH:
        for causal in (False, True):
            fcfg, bcfg = _configs(dict(head_dim=D, is_causal=causal, **kw))
            q, k, v, do, _, _ = fresh_inputs(B, S, S, N, N, D, "bfloat16", {}, with_do=True)
            scale = 1.0 / np.sqrt(D)
            slopes = (2.0 ** (-8.0 * np.arange(1, N + 1) / N)).astype(np.float32) \
                if bcfg.has_alibi else None
            seg = (np.repeat(np.arange(8), S // 8)[None].astype(np.int32)
                   if bcfg.has_segments else None)
            f = jax.jit(lambda q, k, v, do, sl, sg: ours_grads(
                q, k, v, do, fcfg, bcfg, scale, alibi_slopes=sl, q_seg=sg, kv_seg=sg))
            row = {"name": name, "D": D, "S": S, "causal": causal, "config": bcfg.key}
            try:
                row["fwd_bwd_ms"] = _time(f, (q, k, v, do, slopes, seg)) * 1e3
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            record_row(row, rows, out_path)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["build", "check", "bench", "determinism", "segbench"])
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="bench points 'D:S:causal,...'")
    p.add_argument("--cases", default="", help="check cases by name, ';'-separated")
    a = p.parse_args(argv)
    cases = {c for c in a.cases.split(";") if c} or None
    if a.cmd == "build":
        build(a.out, cases)
    elif a.cmd == "check":
        sys.exit(0 if check(a.out, cases) else 1)
    elif a.cmd == "determinism":
        sys.exit(0 if determinism(a.out) else 1)
    elif a.cmd == "segbench":
        segbench(a.out)
    else:
        only = {tuple(int(x) for x in s.split(":")) for s in a.only.split(",") if s}
        bench(a.out, {(d, s, bool(c)) for d, s, c in only} or None)


if __name__ == "__main__":
    main()
