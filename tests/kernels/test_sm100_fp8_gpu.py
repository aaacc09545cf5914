"""First Blackwell run of the FP8 forward (`FlashFwdSm100Fp8`): the Hopper FP8 kernel's cases
(`tests/kernels/test_fp8_gpu.py`: fresh inputs with outlier channels, odd lengths, GQA, masks,
per-tensor / per-head / 128-row block scales) through ``flash_attention(implementation="cute")``
against the numerics contract's emulation and float64 on the dequantized operands, with the
same tolerances. Runs only on a compute capability 10.0 GPU (B200 / GB200) with the gate opened
by the test; anywhere else it skips with the reason (the H200 refuses cleanly). It has never
run: no Blackwell GPU was available.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.test_fp8_gpu import CASES, _inputs, _reference64, _rel

pytestmark = pytest.mark.gpu


def _blackwell() -> bool:
    import jax
    devs = [d for d in jax.devices() if d.platform == "gpu"]
    return bool(devs) and str(getattr(devs[0], "compute_capability", "")) == "10.0"


@pytest.fixture(autouse=True)
def _only_blackwell(monkeypatch):
    from jaxflash.kernels.policy import verified
    if not _blackwell():
        pytest.skip("needs a compute capability 10.0 GPU (B200 / GB200): sm_100a kernels")
    monkeypatch.setenv(verified.ENV, "1")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sm100_fp8_forward_against_emulation_and_float64(case):
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import quantize as Q
    name, B, T, S, N, K, D, kw, gran = case
    kw = dict(kw)
    lengths = kw.pop("lengths", False)
    q, k, v = _inputs(B, T, S, N, K, D, seed=hash(name) % 2**31)
    q8, qs = Q.quantize(jnp.asarray(q), jnp.float8_e4m3fn, granularity=gran)
    k8, ks = Q.quantize(jnp.asarray(k), jnp.float8_e4m3fn, granularity=gran)
    v8, vs = Q.quantize(jnp.asarray(v), jnp.float8_e4m3fn, granularity=gran)
    q_len = kv_len = None
    if lengths:
        q_len = np.array([T - 37, T // 2], np.int32)[:B]
        kv_len = np.array([S - 5, S // 3], np.int32)[:B]
        kw.update(query_seq_lengths=jnp.asarray(q_len), key_value_seq_lengths=jnp.asarray(kv_len))

    def run(impl):
        f = jax.jit(lambda a, b, c, d, e, g: jaxflash.flash_attention(
            a, b, c, q_scale=d, k_scale=e, v_scale=g, implementation=impl, return_residual=True,
            **kw))
        o, lse = f(q8, k8, v8, qs, ks, vs)
        return np.asarray(o.astype(jnp.float32)), np.swapaxes(np.asarray(lse), 1, 2)

    expl = jaxflash.explain(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs,
                            implementation="cute", **kw)
    assert expl.backend == "cute" and expl.detail.fwd.kernel.endswith(":FlashFwdSm100Fp8"), expl
    o_k, lse_k = run("cute")
    o_e, _ = run("xla")
    deq = [np.asarray(Q.dequantize(x, s, granularity=gran), np.float64)
           for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    o_r, lse_r = _reference64(*deq, D ** -0.5, kw.get("is_causal", False),
                              kw.get("local_window_size"), kw.get("softcap"), q_len, kv_len)
    assert np.all(np.isfinite(o_k)), "non-finite output"
    assert np.array_equal(np.isneginf(lse_k), np.isneginf(lse_r)), "-inf LSE rows differ"
    fin = np.isfinite(lse_r)
    err_k, err_e, err_ke = _rel(o_k, o_r), _rel(o_e, o_r), _rel(o_k, o_e)
    lse_err = float(np.max(np.abs(lse_k[fin] - lse_r[fin]))) if fin.any() else 0.0
    print(f"{name}: kernel vs float64 {err_k:.4f}, emulation vs float64 {err_e:.4f}, "
          f"kernel vs emulation {err_ke:.4f}, max |dLSE| {lse_err:.2e}")
    assert err_ke <= 5e-2, f"kernel vs emulation rel L2 {err_ke:.3e}"
    assert err_k <= 1.25 * err_e + 2e-3, f"kernel {err_k:.3e} vs emulation {err_e:.3e}"
    assert lse_err <= 5e-2, f"LSE max abs error {lse_err:.3e}"
