"""Let small helper objects live through the DSL's runtime control flow.

Inside a ``@cute.jit`` function, a runtime ``if``/``for`` carries every live variable as IR
values; a plain Python object holding DSL values must say how to flatten and rebuild itself.
Subclasses list their runtime attributes in ``_dynamic``; every other attribute is static
(Python) and copied as is.
"""
from __future__ import annotations

import copy

import cutlass


class Carried:
    _dynamic: tuple[str, ...] = ()

    def __extract_mlir_values__(self):
        values, sizes = [], []
        for name in self._dynamic:
            v = cutlass.extract_mlir_values(getattr(self, name))
            values += v
            sizes.append(len(v))
        self._sizes = sizes
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        pos = 0
        for name, n in zip(self._dynamic, self._sizes):
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name),
                                                            values[pos:pos + n]))
            pos += n
        return new
