"""Scratch buffers of the kernels, aligned to cache lines.

Numba's ``np.empty`` aligns to 32 bytes; a 512-bit load from an address that is not a
multiple of 64 spans two cache lines and costs two loads. The tile products load their wide
operands (packed queries, packed values, the output accumulator) 64 bytes at a time.
"""

import numpy as np
from numba import njit

from .options import INLINE

#: Bytes of a cache line (and of a 512-bit vector).
LINE = 64


@njit(**INLINE)
def aligned_empty(n, dtype):
    """An uninitialized 1-D array of ``n`` elements whose first element starts a cache line.

    A view into a slightly larger array: it keeps that array alive.
    """
    itemsize = np.empty(0, dtype).itemsize
    buf = np.empty(n + LINE // itemsize, dtype)
    off = (-buf.ctypes.data) % LINE // itemsize
    return buf[off:off + n]


@njit(**INLINE)
def aligned_full(n, value, dtype):
    """:func:`aligned_empty` filled with ``value``."""
    a = aligned_empty(n, dtype)
    a[:] = value
    return a
