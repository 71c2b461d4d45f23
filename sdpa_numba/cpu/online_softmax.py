"""The online softmax (Milakov & Gimelshein 2018; FlashAttention 1-3).

For each block of scores of a query row, with the running max ``m``, running sum ``l`` and
unnormalized accumulator ``acc``::

    m_new = max(m, max_j s_j);  p_j = exp(s_j - m_new);  alpha = exp(m - m_new)
    l = alpha * l + sum_j p_j;   acc = alpha * acc + sum_j p_j v_j;   m = m_new
    at the end: out = acc / l,   lse = m + log(l)

A row with every score masked so far has ``m = -inf``; exponentials are then taken against 0
instead of -inf, which gives p = 0 and alpha = 0 rather than exp(-inf + inf) = NaN, so a fully
masked row ends with acc = 0, l = 0, out = 0 and lse = -inf.

Scores, ``m`` and ``lse`` are in natural units; every exponential is the vectorizable
:func:`exp2` of a difference ``s - m <= 0`` times log2(e). (Converting the scores themselves to
base 2 would overflow for finite scores beyond FLT_MAX / log2(e).)
"""

import math

import numpy as np
from numba import njit

from ._llvm import data_ptr
from .exp2 import exp2
from ..score.numbers import cast
from .options import INLINE, KERNEL

LOG2E = 1.0 / math.log(2.0)


@njit(**INLINE)
def softmax_row(row, n, m_old):
    """One online-softmax step on ``n`` scores at pointer ``row``.

    Overwrites the scores with p = exp(s - m_new); returns ``(m_new, alpha, sum(p))``.
    """
    m_new = m_old
    for j in range(n):
        m_new = max(m_new, row[j])
    # All masked so far: exponentiate against 0, so p = alpha = 0 instead of NaN.
    m_use = m_new if m_new != -np.inf else cast(0.0, m_new)
    total = cast(0.0, m_new)
    c = cast(LOG2E, m_new)
    for j in range(n):
        p = exp2((row[j] - m_use) * c)
        row[j] = p
        total += p
    return m_new, exp2((m_old - m_use) * c), total


@njit(**INLINE)
def finalize_row(m, l, acc, out):
    """The end of one row: ``out = acc / l`` (``acc``, ``out``: the row's vectors; ``out`` may
    be ``acc``); returns ``lse = m + log(l)``. A row with ``l == 0`` (every score masked) gets
    ``out = 0`` and ``lse = -inf``."""
    if l == 0:
        for d in range(out.shape[0]):
            out[d] = 0
        return cast(-np.inf, m)
    inv = 1 / l
    for d in range(out.shape[0]):
        out[d] = acc[d] * inv
    return m + math.log(l)


@njit(**KERNEL)
def online_softmax_update(s, v, m, l, acc):
    """Fold one block of scores and values into the running softmax state, in place.

    Parameters
    ----------
    s : ndarray, shape (n, b)
        Scores of ``n`` query rows against ``b`` keys, already scaled and masked (natural
        units; ``-inf`` for masked keys). Not modified.
    v : ndarray, shape (b, ev)
        The block's values.
    m, l : ndarray, shape (n,)
        Running max and running sum; start at ``-inf`` and ``0``.
    acc : ndarray, shape (n, ev)
        Unnormalized output; starts at 0.

    Notes
    -----
    Call :func:`online_softmax_finalize` after the last block. The result does not depend on
    how the keys are split into blocks (up to rounding). All arrays share one float dtype.
    """
    n, b = s.shape
    ev = v.shape[1]
    row = np.empty(max(b, 1), dtype=acc.dtype)
    prow = data_ptr(row)
    for i in range(n):
        for j in range(b):
            row[j] = s[i, j]
        m2, alpha, total = softmax_row(prow, b, m[i])
        l[i] = alpha * l[i] + total
        m[i] = m2
        for d in range(ev):
            a = alpha * acc[i, d]
            for j in range(b):
                a += row[j] * v[j, d]
            acc[i, d] = a


@njit(**KERNEL)
def online_softmax_finalize(m, l, acc, out, lse):
    """Write ``out = acc / l`` and ``lse = m + log(l)``; rows with ``l == 0`` get 0 and -inf.

    Parameters
    ----------
    m, l : ndarray, shape (n,)
        State from :func:`online_softmax_update`.
    acc : ndarray, shape (n, ev)
        State from :func:`online_softmax_update`.
    out : ndarray, shape (n, ev)
        Written; may be ``acc`` itself.
    lse : ndarray, shape (n,)
        Written: the log-sum-exp of each row's scores.
    """
    for i in range(acc.shape[0]):
        lse[i] = finalize_row(m[i], l[i], acc[i], out[i])
