"""How the bridge launches the forward kernels (Hopper `FlashFwdSm90`, Blackwell `FlashFwdSm100`):
their `jaxflash.ffi.Launch` (DSL-free). Both take the same tensors and scalars.

Tensors are the canonical jaxflash layouts, row-major: q [B, T, N, H], k [B, S, K, H],
v [B, S, K, Hv], optional q_seqlen / kv_seqlen [B] int32, optional alibi slopes [1, N] float32
(dim 0 fixed at 1 so `jax.vmap` shares it between batch entries instead of folding it), optional
segment inputs q_segment_ids [B, T], kv_segment_ids [B, S] int32 and their block summaries
q_blocks [B, ceil(T/tile_m), 4], kv_blocks [B, ceil(S/tile_n), 2] int32 (`segments.py`);
then with a mod (`FwdConfig.score_mod` / ``mask_mod``) its block table and aux arrays
(`mod_inputs`); outputs o [B, T, N, Hv] (q's dtype) and lse [B, N, T] float32. Only the head
dims (and aux shapes) are fixed by the variant: batch, lengths and head counts are read from
the buffers at run time (dim 0 must stay dynamic for `jax.vmap`). Scalars: float32
(softmax_scale, softcap) always (softcap ignored without ``has_softcap``); int32
(window_left, window_right) when the config has a window.
"""
from __future__ import annotations

from jaxflash.ffi.variant import Launch, TensorArg
from jaxflash.kernels import KERNELS
from jaxflash.kernels.variants.fwd import FLOAT_SCALARS, INT_SCALARS, FwdConfig

KERNEL_REF = KERNELS["sm90_fwd"].kernel_class()
SM100_KERNEL_REF = KERNELS["sm100_fwd"].kernel_class()
SM100_PAIR_REF = KERNELS["sm100_fwd"].kernel_class("pair")


def fwd_launch(config: FwdConfig, arch: str = "sm_90a") -> Launch:
    return _launch(KERNEL_REF, config, arch)


def sm100_fwd_launch(config, arch: str = "sm_100a") -> Launch:
    """The Blackwell forward's launch (`variants.sm100_fwd.Sm100FwdConfig`; ``two_cta``
    variants run on CTA pairs, `FlashFwdSm100Pair`)."""
    return _launch(SM100_PAIR_REF if getattr(config, "two_cta", False) else SM100_KERNEL_REF,
                   config, arch)


def core_inputs(config) -> list:
    """q, k, v and the optional mask operands a forward config uses, in launch order (shared by
    the bf16, FP8 and Blackwell forwards; a config without an ALiBi field takes none)."""
    dt = config.dtype
    h, hv = config.head_dim, config.head_dim_v
    inputs = [TensorArg(dt, (None, None, None, h)), TensorArg(dt, (None, None, None, h)),
              TensorArg(dt, (None, None, None, hv))]
    if config.has_q_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    if config.has_kv_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    if getattr(config, "has_alibi", False):
        inputs.append(TensorArg("float32", (1, None)))
    if config.has_segments:
        inputs += [TensorArg("int32", (None, None)), TensorArg("int32", (None, None)),
                   TensorArg("int32", (None, None, 4)), TensorArg("int32", (None, None, 2))]
    return inputs


def _launch(kernel_ref: str, config, arch: str) -> Launch:
    dt = config.dtype
    hv = config.head_dim_v
    inputs = core_inputs(config) + mod_inputs(config)
    outputs = (TensorArg(dt, (None, None, None, hv)), TensorArg("float32", (None, None, None)))
    return Launch(kernel=kernel_ref, config=config, inputs=tuple(inputs), outputs=outputs,
                  scalars=FLOAT_SCALARS, int_scalars=INT_SCALARS if config.has_window else (),
                  arch=arch)


def mod_inputs(config) -> list:
    """A mod variant's extra inputs: the (batch, head) offsets [2] int32 the mods add to the
    kernel's own indices (a shard's first global ones; zeros unsharded), the block range table
    [Bb, Hb, blocks, 4] int32 (with a mask_mod; `jaxflash.kernels.mod_blocks`), then the aux
    arrays at their fixed shapes."""
    # (configs without mods, the Blackwell forward's, have neither field)
    score, mask = getattr(config, "score_mod", ""), getattr(config, "mask_mod", "")
    if not (score or mask):
        return []
    ins = [TensorArg("int32", (2,))]
    ins += [TensorArg("int32", (None, None, None, 4))] if mask else []
    return ins + [TensorArg(dt, shape) for dt, shape in config.aux]


def fwd_inputs(config: FwdConfig, q, k, v, q_seqlen=None, kv_seqlen=None, alibi_slopes=None,
               q_segment_ids=None, kv_segment_ids=None) -> list:
    """The launch's input arrays in order: (q, k, v) then the optional ones the config uses
    (each must then be given), with the segment block summaries computed here in XLA."""
    import jax.numpy as jnp
    from jaxflash.kernels.common.segments import block_summaries
    ins = [q, k, v]
    want = (("has_q_seqlen", "q_seqlen", q_seqlen), ("has_kv_seqlen", "kv_seqlen", kv_seqlen),
            ("has_alibi", "alibi_slopes", alibi_slopes),
            ("has_segments", "q_segment_ids", q_segment_ids),
            ("has_segments", "kv_segment_ids", kv_segment_ids))
    for flag, name, x in want:
        if getattr(config, flag) and x is None:
            raise ValueError(f"variant {config.key} needs {name}")
    if config.has_q_seqlen:
        ins.append(jnp.asarray(q_seqlen, jnp.int32))
    if config.has_kv_seqlen:
        ins.append(jnp.asarray(kv_seqlen, jnp.int32))
    if config.has_alibi:
        slopes = jnp.asarray(alibi_slopes, jnp.float32)
        if slopes.shape != (q.shape[2],):
            raise ValueError(f"alibi_slopes must have shape (N,) = ({q.shape[2]},); got "
                             f"{slopes.shape}")
        ins.append(slopes.reshape(1, -1))
    if config.has_segments:
        qs = jnp.asarray(q_segment_ids, jnp.int32)
        ks = jnp.asarray(kv_segment_ids, jnp.int32)
        if qs.shape != q.shape[:2] or ks.shape != k.shape[:2]:
            raise ValueError(f"segment ids must be [B, T] = {q.shape[:2]} and [B, S] = "
                             f"{k.shape[:2]}; got {qs.shape} and {ks.shape}")
        q_blocks, kv_blocks = block_summaries(qs, ks, config.tile_m, config.tile_n)
        ins += [qs, ks, q_blocks, kv_blocks]
    return ins


def fwd_scalars(statics) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(float scalars, int scalars) of a call with `jaxflash._types.AttentionStatics`."""
    softcap = statics.softcap if statics.softcap is not None else 1.0
    ints = ()
    if statics.window is not None:
        left, right = (int(w) for w in statics.window)
        # under the causal flag the right bound is at most 0: given so, the same scalars serve
        # the window-alone variant a causal short window runs as (`choose.window_only`)
        ints = (left, min(right, 0) if statics.is_causal else right)
    return (float(statics.scale), float(softcap)), ints
