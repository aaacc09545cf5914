"""How the bridge launches the Hopper FP8 backward kernel: its `jaxflash.ffi.Launch` and the
orders of the transposed copies (DSL-free).

Inputs: q8 [B, T, N, H], k8 [B, S, K, H], v8 [B, S, K, Hv] float8_e4m3fn, do8 [B, T, N, Hv]
(``do_dtype``), then the transposed copies q8t [B, N, H, Tp], k8t [B, K, H, Sp] e4m3 and do8t
[B, N, Hv, Tp] (``do_dtype``), their last axis permuted within each 16 (`Q_ORDER` for the
queries, `K_ORDER` for the keys; Tp = `bwd_launch.padded_len`, Sp = S rounded up to 128, zero
padding), lse2 / delta [B, N, Tp] float32 (as the bf16 backward's), the optional lengths and
segment inputs (as `bwd_launch`), and the descales q [B, N, ceil(T / 64)], do [B, N, ceil(T /
64)], k [B, K, ceil(S / 128)], v [B, K, ceil(S / 128)] float32 (one per kernel step / key block;
k and v one per 64-key block at hd 256, the wide kernel's tile). Outputs: dq_acc [B, N, ceil(T /
64), 64 H] float32 in fragment order (`bwd_launch.dq_from_flat`; the caller multiplies by the
softmax scale), dk [B, S, K, H] and dv [B, S, K, Hv] float32. Scalars as `bwd_launch`.
"""
from __future__ import annotations

from jaxflash.ffi.variant import Launch, TensorArg
from jaxflash.kernels import KERNELS
from jaxflash.kernels.variants.bwd import FLOAT_SCALARS, INT_SCALARS, LSE_PAD
from jaxflash.kernels.variants.bwd_fp8 import Fp8BwdConfig

KERNEL_REF = KERNELS["sm90_bwd_fp8"].kernel_class()
WIDE_KERNEL_REF = KERNELS["sm90_bwd_fp8"].kernel_class("wide")
# Position p (mod 16) of a transposed copy's last axis holds this row (mod 16).
# Queries: the FP8 A operand's k position 4q + i is the accumulator column 2q + i % 2 + 8 (i // 2)
# (`layouts.acc_as_fp8_operand_a`), so P^T / dS^T need no exchange between threads.
Q_ORDER = tuple(2 * (p // 4) + (p % 4) % 2 + 8 * ((p % 4) // 2) for p in range(16))
# Keys: position 2a + b is key a + 8b, so a thread's keys r and r + 8 of dS are adjacent bytes.
K_ORDER = tuple(p // 2 + 8 * (p % 2) for p in range(16))
KEY_PAD = 128
# The same orders as reshapes and transposes of the 16 rows (what XLA applies: no gather, no
# index constant): rows 16c + r, r split as `dims` (outermost first), the position's digits
# are those axes in `perm` order. Queries: r = 8h + 2q + e -> position 4q + 2h + e; keys:
# r = 8b + a -> position 2a + b.
Q_SPLIT = ((2, 4, 2), (1, 0, 2))
K_SPLIT = ((2, 8), (1, 0))


def bwd_fp8_launch(config: Fp8BwdConfig, arch: str = "sm_90a") -> Launch:
    h, hv = config.head_dim, config.head_dim_v
    e4, do = config.dtype, config.do_dtype
    rows = TensorArg("float32", (None, None, None), divisibility=(None, None, LSE_PAD))
    tq = TensorArg(e4, (None, None, h, None), divisibility=(None, None, None, 64))
    tk = TensorArg(e4, (None, None, h, None), divisibility=(None, None, None, KEY_PAD))
    tdo = TensorArg(do, (None, None, hv, None), divisibility=(None, None, None, 64))
    inputs = [TensorArg(e4, (None, None, None, h)), TensorArg(e4, (None, None, None, h)),
              TensorArg(e4, (None, None, None, hv)), TensorArg(do, (None, None, None, hv)),
              tq, tk, tdo, rows, rows]
    if config.has_q_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    if config.has_kv_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    if config.has_segments:
        inputs += [TensorArg("int32", (None, None)), TensorArg("int32", (None, None)),
                   TensorArg("int32", (None, None, 4)), TensorArg("int32", (None, None, 2))]
    inputs += [TensorArg("float32", (None, None, None), align=4) for _ in range(4)]
    outputs = (TensorArg("float32", (None, None, None, config.tile_m * h)),
               TensorArg("float32", (None, None, None, h)),
               TensorArg("float32", (None, None, None, hv)))
    ref = KERNEL_REF if config.split == "keys" else WIDE_KERNEL_REF
    return Launch(kernel=ref, config=config, inputs=tuple(inputs), outputs=outputs,
                  scalars=FLOAT_SCALARS, int_scalars=INT_SCALARS if config.has_window else (),
                  arch=arch)
