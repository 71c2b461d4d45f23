"""Merging attention states by their lse on the CPU: the kernels of
:func:`sdpa_numba.merge_attention_states`.

Rows are independent; each is merged by one thread with the weights of
:mod:`sdpa_numba.score.merge`, in a fixed order of parts, so the result does not depend on the
thread count. Outputs are read and written in their storage dtype (float16 as uint16 bits,
bfloat16 as int16 bits, see :mod:`.storage`) and combined in the compute dtype; ``lse`` arrays
are in the compute dtype. ``*_serial`` run on the calling thread (small merges, and callers that
parallelize themselves); the others split the rows among the threads. Kernels trust their
arguments: shapes ``oa, ob, out (R, Ev)``, ``la, lb, lse (R,)``; ``outs (n, R, Ev)``,
``lses (n, R)``.
"""

import math

import numpy as np
from numba import njit, prange

from ..score.merge import merge_finish, merge_max, merge_weight, merge_weights
from .options import INLINE, KERNEL
from ..score.numbers import cast
from .storage import load, store

#: Rows per parallel task.
ROWS = 64


@njit(**INLINE)
def _two(oa, la, ob, lb, out, lse, r0, r1):
    for r in range(r0, r1):
        wa, wb, x = merge_weights(la[r], lb[r])
        ca = cast(wa, lse)
        cb = cast(wb, lse)
        # A part of weight 0 is skipped, not multiplied by 0: its row may hold anything.
        if wb == 0:
            for d in range(out.shape[1]):
                out[r, d] = store(ca * load(oa[r, d]), out)
        elif wa == 0:
            for d in range(out.shape[1]):
                out[r, d] = store(cb * load(ob[r, d]), out)
        else:
            for d in range(out.shape[1]):
                out[r, d] = store(ca * load(oa[r, d]) + cb * load(ob[r, d]), out)
        lse[r] = x


@njit(**INLINE)
def part_weights(lses, c0, c1, i, sink, w):
    """The merge of row ``i`` of parts ``c0 .. c1 - 1`` by their lse (``lses (n, R)``): writes
    each part's normalized weight, ``w[c - c0]``, in the compute dtype of ``w``, and returns
    the merged lse; the merged row is then ``sum_c w[c - c0] * out_c`` over the parts of
    weight != 0 (a part of weight 0 is skipped, not multiplied by 0: its row may hold
    anything). ``sink``: one more part's logit, of output 0 (a head's sink: it weighs in the
    total only); ``-inf``: none."""
    m = -math.inf
    for c in range(c0, c1):
        m = merge_max(m, lses[c, i])
    m = merge_max(m, sink)
    total = 0.0
    for c in range(c0, c1):
        total += merge_weight(lses[c, i], m)
    if sink != -math.inf:  # no value row: it weighs in the total only
        total += merge_weight(sink, m)
    x, inv = merge_finish(m, total)
    for c in range(c0, c1):
        w[c - c0] = cast(merge_weight(lses[c, i], m) * inv, w)
    return x


@njit(**INLINE)
def _many(outs, lses, out, lse, r0, r1):
    n = outs.shape[0]
    ev = out.shape[1]
    acc = np.empty(ev, lse.dtype)
    w = np.empty(n, lse.dtype)
    for r in range(r0, r1):
        lse[r] = part_weights(lses, 0, n, r, -math.inf, w)
        acc[:] = 0
        for i in range(n):  # in index order: the same sums for any thread count
            if w[i] == 0:  # skipped, not multiplied by 0: its row may hold anything
                continue
            for d in range(ev):
                acc[d] += w[i] * load(outs[i, r, d])
        for d in range(ev):
            out[r, d] = store(acc[d], out)


@njit(**KERNEL)
def merge_two_serial(oa, la, ob, lb, out, lse):
    """Merge two states row by row on the calling thread (see the module)."""
    _two(oa, la, ob, lb, out, lse, 0, out.shape[0])


@njit(parallel=True, **KERNEL)
def merge_two(oa, la, ob, lb, out, lse):
    """Merge two states, rows split among the threads (see the module)."""
    n_rows = out.shape[0]
    for t in prange((n_rows + ROWS - 1) // ROWS):
        _two(oa, la, ob, lb, out, lse, t * ROWS, min(n_rows, (t + 1) * ROWS))


@njit(**KERNEL)
def merge_many_serial(outs, lses, out, lse):
    """Merge ``n`` states (leading axis) row by row on the calling thread (see the module)."""
    _many(outs, lses, out, lse, 0, out.shape[0])


@njit(parallel=True, **KERNEL)
def merge_many(outs, lses, out, lse):
    """Merge ``n`` states (leading axis), rows split among the threads (see the module)."""
    n_rows = out.shape[0]
    for t in prange((n_rows + ROWS - 1) // ROWS):
        _many(outs, lses, out, lse, t * ROWS, min(n_rows, (t + 1) * ROWS))
