"""Merging attention states by their lse, as CUDA device functions for users' kernels.

The weights are :mod:`sdpa_numba.score.merge`'s target-neutral ``@njit`` functions (numba-cuda
compiles them as device functions of its own); the loops over a row's elements are written
here again as device functions because the CUDA simulator cannot pass its arrays to ``@njit``
functions. The conventions (``-inf`` parts contribute nothing, all ``-inf`` gives 0 and
``-inf``, a NaN or ``+inf`` lse makes the row NaN) are those of
:func:`sdpa_numba.merge_attention_states`.
"""

import math

from numba import cuda

from ..score.merge import merge_finish, merge_max, merge_weight, merge_weights

__all__ = ["merge_row", "merge_rows", "merge_weights"]


@cuda.jit(device=True, inline="always")
def merge_row(out_a, lse_a, out_b, lse_b, out):
    """Merge two rows: ``out[d] = w_a out_a[d] + w_b out_b[d]``; returns the merged lse.
    ``out`` may be ``out_a`` or ``out_b``."""
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


@cuda.jit(device=True, inline="always")
def merge_rows(outs, lses, out):
    """Merge ``n`` rows, ``outs (n, Ev)`` with ``lses (n,)``, into ``out (Ev,)`` (parts added
    in index order; ``out`` may be the first part of nonzero weight); returns the merged lse."""
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
