"""The forward's GPU check cases (`devrun check`): pure data, no DSL.

Each case is (name, `FwdConfig` kwargs, problem), problem = (B, T, S, N, K, extras); `devrun`
draws fresh random inputs for it and compares output and LSE with a float64 oracle (and cuDNN's
error on the same inputs). A feature's gate (`verified.RULES`) is cleared only once its cases
here pass on the GPU.
"""
from __future__ import annotations


# End-aligned 192-row persistent tiles (the check cases add the mask).
_MEND_PS = dict(head_dim=64, tile_m=192, persistent=True, m_align="end")

# Shorthands for the cases below: mask_select on causal, the paired persistent loop, the
# 64-row two-CTA tiles.
_SEL = dict(is_causal=True, mask_select=True)
_PAIRS = dict(persistent=True, tile_pipe=True, tile_order="pairs")
_C2_PAIRS = _PAIRS | dict(tile_m=64, ctas_per_sm=2, tile_n=64)
_M256 = dict(head_dim=64, tile_m=256, tile_n=64)

# (name, config kwargs, problem): problem = (B, T, S, N, K, extras); extras "repeat": n runs
# the same inputs n times and requires bitwise-equal O and LSE (`bitwise_equal`).
CHECKS = [
    ("bf16 h128 seqlens", dict(head_dim=128, has_q_seqlen=True, has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 17], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h64 tiny", dict(head_dim=64), (1, 128, 128, 1, 1, {})),
    ("bf16 h128 plain schedule", dict(head_dim=128, is_causal=True, intra_wg_overlap=False,
                                      pingpong=False), (2, 500, 600, 4, 2, {})),
    ("bf16 h64 causal window", dict(head_dim=64, is_causal=True, has_window=True),
     (2, 700, 700, 4, 4, {"window": (129, 0)})),
    ("bf16 h128 window", dict(head_dim=128, has_window=True),
     (2, 800, 800, 4, 2, {"window": (100, 37)})),
    ("bf16 h128 causal lpt8 gqa", dict(head_dim=128, is_causal=True, l2_section_mb=8),
     (2, 999, 999, 8, 2, {})),
    ("bf16 h128 causal persistent gqa", dict(head_dim=128, is_causal=True, persistent=True),
     (2, 777, 900, 8, 2, {})),
    ("fp16 h192 dense", dict(dtype="float16", head_dim=192), (1, 300, 333, 4, 1, {})),
    ("bf16 h128 dense gqa4 odd", dict(head_dim=128), (2, 1000, 1000, 8, 2, {})),
    # The 192-row tile WITH intra-warpgroup overlap (gated as unverified): never run on a GPU
    # for correctness; ptxas-clean at 160 registers since 2026-12-01 (fresh S fragment per
    # block, select-form mask). Every mask it compiles: seqlen (odd S), causal (T = S and
    # T < S), lengths (an empty key row), window + softcap (the left bound).
    ("bf16 h64 m192 dense", dict(head_dim=64, tile_m=192), (2, 500, 700, 6, 2, {})),
    ("bf16 h64 m192 causal", dict(head_dim=64, tile_m=192, is_causal=True),
     (2, 700, 700, 4, 4, {})),
    ("bf16 h64 m192 causal gqa T<S", dict(head_dim=64, tile_m=192, is_causal=True),
     (2, 900, 1100, 6, 2, {})),
    ("fp16 h64 m192 seqlens", dict(dtype="float16", head_dim=64, tile_m=192, has_q_seqlen=True,
                                   has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 17], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h64 m192 causal seqlens", dict(head_dim=64, tile_m=192, is_causal=True,
                                          has_q_seqlen=True, has_kv_seqlen=True),
     (2, 1000, 1000, 4, 1, {"q_seqlen": [1000, 383], "kv_seqlen": [777, 1000]})),
    ("fp16 h64 m192 window softcap", dict(dtype="float16", head_dim=64, tile_m=192,
                                          has_window=True, has_softcap=True),
     (2, 800, 900, 4, 2, {"window": (100, 37), "softcap": 30.0})),
    # The 192-row tile without intra-warpgroup overlap (1.08x cuDNN at D=64 S=16k dense on
    # 2026-11-30, never checked for correctness until the next run):
    ("bf16 h64 m192 no-overlap dense gqa", dict(head_dim=64, tile_m=192, intra_wg_overlap=False),
     (2, 900, 1100, 6, 2, {})),
    ("bf16 h64 m192 no-overlap causal", dict(head_dim=64, tile_m=192, intra_wg_overlap=False,
                                             is_causal=True), (2, 1000, 1000, 4, 4, {})),
    ("fp16 h64 m192 no-overlap seqlens", dict(dtype="float16", head_dim=64, tile_m=192,
                                              intra_wg_overlap=False, has_q_seqlen=True,
                                              has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 17], "kv_seqlen": [400, 0, 255]})),
    # Wider key tiles at 128 rows with a fresh S fragment per block (`fresh_s`; all 8 passed
    # on the H200 on 2026-12-01): hd 128 x 160, hd 64 x 192, hd 256 causal x 80.
    # Key lengths are never a multiple of the tile; GQA; causal T < S; an empty key length.
    ("bf16 h128 n160 dense gqa odd", dict(head_dim=128, tile_n=160, fresh_s=True),
     (2, 1000, 1100, 8, 2, {})),
    ("bf16 h128 n160 causal gqa T<S", dict(head_dim=128, tile_n=160, fresh_s=True,
                                           is_causal=True), (2, 900, 1000, 6, 2, {})),
    ("fp16 h128 n160 seqlens", dict(dtype="float16", head_dim=128, tile_n=160, fresh_s=True,
                                    has_q_seqlen=True, has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 17], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h64 n192 dense gqa odd", dict(head_dim=64, tile_n=192, fresh_s=True),
     (2, 500, 700, 6, 2, {})),
    ("bf16 h64 n192 causal gqa T<S", dict(head_dim=64, tile_n=192, fresh_s=True, is_causal=True),
     (2, 900, 1100, 6, 2, {})),
    ("fp16 h64 n192 seqlens", dict(dtype="float16", head_dim=64, tile_n=192, fresh_s=True,
                                   has_q_seqlen=True, has_kv_seqlen=True),
     (3, 300, 400, 4, 2, {"q_seqlen": [300, 131, 17], "kv_seqlen": [400, 0, 255]})),
    ("bf16 h256 n80 causal gqa T<S", dict(head_dim=256, tile_n=80, fresh_s=True, is_causal=True),
     (2, 650, 730, 4, 2, {})),
    ("fp16 h256 n80 causal seqlens", dict(dtype="float16", head_dim=256, tile_n=80,
                                          fresh_s=True, is_causal=True, has_q_seqlen=True,
                                          has_kv_seqlen=True),
     (3, 300, 410, 4, 2, {"q_seqlen": [300, 131, 17], "kv_seqlen": [410, 0, 255]})),
    ("bf16 h64 persistent causal", dict(head_dim=64, is_causal=True, persistent=True),
     (3, 1000, 1000, 4, 2, {})),
    ("bf16 h256 causal tile_n 64", dict(head_dim=256, is_causal=True), (2, 700, 700, 2, 1, {})),
    # ALiBi and segment ids (added 2026-11-30 evening, not yet run on a GPU):
    ("bf16 h128 alibi", dict(head_dim=128, has_alibi=True), (2, 300, 457, 4, 4, {"alibi": 1})),
    ("bf16 h128 alibi causal gqa", dict(head_dim=128, has_alibi=True, is_causal=True),
     (2, 555, 555, 8, 2, {"alibi": 1})),
    ("fp16 h64 alibi softcap window", dict(dtype="float16", head_dim=64, has_alibi=True,
                                           has_softcap=True, has_window=True),
     (1, 400, 500, 4, 1, {"alibi": 1, "softcap": 30.0, "window": (100, 50)})),
    # batch 0: query segment 2 (250 rows) and batch 1: segment 6 (1 row) meet no key.
    ("bf16 h128 segments", dict(head_dim=128, has_segments=True),
     (2, 700, 650, 4, 2, {"q_segs": [[(0, 100), (1, 37), (2, 250), (3, 313)], [(5, 699), (6, 1)]],
                          "kv_segs": [[(0, 100), (1, 37), (3, 513)], [(5, 650)]]})),
    ("bf16 h128 segments causal", dict(head_dim=128, has_segments=True, is_causal=True),
     (2, 1000, 1000, 8, 2, {"q_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]],
                            "kv_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]]})),
    # Everything at once at the register-heaviest point (also what tests/test_kernels_hopper_gpu
    # runs through the API): packed documents, a query document without keys, causal, GQA.
    ("bf16 h128 alibi segments causal gqa", dict(head_dim=128, has_alibi=True,
                                                 has_segments=True, is_causal=True),
     (2, 700, 700, 8, 2, {"alibi": 1,
                          "q_segs": [[(0, 1), (1, 300), (2, 129), (3, 270)], [(5, 650), (9, 50)]],
                          "kv_segs": [[(0, 1), (1, 300), (2, 129), (3, 270)],
                                      [(5, 650), (6, 50)]]})),
    # Unsorted ids (no block can be skipped; every block takes the element compare) with ALiBi,
    # key lengths (one 0) and GQA.
    ("bf16 h64 segments random alibi kvlen", dict(head_dim=64, has_segments=True, has_alibi=True,
                                                  has_kv_seqlen=True),
     (3, 333, 444, 4, 2, {"random_segs": 3, "alibi": 1, "kv_seqlen": [444, 200, 0]})),
    ("bf16 h256 segments causal alibi", dict(head_dim=256, has_segments=True, is_causal=True,
                                             has_alibi=True),
     (1, 600, 600, 2, 1, {"alibi": 1, "q_segs": [[(0, 200), (1, 400)]],
                          "kv_segs": [[(0, 200), (1, 400)]]})),
    # Persistent forward (added 2026-12-01, not yet run on a GPU). Every case has more tiles
    # than the 132 CTAs, so CTAs loop (2-3 tiles each, unequal counts). "persistent" itself
    # changed (zero-filled S before its zero-init GEMM, so ptxas no longer serializes hdim
    # 128 dense / 256); "persist2" adds the tile pipe (coordinates through shared memory).
    ("bf16 h128 persistent dense gqa odd", dict(head_dim=128, persistent=True),
     (2, 1000, 1111, 12, 4, {})),
    ("bf16 h256 persistent dense gqa", dict(head_dim=256, persistent=True),
     (2, 700, 650, 12, 4, {})),
    ("bf16 h128 persist2 dense gqa odd", dict(head_dim=128, persistent=True, tile_pipe=True),
     (2, 1000, 1111, 12, 4, {})),
    ("bf16 h128 persist2 causal gqa", dict(head_dim=128, is_causal=True, persistent=True,
                                           tile_pipe=True), (2, 999, 999, 12, 3, {})),
    ("bf16 h64 persist2 dense gqa", dict(head_dim=64, persistent=True, tile_pipe=True),
     (3, 1000, 777, 8, 2, {})),
    ("bf16 h64 persist2 causal", dict(head_dim=64, is_causal=True, persistent=True,
                                      tile_pipe=True), (3, 1000, 1000, 8, 8, {})),
    ("bf16 h256 persist2 dense gqa", dict(head_dim=256, persistent=True, tile_pipe=True),
     (2, 700, 650, 12, 4, {})),
    ("bf16 h256 persist2 causal", dict(head_dim=256, is_causal=True, persistent=True,
                                       tile_pipe=True), (2, 700, 700, 12, 2, {})),
    ("fp16 h128 persist2 seqlens", dict(dtype="float16", head_dim=128, persistent=True,
                                        tile_pipe=True, has_q_seqlen=True, has_kv_seqlen=True),
     (3, 1000, 1000, 8, 2, {"q_seqlen": [1000, 131, 17], "kv_seqlen": [1000, 0, 255]})),
    # 192-row tiles on the persistent loop (hd 64; checked on the H200 2026-12-01): more
    # tiles than CTAs (6 x 24 / 6 x 64 heads), T not a multiple of 192, GQA, causal, lengths.
    ("bf16 h64 m192 persistent dense gqa", dict(head_dim=64, tile_m=192, persistent=True),
     (4, 1000, 1100, 12, 4, {})),
    ("bf16 h64 m192 persistent causal", dict(head_dim=64, tile_m=192, persistent=True,
                                             is_causal=True), (8, 1000, 1000, 8, 8, {})),
    # (the two above passed on the H200, 2026-12-01 11:58 UTC; m192_ps then won at hd 64
    # S = 1k dense / causal and 4k causal.) Lengths (one key length 0, rows past q_seqlen),
    # causal GQA with T < S, window + softcap in fp16, and the tile pipe on top.
    ("fp16 h64 m192 persistent seqlens", dict(dtype="float16", head_dim=64, tile_m=192,
                                              persistent=True, has_q_seqlen=True,
                                              has_kv_seqlen=True),
     (5, 1000, 1000, 8, 2, {"q_seqlen": [1000, 131, 17, 999, 500],
                            "kv_seqlen": [1000, 0, 255, 999, 700]})),
    ("bf16 h64 m192 persistent causal gqa T<S", dict(head_dim=64, tile_m=192, persistent=True,
                                                     is_causal=True),
     (6, 700, 1300, 12, 3, {})),
    ("fp16 h64 m192 persistent window softcap", dict(dtype="float16", head_dim=64, tile_m=192,
                                                     persistent=True, has_window=True,
                                                     has_softcap=True),
     (6, 1000, 1000, 8, 4, {"softcap": 30.0, "window": (200, 0)})),
    ("bf16 h64 m192 persist2 causal", dict(head_dim=64, tile_m=192, persistent=True,
                                           tile_pipe=True, is_causal=True),
     (8, 1000, 1000, 8, 8, {})),
    # wg_epilogue (gated until these pass): each warpgroup stores its own 64 rows and moves
    # on. More tiles than CTAs, GQA, odd lengths (the TMA clips each half), causal, lengths
    # with an empty key length (rows past q_seqlen), 192-row tiles (3 warpgroups) with the
    # end-aligned first tile, and bitwise repeats (a half stored late would show).
    ("bf16 h128 we dense gqa odd", dict(head_dim=128, persistent=True, tile_pipe=True,
                                        wg_epilogue=True), (2, 1000, 1111, 12, 4, {"repeat": 3})),
    ("bf16 h128 we causal gqa", dict(head_dim=128, is_causal=True, persistent=True,
                                     tile_pipe=True, wg_epilogue=True), (2, 999, 999, 12, 3, {})),
    ("fp16 h128 we seqlens", dict(dtype="float16", head_dim=128, persistent=True,
                                  tile_pipe=True, has_q_seqlen=True, has_kv_seqlen=True,
                                  wg_epilogue=True),
     (3, 1000, 1000, 8, 2, {"q_seqlen": [1000, 131, 17], "kv_seqlen": [1000, 0, 255]})),
    ("bf16 h64 m192 we causal mend", dict(head_dim=64, tile_m=192, persistent=True,
                                          is_causal=True, m_align="end", wg_epilogue=True),
     (4, 1000, 1000, 8, 8, {"repeat": 3})),
    ("bf16 h64 m192 we dense gqa", dict(head_dim=64, tile_m=192, persistent=True,
                                        wg_epilogue=True), (4, 1000, 1100, 12, 4, {})),
    # tile_order "pairs" (gated until these pass): a CTA takes tile m and tile nm - 1 - m of a
    # head; the producer skips the empty slot of an odd nm's middle tile. More tiles than CTAs
    # (CTAs loop), odd and even nm (5: T = 640; 8), GQA, T < S and T > S, window, lengths with
    # an empty query length, fp16, 192-row tiles (end-aligned too), hd 96 / 256, bitwise
    # repeats, a 2k case against cuDNN's error.
    ("bf16 h128 pairs causal gqa", dict(head_dim=128, is_causal=True, persistent=True,
                                        tile_pipe=True, wg_epilogue=True, tile_order="pairs"),
     (4, 999, 999, 12, 3, {"repeat": 2})),
    ("bf16 h128 pairs causal odd nm", dict(head_dim=128, is_causal=True, persistent=True,
                                           tile_pipe=True, tile_order="pairs"),
     (5, 640, 640, 12, 4, {})),
    ("bf16 h128 pairs causal 2k", dict(head_dim=128, is_causal=True, persistent=True,
                                       tile_pipe=True, tile_order="pairs"),
     (2, 2048, 2048, 8, 8, {"cudnn": True})),
    ("bf16 h128 pairs causal T<S", dict(head_dim=128, is_causal=True, persistent=True,
                                        tile_pipe=True, wg_epilogue=True, tile_order="pairs"),
     (3, 700, 1500, 12, 4, {})),
    ("bf16 h128 pairs causal T>S", dict(head_dim=128, is_causal=True, persistent=True,
                                        tile_pipe=True, tile_order="pairs"),
     (4, 1500, 300, 12, 4, {})),
    ("fp16 h128 pairs window seqlens", dict(dtype="float16", head_dim=128, has_window=True,
                                            has_q_seqlen=True, has_kv_seqlen=True,
                                            persistent=True, tile_pipe=True,
                                            tile_order="pairs"),
     (3, 1000, 1000, 8, 2, {"window": (200, 0), "q_seqlen": [1000, 131, 0],
                            "kv_seqlen": [1000, 0, 255]})),
    ("bf16 h64 m192 pairs causal", dict(head_dim=64, tile_m=192, is_causal=True,
                                        persistent=True, tile_pipe=True, wg_epilogue=True,
                                        tile_order="pairs"), (8, 1000, 1000, 8, 8, {})),
    ("bf16 h64 m192 pairs mend causal", dict(head_dim=64, tile_m=192, is_causal=True,
                                             persistent=True, tile_pipe=True, m_align="end",
                                             wg_epilogue=True, tile_order="pairs"),
     (8, 1000, 1000, 8, 8, {"repeat": 2})),
    ("bf16 h96 pairs causal gqa odd", dict(head_dim=96, is_causal=True, persistent=True,
                                           tile_pipe=True, tile_order="pairs"),
     (3, 777, 801, 12, 4, {})),
    ("bf16 h256 pairs causal", dict(head_dim=256, is_causal=True, persistent=True,
                                    tile_pipe=True, tile_order="pairs"),
     (4, 1000, 1000, 8, 8, {})),
    # 64-row tiles at two CTAs per SM (gated until these pass): one consumer warpgroup per
    # CTA. Persistent (grid 2 x SMs) and not, one stage of 128 keys and two of 64, GQA, odd
    # lengths, T < S, pairs, window with lengths (empty rows), softcap, fp16, hd 64 / 96 /
    # 128, bitwise repeats, 2k against cuDNN.
    ("bf16 h128 m64c2 ps dense gqa odd", dict(head_dim=128, tile_m=64, ctas_per_sm=2,
                                              num_stages=1, persistent=True, tile_pipe=True),
     (2, 1000, 1111, 12, 4, {"repeat": 2})),
    ("bf16 h128 m64c2 n64 ps dense", dict(head_dim=128, tile_m=64, ctas_per_sm=2, tile_n=64,
                                          persistent=True, tile_pipe=True),
     (4, 999, 999, 8, 8, {})),
    ("bf16 h128 m64c2 ps pairs causal", dict(head_dim=128, tile_m=64, ctas_per_sm=2,
                                             num_stages=1, is_causal=True, persistent=True,
                                             tile_pipe=True, tile_order="pairs"),
     (4, 1000, 1000, 8, 8, {})),
    ("bf16 h128 m64c2 causal T<S", dict(head_dim=128, tile_m=64, ctas_per_sm=2, num_stages=1,
                                        is_causal=True), (3, 700, 1500, 12, 4, {})),
    ("fp16 h128 m64c2 ps window seqlens", dict(dtype="float16", head_dim=128, tile_m=64,
                                               ctas_per_sm=2, num_stages=1, has_window=True,
                                               has_q_seqlen=True, has_kv_seqlen=True,
                                               persistent=True, tile_pipe=True),
     (3, 1000, 1000, 8, 2, {"window": (200, 0), "q_seqlen": [1000, 131, 0],
                            "kv_seqlen": [1000, 0, 255]})),
    ("bf16 h128 m64c2 ps softcap causal", dict(head_dim=128, tile_m=64, ctas_per_sm=2,
                                               num_stages=1, is_causal=True, has_softcap=True,
                                               persistent=True, tile_pipe=True),
     (2, 600, 600, 8, 4, {"softcap": 30.0})),
    ("bf16 h64 m64c2 ps dense 2k", dict(head_dim=64, tile_m=64, ctas_per_sm=2,
                                        persistent=True, tile_pipe=True),
     (2, 2048, 2048, 16, 16, {"cudnn": True})),
    ("bf16 h64 m64c2 ps pairs causal odd", dict(head_dim=64, tile_m=64, ctas_per_sm=2,
                                                is_causal=True, persistent=True,
                                                tile_pipe=True, tile_order="pairs"),
     (3, 777, 801, 12, 4, {})),
    ("bf16 h96 m64c2 ps causal", dict(head_dim=96, tile_m=64, ctas_per_sm=2, num_stages=1,
                                      is_causal=True, persistent=True, tile_pipe=True),
     (2, 600, 600, 8, 8, {})),
    # The two-CTA picks exactly (64-key stages with paired causal tiles; picked 2026-12-01 on
    # the checks above, which cover their parts, the API suite and the grid's output checks).
    ("bf16 h128 m64c2 n64 ps pairs causal odd", dict(head_dim=128, tile_m=64, ctas_per_sm=2,
                                                     tile_n=64, is_causal=True, persistent=True,
                                                     tile_pipe=True, tile_order="pairs"),
     (3, 777, 801, 12, 4, {"repeat": 2})),
    ("bf16 h64 m64c2 n64 ps pairs causal 1k", dict(head_dim=64, tile_m=64, ctas_per_sm=2,
                                                   tile_n=64, is_causal=True, persistent=True,
                                                   tile_pipe=True, tile_order="pairs"),
     (2, 1024, 1024, 16, 8, {"cudnn": True})),
    # Three K / V stages on the persistent loop at dense 1k (passed 2026-12-02, no gain, not
    # picked): hd 128 with O in Q's buffer (225 KB), hd 64's 192-row tile with its own O.
    ("bf16 h128 ps s3 dense gqa odd", dict(head_dim=128, persistent=True, tile_pipe=True,
                                           num_stages=3), (2, 1000, 1111, 12, 4, {})),
    ("bf16 h64 m192 ps s3 dense odd", dict(head_dim=64, tile_m=192, persistent=True,
                                           num_stages=3), (3, 777, 801, 12, 4, {})),
    # mask_skip (passed 2026-12-02, cleared): blocks only the key length can cut are compared
    # only when they reach past it. Key lengths a multiple of the tile (skipped) and not,
    # per-batch lengths (some full, one empty), T > S, the dense picks of hd 64 / 128 / 256
    # and the two-CTA tile, 1k against cuDNN.
    ("bf16 h128 ps we msk dense 1k", dict(head_dim=128, persistent=True, tile_pipe=True,
                                          wg_epilogue=True, mask_skip=True),
     (4, 1024, 1024, 8, 8, {"cudnn": True, "repeat": 2})),
    ("bf16 h128 msk dense gqa odd", dict(head_dim=128, mask_skip=True),
     (2, 1000, 1111, 12, 4, {})),
    ("fp16 h128 msk seqlens", dict(dtype="float16", head_dim=128, has_q_seqlen=True,
                                   has_kv_seqlen=True, mask_skip=True),
     (3, 1024, 1024, 8, 2, {"q_seqlen": [1024, 131, 0], "kv_seqlen": [1024, 0, 255]})),
    ("bf16 h64 m192 ps msk dense T>S", dict(head_dim=64, tile_m=192, persistent=True,
                                            mask_skip=True), (2, 1100, 768, 8, 8, {})),
    ("bf16 h256 ps msk dense odd", dict(head_dim=256, persistent=True, tile_pipe=True,
                                        mask_skip=True), (2, 700, 777, 8, 4, {})),
    ("bf16 h64 m64c2 n64 ps msk dense", dict(head_dim=64, tile_m=64, ctas_per_sm=2, tile_n=64,
                                             persistent=True, tile_pipe=True, mask_skip=True),
     (2, 1024, 1024, 8, 8, {})),
    # lazy_rescale (gated until these pass): FA4's conditional O rescale. "k_ramp" makes the
    # logits grow toward earlier keys by up to ~k_ramp x, so rows move their reference max
    # block after block (the rescale path) while plain random inputs mostly skip it.
    ("bf16 h128 lazy dense gqa odd", dict(head_dim=128, lazy_rescale=True),
     (2, 1000, 1111, 12, 4, {})),
    ("bf16 h128 lazy dense ramp", dict(head_dim=128, lazy_rescale=True),
     (2, 700, 2000, 8, 8, {"k_ramp": 6.0, "cudnn": True})),
    ("bf16 h128 lazy causal gqa T<S ramp", dict(head_dim=128, is_causal=True,
                                                lazy_rescale=True),
     (2, 500, 900, 8, 2, {"k_ramp": 4.0})),
    ("fp16 h128 lazy window softcap seqlens", dict(dtype="float16", head_dim=128,
                                                   has_window=True, has_softcap=True,
                                                   has_q_seqlen=True, has_kv_seqlen=True,
                                                   lazy_rescale=True),
     (3, 600, 700, 4, 2, {"softcap": 30.0, "window": (200, 0), "q_seqlen": [600, 131, 17],
                          "kv_seqlen": [700, 0, 255]})),
    ("bf16 h64 m192 lazy ps mend causal", dict(head_dim=64, tile_m=192, persistent=True,
                                               is_causal=True, m_align="end",
                                               wg_epilogue=True, lazy_rescale=True),
     (4, 1000, 1000, 8, 8, {"k_ramp": 5.0, "repeat": 2})),
    ("bf16 h256 lazy causal ramp", dict(head_dim=256, is_causal=True, lazy_rescale=True),
     (2, 700, 700, 8, 4, {"k_ramp": 4.0})),
    ("bf16 h128 lazy causal alibi seg", dict(head_dim=128, is_causal=True,
                                                   has_alibi=True, has_segments=True,
                                                   lazy_rescale=True),
     (2, 600, 600, 4, 2, {"alibi": 1, "random_segs": 3, "k_ramp": 4.0})),
    # End-aligned query tiles v2 (m_align="end", clamped: tile 0 starts at row 0 and recomputes
    # rows [tile_m - shift, tile_m) that tile 1 owns; gated, never run on a GPU). T not a
    # multiple of the tile (1000: shift 152, 1024: 128, 1100: 52, 900: 60), more tiles than the
    # 132 CTAs, GQA, T < S, T > S, window (right bound > 0: tile 0's shared rows see keys past
    # tile 1's first block), an empty key length, T < tile_m (one tile, same as start-aligned).
    # "repeat": run the same inputs that many times and require bitwise-equal O and LSE: the
    # shared rows are stored by two CTAs in a racing order, so values that differ between
    # the two tiles would show up as run-to-run differences (bitwise_equal false -> not ok).
    ("bf16 h64 m192 ps mend causal 1000", _MEND_PS | dict(is_causal=True),
     (4, 1000, 1000, 8, 8, {"repeat": 5})),
    ("bf16 h64 m192 ps mend causal 1024 gqa", _MEND_PS | dict(is_causal=True),
     (3, 1024, 1024, 16, 4, {"repeat": 5})),
    ("bf16 h64 m192 ps mend causal gqa T<S", _MEND_PS | dict(is_causal=True),
     (6, 900, 1100, 12, 3, {})),
    ("bf16 h64 m192 ps mend causal T>S", _MEND_PS | dict(is_causal=True),
     (3, 1100, 700, 8, 2, {})),
    ("bf16 h64 m192 ps mend window", _MEND_PS | dict(has_window=True),
     (4, 1000, 1000, 8, 4, {"window": (150, 37), "repeat": 5})),
    ("bf16 h64 m192 ps mend causal window", _MEND_PS | dict(is_causal=True, has_window=True),
     (4, 1000, 1000, 8, 4, {"window": (200, 0)})),
    ("fp16 h64 m192 ps mend causal kvlens", _MEND_PS | dict(dtype="float16", is_causal=True,
                                                           has_kv_seqlen=True),
     (3, 1000, 1000, 8, 2, {"kv_seqlen": [1000, 0, 333], "repeat": 5})),
    ("bf16 h64 m192 mend causal 1000", dict(head_dim=64, tile_m=192, is_causal=True,
                                            m_align="end"),
     (2, 1000, 1000, 4, 4, {"repeat": 5})),
    ("bf16 h128 mend causal gqa 1000", dict(head_dim=128, is_causal=True, m_align="end"),
     (2, 1000, 1000, 8, 2, {"repeat": 5})),
    ("bf16 h64 m192 ps mend causal T=100", _MEND_PS | dict(is_causal=True),
     (2, 100, 100, 4, 2, {})),
    # mask_select (passed 2026-12-02, cleared): one select per score on masked blocks. The causal
    # picks it would join (two-CTA 1k at hd 64 / 128, pairs at hd 128 / 256, the default at
    # 16k), T < S, softcap, a window with per-batch lengths (empty rows), the key-length tail
    # of a dense call, hd 96, fp16.
    ("bf16 h128 m64c2 n64 ps pairs sel causal 1k", _C2_PAIRS | dict(head_dim=128, **_SEL),
     (4, 1024, 1024, 8, 8, {"cudnn": True, "repeat": 2})),
    ("bf16 h64 m64c2 n64 ps pairs sel causal odd", _C2_PAIRS | dict(head_dim=64, **_SEL),
     (2, 1000, 1000, 8, 4, {})),
    ("bf16 h128 ps pairs sel causal T<S", _PAIRS | dict(head_dim=128, **_SEL),
     (2, 700, 1200, 8, 2, {})),
    ("bf16 h256 ps pairs sel causal odd", _PAIRS | dict(head_dim=256, **_SEL),
     (2, 700, 777, 8, 4, {})),
    ("bf16 h128 sel causal gqa odd", dict(head_dim=128, **_SEL), (2, 1000, 1111, 12, 4, {})),
    ("bf16 h128 sel causal softcap", dict(head_dim=128, has_softcap=True, **_SEL),
     (2, 800, 800, 4, 2, {"softcap": 30.0})),
    ("fp16 h128 sel window seqlens", dict(dtype="float16", head_dim=128, has_window=True,
                                          has_q_seqlen=True, has_kv_seqlen=True,
                                          mask_select=True),
     (3, 1000, 1000, 8, 2, {"window": (200, 37), "q_seqlen": [1000, 131, 0],
                            "kv_seqlen": [1000, 0, 255]})),
    ("fp16 h128 sel dense kv tail", dict(dtype="float16", head_dim=128, mask_select=True),
     (2, 1000, 1111, 8, 8, {})),
    ("bf16 h96 sel causal", dict(head_dim=96, **_SEL), (2, 600, 600, 4, 4, {})),
    # (added after the run that cleared it: hd 192, before dispatch picks it there)
    ("fp16 h192 sel causal gqa odd", dict(dtype="float16", head_dim=192, **_SEL),
     (2, 700, 777, 8, 2, {})),
    # The plain calls' schedules on masked calls (`choose.schedule_for`, `feat_bench`: windows
    # and key lengths get them since 2026-12-02): each schedule with a window or lengths
    # together (the cases above cover them a feature at a time).
    ("fp16 h128 ps msk seqlens", dict(dtype="float16", head_dim=128, persistent=True,
                                      tile_pipe=True, mask_skip=True, has_q_seqlen=True,
                                      has_kv_seqlen=True),
     (3, 1000, 1000, 8, 2, {"q_seqlen": [1000, 131, 0], "kv_seqlen": [1000, 0, 255]})),
    ("bf16 h128 ps msk window", dict(head_dim=128, persistent=True, tile_pipe=True,
                                     mask_skip=True, has_window=True),
     (2, 1000, 1111, 8, 4, {"window": (200, 150)})),
    ("fp16 h128 ps pairs sel causal kvlens", _PAIRS | dict(dtype="float16", head_dim=128,
                                                           has_kv_seqlen=True, **_SEL),
     (3, 1000, 1000, 8, 2, {"kv_seqlen": [1000, 0, 255]})),
    ("bf16 h256 ps pairs sel causal window", _PAIRS | dict(head_dim=256, has_window=True,
                                                           **_SEL),
     (2, 700, 777, 8, 4, {"window": (300, 0)})),
    ("fp16 h64 c2 pairs sel causal window kvlens", _C2_PAIRS | dict(
        dtype="float16", head_dim=64, has_window=True, has_kv_seqlen=True, **_SEL),
     (3, 1000, 1000, 8, 2, {"window": (200, 0), "kv_seqlen": [1000, 0, 255]})),
    ("bf16 h64 m192 ps causal kvlens", dict(head_dim=64, tile_m=192, persistent=True,
                                            is_causal=True, has_kv_seqlen=True),
     (3, 1000, 1000, 8, 8, {"kv_seqlen": [1000, 0, 255]})),
    # 256-row tiles, hd 64 (four consumer warpgroups; gated until these pass): dense
    # (persistent, odd lengths, 1k against cuDNN with repeats, T > S with mask_skip, a call
    # shorter than one tile), causal pairs with mask_select, causal T < S off the persistent
    # loop, fp16 with a window and lengths (empty rows).
    ("bf16 h64 m256 ps dense gqa odd", _M256 | dict(persistent=True, tile_pipe=True),
     (2, 1000, 1111, 12, 4, {})),
    ("bf16 h64 m256 ps dense 1k", _M256 | dict(persistent=True, tile_pipe=True),
     (4, 1024, 1024, 8, 8, {"cudnn": True, "repeat": 2})),
    ("bf16 h64 m256 ps msk dense T>S", _M256 | dict(persistent=True, tile_pipe=True,
                                                   mask_skip=True), (2, 1100, 768, 8, 8, {})),
    ("bf16 h64 m256 dense tiny", _M256, (1, 100, 130, 1, 1, {})),
    ("bf16 h64 m256 ps pairs sel causal odd", _M256 | _PAIRS | _SEL, (2, 1000, 1000, 8, 4, {})),
    ("bf16 h64 m256 causal gqa T<S", _M256 | _SEL, (2, 700, 1200, 8, 2, {})),
    ("fp16 h64 m256 window seqlens", _M256 | dict(dtype="float16", has_window=True,
                                                  has_q_seqlen=True, has_kv_seqlen=True,
                                                  mask_select=True),
     (3, 1000, 1000, 8, 2, {"window": (200, 37), "q_seqlen": [1000, 131, 0],
                            "kv_seqlen": [1000, 0, 255]})),
]
