"""The FP8 backward kernels (`FlashBwdSm90Fp8`, and `FlashBwdSm90Fp8Wide` at hd 256) without a GPU:
head dims 64 / 128 / 256 with each mask feature compile for sm_90a with FP8 wgmma for all five
GEMMs (e4m3 x e4m3 for S^T, dK, dQ; e4m3 x e5m2 for dP^T and dV: mixed operand types), packed
e4m3 conversions, 16-bit dS stores, one bulk dQ reduce a step, no local memory (ptxas: no
spills, no serialized wgmma); a precision="fp8" gradient through ``implementation="cute"``
lowers to two custom calls (forward, backward) with no T x S tensor and survives a jax.export
round trip; the XLA-side copies (transposes with the kernel's orders, dO's quantization) agree
with the contract's emulation.

Each compile takes 2-8 s on 2 cores (+ under 1 s of ptxas).
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from jaxflash.kernels.variants.bwd_fp8 import Fp8BwdConfig  # noqa: E402

# The register-heaviest variants (softcap's tanh values and both lengths) and the rest of the
# features with E4M3 dO, at hd 128 / 64 and at hd 256 (the head-dim split): four compiles of a
# few seconds each.
MATRIX = [
    Fp8BwdConfig(head_dim=128, is_causal=True, has_softcap=True, has_q_seqlen=True,
                 has_kv_seqlen=True),
    Fp8BwdConfig(head_dim=64, has_window=True, has_segments=True, do_dtype="float8_e4m3fn"),
    Fp8BwdConfig(head_dim=256, is_causal=True, has_softcap=True, has_q_seqlen=True,
                 has_kv_seqlen=True),
    Fp8BwdConfig(head_dim=256, has_window=True, has_segments=True, do_dtype="float8_e4m3fn"),
]


@pytest.mark.compile
@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_fp8_bwd_variant_compiles_with_fp8_wgmma_and_no_spills(cfg, tmp_path):
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
    from devtools.ptx_digest import ptx_of
    from jaxflash.kernels.variants.bwd_fp8_launch import bwd_fp8_launch
    from tests.common import check_hopper_sass, ptxas_report
    ptx = ptx_of(bwd_fp8_launch(cfg), str(tmp_path))
    assert ".target sm_90a" in ptx
    do = "e5m2" if cfg.do_dtype == "float8_e5m2" else "e4m3"
    w = "wgmma.mma_async.sync.aligned.m64n{}k32.f32.e4m3.{}"
    # key split: 64 keys x all queries (S^T, dP^T) and x the head dim (dK, dV) per warpgroup;
    # head-dim split (hd 256): 64 keys x half the queries, x half the head dim
    wide = cfg.split == "headdim"
    sq, kv = (cfg.tile_m // 2, cfg.head_dim // 2) if wide else (cfg.tile_m, cfg.head_dim)
    for n, b in ((sq, "e4m3"),                   # S^T = K Q^T
                 (sq, do),                       # dP^T = V dO^T
                 (kv, do),                       # dV += P^T dO^T   (A: registers / smem)
                 (kv, "e4m3"),                   # dK += dS^T Q^T   (A: registers / smem)
                 (cfg.head_dim // 2, "e4m3")):   # dQ = dS K^T, head dim split over 2 WGs
        assert w.format(n, b) in ptx, w.format(n, b)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx       # P and dS to e4m3, two at a time
    assert "st.shared.b16" in ptx                      # dS rows into shared memory
    if wide:  # P^T and dS^T rows, 4 queries a store (`bwd_fp8_wide.store_rows_t`)
        assert ptx.count("st.shared.b32") >= 8
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert "shfl.sync.bfly" in ptx and "bar.sync 	4, 256" in ptx   # dS amax over the block
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx and "ex2.approx" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    if cfg.has_softcap:
        assert "tanh.approx" in ptx
    rep = ptxas_report(ptx, tmp_path)
    if rep is None:
        pytest.skip("no usable ptxas here")
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", rep)]
    assert spills and max(spills) == 0, rep
    assert "C7512" not in rep and "serialized" not in rep, rep
    # nor an injected warpgroup.arrive: every A register is converted before its GEMM's fence
    assert "C7519" not in rep, rep
    check_hopper_sass(ptx, tmp_path, "QGMMA")


def test_kernel_constants_follow_the_contract():
    """The kernel and its launch cannot import `jaxflash.fp8` (sibling layers): their P scale,
    E4M3 range, dO rows per scale and dS block are checked against the contract here."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
    from jaxflash.fp8 import contract as C
    from jaxflash.kernels.sm90.bwd_fp8 import E4M3_MAX, P_SHIFT_LOG2
    from jaxflash.kernels.variants.bwd_fp8 import AMAX_FLOOR, DO_SCALE_ROWS
    assert P_SHIFT_LOG2 == C.P_SCALE_LOG2 and E4M3_MAX == C.E4M3_MAX
    assert AMAX_FLOOR == C.BWD_AMAX_FLOOR
    assert DO_SCALE_ROWS == C.BWD_Q_TILE and DO_SCALE_ROWS % MATRIX[0].tile_m == 0
    for c in MATRIX:
        assert (c.tile_m, c.tile_n) == (C.BWD_DS_Q_TILE, C.bwd_kv_tile(c.head_dim))


def test_transposed_copies_follow_the_kernels_orders():
    """Q^T / dO^T hold query 16c + Q_ORDER[p] at position 16c + p (the FP8 A operand's k order
    of a thread's accumulator columns {2q, 2q+1, 2q+8, 2q+9}); K^T key 16c + K_ORDER[p] (keys r
    and r + 8 of a thread adjacent). Both are permutations; padding is zero."""
    import jax.numpy as jnp

    from jaxflash.kernels.variants.keys_major import keys_major as _transposed
    from jaxflash.kernels.variants.bwd_fp8_launch import K_ORDER, K_SPLIT, Q_ORDER, Q_SPLIT
    assert sorted(Q_ORDER) == list(range(16)) and sorted(K_ORDER) == list(range(16))
    for q in range(4):          # A register of thread q: positions 4q..4q+3
        assert Q_ORDER[4 * q:4 * q + 4] == (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9)
    for a in range(8):          # keys a and a + 8 at positions 2a, 2a + 1
        assert K_ORDER[2 * a:2 * a + 2] == (a, a + 8)
    B, L, Hd, H = 2, 40, 3, 16
    x = np.random.default_rng(0).standard_normal((B, L, Hd, H)).astype(np.float32)
    x8 = jnp.asarray(x).astype(jnp.float8_e4m3fn)
    src = np.asarray(x8.astype(jnp.float32))
    for split, order in ((Q_SPLIT, Q_ORDER), (K_SPLIT, K_ORDER)):
        t = np.asarray(_transposed(x8, split, 64).astype(jnp.float32))
        assert t.shape == (B, Hd, H, 64)
        for p in range(64):
            row = 16 * (p // 16) + order[p % 16]
            want = src[:, row] if row < L else np.zeros_like(src[:, 0])
            np.testing.assert_array_equal(t[..., p], want)


def _grad_fn(**kw):
    import jax
    import jax.numpy as jnp

    import jaxflash

    def loss(q, k, v):
        o = jaxflash.flash_attention(q, k, v, precision="fp8", implementation="cute", **kw)
        return jnp.sum(o.astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))


@pytest.fixture
def cuda_env(tmp_path, monkeypatch):
    from jaxflash.ffi import cache
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("JAXFLASH_CUTE_UNVERIFIED", "1")
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    monkeypatch.delenv(cache.ENV_NO_DSL, raising=False)


@pytest.mark.compile
def test_fp8_grad_lowers_to_two_custom_calls_and_exports(cuda_env):
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import ffi
    B, T, N, K, H = 2, 200, 4, 2, 64      # hd 64: the two kernels compile fastest
    sds = jax.ShapeDtypeStruct
    args = (sds((B, T, N, H), jnp.bfloat16), sds((B, T, K, H), jnp.bfloat16),
            sds((B, T, K, H), jnp.bfloat16))
    with jaxflash.target_platform("cuda"):
        low = jax.jit(_grad_fn(is_causal=True)).trace(*args).lower(
            lowering_platforms=("cuda",))
    txt = low.as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 2, txt.count(f"custom_call @{ffi.TARGET}")
    assert "f8E5M2" in txt                              # dO in E5M2
    assert f"tensor<{B}x{N}x{H}x256xf8E4M3FN>" in txt   # Q^T, queries padded to 256
    assert not re.search(rf"tensor<[^>]*\b{T}x{T}\b", txt)   # nothing T x S
    with jaxflash.target_platform("cuda"):
        exp = jax.export.export(jax.jit(_grad_fn(is_causal=True)), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(*args)
    back = jax.export.deserialize(exp.serialize())
    assert back.mlir_module().count(ffi.TARGET) >= 2
    assert [a.shape for a in back.out_avals] == [(B, T, N, H), (B, T, K, H), (B, T, K, H)]


def test_explain_names_the_backward_that_runs(monkeypatch):
    import jax
    import jax.numpy as jnp

    import jaxflash
    x = jax.ShapeDtypeStruct((2, 200, 4, 128), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((2, 200, 4, 256), jnp.bfloat16)
    # cleared by tests/kernels/test_fp8_bwd_gpu.py on the H200: the kernel, without the switch
    monkeypatch.delenv("JAXFLASH_CUTE_UNVERIFIED", raising=False)
    with jaxflash.target_platform("cuda"):
        text = str(jaxflash.explain(x, x, x, is_causal=True, precision="fp8"))
        assert "backward: CuTe FP8 kernel FlashBwdSm90Fp8 (bwd8_sm90_e4m3_doe5m2_h128" in text
        # hd 256: the head-dim split
        text = str(jaxflash.explain(y, y, y, precision="fp8"))
        assert ("backward: CuTe FP8 kernel FlashBwdSm90Fp8Wide "
                "(bwd8_sm90_e4m3_doe5m2_h256_t64x64s1") in text, text
        # what it does not serve falls back, naming the reason
        text = str(jaxflash.explain(x, x, x, precision="fp8", deterministic=True))
        assert "emulated FP8 backward" in text and "deterministic FP8 backward" in text, text


def _kernel_in_numpy(inputs, scale, causal, T, S, G, tn=128):
    """The kernel's algorithm (`sm90.bwd_fp8`), step by step in NumPy, on the launch's inputs
    as the kernel reads them: the permuted transposed copies, the per-tile descales, P x 2^8,
    dS scaled per 64 x tn block (tn: the kernel's key tile, 128, or 64 at hd 256), dK / dV
    accumulated in the step's units and rescaled when they change, dQ per step x (dS x k) unit,
    dq_acc in fragment order. Dense or causal MHA/GQA."""
    import ml_dtypes

    from jaxflash.kernels.variants.bwd_fp8_launch import K_ORDER, Q_ORDER
    e4 = ml_dtypes.float8_e4m3fn
    f = lambda a: np.asarray(a).astype(np.float32)
    q8, k8, v8, do8, qt, kt, dot, lse2, delta, qd, dod, kd, vd = [f(x) for x in inputs]
    B, _, N, H = q8.shape
    K = k8.shape[2]
    nq, nk = -(-T // 64), -(-S // tn)
    qperm = np.array([16 * (p // 16) + Q_ORDER[p % 16] for p in range(64)])
    kperm = np.array([16 * (p // 16) + K_ORDER[p % 16] for p in range(tn)])
    pad = lambda x, L: np.pad(x, [(0, L - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    cvt = lambda x: np.clip(x, -448, 448).astype(e4).astype(np.float32)
    dq = np.zeros((B, nq * 64, N, H), np.float32)
    dk = np.zeros((B, nk * tn, K, H), np.float32)
    dv = np.zeros_like(dk)
    l2e = np.float32(np.log2(np.e))
    for b in range(B):
        for kh in range(K):
            for n in range(nk):
                kt_ = pad(k8[b, n * tn:(n + 1) * tn, kh], tn)
                vt_ = pad(v8[b, n * tn:(n + 1) * tn, kh], tn)
                ktt = kt[b, kh, :, n * tn:(n + 1) * tn]                   # H x tn positions
                acc_dk = np.zeros((tn, H), np.float32)
                acc_dv = np.zeros((tn, H), np.float32)
                unit_k = unit_v = np.float32(1)
                keys = n * tn + np.arange(tn)
                for g in range(G):
                    h = kh * G + g
                    for m in range(nq):
                        rows = m * 64 + np.arange(64)
                        if causal and rows.max() < n * tn:
                            continue                      # the block range skips it
                        qt_ = pad(q8[b, m * 64:(m + 1) * 64, h], 64)
                        dot_ = pad(do8[b, m * 64:(m + 1) * 64, h], 64)
                        s = kt_ @ qt_.T                                   # S^T, keys x queries
                        keep = (keys[:, None] < S)
                        if causal:
                            keep = keep & (keys[:, None] <= rows[None, :])
                        sl2 = np.float32(scale) * l2e * qd[b, h, m] * kd[b, kh, n]
                        x = np.where(keep, s * sl2, -np.inf)
                        p = np.exp2(x - (lse2[b, h, rows] - 8)[None, :])
                        dp = vt_ @ dot_.T
                        ds = p * (dp * (vd[b, kh, n] * dod[b, h, m] / 256)
                                  - delta[b, h, rows][None, :] / 256)
                        if dod[b, h, m] != unit_v:
                            acc_dv *= unit_v / dod[b, h, m]
                        unit_v = dod[b, h, m]
                        acc_dv += cvt(p)[:, qperm] @ dot[b, h, :, m * 64:(m + 1) * 64].T
                        amax = np.abs(ds).max()
                        amax = max(amax, np.float32(2.0 ** -64)) if amax > 0 else amax
                        ds_s, ds_i = (amax / 448, 448 / amax) if amax > 0 else (1, 1)
                        ds8 = cvt(ds * np.float32(ds_i))
                        uk = np.float32(ds_s) * qd[b, h, m]
                        acc_dk *= unit_k / uk
                        unit_k = uk
                        acc_dk += ds8[:, qperm] @ qt[b, h, :, m * 64:(m + 1) * 64].T
                        sds = ds8[kperm].T                                # queries x positions
                        dq[b, m * 64:(m + 1) * 64, h] += (sds @ ktt.T) * (ds_s * kd[b, kh, n])
                dk[b, n * tn:(n + 1) * tn, kh] = acc_dk * unit_k * np.float32(scale)
                dv[b, n * tn:(n + 1) * tn, kh] = acc_dv * unit_v / 256
    # dq in the accumulator's fragment order (the inverse of `bwd_launch.dq_from_flat`)
    a = dq.reshape(B, nq, 4, 2, 8, N, 2, H // 16, 4, 2)
    a = a.transpose(np.argsort((0, 2, 5, 8, 6, 1, 3, 4, 7, 9)))
    return a.reshape(B, N, nq, 64 * H), dk[:, :S], dv[:, :S]


@pytest.mark.parametrize("causal,do_dtype,far,H", [(False, "float8_e5m2", False, 64),
                                                   (True, "float8_e4m3fn", False, 64),
                                                   (False, "float8_e5m2", True, 64),
                                                   (True, "float8_e5m2", False, 256),
                                                   (False, "float8_e5m2", True, 256)])
def test_launch_inputs_through_the_kernels_algorithm_match_the_emulation(causal, do_dtype, far,
                                                                         H, monkeypatch):
    """`call.backward_fp8` (dO quantized per 128 rows, E5M2 or E4M3, Q^T / K^T / dO^T in the
    kernel's orders, per-tile descales, dq from fragment order) with the kernel replaced by its
    algorithm in NumPy agrees with the contract's emulated backward: the scale, unit and order
    bookkeeping of the kernel is the contract's, at hd 256 with 64-key tiles and 64 x 64 dS
    blocks (the contract's `bwd_kv_tile`). (What NumPy cannot check, the register and
    shared-memory layouts inside the kernel, is the GPU test's.)"""
    import jax
    import jax.numpy as jnp

    from jaxflash import ffi
    from jaxflash._types import AttentionArrays, AttentionStatics, Fp8Spec
    from jaxflash.fp8 import contract as C
    from jaxflash.fp8 import emulated
    from jaxflash.kernels import call
    from jaxflash.kernels.variants.bwd_fp8_launch import bwd_fp8_launch
    B, T, N, K = 1, 200, 4, 2
    rng = np.random.default_rng(3)
    x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    # codes and 128-row block scales that differ block to block (the kernel's units change)
    e4 = lambda *s: (x(*s) * 100).astype(jnp.float8_e4m3fn)
    sc = lambda h: jnp.asarray(rng.uniform(0.005, 0.03, (B, h, 2)), jnp.float32)
    q8, k8, v8 = e4(B, T, N, H), e4(B, T, K, H), e4(B, T, K, H)
    qs, ks, vs = sc(N), sc(K), sc(K)
    if far:
        # the second key block ~97 logits below the first: its P is denormal-small, and so is
        # its dS block's amax (without the contract's amax floor the kernel's dK unit would
        # be 0 and the unit ratio infinite)
        big = jnp.float8_e4m3fn(448)
        q8 = q8.at[..., 0].set(big)
        k8 = k8.at[:, :128, :, 0].set(big).at[:, 128:, :, 0].set(-big)
        qs = ks = jnp.full((B, N, 2), 0.0445, jnp.float32)[:, :N]
        ks = jnp.full((B, K, 2), 0.0445, jnp.float32)
    spec = Fp8Spec(do_dtype=do_dtype)
    arrays = AttentionArrays(q_scale=qs, k_scale=ks, v_scale=vs)
    st = AttentionStatics(scale=H ** -0.5, is_causal=causal, fp8=spec)
    out, lse = jax.jit(emulated.forward, static_argnums=4)(q8, k8, v8, arrays, st)
    dout = x(B, T, N, H).astype(jnp.bfloat16)
    ref = jax.jit(emulated.backward, static_argnums=4)(q8, k8, v8, arrays, st, out, lse,
                                                      dout)[:3]

    def fake_call(launch, *inputs, out_shapes, scalars=(), int_scalars=()):
        assert scalars[0] == st.scale
        return _kernel_in_numpy(inputs, st.scale, causal, T, T, N // K, cfg.tile_n)

    monkeypatch.setattr(ffi, "call", fake_call)
    cfg = Fp8BwdConfig(head_dim=H, is_causal=causal, do_dtype=do_dtype)
    assert cfg.tile_n == C.bwd_kv_tile(H)
    launch = bwd_fp8_launch(cfg)
    from jaxflash.fp8 import prologue
    from jaxflash.kernels.variants.bwd_fp8 import AMAX_FLOOR, DO_SCALE_ROWS
    do8, do_scale = prologue.quantize_rows(dout, cfg.do_dtype, DO_SCALE_ROWS, AMAX_FLOOR, "cpu")
    got = call.backward_fp8(launch, q8, k8, v8, arrays, st, out, lse, dout, do8, do_scale)[:3]
    for what, g, r in zip(("dq", "dk", "dv"), got, ref):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.all(np.isfinite(g)), what
        err = np.linalg.norm(g - r) / np.linalg.norm(r)
        # measured ~5e-7 (exp2 vs exp: rare FP8 flips). In the far case every query's first
        # block has equal P and equal keys on channel 0, so dQ's channel 0 is sum_j dS_ij k_j
        # with sum_j dS_ij = 0 exactly (D_i from the quantized dO): what is left there is dS's
        # rounding, where a flip of one E4M3 code between the two orders of summation shows
        # (~1e-3); a scale or unit mistake would be O(1).
        assert err < (3e-3 if far else 1e-3), (what, err)


@pytest.mark.parametrize("hd,k_block,tile_n", [(128, 128, 128), (256, 128, 64), (256, 64, 64),
                                               (128, 64, None), (256, 32, None)])
def test_backward_config_matches_kv_scale_blocks_to_the_key_tile(hd, k_block, tile_n):
    """The plan's block check follows the variant's key tile: 128 keys, 64 at hd 256 (a 128-key
    scale block then covers two tiles); a block that would straddle tiles is refused."""
    from jaxflash._types import AttentionStatics, Fp8Spec, Problem
    from jaxflash.kernels.policy.choose import fp8_backward_config
    spec = Fp8Spec(k_block=k_block, v_block=k_block)
    st = AttentionStatics(scale=hd ** -0.5, fp8=spec)
    p = Problem(batch=2, q_len=1000, kv_len=1000, num_heads=4, num_kv_heads=4, head_dim=hd,
                head_dim_v=hd, dtype="float8_e4m3fn", statics=st, platform="cuda")
    if tile_n is None:
        with pytest.raises(ValueError, match=f"k scales per {k_block}-row block"):
            fp8_backward_config(p)
    else:
        cfg = fp8_backward_config(p)
        assert cfg.tile_n == tile_n and cfg.split == ("headdim" if hd > 128 else "keys")
