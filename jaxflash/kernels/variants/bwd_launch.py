"""How the bridge launches the Hopper backward kernel: its `jaxflash.ffi.Launch` (DSL-free).

Inputs (row-major): q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], do [B, T, N, Hv] (one
dtype), lse2 [B, N, Tp] and delta [B, N, Tp] float32 with Tp = `padded_len` (T rounded up
to a multiple of both `LSE_PAD` and tile_m)
(lse2 = LSE * log2(e), +inf where a row sees no key, is past q_seqlen or is padding; delta =
rowsum(dO * O)), then q_seqlen / kv_seqlen [B] int32 when the config has them, alibi slopes
[1, N] float32 (``has_alibi``), and (``has_segments``) q_segment_ids [B, T], kv_segment_ids
[B, S], kv_blocks [B, ceil(S/tile_n), 4] and q_blocks [B, ceil(T/tile_m), 2] int32
(`segments.block_summaries(kv_seg, q_seg, tile_n, tile_m)`: rows = keys).
With ``has_alibi`` an output alibi_parts [B, N, ceil(S/tile_n), ALIBI_PARTS] float32 follows dv:
per-warp partial sums of dS_ij |i - j| (the caller returns d(slopes) = -their sum over all but N).
Outputs: dq_acc [B, T, N, H] float32 (the kernel zeroes it, then adds dS K into it; the caller
multiplies by the softmax scale), dk [B, S, K, H] (scale folded in), dv [B, S, K, Hv]. With
``dq_flat`` dq_acc is [B, N, ceil(T / tile_m), tile_m * H] in the consumers' fragment order
(`dq_acc_shape`; `dq_from_flat` turns it into [B, T, N, H]).
With ``deterministic``, a fourth output dq_sem [B, N, ceil(T / tile_m)] int32: the kernel's
key-block-order semaphores (zeroed by the kernel; the caller drops it).
Scalars as the forward's: float32 (softmax_scale, softcap), int32 (window_left, window_right)
only with a window.
"""
from __future__ import annotations

import math

from jaxflash.ffi.variant import Launch, TensorArg
from jaxflash.kernels.variants.bwd import (ALIBI_PARTS, FLOAT_SCALARS, INT_SCALARS, LSE_PAD,
                                          BwdConfig)
from jaxflash.kernels.variants.fwd_launch import mod_inputs

KERNEL_REF = "jaxflash.kernels.sm90.bwd:FlashBwdSm90"
# hd 192 / 256: consumer warpgroups split the head dim (see `BwdConfig.split`).
WIDE_KERNEL_REF = "jaxflash.kernels.sm90.bwd_wide:FlashBwdSm90Wide"


def kernel_ref(config: BwdConfig) -> str:
    """The one place that maps a backward config to its kernel class."""
    return KERNEL_REF if config.split == "keys" else WIDE_KERNEL_REF


def bwd_launch(config: BwdConfig, arch: str = "sm_90a") -> Launch:
    dt = config.dtype
    h, hv = config.head_dim, config.head_dim_v
    rows = TensorArg("float32", (None, None, None), divisibility=(None, None, LSE_PAD))
    inputs = [TensorArg(dt, (None, None, None, h)), TensorArg(dt, (None, None, None, h)),
              TensorArg(dt, (None, None, None, hv)), TensorArg(dt, (None, None, None, hv)),
              rows, rows]
    if config.has_q_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    if config.has_kv_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    if config.has_alibi:
        inputs.append(TensorArg("float32", (1, None)))
    if config.has_segments:
        inputs += [TensorArg("int32", (None, None)), TensorArg("int32", (None, None)),
                   TensorArg("int32", (None, None, 4)), TensorArg("int32", (None, None, 2))]
    inputs += mod_inputs(config)  # the mask_mod's table (rows = key blocks), the aux arrays
    dq_last = config.tile_m * h if config.dq_flat else h
    outputs = [TensorArg("float32", (None, None, None, dq_last)),
               TensorArg(dt, (None, None, None, h)),
               TensorArg(dt, (None, None, None, hv))]
    if config.has_alibi:
        outputs.append(TensorArg("float32", (None, None, None, ALIBI_PARTS)))
    if config.deterministic:
        outputs.append(TensorArg("int32", (None, None, None)))
    return Launch(kernel=kernel_ref(config), config=config, inputs=tuple(inputs),
                  outputs=tuple(outputs),
                  scalars=FLOAT_SCALARS, int_scalars=INT_SCALARS if config.has_window else (),
                  arch=arch)


def padded_len(t: int, config: BwdConfig) -> int:
    """Tp: T rounded up to LSE_PAD and to the config's tile_m, so the last query block's
    LSE / delta box lies inside the array (its rows past T are +inf padding, not TMA fill)."""
    pad = math.lcm(LSE_PAD, config.tile_m)  # (the launch declares LSE_PAD)
    return -(-t // pad) * pad


def num_q_blocks(t: int, config: BwdConfig) -> int:
    return -(-t // config.tile_m)


def num_k_blocks(s: int, config: BwdConfig) -> int:
    return -(-s // config.tile_n)


def dq_acc_shape(B: int, T: int, N: int, H: int, config: BwdConfig) -> tuple[int, ...]:
    """Shape of the kernel's float32 dQ accumulator output (see the module docstring)."""
    if config.dq_flat:
        return (B, N, num_q_blocks(T, config), config.tile_m * H)
    return (B, T, N, H)


def dq_from_flat(acc, T: int, config: BwdConfig):
    """[B, T, N, H] from a `dq_flat` accumulator [B, N, blocks, tile_m * H] (numpy or jax).

    A block is two warpgroup parts, each 64 rows x P columns (tile_m 64: the head-dim halves
    of the dQ GEMM, P = H/2; tile_m 128: the 64-row halves, P = H), stored as C = P/8 chunks
    of 128 threads x 4 floats: float v of chunk c of thread t = 32 w + 4 lq + lr is
    accumulator register r = 4 c + v of that thread, and the wgmma accumulator puts register
    r = va + 2 vb + 4 c of warp w's lane (lq, lr) at row 16 w + 8 vb + lq, column
    8 c + 2 lr + va of the part. So the flat index factors as (wg, c, w, lq, lr, vb, va) and
    the tile as rows (w, vb, lq) x columns (wg, c, lr, va) at tile_m 64, rows
    (wg, w, vb, lq) x columns (c, lr, va) at tile_m 128.
    """
    B, N, nblk, _ = acc.shape
    H = config.head_dim
    by_rows = config.tile_m == 128
    a = acc.reshape(B, N, nblk, 2, H // (8 if by_rows else 16), 4, 8, 4, 2, 2)
    if by_rows:
        a = a.transpose(0, 2, 3, 5, 8, 6, 1, 4, 7, 9)
    else:
        a = a.transpose(0, 2, 5, 8, 6, 1, 3, 4, 7, 9)
    return a.reshape(B, nblk * config.tile_m, N, H)[:, :T]
