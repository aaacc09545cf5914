"""The backward's GPU check cases (`bwd_devrun check` / `determinism`): pure data, no DSL.

Each case is (name, config kwargs shared by `FwdConfig` and `BwdConfig`, problem), problem =
(B, T, S, N, K, extras); `bwd_devrun` draws fresh random inputs for it and compares dq / dk / dv
with a float64 oracle. A feature's gate (`verified.RULES`) is cleared only once its cases here
pass on the GPU.
"""
from __future__ import annotations


def _hd128_edv_cases(tag: str, **flags):
    """The four hd 128 early_dv cases every schedule opt-in of that step is checked on (name
    "... h128 edv {tag} ..."): causal GQA T < S, dense 2k (also against cuDNN's error),
    window T > S (more query blocks than key blocks), fp16 lengths with empty rows."""
    kw = dict(head_dim=128, early_dv=True, **flags)
    return [
        (f"bf16 h128 edv {tag} causal gqa T<S", dict(kw, is_causal=True),
         (2, 500, 700, 8, 2, {})),
        (f"bf16 h128 edv {tag} dense 2k", kw, (1, 2048, 2048, 8, 8, {"cudnn": True})),
        (f"bf16 h128 edv {tag} window T>S", dict(kw, is_causal=True, has_window=True),
         (1, 400, 150, 2, 2, {"window": (70, 0)})),
        (f"fp16 h128 edv {tag} seqlens empty rows",
         dict(kw, dtype="float16", has_q_seqlen=True, has_kv_seqlen=True),
         (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255]})),
    ]


def _wide_dq_cases(tag: str, **flags):
    """The four cases each dQ-path opt-in of the head-dim-split kernel (hd 192 / 256) is
    checked on (name "... {tag} ..."): dense odd lengths, causal GQA T < S, fp16 window with
    key lengths (empty rows), dense 2k against cuDNN's error."""
    return [
        (f"bf16 h256 {tag} dense odd", dict(head_dim=256, **flags), (2, 300, 333, 4, 4, {})),
        (f"bf16 h256 {tag} causal gqa T<S", dict(head_dim=256, is_causal=True, **flags),
         (2, 500, 700, 8, 2, {})),
        (f"fp16 h192 {tag} window kvlen", dict(dtype="float16", head_dim=192, has_window=True,
                                               has_kv_seqlen=True, **flags),
         (2, 260, 270, 4, 2, {"window": (50, 20), "kv_seqlen": [270, 100]})),
        (f"bf16 h256 {tag} dense 2k", dict(head_dim=256, **flags),
         (1, 2048, 2048, 4, 4, {"cudnn": True})),
    ]


def _wide_order_cases(tag: str, **flags):
    """Two more cases for a step order of the wide kernel (name "... {tag} ..."): causal
    T > S with softcap (the mask and tanh around the reordered GEMMs), and tail_lpt's launch
    order with GQA."""
    return [
        (f"bf16 h256 {tag} causal T>S softcap", dict(head_dim=256, is_causal=True,
                                                     has_softcap=True, **flags),
         (1, 400, 150, 2, 2, {"softcap": 20.0})),
        (f"bf16 h256 {tag} tl causal gqa", dict(head_dim=256, is_causal=True, tail_lpt=True,
                                                **flags), (4, 500, 700, 8, 2, {})),
    ]


# (name, config kwargs (shared by the forward and backward configs), problem):
# problem = (B, T, S, N, K, extras)
CHECKS = [
    ("bf16 h128 dense odd", dict(head_dim=128), (2, 300, 333, 4, 4, {"cudnn": True})),
    ("bf16 h64 tiny", dict(head_dim=64), (1, 64, 128, 1, 1, {})),
    ("bf16 h128 causal gqa T<S", dict(head_dim=128, is_causal=True),
     (2, 500, 700, 8, 2, {"cudnn": True})),
    ("bf16 h128 causal T>S", dict(head_dim=128, is_causal=True), (1, 400, 150, 2, 2, {})),
    ("bf16 h128 mqa odd", dict(head_dim=128), (2, 257, 259, 4, 1, {"cudnn": True})),
    ("bf16 h96 window", dict(head_dim=96, has_window=True),
     (2, 400, 400, 4, 2, {"window": (100, 37)})),
    ("bf16 h64 causal window", dict(head_dim=64, is_causal=True, has_window=True),
     (2, 333, 333, 4, 4, {"window": (129, 0), "cudnn": True})),
    ("bf16 h128 softcap", dict(head_dim=128, has_softcap=True),
     (2, 200, 300, 4, 2, {"softcap": 2.0})),
    ("bf16 h128 seqlens empty rows", dict(head_dim=128, has_q_seqlen=True, has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255],
                          "cudnn": True})),
    ("fp16 h128 causal gqa", dict(dtype="float16", head_dim=128, is_causal=True),
     (2, 384, 384, 6, 3, {"cudnn": True})),
    ("fp16 h64 window softcap kvlen", dict(dtype="float16", head_dim=64, has_window=True,
                                            has_softcap=True, has_kv_seqlen=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "softcap": 5.0, "kv_seqlen": [270, 100]})),
    ("bf16 h128 dense 2k", dict(head_dim=128), (1, 2048, 2048, 8, 8, {"cudnn": True})),
    ("bf16 h64 causal via jax.grad", dict(head_dim=64, is_causal=True),
     (2, 190, 190, 4, 2, {"api": True})),
    # dQ by red.global.add.f32 instead of TMA reduce-add
    ("bf16 h128 causal gqa dq red", dict(head_dim=128, is_causal=True, dq_accum="red"),
     (2, 500, 700, 8, 2, {})),
    ("fp16 h64 seqlens dq red", dict(dtype="float16", head_dim=64, has_q_seqlen=True,
                                     has_kv_seqlen=True, dq_accum="red"),
     (3, 200, 260, 4, 4, {"q_seqlen": [200, 0, 77], "kv_seqlen": [1, 260, 130]})),
    # Scheduling variants (issue 3, opt-in): early_dv = P^T and the dV GEMM before dS^T;
    # overlap_dq = dQ GEMM before dK, its store / reduce behind the dK GEMM (hd <= 96).
    ("bf16 h128 causal gqa T<S edv", dict(head_dim=128, is_causal=True, early_dv=True),
     (2, 500, 700, 8, 2, {})),
    ("bf16 h128 dense 2k edv", dict(head_dim=128, early_dv=True),
     (1, 2048, 2048, 8, 8, {})),
    ("bf16 h128 seqlens empty rows edv", dict(head_dim=128, has_q_seqlen=True,
                                              has_kv_seqlen=True, early_dv=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h128 window T>S edv", dict(head_dim=128, is_causal=True, has_window=True,
                                      early_dv=True),
     (1, 400, 150, 2, 2, {"window": (70, 0)})),
    ("bf16 h64 dense odd ovl", dict(head_dim=64, overlap_dq=True), (2, 300, 333, 4, 4, {})),
    ("bf16 h64 causal window ovl edv", dict(head_dim=64, is_causal=True, has_window=True,
                                            overlap_dq=True, early_dv=True),
     (2, 333, 333, 4, 4, {"window": (129, 0)})),
    ("bf16 h64 causal gqa 1k ovl edv", dict(head_dim=64, is_causal=True, overlap_dq=True,
                                            early_dv=True), (2, 1024, 1024, 8, 2, {})),
    ("fp16 h96 window softcap ovl edv", dict(dtype="float16", head_dim=96, has_window=True,
                                             has_softcap=True, overlap_dq=True, early_dv=True),
     (2, 400, 400, 4, 2, {"window": (100, 37), "softcap": 3.0})),
    ("fp16 h64 seqlens dq red ovl edv", dict(dtype="float16", head_dim=64, has_q_seqlen=True,
                                             has_kv_seqlen=True, dq_accum="red",
                                             overlap_dq=True, early_dv=True),
     (3, 200, 260, 4, 4, {"q_seqlen": [200, 0, 77], "kv_seqlen": [1, 260, 130]})),
    # Head dims 192 / 256: FlashBwdSm90Wide (warpgroups split the head dim, tile_n 64).
    ("bf16 h256 dense odd", dict(head_dim=256), (2, 300, 333, 4, 4, {"cudnn": True})),
    ("bf16 h256 tiny", dict(head_dim=256), (1, 64, 64, 1, 1, {})),
    ("bf16 h256 causal gqa T<S", dict(head_dim=256, is_causal=True),
     (2, 500, 700, 8, 2, {"cudnn": True})),
    ("bf16 h192 causal T>S", dict(head_dim=192, is_causal=True), (1, 400, 150, 2, 2, {})),
    ("bf16 h192 mqa odd", dict(head_dim=192), (2, 257, 259, 4, 1, {})),
    ("bf16 h256 window", dict(head_dim=256, has_window=True),
     (2, 400, 400, 4, 2, {"window": (100, 37)})),
    ("bf16 h192 causal window", dict(head_dim=192, is_causal=True, has_window=True),
     (2, 333, 333, 4, 4, {"window": (129, 0)})),
    ("bf16 h256 softcap", dict(head_dim=256, has_softcap=True),
     (2, 200, 300, 4, 2, {"softcap": 2.0})),
    ("bf16 h192 seqlens empty rows", dict(head_dim=192, has_q_seqlen=True, has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h256 seqlens empty rows", dict(head_dim=256, has_q_seqlen=True, has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255]})),
    ("fp16 h256 causal gqa", dict(dtype="float16", head_dim=256, is_causal=True),
     (2, 384, 384, 6, 3, {})),
    ("fp16 h192 window softcap kvlen", dict(dtype="float16", head_dim=192, has_window=True,
                                             has_softcap=True, has_kv_seqlen=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "softcap": 5.0, "kv_seqlen": [270, 100]})),
    ("bf16 h256 dense 2k", dict(head_dim=256), (1, 2048, 2048, 4, 4, {"cudnn": True})),
    ("bf16 h192 dense 1k", dict(head_dim=192), (1, 1024, 1024, 4, 2, {})),
    ("bf16 h256 causal via jax.grad", dict(head_dim=256, is_causal=True),
     (2, 190, 190, 4, 2, {"api": True})),
    ("bf16 h192 causal via jax.grad", dict(head_dim=192, is_causal=True),
     (2, 190, 190, 4, 2, {"api": True})),
    # hd 256 with "red": 2 Q / dO stages, 2 P^T / dS^T buffers (no dQ tile in smem)
    ("bf16 h256 causal gqa dq red", dict(head_dim=256, is_causal=True, dq_accum="red"),
     (2, 500, 700, 8, 2, {})),
    ("fp16 h192 seqlens dq red", dict(dtype="float16", head_dim=192, has_q_seqlen=True,
                                      has_kv_seqlen=True, dq_accum="red"),
     (3, 200, 260, 4, 4, {"q_seqlen": [200, 0, 77], "kv_seqlen": [1, 260, 130]})),
    # ALiBi (d(slopes) compared too) and segment ids (added 2026-12-01, not yet run on a GPU).
    ("bf16 h64 alibi odd", dict(head_dim=64, has_alibi=True), (2, 300, 457, 4, 4, {"alibi": 1})),
    ("fp16 h96 alibi causal gqa", dict(dtype="float16", head_dim=96, has_alibi=True,
                                       is_causal=True), (2, 555, 555, 8, 2, {"alibi": 1})),
    # batch 0: query segment 2 (250 rows) and batch 1: segment 6 (1 row) meet no key.
    ("bf16 h128 segments", dict(head_dim=128, has_segments=True),
     (2, 700, 650, 4, 2, {"q_segs": [[(0, 100), (1, 37), (2, 250), (3, 313)], [(5, 699), (6, 1)]],
                          "kv_segs": [[(0, 100), (1, 37), (3, 513)], [(5, 650)]]})),
    ("bf16 h128 segments causal gqa", dict(head_dim=128, has_segments=True, is_causal=True),
     (2, 1000, 1000, 8, 2, {"q_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]],
                            "kv_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]]})),
    ("bf16 h64 alibi segments causal gqa", dict(head_dim=64, has_alibi=True, has_segments=True,
                                                is_causal=True),
     (2, 700, 700, 8, 2, {"alibi": 1,
                          "q_segs": [[(0, 1), (1, 300), (2, 129), (3, 270)], [(5, 650), (9, 50)]],
                          "kv_segs": [[(0, 1), (1, 300), (2, 129), (3, 270)],
                                      [(5, 650), (8, 50)]]})),
    ("fp16 h96 alibi segments random kvlen edv", dict(dtype="float16", head_dim=96,
                                                      has_alibi=True, has_segments=True,
                                                      has_kv_seqlen=True, early_dv=True),
     (3, 333, 444, 4, 2, {"random_segs": 3, "alibi": 1, "kv_seqlen": [444, 200, 0]})),
    ("bf16 h96 alibi segments window qlen", dict(head_dim=96, has_alibi=True, has_segments=True,
                                                 is_causal=True, has_window=True,
                                                 has_q_seqlen=True),
     (2, 513, 513, 4, 1, {"alibi": 1, "window": (200, 0), "q_seqlen": [513, 77],
                          "q_segs": [[(0, 200), (1, 313)], [(2, 513)]],
                          "kv_segs": [[(0, 200), (1, 313)], [(2, 513)]]})),
    # tile_m 128 (opt-in, hd 64, unverified until these pass): 128 queries per step; odd T / S
    # (partial last query blocks, LSE / delta padded to 128 rows), T < 128, causal T > S and
    # T < S, GQA / MQA, windows, lengths with empty rows, fp16, "red", segment skipping.
    ("bf16 h64 m128 dense odd", dict(head_dim=64, tile_m=128),
     (2, 300, 333, 4, 4, {"cudnn": True})),
    ("bf16 h64 m128 tiny", dict(head_dim=64, tile_m=128), (1, 64, 128, 1, 1, {})),
    ("bf16 h64 m128 causal gqa T<S", dict(head_dim=64, tile_m=128, is_causal=True),
     (2, 500, 700, 8, 2, {"cudnn": True})),
    ("bf16 h64 m128 causal T>S", dict(head_dim=64, tile_m=128, is_causal=True),
     (1, 400, 150, 2, 2, {})),
    ("bf16 h64 m128 mqa odd", dict(head_dim=64, tile_m=128), (2, 257, 259, 4, 1, {})),
    ("bf16 h64 m128 window", dict(head_dim=64, tile_m=128, has_window=True),
     (2, 400, 400, 4, 2, {"window": (100, 37)})),
    ("bf16 h64 m128 causal window", dict(head_dim=64, tile_m=128, is_causal=True,
                                         has_window=True),
     (2, 333, 333, 4, 4, {"window": (129, 0), "cudnn": True})),
    ("bf16 h64 m128 window T>S", dict(head_dim=64, tile_m=128, is_causal=True,
                                      has_window=True), (1, 400, 150, 2, 2, {"window": (70, 0)})),
    ("bf16 h64 m128 seqlens empty rows", dict(head_dim=64, tile_m=128, has_q_seqlen=True,
                                              has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255],
                          "cudnn": True})),
    ("fp16 h64 m128 causal gqa", dict(dtype="float16", head_dim=64, tile_m=128,
                                      is_causal=True), (2, 384, 384, 6, 3, {"cudnn": True})),
    ("fp16 h64 m128 window kvlen", dict(dtype="float16", head_dim=64, tile_m=128,
                                        has_window=True, has_kv_seqlen=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "kv_seqlen": [270, 100]})),
    ("bf16 h64 m128 dense 2k", dict(head_dim=64, tile_m=128), (1, 2048, 2048, 8, 8, {})),
    ("fp16 h64 m128 seqlens dq red", dict(dtype="float16", head_dim=64, tile_m=128,
                                          has_q_seqlen=True, has_kv_seqlen=True,
                                          dq_accum="red"),
     (3, 200, 260, 4, 4, {"q_seqlen": [200, 0, 77], "kv_seqlen": [1, 260, 130]})),
    ("bf16 h64 m128 segments causal gqa", dict(head_dim=64, tile_m=128, has_segments=True,
                                               is_causal=True),
     (2, 1000, 1000, 8, 2, {"q_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]],
                            "kv_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]]})),
    # overlap_dq at tile_m 128 (opt-in, hd 64, unverified until these pass): dQ issued before
    # dK, its flush behind the dK GEMM; S^T / dQ zeroed before their GEMMs (the registers that
    # made it spill). Odd T / S, causal T < S and T > S, GQA / MQA, windows, lengths with empty
    # rows, fp16, "red"; the deterministic cases are with the others at the end.
    ("bf16 h64 m128 ovl dense odd", dict(head_dim=64, tile_m=128, overlap_dq=True),
     (2, 300, 333, 4, 4, {"cudnn": True})),
    ("bf16 h64 m128 ovl causal gqa T<S", dict(head_dim=64, tile_m=128, overlap_dq=True,
                                              is_causal=True), (2, 500, 700, 8, 2, {})),
    ("bf16 h64 m128 ovl causal T>S", dict(head_dim=64, tile_m=128, overlap_dq=True,
                                          is_causal=True), (1, 400, 150, 2, 2, {})),
    ("bf16 h64 m128 ovl mqa odd", dict(head_dim=64, tile_m=128, overlap_dq=True),
     (2, 257, 259, 4, 1, {})),
    ("bf16 h64 m128 ovl causal window", dict(head_dim=64, tile_m=128, overlap_dq=True,
                                             is_causal=True, has_window=True),
     (2, 333, 333, 4, 4, {"window": (129, 0)})),
    ("bf16 h64 m128 ovl seqlens empty rows", dict(head_dim=64, tile_m=128, overlap_dq=True,
                                                  has_q_seqlen=True, has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255]})),
    ("fp16 h64 m128 ovl window kvlen", dict(dtype="float16", head_dim=64, tile_m=128,
                                            overlap_dq=True, has_window=True,
                                            has_kv_seqlen=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "kv_seqlen": [270, 100]})),
    ("fp16 h64 m128 ovl seqlens dq red", dict(dtype="float16", head_dim=64, tile_m=128,
                                              overlap_dq=True, has_q_seqlen=True,
                                              has_kv_seqlen=True, dq_accum="red"),
     (3, 200, 260, 4, 4, {"q_seqlen": [200, 0, 77], "kv_seqlen": [1, 260, 130]})),
    ("bf16 h64 m128 ovl dense 2k", dict(head_dim=64, tile_m=128, overlap_dq=True),
     (1, 2048, 2048, 8, 8, {})),
    # dq_arrive (opt-in, hd <= 128, unverified until these pass): BAR_DQ arrive-only except
    # for warp 4, so the warpgroups drift apart by up to a step. Many query blocks per key
    # block (long T) and GQA let them drift; odd T / S, causal T < S and T > S, windows,
    # lengths with empty rows, fp16, hd 64 at tile_m 128 and with overlap_dq.
    *_hd128_edv_cases("dqa", dq_arrive=True),
    ("bf16 h64 m128 dqa dense odd", dict(head_dim=64, tile_m=128, dq_arrive=True),
     (2, 300, 333, 4, 4, {})),
    ("bf16 h64 m128 dqa causal gqa T<S", dict(head_dim=64, tile_m=128, is_causal=True,
                                              dq_arrive=True), (2, 500, 700, 8, 2, {})),
    ("fp16 h64 m128 dqa window kvlen", dict(dtype="float16", head_dim=64, tile_m=128,
                                            has_window=True, has_kv_seqlen=True,
                                            dq_arrive=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "kv_seqlen": [270, 100]})),
    ("bf16 h64 m128 ovl dqa causal 2k", dict(head_dim=64, tile_m=128, overlap_dq=True,
                                             is_causal=True, dq_arrive=True),
     (1, 2048, 2048, 8, 2, {})),
    # overlap_dq at hd 128 with early_dv (gated until these pass; FA3 / FA4's order: dQ issued
    # before dK, its tile stored while dK runs). ptxas keeps 1-7 loop-invariant values in
    # local memory (one LDL each per step). Dense / causal GQA, window T > S, fp16 lengths
    # with empty rows, with dq_arrive, and a 2k case against cuDNN.
    *_hd128_edv_cases("ovl", overlap_dq=True),
    ("bf16 h128 edv ovl dense odd mqa", dict(head_dim=128, early_dv=True, overlap_dq=True),
     (2, 333, 301, 4, 1, {})),
    ("bf16 h128 edv ovl dqa causal 2k", dict(head_dim=128, early_dv=True, overlap_dq=True,
                                             is_causal=True, dq_arrive=True),
     (1, 2048, 2048, 8, 2, {})),
    # dq_writer (gated until these pass): warp 1 issues one reduce-add per warpgroup half,
    # per-warpgroup barrier pairs instead of BAR_DQ. Long T (many steps per CTA), GQA (the
    # head loop), odd lengths (clipped rows), T < S and T > S, window, fp16 lengths with
    # empty rows (CTAs with no step), hd 64 / 96, with and without overlap_dq / early_dv.
    *_hd128_edv_cases("ovl dqw", overlap_dq=True, dq_writer=True),
    ("bf16 h128 edv dqw dense odd mqa", dict(head_dim=128, early_dv=True, dq_writer=True),
     (2, 333, 301, 4, 1, {})),
    ("bf16 h64 dqw causal gqa 1k", dict(head_dim=64, is_causal=True, dq_writer=True),
     (2, 1000, 1000, 8, 2, {})),
    ("fp16 h96 ovl dqw window kvlen", dict(dtype="float16", head_dim=96, has_window=True,
                                           has_kv_seqlen=True, overlap_dq=True,
                                           dq_writer=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "kv_seqlen": [270, 100]})),
    # dq_flat (gated until these pass): the dQ tile in fragment order, one bulk reduce per
    # step into the fragment-ordered accumulator that `bwd_launch.dq_from_flat` un-permutes
    # (a wrong order shows as a large error): hd 128 early_dv with and without overlap_dq,
    # hd 96 (6 chunks per part), hd 192 / 256 (the head-dim-split kernel), fp16, odd
    # lengths (a partial last block), GQA, window, T > S.
    *_hd128_edv_cases("dqf", dq_flat=True),
    *_hd128_edv_cases("ovl dqf", overlap_dq=True, dq_flat=True),
    ("bf16 h96 dqf causal gqa odd", dict(head_dim=96, is_causal=True, dq_flat=True),
     (2, 333, 301, 4, 2, {})),
    *_wide_dq_cases("dqf", dq_flat=True),
    # dq_flat with dq_writer (gated until these pass): the writer warp adds each warpgroup's
    # part with its own bulk reduce (FA4's scheme), with and without overlap_dq; hd 96 too.
    *_hd128_edv_cases("ovl dqw dqf", overlap_dq=True, dq_writer=True, dq_flat=True),
    ("bf16 h128 edv dqw dqf dense odd mqa", dict(head_dim=128, early_dv=True, dq_writer=True,
                                                 dq_flat=True), (2, 333, 301, 4, 1, {})),
    ("fp16 h96 dqw dqf window kvlen", dict(dtype="float16", head_dim=96, has_window=True,
                                           has_kv_seqlen=True, dq_writer=True, dq_flat=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "kv_seqlen": [270, 100]})),
    # tail_lpt (gated until these pass): the last heads' CTAs launch key-block-major
    # (`bwd_order`). More heads than fit the tail (the order switches mid-grid) and fewer
    # (all reordered), GQA, odd lengths, T < S and T > S, lengths with empty rows, fp16,
    # deterministic (its ordered adds wait on lower key blocks), hd 64 / 128 / 256, 2k vs cuDNN.
    ("bf16 h128 edv dqf tl causal gqa T<S", dict(head_dim=128, early_dv=True, dq_flat=True,
                                                 is_causal=True, tail_lpt=True),
     (2, 500, 700, 8, 2, {})),
    ("bf16 h128 edv dqf tl causal many heads", dict(head_dim=128, early_dv=True, dq_flat=True,
                                                    is_causal=True, tail_lpt=True),
     (8, 1000, 1000, 16, 8, {})),
    ("bf16 h128 edv dqf tl causal 2k", dict(head_dim=128, early_dv=True, dq_flat=True,
                                            is_causal=True, tail_lpt=True),
     (1, 2048, 2048, 8, 8, {"cudnn": True})),
    ("bf16 h128 tl causal T>S", dict(head_dim=128, is_causal=True, tail_lpt=True),
     (1, 400, 150, 2, 2, {})),
    ("fp16 h128 edv tl causal seqlens empty rows", dict(dtype="float16", head_dim=128,
                                                        early_dv=True, is_causal=True,
                                                        has_q_seqlen=True, has_kv_seqlen=True,
                                                        tail_lpt=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h64 m128 dqf tl causal gqa odd", dict(head_dim=64, tile_m=128, dq_flat=True,
                                                 is_causal=True, tail_lpt=True),
     (4, 777, 801, 16, 4, {})),
    ("bf16 h256 dqf tl causal gqa", dict(head_dim=256, dq_flat=True, is_causal=True,
                                         tail_lpt=True), (4, 500, 700, 8, 2, {})),
    ("bf16 h128 tl deterministic causal gqa", dict(head_dim=128, is_causal=True,
                                                   deterministic=True, tail_lpt=True),
     (4, 700, 700, 8, 4, {})),
    # dq_flat at tile_m 128 (hd 64: the warpgroups' parts are 64-row halves, whole head dim)
    ("bf16 h64 m128 dqf dense odd", dict(head_dim=64, tile_m=128, dq_flat=True),
     (2, 300, 333, 4, 4, {})),
    ("bf16 h64 m128 dqf causal gqa T<S", dict(head_dim=64, tile_m=128, is_causal=True,
                                              dq_flat=True), (2, 500, 700, 8, 2, {})),
    ("fp16 h64 m128 dqf window kvlen", dict(dtype="float16", head_dim=64, tile_m=128,
                                            has_window=True, has_kv_seqlen=True, dq_flat=True),
     (2, 260, 270, 4, 2, {"window": (50, 20), "kv_seqlen": [270, 100]})),
    ("bf16 h64 m128 dqf causal T>S", dict(head_dim=64, tile_m=128, is_causal=True,
                                          dq_flat=True), (1, 400, 150, 2, 2, {})),
    ("bf16 h64 m128 dqf dense 2k", dict(head_dim=64, tile_m=128, dq_flat=True),
     (1, 2048, 2048, 8, 8, {"cudnn": True})),
    # 80 queries per step at hd 128 dense (opt-in, gated until these pass; `hopper_bwd_m80`:
    # dQ^T = K^T dS^T stored transposed into the reduce-add tile, LSE / delta padded to 320).
    # Partial last query blocks (1000 = 12.5 x 80), GQA, T < S and T > S (more query blocks
    # than key blocks), fp16, one exact block and a single partial block.
    ("bf16 h128 m80 dense odd gqa", dict(head_dim=128, tile_m=80),
     (2, 1000, 1000, 8, 2, {"cudnn": True})),
    ("bf16 h128 m80 dense T<S", dict(head_dim=128, tile_m=80), (2, 333, 777, 4, 1, {})),
    ("bf16 h128 m80 dense T>S", dict(head_dim=128, tile_m=80), (1, 1500, 300, 4, 2, {})),
    ("fp16 h128 m80 dense 2k", dict(dtype="float16", head_dim=128, tile_m=80),
     (1, 2048, 2048, 8, 8, {"cudnn": True})),
    ("bf16 h128 m80 tiny 80", dict(head_dim=128, tile_m=80), (1, 80, 80, 1, 1, {})),
    ("bf16 h128 m80 tiny 17", dict(head_dim=128, tile_m=80), (1, 17, 17, 2, 1, {})),
    # dq_wg_flush (hd 192 / 256: each warpgroup reduce-adds its own dQ half, P^T / dS^T
    # double-buffered): dq_flat's four, and causal T > S, softcap.
    *_wide_dq_cases("dqg", dq_flat=True, dq_wg_flush=True),
    ("bf16 h256 dqg causal T>S", dict(head_dim=256, is_causal=True, dq_flat=True,
                                      dq_wg_flush=True), (1, 400, 150, 2, 2, {})),
    ("bf16 h256 dqg softcap", dict(head_dim=256, has_softcap=True, dq_flat=True,
                                   dq_wg_flush=True), (2, 300, 333, 4, 2, {"softcap": 20.0})),
    # q_multicast (key-block pairs in a cluster, Q / dO halves multicast to both): odd key
    # block counts (300 / 700 / 150 keys: the pair's phantom CTA has every key masked), a
    # single block, causal (the odd block's first query block fully masked), T > S, lengths
    # with empty rows, softcap, fp16 hd 192, the key-split kernel (hd 128 causal GQA) and two
    # 2k cases against cuDNN's error.
    ("bf16 h256 qmc dense odd", dict(head_dim=256, dq_flat=True, q_multicast=True),
     (2, 333, 300, 4, 4, {})),
    ("bf16 h256 qmc tiny", dict(head_dim=256, dq_flat=True, q_multicast=True),
     (1, 64, 64, 1, 1, {})),
    ("bf16 h256 qmc causal gqa T<S", dict(head_dim=256, is_causal=True, dq_flat=True,
                                          q_multicast=True), (2, 500, 700, 8, 2, {})),
    ("bf16 h256 qmc causal T>S", dict(head_dim=256, is_causal=True, dq_flat=True,
                                      q_multicast=True), (1, 400, 150, 2, 2, {})),
    ("fp16 h192 qmc causal lengths", dict(dtype="float16", head_dim=192, is_causal=True,
                                          has_q_seqlen=True, has_kv_seqlen=True, dq_flat=True,
                                          q_multicast=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 0], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h256 qmc softcap", dict(head_dim=256, has_softcap=True, dq_flat=True,
                                   q_multicast=True), (2, 300, 333, 4, 2, {"softcap": 20.0})),
    ("bf16 h128 qmc causal gqa odd", dict(head_dim=128, is_causal=True, early_dv=True,
                                          dq_flat=True, q_multicast=True),
     (2, 500, 700, 8, 2, {})),
    ("bf16 h256 qmc tl causal gqa", dict(head_dim=256, is_causal=True, dq_flat=True,
                                         tail_lpt=True, q_multicast=True),
     (4, 500, 700, 8, 2, {})),
    ("bf16 h128 qmc tl causal odd", dict(head_dim=128, is_causal=True, early_dv=True,
                                         dq_flat=True, tail_lpt=True, q_multicast=True),
     (3, 333, 333, 6, 3, {})),
    ("bf16 h256 qmc dense 2k", dict(head_dim=256, dq_flat=True, q_multicast=True),
     (1, 2048, 2048, 4, 4, {"cudnn": True})),
    ("bf16 h256 qmc causal 2k", dict(head_dim=256, is_causal=True, dq_flat=True,
                                     q_multicast=True), (1, 2048, 2048, 4, 4, {"cudnn": True})),
    # do_first (hd 192 / 256: dP^T before S^T, dO released after dV, Q after dK): the wide
    # dQ-path four, causal T > S with softcap, and with tail_lpt / q_multicast.
    *_wide_dq_cases("dof", dq_flat=True, do_first=True),
    *_wide_order_cases("dof", dq_flat=True, do_first=True),
    ("bf16 h256 dof qmc causal odd", dict(head_dim=256, is_causal=True, dq_flat=True,
                                          do_first=True, q_multicast=True),
     (2, 333, 300, 4, 2, {})),
    ("bf16 h256 dof qmc dense 2k", dict(head_dim=256, dq_flat=True, do_first=True,
                                        q_multicast=True), (1, 2048, 2048, 4, 4, {"cudnn": True})),
    # Ordered dQ adds (semaphores); last, since a hang here ends the run (watchdog).
    ("bf16 h128 deterministic causal gqa", dict(head_dim=128, is_causal=True,
                                                deterministic=True), (2, 500, 700, 8, 2, {})),
    ("bf16 h64 deterministic window", dict(head_dim=64, has_window=True, deterministic=True),
     (2, 700, 600, 4, 1, {"window": (150, 20)})),
    ("bf16 h128 dqf deterministic causal gqa", dict(head_dim=128, is_causal=True,
                                                    deterministic=True, dq_flat=True),
     (2, 500, 700, 8, 2, {})),
    ("bf16 h256 dqf deterministic causal gqa", dict(head_dim=256, is_causal=True,
                                                    deterministic=True, dq_flat=True),
     (2, 500, 700, 8, 2, {})),
    ("bf16 h64 m128 dqf deterministic causal gqa", dict(head_dim=64, tile_m=128,
                                                        is_causal=True, deterministic=True,
                                                        dq_flat=True),
     (2, 500, 700, 8, 2, {})),
    ("bf16 h256 deterministic causal gqa", dict(head_dim=256, is_causal=True,
                                                deterministic=True), (2, 500, 700, 8, 2, {})),
    ("bf16 h192 deterministic window", dict(head_dim=192, has_window=True, deterministic=True),
     (2, 700, 600, 4, 1, {"window": (150, 20)})),
    ("bf16 h64 m128 deterministic window", dict(head_dim=64, tile_m=128, has_window=True,
                                                deterministic=True),
     (2, 700, 600, 4, 1, {"window": (150, 20)})),
    ("bf16 h64 m128 deterministic causal gqa", dict(head_dim=64, tile_m=128, is_causal=True,
                                                    deterministic=True), (2, 500, 700, 8, 2, {})),
    ("bf16 h64 m128 ovl deterministic causal gqa", dict(head_dim=64, tile_m=128,
                                                        overlap_dq=True, is_causal=True,
                                                        deterministic=True),
     (2, 500, 700, 8, 2, {})),
    ("bf16 h64 m128 dqa deterministic causal gqa", dict(head_dim=64, tile_m=128,
                                                        is_causal=True, deterministic=True,
                                                        dq_arrive=True),
     (2, 500, 700, 8, 2, {})),
]
# `determinism`: (name, config kwargs, problem) run 10 times each, bitwise compared.
DETERMINISM = [
    ("deterministic causal gqa", dict(head_dim=128, is_causal=True, deterministic=True),
     (2, 1000, 1000, 8, 2, {})),
    ("deterministic window", dict(head_dim=64, has_window=True, deterministic=True),
     (2, 1000, 1000, 4, 1, {"window": (300, 0)})),
    ("default (atomic order) causal gqa", dict(head_dim=128, is_causal=True),
     (2, 1000, 1000, 8, 2, {})),
    ("deterministic causal gqa dqf", dict(head_dim=128, is_causal=True, deterministic=True,
                                          dq_flat=True), (2, 1000, 1000, 8, 2, {})),
    ("deterministic window m128", dict(head_dim=64, tile_m=128, has_window=True,
                                       deterministic=True),
     (2, 1000, 1000, 4, 1, {"window": (300, 0)})),
]
