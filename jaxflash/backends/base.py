"""What a backend is: a name, a `check` that says why it cannot serve a problem, and a forward
and a backward in canonical form. The gradient wiring (`jax.custom_vjp`) lives once, in
`jaxflash.autodiff`, for every backend; so does sharding (`jaxflash.sharding`)."""
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
    def forward(self, q, k, v, arrays: AttentionArrays, statics: AttentionStatics,
                problem: Problem):
        """Return ``(out [B,T,N,Hv] q.dtype, lse [B,N,T] float32)``. Not differentiated."""

    @abc.abstractmethod
    def backward(self, q, k, v, arrays: AttentionArrays, statics: AttentionStatics,
                 problem: Problem, out, lse, dout):
        """Return ``(dq, dk, dv, dbias, dalibi)``; dbias/dalibi are None when the call has no
        bias/alibi_slopes. dbias has ``arrays.bias``'s (possibly size-1 broadcast) shape."""

    def __call__(self, q, k, v, arrays: AttentionArrays, statics: AttentionStatics,
                 problem: Problem):
        """Differentiable attention through this backend's forward and backward."""
        from jaxflash import autodiff
        return autodiff.attention(self, q, k, v, arrays, statics, problem)

    def notes(self, problem: Problem) -> tuple[str, ...]:
        """Sentences `explain` adds when this backend runs `problem` (e.g. which backward)."""
        return ()

    def reason(self, problem: Problem) -> str | None:
        """None if `problem` is served, else why not."""
        try:
            self.check(problem)
        except NotImplementedError as e:
            return str(e) or f"{self.name} cannot serve this call"
        return None
