"""A float64 NumPy model of jaxflash's documented semantics, forward and backward, written
independently of `jaxflash.reference` (loops over rows, no shared code): the oracle of the
tests in this directory.

Only what these tests use: causal, window, sequence lengths, dense bias, GQA. Non-finite
inputs follow the documented rules (see `jaxflash.flash_attention`): a masked pair never
contributes; a NaN logit makes the row NaN (LSE NaN); a +inf logit makes the row NaN with LSE
+inf; a -inf logit removes its key; a row with nothing left gives output 0 and LSE -inf.
"""
from __future__ import annotations

import numpy as np


def visible(T, S, *, is_causal=False, window=None, q_len=None, kv_len=None):
    """[T, S] bool: may query i attend key j (one batch row's lengths)."""
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    ok = np.ones((T, S), bool)
    if is_causal:
        ok &= j <= i
    if window is not None:
        ok &= (j >= i - window[0]) & (j <= i + window[1])
    if q_len is not None:
        ok &= i < q_len
    if kv_len is not None:
        ok &= j < kv_len
    return ok


def attention(q, k, v, bias=None, *, scale=None, is_causal=False, window=None,
              q_lens=None, kv_lens=None, dout=None):
    """q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv], bias [B,N,T,S] or None (all float64).

    Returns (out [B,T,N,Hv], lse [B,T,N]) and, when `dout` is given, also
    (dq, dk, dv, dbias) of sum(out * dout)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    _, S, K, Hv = v.shape
    G = N // K
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    out = np.zeros((B, T, N, Hv))
    lse = np.full((B, T, N), -np.inf)
    grads = dout is not None
    if grads:
        dout = np.asarray(dout, np.float64)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        dbias = np.zeros((B, N, T, S))
    with np.errstate(all="ignore"):
        for b in range(B):
            vis = visible(T, S, is_causal=is_causal, window=window,
                          q_len=None if q_lens is None else q_lens[b],
                          kv_len=None if kv_lens is None else kv_lens[b])
            for n in range(N):
                kh = n // G
                for i in range(T):
                    js = np.nonzero(vis[i])[0]
                    if js.size == 0:
                        continue
                    s = scale * (k[b, js, kh, :] @ q[b, i, n, :])
                    if bias is not None:
                        s = s + np.asarray(bias, np.float64)[b, n, i, js]
                    if np.isnan(s).any():
                        out[b, i, n] = np.nan
                        lse[b, i, n] = np.nan
                        continue
                    if np.isposinf(s).any():
                        out[b, i, n] = np.nan
                        lse[b, i, n] = np.inf
                        continue
                    live = s > -np.inf
                    if not live.any():
                        continue
                    js, s = js[live], s[live]
                    m = s.max()
                    p = np.exp(s - m)
                    l = p.sum()
                    p = p / l
                    out[b, i, n] = p @ v[b, js, kh, :]
                    lse[b, i, n] = m + np.log(l)
                    if grads:
                        do = dout[b, i, n]
                        dv[b, js, kh, :] += p[:, None] * do[None, :]
                        dp = v[b, js, kh, :] @ do
                        ds = p * (dp - do @ out[b, i, n])
                        dbias[b, n, i, js] += ds
                        dq[b, i, n] += scale * ds @ k[b, js, kh, :]
                        dk[b, js, kh, :] += scale * ds[:, None] * q[b, i, n][None, :]
    if grads:
        return out, lse, (dq, dk, dv, dbias)
    return out, lse
