"""The Pallas fallback's configs, refusals and GPU lowering (lowered here, without a GPU)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from jaxflash import pallas_fallback
from jaxflash._types import AttentionStatics, Problem
from jaxflash.pallas_fallback import config


@pytest.mark.parametrize("kw, msg", [
    (dict(block_q=48, block_k=64), "block_q must be a power of two"),
    (dict(block_q=64, block_k=8), "block_k must be a power of two >= 16"),
    (dict(block_q=64, block_k=64, num_warps=3), "num_warps"),
    (dict(block_q=64, block_k=64, num_stages=0), "num_stages"),
])
def test_pass_config_validates(kw, msg):
    with pytest.raises(ValueError, match=msg):
        config.PassConfig(**kw)


def test_configs_are_frozen_and_cover_every_head_dim():
    for d in (1, 16, 33, 64, 96, 128, 200, 256):
        for dt in ("bfloat16", "float16", "float32"):
            c = config.choose(d, d, dt, interpret=False)
            assert isinstance(c, config.Config)
    c = config.choose(64, 64, "bfloat16", interpret=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.fwd = None
    assert config.padded_head_dim(96) == 128 and config.padded_head_dim(8) == 16


def _problem(**kw):
    base = dict(batch=2, q_len=16, kv_len=16, num_heads=4, num_kv_heads=4, head_dim=64,
                head_dim_v=64, dtype="bfloat16", statics=AttentionStatics(scale=0.1),
                platform="cuda")
    base.update(kw)
    return Problem(**base)


@pytest.mark.parametrize("kw, msg", [
    (dict(platform="tpu"), "platform 'tpu' is not supported"),
    (dict(platform="rocm"), "platform 'rocm' is not supported"),
    (dict(head_dim=320), "head_dim 320 > 256"),
    (dict(head_dim_v=512), "head_dim_v 512 > 256"),
    # one (batch, kv head) slice past int32 indexing (larger calls are split, not refused)
    (dict(batch=1, q_len=1 << 24, kv_len=1 << 24, num_heads=1, num_kv_heads=1,
          head_dim=128), "int32"),
])
def test_check_refuses_with_reason(kw, msg):
    with pytest.raises(NotImplementedError, match=msg):
        pallas_fallback.check(_problem(**kw))


def test_check_accepts_and_explain_names_pallas():
    pallas_fallback.check(_problem())
    pallas_fallback.check(_problem(platform="cpu", head_dim=256, head_dim_v=32))
    q = jax.ShapeDtypeStruct((2, 16, 4, 320), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="head_dim 320"):
        jaxflash.flash_attention(jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape, q.dtype),
                                 jnp.zeros(q.shape, q.dtype), implementation="pallas")


def _lower_cuda(B=2, T=70, S=45, N=4, K=2, H=96, Hv=64, dtype=jnp.bfloat16, bias=None, **kw):
    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    k = jax.ShapeDtypeStruct((B, S, K, H), dtype)
    v = jax.ShapeDtypeStruct((B, S, K, Hv), dtype)

    def loss(q, k, v, *b):
        extra = {"bias": b[0]} if b else {}
        return jnp.sum(jaxflash.flash_attention(q, k, v, implementation="pallas", **kw,
                                                **extra).astype(jnp.float32))

    args = (q, k, v) + ((bias,) if bias is not None else ())
    with jaxflash.target_platform("cuda"):
        return jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name, kw", [
    ("plain", {}),
    ("causal_f32_d256", dict(H=256, Hv=256, dtype=jnp.float32, is_causal=True)),
    ("everything", dict(
        bias=jax.ShapeDtypeStruct((1, 4, 70, 45), jnp.float32), is_causal=True, softcap=5.0,
        alibi_slopes=jnp.ones(4), local_window_size=(10, 3),
        q_segment_ids=jnp.ones((2, 70), jnp.int32), kv_segment_ids=jnp.ones((2, 45), jnp.int32),
        query_seq_lengths=jnp.array([50, 70], jnp.int32),
        key_value_seq_lengths=jnp.array([20, 45], jnp.int32),
        mask=jnp.ones((2, 1, 70, 45), bool))),
])
def test_triton_lowering(name, kw):
    """Forward + backward lower to Triton custom calls (fwd, dK/dV, dQ [, dbias]) for CUDA on a
    machine without a GPU: what the H200 runs, minus the PTX compile."""
    text = _lower_cuda(**kw)
    want = 4 if "bias" in kw else 3
    assert text.count("xla.gpu.triton") == want


def test_tiles_fit_shared_memory():
    """Dense operands and smaller GPUs shrink the tiles; the estimate matches what an H200
    accepted (plain D=128 forward 128 x 128, 3 stages) and refused (bias+mask at that size)."""
    plain = config.choose(128, 128, "bfloat16", interpret=False, arch=(9, 0))
    assert (plain.fwd.block_q, plain.fwd.block_k, plain.fwd.num_stages) == (128, 128, 3)
    dense = config.choose(128, 128, "bfloat16", interpret=False, arch=(9, 0), dense_bytes=5)
    small = config.choose(128, 128, "bfloat16", interpret=False, arch=(8, 6))
    for cfg, limit in ((plain, 232448), (dense, 232448), (small, 101376)):
        for f in dataclasses.fields(cfg):
            pc = getattr(cfg, f.name)
            assert config.smem_bytes(f.name, pc, 128, 128, 2, 0 if cfg is not dense else 5) \
                <= limit
    assert config.smem_bytes("fwd", config.PassConfig(128, 128, 8, 3), 128, 128, 2, 5) > 232448
    assert dense.fwd != plain.fwd and small.fwd != plain.fwd
    with pytest.raises(NotImplementedError, match="shared memory"):
        config.fit("fwd", plain.fwd, 256, 256, 4, 8, limit=4096)


def test_target_arch_from_env(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert config.target_arch() == (10, 0)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert config.target_arch() == (9, 0)


def test_table_reading_score_mod_reserves_shared_memory(monkeypatch):
    """A score mod that reads a table per element (T5's bias table) gets smaller tiles than the
    same call without it (Triton's layout conversions for the gather take shared memory the
    stream estimate does not count); a per-head aux (ALiBi slopes) does not."""
    from jaxflash import mods
    from jaxflash.mods.spec import make_spec
    from jaxflash.pallas_fallback import _choose, _spec
    from jaxflash._types import AttentionArrays
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    q = jax.ShapeDtypeStruct((1, 300, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 333, 2, 64), jnp.bfloat16)
    arrays = AttentionArrays()
    st = AttentionStatics(scale=0.125)
    spec = _spec(q, k, k, arrays, st)
    t5, _ = make_spec(score_mod=mods.t5_bias(0), aux=(jnp.zeros((32, 4), jnp.float32),))
    alibi, _ = make_spec(score_mod=mods.alibi(0), aux=(jnp.zeros((4,), jnp.float32),))
    plain = _choose(q, arrays, spec, False)
    assert _choose(q, arrays, spec, False, alibi) == plain

    def elems(c):
        return c.block_q * c.block_k * c.num_stages

    reserved = _choose(q, arrays, spec, False, t5)
    for kind in ("fwd", "dq", "dkdv"):
        assert elems(getattr(reserved, kind)) < elems(getattr(plain, kind)), kind
