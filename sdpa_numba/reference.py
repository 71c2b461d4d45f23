"""Plain NumPy attention in float64: the reference for tests, docs and the CLI's check.

It builds the full L x S score matrix on purpose (clarity over memory): use it on small inputs.
Semantics are those of :func:`sdpa_numba.scaled_dot_product_attention`.

It depends on NumPy alone, never on the package's other modules (tests/test_reference.py
checks): an oracle that ran the code it judges (a shared reduction, a shared dropout stream)
would agree with that code's bugs.
"""

import math
from typing import Any

import numpy as np
import numpy.typing as npt

ArrayLike = npt.ArrayLike
F64 = npt.NDArray[np.float64]

# The dropout stream of :mod:`sdpa_numba.dropout` (SplitMix64), restated from its
# specification there rather than imported.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _sum_to(x, shape):
    """``x`` summed back to ``shape``, the shape of an operand broadcast to ``x.shape``: over
    the leading axes the operand lacks, then over the axes where it has 1 and ``x`` does not."""
    shape = tuple(shape)
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    stretched = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=stretched, keepdims=True).reshape(shape)


def _keep_mask(seed, p, batch, heads, L, S):
    """The dropout keep mask (True: kept), shape ``(*batch, heads, L, S)``: element
    ``(b, h, i, j)`` (``b`` the flat batch index) is kept when the top 32 bits of
    ``step(step(step(step(seed, b), h), i), j)`` are at least ``floor(p * 2**32)``, with
    ``step(key, n) = mix(key + (n + 1) * GAMMA)``, all modulo 2**64."""
    def mix(z):
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))

    def step(key, n):
        return mix(key + (np.asarray(n, np.uint64) + np.uint64(1)) * _GAMMA)

    nb = math.prod(batch)
    b, h, i, j = np.ix_(*(np.arange(n, dtype=np.uint64) for n in (nb, heads, L, S)))
    with np.errstate(over="ignore"):
        bits = step(step(step(step(np.uint64(seed), b), h), i), j)
    threshold = min(int(float(p) * 2.0**32), 2**32 - 1)
    return ((bits >> np.uint64(32)) >= np.uint64(threshold)).reshape((*batch, heads, L, S))


def _call(f):
    """The plain-Python form of a user's function (a Numba dispatcher's ``py_func``): the
    reference does not depend on Numba compiling it."""
    return getattr(f, "py_func", f)


def _elementwise(f, s, args, mod_args):
    """``f(s[idx], b, h, i, j, *mod_args)`` (or, with ``s`` None, ``f(b, h, i, j, ...)``) at
    every index of the full ``(*batch, Hq, L, S)`` shape ``args``, ``b`` the flat batch index."""
    shape = args
    batch = shape[:-3]
    out = np.empty(shape, dtype=bool if s is None else np.float64)
    f = _call(f)
    for idx in np.ndindex(*shape):
        b = int(np.ravel_multi_index(idx[:-3], batch)) if batch else 0
        h, i, j = idx[-3:]
        if s is None:
            out[idx] = bool(f(b, h, i, j, *mod_args))
        else:
            out[idx] = float(f(float(s[idx]), b, h, i, j, *mod_args))
    return out


def _scores(query, key, value, attn_mask, is_causal, scale, enable_gqa, window=None,
            alignment="top_left", softcap=None, alibi_slopes=None, score_mod=None,
            mask_mod=None, mod_args=(), score_mod_grad=None, chunk=None):
    """float64 operands (key/value heads repeated for GQA), the scale, the GQA repeat factor,
    the masked, modified scores and ``ds_dscaled``, d(score) / d(scale · q · k) (1 where no
    soft cap or score_mod changes it; only computed with ``score_mod_grad`` or a soft cap).

    The score of ``(b, h, i, j)``, in this order (``i' = i + offset``, ``offset = S - L``
    bottom-right, else 0)::

        s = scale · q_i · k_j;  s = softcap · tanh(s / softcap);  s = s - slope · |i' - j|;
        s = score_mod(s, b, h, i, j, *mod_args);  s = s + (float) attn_mask;
        s = -inf unless i' - left <= j <= i' + right (causal: right <= 0),
        floor(i' / chunk) == floor(j / chunk) (with ``chunk``), mask_mod and the bool
        attn_mask keep it.

    Scores always have the full shape ``(*batch, Hq, L, S)`` (inputs that are all 2-D: no head
    dim) so that ``b`` is the flat index into the batch dims.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    two_d = max(q.ndim, k.ndim, v.ndim) == 2
    if two_d:  # one head
        q, k, v = q[None], k[None], v[None]
    rep = 1
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, rep, axis=-3)
        v = np.repeat(v, rep, axis=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    mask = None if attn_mask is None else np.asarray(attn_mask)
    if mask is not None and two_d:
        mask = mask.reshape((1,) * (3 - mask.ndim) + mask.shape) if mask.ndim < 3 else mask
    full = np.broadcast_shapes(s.shape, () if mask is None else mask.shape)
    s = np.broadcast_to(s, full)
    L, S = full[-2:]
    offset = S - L if alignment == "bottom_right" else 0
    i = np.arange(L)[:, None] + offset  # i' (aligned frame)
    j = np.arange(S)[None, :]
    slope = np.ones(full) if score_mod_grad is not None or softcap else None
    if softcap:
        t = np.tanh(s / softcap)
        s = softcap * t
        slope = slope * (1.0 - t * t)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        s = s - slopes[..., None, None] * np.abs(i - j)
    if score_mod is not None:
        if score_mod_grad is not None:
            slope = slope * _elementwise(score_mod_grad, s, full, tuple(mod_args))
        s = _elementwise(score_mod, s, full, tuple(mod_args))
    if mask is not None and mask.dtype != bool:
        s = s + mask.astype(np.float64)
    keep = np.ones((L, S), dtype=bool)
    left, right = (None, None) if window is None else window
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    if chunk is not None:  # chunked local attention: the query's chunk only
        keep &= np.floor_divide(i, chunk) == np.floor_divide(j, chunk)
    keep = np.broadcast_to(keep, full)
    if mask_mod is not None:
        keep = keep & _elementwise(mask_mod, None, full, tuple(mod_args))
    if mask is not None and mask.dtype == bool:
        keep = keep & mask
    s = np.where(keep, s, -np.inf)
    if two_d:
        s = s[0]
        slope = None if slope is None else slope[0]
        q, k, v = q[0], k[0], v[0]
    return q, k, v, scale, rep, s, slope


def _softmax(s, sinks):
    """Probabilities and lse of the scores ``s`` (rows over the last axis), with each head's
    sink logit in the denominator (``sinks`` of shape (Hq,), or None). A row with every key
    masked: p = 0 and lse = -inf (with a sink: lse = sink)."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)
        sink = sink[:, None, None] if s.ndim >= 3 else sink.reshape(1, 1)
        m = np.maximum(m, sink)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m_safe)
    l = np.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
        lse = (m_safe + np.log(l))[..., 0]
    return p, lse


def attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
              attn_mask: ArrayLike | None = None, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, window: tuple[int | None, int | None] | None = None,
              alignment: str = "top_left", softcap: float | None = None,
              alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
              score_mod: Any = None, mask_mod: Any = None,
              mod_args: tuple[Any, ...] = (), chunk: int | None = None) -> tuple[F64, F64]:
    """Reference attention; returns ``(out, lse)`` in float64.

    Parameters
    ----------
    query, key, value : array_like
        ``(..., Hq, L, E)``, ``(..., H, S, E)``, ``(..., H, S, Ev)``; 2-D inputs are one head.
    attn_mask : array_like, optional
        bool (True takes part) or float (added), broadcastable to ``(..., Hq, L, S)``.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (with ``alignment="bottom_right"``: ``j <= i + S - L``).
    scale : float, optional
        Defaults to ``1 / sqrt(E)``.
    enable_gqa : bool
        Query head ``h`` uses key/value head ``h // (Hq // H)``.
    window, alignment, softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_args, chunk
        The variants, keyword-only, exactly as :func:`sdpa_numba.scaled_dot_product_attention`
        takes them (``score_mod`` and ``mask_mod`` are called in plain Python: a Numba
        function's ``py_func``). Not validated here: pass what the public function accepts.

    Returns
    -------
    out : ndarray, float64, ``(..., Hq, L, Ev)``
    lse : ndarray, float64, ``(..., Hq, L)``; ``-inf`` for a row whose every key is masked,
        whose output row is then 0 (with sinks: ``lse`` is the head's sink logit).
    """
    q, k, v, scale, _, s, _ = _scores(query, key, value, attn_mask, is_causal, scale,
                                      enable_gqa, window, alignment, softcap, alibi_slopes,
                                      score_mod, mask_mod, mod_args, chunk=chunk)
    p, lse = _softmax(s, sinks)
    return np.matmul(p, v), lse


def _train_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
                   **variants):
    """Everything the training references need, in float64 with explicit broadcasting:
    ``(q, k, v, scale, rep, p, z, lse)``, and with ``with_slope=True`` also d(score) /
    d(scale · q · k) (or None where that is 1)."""
    with_slope = variants.pop("with_slope", False)
    sinks = variants.pop("sinks", None)
    q, k, v, scale, rep, s, slope = _scores(query, key, value, attn_mask, is_causal, scale,
                                            enable_gqa, **variants)
    p, lse = _softmax(s, sinks)
    z = np.ones_like(p)
    if dropout_p > 0:
        L, S = p.shape[-2:]
        batch, heads = (p.shape[:-3], p.shape[-3]) if p.ndim >= 3 else ((), 1)
        z = _keep_mask(seed, dropout_p, batch, heads, L, S).reshape(p.shape) / (1.0 - dropout_p)
    if with_slope:
        return q, k, v, scale, rep, p, z, lse, slope
    return q, k, v, scale, rep, p, z, lse


def attention_dropout(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                      attn_mask: ArrayLike | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, seed: int = 0,
                      window: tuple[int | None, int | None] | None = None,
                      alignment: str = "top_left", softcap: float | None = None,
                      alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
                      score_mod: Any = None, mask_mod: Any = None,
                      mod_args: tuple[Any, ...] = (),
                      chunk: int | None = None) -> tuple[F64, F64]:
    """Reference attention with dropout (the mask of :mod:`sdpa_numba.dropout`'s stream).

    Returns ``(out, lse)`` in float64; ``lse`` is that of the softmax before dropout. The
    variants (keyword-only) are those of :func:`attention`.
    """
    q, k, v, scale, rep, p, z, lse = _train_forward(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
        window=window, alignment=alignment, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args, chunk=chunk)
    return np.matmul(p * z, v), lse


def attention_backward(grad_out: ArrayLike, query: ArrayLike, key: ArrayLike,
                       value: ArrayLike, attn_mask: ArrayLike | None = None,
                       dropout_p: float = 0.0, is_causal: bool = False,
                       scale: float | None = None, enable_gqa: bool = False, *,
                       seed: int = 0, window: tuple[int | None, int | None] | None = None,
                       alignment: str = "top_left", softcap: float | None = None,
                       alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
                       score_mod: Any = None, mask_mod: Any = None,
                       mod_args: tuple[Any, ...] = (),
                       score_mod_grad: Any = None,
                       chunk: int | None = None) -> tuple[Any, ...]:
    """Reference gradients of :func:`attention` (with dropout: of :func:`attention_dropout`).

    With ``P`` the probabilities, ``Z`` the dropout factors (kept / (1 - p), or 1),
    ``O = (P Z) V``::

        dV = (P Z)ᵀ dO,   dP = (dO Vᵀ) Z,   dS = P (dP - D),   D = rowsum(P dP) = rowsum(dO O),
        dQ = scale dS' K,  dK = scale dS'ᵀ Q,  d(mask) = dS,
        dS' = dS · d(score) / d(scale q·k)  (the soft cap's 1 - tanh², score_mod_grad),
        d sink_h = -Σ_{b,i} exp(sink_h - lse_{b,h,i}) D_{b,h,i}

    all in float64; key/value gradients are summed over the query heads of each group (GQA),
    and every gradient is summed over the dims its input was broadcast along. ALiBi slopes
    get no gradient. With a ``score_mod``, ``score_mod_grad`` (its derivative with respect to
    the score) is required.

    Returns
    -------
    grad_query, grad_key, grad_value : ndarray, float64, the shapes of the inputs
    grad_attn_mask : ndarray (the mask's shape) for a float mask, else None
    grad_sinks : ndarray, float64, shape (Hq,); only when ``sinks`` is given (a fifth entry)
    """
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("score_mod_grad is needed with a score_mod: the backward needs "
                         "d score_mod / d score")
    q, k, v, scale, rep, p, z, lse, slope = _train_forward(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
        window=window, alignment=alignment, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args,
        score_mod_grad=score_mod_grad, chunk=chunk, with_slope=True)
    do = np.asarray(grad_out, dtype=np.float64)
    dv = np.matmul(np.swapaxes(p * z, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v, -1, -2)) * z
    d = np.sum(p * dp, axis=-1, keepdims=True)
    ds = p * (dp - d)
    ds_scaled = ds if slope is None else ds * slope
    dq = np.matmul(ds_scaled, k) * scale
    dk = np.matmul(np.swapaxes(ds_scaled, -1, -2), q) * scale
    if rep > 1:
        # Explicit head counts, not -1: a reshape cannot infer a dim of an empty array (L or S 0).
        def group_sum(g):
            return g.reshape(g.shape[:-3] + (g.shape[-3] // rep, rep) + g.shape[-2:]).sum(axis=-3)
        dk, dv = group_sum(dk), group_sum(dv)
    dmask = None
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        dmask = _sum_to(ds, np.shape(attn_mask))
    grads = (_sum_to(dq, np.shape(query)), _sum_to(dk, np.shape(key)),
             _sum_to(dv, np.shape(value)), dmask)
    if sinks is None:
        return grads
    sink = np.asarray(sinks, dtype=np.float64)
    sink_b = sink[:, None] if lse.ndim >= 2 else sink
    with np.errstate(invalid="ignore"):
        w = np.where(np.isneginf(sink_b), 0.0, np.exp(sink_b - lse))
    dsink = -(w * d[..., 0])
    if lse.ndim >= 2:
        dsink = dsink.reshape(int(np.prod(dsink.shape[:-2])), sink.shape[0], dsink.shape[-1])
    else:
        dsink = dsink[None, None]
    return (*grads, dsink.sum(axis=(0, 2)))
