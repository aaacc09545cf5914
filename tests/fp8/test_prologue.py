"""`jaxflash.fp8.prologue`: every implementation of precision="fp8"'s quantize (+ Hadamard)
gives the codes and scales of `jaxflash.quantize`'s rules bit for bit (the Triton kernel in
Pallas' interpret mode here; on a GPU in test_prologue_gpu.py), on normal data, outlier
channels, zero / NaN / Inf blocks, a short last block, each input float dtype and both FP8
formats; and the pick falls back to the XLA arrangement where the kernel cannot run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import quantize as Q
from jaxflash.fp8 import prologue as P
from jaxflash.fp8 import prologue_triton as T


def _draw(shape, dtype, seed=0, special=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    B, L, H, D = shape
    x[..., 3] *= 100.0                                   # an outlier channel (the Hadamard's case)
    x[0, : min(L, 7), 0] *= 1e-30                         # subnormal-range values in one block
    if special and L >= 64 and H >= 2:
        x[0, 0:32, 1] = 0.0                              # a zero block (block 32)
        x[0, 40, 1, 0] = np.nan                          # a NaN block
        x[B - 1, L - 1, H - 1, 1] = np.inf               # an Inf block
        x[0, 33, 0, 2] = 3e38                            # Hadamard overflow to Inf (float32 in)
        x[0, 50, 0, :] = 6e4 * np.sign(x[0, 50, 0, :])   # float16: sums past 65504 saturate
    return jnp.asarray(x).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


def _expected(x, dtype, block, signs):
    y = x if signs is None else Q.hadamard_signed(x, signs)
    x8, s = Q.quantize(y, dtype, granularity="block", block_size=block)
    return x8, s                                         # scale [B, heads, nb]: canonical already


def _differ(g, w):
    """Positions where g and w differ bitwise; any NaN equals any NaN (the rules say a block
    dequantizes to NaN, not which of E5M2's NaN encodings or float32 payloads it carries)."""
    gn = np.isnan(np.asarray(g.astype(jnp.float32)))
    wn = np.isnan(np.asarray(w.astype(jnp.float32)))
    return (gn != wn) | (~gn & (_bits(g) != _bits(w)))


def _same(got, want, what="codes"):
    (g8, gs), (w8, ws) = got, want
    assert g8.dtype == w8.dtype and g8.shape == w8.shape and gs.shape == ws.shape
    dc, ds = _differ(g8, w8), _differ(gs, ws)
    nb, ns = np.count_nonzero(dc), np.count_nonzero(ds)
    if nb or ns:  # where and by how much, to tell a rounding rule from a tiling bug
        f32 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32))
        at = [tuple(int(i) for i in ix) for ix in np.argwhere(dc)[:4]]
        sat = [tuple(int(i) for i in ix) for ix in np.argwhere(ds)[:4]]
        g, w, gsf, wsf = f32(g8), f32(w8), f32(gs), f32(ws)
        detail = (f"; codes (got, want) at {[(ix, g[ix], w[ix]) for ix in at]}"
                  f"; scales at {[(ix, gsf[ix], wsf[ix]) for ix in sat]}")
    else:
        detail = ""
    assert nb == 0 and ns == 0, f"{what}: {nb} codes and {ns} scales differ{detail}"


CASES = [  # (shape [B, L, H, D], block)
    ((2, 128, 3, 16), 32),
    ((1, 256, 2, 64), 128),
    ((2, 256, 2, 128), 128),
    ((1, 256, 2, 256), 128),
    ((1, 64, 4, 32), 64),
]


@pytest.mark.parametrize("impl", ["xla", "triton_interpret"])
@pytest.mark.parametrize("shape,block", CASES)
@pytest.mark.parametrize("hadamard", [True, False])
def test_bit_exact_to_quantize_rules(impl, shape, block, hadamard):
    signs = Q.hadamard_signs(7, shape[-1]) if hadamard else None
    for in_dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            if in_dt == jnp.float16 and fp8 == jnp.float8_e5m2:
                continue                                 # one cross of the two enough here
            x = _draw(shape, in_dt, seed=shape[-1] + block)
            want = _expected(x, fp8, block, signs)
            if impl == "xla":
                got = P._xla(x, fp8, block, signs)
            else:  # a light tiling (interpret mode runs the unrolled body as XLA ops)
                got = T.quantize_blocks(x, signs, dtype=jnp.dtype(fp8), block=block,
                                        width=min(32, shape[-1]), interpret=True)
            _same(got, want)


def test_float16_hadamard_saturates_instead_of_overflowing():
    """Finite float16 rows whose transform passes 65504 (|x| near float16's top): the sums
    saturate, so the blocks stay finite (an overflow to inf made every code of the block NaN),
    the same in every implementation; precision="fp8" on such inputs gives no NaN."""
    import jaxflash
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 128, 2, 64)).astype(np.float32)
    x[0, :40, 0] = 4e4 + 400 * x[0, :40, 0]
    x = jnp.asarray(x, jnp.float16)
    signs = Q.hadamard_signs(1, 64)
    y = Q.hadamard_signed(x, signs)
    assert bool(jnp.all(jnp.isfinite(y))) and float(jnp.max(jnp.abs(y))) == 65504.0
    want = _expected(x, jnp.float8_e4m3fn, 128, signs)
    assert bool(jnp.all(jnp.isfinite(want[1])))
    _same(P._xla(x, jnp.float8_e4m3fn, 128, signs), want)
    _same(T.quantize_blocks(x, signs, dtype=jnp.dtype(jnp.float8_e4m3fn), block=128, width=32,
                            interpret=True), want)
    out = jaxflash.flash_attention(x, x, x, precision="fp8", emulate=True)
    assert bool(jnp.all(jnp.isfinite(out)))
    # the linear map stays linear (its transpose is the gradient's), and so does the public
    # quantize.hadamard
    assert not bool(jnp.all(jnp.isfinite(Q.hadamard_signed(x, signs, saturate=False))))
    jax.linear_transpose(lambda z: Q.hadamard(z, 1), jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_triton_library_tiling_per_head_dim(D):
    """The kernel as `prologue`'s configs tile it for each head dim (one block)."""
    signs = Q.hadamard_signs(4, D)
    x = _draw((1, 128, 2, D), jnp.bfloat16, seed=D, special=False)
    x = x.at[0, 5, 1, 0].set(jnp.nan).at[0, :, 0].set(0.0)
    _same(P._triton(x, jnp.float8_e4m3fn, 128, signs, interpret=True),
          _expected(x, jnp.float8_e4m3fn, 128, signs))
    # V's tiling (no Hadamard), and the tensor-core Hadamard's
    _same(P._triton(x, jnp.float8_e4m3fn, 128, None, interpret=True),
          _expected(x, jnp.float8_e4m3fn, 128, None))
    _near(P._triton_gemm(x, jnp.float8_e4m3fn, 128, signs, interpret=True),
          _expected(x, jnp.float8_e4m3fn, 128, signs))


@pytest.mark.parametrize("L", [200, 129])
def test_xla_short_last_block(L):
    x = _draw((2, L, 3, 64), jnp.bfloat16, special=False)
    signs = Q.hadamard_signs(0, 64)
    _same(P._xla(x, jnp.float8_e4m3fn, 128, signs), _expected(x, jnp.float8_e4m3fn, 128, signs))
    assert not T.supports(x.shape, 128)
    assert P.pick(x, 128, "cuda", "triton") == "xla"


def test_special_blocks_are_exercised():
    """The draw really holds the zero / NaN / Inf blocks the rules single out."""
    x = _draw((1, 256, 2, 64), jnp.bfloat16)
    _, s = _expected(x, jnp.float8_e4m3fn, 32, None)
    s = np.asarray(s)
    assert s[0, 1, 0] == 1.0 and np.isnan(s[0, 1, 1]) and np.isinf(s[0, 1, 7])


def test_pick_and_dispatch_of_granularities():
    x = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    assert P.pick(x, 128, "cpu", "triton") == "xla"
    assert P.pick(x, 128, "cuda", "triton") == "triton"
    assert P.pick(x, 128, "gpu", "triton") == "triton"    # jax.default_backend() on a GPU
    assert P.pick(x, 128, "cuda", "reference") == "reference"
    assert P.pick(x, 96, "cuda", "triton") == "xla"
    assert not T.supports((1, 128 * 65536, 2, 64), 128)      # past CUDA's grid y limit
    assert not T.supports((8, 2 ** 20, 8, 64), 128)          # past int32 offsets
    assert T.supports((8, 2 ** 20, 2, 64), 256)              # 2^30 elements, 4096 blocks
    with pytest.raises(ValueError, match="prologue implementation"):
        P.pick(x, 128, "cuda", "fast")
    # per-head / per-tensor scales: quantize's own layouts, canonical
    x = _draw((2, 64, 3, 32), jnp.bfloat16, special=False)
    for g, shape in (("head", (2, 3, 1)), ("tensor", (2, 3, 1))):
        x8, s = P.quantize_operand(x, jnp.float8_e4m3fn, g, 64, Q.hadamard_signs(1, 32))
        assert s.shape == shape and x8.dtype == jnp.float8_e4m3fn


def test_triton_kernel_lowers_for_cuda():
    """The kernel's Triton lowering (no GPU needed to emit it): one custom call, no fallback."""
    from jaxflash import target_platform
    x = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)

    def f(x):  # (pick would take "xla" here: 8 host devices make every jit trace "sharded")
        return P._triton(x, jnp.float8_e4m3fn, 128, Q.hadamard_signs(0, 128))

    def g(x):  # the tensor-core Hadamard, and the backward's dO rule
        return (P._triton_gemm(x, jnp.float8_e4m3fn, 128, Q.hadamard_signs(0, 128)),
                T.quantize_blocks(x, None, dtype=jnp.dtype(jnp.float8_e5m2), block=128,
                                  amax_floor=2.0 ** -64, divide=True))

    with target_platform("cuda"):
        txt = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") == 1, txt[:2000]
    # exportable with jaxflash's safety checks (jax lists no Triton kernel as stable)
    from jaxflash import ffi
    with target_platform("cuda"):
        with pytest.raises(ValueError, match="compatibility guarantees"):
            jax.export.export(jax.jit(f), platforms=["cuda"])(x)
        exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(x)
    back = jax.export.deserialize(exp.serialize())
    assert [o.shape for o in back.out_avals] == [(2, 256, 4, 128), (2, 4, 2)]
    with target_platform("cuda"):
        txt = jax.jit(g).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("__gpu$xla.gpu.triton") == 2, txt[:2000]
        exp = jax.export.export(jax.jit(g), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(x)
    back = jax.export.deserialize(exp.serialize())
    assert [o.shape for o in back.out_avals] == [(2, 256, 4, 128), (2, 4, 2)] * 2


@pytest.mark.parametrize("width,rows", [(None, None), (4, 32), (16, 64)])
def test_triton_tilings_agree(width, rows):
    """The kernel's tilings (columns per tile, rows per pass) only move work around."""
    shape, block = (1, 256, 2, 128), 128
    signs = Q.hadamard_signs(5, 128)
    x = _draw(shape, jnp.bfloat16, seed=11)
    got = T.quantize_blocks(x, signs, dtype=jnp.dtype(jnp.float8_e4m3fn), block=block,
                            width=width, rows=rows, interpret=True)
    _same(got, _expected(x, jnp.float8_e4m3fn, block, signs))


def _near(got, want, what="codes", frac=1e-3):
    """The tensor-core Hadamard's contract (``triton_gemm``): NaN where the rules have NaN; a
    few codes (`frac` at most, signed zeros aside) or a block's scale differ, each value within
    one code step of the rules' (the larger of the two scales' steps)."""
    (g8, gs), (w8, ws) = got, want
    assert g8.dtype == w8.dtype and g8.shape == w8.shape and gs.shape == ws.shape
    f32 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32))
    g, w, sg, sw = f32(g8), f32(w8), f32(gs), f32(ws)
    assert np.array_equal(np.isnan(g), np.isnan(w)), what
    assert np.array_equal(np.isnan(sg), np.isnan(sw)), what
    finite = np.isfinite(sw) & np.isfinite(sg)
    np.testing.assert_allclose(sg[finite], sw[finite], rtol=2 ** -7, err_msg=what)
    B, L, H, D = g.shape
    nb = sw.shape[-1]
    blk = lambda s: np.repeat(np.swapaxes(s, 1, 2), L // nb, axis=1)[..., None]   # [B, L, H, 1]
    with np.errstate(invalid="ignore"):          # NaN / Inf blocks: compared above
        dg, dw = g * blk(sg), w * blk(sw)
    ok = np.isfinite(dw) & np.isfinite(dg)
    fmax = float(Q.FP8_MAX[jnp.dtype(g8.dtype)])
    # one code step at |x|: 2^(exponent - mantissa bits), mantissa 3 (E4M3) or 2 (E5M2)
    mbits = 3 if g8.dtype == jnp.float8_e4m3fn else 2
    mag = np.maximum(np.abs(g), np.abs(w))
    step = np.exp2(np.floor(np.log2(np.maximum(mag, 2.0 ** -6))) - mbits)
    tol = step * np.maximum(blk(sg), blk(sw))
    assert np.all(np.abs(dg - dw)[ok] <= tol[ok] * (1 + 1e-6)), what
    assert np.all(np.abs(g[~np.isnan(g)]) <= fmax), what
    differ = (g != w) & ~(np.isnan(g) & np.isnan(w))
    assert np.count_nonzero(differ) <= frac * g.size, (what, np.count_nonzero(differ))


@pytest.mark.parametrize("shape,block", CASES)
def test_triton_gemm_within_a_step(shape, block):
    """The tensor-core Hadamard (interpret mode: XLA's dot) against the rules' butterflies, on
    the outlier / zero / NaN / Inf draw, bfloat16 and float16, both FP8 formats."""
    signs = Q.hadamard_signs(7, shape[-1])
    for in_dt, fp8 in ((jnp.bfloat16, jnp.float8_e4m3fn), (jnp.float16, jnp.float8_e4m3fn),
                       (jnp.bfloat16, jnp.float8_e5m2)):
        x = _draw(shape, in_dt, seed=shape[-1] + block)
        got = P._triton_gemm(x, fp8, block, signs, interpret=True)
        _near(got, _expected(x, fp8, block, signs), f"{shape} {in_dt.__name__}",
              frac=0.01 if shape[-1] < 64 else 1e-3)


def test_triton_gemm_takes_what_it_can():
    """float32 operands and V (no Hadamard) take the butterfly kernel, bit for bit; gemm on
    them directly is refused."""
    x = _draw((1, 256, 2, 64), jnp.float32, seed=2)
    signs = Q.hadamard_signs(1, 64)
    _same(P._triton_gemm(x, jnp.float8_e4m3fn, 128, signs, interpret=True),
          _expected(x, jnp.float8_e4m3fn, 128, signs))
    xb = x.astype(jnp.bfloat16)
    _same(P._triton_gemm(xb, jnp.float8_e4m3fn, 128, None, interpret=True),
          _expected(xb, jnp.float8_e4m3fn, 128, None))
    for arr, s in ((x, signs), (xb, None)):
        with pytest.raises(ValueError, match="gemm takes"):
            T.quantize_blocks(arr, s, dtype=jnp.dtype(jnp.float8_e4m3fn), block=128, gemm=True,
                              interpret=True)
    assert P.pick(xb, 128, "gpu", "triton_gemm") == "triton_gemm"
    assert P.pick(xb, 96, "gpu", "triton_gemm") == "xla"


def test_triton_tiling_errors():
    x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="powers of two"):
        T.quantize_blocks(x, None, dtype=jnp.dtype(jnp.float8_e4m3fn), block=128, width=24,
                          interpret=True)


def test_precision_fp8_equals_hadamard_outside():
    """precision="fp8" (the Hadamard inside the quantizing prologue, its transpose in the
    backward) computes exactly what the Hadamard applied first by the caller does: same output,
    same gradients, bit for bit."""
    import jaxflash
    ks = jax.random.split(jax.random.PRNGKey(2), 4)
    q, k, v = (jax.random.normal(kk, (1, 256, 2, 64), jnp.bfloat16) for kk in ks[:3])
    w = jax.random.normal(ks[3], (1, 256, 2, 64), jnp.float32)

    def inside(q, k, v):
        o = jaxflash.flash_attention(q, k, v, is_causal=True, precision="fp8", hadamard_seed=3,
                                     implementation="xla")
        return jnp.sum(o.astype(jnp.float32) * w), o

    def outside(q, k, v):
        o = jaxflash.flash_attention(Q.hadamard(q, 3), Q.hadamard(k, 3), v, is_causal=True,
                                     precision="fp8", hadamard=False, implementation="xla")
        return jnp.sum(o.astype(jnp.float32) * w), o

    (la, oa), ga = jax.jit(jax.value_and_grad(inside, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (lb, ob), gb = jax.jit(jax.value_and_grad(outside, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_array_equal(np.asarray(oa, np.float32), np.asarray(ob, np.float32))
    for a, b in zip(ga, gb):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_explain_names_the_prologue():
    """explain says which prologue a precision="fp8" call takes, per operand when they differ."""
    import jaxflash
    from jaxflash import target_platform
    x = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
    odd = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)   # no whole 128-row blocks
    assert "FP8 prologue (Hadamard, amax, codes, scales): xla" in str(
        jaxflash.explain(x, x, x, precision="fp8"))
    xf = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.float32)
    with target_platform("gpu"):
        assert "scales): q triton_gemm, k triton_gemm, v triton (" in str(
            jaxflash.explain(x, x, x, precision="fp8"))
        assert "q xla, k triton_gemm, v triton" in str(
            jaxflash.explain(odd, x, x, precision="fp8"))
        # the copies and dO around the CuTe FP8 kernels (named on CUDA plans only)
        helpers = "keys-major copies (V^T; the backward's Q^T, K^T, dO^T) by Pallas (Triton)"
        assert helpers in str(jaxflash.explain(x, x, x, precision="fp8",
                                               implementation="cute"))
        # float32 operands, or no Hadamard: the butterfly kernel (no tensor-core product)
        assert "scales): triton, one Pallas" in str(jaxflash.explain(xf, xf, xf,
                                                                       precision="fp8"))
        assert "scales): triton, one Pallas" in str(jaxflash.explain(x, x, x, precision="fp8",
                                                                       hadamard=False))
        assert "scales): xla" in str(jaxflash.explain(x, x, x, precision="fp8",
                                                      scale_granularity="head"))
    assert "FP8 prologue" not in str(jaxflash.explain(x, x, x))


def _draw_do(shape, dtype, seed):
    """dO-like data: normal, a tiny block (the rule's amax floor), zero / NaN / Inf blocks."""
    x = np.array(_draw(shape, jnp.float32, seed=seed), np.float32)
    x[0, :, 2] = np.random.default_rng(seed).standard_normal(x[0, :, 2].shape) * 1e-24
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("fp8", [jnp.float8_e5m2, jnp.float8_e4m3fn])
@pytest.mark.parametrize("shape,rows", [((2, 256, 3, 64), 128), ((1, 128, 3, 128), 64)])
def test_quantize_rows_kernel_bit_exact(fp8, shape, rows):
    """The FP8 backward's dO rule (amax floor, scale by division) in the Triton kernel gives the
    XLA rule's codes and scales bit for bit."""
    x = _draw_do(shape, jnp.bfloat16, seed=shape[-1] + rows)
    floor = 2.0 ** -64
    want = P._xla(x, fp8, rows, None, amax_floor=floor, divide=True)
    got = T.quantize_blocks(x, None, dtype=jnp.dtype(fp8), block=rows, width=32,
                            amax_floor=floor, divide=True, interpret=True)
    assert float(jnp.nanmin(want[1])) < 2.0 ** -60    # the floor decides a block's scale here
    _same(got, want)


def _xla_rows(x, dtype, rows, floor):
    return P._xla(x, dtype, rows, None, amax_floor=floor, divide=True)


def test_quantize_rows_picks():
    x = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    ok = (jnp.dtype(jnp.float8_e5m2), 128, 2.0 ** -64)
    assert P.pick(x, 128, "gpu", "triton") == "triton"
    y = _draw_do((1, 256, 3, 64), jnp.bfloat16, seed=2)
    saved, P.ROWS_IMPL = P.ROWS_IMPL, "triton"
    try:   # the kernel's pick off CUDA: XLA
        _same(P.quantize_rows(y, *ok, platform="cpu"), _xla_rows(y, *ok))
    finally:
        P.ROWS_IMPL = saved
    odd = _draw_do((1, 200, 3, 64), jnp.bfloat16, seed=1)    # no whole 128-row blocks: XLA
    a = P.quantize_rows(odd, *ok, platform="gpu")
    b = _xla_rows(odd, *ok)
    _same(a, b)
    assert a[1].shape == (1, 3, 2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_hadamard_transpose(dtype):
    """precision="fp8"'s gradient through the Hadamard: the transpose of `hadamard_signed`. Off
    CUDA it is autodiff's, bit for bit; on CUDA (16-bit) the tensor-core GEMM, a unit of the
    dtype's last place from it at most (where the sum does not cancel) in few elements."""
    signs = Q.hadamard_signs(2, 128)
    g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64, 3, 128)) * 3, dtype)
    _, vjp = jax.vjp(lambda x: Q.hadamard_signed(x, signs), g)
    want = np.asarray(vjp(g)[0].astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(P.hadamard_transpose(g, signs, "cpu")
                                             .astype(jnp.float32)), want)
    got = P.hadamard_transpose(g, signs, "gpu")
    assert got.dtype == g.dtype
    got = np.asarray(got.astype(jnp.float32))
    if dtype == jnp.float32:
        np.testing.assert_array_equal(got, want)              # float32: autodiff's everywhere
        return
    # one unit of the last place, plus float32's summation error where the sum cancels
    tol = np.abs(want) * float(jnp.finfo(dtype).eps) + np.abs(want).max() * 2.0 ** -20
    assert np.all(np.abs(got - want) <= tol)
    assert np.count_nonzero(got != want) <= 1e-3 * got.size


def test_kernels_only_on_the_arch_they_ran_on(monkeypatch):
    """An older GPU (sm_80 / sm_89: less shared memory, never run there) takes the XLA
    arrangement and autodiff's Hadamard transpose; Hopper (and a CPU host lowering for it)
    the kernels."""
    x = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    g = jnp.ones((1, 4, 2, 64), jnp.bfloat16)
    signs = Q.hadamard_signs(0, 64)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert P.pick(x, 128, "gpu") == P.IMPL == "triton_gemm"
    for arch in ("sm_80", "sm_89"):
        monkeypatch.setenv("CUTE_DSL_ARCH", arch)
        assert P.pick(x, 128, "gpu") == "xla"
        assert P.quantize_rows(x, jnp.float8_e5m2, 128, 2.0 ** -64, "gpu")[0].shape == x.shape
        _, vjp = jax.vjp(lambda y: Q.hadamard_signed(y, signs), g)
        np.testing.assert_array_equal(np.asarray(P.hadamard_transpose(g, signs, "gpu"), np.float32),
                                      np.asarray(vjp(g)[0], np.float32))


def test_tiny_blocks_stay_finite_in_every_arrangement():
    """A block whose nonzero amax is below 2^-112 (where FMAX / amax would overflow and its
    zeros turn NaN): the amax floor, the same codes and scales in the rules, the XLA
    arrangement and the Triton kernel (interpret mode), and no NaN."""
    x = np.zeros((1, 128, 2, 32), np.float32)
    x[0, 3, 0, 5] = 1e-37
    x[0, 70, 1, :] = np.linspace(-1e-36, 1e-36, 32)
    x = jnp.asarray(x)
    for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        want = _expected(x, fp8, 64, None)
        assert not np.any(np.isnan(np.asarray(want[0].astype(jnp.float32))))
        _same(P.quantize_operand(x, fp8, "block", 64, platform="cpu"), want, "xla")
        _same(P._triton(x, fp8, 64, None, interpret=True, amax_floor=Q.AMAX_FLOOR), want,
              "triton")
