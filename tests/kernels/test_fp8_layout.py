"""The FP8 forward's register / shared-memory conventions, checked without a GPU:

- the DSL's sm_90 FP8 wgmma layouts are the ones `layouts.acc_as_fp8_operand_a` and
  `sm90.v_transpose` are written against (A: 4 consecutive k per register, rows r / r + 8,
  k / k + 16; C: column pairs, rows r / r + 8, 8-column groups);
- with those layouts, P packed in place and V^T written in the transposer's key order give
  A[m, k] = P[m, key(k)] for a permutation `key` (so P V^T is unchanged);
- the transposer's PRMT selectors transpose a 4 x 4 byte block.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
pytestmark = pytest.mark.compile


def test_dsl_fp8_wgmma_layouts_are_the_assumed_ones():
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as h
    from cutlass import Float32
    from cutlass.cute.nvgpu import warpgroup
    seen = {}

    @cute.jit
    def layouts_of():
        k_ = cute.nvgpu.OperandMajorMode.K
        f8 = cutlass.Float8E4M3FN
        pv = h.make_trivial_tiled_mma(f8, f8, k_, k_, Float32, atom_layout_mnk=(2, 1, 1),
                                      tiler_mn=(64, 128), a_source=warpgroup.OperandSource.RMEM)
        qk = h.make_trivial_tiled_mma(f8, f8, k_, k_, Float32, atom_layout_mnk=(2, 1, 1),
                                      tiler_mn=(64, 128))
        seen["A"] = str(pv.tv_layout_A)
        seen["C"] = str(qk.tv_layout_C)
        thr = pv.get_slice(0)
        seen["fragA"] = str(thr.make_fragment_A(thr.partition_shape_A((128, 128))).layout)

    layouts_of()
    # (thread, value) -> m + 64 k (A, 64 x 32) and m + 64 n (C, 64 x 128)
    assert seen["A"] == "((4,8,4),(4,2,2)):((256,1,16),(64,8,1024))"
    assert seen["C"] == "((4,8,4),(2,2,16)):((128,1,16),(64,8,512))"
    assert seen["fragA"] == "((4,2,2),1,4):((1,4,8),0,16)"


def test_packed_p_against_permuted_vt_is_p_times_v():
    from jaxflash.kernels.sm90.v_transpose import KEY_OFFSETS
    n = 128
    p = np.random.default_rng(0).random((64, n))
    a = np.full((64, n), np.nan)
    for t in range(128):  # one warpgroup
        q, row0 = t % 4, (t // 4) % 8 + 16 * (t // 32)
        for kb in range(n // 32):
            for i in range(4):
                for j in range(2):
                    for h in range(2):
                        g = i // 2 + 2 * h + 4 * kb           # acc_as_fp8_operand_a
                        col = 2 * q + i % 2 + 8 * g            # the accumulator's column
                        k = 32 * kb + 4 * q + i + 16 * h       # the A operand's k
                        a[row0 + 8 * j, k] = p[row0 + 8 * j, col]

    def key(k):  # V^T column 16c + 4q + i holds key 16c + 2q + KEY_OFFSETS[i]
        c, r = divmod(k, 16)
        return 16 * c + 2 * (r // 4) + KEY_OFFSETS[r % 4]

    keys = [key(k) for k in range(n)]
    assert sorted(keys) == list(range(n))
    assert np.array_equal(a, p[:, keys])


def test_prmt_selectors_transpose_a_4x4_byte_block():
    from jaxflash.kernels.sm90 import v_transpose as vt

    def prmt(x, y, sel):
        by = [(x >> (8 * i)) & 255 for i in range(4)] + [(y >> (8 * i)) & 255 for i in range(4)]
        return sum(by[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))

    w = [int.from_bytes(bytes([16 * r + d for d in range(4)]), "little") for r in range(4)]
    t0, t1 = prmt(w[0], w[1], vt._LO_BYTES), prmt(w[0], w[1], vt._HI_BYTES)
    t2, t3 = prmt(w[2], w[3], vt._LO_BYTES), prmt(w[2], w[3], vt._HI_BYTES)
    out = [prmt(t0, t2, vt._LO_HALVES), prmt(t0, t2, vt._HI_HALVES),
           prmt(t1, t3, vt._LO_HALVES), prmt(t1, t3, vt._HI_HALVES)]
    for d in range(4):
        assert out[d] == int.from_bytes(bytes([16 * r + d for r in range(4)]), "little")
