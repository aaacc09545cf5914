"""Test-session setup shared by every test file.

Eight host devices let the sharding tests build real meshes on a CPU-only machine; the default
device stays device 0, so single-device tests are unaffected. This must run before jax is
imported anywhere, hence here.

Markers (registered in pyproject.toml, `--strict-markers`), applied here so no test file has to:

- ``gpu``: needs a CUDA GPU. Set by the test (``pytestmark = pytest.mark.gpu``) or by its file
  name (``*_gpu.py``, ``*_gpu_cases.py``; not on a test marked ``cpu`` there); skipped, with
  the reason shown, where there is none.
- ``compile``: needs the CuTe DSL compiler (compiles or traces kernels). Set on every test of a
  module that imported ``cutlass`` (``cutlass = pytest.importorskip("cutlass")``) or marked
  itself ``compile``.
- ``cpu``: every test that is not ``gpu`` (what CI runs).
- ``slow``: the longest CPU tests (still run by default, first; ``-m "not slow"`` skips them).
"""
import os
import sys
import types

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def _imports_cutlass(module) -> bool:
    if module is None:
        return False
    return any(isinstance(v, types.ModuleType) and v.__name__.split(".")[0] == "cutlass"
               for v in vars(module).values())


def _is_gpu_file(path) -> bool:
    stem = os.path.splitext(os.path.basename(str(path)))[0]
    return stem.endswith("_gpu") or stem.endswith("_gpu_cases")


def pytest_collection_modifyitems(config, items):
    """Apply the markers; skip GPU-only tests where no GPU is present (CI)."""
    have_gpu = jax.default_backend() == "gpu"
    # tests/collect_variants.py records what GPU tests would launch: keep them selected there.
    keep_gpu = have_gpu or os.environ.get("JAXFLASH_COLLECT_VARIANTS")
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    # From jax 0.12 Pallas' Triton lowering reads the GPU's architecture from a device: on a
    # machine without one, lowering our Pallas kernels for CUDA cannot be done (an abstract
    # device is refused for jaxprs with custom calls). These tests run under jax < 0.12 here
    # and on every GPU machine.
    triton_needs_gpu = not have_gpu and jax.__version_info__ >= (0, 12)
    skip_triton = pytest.mark.skip(reason="jax >= 0.12 lowers Pallas-Triton only with a GPU")
    for item in items:
        if triton_needs_gpu and (item.name.startswith("test_triton_lowering")
                                 or item.name == "test_backward_has_no_t_by_s_buffer[cuda]"):
            item.add_marker(skip_triton)
        if (_is_gpu_file(item.path) and item.get_closest_marker("gpu") is None
                and item.get_closest_marker("cpu") is None):
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") is not None:
            if not keep_gpu:
                item.add_marker(skip)
        else:
            item.add_marker(pytest.mark.cpu)
        module = getattr(item, "module", None)
        if item.get_closest_marker("compile") is None and _imports_cutlass(module):
            item.add_marker(pytest.mark.compile)
    # The longest tests first (a stable sort: the rest keep their order): started last, one of
    # them would leave the other xdist worker idle at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_report_header(config):
    dsl = "cutlass" in sys.modules or _dsl_installed()
    return (f"jaxflash tests: jax {jax.__version__} on {jax.default_backend()} "
            f"({jax.device_count()} devices), CuTe DSL {'installed' if dsl else 'absent'}")


def _dsl_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("cutlass") is not None
