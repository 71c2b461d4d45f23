"""Plain NumPy attention in float64: the reference for tests, docs and the CLI's check.

It builds the full L x S score matrix on purpose (clarity over memory): use it on small inputs.
Semantics are those of :func:`sdpa_numba.scaled_dot_product_attention`.
"""

import math

import numpy as np

from ._typing import F64, ArrayLike
from .problem.reductions import sum_to


def _scores(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """float64 operands (key/value heads repeated for GQA), the scale, the GQA repeat factor,
    and the masked, scaled scores."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    rep = 1
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
    return q, k, v, scale, rep, s


def attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
              attn_mask: ArrayLike | None = None, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> tuple[F64, F64]:
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
    q, k, v, scale, _, s = _scores(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_safe)
    l = np.sum(p, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.matmul(np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0), v)
        lse = (m_safe + np.log(l))[..., 0]
    return out, lse


def _train_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed):
    """Everything the training references need, in float64 with explicit broadcasting."""
    from .dropout import keep_mask

    q, k, v, scale, rep, s = _scores(query, key, value, attn_mask, is_causal, scale,
                                     enable_gqa)
    s = np.broadcast_to(s, np.broadcast_shapes(s.shape, () if attn_mask is None
                                               else np.shape(attn_mask)))
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m_safe)
    l = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
        lse = (m_safe + np.log(l))[..., 0]
    z = np.ones_like(p)
    if dropout_p > 0:
        L, S = p.shape[-2:]
        batch, heads = (p.shape[:-3], p.shape[-3]) if p.ndim >= 3 else ((), 1)
        z = keep_mask(seed, dropout_p, batch, heads, L, S).reshape(p.shape) / (1.0 - dropout_p)
    return q, k, v, scale, rep, p, z, lse


def attention_dropout(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                      attn_mask: ArrayLike | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, seed: int = 0) -> tuple[F64, F64]:
    """Reference attention with dropout (the mask of :func:`sdpa_numba.dropout.keep_mask`).

    Returns ``(out, lse)`` in float64; ``lse`` is that of the softmax before dropout.
    """
    q, k, v, scale, rep, p, z, lse = _train_forward(query, key, value, attn_mask, dropout_p,
                                                     is_causal, scale, enable_gqa, seed)
    return np.matmul(p * z, v), lse


def attention_backward(grad_out: ArrayLike, query: ArrayLike, key: ArrayLike,
                       value: ArrayLike, attn_mask: ArrayLike | None = None,
                       dropout_p: float = 0.0, is_causal: bool = False,
                       scale: float | None = None, enable_gqa: bool = False, *,
                       seed: int = 0) -> tuple[F64, F64, F64, F64 | None]:
    """Reference gradients of :func:`attention` (with dropout: of :func:`attention_dropout`).

    With ``P`` the probabilities, ``Z`` the dropout factors (kept / (1 - p), or 1),
    ``O = (P Z) V``::

        dV = (P Z)ᵀ dO,   dP = (dO Vᵀ) Z,   dS = P (dP - rowsum(P dP)),
        dQ = scale dS K,  dK = scale dSᵀ Q,  d(mask) = dS

    all in float64; key/value gradients are summed over the query heads of each group (GQA),
    and every gradient is summed over the dims its input was broadcast along.

    Returns
    -------
    grad_query, grad_key, grad_value : ndarray, float64, the shapes of the inputs
    grad_attn_mask : ndarray (the mask's shape) for a float mask, else None
    """
    q, k, v, scale, rep, p, z, _ = _train_forward(query, key, value, attn_mask, dropout_p,
                                                   is_causal, scale, enable_gqa, seed)
    do = np.asarray(grad_out, dtype=np.float64)
    dv = np.matmul(np.swapaxes(p * z, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v, -1, -2)) * z
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = np.matmul(ds, k) * scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * scale
    if rep > 1:
        dk = dk.reshape(dk.shape[:-3] + (-1, rep) + dk.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(dv.shape[:-3] + (-1, rep) + dv.shape[-2:]).sum(axis=-3)
    dmask = None
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        dmask = sum_to(ds, np.shape(attn_mask))
    return (sum_to(dq, np.shape(query)), sum_to(dk, np.shape(key)),
            sum_to(dv, np.shape(value)), dmask)
