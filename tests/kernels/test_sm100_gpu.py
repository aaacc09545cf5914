"""First Blackwell run: the sm_100a forward through `flash_attention(implementation="cute")`
against the float32 reference. Runs only on a GPU of compute capability 10.0 (B200 / GB200),
with ``JAXFLASH_CUTE_UNVERIFIED=1`` set by the test (the variants are gated until this passes);
anywhere else it skips with the reason, so on the H200 it refuses cleanly. It has never run:
no Blackwell GPU was available.

On a machine without the CuTe DSL, build the variants first (``python -m jaxflash.aot --arch
sm_100a --out DIR --kernel sm100_fwd head_dim=64,96,128,192,256 ...`` and
``JAXFLASH_KERNEL_DIR=DIR``; or ``python -m devtools.blackwell_first_run build --out DIR``).
"""
from __future__ import annotations

import jax
import pytest

import jaxflash
from jaxflash.kernels.policy import verified
from tests.common import Case, assert_forward_close, oracle

pytestmark = pytest.mark.gpu


def _blackwell() -> bool:
    devs = [d for d in jax.devices() if d.platform == "gpu"]
    return bool(devs) and str(getattr(devs[0], "compute_capability", "")) == "10.0"


@pytest.fixture(autouse=True)
def _only_blackwell(monkeypatch):
    if not _blackwell():
        pytest.skip("needs a compute capability 10.0 GPU (B200 / GB200): sm_100a kernels")
    monkeypatch.setenv(verified.ENV, "1")


CASES = [
    Case(B=2, T=1000, S=1000, N=8, K=2, H=128, dtype="bfloat16"),
    Case(B=2, T=777, S=1300, N=4, K=4, H=128, dtype="bfloat16", kwargs=dict(is_causal=True)),
    Case(B=2, T=257, S=300, N=6, K=1, H=64, dtype="bfloat16"),
    Case(B=3, T=129, S=77, N=2, K=2, H=64, dtype="float16", kwargs=dict(is_causal=True)),
    Case(B=2, T=700, S=700, N=2, K=1, H=256, dtype="bfloat16", kwargs=dict(is_causal=True)),
    Case(B=2, T=500, S=500, N=4, K=2, H=128, dtype="bfloat16",
         kwargs=dict(is_causal=True, softcap=20.0)),
    Case(B=2, T=800, S=800, N=4, K=2, H=128, dtype="bfloat16",
         kwargs=dict(local_window_size=(100, 37))),
    # long key loop: the conditional rescale and the polynomial exp2 on many blocks
    Case(B=1, T=256, S=8192, N=2, K=1, H=128, dtype="bfloat16"),
    # head dims 96 (SW64 operand rows) and 192 (64-key tiles, 3 stages)
    Case(B=2, T=555, S=600, N=6, K=2, H=96, dtype="float16", kwargs=dict(is_causal=True)),
    Case(B=2, T=640, S=900, N=4, K=1, H=96, dtype="bfloat16", kwargs=dict(softcap=20.0)),
    Case(B=2, T=777, S=900, N=8, K=2, H=192, dtype="bfloat16"),
    Case(B=2, T=700, S=700, N=4, K=4, H=192, dtype="bfloat16",
         kwargs=dict(is_causal=True, local_window_size=(150, 0))),
    Case(B=1, T=256, S=4096, N=2, K=1, H=192, dtype="float16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-h{c.H}-T{c.T}S{c.S}"
                         f"-N{c.N}K{c.K}-{'-'.join(sorted(c.kwargs)) or 'dense'}")
def test_sm100_forward_matches_reference(case):
    q, k, v, kw = case.make()
    plan = jaxflash.explain(q, k, v, implementation="cute", **kw)
    assert plan.detail.fwd.kernel.endswith(":FlashFwdSm100"), plan
    out, lse = jaxflash.flash_attention(q, k, v, implementation="cute", return_residual=True,
                                        **kw)
    ref_out, ref_lse = oracle(q, k, v, **kw)
    assert_forward_close(out, lse, ref_out, ref_lse, case.dtype)
