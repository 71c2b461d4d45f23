"""Merging attention states by their lse, as CUDA device functions for users' kernels.

The device functions are :mod:`sdpa_numba.score.merge`'s target-neutral functions: the scalar
weights as the ``@njit`` functions they are (numba-cuda compiles them as device functions of
its own), the loops over a row's elements (:func:`merge_row`, :func:`merge_rows`) compiled here
from the same Python source as ``cuda.jit`` device functions. The conventions (``-inf``
parts contribute nothing, all ``-inf`` gives 0 and ``-inf``, a NaN or ``+inf`` lse makes the
row NaN) are those of :func:`sdpa_numba.merge_attention_states`, whose CUDA path is
:func:`merge_states` here: one thread per output element, combining the parts in index order
in the compute dtype, with the CPU kernels' arithmetic (:mod:`sdpa_numba.cpu.merge`).
"""

import math

import numba
import numpy as np
from numba import cuda

from ..score import merge as score_merge
from ..score.merge import merge_finish, merge_max, merge_weight, merge_weights
from .storage import load, store, storage_view

__all__ = ["merge_row", "merge_rows", "merge_weights", "merge_states"]

#: Threads per block of the merge kernels.
THREADS = 128

_kernels: dict = {}


#: :func:`sdpa_numba.score.merge.merge_row` and :func:`~sdpa_numba.score.merge.merge_rows`,
#: compiled from their Python source as CUDA device functions. (Not the ``@njit`` functions
#: themselves: the simulator runs device code as Python and cannot pass its arrays to them.)
merge_row = cuda.jit(device=True, inline="always")(score_merge.merge_row.py_func)
merge_rows = cuda.jit(device=True, inline="always")(score_merge.merge_rows.py_func)


def _make_kernels(ct):
    CT = ct

    @cuda.jit
    def two_kernel(oa, la, ob, lb, out, lse):
        x = cuda.grid(1)
        ev = out.shape[1]
        ev1 = max(ev, 1)  # rows of no columns still get their lse
        if x >= out.shape[0] * ev1:
            return
        r, d = x // ev1, x % ev1
        wa, wb, m = merge_weights(la[r], lb[r])
        ca = CT(wa)
        cb = CT(wb)
        # A part of weight 0 is skipped, not multiplied by 0: its row may hold anything.
        if d < ev:
            if wb == 0:
                y = ca * CT(load(oa[r, d]))
            elif wa == 0:
                y = cb * CT(load(ob[r, d]))
            else:
                y = ca * CT(load(oa[r, d])) + cb * CT(load(ob[r, d]))
            out[r, d] = store(y, out)
        if d == 0:
            lse[r] = m

    @cuda.jit
    def many_kernel(outs, lses, out, lse):
        x = cuda.grid(1)
        ev = out.shape[1]
        ev1 = max(ev, 1)
        if x >= out.shape[0] * ev1:
            return
        r, d = x // ev1, x % ev1
        n = outs.shape[0]
        m = -math.inf
        for i in range(n):
            m = merge_max(m, lses[i, r])
        total = 0.0
        for i in range(n):
            total += merge_weight(lses[i, r], m)
        lse_r, inv = merge_finish(m, total)
        if d < ev:
            y = CT(0)
            for i in range(n):  # in index order, as the CPU kernels
                w = CT(merge_weight(lses[i, r], m) * inv)
                if w != 0:  # skipped, not multiplied by 0: its row may hold anything
                    y += w * CT(load(outs[i, r, d]))
            out[r, d] = store(y, out)
        if d == 0:
            lse[r] = lse_r

    return two_kernel, many_kernel


def merge_states(parts, out, lse, stream=0):
    """Launch the merge of attention states on device arrays.

    Parameters
    ----------
    parts : tuple
        ``(oa, la, ob, lb)``: two states, ``oa``, ``ob`` of shape (R, Ev) and ``la``, ``lb``
        (R,); or ``(outs, lses)``: ``n`` states, ``outs (n, R, Ev)``, ``lses (n, R)``. Outputs
        of any float storage dtype (bfloat16 too), lse arrays of the compute dtype.
    out : device array, shape (R, Ev), the outputs' dtype
        Written.
    lse : device array, shape (R,), of the compute dtype (float64 for float64 outputs, else
        float32)
        Written.
    stream : cuda stream, optional

    Notes
    -----
    Arguments are trusted (:func:`sdpa_numba.merge_attention_states` checks them). Each
    output element is one thread's, its parts combined in index order: the result does not
    depend on the launch. Asynchronous on ``stream``.
    """
    from .arrays import is_simulated_mode

    ct = np.dtype(lse.dtype)
    if ct not in _kernels:
        _kernels[ct] = _make_kernels(numba.from_dtype(ct))
    two_kernel, many_kernel = _kernels[ct]
    n = out.shape[0] * max(out.shape[1], 1)
    if n == 0:
        return
    threads = 32 if is_simulated_mode() else THREADS
    views = [storage_view(x) if i % 2 == 0 else x for i, x in enumerate(parts)]
    kernel = two_kernel if len(parts) == 4 else many_kernel
    kernel[-(-n // threads), threads, stream](*views, storage_view(out), lse)
