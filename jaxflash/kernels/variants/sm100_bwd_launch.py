"""The Blackwell backward's launch description (`Sm100BwdConfig` -> `jaxflash.ffi.variant.Launch`).

The tensors and their order are the Hopper backward's (`bwd_launch`), so `kernels.call` feeds
both the same way: q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], do [B, T, N, Hv], lse2 and
delta [B, N, Tp] float32 (Tp = T padded to a multiple of 128, `bwd_launch.padded_len`), then
q_seqlen / kv_seqlen [B] int32, the ALiBi slopes [1, N] float32 and (``has_segments``)
q_segment_ids [B, T], kv_segment_ids [B, S], kv_blocks [B, ceil(S / 128), 4] and q_blocks
[B, ceil(T / 128), 2] int32 (`segments.block_summaries(kv_seg, q_seg, 128, 128)`: rows = keys)
when the config has them;
outputs dq_acc [B, T, N, H] float32 (zeroed by the kernel, unscaled), dk [B, S, K, H] (scale
folded in), dv [B, S, K, Hv], with ALiBi alibi_parts [B, N, ceil(S / 128), ALIBI_PARTS] float32
(per compute warp sums of dS_ij |i - j|), and with ``deterministic`` the ordering semaphores
dq_sem [B, N, ceil(T / 128)] int32 (scratch).

At hd 256 the backward is two launches of the kernel (`Sm100BwdConfig.passes`), with the same
inputs: "dv" writes dv only; "dkdq" writes dq_acc, dk and the ALiBi partials / semaphores
(its query blocks are 64 rows: dq_sem [B, N, ceil(T / 64)]). `OUTPUTS` names each pass's
outputs; `pass_launches` gives a backward's launches in order.
"""
from __future__ import annotations

from jaxflash.ffi.variant import Launch, TensorArg
from jaxflash.kernels.variants.bwd import ALIBI_PARTS, FLOAT_SCALARS, INT_SCALARS, LSE_PAD
from jaxflash.kernels.variants.sm100_bwd import Sm100BwdConfig

KERNEL_REF = "jaxflash.kernels.sm100.bwd:FlashBwdSm100"


def output_names(config: Sm100BwdConfig) -> tuple[str, ...]:
    """The outputs a pass's launch writes, in order (the kernel's `launch_layout` too)."""
    names = ["dq_acc", "dk"] if config.has_dkdq else []
    names += ["dv"] if config.has_dv else []
    if config.has_dkdq:
        names += ["alibi_parts"] * config.has_alibi + ["dq_sem"] * config.deterministic
    return tuple(names)


def pass_launches(launch: Launch) -> tuple[Launch, ...]:
    """The launches a backward `launch` stands for: itself, or at hd 256 its two passes."""
    configs = launch.config.passes()
    if configs == (launch.config,):
        return (launch,)
    return tuple(sm100_bwd_launch(c, launch.arch) for c in configs)


def sm100_bwd_launch(config: Sm100BwdConfig, arch: str = "sm_100a") -> Launch:
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
    args = {"dq_acc": TensorArg("float32", (None, None, None, h)),
            "dk": TensorArg(dt, (None, None, None, h)), "dv": TensorArg(dt, (None, None, None, hv)),
            "alibi_parts": TensorArg("float32", (None, None, None, ALIBI_PARTS)),
            "dq_sem": TensorArg("int32", (None, None, None))}
    outputs = [args[n] for n in output_names(config)]
    return Launch(kernel=KERNEL_REF, config=config, inputs=tuple(inputs),
                  outputs=tuple(outputs), scalars=FLOAT_SCALARS,
                  int_scalars=INT_SCALARS if config.has_window else (), arch=arch)
