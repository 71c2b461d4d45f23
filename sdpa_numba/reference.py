"""Plain NumPy attention in float64: the reference for tests, docs and the CLI's check.

It builds the full L x S score matrix on purpose (clarity over memory): use it on small inputs.
Semantics are those of :func:`sdpa_numba.scaled_dot_product_attention`.
"""

import math

import numpy as np


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Reference attention; returns ``(out, lse)`` in float64.

    Parameters
    ----------
    query, key, value : array_like
        ``(..., Hq, L, E)``, ``(..., H, S, E)``, ``(..., H, S, Ev)``; 2-D inputs are one head.
    attn_mask : array_like, optional
        bool (True takes part) or float (added), broadcastable to ``(..., Hq, L, S)``.
    is_causal : bool
        Query ``i`` sees keys ``j <= i``.
    scale : float, optional
        Defaults to ``1 / sqrt(E)``.
    enable_gqa : bool
        Query head ``h`` uses key/value head ``h // (Hq // H)``.

    Returns
    -------
    out : ndarray, float64, ``(..., Hq, L, Ev)``
    lse : ndarray, float64, ``(..., Hq, L)``; ``-inf`` for a row whose every key is masked,
        whose output row is then 0.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, rep, axis=-3)
        v = np.repeat(v, rep, axis=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if is_causal:
        L, S = s.shape[-2:]
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask.astype(np.float64)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_safe)
    l = np.sum(p, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.matmul(np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0), v)
        lse = (m_safe + np.log(l))[..., 0]
    return out, lse
