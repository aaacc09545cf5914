"""How the bridge launches the sm_100a FP4 Direct-P forward, and the XLA-side operands it reads.

`sm100_fwd_fp4_launch` is the kernel's `jaxflash.ffi.Launch` (DSL-free). `fp4_kernel_operands`
quantizes float q, k, v in JAX exactly as the emulator does (`jaxflash.fp4.direct_p`: NVFP4
Q / K with a global factor per (batch, head), MXFP4 V along the keys, the same formats code)
and lays the codes and scales out as the kernel reads them (`variants.sm100_fwd_fp4`):
E2M1 codes packed two a byte, V transposed (keys contiguous), the block scales in 128-row
chunks in the tcgen05 scale-factor byte order, the NVFP4 global factors folded into the score
scale, and the row reference of the accurate policy / the guard (anchor rows, as the emulator).
"""
from __future__ import annotations

import numpy as np

from jaxflash.ffi.variant import Launch, TensorArg
from jaxflash.fp4 import constants as C
from jaxflash.kernels import KERNELS
from jaxflash.kernels.variants.sm100_fwd_fp4 import (SF_ATOM_ROWS, TILE_N, Sm100FwdFp4Config,
                                                     scale_atom_offset)
from jaxflash.kernels.variants.sm100_fwd import TILE_M

KERNEL_REF = KERNELS["sm100_fwd_fp4"].kernel_class()


def sm100_fwd_fp4_launch(config: Sm100FwdFp4Config, arch: str = "sm_100a") -> Launch:
    h, hv = config.head_dim, config.head_dim_v
    sfq, sfk, sfv = config.sf_bytes()
    u8 = "uint8"
    inputs = [TensorArg(u8, (None, None, None, h // 2)), TensorArg(u8, (None, None, None, h // 2)),
              TensorArg(u8, (None, None, hv, None), divisibility=(None, None, None, TILE_N // 2)),
              TensorArg(u8, (None, None, None, sfq)), TensorArg(u8, (None, None, None, sfk)),
              TensorArg(u8, (None, None, None, sfv)), TensorArg("float32", (None, None), align=4)]
    if config.has_row_ref:
        inputs.append(TensorArg("float32", (None, None, None), align=4))
    outputs = (TensorArg(config.out_dtype, (None, None, None, hv)),
               TensorArg("float32", (None, None, None), align=4))
    return Launch(kernel=KERNEL_REF, config=config, inputs=tuple(inputs), outputs=outputs,
                  arch=arch)


def _chunk_permutation(blocks: int) -> np.ndarray:
    """perm[byte] = row * blocks + block: gathers a [128, blocks] tile of scale bytes into
    its chunk order."""
    perm = np.empty(SF_ATOM_ROWS * blocks, np.int32)
    for r in range(SF_ATOM_ROWS):
        for b in range(blocks):
            perm[scale_atom_offset(r, b)] = r * blocks + b
    return perm


def _chunks(scales, rows: int, tile_rows: int, blocks_per_tile: int, tiles_along_blocks: bool):
    """Scale bytes [..., rows, nblocks] -> [..., tiles, chunk] (rows padded to whole tiles /
    atoms with zero bytes). ``tiles_along_blocks``: tiles cut the block axis (V: 4 blocks of
    32 keys per 128-key tile, rows = the value dims) instead of the row axis (Q, K)."""
    import jax.numpy as jnp
    s = jnp.asarray(scales, jnp.uint8)
    lead = s.shape[:-2]
    if tiles_along_blocks:
        n_tiles = s.shape[-1] // blocks_per_tile
        pad_rows = -(-rows // SF_ATOM_ROWS) * SF_ATOM_ROWS - rows
        s = jnp.pad(s, [(0, 0)] * len(lead) + [(0, pad_rows), (0, 0)])
        s = s.reshape(lead + (s.shape[-2] // SF_ATOM_ROWS, SF_ATOM_ROWS, n_tiles,
                              blocks_per_tile))
        s = jnp.moveaxis(s, -2, -4)       # [..., tiles, row atoms, 128, blocks]
        s = s.reshape(lead + (n_tiles, -1, SF_ATOM_ROWS * blocks_per_tile))
        perm = jnp.asarray(_chunk_permutation(blocks_per_tile))
        return s[..., perm].reshape(lead + (n_tiles, -1))
    n_tiles = -(-rows // tile_rows)
    s = jnp.pad(s, [(0, 0)] * len(lead) + [(0, n_tiles * tile_rows - rows), (0, 0)])
    s = s.reshape(lead + (n_tiles, tile_rows * blocks_per_tile))
    return s[..., jnp.asarray(_chunk_permutation(blocks_per_tile))]


def fp4_kernel_operands(config: Sm100FwdFp4Config, q, k, v, *, scale=None, guard_margin=None,
                        qk_global: str = "head") -> list:
    """The launch's input arrays for float q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv]:
    q, k, vt, sfq, sfk, sfv, qk_scale [, m_ref]. ``guard_margin``: the guard's M (with
    ``config.guard_shift`` = L; default `constants.GUARD_DEFAULT_M_L`'s)."""
    import jax.numpy as jnp
    from jaxflash.fp4 import formats as F
    B, T, N, H = q.shape
    _, S, K, Hv = v.shape
    if H != config.head_dim or Hv != config.head_dim_v:
        raise ValueError(f"head dims {H}/{Hv} do not match the variant {config.key}")
    scale = float(1.0 / np.sqrt(H)) if scale is None else float(scale)
    gax = (2, 3) if qk_global == "head" else (0, 1, 2, 3)
    qn = F.nvfp4_quantize(jnp.transpose(q, (0, 2, 1, 3)).astype(jnp.float32), global_axes=gax)
    kn = F.nvfp4_quantize(jnp.transpose(k, (0, 2, 1, 3)).astype(jnp.float32), global_axes=gax)
    n_tiles = -(-S // TILE_N)
    vt = jnp.transpose(v, (0, 2, 3, 1)).astype(jnp.float32)            # [B, K, Hv, S]
    vt = jnp.pad(vt, ((0, 0), (0, 0), (0, 0), (0, n_tiles * TILE_N - S)))
    vm = F.mxfp4_quantize(vt, rule=C.V_SCALE_RULE)
    ins = [jnp.transpose(F.pack_e2m1(qn.codes), (0, 2, 1, 3)),
           jnp.transpose(F.pack_e2m1(kn.codes), (0, 2, 1, 3)),
           F.pack_e2m1(vm.codes),
           _chunks(qn.scales, T, TILE_M, H // C.QK_BLOCK, False),
           _chunks(kn.scales, S, TILE_N, H // C.QK_BLOCK, False),
           _chunks(vm.scales, Hv, None, TILE_N // C.V_BLOCK, True)]
    gq = jnp.broadcast_to(qn.global_scale, (B, N, 1, 1))[..., 0, 0]
    gk = jnp.broadcast_to(kn.global_scale, (B, K, 1, 1))[..., 0, 0]
    gk = jnp.repeat(gk, N // K, axis=1)
    # z = scale * q_hat . k_hat = scale / (G_q G_k) * (the MMA's sum of code x scale products)
    ins.append((jnp.float32(scale * C.LOG2E) / (gq * gk)).astype(jnp.float32))
    if config.has_row_ref:
        ins.append(row_reference(config, F.nvfp4_dequantize(qn), F.nvfp4_dequantize(kn), scale,
                                 guard_margin))
    return ins


def row_reference(config: Sm100FwdFp4Config, q_hat, k_hat, scale: float, guard_margin=None):
    """m_i [B, N, T] in logit units, as the emulator: the max over evenly spread anchor key
    rows (the accurate policy's 32; the guard's 128, plus M ln 2)."""
    import jax.numpy as jnp
    from jax import lax
    B, N, T, H = q_hat.shape
    K, S = k_hat.shape[1], k_hat.shape[2]
    if config.guard_shift is not None:
        n, M = C.GUARD_SAMPLE_ROWS, (C.GUARD_DEFAULT_M_L[0] if guard_margin is None
                                     else guard_margin)
        C.check_guard(M, config.guard_shift)
    else:
        n, M = config.params["anchor_rows"], 0
    n = min(n, S)
    idx = (np.arange(n) * S) // n
    qg = q_hat.reshape(B, K, N // K, T, H)
    z = jnp.einsum("bkgth,bksh->bkgts", qg, k_hat[:, :, idx],
                   precision=lax.Precision.HIGHEST) * jnp.float32(scale)
    return (jnp.max(z, axis=-1) + jnp.float32(M * C.LN2)).reshape(B, N, T)
