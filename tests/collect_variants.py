"""Compile, on a machine without a GPU, the CuTe kernel variants that GPU tests will need.

    CUTE_DSL_ARCH=sm_90a python -m tests.collect_variants --out .device/kernels -m gpu tests

(the float64 check cases of tests/kernels/test_kernels_gpu_cases.py are also built, faster, by
``python -m devtools.devrun build`` and ``python -m devtools.bwd_devrun build``).

The GPU machine has no CuTe DSL, so every variant a test reaches must be built here first. Which
ones a test reaches depends on the dispatch (`config_for`, schedules, backward choice), so rather
than list them by hand this runs the selected tests once under pytest with the dispatch told it
targets CUDA (``JAXFLASH_PLATFORM=cuda``) and `jaxflash.ffi.call` replaced by a recorder that
notes each launch and returns zeros (so a forward's zeros flow on into its backward, which is
then recorded too); the tests' closeness checks are silenced, other assertions may fail: only
the recorded launches matter.
They are then built with `jaxflash.aot.build` into ``--out`` (point JAXFLASH_KERNEL_DIR there).
"""
from __future__ import annotations

import argparse
import os
import sys

ENV = "JAXFLASH_COLLECT_VARIANTS"  # tests/conftest.py keeps GPU tests selected when set


class _Recorder:
    def __init__(self):
        self.launches = {}

    def pytest_sessionstart(self, session):
        import jax.numpy as jnp

        from jaxflash import ffi
        from jaxflash.ffi import primitive

        def record(launch, *inputs, out_shapes, scalars=(), int_scalars=()):
            self.launches.setdefault(launch.name, launch)
            return tuple(jnp.zeros(tuple(int(d) for d in s.shape), s.dtype) for s in out_shapes)

        ffi.call = primitive.call = record

    def pytest_collection_finish(self, session):
        # Numbers are zeros here: silence the tests' closeness checks so each test goes on to
        # its backward (and records it) instead of stopping at the forward's comparison.
        for item in session.items:
            mod = getattr(item, "module", None)
            if mod is not None and hasattr(mod, "assert_close"):
                mod.assert_close = lambda *a, **k: 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lower", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="also call FUNCTION of MODULE, which lowers (traces, never runs) the "
                        "programs of tests too large to run here, recording their launches")
    a, pytest_args = p.parse_known_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ[ENV] = "1"
    os.environ["JAXFLASH_PLATFORM"] = "cuda"
    # Build the not-yet-GPU-checked variants too: the GPU run admits them (it is what checks them).
    os.environ["JAXFLASH_CUTE_UNVERIFIED"] = "1"
    import pytest

    from jaxflash import aot
    rec = _Recorder()
    if pytest_args:
        pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[rec])
    if a.lower:
        import importlib
        rec.pytest_sessionstart(None)
        for ref in a.lower:
            mod, _, fn = ref.partition(":")
            getattr(importlib.import_module(mod), fn)()
    launches = list(rec.launches.values())
    print(f"{len(launches)} variants reached:")
    for launch in launches:
        print(f"  {launch.name}")
    if not launches:
        return 1
    counts = aot.build(launches, a.out, progress=False)
    print(f"{counts['built']} built, {counts['kept']} up to date in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
