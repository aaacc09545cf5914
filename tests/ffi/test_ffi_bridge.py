"""The CuTe DSL -> XLA bridge without a GPU: compiling the self-test kernel for sm_90a and sm_100a,
the memory/disk caches (hit, miss, corruption, concurrent compile), runtime-only mode, the
missing-variant error, lowering for CUDA (custom call in the HLO, no recompile for new shapes or
scalars, vmap folding) and the jax.export round trip. GPU execution: tests/ffi/test_ffi_gpu.py."""
from __future__ import annotations

import hashlib
import os
import shlex
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cutlass", reason="needs the CuTe DSL compiler")
pytestmark = pytest.mark.compile

from jaxflash import ffi  # noqa: E402
from jaxflash.ffi import cache, compiler  # noqa: E402
from jaxflash.kernels.variants.selftest import SelfTestConfig, scale_add, selftest_launch  # noqa: E402
from tests.common import runtime_only  # noqa: E402


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Every test gets its own disk cache, no kernel dir, an empty memory cache, zero stats."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    monkeypatch.delenv(cache.ENV_NO_DSL, raising=False)
    cache.clear_memory_cache()
    jax.clear_caches()  # jax reuses lowerings of identical programs; we count compiles
    for k in cache.stats:
        cache.stats[k] = 0
    yield
    cache.clear_memory_cache()


def _count_compiles(monkeypatch, delay=0.0):
    calls = []
    real = compiler.compile_launch

    def counting(launch):
        calls.append(launch.key)
        time.sleep(delay)
        return real(launch)

    monkeypatch.setattr(compiler, "compile_launch", counting)
    return calls


def _f(x, y, alpha):
    return scale_add(x, y, alpha, arch="sm_90a")


def _lower_cuda(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


# -- compile --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_selftest_for_arch(arch):
    launch = selftest_launch(SelfTestConfig("bfloat16"), arch)
    b = ffi.get_binary(launch)
    assert b.source == "compiled"
    assert b.module[:4] == b"\x7fELF"
    assert f"-arch {arch}".encode() in b.module  # the device code really targets `arch`
    assert b"cutlass_call" in b.module  # the prefix the runtime's FFI handler looks up
    assert b.digest == hashlib.sha256(b.module).digest()
    assert os.path.exists(os.path.join(cache.cache_dir(cache.dsl_version()), launch.name + ".o"))


def test_variant_key_ignores_runtime_values_and_tracks_binary_inputs():
    a = selftest_launch(SelfTestConfig("float32"), "sm_90a")
    assert a.key == selftest_launch(SelfTestConfig("float32"), "sm_90a").key
    assert a.key != selftest_launch(SelfTestConfig("float16"), "sm_90a").key
    assert a.key != selftest_launch(SelfTestConfig("float32"), "sm_100a").key
    fixed = ffi.Launch(a.kernel, a.config, (ffi.TensorArg("float32", (None, 8)),) * 2,
                       a.outputs, a.scalars, arch="sm_90a")
    assert fixed.key != a.key
    files = dict(ffi.variant.source_files(a.kernel, "jaxflash.kernels.variants.selftest:X"))
    assert {"jaxflash.kernels.selftest", "jaxflash.kernels.variants.selftest",
            "jaxflash.ffi.compiler"} <= set(files)
    assert ffi.Launch.from_json(a.to_json_str()) == a


def test_source_change_changes_key(tmp_path, monkeypatch):
    pkg = tmp_path / "jfk_tmp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "k.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ffi.variant, "_HASHED_PACKAGES", ("jfk_tmp",))
    h1 = ffi.variant.source_hash("jfk_tmp.k:K", "jfk_tmp.k:C")
    (pkg / "k.py").write_text("X = 2\n")
    os.utime(pkg / "k.py", ns=(time.time_ns() + 10**9,) * 2)
    assert ffi.variant.source_hash("jfk_tmp.k:K", "jfk_tmp.k:C") != h1


# -- caches ---------------------------------------------------------------------------------------
def test_memory_and_disk_cache_hit_miss(monkeypatch):
    calls = _count_compiles(monkeypatch)
    launch = selftest_launch(SelfTestConfig("float32"), "sm_90a")
    first = ffi.get_binary(launch)
    assert (first.source, len(calls)) == ("compiled", 1)
    assert ffi.get_binary(launch) is first and cache.stats["memory"] == 1
    cache.clear_memory_cache()  # a new process: the disk cache serves, no compile
    again = ffi.get_binary(launch)
    assert (again.source, len(calls)) == ("disk_cache", 1)
    assert again.module == first.module


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "stale_dsl", "garbage_meta"])
def test_corrupt_or_stale_entry_is_rebuilt_not_loaded(monkeypatch, caplog, damage):
    launch = selftest_launch(SelfTestConfig("float32"), "sm_90a")
    good = ffi.get_binary(launch).module
    cache.clear_memory_cache()
    d = cache.cache_dir(cache.dsl_version())
    obj, meta = (os.path.join(d, launch.name + e) for e in (".o", ".json"))
    if damage == "truncate":
        with open(obj, "r+b") as f:
            f.truncate(len(good) // 2)
    elif damage == "flip":  # same size, one byte differs: only the checksum can tell
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        open(obj, "wb").write(bytes(data))
    elif damage == "meta":
        os.unlink(obj)
    elif damage == "stale_dsl":
        txt = open(meta).read().replace(cache.dsl_version(), "0.0.1")
        open(meta, "w").write(txt)
    else:
        open(meta, "w").write("{not json")
    calls = _count_compiles(monkeypatch)
    with caplog.at_level("WARNING", logger="jaxflash.ffi"):
        b = ffi.get_binary(launch)
    assert b.source == "compiled" and len(calls) == 1
    assert b.module == good  # the rebuilt binary, never the damaged bytes
    assert any("rebuilding" in r.message for r in caplog.records)
    data, why = cache.read_entry(d, launch, cache.dsl_version())
    assert data == good and why == ""


def test_concurrent_lowering_compiles_once(monkeypatch):
    calls = _count_compiles(monkeypatch, delay=0.5)
    launch = selftest_launch(SelfTestConfig("float16"), "sm_90a")
    results, errors = [], []

    def work():
        try:
            results.append(ffi.get_binary(launch))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert len(calls) == 1
    assert len({r.digest for r in results}) == 1


# -- runtime-only mode ----------------------------------------------------------------------------
def test_runtime_only_with_precompiled_dir(tmp_path, monkeypatch):
    from jaxflash import aot
    kd = tmp_path / "kernels"
    launch = selftest_launch(SelfTestConfig("float32"), "sm_90a")
    aot.build([launch], str(kd), progress=False, log=lambda *_: None)
    runtime_only(monkeypatch, kd)
    assert not ffi.dsl_available()
    x = jnp.ones((5, 7), jnp.float32)
    txt = _lower_cuda(_f, x, x, 2.0).as_text()
    assert ffi.TARGET in txt
    assert cache.stats["kernel_dir"] == 1


def test_missing_variant_error_names_variant_and_exact_command(tmp_path, monkeypatch):
    kd = tmp_path / "kernels"
    kd.mkdir()
    runtime_only(monkeypatch, kd)
    launch = selftest_launch(SelfTestConfig("bfloat16"), "sm_90a")
    x = jnp.ones((3, 4), jnp.bfloat16)
    with pytest.raises(ffi.MissingVariantError) as ei:
        _lower_cuda(_f, x, x, 1.5)
    msg = str(ei.value)
    assert launch.name in msg and "bfloat16" in msg
    cmd = ffi.aot_command(launch)
    assert cmd in msg and f"--out {kd}" in cmd
    # The printed command, run as printed (with the DSL back), builds exactly what was missing.
    monkeypatch.undo()
    monkeypatch.setenv(cache.ENV_KERNEL_DIR, str(kd))
    argv = shlex.split(cmd)
    assert argv[:4] == ["CUTE_DSL_ARCH=sm_90a", "python", "-m", "jaxflash.aot"]
    from jaxflash import aot
    assert aot.main(argv[4:] + ["--no-progress"]) == 0
    runtime_only(monkeypatch, kd)
    cache.clear_memory_cache()
    assert ffi.TARGET in _lower_cuda(_f, x, x, 1.5).as_text()


def test_runtime_targets_register_once_without_a_gpu():
    from jaxflash.ffi import runtime
    path = ffi.register_runtime()  # the installed DSL's library; no driver needed to register
    assert runtime.is_registered() and path.endswith("libcute_dsl_runtime.so")
    assert ffi.register_runtime() == path


def test_runtime_library_missing_is_a_clear_error(monkeypatch):
    from jaxflash.ffi import runtime
    monkeypatch.setattr(runtime, "_registered", None)
    monkeypatch.setenv(runtime.ENV_RUNTIME_LIB, "/nonexistent/libcute_dsl_runtime.so")
    with pytest.raises(ffi.RuntimeLibraryError, match="no such file"):
        runtime.register()
    assert runtime.find_runtime_library() == "/nonexistent/libcute_dsl_runtime.so"
    monkeypatch.delenv(runtime.ENV_RUNTIME_LIB)
    found = runtime.find_runtime_library()  # the installed DSL's copy
    assert found and found.endswith("libcute_dsl_runtime.so") and os.path.exists(found)


# -- lowering ---------------------------------------------------------------------------------------
def test_lowering_for_cuda_without_gpu_has_the_custom_call(monkeypatch):
    calls = _count_compiles(monkeypatch)
    x = jnp.ones((5, 7), jnp.float32)
    low = _lower_cuda(_f, x, x, 2.0)
    txt = low.as_text()
    assert f"stablehlo.custom_call @{ffi.TARGET}" in txt
    assert "module = " in txt and "key = " in txt
    assert len(calls) == 1
    # Other lengths, other scalar values (even traced ones): new HLO, same binary, no compile.
    for shape in [(1, 1), (37, 129), (512, 3)]:
        z = jnp.ones(shape, jnp.float32)
        assert ffi.TARGET in _lower_cuda(_f, z, z, 0.5).as_text()
    assert ffi.TARGET in _lower_cuda(lambda a, b: _f(a, b, jnp.sum(a)), x, x).as_text()
    assert len(calls) == 1
    # Tracing alone never compiles.
    cache.clear_memory_cache()
    jax.make_jaxpr(_f)(x, x, 3.0)
    assert len(calls) == 1


def test_lowering_for_cpu_refuses_clearly():
    x = jnp.ones((2, 3), jnp.float32)
    with pytest.raises(NotImplementedError, match="only be lowered for CUDA"):
        jax.jit(_f).trace(x, x, 1.0).lower(lowering_platforms=("cpu",))


def test_call_validates_arguments():
    x = jnp.ones((2, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"expects float16\[\?,\?\]"):
        ffi.call(selftest_launch(SelfTestConfig("float16"), "sm_90a"), x, x,
                 out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)], scalars=(1.0,))
    with pytest.raises(ValueError, match="values for scalars"):
        ffi.call(selftest_launch(SelfTestConfig("float32"), "sm_90a"), x, x,
                 out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)], scalars=())


def test_vmap_folds_batch_into_dim0():
    x = jnp.ones((3, 5, 7), jnp.float32)
    txt = _lower_cuda(jax.vmap(_f, in_axes=(0, 0, None)), x, x, 2.0).as_text()
    calls = [line for line in txt.splitlines() if f"custom_call @{ffi.TARGET}" in line]
    assert len(calls) == 1 and "tensor<15x7xf32>" in calls[0]
    # Unmapped y (dynamic dim 0) is broadcast; mapped axis 1 is moved first.
    y = jnp.ones((5, 7), jnp.float32)
    xt = jnp.ones((5, 3, 7), jnp.float32)
    txt = _lower_cuda(jax.vmap(_f, in_axes=(1, None, None)), xt, y, 2.0).as_text()
    assert "tensor<15x7xf32>" in txt
    assert jax.eval_shape(jax.vmap(_f, in_axes=(1, None, None)), xt, y, 2.0).shape == (3, 5, 7)
    # Mapped scalars cannot be folded: one launch per entry (a loop), still one binary.
    a = jnp.arange(3.0)
    txt = _lower_cuda(jax.vmap(_f, in_axes=(0, 0, 0)), x, x, a).as_text()
    assert "stablehlo.while" in txt and "tensor<5x7xf32>" in txt


def test_export_round_trip_for_cuda():
    x = jnp.ones((4, 6), jnp.bfloat16)
    exp = jax.export.export(jax.jit(_f), platforms=["cuda"],
                            disabled_checks=ffi.export_safety_checks())(x, x, 1.0)
    blob = exp.serialize()
    back = jax.export.deserialize(blob)
    assert back.platforms == ("cuda",)
    assert back.in_avals[0].shape == (4, 6) and back.out_avals[0].dtype == jnp.bfloat16
    assert ffi.TARGET in back.mlir_module()
    # Shape polymorphism: one export for every M, the kernel reads M at run time.
    m = jax.export.symbolic_shape("m, 6")
    spec = jax.ShapeDtypeStruct(m, jnp.bfloat16)
    poly = jax.export.export(jax.jit(_f), platforms=["cuda"],
                             disabled_checks=ffi.export_safety_checks())(spec, spec, 1.0)
    back = jax.export.deserialize(poly.serialize())
    assert str(back.out_avals[0].shape[0]) == "m"


def test_export_without_disabled_check_is_refused():
    x = jnp.ones((2, 2), jnp.float32)
    with pytest.raises(ValueError, match=ffi.TARGET):
        jax.export.export(jax.jit(_f), platforms=["cuda"])(x, x, 1.0)


def test_two_processes_share_one_compile(tmp_path):
    """The file lock: two processes lowering the same variant into one disk cache compile once."""
    import subprocess
    code = ("import sys; from jaxflash import ffi; "
            "from jaxflash.kernels.variants.selftest import SelfTestConfig, selftest_launch; "
            "print('SOURCE', ffi.get_binary(selftest_launch(SelfTestConfig('float16'), "
            "'sm_100a')).source)")
    env = dict(os.environ, JAXFLASH_CACHE_DIR=str(tmp_path / "shared"))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    sources = sorted(o.split("SOURCE ")[1].strip() for o, _ in outs)
    assert sources == ["compiled", "disk_cache"]
