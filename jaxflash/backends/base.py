"""What a backend is: a name, a `plan` that says how it serves a problem (or raises
NotImplementedError with why it cannot), and a forward and a backward in canonical form that
receive the call's `jaxflash.dispatch.Plan`. The gradient wiring (`jax.custom_vjp`) lives once,
in `jaxflash.autodiff`, for every backend; so does sharding (`jaxflash.sharding`)."""
from __future__ import annotations

import abc

from jaxflash._types import AttentionArrays, AttentionStatics, Problem


class Backend(abc.ABC):
    """One attention implementation in canonical form (see `jaxflash._types`)."""

    name: str = ""
    # Whether forward / backward honour ``arrays.mod_offsets`` (a shard's global batch / head
    # offsets, which mods see); calls with mods are partitioned only over backends that do.
    shards_mods: bool = False
    # Whether the passes are plain JAX: `jaxflash.autodiff` then differentiates `forward`
    # itself (any order, forward mode too; ring attention still calls `backward`). A kernel's
    # passes are not, and a second derivative through them raises with the reason.
    differentiable_backward: bool = False
    # Whether the backend is the reference, which serves every valid call: what only it serves
    # (`jaxflash.dispatch.reference_only`) is refused for the others before they plan.
    reference: bool = False

    @abc.abstractmethod
    def plan(self, problem: Problem):
        """This backend's own frozen, hashable plan for `problem` (None when it needs none),
        kept in the call's `Plan.detail`; raise NotImplementedError(reason) if it cannot
        serve `problem`."""

    @abc.abstractmethod
    def forward(self, q, k, v, arrays: AttentionArrays, statics: AttentionStatics, plan):
        """Return ``(out [B,T,N,Hv] q.dtype, lse [B,N,T] float32)`` (float64 LSE for float64
        q). Not differentiated. Shapes come from the arrays (under sharding they are a shard's)."""

    @abc.abstractmethod
    def backward(self, q, k, v, arrays: AttentionArrays, statics: AttentionStatics, plan,
                 out, lse, dout):
        """Return ``(dq, dk, dv, dbias, dalibi)``; dbias/dalibi are None when the call has no
        bias/alibi_slopes. dbias has ``arrays.bias``'s (possibly size-1 broadcast) shape.
        With mods (``statics.mods``) a sixth element: the cotangents of ``arrays.mod_aux``
        (a tuple: an array for each floating leaf when the call has a score_mod, else None)."""

    def __call__(self, q, k, v, arrays: AttentionArrays, statics: AttentionStatics, plan):
        """Differentiable attention through this backend's forward and backward."""
        from jaxflash import autodiff
        return autodiff.attention(self, q, k, v, arrays, statics, plan)

    def notes(self, detail) -> tuple[str, ...]:
        """Sentences `explain` adds when this backend runs with plan `detail`."""
        return ()
