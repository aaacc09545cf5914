"""First Blackwell run: the 2-CTA forward (`FlashFwdSm100Pair`, ``Sm100FwdConfig(two_cta=True)``)
against the float32 reference. Dispatch never picks the pair (not measured), so the test runs
its launch directly (`kernels.call.forward`, the XLA-side halves every forward uses). Runs only
on a GPU of compute capability 10.0; anywhere else it skips with the reason. It has never run:
no Blackwell GPU was available.

The first-run kit builds these variants (``python -m devtools.blackwell_first_run build``) and
clears its ``two_cta`` feature from this file's results (`devtools.blackwell_verdict`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash._types import AttentionArrays, AttentionStatics
from jaxflash.kernels.variants.sm100_fwd import Sm100FwdConfig
from tests.common import Case, assert_forward_close, oracle

pytestmark = pytest.mark.gpu


def _blackwell() -> bool:
    devs = [d for d in jax.devices() if d.platform == "gpu"]
    return bool(devs) and str(getattr(devs[0], "compute_capability", "")) == "10.0"


@pytest.fixture(autouse=True)
def _only_blackwell():
    if not _blackwell():
        pytest.skip("needs a compute capability 10.0 GPU (B200 / GB200): sm_100a kernels")


# Dense calls only (a pair walks one key range). T not a multiple of the pair's 256 rows: the
# second tile of the last pair is partly (T = 1000) or wholly (T = 300) past the queries.
CASES = [
    Case(B=2, T=1000, S=1000, N=8, K=2, H=128, dtype="bfloat16"),
    Case(B=2, T=300, S=777, N=4, K=4, H=192, dtype="bfloat16"),
    Case(B=1, T=640, S=2048, N=4, K=1, H=192, dtype="float16", kwargs=dict(softcap=20.0)),
    Case(B=2, T=512, S=700, N=4, K=2, H=256, dtype="bfloat16",
         kwargs=dict(softcap=20.0, kv_lengths=[700, 131], alibi=True)),
]


def pair_config(case: Case) -> Sm100FwdConfig:
    kw = case.kwargs
    return Sm100FwdConfig(dtype=case.dtype, head_dim=case.H, two_cta=True,
                          has_softcap="softcap" in kw, has_kv_seqlen="kv_lengths" in kw,
                          has_alibi=bool(kw.get("alibi")))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-h{c.H}-T{c.T}S{c.S}"
                         f"-N{c.N}K{c.K}-{'-'.join(sorted(c.kwargs)) or 'dense'}")
def test_pair_forward_matches_reference(case):
    from jaxflash.kernels import call
    from jaxflash.kernels.variants.fwd_launch import sm100_fwd_launch
    cfg = pair_config(case)
    kw = dict(case.kwargs)
    lengths = kw.pop("kv_lengths", None)
    alibi = kw.pop("alibi", False)
    q, k, v, _ = Case(B=case.B, T=case.T, S=case.S, N=case.N, K=case.K, H=case.H,
                      dtype=case.dtype).make()
    scale = case.H ** -0.5
    ref_kw = dict(kw, scale=scale)
    kv_seqlen = slopes = None
    if lengths is not None:
        kv_seqlen = jnp.asarray(lengths, jnp.int32)
        ref_kw["key_value_seq_lengths"] = kv_seqlen
    if alibi:
        slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, case.N + 1) / case.N), jnp.float32)
        ref_kw["alibi_slopes"] = slopes
    arrays = AttentionArrays(kv_seqlen=kv_seqlen, alibi_slopes=slopes)
    statics = AttentionStatics(scale=scale, softcap=kw.get("softcap"))
    launch = sm100_fwd_launch(cfg)
    assert launch.kernel.endswith(":FlashFwdSm100Pair")
    out, lse = jax.jit(lambda q, k, v, a: call.forward(launch, q, k, v, a, statics))(
        q, k, v, arrays)
    ref_out, ref_lse = oracle(q, k, v, **ref_kw)
    assert_forward_close(out, lse, ref_out, ref_lse, case.dtype)
