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
