"""The reduced-precision part of a `jaxflash.flash_attention` call: FP8 inputs with scales,
``precision="fp8"`` (quantize float inputs here) and ``precision="fp4"`` (routed to
`jaxflash.fp4`). Validation works on shapes and dtypes only, so `explain` shares it.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import quantize as Q
from jaxflash._types import Fp8Spec
from jaxflash.fp8 import contract as C
from jaxflash.fp8 import layout

PRECISIONS = (None, "fp8", "fp4")
_OUT_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_FLOATS = _OUT_DTYPES + (jnp.dtype(jnp.float64),)   # float64: x64 only, precision=None only


@dataclasses.dataclass(frozen=True)
class Fp8Request:
    """A validated FP8 call: its static spec, the Hadamard seed (precision="fp8" only) and
    the implementation to ask dispatch for."""

    spec: Fp8Spec
    hadamard_seed: object
    implementation: Optional[str]


def _shape(x):
    return tuple(np.shape(x))


def _dtype(x):
    """The dtype the call computes in: NumPy float64 becomes float32 without x64, as
    `jnp.asarray` (and jax.nn) would make it."""
    d = getattr(x, "dtype", None)
    return jnp.dtype(jax.dtypes.canonicalize_dtype(d if d is not None else jnp.asarray(x).dtype))


def check_precision(precision):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be None, 'fp8' or 'fp4'; got {precision!r}")


def fp8_request(query, key, value, *, precision, q_scale, k_scale, v_scale, out_dtype,
                hadamard, hadamard_seed, scale_block, emulate, implementation,
                scale_granularity="block", dout_dtype=None) -> Optional[Fp8Request]:
    """The FP8 request of a call (None for a float call), or ValueError for a malformed one:
    FP8 tensors without scales, scales with float tensors, scale shapes that fit no layout,
    dtype mixes, options given where they mean nothing."""
    check_precision(precision)
    dts = [_dtype(x) for x in (query, key, value)]
    n8 = sum(Q.is_fp8(d) for d in dts)
    shapes = f"query {_shape(query)} {dts[0]}, key {_shape(key)} {dts[1]}, value {_shape(value)} {dts[2]}"
    scales = (q_scale, k_scale, v_scale)
    given = [n for n, s in zip(("q_scale", "k_scale", "v_scale"), scales) if s is not None]
    if 0 < n8 < 3:
        raise ValueError(f"query, key and value must be all FP8 (float8_e4m3fn / float8_e5m2) "
                         f"or all float16 / bfloat16 / float32; got {shapes}")
    fp8_in = n8 == 3
    if not fp8_in:
        for n, d in zip(("query", "key", "value"), dts):
            if d not in _FLOATS:
                raise ValueError(f"{n} dtype must be float16, bfloat16, float32, float64, "
                                 f"float8_e4m3fn or float8_e5m2; got {shapes}")
        if precision is not None and jnp.dtype(jnp.float64) in dts:
            raise ValueError(f"precision={precision!r} quantizes float16 / bfloat16 / float32 "
                             f"inputs; got {shapes}")
    if given and not fp8_in:
        raise ValueError(f"{', '.join(given)} given with non-FP8 inputs ({shapes}): scales are "
                         f"for FP8 query/key/value; precision='fp8' quantizes float inputs itself")
    if precision == "fp4" and (fp8_in or given):
        raise ValueError(f"precision='fp4' quantizes float16 / bfloat16 / float32 inputs itself "
                         f"and takes no scales; got {shapes}"
                         + (f" with {', '.join(given)}" if given else ""))
    if precision == "fp4" or (precision is None and not fp8_in):
        if out_dtype is not None:
            raise ValueError("out_dtype is for FP8 calls (FP8 inputs or precision='fp8')")
        if emulate and precision is None:
            raise ValueError("emulate=True is for precision='fp8' or 'fp4'")
        if precision is None:   # (precision='fp4' refuses these by name itself)
            fp8_only = [n for n, on in (("hadamard", hadamard is not None),
                                        ("hadamard_seed", hadamard_seed is not None),
                                        ("scale_granularity", scale_granularity != "block"),
                                        ("dout_dtype", dout_dtype is not None),
                                        ("scale_block", scale_block != 128)) if on]
            if fp8_only:
                raise ValueError(f"{', '.join(fp8_only)}: options of FP8 calls (FP8 inputs or "
                                 f"precision='fp8'); this call is float ({shapes})")
        return None
    if fp8_in and len(given) < 3:
        missing = [n for n, s in zip(("q_scale", "k_scale", "v_scale"), scales) if s is None]
        raise ValueError(f"FP8 query/key/value need their dequantization scales; missing "
                         f"{', '.join(missing)} ({shapes})")
    if (not isinstance(scale_block, numbers.Integral) or isinstance(scale_block, bool)
            or scale_block <= 0):
        raise ValueError(f"scale_block must be a positive int; got {scale_block!r}")
    scale_block = int(scale_block)
    if out_dtype is not None and jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32; got {out_dtype!r}")
    do_dt = jnp.dtype(dout_dtype or jnp.float8_e5m2)
    if not Q.is_fp8(do_dt):
        raise ValueError(f"dout_dtype must be float8_e5m2 or float8_e4m3fn; got {dout_dtype!r}")
    if hadamard is not None and not isinstance(hadamard, bool):
        raise ValueError(f"hadamard must be None, True or False; got {hadamard!r}")
    if emulate:
        if implementation not in (None, "xla"):
            raise ValueError(f"emulate=True runs the emulated FP8 path (implementation 'xla'); "
                             f"it contradicts implementation={implementation!r}")
        implementation = "xla"
    lens = (_shape(query)[-3], _shape(key)[-3], _shape(value)[-3])
    if fp8_in:
        if not all(isinstance(n, int) for n in lens):
            raise NotImplementedError(f"FP8 inputs with symbolic sequence lengths (jax.export; "
                                      f"{shapes}): their scales' layout is told from the "
                                      f"lengths; precision='fp8' on float inputs exports")
        # the transform and the quantization of precision="fp8" are the caller's own here
        if hadamard:
            raise ValueError(f"hadamard=True with FP8 inputs ({shapes}): FP8 tensors are used "
                             f"as given; apply jaxflash.quantize.hadamard to query and key "
                             f"before quantizing them (it cancels in QK^T)")
        for n, given, why in (
                ("hadamard_seed", hadamard_seed is not None, "FP8 inputs get no transform here"),
                ("scale_granularity", scale_granularity != "block",
                 "FP8 inputs' scale layout comes from their scales' shapes")):
            if given:
                value = hadamard_seed if n == "hadamard_seed" else scale_granularity
                raise ValueError(f"{n}={value!r} with FP8 inputs ({shapes}): it is for "
                                 f"precision='fp8' on float inputs ({why})")
        grans = []
        for n, x, s in zip(("q_scale", "k_scale", "v_scale"), (query, key, value), scales):
            sd = _dtype(s)
            if (not (jnp.issubdtype(sd, jnp.floating) or jnp.issubdtype(sd, jnp.integer))
                    or Q.is_fp8(sd)):
                raise ValueError(f"{n} must be a float32 (or float16 / bfloat16) array; got "
                                 f"dtype {sd}")
            try:
                grans.append(Q.infer_granularity(_shape(x), _shape(s), scale_block))
            except ValueError as e:
                raise ValueError(f"{n}: {e} ({shapes})") from None
        spec = Fp8Spec(
            q_dtype=str(dts[0]), k_dtype=str(dts[1]), v_dtype=str(dts[2]),
            q_block=layout.canonical_block(grans[0], lens[0], scale_block),
            k_block=layout.canonical_block(grans[1], lens[1], scale_block),
            v_block=layout.canonical_block(grans[2], lens[2], scale_block),
            granularity=tuple(grans),
            out_dtype=str(jnp.dtype(out_dtype or jnp.bfloat16)), source="fp8", hadamard=False,
            do_dtype=str(do_dt))
        return Fp8Request(spec, None, implementation)
    if scale_granularity not in Q.GRANULARITIES:
        raise ValueError(f"scale_granularity must be one of {Q.GRANULARITIES}; got "
                         f"{scale_granularity!r}")
    D = _shape(query)[-1]
    if hadamard is None:  # the default: on wherever the transform exists
        hadamard = D in Q.HADAMARD_DIMS
    if hadamard and D not in Q.HADAMARD_DIMS:
        raise ValueError(f"precision='fp8' applies a Hadamard transform to the head dim, which "
                         f"takes {Q.HADAMARD_DIMS}; got head dim {D} (query {_shape(query)}); "
                         f"pass hadamard=False")
    g = scale_granularity
    spec = Fp8Spec(q_block=layout.canonical_block(g, lens[0], scale_block),
                   k_block=layout.canonical_block(g, lens[1], scale_block),
                   v_block=layout.canonical_block(g, lens[2], scale_block),
                   granularity=(g, g, g),
                   out_dtype=str(jnp.dtype(out_dtype or dts[0])), source="quantized",
                   hadamard=bool(hadamard), do_dtype=str(do_dt))
    seed = C.HADAMARD_DEFAULT_SEED if hadamard_seed is None else hadamard_seed
    return Fp8Request(spec, seed, implementation)


def canonical_scales(req: Fp8Request, q_scale, k_scale, v_scale, batch_shape, N, K):
    """The caller's scales in the canonical layout ``[B, heads, nb]`` float32."""
    g = req.spec.granularity
    return (layout.canonical_scale(q_scale, g[0], batch_shape, N),
            layout.canonical_scale(k_scale, g[1], batch_shape, K),
            layout.canonical_scale(v_scale, g[2], batch_shape, K))


def describe(spec: Fp8Spec, seed, head_dim=None) -> tuple[str, ...]:
    """`explain`'s sentences about an FP8 call."""
    def one(name, dt, g, block):
        where = {"tensor": "per-tensor", "head": "per-(batch, head)",
                 "block": f"per-block ({block} rows x head dim)"}[g]
        return f"{name} {dt.replace('float8_', '')} {where} scales"

    src = ("inputs given in FP8 with their scales" if spec.source == "fp8" else
           "precision='fp8': float inputs quantized here (amax scales, jaxflash.quantize rules)")
    had = (f"random-sign Hadamard on Q and K (seed {seed}; cancels in QK^T)" if spec.hadamard
           else "no Hadamard transform")
    if (not spec.hadamard and spec.source == "quantized" and head_dim is not None
            and head_dim not in Q.HADAMARD_DIMS):
        had += f" (head dim {head_dim}: the transform takes {Q.HADAMARD_DIMS})"
    grads = ("gradients straight-through to the float inputs" if spec.source == "quantized" else
             "gradients: FP8 cotangents for the FP8 operands (chain rule through "
             "dequantization), float32 for the scales")
    ops = ", ".join(one(n, d, g, b) for n, d, g, b in zip(
        ("q", "k", "v"), (spec.q_dtype, spec.k_dtype, spec.v_dtype), spec.granularity,
        (spec.q_block, spec.k_block, spec.v_block)))
    return (f"FP8: {src}; {ops}; {had}; P in E4M3 (x 2^{C.P_SCALE_LOG2}, relative to the "
            f"running row max per {C.FWD_KV_TILE}-key tile); output {spec.out_dtype}",
            f"FP8 backward: E4M3 Q, K, V, P, dS and "
            f"{spec.do_dtype.replace('float8_', '').upper().replace('FN', '')} dO, float32 accumulation, per-block "
            f"scales ({C.BWD_Q_TILE} query rows; dS per {C.BWD_DS_Q_TILE}x{C.BWD_KV_TILE} block, "
            f"{C.BWD_DS_Q_TILE}x{C.BWD_KV_TILE_WIDE} at head dims > {C.BWD_WIDE_HEAD_DIM}); "
            f"{grads}")


EMULATED_NOTE = ("emulated FP8 path (jaxflash.fp8.emulated): the FP8 kernels' numerics contract "
                 "(jaxflash.fp8.contract) in float32 JAX on FP8 codes; runs on any device, no "
                 "speed-up")
