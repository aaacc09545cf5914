"""Backend implementations; `jaxflash.dispatch` is the one place that chooses among them."""
