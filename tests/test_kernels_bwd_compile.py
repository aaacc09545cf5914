"""The Hopper backward kernel compiles for sm_90a without a GPU over a matrix covering every
supported head dim, both dtypes and every mask feature at least once; its PTX holds the wgmma
shapes, TMA, exp2 and dQ atomics the design relies on and ptxas does not serialize its wgmma;
unsupported variants are refused with a reason; and jax.grad through
``flash_attention(implementation="cute")`` lowers for CUDA to the forward and backward custom
calls with no T x S tensor (numerics run on the GPU: ``python -m devtools.bwd_devrun``).

Each compile takes 1-3 s on 2 cores (+ under a second of ptxas); the module about 40 s.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before the DSL is imported anywhere

from jaxflash.kernels.policy import verified  # noqa: E402
from jaxflash.kernels.variants.bwd import BwdConfig, can_implement  # noqa: E402
from jaxflash.kernels.policy.choose import backward_config as config_for  # noqa: E402
from tests.common import ptxas_report, runtime_only  # noqa: E402

cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")

MATRIX = [
    BwdConfig(dtype="bfloat16", head_dim=64),
    BwdConfig(dtype="bfloat16", head_dim=64, is_causal=True),
    BwdConfig(dtype="float16", head_dim=96, has_window=True, has_softcap=True),
    BwdConfig(dtype="bfloat16", head_dim=128),
    BwdConfig(dtype="bfloat16", head_dim=128, is_causal=True),
    BwdConfig(dtype="float16", head_dim=128, is_causal=True, has_window=True,
              has_q_seqlen=True, has_kv_seqlen=True),
    BwdConfig(dtype="bfloat16", head_dim=128, has_softcap=True, has_kv_seqlen=True,
              num_stages=1),
    # dQ adds ordered by key block (semaphores)
    BwdConfig(dtype="bfloat16", head_dim=128, is_causal=True, has_window=True,
              deterministic=True),
    # early_dv: P^T / dV before dS^T (hd 128's pick)
    BwdConfig(dtype="bfloat16", head_dim=128, early_dv=True),
    BwdConfig(dtype="bfloat16", head_dim=128, is_causal=True, has_window=True,
              has_q_seqlen=True, has_kv_seqlen=True, early_dv=True),
    # dq_flat (fragment-ordered dQ tile, one bulk reduce): both kernels; hd 128's dense and
    # causal picks (with tail_lpt), deterministic
    BwdConfig(dtype="bfloat16", head_dim=128, early_dv=True, dq_flat=True),
    BwdConfig(dtype="bfloat16", head_dim=128, is_causal=True, early_dv=True, dq_flat=True,
              tail_lpt=True),
    BwdConfig(dtype="bfloat16", head_dim=128, is_causal=True, deterministic=True,
              dq_flat=True),
    BwdConfig(dtype="bfloat16", head_dim=256, is_causal=True, dq_flat=True),
    # Head dims 192 / 256: FlashBwdSm90Wide (tile_n 64, the warpgroups split the head dim)
    BwdConfig(dtype="bfloat16", head_dim=256),
    BwdConfig(dtype="bfloat16", head_dim=256, is_causal=True),
    BwdConfig(dtype="float16", head_dim=256, is_causal=True, has_window=True,
              has_softcap=True, has_q_seqlen=True, has_kv_seqlen=True),
    BwdConfig(dtype="bfloat16", head_dim=256, is_causal=True, has_window=True,
              deterministic=True),
    BwdConfig(dtype="bfloat16", head_dim=192, is_causal=True),
    BwdConfig(dtype="float16", head_dim=192, has_window=True, has_softcap=True,
              has_q_seqlen=True, has_kv_seqlen=True),
    BwdConfig(dtype="bfloat16", head_dim=192, has_kv_seqlen=True, dq_flat=True),
    # ALiBi (with its d(slopes) partials) and segment ids (block skipping + element compare)
    BwdConfig(dtype="bfloat16", head_dim=64, has_alibi=True),
    BwdConfig(dtype="float16", head_dim=96, has_segments=True, has_kv_seqlen=True),
    BwdConfig(dtype="float16", head_dim=96, is_causal=True, has_alibi=True, early_dv=True),
    BwdConfig(dtype="float16", head_dim=96, is_causal=True, has_alibi=True),
    BwdConfig(dtype="float16", head_dim=96, has_alibi=True, has_segments=True, early_dv=True,
              has_kv_seqlen=True),
    BwdConfig(dtype="float16", head_dim=128, is_causal=True, has_segments=True),
    BwdConfig(dtype="bfloat16", head_dim=64, is_causal=True, has_alibi=True, has_segments=True),
    BwdConfig(dtype="bfloat16", head_dim=96, is_causal=True, has_window=True, has_alibi=True,
              has_segments=True, has_q_seqlen=True),
    # 128 queries per step (hd 64's pick; the dQ GEMM split by query rows, unswizzled dQ slabs
    # or the fragment-ordered tile)
    BwdConfig(dtype="bfloat16", head_dim=64, tile_m=128),
    BwdConfig(dtype="bfloat16", head_dim=64, tile_m=128, is_causal=True),
    BwdConfig(dtype="float16", head_dim=64, tile_m=128, is_causal=True, has_window=True,
              has_q_seqlen=True, has_kv_seqlen=True),
    BwdConfig(dtype="bfloat16", head_dim=64, tile_m=128, is_causal=True, has_window=True,
              deterministic=True),
    BwdConfig(dtype="float16", head_dim=64, tile_m=128, has_q_seqlen=True),
    BwdConfig(dtype="bfloat16", head_dim=64, tile_m=128, is_causal=True, has_segments=True),
    BwdConfig(dtype="bfloat16", head_dim=64, tile_m=128, dq_flat=True),
    BwdConfig(dtype="bfloat16", head_dim=64, tile_m=128, is_causal=True, dq_flat=True,
              tail_lpt=True),
    # q_multicast: key-block pairs in a cluster, Q / dO halves multicast
    BwdConfig(dtype="bfloat16", head_dim=256, dq_flat=True, q_multicast=True, is_causal=True,
              tail_lpt=True),
    BwdConfig(dtype="float16", head_dim=128, early_dv=True, dq_flat=True, q_multicast=True,
              has_q_seqlen=True, has_kv_seqlen=True),
]


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_compiles_for_sm90a(cfg, tmp_path):
    from devtools.bwd_standalone import compile_bwd
    compile_bwd(cfg, arch="sm_90a", dump_dir=str(tmp_path))
    ptx_files = glob.glob(str(tmp_path / "*.ptx"))
    assert ptx_files, "no PTX dumped"
    ptx = open(ptx_files[0]).read()
    assert ".target sm_90a" in ptx
    # q_multicast: Q / dO loads multicast into the pair, stage releases arrive in both CTAs,
    # and the CTAs leave through a cluster barrier; nothing of it in any other variant.
    mc = ptx.count("multicast::cluster")
    if cfg.q_multicast:
        assert mc >= 2 and "mbarrier.arrive.shared::cluster" in ptx, mc
        assert "barrier.cluster.wait" in ptx
    else:
        assert mc == 0 and "barrier.cluster" not in ptx
    dt = "bf16" if cfg.dtype == "bfloat16" else "f16"
    wg = f"wgmma.mma_async.sync.aligned.m64n{{}}k16.f32.{dt}.{dt}"
    if cfg.split == "keys":
        assert wg.format(cfg.tile_m) in ptx  # S^T = K Q^T and dP^T = V dO^T (N = queries)
        assert wg.format(cfg.head_dim) in ptx  # dK += dS^T Q, dV += P^T dO (N = head dim)
        # dQ = dS K: tile_m 64 splits the head dim over the 2 WGs, tile_m 128 the query rows
        assert wg.format(cfg.head_dim // 2 if cfg.tile_m == 64 else cfg.head_dim) in ptx
        if cfg.tile_m == 128 and not cfg.dq_flat:
            assert ptx.count("cp.reduce.async.bulk.tensor") == cfg.head_dim // 8  # 8-col slabs
    else:  # FlashBwdSm90Wide: S^T / dP^T split by query halves, every other GEMM by hd halves
        shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
        assert shapes == {str(cfg.tile_m // 2), str(cfg.head_dim // 2)}, shapes
        assert ".shared" in ptx and "wgmma" in ptx
    red = bool(re.search(r"red(\.relaxed)?(\.gpu)?\.global\.add\.f32", ptx))
    tma_reduce = "cp.reduce.async.bulk.tensor" in ptx and ".add." in ptx
    # dq_flat: one flat bulk reduce of the fragment-ordered tile per step, no tensor-map
    # reduce at all; else TMA reduce-adds; never per-element atomics
    flat = ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32")
    assert flat == (1 if cfg.dq_flat else 0), flat
    assert not red and tma_reduce != cfg.dq_flat
    assert "cp.async.bulk.tensor" in ptx and "ex2.approx" in ptx and "setmaxnreg" in ptx
    assert "stmatrix" in ptx  # dS^T and the dK/dV epilogue through shared memory
    assert re.search(r"bar\.sync\s+3, 256;", ptx)  # BAR_DQ: dQ staged, the reduce may read it
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ("tanh.approx" in ptx) == cfg.has_softcap
    ordered = "ld.acquire.gpu.global" in ptx and "red.release.gpu.global.add" in ptx
    assert ordered == cfg.deterministic
    report = ptxas_report(ptx, tmp_path)
    if report is not None:
        assert "C7512" not in report, "ptxas serialized the wgmma (insufficient registers)"
        assert "instructions are serialized" not in report, report  # C7514 and the like
        # C7517: a wgmma wait ptxas inserted on its own (an extra WARPGROUP.DEPBAR in the
        # loop): what zeroing the dP^T accumulator while S^T is in flight caused.
        assert "C7517" not in report, report
        # Every function (the zero-fill kernel too): no spills (each function's line counts,
        # not just one " 0 bytes spill stores", which the zero-fill kernel always has).
        # Known: deterministic hd 128 causal + window spills 4 bytes.
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        allowed = 4 if (cfg.deterministic and cfg.head_dim == 128 and cfg.has_window) else 0
        assert spills and max(spills) <= allowed, report


def test_refusals_name_the_reason():
    for kw, why in [(dict(head_dim=320), "head_dim 320"), (dict(head_dim=160), "head_dim 160"),
                    (dict(head_dim=256, tile_n=128), "tile_n 128 must be 64"),
                    (dict(head_dim=256, num_stages=2), "shared memory"),
                    (dict(head_dim=256, early_dv=True), "early_dv"),
                    (dict(head_dim=128, head_dim_v=64), "head_dim_v"),
                    (dict(dtype="float32"), "dtype"), (dict(tile_m=128), "tile_m"),
                    (dict(tile_n=64), "tile_n"), (dict(num_stages=5), "num_stages"),
                    (dict(head_dim=128, has_softcap=True, early_dv=True), "early_dv"),
                    (dict(head_dim=64, tile_m=96), "tile_m 96"),
                    (dict(head_dim=128, tile_m=80), "tile_m 80"),
                    (dict(head_dim=96, tile_m=128), "tile_m 128 at head_dim 96"),
                    (dict(head_dim=256, tile_m=128), "tile_m 128 at head_dim 256"),
                    (dict(head_dim=64, tile_m=128, has_softcap=True), "softcap"),
                    (dict(head_dim=64, tile_m=128, has_alibi=True), "alibi"),
                    (dict(head_dim=64, tile_m=128, early_dv=True), "early_dv"),
                    (dict(head_dim=128, tail_lpt=True), "tail_lpt"),
                    (dict(head_dim=256, has_window=True, q_multicast=True), "q_multicast"),
                    (dict(head_dim=256, deterministic=True, q_multicast=True), "q_multicast")]:
        with pytest.raises(ValueError, match=why):
            BwdConfig(**kw)
    assert can_implement(dtype="bfloat16", head_dim=128,
                         features=("causal", "window", "softcap", "seq_lengths")) == (True, "")
    assert can_implement(dtype="bfloat16", head_dim=64,
                         features=("causal", "alibi", "segment_ids")) == (True, "")
    for facts, why in [(dict(features=("bias",)), "bias"),
                       (dict(features=("mask",)), "mask"),
                       (dict(head_dim=320), "head dim 320"),
                       (dict(head_dim_v=64), "value head dim")]:
        ok, reason = can_implement(**{"dtype": "bfloat16", "head_dim": 128, **facts})
        assert not ok and why in reason


def test_config_for_problem():
    from jaxflash._types import AttentionStatics, Problem
    st = AttentionStatics(scale=0.1, is_causal=True, window=(8, 0), softcap=5.0)
    p = Problem(batch=2, q_len=10, kv_len=12, num_heads=4, num_kv_heads=2, head_dim=96,
                head_dim_v=96, dtype="float16", statics=st, has_q_seqlen=True)
    cfg = config_for(p)
    assert (cfg.dtype, cfg.head_dim, cfg.is_causal, cfg.has_window, cfg.has_softcap,
            cfg.has_q_seqlen, cfg.has_kv_seqlen) == ("float16", 96, True, True, True, True, False)
    det = config_for(Problem(**{**p.__dict__, "statics": AttentionStatics(scale=0.1,
                                                                         deterministic=True)}))
    assert det.deterministic and not cfg.deterministic and det.key != cfg.key
    with pytest.raises(ValueError, match="empty"):
        config_for(Problem(**{**p.__dict__, "kv_len": 0}))


def test_wide_head_dims_pick_the_head_dim_split_kernel():
    """hd 192 / 256: tile_n 64, the wide kernel, and the most Q / dO stages that fit (hd 256
    beside the float32 dQ tile in shared memory: 1); hd <= 128 unchanged."""
    from jaxflash.kernels.variants.bwd import SMEM_LIMIT_BYTES
    from jaxflash.kernels.variants.bwd_launch import WIDE_KERNEL_REF, KERNEL_REF, bwd_launch
    for hd, stages in [(192, 2), (256, 1)]:
        c = BwdConfig(head_dim=hd)
        assert (c.split, c.tile_n, c.num_stages) == ("headdim", 64, stages), c
        assert c.smem_bytes() <= SMEM_LIMIT_BYTES
        assert bwd_launch(c, "sm_90a").kernel == WIDE_KERNEL_REF
    c = BwdConfig(head_dim=128)
    assert (c.split, c.tile_n, c.num_stages) == ("keys", 128, 2)
    assert bwd_launch(c, "sm_90a").kernel == KERNEL_REF
    assert can_implement(dtype="float16", head_dim=256,
                         features=("causal", "window", "softcap", "seq_lengths")) == (True, "")


def test_variant_keys_differ():
    assert len({c.key for c in MATRIX}) == len(MATRIX)


def test_tile_m_128_is_keyed_and_picked_at_hd_64():
    """tile_m 128 is keyed, checked (not gated), what dispatch picks at hd 64 unless softcap or
    ALiBi (which it refuses), and its LSE / delta padding and semaphore / segment-summary
    counts follow its 128-query blocks."""
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.variants.bwd import SMEM_LIMIT_BYTES
    from jaxflash.kernels.variants.bwd_launch import num_q_blocks, padded_len
    c, d = BwdConfig(head_dim=64, tile_m=128), BwdConfig(head_dim=64)
    assert "_t128x128" in c.key and "_t64x128" in d.key
    assert verified.pending(c) == () and verified.pending(d) == ()
    assert c.num_stages == 2 and c.smem_bytes() <= SMEM_LIMIT_BYTES
    p = Problem(batch=2, q_len=300, kv_len=300, num_heads=4, num_kv_heads=4, head_dim=64,
                head_dim_v=64, dtype="bfloat16", statics=AttentionStatics(scale=0.1))
    assert config_for(p).tile_m == 128
    for kw, tm in ((dict(softcap=30.0), 64), (dict(is_causal=True, deterministic=True), 128)):
        st = AttentionStatics(scale=0.1, **kw)
        assert config_for(dataclasses.replace(p, statics=st)).tile_m == tm, kw
    assert config_for(dataclasses.replace(p, has_alibi=True)).tile_m == 64
    assert config_for(dataclasses.replace(p, head_dim=128, head_dim_v=128)).tile_m == 64
    assert [padded_len(t, d) for t in (1, 64, 65, 300)] == [64, 64, 128, 320]
    assert [padded_len(t, c) for t in (1, 64, 65, 300)] == [128, 128, 128, 384]
    assert (num_q_blocks(300, d), num_q_blocks(300, c)) == (5, 3)


# -- wiring through the backend ----------------------------------------------------------------
@pytest.fixture
def cuda_env(tmp_path_factory, monkeypatch):
    import jax
    from jaxflash.ffi import cache
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path_factory.mktemp("jf_bwd_cache")))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    monkeypatch.delenv(cache.ENV_NO_DSL, raising=False)
    jax.clear_caches()
    yield


def _shapes(B=2, T=100, S=130, N=4, K=2, H=64):
    import jax
    import jax.numpy as jnp
    return (jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16))


def _grad_fn(**kw):
    import jax
    import jax.numpy as jnp
    import jaxflash

    def loss(q, k, v):
        o = jaxflash.flash_attention(q, k, v, implementation="cute", **kw)
        return o.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))


def _explain(qkv=None, **kw):
    import jaxflash
    with jaxflash.target_platform("cuda"):
        return str(jaxflash.explain(*(qkv or _shapes()), implementation="cute", **kw))


def test_explain_names_the_backward(cuda_env, monkeypatch):
    from jaxflash.kernels.policy import verified
    assert "backward: CuTe kernel FlashBwdSm90" in _explain(is_causal=True)
    assert "_det_causal" in _explain(is_causal=True, deterministic=True)
    # The wide kernel (checked on the H200) runs by default, no switch needed.
    monkeypatch.delenv(verified.ENV, raising=False)
    for H in (192, 256):
        text = _explain(_shapes(H=H), is_causal=True)
        assert f"backward: CuTe kernel FlashBwdSm90Wide (bwd_sm90_bfloat16_h{H}" in text, text
    # Still refused (and said why) at the wide head dims: what the backward does not implement.
    import jax.numpy as jnp
    text = _explain(_shapes(H=256), alibi_slopes=jnp.ones((4,), jnp.float32))
    assert "backward: Pallas" in text and "alibi" in text, text


def test_grad_lowers_to_forward_and_backward_custom_calls(cuda_env):
    import jax
    import jaxflash
    from jaxflash import ffi
    B, T, S = 2, 100, 130
    with jaxflash.target_platform("cuda"):
        low = jax.jit(_grad_fn(is_causal=True, local_window_size=(40, 3),
                               softcap=4.0)).trace(*_shapes(B, T, S)).lower(
            lowering_platforms=("cuda",))
    txt = low.as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 2  # forward + backward
    assert "tensor<2x100x4x64xf32>" in txt  # the float32 dQ accumulator
    assert "tensor<2x4x128xf32>" in txt  # LSE / delta padded to the kernel's 64-row boxes
    dims = {tuple(int(d) for d in m.split("x")) for m in re.findall(r"tensor<([0-9x]+)x", txt)}
    assert not any(T in d and S in d for d in dims), "a T x S tensor appeared in the HLO"


@pytest.mark.parametrize("H", [192, 256])
def test_wide_grad_lowers_to_the_cute_backward(cuda_env, H, monkeypatch):
    """jax.grad at D 192 / 256 runs our backward (two custom calls, float32 dQ accumulator),
    not the Pallas fallback, by default (GPU-checked, so `verified` admits it)."""
    from jaxflash.kernels.policy import verified
    monkeypatch.delenv(verified.ENV, raising=False)
    import jax
    import jaxflash
    from jaxflash import ffi
    with jaxflash.target_platform("cuda"):
        txt = jax.jit(_grad_fn(is_causal=True, softcap=4.0)).trace(
            *_shapes(2, 100, 130, H=H)).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 2  # forward + backward
    assert f"tensor<2x100x4x{H}xf32>" in txt  # the float32 dQ accumulator


def test_deterministic_grad_carries_the_semaphores(cuda_env):
    import jax
    import jaxflash
    with jaxflash.target_platform("cuda"):
        txt = jax.jit(_grad_fn(is_causal=True, deterministic=True)).trace(
            *_shapes(2, 100, 130)).lower(lowering_platforms=("cuda",)).as_text()
    # [B, N, ceil(T / tile_m)] ordering semaphores; hd 64 takes tile_m 128
    assert "tensor<2x4x1xi32>" in txt


def test_grad_export_round_trip(cuda_env):
    import jax
    import jaxflash
    from jaxflash import ffi
    with jaxflash.target_platform("cuda"):
        exp = jax.export.export(jax.jit(_grad_fn(is_causal=True)), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(*_shapes())
    back = jax.export.deserialize(exp.serialize())
    assert back.mlir_module().count(ffi.TARGET) >= 2
    assert [a.shape for a in back.out_avals] == [(2, 100, 4, 64), (2, 130, 2, 64),
                                                 (2, 130, 2, 64)]


def test_runtime_only_without_backward_artifact_falls_back_visibly(cuda_env, tmp_path,
                                                                   monkeypatch):
    """A machine without the DSL that has the forward's artifact but not the backward's runs
    the Pallas backward, and explain says so with the command that builds the missing one."""
    from jaxflash import aot
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.plan import forward_launch as fwd_launch_for
    from jaxflash.ffi import cache
    problem = Problem(2, 100, 130, 4, 2, 64, 64, "bfloat16",
                      AttentionStatics(scale=0.125, is_causal=True), platform="cuda")
    aot.build([fwd_launch_for(problem, "sm_90a")], str(tmp_path), progress=False,
              log=lambda *_: None)
    runtime_only(monkeypatch, tmp_path)
    text = _explain(is_causal=True)
    assert "'cute' runs" in text
    assert "backward: Pallas" in text and "python -m jaxflash.aot" in text


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(5, 3), softcap=2.0),
                                dict(q_seqlen=[9, 0], kv_seqlen=[12, 4])])
def test_device_gradient_oracle_matches_the_reference(kw):
    """`bwd_devrun.np_grads` (the float64 oracle the H200 checks use) equals jax.grad of the
    jaxflash reference (implementation="xla") on fresh random inputs, GQA included."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxflash
    from devtools.bwd_devrun import np_grads
    B, T, S, N, K, H = 2, 11, 13, 4, 2, 16
    ks = jax.random.split(jax.random.key(int.from_bytes(os.urandom(4), "little")), 4)
    q, do = (jax.random.normal(kk, (B, T, N, H), jnp.float32) for kk in (ks[0], ks[3]))
    k, v = (jax.random.normal(kk, (B, S, K, H), jnp.float32) for kk in (ks[1], ks[2]))
    scale = 0.3
    api = dict(is_causal=kw.get("causal", False), local_window_size=kw.get("window"),
               softcap=kw.get("softcap"))
    if "q_seqlen" in kw:
        api.update(query_seq_lengths=jnp.asarray(kw["q_seqlen"]),
                   key_value_seq_lengths=jnp.asarray(kw["kv_seqlen"]))
    f = lambda q, k, v: jaxflash.flash_attention(q, k, v, scale=scale, implementation="xla",
                                                 **api)
    _, vjp = jax.vjp(f, q, k, v)
    want = vjp(do)
    got = np_grads(q, k, v, do, scale, kw.get("causal", False), kw.get("window"),
                   kw.get("softcap"), kw.get("q_seqlen"), kw.get("kv_seqlen"))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        w = np.asarray(w, np.float64)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5 * np.abs(w).max(), err_msg=name)


# -- ALiBi and segment ids in the CuTe backward --------------------------------------------------
def _seg_arrays(B=2, T=100, S=130):
    import jax.numpy as jnp
    q_seg = jnp.broadcast_to((jnp.arange(T) // 37)[None], (B, T)).astype(jnp.int32)
    kv_seg = jnp.broadcast_to((jnp.arange(S) // 45)[None], (B, S)).astype(jnp.int32)
    return q_seg, kv_seg


def test_explain_names_the_backward_for_alibi_and_segments(cuda_env, monkeypatch):
    import jax
    import jax.numpy as jnp
    from jaxflash.kernels.policy import verified
    slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
    q_seg, kv_seg = _seg_arrays()
    # Checked on the H200: dispatched by default, no switch needed.
    monkeypatch.delenv(verified.ENV, raising=False)
    text = _explain(is_causal=True, alibi_slopes=slopes, q_segment_ids=q_seg,
                    kv_segment_ids=kv_seg)
    assert "backward: CuTe kernel FlashBwdSm90" in text and "causal-alibi-seg" in text
    # hd 128 ALiBi and ALiBi + softcap are refused with the reason (Pallas backward runs).
    text = _explain(_shapes(H=128), alibi_slopes=slopes)
    assert "backward: Pallas" in text and "ALiBi at head_dim 128" in text
    text = _explain(alibi_slopes=slopes, softcap=5.0)
    assert "backward: Pallas" in text and "ALiBi with softcap" in text
    text = _explain(_shapes(H=128), q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    assert "backward: CuTe kernel FlashBwdSm90" in text and "_seg" in text


def test_grad_with_alibi_and_segments_lowers_to_custom_calls(cuda_env, monkeypatch):
    """jax.grad w.r.t. the slopes goes through the CuTe backward (its partials output
    [B, N, ceil(S/128), 8] is in the HLO) and no T x S tensor appears, by default."""
    from jaxflash.kernels.policy import verified
    monkeypatch.delenv(verified.ENV, raising=False)
    import jax
    import jax.numpy as jnp
    import jaxflash
    from jaxflash import ffi
    B, T, S = 2, 100, 130
    q_seg, kv_seg = _seg_arrays(B, T, S)

    def loss(q, k, v, slopes):
        o = jaxflash.flash_attention(q, k, v, implementation="cute", is_causal=True,
                                     alibi_slopes=slopes, q_segment_ids=q_seg,
                                     kv_segment_ids=kv_seg)
        return o.astype(jnp.float32).sum()
    with jaxflash.target_platform("cuda"):
        low = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
            *_shapes(B, T, S), jax.ShapeDtypeStruct((4,), jnp.float32)).lower(
            lowering_platforms=("cuda",))
    txt = low.as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 2  # forward + backward
    assert "tensor<2x4x2x8xf32>" in txt  # the d(slopes) partials
    dims = {tuple(int(d) for d in m.split("x")) for m in re.findall(r"tensor<([0-9x]+)x", txt)}
    assert not any(T in d and S in d for d in dims), "a T x S tensor appeared in the HLO"


def test_refusals_for_alibi_and_segments():
    ok, why = BwdConfig(head_dim=64, has_alibi=True).check()
    assert ok, why
    for kw, word in ((dict(head_dim=128, has_alibi=True), "ALiBi at head_dim 128"),
                     (dict(head_dim=64, has_alibi=True, has_softcap=True), "softcap"),
                     (dict(head_dim=64, has_segments=True, deterministic=True), "deterministic")):
        with pytest.raises(ValueError, match=word):
            BwdConfig(**kw)
    assert "alibi" in BwdConfig(head_dim=64, has_alibi=True).key
    assert "seg" in BwdConfig(head_dim=64, has_segments=True).key


def test_cute_backward_passes_alibi_segments_and_reduces_dslopes(monkeypatch):
    """cute_backward hands the kernel its inputs in the launch's order and shapes (slopes
    [1, N], segment ids, key-major block summaries) and turns the kernel's per-warp partials
    into d(slopes) = -their sum over batch, key blocks and warps (the kernel is replaced by a
    fake here: only the XLA side is under test)."""
    import jax.numpy as jnp
    import numpy as np
    from jaxflash import ffi
    from jaxflash._types import AttentionArrays, AttentionStatics
    from jaxflash.kernels.call import backward as cute_backward
    from jaxflash.kernels.variants.bwd_launch import bwd_launch
    from jaxflash.kernels.common.segments import block_summaries
    B, T, S, N, K, H = 2, 100, 300, 4, 2, 64
    cfg = BwdConfig(head_dim=H, is_causal=True, has_alibi=True, has_segments=True)
    launch = bwd_launch(cfg)
    q_seg, kv_seg = _seg_arrays(B, T, S)
    parts = jnp.asarray(np.random.default_rng(0).standard_normal((B, N, 3, 8)), jnp.float32)
    seen = {}

    def fake_call(l, *inputs, out_shapes, scalars, int_scalars):
        seen["inputs"] = inputs
        assert l is launch
        assert [tuple(o.shape) for o in out_shapes] == [(B, T, N, H), (B, S, K, H),
                                                        (B, S, K, H), (B, N, 3, 8)]
        return [jnp.zeros(o.shape, o.dtype) for o in out_shapes[:3]] + [parts]
    monkeypatch.setattr(ffi, "call", fake_call)
    q = jnp.zeros((B, T, N, H), jnp.bfloat16)
    k = v = jnp.zeros((B, S, K, H), jnp.bfloat16)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    arrays = AttentionArrays(alibi_slopes=slopes, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    st = AttentionStatics(scale=0.125, is_causal=True)
    out = jnp.zeros((B, T, N, H), jnp.bfloat16)
    lse = jnp.zeros((B, N, T), jnp.float32)
    dq, dk, dv, dbias, dslopes = cute_backward(launch, q, k, v, arrays, st, out, lse, out)
    ins = seen["inputs"]
    assert len(ins) == len(launch.inputs) == 6 + 1 + 4
    for x, spec in zip(ins, launch.inputs):
        assert x.ndim == len(spec.shape) and str(x.dtype) == spec.dtype
        assert all(f is None or f == d for f, d in zip(spec.shape, x.shape))
    np.testing.assert_array_equal(np.asarray(ins[6]), np.asarray(slopes)[None])
    kv_blocks, q_blocks = block_summaries(kv_seg, q_seg, cfg.tile_n, cfg.tile_m)
    assert ins[9].shape == (B, 3, 4) and ins[10].shape == (B, 2, 2)  # rows = keys
    np.testing.assert_array_equal(np.asarray(ins[9]), np.asarray(kv_blocks))
    np.testing.assert_array_equal(np.asarray(ins[10]), np.asarray(q_blocks))
    assert dbias is None
    np.testing.assert_allclose(np.asarray(dslopes), -np.asarray(parts).sum(axis=(0, 2, 3)),
                               rtol=1e-6)
