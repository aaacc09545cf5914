"""Walking the bridge's positional arguments in a kernel's host ``__call__``.

`jaxflash.ffi` passes inputs, outputs, float scalars, [int scalars] and the stream as one flat
list whose optional members depend on the variant's static features; both Hopper kernels read
it with this cursor instead of hand-counted offsets. Plain Python, run while the DSL traces the
host function: the feature flags are Python bools, so nothing here becomes device control flow.
"""
from __future__ import annotations


class LaunchArgs:
    def __init__(self, args, owner: str):
        self.args = list(args)
        self.pos = 0
        self.owner = owner  # for the error message: "FlashFwdSm90(<variant key>)"

    def take(self, n: int = 1):
        """The next argument (n == 1) or the next n as a tuple."""
        if self.pos + n > len(self.args):
            raise TypeError(f"{self.owner} got {len(self.args)} arguments, expected more")
        got = self.args[self.pos:self.pos + n]
        self.pos += n
        return got[0] if n == 1 else tuple(got)

    def maybe(self, present: bool, n: int = 1):
        """`take(n)` when the variant has this argument, else None (or n Nones)."""
        if present:
            return self.take(n)
        return None if n == 1 else (None,) * n

    def stream(self):
        """The last argument, the CUDA stream; anything after it is a caller error."""
        s = self.take()
        if self.pos != len(self.args):
            raise TypeError(f"{self.owner} got {len(self.args)} arguments, {self.pos} expected")
        return s


def mask_inputs(cfg, backward: bool = False) -> list:
    """Names of the optional mask inputs a forward / backward config takes, in launch order
    (`launch_layout` of every kernel; the segment block summaries come rows-first in the
    backward, whose rows are key blocks). A config without an ALiBi field takes none."""
    ins = ["q_seqlen"] * bool(cfg.has_q_seqlen) + ["kv_seqlen"] * bool(cfg.has_kv_seqlen)
    ins += ["alibi_slopes"] * bool(getattr(cfg, "has_alibi", False))
    if cfg.has_segments:
        ins += ["q_segment_ids", "kv_segment_ids"] + (
            ["kv_blocks", "q_blocks"] if backward else ["q_blocks", "kv_blocks"])
    return ins
