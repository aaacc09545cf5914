"""Flax integration (import it as `jaxflash.flax_layers`): `attention_fn` for Flax's own attention
modules, and `FlashMultiHeadAttention` layers for NNX (`nnx_attention`) and Linen
(`linen_attention`). `core` holds what both layers share and needs no Flax."""
