"""Merging attention states by their log-sum-exp, in jitted code: written once for both targets.

Attention of a query row over two disjoint key sets A and B, each given as its normalized output
``o`` and its log-sum-exp ``lse`` (the dense API's ``return_lse``), combines exactly::

    m = max(lse_a, lse_b);  w_a = exp(lse_a - m);  w_b = exp(lse_b - m);  W = w_a + w_b
    out = (w_a o_a + w_b o_b) / W;                 lse = m + log(W)

and likewise for n parts. The conventions at the edges:

* a part with ``lse = -inf`` (no key took part) has weight 0: it contributes nothing (its output
  row is not even read, so it may hold anything, NaN included); if every
  part has ``lse = -inf`` the result is ``out = 0``, ``lse = -inf`` (no 0/0), as the kernels give
  a fully masked row;
* a part with ``lse = NaN`` or ``+inf`` (neither comes from finite scores) makes the merged row
  NaN, ``out`` and ``lse`` both, so that an upstream error stays visible instead of being
  silently dropped or taken as the only part that counts.

The scalar pieces (:func:`merge_max`, :func:`merge_finish`, :func:`merge_weights`) are plain
``@njit`` functions on scalars, which numba-cuda compiles as device functions of its own, from
this source (as :mod:`sdpa_numba.score.dropout`); :func:`merge_row` and :func:`merge_rows` add
the loops over a row's elements for users' ``@njit`` code, and :mod:`sdpa_numba.gpu.merge`
compiles their Python source as CUDA device functions (the CUDA simulator runs device code
as Python and cannot pass its arrays to ``@njit`` functions). The exponentials are
``math.exp``: one per part and row, not per element, so their speed does not matter here;
the weights are computed in float64 where Numba's typing promotes float32 (a literal 1.0 or
0.0 with a float32), which costs nothing per element and only rounds better.
"""

import math

from numba import njit

from ..options import INLINE


@njit(**INLINE)
def merge_max(m, lse):
    """The running maximum of the parts' lse, ``max(m, lse)``, except that a NaN (in ``m`` or
    ``lse``) stays NaN whatever comes after it. Start at ``m = -inf``."""
    if m != m:
        return m
    if lse > m or lse != lse:
        return lse
    return m


@njit(**INLINE)
def merge_finish(m, total):
    """``(lse, inv)`` of a merge: ``lse = m + log(total)`` and ``inv = 1 / total``, where ``m``
    is :func:`merge_max` over the parts and ``total`` the sum of their :func:`merge_weight`.

    Every part at ``-inf`` (``m == -inf``, ``total == 0``) gives ``(-inf, 0)``: weights of 0, so
    ``out = 0``; a NaN or ``+inf`` part (``total`` is then NaN) gives ``(NaN, NaN)``.
    """
    if total > 0:
        return m + math.log(total), 1.0 / total
    if m == -math.inf:
        return m, total  # total == 0
    return total, total  # NaN


@njit(**INLINE)
def merge_weight(lse, m):
    """The unnormalized weight ``exp(lse - m)`` of a part (``m`` from :func:`merge_max`); 0
    when every part is at ``-inf`` (``m == -inf``), where ``exp(-inf + inf)`` would be NaN."""
    if m == -math.inf:
        return 0.0
    return math.exp(lse - m)


@njit(**INLINE)
def merge_weights(lse_a, lse_b):
    """``(w_a, w_b, lse)``: the normalized weights of two parts and the merged lse, so that the
    merged output is ``w_a * o_a + w_b * o_b``. Both at ``-inf``: ``(0, 0, -inf)``."""
    m = merge_max(merge_max(-math.inf, lse_a), lse_b)
    ea = merge_weight(lse_a, m)
    eb = merge_weight(lse_b, m)
    lse, inv = merge_finish(m, ea + eb)
    return ea * inv, eb * inv, lse


@njit(**INLINE)
def merge_row(out_a, lse_a, out_b, lse_b, out):
    """Merge two rows: ``out[d] = w_a out_a[d] + w_b out_b[d]``; returns the merged lse.

    ``out_a``, ``out_b``, ``out``: 1-D float arrays of one length (``out`` may be either input:
    each element is read before it is written). The arithmetic is in ``out``'s dtype.
    """
    wa, wb, lse = merge_weights(lse_a, lse_b)
    # A part of weight 0 is skipped, not multiplied by 0: its row may hold anything (0 * NaN).
    if wb == 0:
        for d in range(out.shape[0]):
            out[d] = wa * out_a[d]
    elif wa == 0:
        for d in range(out.shape[0]):
            out[d] = wb * out_b[d]
    else:
        for d in range(out.shape[0]):
            out[d] = wa * out_a[d] + wb * out_b[d]
    return lse


@njit(**INLINE)
def merge_rows(outs, lses, out):
    """Merge ``n`` rows: ``outs (n, Ev)`` with ``lses (n,)`` into ``out (Ev,)``; returns the
    merged lse.

    Parts are added in index order (``out`` may be the first part of nonzero weight, no other
    one). ``n == 0`` gives ``out = 0`` and ``-inf``, as all parts at ``-inf``.
    """
    n = lses.shape[0]
    m = -math.inf
    for i in range(n):
        m = merge_max(m, lses[i])
    total = 0.0
    for i in range(n):
        total += merge_weight(lses[i], m)
    lse, inv = merge_finish(m, total)
    ev = out.shape[0]
    first = True
    for i in range(n):
        w = merge_weight(lses[i], m) * inv
        if w == 0:  # skipped, not multiplied by 0: its row may hold anything (0 * NaN)
            continue
        if first:
            for d in range(ev):
                out[d] = w * outs[i, d]
            first = False
        else:
            for d in range(ev):
                out[d] += w * outs[i, d]
    if first:
        for d in range(ev):
            out[d] = 0
    return lse
