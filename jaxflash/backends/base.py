"""What a backend is: a name, a `check` that says why it cannot serve a problem, and a call."""
from __future__ import annotations

import abc

from jaxflash._types import AttentionArrays, AttentionStatics, Problem


class Backend(abc.ABC):
    """One attention implementation in canonical form (see `jaxflash._types`)."""

    name: str = ""

    @abc.abstractmethod
    def check(self, problem: Problem) -> None:
        """Raise NotImplementedError(reason) if this backend cannot serve `problem`."""

    @abc.abstractmethod
    def __call__(self, q, k, v, arrays: AttentionArrays, statics: AttentionStatics,
                 problem: Problem):
        """Return ``(out, lse)``; differentiable in q, k, v, bias and alibi_slopes."""

    def reason(self, problem: Problem) -> str | None:
        """None if `problem` is served, else why not."""
        try:
            self.check(problem)
        except NotImplementedError as e:
            return str(e) or f"{self.name} cannot serve this call"
        return None
