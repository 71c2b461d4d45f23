"""The online softmax as CUDA device functions, for the forward kernel and users' own kernels.

For each block of scores of a query row, with the running max ``m``, running sum ``l`` and
unnormalized accumulator ``acc`` (Milakov & Gimelshein 2018; FlashAttention 1-3)::

    m_new = max(m, max_j s_j);  p_j = exp(s_j - m_new);  alpha = exp(m - m_new)
    l = alpha * l + sum_j p_j;   acc = alpha * acc + sum_j p_j v_j;   m = m_new
    at the end: out = acc / l,   lse = m + log(l)

A row whose scores so far are all masked has ``m = -inf``; its exponentials are then taken
against 0 instead, which gives p = 0 and alpha = 0 rather than exp(-inf + inf) = NaN, so a fully
masked row ends with acc = 0, l = 0, out = 0 and lse = -inf.

Every function here works on one query row and is meant to be called by one thread; arrays may
be global, shared or local memory, of float32 or float64 (all of one dtype). Scores are in
natural units; masked keys are ``-inf``.
"""

import math

from numba import cuda

from ..score.recipe import keeps, modified_score
from .options import FASTMATH
from .variants import device_recipe


@cuda.jit(device=True, fastmath=FASTMATH)
def online_softmax_update(s, off, n, m, l):
    """Fold the scores ``s[off:off + n]`` of one query row into its running max and sum.

    Parameters
    ----------
    s : array
        Scores (already scaled and masked; ``-inf`` for masked keys). ``s[off:off + n]`` is
        overwritten with ``p = exp(s - m_new)``.
    off, n : int
        Where the block's scores start, and how many there are.
    m, l : float
        Running max and running sum; start at ``-inf`` and ``0``.

    Returns
    -------
    m_new, l_new, alpha : float
        The updated max and sum, and the factor by which the caller must rescale its
        accumulator before adding ``sum_j p_j v_j``.

    Notes
    -----
    A NaN score is never taken as the max, so it reaches ``p``, ``l`` and the accumulator: a
    NaN in a query row's scores gives a NaN output row, and no other row is touched.
    """
    m_new = m
    for j in range(n):
        x = s[off + j]
        if x > m_new:
            m_new = x
    # Every key so far masked: exponentiate against 0, so p = alpha = 0 instead of NaN.
    zero = s.dtype.type(0)
    m_use = m_new if m_new != s.dtype.type(-math.inf) else zero
    total = zero
    for j in range(n):
        p = math.exp(s[off + j] - m_use)
        s[off + j] = p
        total += p
    alpha = math.exp(m - m_use)
    return m_new, alpha * l + total, alpha


@cuda.jit(device=True, fastmath=FASTMATH)
def online_softmax_lse(m, l):
    """Log-sum-exp of a row from its final running max ``m`` and sum ``l``.

    ``l == 0`` only when every key was masked, and then ``m`` is still ``-inf``: the result is
    ``-inf``, as torch gives.
    """
    if l == 0:
        return m
    return m + math.log(l)  # NaN for a row with a NaN score, as it should be


@cuda.jit(device=True, fastmath=FASTMATH)
def attend_row(q, k, v, scale, s, m, l, acc):
    """One query row against one block of keys and values: an online-softmax step.

    Parameters
    ----------
    q : array, shape (E,)
        The query row.
    k : array, shape (n, E)
        The block's keys (e.g. a slice ``key[j0:j1]`` of global memory); every key takes part:
        restrict the slice for causal attention.
    v : array, shape (n, Ev)
        The block's values.
    scale : float
        Multiplies ``q · k`` (of the arrays' dtype, or float32 math turns into float64).
    s : array, shape (>= n,)
        Scratch for the block's scores (e.g. a ``cuda.local.array``).
    m, l : float
        Running max and sum of the row; start at ``-inf`` and ``0``.
    acc : array, shape (Ev,)
        Unnormalized output row; starts at 0; updated in place.

    Returns
    -------
    m, l : float
        The updated running max and sum.

    Examples
    --------
    One thread per query row ``i`` of a single head, keys in blocks of ``BN``::

        m, l = -math.inf, 0.0          # typed like the arrays (float64 here)
        for d in range(Ev):
            acc[d] = 0
        for j0 in range(0, S, BN):
            j1 = min(S, j0 + BN)
            m, l = attend_row(q[i], k[j0:j1], v[j0:j1], scale, s, m, l, acc)
        lse[i] = online_softmax_finalize(m, l, acc, out[i])
    """
    n, e_len = k.shape
    for j in range(n):
        x = s.dtype.type(0)
        for e in range(e_len):
            x += q[e] * k[j, e]
        s[j] = x * scale
    return _fold_block(s, n, v, m, l, acc)


@cuda.jit(device=True, fastmath=FASTMATH)
def attend_row_recipe(q, k, v, scale, s, m, l, acc, r, b, h, i, j0):
    """:func:`attend_row` with the scores formed by a score recipe: the variants (window,
    alignment, soft cap, ALiBi, the user's ``score_mod`` and ``mask_mod``) in a user's kernel.

    Parameters
    ----------
    q, k, v, scale, s, m, l, acc
        As for :func:`attend_row`.
    r : Recipe
        Made in the kernel with :func:`sdpa_numba.score.recipe.recipe` (its keywords; the
        user's functions are globals of the kernel, ``mod_args`` a tuple of the kernel's
        arrays). Its block mask and sinks are the caller's to apply (skip the blocks;
        :func:`~sdpa_numba.score.recipe.fold_sink` before finalizing).
    b, h : int
        The batch index and query head, as the recipe's functions see them.
    i : int
        The query row's position (in the call's ``q``).
    j0 : int
        The position of ``k[0]`` (keys ``j0 .. j0 + n - 1``).

    Returns
    -------
    m, l : float
        The updated running max and sum.
    """
    r = device_recipe(r)
    n, e_len = k.shape
    t = s.dtype.type
    for j in range(n):
        x = t(0)
        for e in range(e_len):
            x += q[e] * k[j, e]
        # t(): on the simulator the score functions are CPU-jitted and return Python floats
        x = t(modified_score(r, x * scale, b, h, i, j0 + j))
        s[j] = x if keeps(r, b, h, i, j0 + j) else t(-math.inf)
    return _fold_block(s, n, v, m, l, acc)


@cuda.jit(device=True, fastmath=FASTMATH)
def _fold_block(s, n, v, m, l, acc):
    """Fold the ``n`` scores ``s`` of a block into ``m``, ``l`` and ``acc += p · v``."""
    m, l, alpha = online_softmax_update(s, 0, n, m, l)
    for d in range(v.shape[1]):
        a = alpha * acc[d]
        for j in range(n):
            a += s[j] * v[j, d]
        acc[d] = a
    return m, l


@cuda.jit(device=True, fastmath=FASTMATH)
def online_softmax_finalize(m, l, acc, out):
    """Write ``out = acc / l`` and return the row's log-sum-exp.

    Parameters
    ----------
    m, l : float
        Final running max and sum (from :func:`attend_row` or :func:`online_softmax_update`).
    acc : array, shape (Ev,)
        Final unnormalized output row.
    out : array, shape (Ev,)
        Written: zeros for a row whose every key was masked (``l == 0``), as torch gives.

    Returns
    -------
    lse : float
        ``m + log(l)``, or ``-inf`` for a fully masked row.
    """
    if l == 0:
        for d in range(out.shape[0]):
            out[d] = 0
    else:
        for d in range(out.shape[0]):
            out[d] = acc[d] / l
    return online_softmax_lse(m, l)
