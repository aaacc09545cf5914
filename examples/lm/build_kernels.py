"""Compile the CuTe DSL kernels a GPU run of the example needs, on any machine with the DSL.

    python -m examples.lm.build_kernels --out DIR --size full --batch 16 --mesh 1,1
    # then, on the GPU machine (no DSL needed there):
    JAXFLASH_KERNEL_DIR=DIR python -m examples.lm.train --size full --batch 16 --mesh 1,1 ...

Takes the training arguments (model size, batch, sequence length, window, softcap, mesh), works
out the per-shard attention call the model makes, asks the CuTe backend which forward and
backward kernel variants serve it (the same functions the bridge uses at lowering, so the keys
match) and builds them with `jaxflash.aot`. A call the CuTe kernels cannot serve is reported with
the reason (the run would then use the Pallas path for it).
"""
from __future__ import annotations

import argparse
import os
import sys


def attention_problem(args):
    """The per-device attention `Problem` of the model trained with `args` (train.py's)."""
    from examples.lm.train import config_from_args
    from jaxflash._types import AttentionStatics, Problem
    cfg = config_from_args(args)
    data, model = (1, 1) if args.mesh is None else (int(x) for x in args.mesh.split(","))
    if args.batch % data or cfg.n_heads % model or cfg.n_kv_heads % model:
        raise SystemExit(f"batch {args.batch} / heads {cfg.n_heads} / kv heads {cfg.n_kv_heads} "
                         f"do not split over mesh {args.mesh}")
    hd = cfg.d_model // cfg.n_heads
    statics = AttentionStatics(
        scale=hd ** -0.5, is_causal=True,
        window=None if cfg.local_window is None else (cfg.local_window, 0), softcap=cfg.softcap)
    return Problem(batch=args.batch // data, q_len=cfg.seq_len, kv_len=cfg.seq_len,
                   num_heads=cfg.n_heads // model, num_kv_heads=cfg.n_kv_heads // model,
                   head_dim=hd, head_dim_v=hd, dtype=cfg.dtype, statics=statics, platform="gpu")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="artifact directory (JAXFLASH_KERNEL_DIR)")
    p.add_argument("--arch", default=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    a, rest = p.parse_known_args(argv)
    os.environ["CUTE_DSL_ARCH"] = a.arch  # read by the DSL at import
    from examples.lm.train import parse_args
    from jaxflash import aot
    from jaxflash.kernels import plan
    problem = attention_problem(parse_args(rest))
    try:
        cplan = plan.plan(problem, a.arch)
    except NotImplementedError as e:
        print(f"forward: no CuTe kernel ({e})", file=sys.stderr)
        return 1
    print(cplan.note)
    launches = [cplan.fwd] + ([cplan.bwd] if cplan.bwd is not None else [])
    for launch in launches:
        print(f"  {launch.name}")
    counts = aot.build(launches, a.out, progress=False)
    print(f"{counts['built']} built, {counts['kept']} up to date in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
