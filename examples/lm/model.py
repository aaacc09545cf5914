"""A small decoder-only language model in Flax NNX on `jaxflash.flax_layers.FlashMultiHeadAttention`.

Pre-norm blocks (RMSNorm -> causal GQA attention with rotary embeddings -> RMSNorm -> SwiGLU MLP),
a separate output head (zero-mean, small init: the first loss is ~ln 256). Parameters carry mesh-axis annotations: attention heads and the MLP
hidden dim are split over the ``model`` axis (tensor parallelism), everything else is replicated;
the batch is split over ``data``. Create the model under ``jax.set_mesh(mesh)`` and Flax places
each parameter on the mesh as it is created.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflash.flax_layers import FlashMultiHeadAttention


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    seq_len: int = 128
    rope_theta: float = 10000.0
    local_window: Optional[int] = None   # sliding-window attention (left context), if set
    softcap: Optional[float] = None
    dtype: str = "float32"               # compute dtype; parameters are float32
    implementation: Optional[str] = None  # jaxflash backend: None = best available
    attention_precision: Optional[str] = None  # None (the compute dtype) or "fp8"

    def check_mesh(self, model_axis: int):
        for name, n in (("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads),
                        ("d_ff", self.d_ff)):
            if n % model_axis:
                raise ValueError(f"{name}={n} must be divisible by the mesh's model axis "
                                 f"({model_axis})")


SIZES = {
    # A few dozen steps on 2 CPU cores in well under 3 minutes.
    "tiny": LMConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq_len=64),
    "small": LMConfig(),
    # The GPU run: head_dim 64, bf16 compute, 1k context.
    "full": LMConfig(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1536, seq_len=1024,
                     dtype="bfloat16"),
}


def _sharded(init, *axes):
    return nnx.with_partitioning(init, axes)


class Block(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)
        self.norm1 = nnx.RMSNorm(cfg.d_model, dtype=dt, rngs=rngs)
        self.attn = FlashMultiHeadAttention(
            cfg.n_heads, cfg.d_model, num_kv_heads=cfg.n_kv_heads, is_causal=True, rope=True,
            rope_theta=cfg.rope_theta,
            local_window_size=None if cfg.local_window is None else (cfg.local_window, 0),
            softcap=cfg.softcap, implementation=cfg.implementation,
            attention_precision=cfg.attention_precision, use_bias=False, dtype=dt,
            kernel_init=_sharded(init, None, "model", None),
            out_kernel_init=_sharded(out_init, "model", None, None), rngs=rngs)
        self.norm2 = nnx.RMSNorm(cfg.d_model, dtype=dt, rngs=rngs)
        self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, dtype=dt,
                               kernel_init=_sharded(init, None, "model"), rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, dtype=dt,
                             kernel_init=_sharded(init, None, "model"), rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, dtype=dt,
                               kernel_init=_sharded(out_init, "model", None), rngs=rngs)

    def __call__(self, x, segment_ids=None, decode=False):
        x = x + self.attn(self.norm1(x), segment_ids=segment_ids, decode=decode)
        h = self.norm2(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class LM(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=jnp.dtype(cfg.dtype),
                               embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=jnp.dtype(cfg.dtype),
                               kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

    def __call__(self, tokens, segment_ids=None, decode=False):
        """tokens ``[B, T]`` int -> logits ``[B, T, vocab]`` float32."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids=segment_ids, decode=decode)
        x = self.norm(x)
        return self.head(x).astype(jnp.float32)

    def init_cache(self, batch_size: int, max_length: int):
        for block in self.blocks:
            block.attn.init_cache((batch_size, max_length, self.cfg.d_model),
                                  dtype=jnp.dtype(self.cfg.dtype))


def loss_fn(model: LM, tokens):
    """Mean next-token cross-entropy of ``tokens [B, T+1]``."""
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll)


def generate(model: LM, prompt, steps: int, *, temperature: float = 0.8, key=None):
    """Sample ``steps`` tokens after ``prompt [B, P]`` with the KV cache (prefill, then one token
    at a time). Returns ``[B, P + steps]``."""
    B, P = prompt.shape
    model.init_cache(B, P + steps)
    step = nnx.jit(lambda m, t: m(t, decode=True)[:, -1])
    key = jax.random.key(0) if key is None else key
    logits = step(model, prompt)
    out = [prompt]
    for i in range(steps):
        key, sub = jax.random.split(key)
        nxt = jax.random.categorical(sub, logits / temperature, axis=-1)[:, None].astype(jnp.int32)
        out.append(nxt)
        if i + 1 < steps:
            logits = step(model, nxt)
    return jnp.concatenate(out, axis=1)
