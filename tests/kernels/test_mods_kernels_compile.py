"""Score / mask mods compiled into the Hopper kernels for sm_90a (no GPU): the variants dispatch
picks for causal, ALiBi, softcap as mods, document masking, a T5 bias (aux gather) and a
user-written mod, forward and backward. Their PTX holds the emitted operations, no local
memory, and (where a usable ptxas is installed) no spills and no serialized wgmma.

About 5-10 s per compile on 2 cores: twelve compiles.
"""
from __future__ import annotations

import os
import re
import tempfile

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxflash._types import AttentionStatics, Problem  # noqa: E402
from jaxflash.mods import library as L  # noqa: E402
from jaxflash.mods.spec import make_spec  # noqa: E402
from tests.common import ptxas_report  # noqa: E402
from tests.kernels.test_mods_gpu import _user_mask, _user_score  # noqa: E402


def _problem(spec, H=128, causal=False, T=2048):
    st = AttentionStatics(scale=H ** -0.5, is_causal=causal, mods=spec)
    return Problem(batch=2, q_len=T, kv_len=T, num_heads=8, num_kv_heads=2, head_dim=H,
                   head_dim_v=H, dtype="bfloat16", statics=st, platform="cuda")


# Aux element reads: a scalar load each (the runtime scalars and tables take a few).
AUX_LOADS = (r"ld\.global\.b32", 16)
# (id, score_mod, mask_mod, aux, head dim, built-in causal, (PTX pattern, least count) the
# mods add)
CASES = [
    ("causal-as-mod", None, L.causal(), (), 128, False, [(r"selp\.f32", 16)]),
    ("alibi-as-mod", L.alibi(), L.causal(), (np.ones(8, np.float32),), 64, False,
     [(r"cvt\.rn\.f32\.s32", 16)]),
    ("softcap-as-mod", L.softcap(30.0), None, (), 128, True, [(r"tanh\.approx\.f32", 32)]),
    ("document", None, L.document(), (np.zeros((2, 2048), np.int32),), 128, False,
     [AUX_LOADS, (r"selp\.f32", 16)]),
    ("t5-bias", L.t5_bias(), None, (np.zeros((32, 8), np.float32),), 128, False,
     [(r"lg2\.approx", 16), AUX_LOADS]),
    ("user-written", _user_score, _user_mask, (np.zeros(2048, np.float32),), 64, False,
     [(r"tanh\.approx\.f32", 16), (r"mul\.hi\.s32|div\.s32|rem\.s32", 16)]),
]


# ptxas spill stores measured with this repo's ptxas (CUDA 13.0, PTX version lowered; the
# built-in softcap backward at hd 128 spills 4 B there): (case, direction) -> bytes allowed.
# Guards against growth; every other case must stay at 0. The score_mod backward holds S^T,
# dP^T, dK and dV (hd 128: 192 floats a thread) while it evaluates the mod per element; the T5
# bucket (a log and ~20 operations per score, with a table load) is the heaviest mod here.
SPILL_BUDGET = {("softcap-as-mod", "bwd"): 16, ("t5-bias", "fwd"): 48, ("t5-bias", "bwd"): 64}


def _launch(direction, problem):
    from jaxflash.kernels import plan
    return (plan.forward_launch if direction == "fwd" else plan.backward_launch)(problem)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_mod_variant_compiles_clean(case, direction, monkeypatch, tmp_path):
    from devtools.ptx_digest import ptx_of
    monkeypatch.setenv("JAXFLASH_CUTE_UNVERIFIED", "1")
    name, sm, mm, aux, H, causal, patterns = case
    spec, _ = make_spec(sm, mm, tuple(jnp.asarray(a) for a in aux))
    launch = _launch(direction, _problem(spec, H, causal))
    cfg = launch.config
    assert (bool(cfg.score_mod), bool(cfg.mask_mod)) == (sm is not None, mm is not None)
    assert "mod" in cfg.key
    with tempfile.TemporaryDirectory() as d:
        ptx = ptx_of(launch, d)
    for pat, least in patterns:
        n = len(re.findall(pat, ptx))
        assert n >= least, f"{cfg.key}: {n} x {pat} in the PTX (expected >= {least})"
    assert "ld.local" not in ptx and "st.local" not in ptx
    report = ptxas_report(ptx, tmp_path)
    if report is not None:
        assert "C7512" not in report and "serialized" not in report, report
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        budget = SPILL_BUDGET.get((name, direction), 0)
        print(f"{cfg.key}: ptxas spill stores {max(spills)} B (budget {budget} B)")
        assert spills and max(spills) <= budget, report


def test_mod_variants_are_dispatched_without_the_switch(monkeypatch):
    """The mods' variants passed their GPU checks (tests/kernels/test_mods_gpu.py on the H200):
    the plan picks them with no switch set, forward and backward."""
    monkeypatch.delenv("JAXFLASH_CUTE_UNVERIFIED", raising=False)
    spec, _ = make_spec(L.softcap(30.0), L.causal(), ())
    for direction in ("fwd", "bwd"):
        launch = _launch(direction, _problem(spec))
        assert launch.config.mask_mod and launch.config.score_mod, launch.name


def test_long_context_mask_table_is_not_classified_on_the_host(monkeypatch):
    """Past `CONSTANT_TABLE_MAX_PAIRS` (query, key) pairs a mask that reads no aux gets its
    block table from the device at run time, not from a host evaluation over T x S while
    tracing (minutes at 1M tokens): lowering 128k tokens forward and backward never calls it."""
    import jax

    import jaxflash
    from jaxflash.kernels import mod_blocks

    def host_table(*args, **kwargs):
        raise AssertionError("the T x S mask table was classified on the host")

    monkeypatch.setattr(mod_blocks, "constant_table", host_table)
    S = 2**17
    assert S * S > mod_blocks.CONSTANT_TABLE_MAX_PAIRS
    q = jax.ShapeDtypeStruct((1, S, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, S, 1, 128), jnp.bfloat16)
    f = lambda q, k, v: jnp.sum(jaxflash.flash_attention(
        q, k, v, mask_mod=L.chunked(4096)).astype(jnp.float32))
    with jaxflash.target_platform("cuda"):
        text = jax.jit(jax.grad(f)).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert "CuteDSLRT" in text
