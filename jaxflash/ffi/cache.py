"""Where compiled kernels come from: memory, a precompiled directory, the disk cache, or the DSL.

`get_binary(launch)` looks, in order, at
1. the in-process cache (one entry per variant key);
2. ``$JAXFLASH_KERNEL_DIR``: artifacts made by ``python -m jaxflash.aot`` (read-only to us);
3. the disk cache ``$JAXFLASH_CACHE_DIR`` (default ``~/.cache/jaxflash``), in a subdirectory per
   DSL version (so a DSL upgrade never loads an old binary);
4. the CuTe DSL, if importable: compile, then store in the disk cache.
Without the DSL (runtime-only mode) only 1 and 2 can serve; a miss raises `MissingVariantError`
naming the variant and the exact ``python -m jaxflash.aot`` command that builds it.

Concurrency: one lock per variant key makes two threads lowering the same variant compile it
once (the second waits and takes the first one's result); an advisory file lock does the same
across processes sharing the disk cache. Every entry is written atomically (temp file + rename,
object before its metadata, the pair under an exclusive lock on the directory that readers take
shared, so no reader ever pairs one writer's metadata with another's object) and verified on
load (size and sha256 of the object, variant key, DSL version), so a truncated, corrupt or stale
entry is reported and rebuilt, never loaded.

Faults: a cache directory that cannot be created or written (read-only, full, a file in its
place) costs the disk cache only: the binary is compiled and kept in memory, with one warning
per directory. Without the DSL, a missing or damaged artifact is a `MissingVariantError` (a
NotImplementedError) naming the ``python -m jaxflash.aot`` command that builds it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shlex
import threading
import time
import uuid
from typing import Optional

from jaxflash._types import env_flag
from jaxflash.ffi.variant import Launch

logger = logging.getLogger("jaxflash.ffi")

FORMAT = 1
ENV_KERNEL_DIR = "JAXFLASH_KERNEL_DIR"
ENV_CACHE_DIR = "JAXFLASH_CACHE_DIR"
ENV_NO_DSL = "JAXFLASH_NO_DSL"  # "1": behave as if the CuTe DSL were not installed


class MissingVariantError(NotImplementedError):
    """No binary for a kernel variant and no way to build one here (a NotImplementedError, so a
    RuntimeError too); the message names the ``python -m jaxflash.aot`` command that builds it."""


@dataclasses.dataclass(frozen=True)
class Binary:
    module: bytes   # object bytes, the FFI handler's ``module`` attribute
    digest: bytes   # sha256(module), the handler's ``key`` attribute (its load cache key)
    source: str     # "memory", "kernel_dir", "disk_cache" or "compiled": where it came from


# -- DSL availability --------------------------------------------------------------------------
def dsl_available() -> bool:
    """Whether the CuTe DSL can compile here (``JAXFLASH_NO_DSL=1`` forces runtime-only mode)."""
    if env_flag(ENV_NO_DSL):
        return False
    # Look the package up without importing it: importing `cutlass` fixes the DSL's target
    # architecture for the whole process (from CUTE_DSL_ARCH, else the local GPU, else sm_100a),
    # and `jaxflash.ffi.compiler` must set that first.
    import importlib.util
    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


def dsl_version() -> Optional[str]:
    if not dsl_available():
        return None
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        import cutlass
        return str(getattr(cutlass, "__version__", "unknown"))


def kernel_dir() -> Optional[str]:
    """$JAXFLASH_KERNEL_DIR as a path (surrounding blanks dropped); one warning per process
    when it names no directory (a typo would otherwise read as every variant being absent)."""
    d = os.environ.get(ENV_KERNEL_DIR, "").strip()
    if not d:
        return None
    path = os.path.abspath(os.path.expanduser(d))
    if not os.path.isdir(path) and path not in _warned_dirs:
        _warned_dirs.add(path)
        logger.warning("jaxflash: $%s=%s is not a directory (%s); no precompiled kernel is read "
                       "from it", ENV_KERNEL_DIR, path,
                       "a file" if os.path.exists(path) else "nothing there")
    return path


def cache_root() -> str:
    d = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxflash")
    return os.path.abspath(os.path.expanduser(d))


def cache_dir(version: str) -> str:
    return os.path.join(cache_root(), f"cute-dsl-{version}")


def aot_command(launch: Launch, out: Optional[str] = None) -> str:
    """The exact command that builds `launch` into `out` (default: $JAXFLASH_KERNEL_DIR)."""
    out = out or kernel_dir() or "DIR"
    return (f"CUTE_DSL_ARCH={launch.arch} python -m jaxflash.aot --arch {launch.arch} "
            f"--out {shlex.quote(out)} --variant {shlex.quote(launch.to_json_str())}")


# -- one directory of artifacts ----------------------------------------------------------------
def _paths(directory: str, launch: Launch) -> tuple[str, str]:
    base = os.path.join(directory, launch.name)
    return base + ".o", base + ".json"


def read_entry(directory: str, launch: Launch, version: Optional[str]
               ) -> tuple[Optional[bytes], str]:
    """(module bytes, "") for a valid entry, else (None, why). `version` None accepts any DSL
    version (runtime-only mode: the runtime library checks the object's own version)."""
    obj, meta = _paths(directory, launch)
    if not os.path.isdir(directory):
        return None, "not a directory"
    if not os.path.exists(meta):
        return None, "absent"
    try:
        with _dir_lock(directory, shared=True):
            with open(meta) as f:
                m = json.load(f)
            with open(obj, "rb") as f:
                data = f.read()
    except (OSError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        return None, "unknown metadata format"
    if m.get("key") != launch.key:
        return None, "stale (variant key or kernel sources differ)"
    if version is not None and m.get("dsl_version") != version:
        return None, f"stale (built by CuTe DSL {m.get('dsl_version')}, this is {version})"
    if len(data) != m.get("size"):
        return None, f"corrupt (object has {len(data)} bytes, metadata says {m.get('size')})"
    if hashlib.sha256(data).hexdigest() != m.get("sha256"):
        return None, "corrupt (object checksum mismatch)"
    return data, ""


def _atomic_write(path: str, data: bytes) -> None:
    d = os.path.dirname(path)
    # created 0644 less the umask, as any file the user writes (mkstemp's would be private
    # 0600): a kernel directory built by one user (an image built as root) serves another
    tmp = os.path.join(d, f".tmp-{os.getpid()}-{uuid.uuid4().hex}-{os.path.basename(path)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_entry(directory: str, launch: Launch, module: bytes, version: str) -> str:
    """Store `module` for `launch` in `directory`; returns the object's path. OSError if the
    directory cannot be created or written (nothing partial is left behind)."""
    os.makedirs(directory, exist_ok=True)
    obj, meta = _paths(directory, launch)
    m = {"format": FORMAT, "key": launch.key, "name": launch.name, "size": len(module),
         "sha256": hashlib.sha256(module).hexdigest(), "dsl_version": version,
         "arch": launch.arch, "source_hash": launch.source_hash,
         "launch": launch.to_json(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with _dir_lock(directory, shared=False):  # the pair is replaced as one (see the docstring)
        _atomic_write(obj, module)  # object first: metadata appears only once it is whole
        try:
            _atomic_write(meta, json.dumps(m, indent=1, sort_keys=True).encode())
        except BaseException:
            with contextlib.suppress(OSError):  # no object without its metadata
                os.unlink(obj)
            raise
    _sweep_temporaries(directory)
    return obj


# A writer killed between creating its temporary file and renaming it leaves the file; one
# older than this is nobody's any more and is removed by the next write to the directory.
STALE_TMP_S = 24 * 3600.0


def _sweep_temporaries(directory: str) -> None:
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(".tmp-"):
                path = os.path.join(directory, name)
                with contextlib.suppress(OSError):
                    if now - os.stat(path).st_mtime > STALE_TMP_S:
                        os.unlink(path)


@contextlib.contextmanager
def _dir_lock(directory: str, shared: bool):
    """Advisory lock on the directory itself (no lock file, so it works in read-only ones):
    exclusive while an entry's pair of files is replaced, shared while one is read. Where the
    platform or file system has no flock, entries are still whole (atomic renames); a reader
    may then see a new object with old metadata, which fails its checksum and is rebuilt."""
    try:
        import fcntl
        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        fd = None
    if fd is None:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def _file_lock(directory: str, name: str):
    """Advisory lock between processes compiling the same variant into one cache. Where the
    directory cannot hold a lock file (read-only, ...) there is no lock: processes may then
    compile the same variant twice, which costs time, not correctness."""
    f = None
    try:
        import fcntl
        os.makedirs(directory, exist_ok=True)
        f = open(os.path.join(directory, name + ".lock"), "a")
    except (ImportError, OSError):  # not POSIX, or not writable (warned about if a write
        pass  # fails): threads are still serialized by the in-process lock
    if f is None:
        yield
        return
    with f:
        locked = _acquire(f, directory, name)
        try:
            yield
        finally:
            if locked:
                with contextlib.suppress(OSError):
                    fcntl.flock(f, fcntl.LOCK_UN)


# How long a process waits for another one compiling the same variant before compiling it
# too (a compile takes seconds to a few minutes; a longer wait means that process hangs).
LOCK_WAIT_S = 900.0


def _acquire(f, directory: str, name: str) -> bool:
    """Take the lock on `f`, saying so while another process holds it. A file system without
    locks (ENOLCK, ...) or a holder past `LOCK_WAIT_S` means compiling unlocked: time, not
    correctness (entries are replaced whole)."""
    import fcntl
    start, said = time.monotonic(), False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            logger.warning("jaxflash: the kernel cache %s takes no file locks (%s); compiling "
                           "%s without one (processes may compile it twice)", directory, e, name)
            return False
        waited = time.monotonic() - start
        if not said and waited > 2.0:
            said = True
            logger.warning("jaxflash: waiting for another process compiling %s (lock %s)",
                           name, os.path.join(directory, name + ".lock"))
        if waited > LOCK_WAIT_S:
            logger.warning("jaxflash: gave up waiting %.0f s for the lock on %s; compiling it "
                           "here too", waited, name)
            return False
        time.sleep(0.1)


_warned_dirs: set[str] = set()


def _warn_unwritable(directory: str, error: BaseException) -> None:
    """One warning per directory per process: the disk cache there is not used for writing."""
    if directory in _warned_dirs:
        return
    _warned_dirs.add(directory)
    logger.warning("jaxflash: the kernel cache %s is not writable (%s: %s); compiled kernels are "
                   "kept in memory only. Set $%s to a writable directory to keep them across "
                   "processes.", directory, type(error).__name__, error, ENV_CACHE_DIR)


# -- the lookup ---------------------------------------------------------------------------------
_memory: dict[str, Binary] = {}
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
# Counts per source, for tests and `explain`-style diagnostics.
stats = {"memory": 0, "kernel_dir": 0, "disk_cache": 0, "compiled": 0}


def _lock_for(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def clear_memory_cache() -> None:
    with _locks_guard:
        _memory.clear()


def _binary(module: bytes, source: str) -> Binary:
    return Binary(module, hashlib.sha256(module).digest(), source)


def find_artifact(launch: Launch) -> tuple[Optional[bytes], list[str]]:
    """A valid precompiled/cached object for `launch` without compiling: (bytes, []) or
    (None, reasons per place looked)."""
    reasons = []
    kd = kernel_dir()
    version = dsl_version()
    if kd:
        data, why = read_entry(kd, launch, version)
        if data is not None:
            return data, []
        reasons.append(f"${ENV_KERNEL_DIR}={kd}: {why}")
    else:
        reasons.append(f"${ENV_KERNEL_DIR} is not set")
    if version is not None:
        data, why = read_entry(cache_dir(version), launch, version)
        if data is not None:
            return data, []
        reasons.append(f"disk cache {cache_dir(version)}: {why}")
    return None, reasons


def get_binary(launch: Launch) -> Binary:
    """The compiled binary of `launch` (see the module docstring for the order of lookups)."""
    key = launch.key
    hit = _memory.get(key)
    if hit is not None:
        stats["memory"] += 1
        return hit
    with _lock_for(key):
        hit = _memory.get(key)  # another thread may have built it while we waited
        if hit is not None:
            stats["memory"] += 1
            return hit
        b = _load_or_build(launch)
        stats[b.source] += 1
        _memory[key] = b
        return b


def _load_or_build(launch: Launch) -> Binary:
    version = dsl_version()
    kd = kernel_dir()
    tried = []
    if kd:
        data, why = read_entry(kd, launch, version)
        if data is not None:
            return _binary(data, "kernel_dir")
        tried.append(f"${ENV_KERNEL_DIR}={kd}: {why}")
        if why not in ("absent", "not a directory"):   # (the latter said once, `kernel_dir`)
            logger.warning("jaxflash: not loading %s from %s: %s", launch.name, kd, why)
    else:
        tried.append(f"${ENV_KERNEL_DIR} is not set")
    if version is None:
        raise MissingVariantError(
            f"no compiled kernel for variant {launch.name}\n  {launch.describe()}\n"
            f"and the CuTe DSL is not available here (not installed, or ${ENV_NO_DSL} on: "
            f"runtime-only mode), so it cannot be "
            f"compiled. Looked in: {'; '.join(tried)}.\nBuild it on any machine with the DSL:\n  "
            f"{aot_command(launch)}\nthen point ${ENV_KERNEL_DIR} at that directory.")
    cdir = cache_dir(version)
    with _file_lock(cdir, launch.name):
        data, why = read_entry(cdir, launch, version)
        if data is not None:
            return _binary(data, "disk_cache")
        if why not in ("absent", "not a directory"):
            logger.warning("jaxflash: rebuilding %s in %s: %s", launch.name, cdir, why)
        from jaxflash.ffi import compiler
        t0 = time.perf_counter()
        module = compiler.compile_launch(launch)
        logger.info("jaxflash: compiled %s in %.1f s", launch.name, time.perf_counter() - t0)
        try:
            write_entry(cdir, launch, module, version)
        except OSError as e:  # read-only, full, ...: the binary is good, keep it in memory
            _warn_unwritable(cdir, e)
        return _binary(module, "compiled")
