"""The kernel cache under faults (`jaxflash.ffi.cache`, `jaxflash.ffi.runtime`), without a GPU
and without compiling: the compiler is replaced by a fake that returns deterministic bytes
(it never imports the DSL), and the DSL version is faked where the DSL must seem present.

Each fault gives the right binary (rebuilt) or a clear error naming the fix, never a crash and
never a damaged or stale binary:
- a truncated, corrupted, half-written or stale entry: detected (size, sha256, key, DSL
  version), reported, rebuilt; without the DSL a `MissingVariantError` (NotImplementedError)
  names what was wrong and the ``python -m jaxflash.aot`` command;
- a cache directory that cannot be written: compiled in memory, one warning;
- two processes compiling the same variant: one compiles, the other loads its entry; two
  processes writing one entry: every read sees one whole entry;
- a DSL version change: its own subdirectory, old entries never loaded;
- a missing or wrong runtime library: `RuntimeLibraryError` naming the fix.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

import jaxflash
from jaxflash import ffi
from jaxflash.ffi import cache, runtime
from jaxflash.kernels.variants.selftest import SelfTestConfig, selftest_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(jaxflash.__file__)))
DSL = "9.9.9-fake"


def fake_module(launch) -> bytes:
    """What the fake compiler builds for `launch`: deterministic, distinct per variant."""
    return b"\x7fELF-fake-" + hashlib.sha256(launch.key.encode()).digest() * 64


def _launch(dtype="float32"):
    return selftest_launch(SelfTestConfig(dtype), "sm_90a")


@pytest.fixture
def fake_dsl(tmp_path, monkeypatch):
    """A disk cache of our own, no kernel dir, an empty memory cache, a DSL that 'is there'
    (version `DSL`) and a compiler that counts its calls."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    monkeypatch.delenv(cache.ENV_NO_DSL, raising=False)
    monkeypatch.setattr(cache, "dsl_version", lambda: DSL)
    monkeypatch.setattr(cache, "_warned_dirs", set())
    cache.clear_memory_cache()
    calls = []

    def compile_launch(launch):
        calls.append(launch.name)
        return fake_module(launch)

    real = sys.modules.get("jaxflash.ffi.compiler")
    if real is not None:  # imported by another test: patch it where `_load_or_build` looks
        monkeypatch.setattr(real, "compile_launch", compile_launch)
    else:  # never import the real one (it imports the DSL)
        fake = types.ModuleType("jaxflash.ffi.compiler")
        # Its spec is the real module's: variant keys hash compiler.py's source through it.
        fake.__spec__ = importlib.util.find_spec("jaxflash.ffi.compiler")
        fake.compile_launch = compile_launch
        monkeypatch.setitem(sys.modules, "jaxflash.ffi.compiler", fake)
        monkeypatch.setattr(ffi, "compiler", fake, raising=False)
    yield calls
    cache.clear_memory_cache()


def _no_dsl(monkeypatch, kernel_dir):
    monkeypatch.setattr(cache, "dsl_version", lambda: None)
    monkeypatch.setenv(cache.ENV_KERNEL_DIR, str(kernel_dir))
    cache.clear_memory_cache()


def _files(directory, launch):
    return (os.path.join(directory, launch.name + ".o"),
            os.path.join(directory, launch.name + ".json"))


# ------------------------------------------------------------------ damaged or stale entries
def _damage(obj, meta, how):
    data = open(obj, "rb").read()
    if how == "truncated":
        open(obj, "wb").write(data[:len(data) // 3])
    elif how == "bit_flip":  # same size: only the checksum can tell
        b = bytearray(data)
        b[len(b) // 2] ^= 0x01
        open(obj, "wb").write(bytes(b))
    elif how == "empty_object":
        open(obj, "wb").close()
    elif how == "object_missing":  # metadata written, object gone
        os.unlink(obj)
    elif how == "object_is_a_directory":
        os.unlink(obj)
        os.mkdir(obj)
    elif how == "metadata_truncated":
        txt = open(meta).read()
        open(meta, "w").write(txt[:len(txt) // 2])
    elif how == "metadata_not_a_dict":
        open(meta, "w").write("[1, 2]")
    elif how == "metadata_other_variant":
        m = json.load(open(meta))
        m["key"] = "0" * 64
        json.dump(m, open(meta, "w"))
    elif how == "metadata_other_dsl":
        m = json.load(open(meta))
        m["dsl_version"] = "0.0.1"
        json.dump(m, open(meta, "w"))
    else:
        raise ValueError(how)


DAMAGES = ["truncated", "bit_flip", "empty_object", "object_missing", "object_is_a_directory",
           "metadata_truncated", "metadata_not_a_dict", "metadata_other_variant",
           "metadata_other_dsl"]


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_disk_entry_is_rebuilt_never_loaded(fake_dsl, caplog, how):
    launch = _launch()
    good = ffi.get_binary(launch).module
    assert fake_dsl == [launch.name]
    cache.clear_memory_cache()  # a new process
    d = cache.cache_dir(DSL)
    _damage(*_files(d, launch), how)
    with caplog.at_level(logging.WARNING, logger="jaxflash.ffi"):
        b = ffi.get_binary(launch)
    assert b.source == "compiled" and b.module == good and len(fake_dsl) == 2
    assert [r for r in caplog.records if "rebuilding" in r.getMessage()], caplog.text
    if how == "object_is_a_directory":  # cannot be replaced: served from memory, with a warning
        assert [r for r in caplog.records if "not writable" in r.getMessage()], caplog.text
        assert "unreadable" in cache.read_entry(d, launch, DSL)[1]
    else:
        assert cache.read_entry(d, launch, DSL) == (good, "")  # and the entry is whole again


@pytest.mark.parametrize("how", ["truncated", "bit_flip", "object_missing",
                                 "metadata_truncated", "metadata_other_variant"])
def test_damaged_artifact_without_dsl_names_the_aot_command(fake_dsl, tmp_path, monkeypatch,
                                                            how):
    kd = tmp_path / "kernels"
    launch = _launch("bfloat16")
    cache.write_entry(str(kd), launch, fake_module(launch), DSL)
    _no_dsl(monkeypatch, kd)
    assert ffi.get_binary(launch).source == "kernel_dir"  # whole: served without the DSL
    cache.clear_memory_cache()
    _damage(*_files(str(kd), launch), how)
    data, reasons = ffi.find_artifact(launch)  # what planning sees (and refuses with)
    assert data is None and any(str(kd) in r for r in reasons)
    with pytest.raises(ffi.MissingVariantError) as ei:
        ffi.get_binary(launch)
    assert isinstance(ei.value, NotImplementedError)
    msg = str(ei.value)
    assert launch.name in msg and "python -m jaxflash.aot" in msg
    assert ffi.aot_command(launch) in msg
    why = cache.read_entry(str(kd), launch, None)[1]
    assert why and why in msg  # says what was wrong with the artifact
    assert fake_dsl == []  # nothing compiled


# --------------------------------------------------------------------------- DSL version change
def test_dsl_version_change_uses_its_own_directory(fake_dsl, monkeypatch):
    launch = _launch()
    ffi.get_binary(launch)
    old_dir = cache.cache_dir(DSL)
    cache.clear_memory_cache()
    monkeypatch.setattr(cache, "dsl_version", lambda: "10.0.0-fake")
    new_dir = cache.cache_dir("10.0.0-fake")
    assert new_dir != old_dir
    b = ffi.get_binary(launch)
    assert b.source == "compiled" and len(fake_dsl) == 2  # the old entry was not used
    assert cache.read_entry(new_dir, launch, "10.0.0-fake")[0] == b.module
    # An entry of another version copied into this version's directory is refused as stale.
    data, why = cache.read_entry(old_dir, launch, "10.0.0-fake")
    assert data is None and "stale" in why and DSL in why


# --------------------------------------------------------------------------- unwritable cache
def test_unwritable_cache_compiles_in_memory_with_one_warning(fake_dsl, tmp_path, monkeypatch,
                                                              caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(blocker / "cache"))  # cannot be created
    with caplog.at_level(logging.WARNING, logger="jaxflash.ffi"):
        a = ffi.get_binary(_launch("float32"))
        b = ffi.get_binary(_launch("float16"))
        assert ffi.get_binary(_launch("float32")) is a  # kept in memory
    assert (a.source, b.source) == ("compiled", "compiled")
    assert a.module == fake_module(_launch("float32"))
    warnings = [r.getMessage() for r in caplog.records if "not writable" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert cache.ENV_CACHE_DIR in warnings[0]


def test_artifacts_are_readable_by_other_users(fake_dsl):
    """A cached kernel is written 0644 under the usual umask (not mkstemp's private 0600):
    a kernel directory built by one user (an image built as root) serves another."""
    launch = _launch()
    ffi.get_binary(launch)
    d = cache.cache_dir(DSL)
    files = [os.path.join(d, f) for f in os.listdir(d) if not f.startswith(".")]
    assert files
    umask = os.umask(0o022)
    os.umask(umask)
    for f in files:
        assert os.stat(f).st_mode & 0o777 == 0o644 & ~umask, (f, oct(os.stat(f).st_mode))


def test_read_only_cache_dir_still_serves_its_entries(fake_dsl, tmp_path):
    launch = _launch()
    ffi.get_binary(launch)
    d = cache.cache_dir(DSL)
    cache.clear_memory_cache()
    os.chmod(d, 0o555)
    try:
        b = ffi.get_binary(launch)
        assert b.source == "disk_cache" and b.module == fake_module(launch)
        if not os.access(d, os.W_OK):  # (root may write anyway)
            cache.clear_memory_cache()
            other = _launch("bfloat16")
            assert ffi.get_binary(other).source == "compiled"
            assert not os.path.exists(_files(d, other)[1])
    finally:
        os.chmod(d, 0o755)


# -------------------------------------------------------------------------- two processes
# Child processes load the real `jaxflash.ffi.cache` without jax (stub parent packages), so
# they start in a fraction of a second.
_CHILD = textwrap.dedent("""
    import hashlib, importlib.util, os, sys, time, types
    repo, mode, workdir = sys.argv[1:4]
    for name in ("jaxflash", "jaxflash.ffi"):
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(repo, *name.split("."))]
        sys.modules[name] = m
    from jaxflash.ffi import cache
    from jaxflash.kernels.variants.selftest import SelfTestConfig, selftest_launch
    launch = selftest_launch(SelfTestConfig("float32"), "sm_90a")

    def barrier(n=2):  # both processes start the race together
        open(os.path.join(workdir, f"ready-{os.getpid()}"), "w").close()
        t0 = time.time()
        while sum(f.startswith("ready-") for f in os.listdir(workdir)) < n:
            assert time.time() - t0 < 60, "the other process never came"
            time.sleep(0.005)

    if mode == "compile":
        fake = types.ModuleType("jaxflash.ffi.compiler")
        fake.__spec__ = importlib.util.find_spec("jaxflash.ffi.compiler")  # (keys hash it)
        def compile_launch(launch):
            open(os.path.join(workdir, f"compiled-{os.getpid()}"), "w").close()
            time.sleep(1.0)  # long enough for the other process to arrive
            return b"\\x7fELF-fake-" + hashlib.sha256(launch.key.encode()).digest() * 64
        fake.compile_launch = compile_launch
        sys.modules["jaxflash.ffi.compiler"] = fake
        sys.modules["jaxflash.ffi"].compiler = fake
        cache.dsl_version = lambda: "9.9.9-fake"
        barrier()
        b = cache.get_binary(launch)
        print(b.source, hashlib.sha256(b.module).hexdigest())
    else:  # "write": different bytes per process (a non-deterministic build), many times
        mine = (b"P%d-" % os.getpid()) * (1000 + os.getpid() % 1000)
        d = os.path.join(workdir, "entries")
        barrier()
        bad = []
        for _ in range(int(mode.split(":")[1])):
            cache.write_entry(d, launch, mine, "1.0")
            data, why = cache.read_entry(d, launch, "1.0")
            if data is None or not data.startswith(b"P"):
                bad.append(why)
        print(len(bad), bad[:3])
""")


def _race(tmp_path, mode, n=2):
    work = tmp_path / "race"
    work.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, JAXFLASH_CACHE_DIR=str(tmp_path / "shared-cache"))
    env.pop(cache.ENV_KERNEL_DIR, None)
    procs = [subprocess.Popen([sys.executable, str(script), REPO, mode, str(work)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.split())
    return work, outs


def test_two_processes_compiling_one_variant_compile_it_once(fake_dsl, tmp_path, monkeypatch):
    work, outs = _race(tmp_path, "compile")
    assert sorted(o[0] for o in outs) == ["compiled", "disk_cache"], outs
    assert outs[0][1] == outs[1][1]  # the same binary
    assert len([f for f in os.listdir(work) if f.startswith("compiled-")]) == 1
    launch = _launch()
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "shared-cache"))
    data, why = cache.read_entry(cache.cache_dir(DSL), launch, DSL)
    assert why == "" and hashlib.sha256(data).hexdigest() == outs[0][1]


def test_two_processes_writing_one_entry_never_expose_a_mixed_one(tmp_path):
    work, outs = _race(tmp_path, "write:30")
    assert all(o[0] == "0" for o in outs), outs  # every read found one whole entry
    launch = _launch()
    data, why = cache.read_entry(str(work / "entries"), launch, "1.0")
    assert why == "" and data.startswith(b"P")
    assert not [f for f in os.listdir(work / "entries") if f.startswith(".tmp-")]


# ---------------------------------------------------------------------------- runtime library
@pytest.fixture
def unregistered(monkeypatch):
    monkeypatch.setattr(runtime, "_registered", None)
    monkeypatch.delenv(runtime.ENV_RUNTIME_LIB, raising=False)


def test_runtime_library_path_pointing_nowhere_names_the_fix(unregistered, monkeypatch):
    monkeypatch.setenv(runtime.ENV_RUNTIME_LIB, "/nonexistent/libcute_dsl_runtime.so")
    with pytest.raises(ffi.RuntimeLibraryError) as ei:
        runtime.register()
    msg = str(ei.value)
    assert "/nonexistent/libcute_dsl_runtime.so" in msg and "no such file" in msg
    assert runtime.ENV_RUNTIME_LIB in msg and ("Unset" in msg or "Point" in msg)
    assert not runtime.is_registered()


def test_runtime_library_missing_without_dsl_names_the_fix(unregistered, monkeypatch):
    monkeypatch.setattr(runtime, "_installed_runtime_library", lambda: None)  # no DSL wheel
    with pytest.raises(ffi.RuntimeLibraryError) as ei:
        runtime.register()
    msg = str(ei.value)
    assert "not found" in msg and runtime.ENV_RUNTIME_LIB in msg
    assert "nvidia-cutlass-dsl" in msg
    monkeypatch.setenv(runtime.ENV_RUNTIME_LIB, "/nonexistent/lib.so")
    with pytest.raises(ffi.RuntimeLibraryError, match="Point \\$CUTE_DSL_RUNTIME_LIB at"):
        runtime.register()


def test_runtime_library_that_is_not_one_names_the_fix(unregistered, monkeypatch, tmp_path):
    bogus = tmp_path / "libcute_dsl_runtime.so"
    bogus.write_bytes(b"this is not a shared library")
    monkeypatch.setenv(runtime.ENV_RUNTIME_LIB, str(bogus))
    with pytest.raises(ffi.RuntimeLibraryError) as ei:
        runtime.register()
    msg = str(ei.value)
    assert str(bogus) in msg and "nvidia-cutlass-dsl" in msg and runtime.TARGET in msg
    assert not runtime.is_registered()  # a later, fixed call can still register


def test_cache_without_file_locks_compiles_unlocked_and_says_so(fake_dsl, monkeypatch, caplog):
    """A file system without locks (ENOLCK): the variant compiles, one warning names the
    directory, instead of an OSError out of the lowering."""
    import errno
    import fcntl

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="jaxflash"):
        binary = cache.get_binary(selftest_launch(SelfTestConfig("float32"), "sm_90a"))
    assert binary.module
    assert any("takes no file locks" in r.getMessage() for r in caplog.records)


def test_importing_the_compiler_leaves_the_target_unset():
    """The compiler sets $CUTE_DSL_ARCH for the DSL's import only: left set, it would name
    the target of every later variant in the process, whatever the GPU."""
    pytest.importorskip("cutlass", reason="the compiler imports the CuTe DSL")
    code = ("import os; os.environ.pop('CUTE_DSL_ARCH', None); import jaxflash.ffi.compiler; "
            "print(os.environ.get('CUTE_DSL_ARCH'))")
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None"


@pytest.mark.parametrize("value,off", [("false", True), ("No", True), (" 0 ", True), ("", True),
                                       ("1", False), ("on", False)])
def test_on_off_settings_read_as_written(monkeypatch, value, off):
    """$JAXFLASH_NO_DSL (and every on / off setting) reads false / no / 0 as off; a value that
    is neither raises ValueError naming the variable."""
    from jaxflash._types import env_flag
    monkeypatch.setenv(cache.ENV_NO_DSL, value)
    assert env_flag(cache.ENV_NO_DSL) is (not off)
    monkeypatch.setenv(cache.ENV_NO_DSL, "maybe")
    with pytest.raises(ValueError, match=cache.ENV_NO_DSL):
        env_flag(cache.ENV_NO_DSL)


def test_kernel_dir_that_names_no_directory_is_said_once(fake_dsl, monkeypatch, tmp_path, caplog):
    """$JAXFLASH_KERNEL_DIR with a typo, a file, or a trailing newline: one warning naming it
    (not a silent "absent" per variant); blanks around the path are dropped."""
    bad = tmp_path / "nowhere"
    monkeypatch.setenv(cache.ENV_KERNEL_DIR, f"{bad}\n")
    cache._warned_dirs.discard(str(bad))
    with caplog.at_level(logging.WARNING, logger="jaxflash"):
        assert cache.kernel_dir() == str(bad)
        cache.kernel_dir()
    said = [r.getMessage() for r in caplog.records if "is not a directory" in r.getMessage()]
    assert len(said) == 1 and str(bad) in said[0]
    data, why = cache.read_entry(str(bad), selftest_launch(SelfTestConfig("float32"), "sm_90a"),
                                 DSL)
    assert data is None and why == "not a directory"


def test_write_leaves_no_orphan_and_sweeps_old_temporaries(tmp_path, monkeypatch):
    """A metadata write that fails removes the object it would describe; a temporary file left
    by a killed writer long ago is removed by the next write, a fresh one (a writer at work) is
    kept."""
    launch = selftest_launch(SelfTestConfig("float32"), "sm_90a")
    d = str(tmp_path)
    old = os.path.join(d, ".tmp-1-dead-x.o")
    new = os.path.join(d, ".tmp-2-live-y.o")
    for p in (old, new):
        open(p, "wb").write(b"partial")
    os.utime(old, (0, 0))
    cache.write_entry(d, launch, b"module", DSL)
    assert not os.path.exists(old) and os.path.exists(new)
    real = cache._atomic_write

    def full_disk(path, data):
        if path.endswith(".json"):
            raise OSError(28, "No space left on device")
        real(path, data)

    other = selftest_launch(SelfTestConfig("float16"), "sm_90a")
    monkeypatch.setattr(cache, "_atomic_write", full_disk)
    with pytest.raises(OSError):
        cache.write_entry(d, other, b"module", DSL)
    obj, meta = cache._paths(d, other)
    assert not os.path.exists(obj) and not os.path.exists(meta)
