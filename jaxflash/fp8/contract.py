"""The FP8 attention numerics contract: constants shared by the emulation
(`jaxflash.fp8.emulated`) and the sm_90a FP8 kernels (their DSL code imports this module).

Plain Python numbers only (no JAX, no DSL), so either side imports it cheaply.

Forward (per batch row b, query head n, kv head n // G):
  s_ij   = (q8_i . k8_j) * qs[b,n,i // q_block] * ks[b,kv,j // k_block]   float32 accumulate
  z_ij   = transform(s_ij * scale)  (softcap, ALiBi, bias), masked keys -> -inf
  keys are visited in tiles of FWD_KV_TILE; m_i the running row max over the tiles so far
  p_ij   = exp(z_ij - m_i)  (float32, <= 1)
  l_i    = l_i * exp(m_old - m_i) + sum_j p_ij       (float32, from the unquantized p)
  p8_ij  = e4m3_satfinite_rne(p_ij * 2^P_SCALE_LOG2)  (the P block scale is exp(m_i) 2^-8:
           relative to the running max, then an exact power of two that puts p's top at
           E4M3's top binade, so p down to 2^-17 is kept)
  acc_i  = acc_i * exp(m_old - m_i) + 2^-P_SCALE_LOG2 * sum_j p8_ij * (v8_j * vs[b,kv,j // v_block])
  out_i  = acc_i / l_i  cast to out_dtype (bfloat16 by default);  lse_i = m_i + log(l_i)
  A row with no visible key: out 0, lse -inf.

Backward (FlashAttention-2 order, recomputing P from the saved FP8 Q/K and the LSE):
  dO8    = E5M2 of dO (E4M3 when Fp8Spec.do_dtype says so), scales per (b, n, block of
           BWD_Q_TILE query rows), amax rule
  D_i    = sum_d dO8_id * out_id    (the dequantized dO8, as dP uses it, and out as returned:
           then sum_j p_ij (dP_ij - D_i) = 0 as for the exact gradient, up to P's rounding; a
           row with one visible key gets dQ = 0, not dO's quantization error)
  p_ij   = exp(z_ij - lse_i);  p8 as in the forward (E4M3, x 2^8)
  dV_j  += sum_i p8_ij dO8_i                     (dequantized operands, float32 accumulate)
  dP_ij  = dO8_i . v_j;   dZ_ij = p_ij (dP_ij - D_i)   (float32)
  dX_ij  = dZ_ij * softcap'(.)   (gradient at s_ij * scale; dZ itself feeds dbias / dALiBi)
  dS8    = E4M3 of dX, scales per (b, n, BWD_DS_Q_TILE query rows x bwd_kv_tile(H) keys), amax
           rule (128 keys, 64 at head dims above BWD_WIDE_HEAD_DIM)
  dQ_i  += scale * sum_j dS8_ij k_j;   dK_j += scale * sum_i dS8_ij q_i
  with q, k, v the dequantized FP8 operands of the forward (E4M3 unless the caller gave E5M2).
  Gradients are float32, with respect to the dequantized operands.

Amax rule (as `jaxflash.quantize`): scale = amax / FMAX, codes = satfinite_rne(x * FMAX / amax),
an all-zero block has scale 1. For the backward's dO and dS blocks a nonzero amax is first
raised to BWD_AMAX_FLOOR: the kernel accumulates dV and dK in the units of the current block
and rescales by the ratio of consecutive units, which must stay inside float32's range (a dS
block of denormal-small P, far from the row max, would otherwise give a unit near zero and an
infinite ratio). Values below the floor / 2^9 then round to zero: negligible beside any
gradient that float32 training keeps.

Backend interface (what an FP8 kernel backend implements; `jaxflash.backends.xla` serves it
with `jaxflash.fp8.emulated`, `jaxflash.backends.cute` refuses it until the kernels exist):
  plan(problem): ``problem.statics.fp8`` is the `Fp8Spec` (dtypes, scale blocks, out_dtype,
    do_dtype, source), ``problem.dtype`` the query's FP8 dtype, "fp8" in ``problem.features()``;
    raise NotImplementedError(why) for what the kernel cannot serve (dispatch then falls back to
    the emulation and `explain` prints the reason).
  forward(q8, k8, v8, arrays, statics, plan) -> (out [B,T,N,Hv] in spec.out_dtype,
    lse [B,N,T] float32); the scales are ``arrays.q_scale / k_scale / v_scale`` (canonical
    ``[B, heads, nblocks]`` float32, see `jaxflash._types.AttentionArrays`).
  backward(q8, k8, v8, arrays, statics, plan, out, lse, dout) -> (dq, dk, dv, dbias, dalibi),
    float32 gradients with respect to the dequantized q, k, v (dout in out's dtype; out / lse
    may be the global ones of ring attention). The wrappers in `jaxflash.autodiff` turn them
    into the caller's gradients (straight-through for precision="fp8").
  A kernel that quantizes bf16 Q/K/V itself (the fused prologue) would serve
  ``spec.source == "quantized"`` calls through the same plan, with the same rules.

Kernel alignment: a kernel whose tiles differ from these constants computes a different but
equally accurate rounding; it must keep each scale block within one of its tiles' rows
(q_block a multiple of its query tile, k_block / v_block of its key tile, or one block for the
whole sequence) or refuse the call. Tolerances the kernel is held to against this emulation are
in tests/fp8 (`EMULATION_TOLERANCE` there).
"""

P_SCALE_LOG2 = 8          # P is stored in E4M3 as p * 2^8 (p <= 1, so <= 256 < 448)
FWD_KV_TILE = 128         # keys per forward tile (the running max's granularity)
BWD_Q_TILE = 128          # query rows per dO (E5M2) scale
# Query rows per dS block: the Hopper FP8 backward kernel steps over 64 queries at a time (its
# 128-key x 64-query S^T / dP^T tiles beside the dK / dV accumulators fill the 240 registers;
# 128 queries would need 256), and a dS scale must be known before the step's convert: one
# amax per 64 x 128 block, finer than a 128 x 128 one and reduced inside one step.
BWD_DS_Q_TILE = 64
BWD_KV_TILE = 128         # keys per dS block
# Above this head dim the kernel's CTA holds 64 keys (its two warpgroups split the head dim: the
# dK + dV accumulators of 128 keys do not fit the registers), and a dS block cannot span two
# CTAs: the dS block is BWD_DS_Q_TILE x BWD_KV_TILE_WIDE there.
BWD_WIDE_HEAD_DIM = 128
BWD_KV_TILE_WIDE = 64
BWD_AMAX_FLOOR = 2.0 ** -64  # least amax of a nonzero dO / dS block (see the amax rule)
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
DEFAULT_BLOCK = 128       # sequence rows per scale when precision="fp8" quantizes itself
HADAMARD_DEFAULT_SEED = 0


def bwd_kv_tile(head_dim: int) -> int:
    """Keys per dS scale block of the backward at this (query / key) head dim."""
    return BWD_KV_TILE if head_dim <= BWD_WIDE_HEAD_DIM else BWD_KV_TILE_WIDE
