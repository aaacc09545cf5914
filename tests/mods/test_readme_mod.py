"""The README's custom-attention example runs as pasted (after the usage example's setup of
q, k, v, at a smaller size), on the Pallas kernels as on the reference, with equal results."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_custom_attention_example_runs():
    with open(README, encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    block = next(b for b in blocks if "score_mod=" in b)
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((1, 40, 8, 16)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((1, 40, 2, 16)).astype(np.float32))
    results = {}
    for impl in ("xla", "pallas"):
        code = block.replace("jaxflash.flash_attention(\n    q, k, v,",
                             f"jaxflash.flash_attention(\n    q, k, v, implementation={impl!r},")
        assert code != block
        env = {"jax": jax, "jnp": jnp, "jaxflash": jaxflash, "q": q, "k": k, "v": k}
        exec(compile(code, "README.md custom attention", "exec"), env)
        results[impl] = env["dtable"]
    assert results["xla"].shape == (8, 129) and float(jnp.abs(results["xla"]).sum()) > 0
    np.testing.assert_allclose(results["pallas"], results["xla"], rtol=2e-4, atol=2e-5)
