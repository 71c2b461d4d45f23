"""The validated shared prefix of a cascade (shared-prefix) attention call:
:func:`check_prefix` checks the prefix's keys and values of
:func:`sdpa_numba.cascade_attention` against the suffix's validated
:class:`~sdpa_numba.problem.kvcache.KVCacheProblem` (shapes, strides and dtypes alone);
:func:`fold_view`, :func:`unfold_view` and :func:`swap_last_view` are the views (shapes and
strides alone, through a target's ``as_strided``) that the target copies to fold the batch's
queries into rows and back.
"""

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


def fold_view(q, h, as_strided):
    """``q (B, Lq, Hq, E)`` seen as ``(H, B, Lq, g, E)`` (``g = Hq / H``), a view made by the
    target's ``as_strided`` from q's own strides: copied in C order and read as ``(1, H, B *
    Lq * g, E)``, these are the rows of one block per key/value head (row ``(b * Lq + t) * g
    + i`` of head ``h`` is query head ``h * g + i`` of token ``t`` of sequence ``b``)."""
    b, lq, hq, e = tuple(q.shape)
    g = hq // h
    sb, st, sh, se = tuple(q.strides)
    return as_strided(q, (h, b, lq, g, e), (g * sh, sb, st, sh, se))


def unfold_view(x, shape, as_strided):
    """The inverse of :func:`fold_view` for the rows ``x (1, H, B * Lq * g, ...)``: a view
    ``(B, Lq, H, g, ...)``, which copied in C order is ``(B, Lq, Hq, ...)``, with ``shape =
    (B, Lq, Hq)``."""
    b, lq, hq = shape
    xs, xst = tuple(x.shape), tuple(x.strides)
    h = xs[1]
    s_h, s_r = xst[1], xst[2]
    g = hq // h
    return as_strided(x, (b, lq, h, g, *xs[3:]), (lq * g * s_r, g * s_r, s_h, s_r, *xst[3:]))


def swap_last_view(x, as_strided):
    """``x (B, m, n)`` seen as ``(B, n, m)`` (the lse's ``(B, Hq, Lq)`` and ``(B, Lq, Hq)``
    layouts), a view."""
    (b, m, n), (sb, sm, sn) = tuple(x.shape), tuple(x.strides)
    return as_strided(x, (b, n, m), (sb, sn, sm))
