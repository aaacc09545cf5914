"""The Blackwell backward (`FlashBwdSm100`) compiles for sm_100a without a GPU, and its PTX holds
what the design says: tcgen05 MMAs (kind::f16) with S^T, dP^T, dV, dK and dQ in tensor memory
(P^T and dS^T read from tensor memory by the dV and dK MMAs), tensor-memory alloc / ld / st /
commit, TMA loads, dQ added by TMA reduce-adds (ordered by acquire / release semaphores in the
deterministic mode), the warpgroups' `setmaxnreg` budgets; ptxas reports no stack and no spills;
the same source gives the same cubin; the bridge lowers and exports it. Head dim 256 is two
passes of the kernel ("dv", then "dkdq" with dQ^T = K^T dS^T): each pass is a variant here.

Nothing here has run on a Blackwell GPU: these are compile-time facts only.
"""
from __future__ import annotations

import glob
import re
import time

import pytest

from jaxflash.kernels.variants.sm100_bwd import REGS, Sm100BwdConfig

cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")

# bf16 / fp16, D 64 / 128 / 256, dense / causal, window, softcap, deterministic, lengths, ALiBi
# and segment ids. Every compile serves any GQA ratio (the head counts are runtime values of the
# bridge's launch). D 256: the "dv" pass (fp16, causal) and the "dkdq" pass (causal, lengths,
# ALiBi, deterministic); the passes' other variants differ only in the shared mask code
# (`python -m devtools.sm100_bwd_compile 256 ...` compiles any; docs/blackwell.md lists 16).
MATRIX = [
    Sm100BwdConfig(head_dim=64),
    Sm100BwdConfig(head_dim=64, is_causal=True, dtype="float16"),
    Sm100BwdConfig(head_dim=128),
    Sm100BwdConfig(head_dim=128, is_causal=True),
    Sm100BwdConfig(head_dim=128, has_window=True),
    Sm100BwdConfig(head_dim=128, has_softcap=True, dtype="float16"),
    Sm100BwdConfig(head_dim=128, is_causal=True, deterministic=True),
    Sm100BwdConfig(head_dim=64, is_causal=True, has_q_seqlen=True, has_kv_seqlen=True,
                   deterministic=True),
    Sm100BwdConfig(head_dim=128, is_causal=True, has_alibi=True, has_segments=True,
                   has_q_seqlen=True, has_kv_seqlen=True),
    Sm100BwdConfig(head_dim=256, is_causal=True, dtype="float16"),
    Sm100BwdConfig(head_dim=256, is_causal=True, has_alibi=True, has_q_seqlen=True,
                   has_kv_seqlen=True, deterministic=True, bwd_pass="dkdq"),
]
COMPILE_LIMIT_S = 60.0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile each variant once for the module: {key: (ptx text, cubin path, seconds)}."""
    from devtools.sm100_bwd_compile import compile_bwd_sm100
    out = {}

    def get(cfg):
        if cfg.key not in out:
            d = tmp_path_factory.mktemp(cfg.key[:60])
            t0 = time.time()
            compile_bwd_sm100(cfg, dump_dir=str(d))
            dt = time.time() - t0
            ptx = open(glob.glob(str(d / "*.ptx"))[0]).read()
            cubins = glob.glob(str(d / "*.cubin"))
            out[cfg.key] = (ptx, cubins[0] if cubins else None, dt)
        return out[cfg.key]
    return get


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_compiles_with_the_blackwell_instructions(cfg, compiled):
    ptx, _, seconds = compiled(cfg)
    assert ".target sm_100a" in ptx
    lines = [l for l in ptx.splitlines() if "tcgen05.mma.cta_group::1.kind::f16" in l]
    # dV += P^T dO and dK += dS^T Q take A from tensor memory (a TMEM address in brackets
    # where the others have a shared-memory descriptor), one MMA per 16 queries each, unrolled;
    # S^T, dP^T and dQ run their k-blocks in a rolled loop: one MMA each in the PTX ("dkdq":
    # one dQ^T MMA per 128-dim half; "dv": S^T and dV only).
    a_tmem = [l for l in lines if re.search(r"kind::f16[.:\w]*\s+\[[^\]]+\],\s*\[", l)]
    m, hd = cfg.tile_m, cfg.head_dim
    assert len(a_tmem) == (cfg.has_dv + cfg.has_dkdq) * (m // 16), (len(a_tmem), lines[:2])
    smem_mmas = {"all": 3, "dv": 1, "dkdq": 2 + hd // 128}[cfg.bwd_pass]
    assert len(lines) == len(a_tmem) + smem_mmas, len(lines)
    assert "cta_group::2" not in ptx
    for instr in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.st",
                  "tcgen05.commit", "tcgen05.wait::ld", "tcgen05.wait::st",
                  "tcgen05.fence::before_thread_sync", "tcgen05.fence::after_thread_sync"):
        assert instr in ptx, instr
    # TMA loads: K, V, Q, dO (4-d tiles) and the lse2 / delta rows (3-d); "dv": no V, no delta
    loads = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::cta\.global", ptx)
    # (a 128-column tile of 16-bit values is two 64-column boxes)
    tiles, rows = (3, 1) if cfg.bwd_pass == "dv" else (4, 2)
    assert loads.count("4") == tiles * (hd // 64) and loads.count("3") == rows, loads
    # dQ: one TMA reduce-add (float32 add in L2) per 32-column chunk of the step's dQ tile;
    # "dkdq": per 32 x 32 box of dQ^T, one issue site per (half, 32 queries)
    reduces = re.findall(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)
    n_red = {"all": hd // 32, "dv": 0, "dkdq": hd // 128 * (m // 32)}[cfg.bwd_pass]
    assert len(reduces) == n_red, len(reduces)
    ordered = ("ld.acquire.gpu" in ptx, "red.release.gpu" in ptx)
    det = cfg.deterministic and cfg.has_dkdq
    assert ordered == (det, det), ordered
    reduce_regs, compute_regs, other_regs = REGS
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{reduce_regs};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{compute_regs};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{other_regs};", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    if cfg.has_softcap:
        assert "tanh.approx" in ptx
    if cfg.has_alibi:  # d(slope) partials: a warp reduction, one store per compute warp
        assert "shfl.sync.bfly" in ptx
    assert seconds < COMPILE_LIMIT_S, f"{cfg.key} took {seconds:.0f} s"


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_no_stack_no_spills(cfg, compiled, tmp_path):
    from tests.common import ptxas_report
    ptx, _, _ = compiled(cfg)
    report = ptxas_report(ptx, tmp_path, arch="sm_100a")
    if report is None:
        pytest.skip("no usable ptxas for sm_100a")
    main = report.split("Function properties for kernel_cutlass_kernel")[1].split("ptxas info")[:2]
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                     main[0]), report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


@pytest.mark.parametrize("cfg", [MATRIX[3], MATRIX[10]], ids=lambda c: c.key)
def test_sass_and_resources(cfg, compiled):
    """SASS (nvdisasm): UTCHMMA, tensor-memory loads / stores, TMA loads and reduce-adds;
    cuobjdump: no stack, no local memory, 128 registers at launch (512 threads)."""
    import subprocess
    from tests.common import cuda_tool, sass_opcodes
    nvdisasm, cuobjdump = cuda_tool("nvdisasm"), cuda_tool("cuobjdump")
    if nvdisasm is None or cuobjdump is None:
        pytest.skip("nvdisasm / cuobjdump not installed (pip nvidia-cuda-nvdisasm "
                    "nvidia-cuda-cuobjdump)")
    ptx, cubin, _ = compiled(cfg)
    ops = sass_opcodes(cubin)
    assert ops["UTCHMMA"] >= len(re.findall(r"tcgen05\.mma\.cta_group::1", ptx))
    for op in ("LDTM", "STTM", "UTMALDG", "UTMAREDG") if cfg.has_dkdq else ("LDTM", "STTM",
                                                                             "UTMALDG"):
        assert sum(v for k, v in ops.items() if k.startswith(op)) > 0, op
    res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"STACK:0\b", res) and re.search(r"LOCAL:0\b", res), res
    assert re.search(r"REG:128\b", res), res


def test_same_source_same_cubin(tmp_path):
    """Two fresh processes, the DSL's in-memory and file caches off, compile one backward
    variant: the cubins are byte-identical (what keying artifacts by source hash relies on)."""
    import hashlib
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digests = []
    for i in range(2):
        d = tmp_path / str(i)
        env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", CUTE_DSL_NO_CACHE="1",
                   CUTE_DSL_DISABLE_FILE_CACHING="1", DUMP=str(d))
        subprocess.run([sys.executable, "-m", "devtools.sm100_bwd_compile", "64", "is_causal"],
                       cwd=root, env=env, check=True, capture_output=True)
        cubin = glob.glob(str(d / "*.cubin"))
        assert cubin, "no cubin dumped"
        digests.append(hashlib.sha256(open(cubin[0], "rb").read()).hexdigest())
    assert digests[0] == digests[1]


def test_lowers_and_exports_through_the_bridge(tmp_path, monkeypatch):
    """With the switch on and sm_100a targeted, the gradient of `implementation="cute"` lowers
    the Blackwell forward and backward through the XLA FFI bridge (GQA, causal, a window as
    runtime values): two custom calls, no T x S tensor, and `jax.export` round-trips it."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import ffi
    from jaxflash.ffi import cache
    from jaxflash.kernels.policy import verified
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setenv(verified.ENV, "1")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    B, T, S, N, K, H = 2, 640, 896, 8, 2, 64
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
    kw = dict(implementation="cute", is_causal=True, local_window_size=(256, 0))
    loss = lambda q, k, v: jaxflash.flash_attention(q, k, v, **kw).astype(jnp.float32).sum()
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, kv, kv, **kw)
        assert plan.detail.fwd.kernel.endswith(":FlashFwdSm100"), plan
        assert plan.detail.bwd.kernel.endswith(":FlashBwdSm100"), plan
        exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(q, kv, kv)
    txt = exp.mlir_module()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 2
    assert f"{T}x{S}" not in txt and f"{S}x{T}" not in txt  # no T x S tensor
    back = jax.export.deserialize(exp.serialize())
    assert back.mlir_module().count(ffi.TARGET) >= 2


def _offsets(layout_str: str, rows_modes, cols_modes, n_rows: int, n_cols: int):
    """{(row, col): offset} of a static shared-memory layout printed as "shape:stride", its
    row / column coordinates spread colexicographically over the given (flattened) modes."""
    import ast
    shape, stride = (ast.literal_eval(x) for x in layout_str.split(":"))

    def flat(t):
        return [x for y in t for x in flat(y)] if isinstance(t, tuple) else [t]

    def pick(modes):
        sh = [x for path in modes for x in flat(_at(shape, path))]
        st = [x for path in modes for x in flat(_at(stride, path))]
        return sh, st

    def _at(t, path):
        for p in path:
            t = t[p]
        return t

    def offset(i, sh, st):
        o = 0
        for n, d in zip(sh, st):
            o, i = o + (i % n) * d, i // n
        return o
    rs, cs = pick(rows_modes), pick(cols_modes)
    return {(r, c): offset(r, *rs) + offset(c, *cs) for r in range(n_rows) for c in range(n_cols)}


def test_hd256_operand_views():
    """At hd 256 each shared tile is read under two views of the bytes its writer (the TMA, or
    the compute warps for dS^T) laid out: dO as dP^T's K-major B and dV's MN-major B ("dv"); Q
    as S^T's K-major B and dK's MN-major B, K as S^T's K-major A and, per 128-dim half at
    128 x 128 elements, dQ^T's MN-major A, dS^T row-major (keys x queries) and as dQ^T's
    MN-major B ("dkdq"). Same swizzle, same offsets, element for element."""
    import cutlass.cute as cute
    import cutlass.tensor_utils
    import cutlass.utils.blackwell_helpers as sm100_helpers

    from jaxflash.ffi.compiler import target_arch
    from jaxflash.kernels.sm100.bwd import FlashBwdSm100
    got = {}

    @cute.jit
    def probe():
        la, lb = sm100_helpers.make_smem_layout_a, sm100_helpers.make_smem_layout_b
        k = FlashBwdSm100(Sm100BwdConfig(head_dim=256, bwd_pass="dv"))
        _, dp_mma, dv_mma, _, _ = k.tiled_mmas()
        lays = dict(dO=lb(dp_mma, (128, 128, 256), k.dtype, 1),
                    dOt=lb(dv_mma, (128, 256, 128), k.dtype, 1))
        k = FlashBwdSm100(Sm100BwdConfig(head_dim=256, bwd_pass="dkdq"))
        s_mma, _, _, dk_mma, dq_mma = k.tiled_mmas()
        lays.update(K=la(s_mma, (128, 64, 256), k.dtype, 1),
                    Kt=la(dq_mma, (128, 64, 128), k.dtype, 1),
                    Q=lb(s_mma, (128, 64, 256), k.dtype, 1),
                    Qt=lb(dk_mma, (128, 256, 64), k.dtype, 1),
                    dS=lb(dq_mma, (128, 64, 128), k.dtype, 1),
                    dSw=sm100_helpers.make_smem_layout_epi(
                        k.dtype, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, (128, 64), 1))
        for n, l in lays.items():
            got[n] = (str(l.inner), str(l.outer))

    # the DSL's target, not the process's (another module of the session may hold sm_90a):
    # the tcgen05 MMAs exist on sm_100a only
    with target_arch("sm_100a"):
        cute.compile(probe)
    assert len({sw for sw, _ in got.values()}) == 1, got  # one swizzle for every view
    # operand layouts: mode 0 = (M or N part, K part), mode 1 = M / N repeats, 2 = K repeats
    op = lambda name, mn, k: _offsets(got[name][1], [(0, 0), (1,)], [(0, 1), (2,)], mn, k)
    do, do_t = op("dO", 128, 256), op("dOt", 256, 128)  # (query, hd) / (hd, query)
    assert all(do[q, d] == do_t[d, q] for q in range(128) for d in range(256))
    q_, q_t = op("Q", 64, 256), op("Qt", 256, 64)
    assert all(q_[q, d] == q_t[d, q] for q in range(64) for d in range(256))
    k_tma, k_t = op("K", 128, 256), op("Kt", 128, 128)  # (key, hd) / (hd in a half, key)
    assert all(k_tma[key, d] == d // 128 * 128 * 128 + k_t[d % 128, key]
               for key in range(128) for d in range(256))
    ds_b = op("dS", 64, 128)  # (query, key)
    ds_w = _offsets(got["dSw"][1], [(0,)], [(1,)], 128, 64)  # (key, query)
    assert all(ds_b[q, key] == ds_w[key, q] for key in range(128) for q in range(64))


@pytest.fixture(scope="module")
def hd256_cache(tmp_path_factory):
    """One disk cache for the hd 256 bridge tests: the forward and both passes compile once."""
    return tmp_path_factory.mktemp("hd256_cache")


def test_head_dim_256_lowers_and_exports_both_passes(hd256_cache, monkeypatch):
    """At head dim 256 the gradient lowers to the forward and the backward's two passes (three
    custom calls, deterministic mode on), with no T x S tensor."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import ffi
    from jaxflash.ffi import cache
    from jaxflash.kernels.policy import verified
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setenv(verified.ENV, "1")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(hd256_cache))
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    B, T, S, N, K, H = 1, 384, 320, 4, 2, 256
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
    kw = dict(implementation="cute", is_causal=True, deterministic=True)
    loss = lambda q, k, v: jaxflash.flash_attention(q, k, v, **kw).astype(jnp.float32).sum()
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, kv, kv, **kw)
        assert plan.detail.bwd.kernel.endswith(":FlashBwdSm100"), plan
        assert plan.detail.bwd.config.bwd_pass == "dv", plan
        exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(q, kv, kv)
    txt = exp.mlir_module()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 3
    assert f"{T}x{S}" not in txt and f"{S}x{T}" not in txt


def test_runtime_only_needs_both_passes(hd256_cache, tmp_path, monkeypatch):
    """Without the DSL (the Blackwell machine) the hd 256 backward is planned only when both
    passes' binaries are in JAXFLASH_KERNEL_DIR; with the "dkdq" one missing, the plan says
    which and prints the command that builds it (the Pallas backward serves meanwhile)."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import aot
    from jaxflash.ffi import cache
    from jaxflash.kernels.policy import verified
    from jaxflash.kernels.variants.sm100_bwd_launch import pass_launches
    from tests.common import runtime_only
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setenv(verified.ENV, "1")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(hd256_cache))
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    q = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16)
    kw = dict(is_causal=True, deterministic=True)  # (the export test's variants: cached)
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, q, q, **kw).detail
    dv, dkdq = pass_launches(plan.bwd)
    out = tmp_path / "kernels"
    aot.build([plan.fwd, dv], str(out), progress=False, log=lambda *_: None)
    with monkeypatch.context() as m:
        runtime_only(m, out)
        with jaxflash.target_platform("cuda"):
            missing = jaxflash.explain(q, q, q, **kw).detail
    assert missing.fwd.key == plan.fwd.key and missing.bwd is None
    assert dkdq.name in missing.bwd_reason
    command = missing.bwd_reason.split("build it with: ")[1]
    assert "python -m jaxflash.aot" in command and "dkdq" in command
    aot.build([dkdq], str(out), progress=False, log=lambda *_: None)
    runtime_only(monkeypatch, out)
    with jaxflash.target_platform("cuda"):
        both = jaxflash.explain(q, q, q, **kw).detail
    assert both.bwd is not None and both.bwd.key == dv.key
