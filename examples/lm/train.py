"""Train the example LM (model.py) on the bundled corpus (data.py).

    python -m examples.lm.train                       # short CPU run: prints backend and loss
    python -m examples.lm.train --size full --steps 2000 --batch 32 --mesh 1,1   # on a GPU
    python -m examples.lm.train --mesh 4,2 --ckpt-dir /tmp/lm   # data x model mesh, checkpoints

`jax.jit` with explicit in/out shardings over a (data, model) mesh: batch over ``data``, heads
and MLP hidden dim over ``model`` (see model.py). optax AdamW; orbax checkpoints (``--ckpt-dir``
resumes from the latest one; batches depend only on the step, so a resumed run continues
exactly as the uninterrupted one would).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import sys
import time

if __package__ in (None, ""):  # `python examples/lm/train.py`: make the repo root importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxflash
from examples.lm import data as data_lib
from examples.lm.model import LM, SIZES, LMConfig, generate, loss_fn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model preset")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--window", type=int, default=None, help="sliding-window attention (left)")
    p.add_argument("--softcap", type=float, default=None)
    p.add_argument("--implementation", choices=["cute", "pallas", "xla"], default=None,
                   help="jaxflash backend (default: best available)")
    p.add_argument("--attention-precision", choices=["bf16", "fp8"], default="bf16",
                   help="attention in the compute dtype (bf16: no change) or FP8 "
                        "(flash_attention precision='fp8')")
    p.add_argument("--mesh", default=None,
                   help="DATA,MODEL mesh shape (default: all devices on data, model 1)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="orbax checkpoints; resumes from the latest")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--sample", type=int, default=64,
                   help="bytes to generate with the KV cache at the end (0: none)")
    p.add_argument("--metrics-json", default=None, help="write the loss curve and speed here")
    p.add_argument("--die-after-step", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from_args(args) -> LMConfig:
    over = {k: v for k, v in dict(seq_len=args.seq_len, d_model=args.d_model,
                                  n_layers=args.layers, n_heads=args.heads,
                                  n_kv_heads=args.kv_heads, dtype=args.dtype,
                                  local_window=args.window, softcap=args.softcap).items()
            if v is not None}
    prec = None if args.attention_precision == "bf16" else args.attention_precision
    cfg = dataclasses.replace(SIZES[args.size], implementation=args.implementation,
                              attention_precision=prec, **over)
    if "d_model" in over and "d_ff" not in over:
        cfg = dataclasses.replace(cfg, d_ff=3 * cfg.d_model)
    return cfg


def make_mesh(spec):
    devices = jax.devices()
    if spec is None:
        shape = (len(devices), 1)
    else:
        try:
            shape = tuple(int(x) for x in spec.split(","))
            assert len(shape) == 2 and min(shape) > 0
        except (ValueError, AssertionError):
            raise SystemExit(f"--mesh must be DATA,MODEL (two positive ints); got {spec!r}")
    if shape[0] * shape[1] > len(devices):
        raise SystemExit(f"--mesh {shape} needs {shape[0] * shape[1]} devices; "
                         f"{len(devices)} present")
    devs = np.asarray(devices[:shape[0] * shape[1]]).reshape(shape)
    # Auto axes: XLA propagates the parameter shardings through the computation.
    return jax.sharding.Mesh(devs, ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_optimizer(args):
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.warmup),
                                               max(args.steps, args.warmup + 1), args.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=args.weight_decay))


def init_state(cfg: LMConfig, mesh, tx, seed: int):
    """(graphdef, params, opt_state), every array placed on `mesh` per the model's annotations."""
    with jax.set_mesh(mesh):
        model = LM(cfg, rngs=nnx.Rngs(seed))
        graphdef, params = nnx.split(model)
        param_sh = nnx.get_named_sharding(params, mesh)
        params = jax.device_put(params, param_sh)
        opt_state = jax.jit(tx.init, out_shardings=None)(params)
    return graphdef, params, opt_state


def make_train_step(graphdef, tx, state_sh, batch_sh):
    def step(params, opt_state, tokens):
        def loss_of(p):
            return loss_fn(nnx.merge(graphdef, p), tokens)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    repl = NamedSharding(batch_sh.mesh, P())
    return jax.jit(step, in_shardings=(*state_sh, batch_sh), out_shardings=(*state_sh, repl),
                   donate_argnums=(0, 1))


def describe_backend(cfg: LMConfig, batch: int, mesh) -> str:
    """`jaxflash.explain` for the attention call the model makes (one data shard's shapes)."""
    b = batch // mesh.shape["data"]
    hd = cfg.d_model // cfg.n_heads
    dt = jnp.dtype(cfg.dtype)
    q = jax.ShapeDtypeStruct((b, cfg.seq_len, cfg.n_heads, hd), dt)
    kv = jax.ShapeDtypeStruct((b, cfg.seq_len, cfg.n_kv_heads, hd), dt)
    window = None if cfg.local_window is None else (cfg.local_window, 0)
    return str(jaxflash.explain(q, kv, kv, is_causal=True, local_window_size=window,
                                softcap=cfg.softcap, implementation=cfg.implementation,
                                precision=cfg.attention_precision))


def _checkpoint_manager(path, save_every):
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(
        pathlib.Path(path).resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=save_every))


def train(args) -> dict:
    cfg = config_from_args(args)
    mesh = make_mesh(args.mesh)
    cfg.check_mesh(mesh.shape["model"])
    if args.batch % mesh.shape["data"]:
        raise SystemExit(f"--batch {args.batch} must be divisible by the data axis "
                         f"({mesh.shape['data']})")
    train_tokens, val_tokens = data_lib.load_tokens()
    tx = make_optimizer(args)
    graphdef, params, opt_state = init_state(cfg, mesh, tx, args.seed)
    state_sh = (jax.tree.map(lambda x: x.sharding, params),
                jax.tree.map(lambda x: x.sharding, opt_state))
    batch_sh = NamedSharding(mesh, P("data", None))
    step_fn = make_train_step(graphdef, tx, state_sh, batch_sh)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; mesh "
          f"data={mesh.shape['data']} model={mesh.shape['model']}; params {n_params / 1e6:.2f}M; "
          f"corpus {len(train_tokens) + len(val_tokens)} bytes")
    print(describe_backend(cfg, args.batch, mesh), flush=True)

    start = 0
    mgr = None
    if args.ckpt_dir:
        import orbax.checkpoint as ocp
        mgr = _checkpoint_manager(args.ckpt_dir, args.save_every)
        latest = mgr.latest_step()
        if latest is not None:
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                {"params": params, "opt_state": opt_state})
            restored = mgr.restore(latest, args=ocp.args.StandardRestore(abstract))
            params, opt_state = restored["params"], restored["opt_state"]
            start = latest
            print(f"resumed from checkpoint step {latest} in {args.ckpt_dir}")

    losses = {}
    tokens_per_step = args.batch * cfg.seq_len
    t_first, train_time = None, 0.0
    for step in range(start + 1, args.steps + 1):
        batch = jax.device_put(data_lib.batch(train_tokens, step, args.batch, cfg.seq_len,
                                              args.seed), batch_sh)
        t0 = time.perf_counter()
        params, opt_state, loss = step_fn(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        losses[step] = loss
        if t_first is None:
            t_first = True  # the first step holds the compile: not timed
        else:
            train_time += time.perf_counter() - t0
        if step % args.log_every == 0 or step == args.steps or step == start + 1:
            done = step - start - 1
            speed = (f"{done * tokens_per_step / train_time:,.0f} tok/s" if done and train_time
                     else "compiling")
            print(f"step {step:5d}  loss {loss:.4f}  ({speed})", flush=True)
        if mgr is not None:
            import orbax.checkpoint as ocp
            mgr.save(step, args=ocp.args.StandardSave({"params": params,
                                                       "opt_state": opt_state}))
            if args.die_after_step == step:
                mgr.wait_until_finished()
                print(f"killing myself after step {step} (test of resume)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    timed_steps = max(0, len(losses) - 1)
    tok_s = timed_steps * tokens_per_step / train_time if timed_steps and train_time else None
    if mgr is not None:
        mgr.wait_until_finished()
        mgr.close()

    model = nnx.merge(graphdef, params)
    val = float(jax.jit(loss_fn)(model, jnp.asarray(
        data_lib.batch(val_tokens, 0, args.batch, cfg.seq_len, args.seed + 1))))
    print(f"validation loss {val:.4f}" + (f"; {tok_s:,.0f} tokens/s" if tok_s else ""))
    sample = None
    if args.sample > 0:
        prompt = jnp.asarray(data_lib.encode("Anne was")[None])
        sample = data_lib.decode(generate(model, prompt, args.sample)[0])
        print(f"sample (KV-cache decoding): {sample!r}")
    result = {"config": dataclasses.asdict(cfg), "mesh": dict(mesh.shape),
              "backend": describe_backend(cfg, args.batch, mesh),
              "losses": {str(k): v for k, v in losses.items()}, "val_loss": val,
              "tokens_per_s": tok_s, "steps_timed": timed_steps, "sample": sample}
    if args.metrics_json:
        pathlib.Path(args.metrics_json).write_text(json.dumps(result, indent=1))
    return result


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
