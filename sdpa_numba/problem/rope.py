"""Rotary position embedding on append (FlashAttention's ``rotary_cos``, ``rotary_sin`` and
``rotary_interleaved`` of ``flash_attn_with_kvcache``): the checks, and the table rows each
token of a decode step is rotated with.

:func:`rope_problem` validates the tables against a step (q's head dim, the new keys, the
positions) and gathers, once per step, the cos/sin rows of each new key and query token as
small float64 arrays: a step's layers share them, so the launchers rotate every layer's q and
k without reading the (large, ``seqlen_ro``-row) tables again. The rotation itself is
:mod:`sdpa_numba.cpu.rope` / :mod:`sdpa_numba.gpu.rope`.

Positions (FlashAttention's rule): new key ``i`` of sequence ``b`` is at ``cache_seqlens[b] +
i`` (the cache slot it is written to; left padding does not shift it). Query token ``t`` is at
``cache_seqlens[b] + t`` when the step is causal or local (a window or chunks), else every
query token is at ``cache_seqlens[b]``.
"""

from dataclasses import dataclass

import numpy as np

from .arguments import check_flag, shape_str
from .dtypes import check_storage_dtype


@dataclass(frozen=True, eq=False)
class RopeProblem:
    """A step's rotation: ``rotary_dim`` (even, ``<= E``; the first ``rotary_dim`` dims of each
    head rotate, the rest pass through), ``interleaved`` (pairs ``(2i, 2i+1)``, GPT-J; else
    ``(i, i + rotary_dim / 2)``, GPT-NeoX), the positions ``q_pos`` (B, Lq) and ``k_pos``
    (B, Lq_new), int64, and the rows ``q_cos``, ``q_sin`` ``(B, Lq, rotary_dim / 2)``,
    ``k_cos``, ``k_sin`` ``(B, Lq_new, rotary_dim / 2)``, float64, C-contiguous: the table
    rows at each token's position. Device tables are not read on the host: then the rows are
    None and ``tables`` holds ``(rotary_cos, rotary_sin)``, for the CUDA launcher to gather
    the rows on the device (:func:`sdpa_numba.gpu.rope.gather_rows`)."""

    rotary_dim: int
    interleaved: bool
    q_pos: np.ndarray
    k_pos: np.ndarray
    q_cos: np.ndarray | None
    q_sin: np.ndarray | None
    k_cos: np.ndarray | None
    k_sin: np.ndarray | None
    tables: tuple | None = None


def rope_problem(rotary_cos, rotary_sin, rotary_interleaved, E, seqlens, lq, lq_new,
                 per_token):
    """Validate the rotation of one decode step and gather its rows (:class:`RopeProblem`), or
    None when ``rotary_cos`` and ``rotary_sin`` are both None.

    ``rotary_cos``, ``rotary_sin``: NumPy arrays (their rows in use copied now) or device
    arrays (checked by shape and dtype alone), shape ``(seqlen_ro, rotary_dim / 2)``, any
    float dtype; ``E``: q's head dim; ``seqlens``: int64 (B,), the
    keys in the cache before the append; ``lq``, ``lq_new``: query tokens and new keys per
    sequence (``lq_new`` None: no append, refused as FlashAttention does); ``per_token``:
    whether query tokens take their own positions (causal or local) or all
    ``cache_seqlens[b]``. TypeError / ValueError naming the argument.
    """
    interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together, or neither")
    if lq_new is None:
        raise ValueError("rotary_cos / rotary_sin rotate q and the new keys k before they are "
                         "appended: pass k and v with them (as FlashAttention requires); to "
                         "rotate q alone, rotate it before the call")
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        check_storage_dtype(name, x)
        if x.ndim != 2:
            raise ValueError(f"{name} must have 2 dims (seqlen_ro, rotary_dim / 2), got shape "
                             f"{shape_str(x)}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin must have rotary_cos's shape {shape_str(rotary_cos)}, got "
                         f"{shape_str(rotary_sin)}")
    seqlen_ro, half = rotary_cos.shape
    if half < 1 or 2 * half > E:
        raise ValueError(f"rotary_cos's second dim (rotary_dim / 2) must be in [1, E / 2] = "
                         f"[1, {E // 2}] (q's head dim E = {E}), got shape "
                         f"{shape_str(rotary_cos)}")
    B = len(seqlens)
    k_pos = seqlens[:, None] + np.arange(lq_new)[None, :]
    q_pos = seqlens[:, None] + (np.arange(lq)[None, :] if per_token
                                else np.zeros((1, lq), np.int64))
    last = max(int(k_pos.max()) if k_pos.size else -1, int(q_pos.max()) if q_pos.size else -1)
    if last >= seqlen_ro:
        raise ValueError(f"rotary_cos has {seqlen_ro} rows (positions), but this step rotates "
                         f"a token at position {last} (cache_seqlens[b] + the token's index): "
                         f"the tables need at least {last + 1} rows")

    q_pos = np.ascontiguousarray(q_pos, np.int64)
    k_pos = np.ascontiguousarray(k_pos, np.int64)
    if not (isinstance(rotary_cos, np.ndarray) and isinstance(rotary_sin, np.ndarray)):
        return RopeProblem(2 * half, interleaved, q_pos, k_pos, None, None, None, None,
                           tables=(rotary_cos, rotary_sin))

    def rows(table, pos):
        # Only the rows in use, as float64 (any table dtype: float16 and bfloat16 included).
        return np.ascontiguousarray(
            np.asarray(table[pos.reshape(-1)], dtype=np.float64).reshape(B, pos.shape[1], half))

    return RopeProblem(2 * half, interleaved, q_pos, k_pos, rows(rotary_cos, q_pos),
                       rows(rotary_sin, q_pos), rows(rotary_cos, k_pos), rows(rotary_sin, k_pos))


def rotate_reference(x, cos, sin, interleaved):
    """``x`` (B, L, H, E) rotated with rows ``cos``, ``sin`` (B, L, rotary_dim / 2), in
    float64, in NumPy: what the kernels compute (each result rounded once to x's dtype), for
    tests and for hosts without the kernels."""
    x = np.asarray(x, np.float64)
    half = cos.shape[-1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = b * c + a * s
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = b * c + a * s
    return out
