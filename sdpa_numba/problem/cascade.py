"""The validated shared prefix of a cascade (shared-prefix) attention call:
:func:`check_prefix` checks the prefix's keys and values of
:func:`sdpa_numba.cascade_attention` against the suffix's validated
:class:`~sdpa_numba.problem.kvcache.KVCacheProblem` (shapes, strides and dtypes alone).
"""

import numpy as np

from .arguments import shape_str
from .dtypes import check_storage_dtype


def check_prefix(p, prefix_k, prefix_v):
    """The number of prefix keys ``P``, after checking that ``prefix_k (P, H, E)`` and
    ``prefix_v (P, H, Ev)`` match the suffix problem ``p`` (its dtype, ``H``, ``E``, ``Ev``);
    TypeError / ValueError naming the argument."""
    h, e = p.k_cache_shape[2:]
    ev = p.v_cache_shape[3]
    for name, x, last, dim in (("prefix_k", prefix_k, e, "E"), ("prefix_v", prefix_v, ev, "Ev")):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims (P, H, {dim}), got shape {shape_str(x)}")
        check_storage_dtype(name, x, ("q", p.dtype))
        if tuple(x.shape[1:]) != (h, last):
            raise ValueError(f"{name} must have shape (P, {h}, {last}) (the caches' H and "
                             f"{dim}), got {shape_str(x)}")
    if prefix_k.shape[0] != prefix_v.shape[0]:
        raise ValueError(f"prefix_k and prefix_v must hold as many keys as values, got "
                         f"{shape_str(prefix_k)} and {shape_str(prefix_v)}")
    return int(prefix_k.shape[0])


def fold_queries(q, h):
    """``q (B, Lq, Hq, E)`` as the rows of one block per key/value head, ``(1, H, B * Lq *
    g, E)`` (``g = Hq / H``; row ``(b * Lq + t) * g + i`` of head ``h`` is query head ``h * g
    + i`` of token ``t`` of sequence ``b``): a copy."""
    b, lq, hq, e = q.shape
    g = hq // h
    return np.ascontiguousarray(
        q.reshape(b, lq, h, g, e).transpose(2, 0, 1, 3, 4)).reshape(1, h, b * lq * g, e)


def unfold_rows(x, shape):
    """The inverse of :func:`fold_queries` for ``x (1, H, B * Lq * g, ...)``: ``(B, Lq, Hq,
    ...)`` with ``shape = (B, Lq, Hq)`` (a view where it can be)."""
    b, lq, hq = shape
    h = x.shape[1]
    rest = x.shape[3:]
    return x.reshape(h, b, lq, hq // h, *rest).transpose(1, 2, 0, 3, *range(4, 4 + len(rest))
                                                         ).reshape(b, lq, hq, *rest)
