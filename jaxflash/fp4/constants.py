"""Direct-P constants: the single source for the JAX emulator (jaxflash.fp4.direct_p) and the
sm_100a kernel (its CuTe DSL code imports this module at trace time).

Plain Python numbers only: no JAX, no DSL, no NumPy, so any side can import it cheaply.
Source: MrHuff/fp4-fa4 technical report v2, section 4 (as summarised in
shared/design/blackwell-fp4-brief.md, section 2).

Notation (per query row i, per N32 key block B):
  z_ij = scale * Q_i . K_j                 (scale = 1/sqrt(d) unless given)
  y_ij = (z_ij - m_i) * LOG2E              (m_i: row reference, see the policies)
  e_B  = block exponent, u_B = e_B + E8M0_BIAS the published E8M0 byte, alpha_B = 2^e_B
  x_ij = y_ij - e_B + LOG2_6               (ideal converter input: q = E2M1(2^x))
  fast map:  q_ij = E2M1(max(0, A * x_ij + B))       (one FFMA2 + one F2FP per score pair)
  represented probability  p~_ij = alpha_B * q_ij / 6
  denominator  L~_iB = alpha_B * (c_B / 6),  c_B = sum_j q_ij   (never (alpha_B / 6) * c_B)
"""
import math

# --- converter geometry --------------------------------------------------------------------
LOG2E = 1.4426950408889634          # log2(e)
LN2 = 0.6931471805599453
LOG2_6 = 2.584962500721156          # log2(6): x = log2(6 p / alpha)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitude by code 0..7
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_MIN_BYTE = 1                   # u = 0 is reserved for a zero block (paper convention)
E8M0_MAX_BYTE = 254                 # 255 is NaN
P_BLOCK = 32                        # MXFP4 block of P along keys (one N32 quarter)
PV_K = 64                           # the PV MMA consumes two adjacent N32 blocks (K64)
QK_BLOCK = 16                       # NVFP4 block of Q/K along the head dim
V_BLOCK = 32                        # MXFP4 block of V along keys (PV MMA's K dimension)
KEY_TILE = 128                      # key columns per S tile (4 N32 quarters)
PV_OUTPUT_CORRECTION = 1.0 / 36.0   # P (alpha q / 6) x V (alpha_v q_v / 6): fixed 1/36
# The kernel's PV MMA multiplies P's codes by 2^(u_B - 127) (Direct-P's p~ = alpha q / 6 without
# the 1/6) and V's by its OCP MXFP4 scale (formats.mxfp4: v_hat = q 2^(u - 127), the emulator's
# V), so the MMA sums 6 x sum p~ v_hat: O = acc / (KERNEL_PV_SCALE * L~).  (The paper's 1/36
# holds when V, too, is stored in the alpha q / 6 convention.)
KERNEL_PV_SCALE = 6.0

# Block-exponent rule for P: how e_B is chosen from the block's max y (y_max = max_j y_ij).
#   "ocp":  e_B = floor(y_max + LOG2_6 - 2): the block max lands in [4, 8) on the E2M1 grid
#           (codes above 6 saturate), the OCP MX shared-exponent rule written in the
#           alpha*q/6 convention.  Matches the paper's P range diagnostic (P rel-L2 0.147,
#           PV cosine 0.9893 at S=4096), which the "ceil" rule misses (0.161 / 0.9877).
#   "ceil": e_B = ceil(y_max): alpha_B >= block max (cvt.rp.ue8m0 of a_B), block max lands in
#           (3, 6].
#   "floor": e_B = floor(y_max): alpha_B <= block max (cvt.rz.ue8m0 of a_B), block max lands in
#           [6, 12) and saturates to 6.
# (devtools/fp4_accuracy.py --p-scale-rule reports the paper-grid accuracy under each.)
P_SCALE_RULE = "ocp"
P_SCALE_OCP_OFFSET = LOG2_6 - 2.0   # e_B = floor(y_max + this)
# MXFP4 rule for V (formats.mxfp4_quantize(rule=...)) along the key axis.
V_SCALE_RULE = "ocp"

# --- the affine maps (fitted for E2M1 code agreement, not exp accuracy) ----------------------
FAST_A = 1.50
FAST_B = 1.20
WAN_A = 1.60                         # equal-cost pair used in the Wan-video evaluations
WAN_B = 0.95

# --- extreme-logit guard ---------------------------------------------------------------------
GUARD_SAMPLE_ROWS = 128              # K rows spread over the sequence, moved into the first tile
GUARD_MAX_SHIFT_SUM = 126            # compile-time margin M and scale shift L need M + L <= 126
GUARD_M_L_WAN_1_3B = (110, 16)
GUARD_M_L_WAN_14B = (112, 14)
GUARD_DEFAULT_M_L = GUARD_M_L_WAN_1_3B


def check_guard(margin: int, shift: int) -> None:
    """Raise ValueError unless (M, L) is a legal guard: integers, M >= 0, L >= 0, M + L <= 126."""
    if int(margin) != margin or int(shift) != shift or margin < 0 or shift < 0:
        raise ValueError(f"guard margin/shift must be non-negative integers, got {margin}, {shift}")
    if margin + shift > GUARD_MAX_SHIFT_SUM:
        raise ValueError(f"guard needs M + L <= {GUARD_MAX_SHIFT_SUM}, got {margin} + {shift}")


# --- policies (paper table tab:policy-definition) -------------------------------------------
# anchor_rows: K rows (evenly spread over the sequence) whose scores give the row reference
#   m_i = max over those rows; 0 = "shiftless": m_i = 0, the E8M0 block exponent carries range.
# native_ex2_pair_period/offset: score pairs (2p, 2p+1) inside each N32 block with
#   p % period == offset use the native EX2 (q = E2M1(2^x)) instead of the affine map;
#   period 4 = 25 % of pair positions; 0 = never.
# kv_stages / denominator_in: kernel-only scheduling facts, recorded for explain().
POLICIES = {
    "fast": dict(A=FAST_A, B=FAST_B, anchor_rows=0, native_ex2_pair_period=0,
                 native_ex2_pair_offset=0, kv_stages=12, denominator_in="softmax"),
    "accurate": dict(A=FAST_A, B=FAST_B, anchor_rows=32, native_ex2_pair_period=4,
                     native_ex2_pair_offset=0, kv_stages=13, denominator_in="correction"),
    "wan": dict(A=WAN_A, B=WAN_B, anchor_rows=0, native_ex2_pair_period=0,
                native_ex2_pair_offset=0, kv_stages=12, denominator_in="softmax"),
}

# --- paper numbers the emulator is held to (GB200 D128 non-causal 9-shape grid) -------------
PAPER_GRID = ((1, 256, 16), (1, 1024, 16), (4, 4096, 16), (1, 32768, 16), (4, 4096, 32),
              (1, 4096, 12), (1, 32768, 12), (1, 4096, 24), (1, 32768, 24))   # (B, S, H), D=128
PAPER_SEED = 20260814
PAPER_ACCURACY = {"fast": (0.943789, 0.336602), "accurate": (0.951669, 0.327225)}  # (cos, relL2)
PAPER_TOLERANCE = 0.02

# --- training recipe (paper section 8) -------------------------------------------------------
FP8_P_MAX_OFFSET = 8                 # P in E4M3 is stored as P * 2^8 (uses E4M3's top codes)

assert math.isclose(LOG2E, 1.0 / math.log(2.0), rel_tol=0, abs_tol=1e-15)
assert math.isclose(LOG2_6, math.log2(6.0), rel_tol=0, abs_tol=1e-15)
check_guard(*GUARD_M_L_WAN_1_3B)
check_guard(*GUARD_M_L_WAN_14B)
