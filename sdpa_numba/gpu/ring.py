"""The device side of ring attention (:mod:`sdpa_numba.distributed`): in-place merges and sums.

The ring merges each step's partial ``(out, lse)`` into its running result and adds each
step's dQ/dK/dV into its accumulators, on row ranges of C-contiguous ``(..., rows, cols)``
buffers. On the host those are NumPy expressions; here they are two small kernels over 3-D
views ``(batch, rows, cols)`` (the leading dims of a C-contiguous buffer, cut along its rows,
collapse into one), one thread per row (merge) or per element (sum), so that the results
do not depend on the launch configuration.
"""

import math

import numpy as np
from numba import cuda

from .arrays import as_strided
from .merge import merge_row
from .reduce import THREADS

__all__ = ["merge_into", "add_into", "zeros", "full"]


def _grid(n):
    return (n + THREADS - 1) // THREADS, THREADS


def view3(x):
    """``x (..., n, c)``, whose leading dims are collapsible (a row range of a C-contiguous
    array), as ``(prod(...), n, c)``."""
    shape, strides = tuple(x.shape), tuple(x.strides)
    lead = math.prod(shape[:-2])
    outer = strides[-3] if x.ndim > 2 else 0
    return as_strided(x, (lead, shape[-2], shape[-1]), (outer, strides[-2], strides[-1]))


def lse3(lse):
    """``lse (..., n)`` as ``(prod(...), n, 1)`` (see :func:`view3`)."""
    shape, strides = tuple(lse.shape), tuple(lse.strides)
    lead = math.prod(shape[:-1])
    outer = strides[-2] if lse.ndim > 1 else 0
    return as_strided(lse, (lead, shape[-1], 1), (outer, strides[-1], 0))


@cuda.jit
def _merge(out, lse, o, lo):
    """Row ``(b, i)``: ``out, lse <- merge((out, lse), (o, lo))``, one thread per row."""
    t = cuda.grid(1)
    n = out.shape[1]
    if t < out.shape[0] * n:
        b = t // n
        i = t - b * n
        lse[b, i, 0] = merge_row(out[b, i], lse[b, i, 0], o[b, i], lo[b, i, 0], out[b, i])


@cuda.jit
def _add(acc, x):
    """``acc += x`` elementwise on 3-D views, one thread per element."""
    t = cuda.grid(1)
    n, c = acc.shape[1], acc.shape[2]
    if t < acc.shape[0] * n * c:
        b = t // (n * c)
        r = t - b * (n * c)
        i = r // c
        j = r - i * c
        acc[b, i, j] += x[b, i, j]


def merge_into(out, lse, o, lo):
    """Merge the state ``(o, lo)`` into ``(out, lse)`` in place (row ranges of C-contiguous
    device buffers of the same leading shapes), with the conventions of
    :func:`sdpa_numba.merge_attention_states` (``-inf`` parts contribute nothing)."""
    out3, o3 = view3(out), view3(o)
    rows = out3.shape[0] * out3.shape[1]
    if rows:
        _merge[_grid(rows)](out3, lse3(lse), o3, lse3(lo))


def add_into(acc, x):
    """``acc += x`` in place (row ranges of C-contiguous device arrays of one shape)."""
    a3, x3 = view3(acc), view3(x)
    if a3.size:
        _add[_grid(a3.size)](a3, x3)


def zeros(shape, dtype):
    """A device array of zeros."""
    return cuda.to_device(np.zeros(shape, dtype))


def full(shape, value, dtype):
    """A device array filled with ``value``."""
    return cuda.to_device(np.full(shape, value, dtype))
