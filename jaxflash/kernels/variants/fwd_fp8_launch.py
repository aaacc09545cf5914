"""How the bridge launches the FP8 forward kernels (Hopper `FlashFwdSm90Fp8`, Blackwell
`FlashFwdSm100Fp8`): their `jaxflash.ffi.Launch` (DSL-free).

Tensors: q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] float8_e4m3fn (row-major: V is
transposed inside the kernel; with ``v_transposed`` v is V^T [B, K, Hv, Sp] as `fp8_v_layout`
writes it), then optional q_seqlen / kv_seqlen [B] int32 and the segment
inputs (as `fwd_launch`), then q_descale [B, N, nq], k_descale [B, K, nk], v_descale [B, K, nv]
float32 (nb = 1, or one per tile of rows with the config's q_blocks / k_blocks / v_blocks);
outputs o [B, T, N, Hv] (``out_dtype``) and lse [B, N, T] float32. Scalars as `fwd_launch`.
"""
from __future__ import annotations

from jaxflash.ffi.variant import Launch, TensorArg
from jaxflash.kernels import KERNELS
from jaxflash.kernels.variants.fwd import FLOAT_SCALARS, INT_SCALARS
from jaxflash.kernels.variants.fwd_fp8 import Fp8FwdConfig
from jaxflash.kernels.variants.fwd_launch import core_inputs

KERNEL_REF = KERNELS["sm90_fwd_fp8"].kernel_class()
SM100_KERNEL_REF = KERNELS["sm100_fwd_fp8"].kernel_class()


def fwd_fp8_launch(config: Fp8FwdConfig, arch: str = "sm_90a") -> Launch:
    return _launch(KERNEL_REF, config, arch)


def sm100_fwd_fp8_launch(config, arch: str = "sm_100a") -> Launch:
    """The Blackwell FP8 forward's launch (`variants.sm100_fwd_fp8.Sm100Fp8FwdConfig`): the
    same tensors and scalars as Hopper's."""
    return _launch(SM100_KERNEL_REF, config, arch)


def _launch(kernel_ref: str, config, arch: str) -> Launch:
    hv = config.head_dim_v
    inputs = core_inputs(config)
    if getattr(config, "v_transposed", False):  # V^T [B, K, Hv, Sp], 16 | Sp (TMA strides)
        inputs[2] = TensorArg(config.dtype, (None, None, hv, None),
                              divisibility=(None, None, None, 16))
    # descales: 4-byte aligned rows of any length (no TMA reads them)
    inputs += [TensorArg("float32", (None, None, None), align=4) for _ in range(3)]
    outputs = (TensorArg(config.out_dtype, (None, None, None, hv)),
               TensorArg("float32", (None, None, None)))
    return Launch(kernel=kernel_ref, config=config, inputs=tuple(inputs), outputs=outputs,
                  scalars=FLOAT_SCALARS, int_scalars=INT_SCALARS if config.has_window else (),
                  arch=arch)


# V^T's key order within each 16 (a `keys_major` split): key 16c + 8a + 2q + b at position
# 16c + 4q + 2a + b.
V_SPLIT = ((2, 4, 2), (1, 0, 2))


def fp8_v_layout(v):
    """V [B, S, K, Hv] -> V^T [B, K, Hv, Sp] for a ``v_transposed`` variant: keys contiguous
    (FP8 wgmma reads its B operand K-major), zero-padded to Sp = a multiple of 16, and permuted
    within each 16 so that position 16c + 4q + 2a + b holds key 16c + 8a + 2q + b: the order in
    which a thread's score accumulator packs into the FP8 A operand
    (`layouts.acc_as_fp8_operand_a`; `sm90.v_transpose` writes the same order in the kernel).
    Keys past S are zeros the kernel masks. `keys_major` moves the bytes."""
    from jaxflash.kernels.variants.keys_major import keys_major
    S = v.shape[1]
    return keys_major(v, V_SPLIT, -(-S // 16) * 16)


def fwd_fp8_inputs(config: Fp8FwdConfig, q, k, v, q_descale, k_descale, v_descale,
                   q_seqlen=None, kv_seqlen=None, q_segment_ids=None,
                   kv_segment_ids=None) -> list:
    """The launch's input arrays in order. Scales may be scalars (per tensor), [N] / [K] (per
    head), [B, N] / [B, K], or [B, heads, nb] (the canonical layout, nb = 1 or the number of
    tiles of rows when the config has that operand's blocks); they reach the kernel as
    [B, heads, nb] float32."""
    import jax.numpy as jnp
    from jaxflash.kernels.common.segments import block_summaries
    B, _, N, _ = q.shape
    K = k.shape[2]
    ins = [q, k, fp8_v_layout(v) if getattr(config, "v_transposed", False) else v]
    for flag, name, x in (("has_q_seqlen", "q_seqlen", q_seqlen),
                          ("has_kv_seqlen", "kv_seqlen", kv_seqlen),
                          ("has_segments", "q_segment_ids", q_segment_ids),
                          ("has_segments", "kv_segment_ids", kv_segment_ids)):
        if getattr(config, flag) and x is None:
            raise ValueError(f"variant {config.key} needs {name}")
    if config.has_q_seqlen:
        ins.append(jnp.asarray(q_seqlen, jnp.int32))
    if config.has_kv_seqlen:
        ins.append(jnp.asarray(kv_seqlen, jnp.int32))
    if config.has_segments:
        qs = jnp.asarray(q_segment_ids, jnp.int32)
        ks = jnp.asarray(kv_segment_ids, jnp.int32)
        q_blocks, kv_blocks = block_summaries(qs, ks, config.tile_m, config.tile_n)
        ins += [qs, ks, q_blocks, kv_blocks]
    T, S = q.shape[1], k.shape[1]
    for name, d, heads, blocked, rows, tile in (
            ("q_descale", q_descale, N, config.q_blocks, T, config.tile_m),
            ("k_descale", k_descale, K, config.k_blocks, S, config.tile_n),
            ("v_descale", v_descale, K, config.v_blocks, S, config.tile_n)):
        d = jnp.asarray(d, jnp.float32)
        nb = -(-rows // tile) if blocked else 1
        if d.ndim == 1:
            d = d[None, :]
        if d.ndim <= 2:
            d = d.reshape(d.shape + (1,))
        try:
            ins.append(jnp.broadcast_to(d, (B, heads, nb)))
        except ValueError as e:
            raise ValueError(f"{name} of shape {d.shape} does not broadcast to (B, heads, nb) = "
                             f"({B}, {heads}, {nb})") from e
    return ins
