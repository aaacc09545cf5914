"""The implementations the harness compares, each as `attn(q, k, v, causal) -> out` on
[B, S, N, D] arrays (the layout jax.nn.dot_product_attention and jaxflash share).

Nothing here decides whether an implementation *can* run a point: the harness calls it and records
the error text when it cannot. The only rule applied up front is `skip_reason` (problems we know
would exhaust memory rather than fail cleanly).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax

# Materializing S x S logits (float32 inside jaxflash's reference, bf16+f32 in jax.nn's xla) at
# S = 16k is 32 GiB per 32 heads before the backward's copies: skip rather than OOM the card.
XLA_MAX_S = 8192


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    about: str
    attn: Callable  # (q, k, v, causal) -> out
    ours: bool = False  # a jaxflash backend: gets a "vs cuDNN" ratio column
    max_s: Optional[int] = None

    def skip_reason(self, point) -> Optional[str]:
        if self.max_s is not None and point.S > self.max_s:
            return (f"skipped: materializes S x S (S={point.S} > {self.max_s}); memory, "
                    f"not speed, would decide it")
        return None


def _jaxflash(implementation):
    def attn(q, k, v, causal):
        import jaxflash
        return jaxflash.flash_attention(q, k, v, is_causal=causal, implementation=implementation)
    return attn


def _jax_nn(implementation):
    def attn(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation=implementation)
    return attn


def _pallas_triton(q, k, v, causal):
    # JAX's deprecated Pallas-Triton op, with its default block sizes (as the anchors ran it).
    from jax.experimental.pallas.ops.gpu import attention as pl_attention
    return pl_attention.mha(q, k, v, segment_ids=None, causal=causal,
                            sm_scale=1.0 / math.sqrt(q.shape[-1]))


def _tokamax(q, k, v, causal):
    import tokamax  # only where installed; the ImportError text is recorded otherwise
    return tokamax.dot_product_attention(q, k, v, is_causal=causal)


IMPLS = {
    i.name: i
    for i in (
        Impl("cute", "jaxflash implementation='cute' (CuTe DSL kernels via XLA FFI)",
             _jaxflash("cute"), ours=True),
        Impl("pallas", "jaxflash implementation='pallas' (our Pallas kernels)",
             _jaxflash("pallas"), ours=True),
        Impl("xla", "jaxflash implementation='xla' (float32 reference, materializes S x S)",
             _jaxflash("xla"), ours=True, max_s=XLA_MAX_S),
        Impl("cudnn", "jax.nn.dot_product_attention(implementation='cudnn')", _jax_nn("cudnn")),
        Impl("jax-xla", "jax.nn.dot_product_attention(implementation='xla')", _jax_nn("xla"),
             max_s=XLA_MAX_S),
        Impl("pallas-triton", "jax.experimental.pallas.ops.gpu.attention.mha (deprecated)",
             _pallas_triton),
        Impl("tokamax", "tokamax.dot_product_attention (default implementation)", _tokamax),
    )
}

# The baselines every output is checked against, first that runs at the point: cuDNN on a GPU;
# jax.nn's XLA path (then jaxflash's float32 reference) where cuDNN cannot run, e.g. on CPU.
CHECK_BASELINES = ("cudnn", "jax-xla", "xla")

# Order of measurement. When the run's time budget runs out, later entries are skipped, so the
# figures that matter most come first: our forward beside cuDNN's, then our forward+backward
# (CuTe and the Pallas fallback) beside cuDNN's, then everything else.
PRIORITY = (
    ("fwd", ("cudnn", "cute", "pallas")),
    ("fwdbwd", ("cudnn", "cute", "pallas")),
    ("fwd", ("pallas-triton", "tokamax", "jax-xla", "xla")),
    ("fwdbwd", ("pallas-triton", "tokamax", "jax-xla", "xla")),
)


def parse(spec: str):
    """'cute,pallas' -> [Impl, ...]; 'all' -> every one. Unknown names are a ValueError."""
    if spec in (None, "", "all"):
        return list(IMPLS.values())
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in IMPLS]
    if bad:
        raise ValueError(f"unknown implementation(s) {bad}; choose from {sorted(IMPLS)}")
    return [IMPLS[n] for n in dict.fromkeys(names)]


def phases(selected, modes):
    """[(mode, [Impl, ...]), ...] in PRIORITY order, restricted to what was selected."""
    by_name = {i.name: i for i in selected}
    out = []
    for mode, group in PRIORITY:
        if mode not in modes:
            continue
        chosen = [by_name[n] for n in group if n in by_name]
        if chosen:
            out.append((mode, chosen))
    # Implementations outside PRIORITY (added by a caller or a test) come last.
    listed = {n for _, group in PRIORITY for n in group}
    extra = [i for i in selected if i.name not in listed]
    for mode in modes:
        if extra:
            out.append((mode, extra))
    return out
