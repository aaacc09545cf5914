"""`jaxflash.fp8.prologue` on a CUDA GPU: the compiled Triton kernel (and the XLA arrangement)
give `jaxflash.quantize`'s codes and scales bit for bit, as XLA computes the rules on the same
GPU, including zero / NaN / Inf blocks; and precision="fp8" through the pick matches the
reference prologue's output exactly (same codes and scales into the same kernel)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import quantize as Q
from jaxflash.fp8 import prologue as P
from tests.fp8.test_prologue import CASES, _draw, _expected, _near, _same

pytestmark = pytest.mark.gpu


GPU_CASES = ([(shape, block, jnp.bfloat16, jnp.float8_e4m3fn) for shape, block in CASES]
             + [((4, 1024, 16, 128), 128, jnp.bfloat16, jnp.float8_e4m3fn),
                ((2, 512, 8, 256), 128, jnp.bfloat16, jnp.float8_e4m3fn),
                ((2, 256, 2, 128), 128, jnp.float16, jnp.float8_e4m3fn),
                ((2, 256, 2, 128), 128, jnp.float32, jnp.float8_e4m3fn),
                ((2, 256, 2, 64), 128, jnp.bfloat16, jnp.float8_e5m2)])


@pytest.mark.parametrize("shape,block,in_dt,fp8", GPU_CASES)
@pytest.mark.parametrize("hadamard", [True, False])
def test_triton_bit_exact_on_gpu(shape, block, in_dt, fp8, hadamard):
    signs = Q.hadamard_signs(3, shape[-1]) if hadamard else None
    x = _draw(shape, in_dt, seed=shape[-1])
    want = jax.jit(_expected, static_argnums=(1, 2))(x, fp8, block, signs)
    errors = []
    for what, got in (("triton", lambda: P._triton(x, fp8, block, signs)),
                      ("xla", lambda: jax.jit(P._xla, static_argnums=(1, 2))(x, fp8, block,
                                                                              signs))):
        try:
            _same(got(), want, what)
        except AssertionError as e:
            errors.append(str(e))
            print(f"{shape} block {block} hadamard {hadamard}: {e}", flush=True)  # now, not at exit
    assert not errors, " | ".join(errors)


@pytest.mark.parametrize("shape,block,in_dt,fp8", [c for c in GPU_CASES if c[2] != jnp.float32])
def test_triton_gemm_within_a_step_on_gpu(shape, block, in_dt, fp8):
    """The tensor-core Hadamard compiled: within a code step of the rules, few codes apart."""
    signs = Q.hadamard_signs(3, shape[-1])
    x = _draw(shape, in_dt, seed=shape[-1])
    want = jax.jit(_expected, static_argnums=(1, 2))(x, fp8, block, signs)
    got = P._triton_gemm(x, fp8, block, signs)
    differ = int(np.count_nonzero(np.asarray(got[0].astype(jnp.float32))
                                  != np.asarray(want[0].astype(jnp.float32))))
    print(f"{shape} {in_dt.__name__} {jnp.dtype(fp8).name}: {differ} of {got[0].size} codes "
          f"differ", flush=True)
    _near(got, want, f"{shape}", frac=0.01 if shape[-1] < 64 else 1e-3)


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_precision_fp8_same_output_with_each_prologue(impl):
    import jaxflash
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(kk, (2, 1024, 4, 128), jnp.bfloat16) for kk in ks)
    outs = {}
    for name in ("reference", impl):
        saved, P.IMPL = P.IMPL, name
        try:
            f = jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,
                                                                 precision="fp8"))
            outs[name] = np.asarray(f(q, k, v).astype(jnp.float32))
        finally:
            P.IMPL = saved
    np.testing.assert_array_equal(outs[impl], outs["reference"])


def test_precision_fp8_with_triton_gemm_prologue():
    """precision="fp8" with the tensor-core Hadamard: the output within the FP8 path's own
    error of the reference prologue's (both against float32 attention)."""
    import jaxflash
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(kk, (2, 1024, 4, 128), jnp.bfloat16) for kk in ks)
    want = np.asarray(jaxflash.flash_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                               v.astype(jnp.float32), is_causal=True,
                                               implementation="xla"))
    err = {}
    for name in ("reference", "triton_gemm"):
        saved, P.IMPL = P.IMPL, name
        try:
            f = jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,
                                                                 precision="fp8"))
            o = np.asarray(f(q, k, v).astype(jnp.float32))
        finally:
            P.IMPL = saved
        assert np.all(np.isfinite(o))
        err[name] = np.linalg.norm(o - want) / np.linalg.norm(want)
    print(err, flush=True)
    assert err["triton_gemm"] <= 1.05 * err["reference"], err


@pytest.mark.parametrize("fp8", [jnp.float8_e5m2, jnp.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(2, 1024, 8, 128), (1, 512, 4, 64), (1, 256, 3, 256)])
def test_quantize_rows_on_gpu(shape, fp8):
    """The FP8 backward's dO rule (amax floor, scale by division) in the compiled Triton kernel
    gives XLA's codes and scales on the same GPU bit for bit (the check `ROWS_IMPL` waits on)."""
    from jaxflash.fp8 import prologue_triton as T
    from tests.fp8.test_prologue import _draw_do
    x = _draw_do(shape, jnp.bfloat16, seed=shape[-1])
    args = (jnp.dtype(fp8), 128, 2.0 ** -64)
    want = jax.jit(lambda x: P._xla(x, args[0], 128, None, amax_floor=args[2], divide=True))(x)
    warps, width, rows = P.PLAIN_CONFIG[shape[-1]]
    got = T.quantize_blocks(x, None, dtype=args[0], block=128, num_warps=warps, width=width,
                            rows=rows, amax_floor=args[2], divide=True)
    _same(got, want, "dO rule")
