"""A call's CuTe kernel plan: the forward launch, and the backward launch or why there is none.

Made once per distinct `jaxflash._types.Problem` (dispatch keeps it in the call's
`jaxflash.dispatch.Plan`), so the forward, the backward and `explain` all read the same
decision. DSL-free: a runtime-only machine plans from precompiled artifacts.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional

from jaxflash import ffi
from jaxflash.ffi.variant import Launch, current_arch, load_ref
from jaxflash.kernels import KERNELS
from jaxflash.kernels.policy import choose
from jaxflash.kernels.policy.verified import require_verified

# Which registered kernel serves each direction, per architecture, and which function of
# `policy.choose` picks its variant. The sm_100a variants stay gated (`policy.verified`) until
# a Blackwell run (with the switch on, a backward the sm_100a kernel cannot serve runs the
# Pallas kernels on the CuTe forward's (out, lse)). An architecture not listed has no CuTe kernel (Hopper kernels never serve
# another architecture, nor the Blackwell ones Hopper).
FORWARD = {"sm_90a": "sm90_fwd", "sm_100a": "sm100_fwd"}
BACKWARD = {"sm_90a": "sm90_bwd", "sm_100a": "sm100_bwd"}
FORWARD_FP8 = {"sm_90a": "sm90_fwd_fp8", "sm_100a": "sm100_fwd_fp8"}
BACKWARD_FP8 = {"sm_90a": "sm90_bwd_fp8"}
# Where the FP8 backward kernel does not serve a call (or is gated), FP8 gradients come from
# the contract's own backward on the FP8 forward kernel's (out, lse).
FP8_BWD_REASON = ("the emulated FP8 backward (XLA, jaxflash.fp8.emulated) runs on the "
                  "kernel's (out, lse)")
PICKS = {"sm90_fwd": choose.forward_config, "sm100_fwd": choose.sm100_forward_config,
         "sm90_bwd": choose.backward_config, "sm100_bwd": choose.sm100_backward_config,
         "sm90_fwd_fp8": choose.fp8_forward_config,
         "sm100_fwd_fp8": choose.sm100_fp8_forward_config,
         "sm90_bwd_fp8": choose.fp8_backward_config}


@dataclasses.dataclass(frozen=True)
class CutePlan:
    """fwd: the forward's launch. bwd: the backward's, or None with ``bwd_reason`` saying why
    (the Pallas backward then runs on this forward's (out, lse))."""

    fwd: Launch
    bwd: Optional[Launch]
    bwd_reason: str = ""
    fp8: bool = False
    bwd_refused: bool = False   # no backward at all (``bwd_reason`` says why)
    extra: tuple = ()           # further `explain` sentences (how aux gradients are taken)

    @property
    def note(self) -> str:
        if self.fp8:
            cls = self.fwd.kernel.rpartition(":")[2]
            if self.bwd is None:
                return (f"forward: CuTe FP8 kernel {cls} ({self.fwd.config.key}); "
                        f"backward: {self.bwd_reason}")
            bcls = self.bwd.kernel.rpartition(":")[2]
            return (f"forward: CuTe FP8 kernel {cls} ({self.fwd.config.key}); "
                    f"backward: CuTe FP8 kernel {bcls} ({self.bwd.config.key})")
        fwd = f"forward: CuTe kernel {self.fwd.kernel.rpartition(':')[2]} ({self.fwd.config.key})"
        if self.bwd_refused:
            return f"{fwd}; backward: none ({self.bwd_reason})"
        if self.bwd is None:
            return (f"{fwd}; backward: Pallas kernels on the CuTe forward's (out, lse) "
                    f"({self.bwd_reason})")
        cls = self.bwd.kernel.rpartition(":")[2]
        # a backward of several passes (the sm_100a one at head dim 256) names each
        passes = getattr(self.bwd.config, "passes", lambda: (self.bwd.config,))()
        if len(passes) > 1:
            return (f"{fwd}; backward: CuTe kernel {cls} in {len(passes)} passes "
                    f"({', then '.join(c.key for c in passes)})")
        return f"{fwd}; backward: CuTe kernel {cls} ({self.bwd.config.key})"


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _launch(table: dict, what: str, problem, arch: str) -> Launch:
    name = table.get(arch)
    if name is None:
        raise NotImplementedError(
            f"no CuTe {what} kernel for {arch} (kernels exist for {', '.join(sorted(table))}; "
            "the target comes from $CUTE_DSL_ARCH, else the local GPU)")
    entry = KERNELS[name]
    try:
        config = PICKS[name](problem)  # runs the config's can_implement
    except ValueError as e:
        raise NotImplementedError(f"the CuTe {what} kernel cannot serve this call: {e}") from e
    require_verified(config, what)
    launch = load_ref(entry.launch)(config, arch)
    module = launch.kernel.partition(":")[0]
    if not _module_present(module):
        raise NotImplementedError(f"the CuTe {what} kernel is not in this checkout "
                                  f"(module {module} missing)")
    if not ffi.dsl_available():
        # a backward of several passes (`Sm100BwdConfig.passes`) needs every pass's binary
        passes = getattr(config, "passes", lambda: (config,))()
        for one in (load_ref(entry.launch)(c, arch) for c in passes):
            data, tried = ffi.find_artifact(one)
            if data is None:
                raise NotImplementedError(
                    f"the CuTe DSL is not installed here and no precompiled artifact of variant "
                    f"{one.name} was found ({'; '.join(tried)}); build it with: "
                    f"{ffi.aot_command(one)}")
    return launch


def forward_launch(problem, arch: Optional[str] = None) -> Launch:
    """The launch serving `problem`'s forward (NotImplementedError with the reason if none)."""
    return _launch(FORWARD, "forward", problem, arch or current_arch())


def backward_launch(problem, arch: Optional[str] = None) -> Launch:
    """The launch serving `problem`'s backward (NotImplementedError with the reason if none)."""
    return _launch(BACKWARD, "backward", problem, arch or current_arch())


def fp8_forward_launch(problem, arch: Optional[str] = None) -> Launch:
    """The launch serving an FP8 `problem`'s forward (NotImplementedError if none)."""
    return _launch(FORWARD_FP8, "FP8 forward", problem, arch or current_arch())


def fp8_backward_launch(problem, arch: Optional[str] = None) -> Launch:
    """The launch serving an FP8 `problem`'s backward (NotImplementedError if none)."""
    return _launch(BACKWARD_FP8, "FP8 backward", problem, arch or current_arch())


def plan(problem, arch: Optional[str] = None) -> CutePlan:
    """The CuTe plan of `problem`; NotImplementedError if the forward cannot run."""
    arch = arch or current_arch()
    # a causal short window plans as the window alone: the same mask, a faster variant (the
    # launches' window scalars clip the right bound under the causal flag, so either reads them)
    problem = dataclasses.replace(problem, statics=choose.window_only(
        problem.statics, problem.head_dim, problem.kv_len))
    if problem.statics.fp8 is not None:
        fwd = fp8_forward_launch(problem, arch)
        try:
            return CutePlan(fwd, fp8_backward_launch(problem, arch), fp8=True)
        except NotImplementedError as e:
            return CutePlan(fwd, None, f"{FP8_BWD_REASON} ({e})", fp8=True)
    fwd = forward_launch(problem, arch)
    try:
        return CutePlan(fwd, backward_launch(problem, arch))
    except NotImplementedError as e:
        return CutePlan(fwd, None, str(e))
