"""Custom attention on the GPU: the issue's measurements of mods and block sparsity.

    python3 -m benchmarks.mods_bench --out benchmarks/results            # every case (H200)
    python3 -m benchmarks.mods_bench --cases alibi --mode fwd --quick    # seconds, also on CPU

Cases (bf16, head dim 128, 16 heads, B x S = 16k tokens at 16k, 2 x 8k at 8k):

- ``document``: causal document masking, 8 documents of random lengths per 16k sequence;
- ``window``: causal sliding window of 1024 keys at S = 16k;
- ``t5``: T5 relative position bias (32 buckets, learnable table) at S = 8k;
- ``alibi``: ALiBi (learnable slopes) at S = 8k.

Implementations per case (each one that applies; one that cannot run is recorded with its
error text and the run goes on):

- ``pallas-mods``: our Pallas kernels with the mod (block mask where the mod masks);
- ``pallas-mods-dense``: the same without the block mask (every tile visited, mask evaluated);
- ``pallas-builtin``: the built-in argument that means the same (is_causal, segment ids,
  local_window_size, alibi_slopes), where one exists;
- ``cute-mods`` / ``cute-builtin``: the CuTe kernels with the mod / the built-in (with the mod
  they refuse until the kernels translate mods; the refusal is recorded);
- ``cudnn-dense``: `jax.nn.dot_product_attention(implementation="cudnn")` given the
  equivalent dense bias (a mask as 0 / most-negative bf16; materialized once, outside the
  timing);
- ``cudnn-native``: cuDNN's own sliding window, where it has one;
- ``xla`` (``--with-xla``): our reference (materializes T x S; only at S <= 8192).

``fwdbwd`` differentiates q, k and v (``pallas-mods+aux`` adds the aux gradient). TFLOP/s
count the dense 4 B N T S D (x 3.5 forward+backward, halved where causal), and for block-sparse
cases also over the visited tiles only (``tflops_tiles``: the block mask's density).
Checks: every output against the case's first row (``pallas-mods-dense``, else
``pallas-mods``) on the same inputs, relative L2 (``xla``, where it runs, checks that one in
turn; the CPU tests check the kernels against the reference). Under ``--budget-s`` the forward
of every case runs first, then forward+backward, each case's rows in a fixed priority order;
what the budget leaves out is recorded as skipped. Writes NAME.json (rows, GPU, date, versions) and
NAME.md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import mods
from benchmarks import envinfo
from benchmarks.timing import time_throughput

CASES = ("document", "window", "t5", "alibi")


def _as_bias(mask):
    """A [S, S] boolean mask as cuDNN's dense operand: a bf16 bias [1, 1, S, S], 0 where kept
    and the most negative bf16 elsewhere (what jax.nn does with a mask, here done once, outside
    the timing)."""
    neg = jnp.finfo(jnp.bfloat16).min
    return dict(bias=jnp.where(mask, 0.0, neg).astype(jnp.bfloat16)[None, None])


def _case(name, quick, rng):
    """(B, S, causal, mod kwargs, builtin kwargs or None, dense mask/bias builder, block mask
    builder or None)."""
    N, D = 16, 128
    S = {"document": 16384, "window": 16384, "t5": 8192, "alibi": 8192}[name]
    if quick:
        N, D, S = 2, 64, 512
    B = max(1, 16384 // S) if not quick else 1
    c = dict(name=name, B=B, S=S, N=N, D=D)
    if name == "document":
        cuts = np.sort(rng.choice(np.arange(1, S), 7, replace=False))
        ids = np.searchsorted(cuts, np.arange(S), side="right").astype(np.int32)
        ids = jnp.asarray(np.broadcast_to(ids, (B, S)))
        mm = mods.and_masks(mods.causal(), mods.document(0))
        c.update(causal=True, mods=dict(mask_mod=mm, aux=(ids,)),
                 builtin=dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids),
                 dense=lambda: _as_bias(jnp.tril(jnp.ones((S, S), bool))
                                        & (ids[0][:, None] == ids[0][None, :])),
                 block=lambda: mods.create_block_mask(mm, 1, 1, S, S, (128, 128), aux=(ids,)),
                 docs=[int(x) for x in np.diff(np.r_[0, cuts, S])])
    elif name == "window":
        w = 1024 if not quick else 64
        mm = mods.sliding_window(w, 0)
        ii = jnp.arange(S)
        c.update(causal=True, mods=dict(mask_mod=mm),
                 builtin=dict(local_window_size=(w, 0)),
                 dense=lambda: _as_bias((ii[None, :] <= ii[:, None])
                                        & (ii[None, :] >= ii[:, None] - w)),
                 native=dict(local_window_size=(w, 0), is_causal=True),
                 block=lambda: mods.create_block_mask(mm, 1, 1, S, S, (128, 128)))
    elif name == "t5":
        table = jnp.asarray(rng.standard_normal((32, N)).astype(np.float32))
        ii = jnp.arange(S)
        c.update(causal=False, mods=dict(score_mod=mods.t5_bias(0), aux=(table,)), builtin=None,
                 dense=lambda: dict(bias=jnp.moveaxis(
                     table[mods.t5_bucket(ii[None, :] - ii[:, None])], -1, 0)[None].astype(
                         jnp.bfloat16)),
                 block=None)
    else:
        slopes = mods.alibi_slopes(N)
        ii = jnp.arange(S, dtype=jnp.float32)
        c.update(causal=False, mods=dict(score_mod=mods.alibi(0), aux=(slopes,)),
                 builtin=dict(alibi_slopes=slopes),
                 dense=lambda: dict(bias=(-slopes[:, None, None]
                                          * jnp.abs(ii[:, None] - ii[None, :]))[None].astype(
                                              jnp.bfloat16)),
                 block=None)
    return c


def _impls(c, have_gpu):
    """name -> attn(q, k, v, aux, extra) -> out; extra holds the dense operands / block mask."""
    S = c["S"]
    mk = c["mods"]
    fa = jaxflash.flash_attention
    out = {}

    def with_aux(kw, aux):
        return dict(kw, aux=aux) if "aux" in kw else kw

    out["pallas-mods"] = lambda q, k, v, aux, ex: fa(q, k, v, implementation="pallas",
                                                     block_mask=ex.get("block"),
                                                     **with_aux(mk, aux))
    if c["block"] is not None:
        out["pallas-mods-dense"] = lambda q, k, v, aux, ex: fa(q, k, v, implementation="pallas",
                                                               **with_aux(mk, aux))
    if c["builtin"] is not None:
        out["pallas-builtin"] = lambda q, k, v, aux, ex: fa(q, k, v, implementation="pallas",
                                                            **c["builtin"])
    out["cute-mods"] = lambda q, k, v, aux, ex: fa(q, k, v, implementation="cute",
                                                   block_mask=ex.get("block"),
                                                   **with_aux(mk, aux))
    if c["builtin"] is not None:
        out["cute-builtin"] = lambda q, k, v, aux, ex: fa(q, k, v, implementation="cute",
                                                          **c["builtin"])
    out["cudnn-dense"] = lambda q, k, v, aux, ex: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn", bias=ex.get("bias"), mask=ex.get("mask"))
    if "native" in c:
        out["cudnn-native"] = lambda q, k, v, aux, ex: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn", **c["native"])
    if S <= 8192:
        out["xla"] = lambda q, k, v, aux, ex: fa(q, k, v, implementation="xla",
                                                 **with_aux(mk, aux))
    if not have_gpu:
        out = {n: f for n, f in out.items() if not n.startswith(("cute", "cudnn"))}
    return out


def _flops(c, mode, density=None):
    f = 4.0 * c["B"] * c["N"] * c["S"] * c["S"] * c["D"]
    if c["causal"]:
        f /= 2
    if mode == "fwdbwd":
        f *= 3.5
    tiles = None
    if density is not None:
        tiles = 4.0 * c["B"] * c["N"] * c["S"] * c["S"] * c["D"] * density * (
            3.5 if mode == "fwdbwd" else 1.0)
    return f, tiles


def _rel_l2(x, ref):
    x = np.asarray(x.astype(jnp.float32), np.float64)
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


_PRIORITY = ("pallas-mods-dense", "pallas-mods", "cute-mods", "cudnn-dense", "cute-builtin",
             "pallas-builtin", "cudnn-native", "pallas-mods+aux", "xla")


def _setup(name, args, rng, have_gpu):
    """One case's inputs, dense operands, block mask and implementations (made once)."""
    c = _case(name, args.quick, rng)
    shape = (c["B"], c["S"], c["N"], c["D"])
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(
        jnp.bfloat16) for _ in range(4))
    extra = c["dense"]() if have_gpu or args.quick else {}
    density = None
    if c["block"] is not None:
        bm = jax.jit(c["block"])()
        extra["block"] = bm
        density = float(jax.device_get(bm.density())[0, 0])
    impls = _impls(c, have_gpu)
    if not args.with_xla and not args.quick:
        impls.pop("xla", None)
    return dict(c=c, q=q, k=k, v=v, do=do, aux=c["mods"].get("aux", ()), extra=extra,
                density=density, impls=impls)


def _programs(st, mode):
    """name -> jitted program of one mode (fwd: the output; fwdbwd: dq, dk, dv [, daux])."""
    c, do, fns = st["c"], st["do"], {}
    for iname, attn in st["impls"].items():
        if mode == "fwd":
            fns[iname] = jax.jit(lambda q, k, v, aux, ex, attn=attn: attn(q, k, v, aux, ex))
        else:
            def g(q, k, v, aux, ex, attn=attn):
                _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, aux, ex), q, k, v)
                return vjp(do)
            fns[iname] = jax.jit(g)
    aux = st["aux"]
    if mode == "fwdbwd" and any(jnp.issubdtype(a.dtype, jnp.floating) for a in aux):
        mk = c["mods"]

        def g_aux(q, k, v, aux, ex):
            f = lambda q, k, v, aux: jaxflash.flash_attention(
                q, k, v, implementation="pallas", block_mask=ex.get("block"),
                **dict(mk, aux=aux))
            _, vjp = jax.vjp(f, q, k, v, aux)
            return vjp(do)
        fns["pallas-mods+aux"] = jax.jit(g_aux)
    return {n: fns[n] for n in sorted(fns, key=_PRIORITY.index)}


def run(args):
    """Forward of every case first, then forward+backward: under the time budget the most
    telling rows of each case come first (the reference row, the mods, cuDNN, built-ins)."""
    have_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(args.seed)
    rows = []
    t_start = time.time()
    setups = {}
    for mode in args.mode:
        for name in args.cases:
            if time.time() - t_start > args.budget_s:
                rows.append(dict(case=name, mode=mode, impl="*", status="skipped",
                                 error="time budget"))
                continue
            if name not in setups:
                setups[name] = _setup(name, args, rng, have_gpu)
            st = setups[name]
            c = st["c"]
            flops, flops_tiles = _flops(c, mode, st["density"])
            fns = _programs(st, mode)
            ref_name = next(iter(fns))
            baseline = None
            args_ = (st["q"], st["k"], st["v"], st["aux"], st["extra"])
            for iname, fn in fns.items():
                row = dict(case=name, impl=iname, mode=mode, B=c["B"], S=c["S"], N=c["N"],
                           D=c["D"], causal=c["causal"], density=st["density"],
                           docs=c.get("docs"))
                if time.time() - t_start > args.budget_s:
                    rows.append(dict(row, status="skipped", error="time budget"))
                    continue
                try:
                    t0 = time.time()
                    out = jax.block_until_ready(fn(*args_))
                    row["compile_s"] = round(time.time() - t0, 2)
                    first = out if mode == "fwd" else out[0]
                    if not bool(jnp.all(jnp.isfinite(first.astype(jnp.float32)))):
                        rows.append(dict(row, status="wrong", error="non-finite output"))
                        continue
                    if iname == ref_name:
                        baseline = first
                    elif baseline is not None:
                        row["rel_l2_vs_" + ref_name] = _rel_l2(first, baseline)
                    t = time_throughput(fn, args_, reps=args.reps)
                    row.update(status="ok", ms=t.median_s * 1e3, ms_min=t.min_s * 1e3,
                               ms_max=t.max_s * 1e3, tflops=flops / t.median_s / 1e12)
                    if (flops_tiles is not None and iname in ("pallas-mods", "cute-mods",
                                                              "pallas-mods+aux")):
                        row["tflops_tiles"] = flops_tiles / t.median_s / 1e12
                except Exception as e:  # noqa: BLE001 - record and go on
                    row.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
                rows.append(row)
                print(_line(row), flush=True)
            del fns
    return rows


def build(args):
    """Here, without a GPU: lower the cute rows' programs for CUDA (sm_90a), which compiles the
    CuTe variants they dispatch to into ``$JAXFLASH_CACHE_DIR`` (the GPU machine has no DSL;
    point its JAXFLASH_KERNEL_DIR at the cache's ``cute-dsl-<version>/``)."""
    os.environ.setdefault("JAXFLASH_CUTE_UNVERIFIED", "1")
    rng = np.random.default_rng(0)
    for name in args.cases:
        c = _case(name, args.quick, rng)
        shape = (c["B"], c["S"], c["N"], c["D"])
        sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        aux = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                           c["mods"].get("aux", ()))
        extra = {} if c["block"] is None else {"block": jax.eval_shape(c["block"])}
        impls = {n: f for n, f in _impls(c, True).items() if n.startswith("cute")}
        for iname, attn in impls.items():
            for mode in args.mode:
                def fn(q, k, v, aux, ex, attn=attn, mode=mode):
                    if mode == "fwd":
                        return attn(q, k, v, aux, ex)
                    _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, aux, ex), q, k, v)
                    return vjp(q)
                t0 = time.time()
                try:
                    with jaxflash.target_platform("cuda"):
                        jax.jit(fn).trace(sds, sds, sds, aux, extra).lower(
                            lowering_platforms=("cuda",))
                    print(f"built {name} {iname} {mode} ({time.time() - t0:.0f} s)", flush=True)
                except Exception as e:  # noqa: BLE001 - say which, go on
                    print(f"FAILED {name} {iname} {mode}: {type(e).__name__}: {str(e)[:300]}",
                          flush=True)


def _line(r):
    if r.get("status") != "ok":
        return (f"{r['case']:9s} {r['mode']:7s} {r['impl']:18s} {r['status']}: "
                f"{r.get('error', '')[:160]}")
    extra = f"  tiles {r['tflops_tiles']:.0f}" if "tflops_tiles" in r else ""
    chk = "".join(f"  rel_l2 {v:.1e}" for k, v in r.items() if k.startswith("rel_l2"))
    return (f"{r['case']:9s} {r['mode']:7s} {r['impl']:18s} {r['ms']:9.3f} ms "
            f"{r['tflops']:7.1f} TFLOP/s{extra}{chk}")


def _markdown(env, rows):
    lines = [f"# Custom attention (mods) on {env.get('device')}",
             "", f"{env.get('date_utc')}, jax {env.get('jax')}, cuDNN {env.get('cudnn')}, "
             f"commit {env.get('commit')}", "",
             "| case | mode | impl | ms | TFLOP/s | TFLOP/s over visited tiles | vs pallas-mods | "
             "rel. L2 | status |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((x for x in rows if x["case"] == r["case"] and x["mode"] == r["mode"]
                     and x["impl"] == "pallas-mods" and x.get("status") == "ok"), None)
        ratio = (f"{base['ms'] / r['ms']:.2f}x" if base and r.get("status") == "ok" else "")
        chk = next((f"{v:.1e}" for k, v in r.items() if k.startswith("rel_l2")), "")
        lines.append(
            f"| {r['case']} | {r['mode']} | {r['impl']} | "
            f"{r.get('ms', float('nan')):.3f} | {r.get('tflops', float('nan')):.1f} | "
            f"{r.get('tflops_tiles', float('nan')):.1f} | {ratio} | {chk} | "
            f"{r.get('status')} {r.get('error', '')[:80]} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--mode", default="fwd,fwdbwd")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--with-xla", action="store_true",
                    help="also time the reference (materializes T x S; S <= 8192 only)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default=None)
    ap.add_argument("--build", action="store_true",
                    help="no GPU needed: compile the cute rows' CuTe variants into "
                         "$JAXFLASH_CACHE_DIR by lowering for CUDA, then exit")
    a = ap.parse_args(argv)
    a.cases = [x for x in a.cases.split(",") if x]
    a.mode = [x for x in a.mode.split(",") if x]
    a.seed = a.seed if a.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    bad = [x for x in a.cases if x not in CASES]
    if bad:
        ap.error(f"unknown cases {bad}; choose from {CASES}")
    if a.build:
        build(a)
        return
    env = envinfo.collect()
    rows = run(a)
    name = a.name or f"mods-{jax.default_backend()}-{env['date_utc'][:10]}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, name + ".json"), "w") as f:
        json.dump(dict(env=env, seed=a.seed, args=vars(a), rows=rows), f, indent=1)
    with open(os.path.join(a.out, name + ".md"), "w") as f:
        f.write(_markdown(env, rows))
    print(f"wrote {os.path.join(a.out, name)}.json / .md")


if __name__ == "__main__":
    main()
