"""The sm_100a forward's partly emulated exp2: its constants and a bit-exact model (DSL-free).

On Blackwell the tensor cores outrun the 16 MUFU.EX2 per clock and SM, so some score pairs of
each row are exponentiated on the FMA pipes instead (FlashAttention-4's trick). For x <= 127:

1. ``xc = max(x, -127)``                            (FMNMX; -inf lands on -127)
2. ``t = xc + 1.5 * 2**23``, rounded toward -inf    (FADD2.RM: t's low mantissa bits = floor(xc))
3. ``j = t - 1.5 * 2**23``                          (exact: floor(xc) as a float)
4. ``f = xc - j``                                   (in [0, 1]; exact except when |xc| < 1)
5. ``p = ((C3 f + C2) f + C1) f + 1``               (three FFMA2; 2**f on [0, 1], p(0) = 1)
6. ``bits(result) = bits(p) + (bits(t) << 23)``     (SHL + IADD: floor(xc) added to p's exponent)

Every step but 5 is exact, so the error is the polynomial's alone: its relative error is the same
for every x whose result is normal. At ``xc = -127`` step 6 gives bits 0: -inf (a masked score)
becomes exactly +0. Results below 2**-126 (x in (-127, -126)) come out as subnormals that are
not 2**x; they are below anything a probability row can hold next to its max of 1.

`model_exp2` is this sequence in NumPy, bit for bit (float32 steps, fused multiply-adds rounded
once, subnormals kept: the kernel's packed ops carry no .ftz, which its compile test checks);
the kernel (`jaxflash.kernels.sm100.exp2`) imports the constants from here. Not modelled: a NaN
input (the kernel's max.f32 returns the clamp, hence 0; the model propagates NaN).
"""
from __future__ import annotations

# Minimax (relative error) fit of 2**f on [0, 1] with p(0) = 1 exactly, rounded to float32;
# fitted here by iteratively reweighted least squares. Max relative error 8.6e-5 (2**-13.5),
# well under bfloat16's half ulp (2**-9) that P is rounded to next.
C1 = 0.6951166391372681
C2 = 0.22764569520950317
C3 = 0.07706641405820847
ROUND_MAGIC = 12582912.0     # 1.5 * 2**23: x + this has ulp 1 for |x| < 2**22
CLAMP_LOW = -127.0


def _np():
    import numpy as np
    return np


def fma_f32(a, b, c):
    """float32 a * b + c rounded once to nearest-even (what FFMA / FFMA2 compute), vectorized.

    a * b is exact in float64 (24 + 24 bits); the float64 sum can round, so its error is
    recovered (TwoSum) and used to break the ties a second rounding to float32 would get
    wrong."""
    np = _np()
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    # neighbour of r on the side of s, and whether s sits exactly half-way between them
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
    mid = (r64 + other.astype(np.float64)) * 0.5
    tie = (s == mid) & (err != 0) & (s != r64)
    # at a float64 tie the true value lies on err's side: pick that neighbour
    toward_other = np.sign(err) == np.sign(other.astype(np.float64) - r64)
    return np.where(tie & toward_other, other, r).astype(np.float32)


def model_exp2(x):
    """Bit-exact NumPy model of the kernel's polynomial exp2 (float32 in, float32 out)."""
    np = _np()
    x = np.asarray(x, np.float32)
    xc = np.maximum(x, np.float32(CLAMP_LOW))                                 # 1
    t = np.floor(xc.astype(np.float64) + ROUND_MAGIC).astype(np.float32)      # 2 (.rm)
    j = (t.astype(np.float64) - ROUND_MAGIC).astype(np.float32)               # 3
    f = (xc.astype(np.float64) - j.astype(np.float64)).astype(np.float32)    # 4 (rn)
    p = fma_f32(np.float32(C3), f, np.float32(C2))                            # 5
    p = fma_f32(p, f, np.float32(C1))
    p = fma_f32(p, f, np.float32(1.0))
    bits = (p.view(np.uint32).astype(np.uint64)
            + (t.view(np.uint32).astype(np.uint64) << np.uint64(23))) & np.uint64(0xFFFFFFFF)
    return bits.astype(np.uint32).view(np.float32)                           # 6


def ulp_error(y, x):
    """|y - 2**x| in float32 ulps of 2**x (x float32, exact value taken in float64)."""
    np = _np()
    exact = np.exp2(np.asarray(x, np.float64))
    e = np.floor(np.log2(exact))
    ulp = np.exp2(np.maximum(e, -126.0) - 23.0)
    return np.abs(np.asarray(y, np.float64) - exact) / ulp


# -- conditional rescaling ----------------------------------------------------------------------
def model_online_softmax(blocks, v_blocks, scale_log2, threshold, p_dtype="bfloat16"):
    """NumPy model of the sm_100a forward's online softmax for a set of rows, float32 like the
    kernel: per key block the row's reference max moves only when the block max exceeds it by
    more than ``threshold`` (log2 units; 0: any growth); then the output is rescaled by
    exp2((old - new) * scale_log2), P = exp2(s * scale_log2 - ref * scale_log2) is rounded to
    ``p_dtype`` and O += P V in float32. Returns (O normalized, float32; row sums).

    With a threshold P can reach 2**threshold; P's relative rounding is the same at any
    magnitude, so the normalized output differs from threshold 0 only by rounding."""
    np = _np()
    import ml_dtypes
    pdt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[p_dtype]
    f32 = np.float32
    rows = blocks[0].shape[0]
    ref = np.full(rows, -np.inf, f32)
    rsum = np.zeros(rows, f32)
    o = np.zeros((rows, v_blocks[0].shape[1]), f32)
    sl2 = f32(scale_log2)
    for s, v in zip(blocks, v_blocks):
        s = s.astype(f32)
        m = np.maximum(ref, s.max(axis=1))
        with np.errstate(invalid="ignore"):
            grow = (m - ref) * sl2 > f32(threshold)
        m_safe = np.where(m == -np.inf, f32(0), m)
        scale = np.where(grow, np.exp2((ref - m_safe) * sl2), f32(1)).astype(f32)
        ref = np.where(grow, m, ref)
        ref_safe = np.where(ref == -np.inf, f32(0), ref)
        p = np.exp2(s * sl2 - (ref_safe * sl2)[:, None]).astype(f32)
        rsum = rsum * scale + p.sum(axis=1, dtype=f32)
        o = o * scale[:, None] + p.astype(pdt).astype(f32) @ v.astype(f32)
    return o / rsum[:, None], rsum
