"""Test-session setup shared by every test file.

Eight host devices let the sharding tests build real meshes on a CPU-only machine; the default
device stays device 0, so single-device tests are unaffected. This must run before jax is
imported anywhere, hence here.
"""
import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip GPU-only tests where no GPU is present (CI), with the reason shown."""
    if jax.default_backend() == "gpu" or os.environ.get("JAXFLASH_COLLECT_VARIANTS"):
        return  # (the latter: tests/collect_variants.py records what GPU tests would launch)
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
