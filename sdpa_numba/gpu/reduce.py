"""Gradients of broadcast operands summed back to the operands' shapes, on the device.

The backward kernels write gradients at the full broadcast shapes, in the compute dtype (as the
CPU backward does). :func:`sum_to` then sums them over the dims along which each operand was
broadcast, one dim at a time, each output element by one thread adding in index order: a fixed
order, so the result is bitwise the same on every run. It then casts to the operand's dtype.
Which axes are summed is the problem layer's rule
(:func:`sdpa_numba.problem.broadcast_axes`), shared with the CPU.
"""

import math

import numpy as np
from numba import cuda

from ..problem.reductions import broadcast_axes
from .arrays import device_array
from .storage import storage_view, store

__all__ = ["broadcast_axes", "sum_to", "THREADS"]

#: Threads per block of the small kernels here.
THREADS = 128


@cuda.jit
def _sum_middle(x, out):
    """``out[o, i] = x[o, 0, i] + x[o, 1, i] + ...`` (that order), one thread per element."""
    t = cuda.grid(1)
    n_inner = out.shape[1]
    if t < out.shape[0] * n_inner:
        o = t // n_inner
        i = t - o * n_inner
        acc = x[o, 0, i]
        for n in range(1, x.shape[1]):
            acc += x[o, n, i]
        out[o, i] = acc


@cuda.jit
def _cast(x, out):
    """``out = x`` elementwise (1-D), converting to ``out``'s dtype (bfloat16 as int16 bits)."""
    t = cuda.grid(1)
    if t < out.shape[0]:
        out[t] = store(x[t], out)


def _grid(n):
    return (n + THREADS - 1) // THREADS, THREADS


def sum_to(x, shape, dtype):
    """``x`` (a C-contiguous device array) summed over its broadcast axes down to ``shape``
    (:func:`broadcast_axes`), as a new C-contiguous device array of ``dtype``; ``x`` itself
    when nothing is to be done."""
    full = tuple(x.shape)
    for a in broadcast_axes(full, shape):
        n = x.shape[a]
        kept = x.shape[:a] + (1,) + x.shape[a + 1:]
        y = device_array(kept, x.dtype)
        outer, inner = math.prod(x.shape[:a]), math.prod(x.shape[a + 1:])
        if y.size and n:
            _sum_middle[_grid(y.size)](x.reshape(outer, n, inner), y.reshape(outer, inner))
        elif y.size:  # summing over an empty axis gives zeros
            y = cuda.to_device(np.zeros(kept, x.dtype))
        x = y
    x = x.reshape(shape)
    if np.dtype(dtype) != np.dtype(x.dtype):
        y = device_array(shape, dtype)
        if y.size:
            _cast[_grid(y.size)](x.reshape(y.size), storage_view(y.reshape(y.size)))
        x = y
    return x
