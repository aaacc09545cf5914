"""What a results file must say about where it was measured: device, date, versions, commit."""
from __future__ import annotations

import datetime
import importlib.metadata as md
import os
import platform
import subprocess

import jax


def _run(cmd, cwd=None):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:
        return None


def _dist_version(*names):
    for n in names:
        try:
            return f"{n} {md.version(n)}"
        except md.PackageNotFoundError:
            continue
    return None


def cudnn_version():
    """cuDNN as the CUDA plugin loaded it (e.g. '9.19.0'), else the wheel's version, else None."""
    try:
        from jax._src.lib import cuda_versions
        if cuda_versions is not None:
            v = int(cuda_versions.cudnn_get_version())
            return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    except Exception:
        pass
    return _dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")


def collect():
    import jaxlib
    import jaxflash
    dev = jax.devices()[0]
    here = os.path.dirname(os.path.abspath(__file__))
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "platform": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.max.sm", "--format=csv,noheader"]),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "cuda_plugin": _dist_version("jax-cuda13-plugin", "jax-cuda12-plugin"),
        "cudnn": cudnn_version(),
        "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"),
        "tokamax": _dist_version("tokamax"),
        "python": platform.python_version(),
        "jaxflash": jaxflash.__version__,
        # The device machine's copy of the tree has no current .git (a stale one there named
        # a days-old commit on 2026-12-01): BENCH_COMMIT, else the commit `prepare.sh` recorded
        # beside the artifacts it built, else git.
        "commit": (os.environ.get("BENCH_COMMIT") or _prepared_commit(here)
                   or _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here)),
    }


def _prepared_commit(here):
    """The commit (+ "-dirty") `benchmarks/device/prepare.sh` wrote to .device/COMMIT."""
    path = os.path.join(here, "..", ".device", "COMMIT")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def matmul_ceiling(n=8192, reps=10):
    """bf16 n^3 matmul TFLOP/s on random data: the card's practical ceiling in this run."""
    import jax.numpy as jnp
    from benchmarks.timing import time_throughput
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    t = time_throughput(jax.jit(jnp.matmul), (a, b), reps=reps)
    return 2.0 * n ** 3 / t.median_s / 1e12
