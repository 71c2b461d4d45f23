"""The scale folded into a staged Q tile, without overflow (the CUDA kernels' counterpart of
:mod:`sdpa_numba.cpu.scale_fold`; the reasoning is there).

The kernels stage Q times ``scale`` in shared memory. Where that overflowed (an infinite
element in the tile, which the whole thread block sees through ``syncthreads_or``) and
``scale = f · 2**e`` with ``e > 0`` (``math.frexp``), the tile is staged again times ``f``,
and the caller multiplies its scores by the returned ``2**e``; else it returns 1 and the
tile, and so every score, keeps its bits.
"""

import math

from numba import cuda

from .tiles import load_tile


@cuda.jit(device=True, inline="always")
def split_power(sm, at, n_rows, n_cols, row_step, scale, tid, nt):
    """The power of two ``w = 2**e`` to take out of the float64 ``scale`` if the tile at
    ``at`` (``n_rows`` x ``n_cols``, row stride ``row_step``), staged times ``scale``,
    overflowed (an infinite element) and ``e > 0``; else 1.0. All ``nt`` threads of the block
    call it after staging; it synchronizes them (before and after reading the tile)."""
    cuda.syncthreads()  # the tile is staged
    found = 0
    for t in range(tid, n_rows * n_cols, nt):
        r = t // n_cols
        if abs(sm[at + r * row_step + t - r * n_cols]) == math.inf:
            found = 1
    w = 1.0
    if cuda.syncthreads_or(found):  # uniform
        _, e = math.frexp(scale)
        if e > 0:
            w = math.ldexp(1.0, e)
    return w


@cuda.jit(device=True, inline="always")
def refold_tile(src, b, h, row0, n_valid, n_rows, n_cols, scale, sm, at, row_step, tid, nt):
    """The factor (a power of two, 1 as a rule) by which the scores of the Q tile staged at
    ``at`` by :func:`~.tiles.load_tile` (factor ``scale``, ``n_cols`` columns, row stride
    ``row_step``) must be multiplied; restages the tile with ``scale / w`` where it is not 1
    (:func:`split_power`). The caller synchronizes before reading the tile."""
    w = split_power(sm, at, n_rows, n_cols, row_step, scale, tid, nt)
    if w != 1.0:
        load_tile(src, b, h, row0, n_valid, n_rows, n_cols, n_cols, sm.dtype.type(scale / w),
                  sm, at, row_step, 1, tid, nt)
    return sm.dtype.type(w)
