"""The README's custom-attention example runs as pasted (after the usage example's setup of
q, k, v, at a smaller size; the kernels' agreement with the reference is test_pallas_mods')."""
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
    env = {"jax": jax, "jnp": jnp, "jaxflash": jaxflash, "q": q, "k": k, "v": k}
    exec(compile(block, "README.md custom attention", "exec"), env)
    d = np.asarray(env["dtable"])
    assert d.shape == (8, 129) and np.all(np.isfinite(d))
    # Relative distances -39..39 occur at T = S = 40 (columns 25..103): only they get gradient.
    assert np.abs(d[:, 25:104]).sum() > 0 and not d[:, :25].any() and not d[:, 104:].any()
