"""Small data-movement kernels of the serving functions on CUDA: strided copies (the cascade's
folding of the queries into rows and back, :func:`sdpa_numba.cascade_attention`), and the
gather / scatter of a paged cache's keys (:func:`sdpa_numba.varlen_attention_backward` with
``block_table``).

Copies move bits: every operand is viewed as unsigned integers of its item size, so one kernel
serves every dtype (bfloat16 and the 8-bit formats included) and nothing is converted. One
thread per element; each element is written by exactly one thread, so the results do not
depend on the launch configuration.
"""

import numpy as np
from numba import cuda

from .arrays import as_strided, device_array
from .reduce import THREADS
from .storage import load, storage_view, store

__all__ = ["copy_into", "packed_copy", "gather_rows", "scatter_sum_rows"]

#: The most dims :func:`copy_into` takes (the cascade's fold views have 5 or 6).
MAX_DIMS = 6


def _grid(n):
    return (n + THREADS - 1) // THREADS, THREADS


def _bits(x):
    """``x`` viewed as unsigned integers of its item size (a view, same shape and strides)."""
    return as_strided(x, tuple(x.shape), tuple(x.strides), np.dtype(f"u{x.dtype.itemsize}"))


def _padded(x):
    """``x`` with leading unit dims (stride 0) up to :data:`MAX_DIMS` dims (a view)."""
    pad = MAX_DIMS - x.ndim
    return as_strided(x, (1,) * pad + tuple(x.shape), (0,) * pad + tuple(x.strides))


@cuda.jit
def _copy(dst, src, n):
    """``dst[i] = src[i]`` for every index of two 6-d arrays of one shape, one thread each."""
    t = cuda.grid(1)
    if t < n:
        r = t
        i5 = r % dst.shape[5]
        r //= dst.shape[5]
        i4 = r % dst.shape[4]
        r //= dst.shape[4]
        i3 = r % dst.shape[3]
        r //= dst.shape[3]
        i2 = r % dst.shape[2]
        r //= dst.shape[2]
        i1 = r % dst.shape[1]
        i0 = r // dst.shape[1]
        dst[i0, i1, i2, i3, i4, i5] = src[i0, i1, i2, i3, i4, i5]


def copy_into(dst, src):
    """``dst[...] = src`` for device arrays of one shape and item size, any strides (views
    included), at most :data:`MAX_DIMS` dims: a bit copy on the device, asynchronous on the
    default stream. ``dst`` must not overlap ``src``."""
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype.itemsize != src.dtype.itemsize:
        raise ValueError(f"copy_into: shapes {tuple(dst.shape)} / {tuple(src.shape)} or item "
                         f"sizes differ")
    if dst.ndim > MAX_DIMS:
        raise ValueError(f"copy_into takes at most {MAX_DIMS} dims, got {dst.ndim}")
    n = int(np.prod(tuple(dst.shape), dtype=np.int64))
    if n:
        _copy[_grid(n)](_padded(_bits(dst)), _padded(_bits(src)), n)


def packed_copy(view, shape):
    """A new C-contiguous device array of ``shape`` holding the elements of device array
    ``view`` (any strides) in C order: ``ascontiguousarray(view).reshape(shape)``."""
    y = device_array(shape, view.dtype)
    strides, step = [], view.dtype.itemsize
    for n in reversed(tuple(view.shape)):
        strides.append(step)
        step *= n
    copy_into(as_strided(y, tuple(view.shape), tuple(reversed(strides))), view)
    return y


@cuda.jit(device=True, inline="always")
def _row_head_column(t, dst):
    """Element ``t`` of the C-ordered ``dst (rows, H, E)`` as its ``(row, head, column)``."""
    e = t % dst.shape[2]
    r = t // dst.shape[2]
    return r // dst.shape[1], r % dst.shape[1], e


@cuda.jit
def _gather(dst, cache, rows, page_size, n):
    """``dst[i, h, e] = cache[rows[i] // page_size, rows[i] % page_size, h, e]``."""
    t = cuda.grid(1)
    if t < n:
        i, h, e = _row_head_column(t, dst)
        row = rows[i]
        dst[i, h, e] = cache[row // page_size, row % page_size, h, e]


def gather_rows(cache, rows):
    """The rows ``rows`` (int64 device array of flat slots ``page * page_size + slot``) of the
    paged device cache ``cache (num_pages, page_size, H, E)`` (any strides), packed: a new
    C-contiguous ``(len(rows), H, E)`` device array of the cache's dtype (a bit copy)."""
    _, page_size, h, e = tuple(cache.shape)
    n_rows = int(rows.shape[0])
    y = device_array((n_rows, h, e), cache.dtype)
    n = n_rows * h * e
    if n:
        _gather[_grid(n)](_bits(y), _bits(cache), rows, page_size, n)
    return y


@cuda.jit
def _scatter_sum(dst, g, start, order, n):
    """Slot ``s`` of ``dst (slots, H, E)``: the sum, in float64 and in the order of
    ``order[start[s]:start[s + 1]]``, of the packed rows of ``g`` gathered from it (0 for a
    slot no sequence read), then stored in ``dst``'s dtype."""
    t = cuda.grid(1)
    if t < n:
        s, h, e = _row_head_column(t, dst)
        acc = 0.0
        for j in range(start[s], start[s + 1]):
            acc += np.float64(load(g[order[j], h, e]))
        dst[s, h, e] = store(acc, dst)


def scatter_sum_rows(g, rows_host, shape):
    """The gradients ``g (n, H, E)`` (device, of the packed rows gathered by
    :func:`gather_rows` from the flat slots ``rows_host``, a NumPy int64 array) summed back
    into their slots: a new C-contiguous device array of ``g``'s dtype and ``shape`` (the
    cache's: its slots, then ``(H, E)``), zero where no row came from.

    Deterministic, without atomics: each slot is summed by one thread per element, in float64,
    over its rows in packed order (a stable sort of ``rows_host`` on the host gives each slot's
    range), then rounded to ``g``'s dtype (bfloat16: through float32); the host's
    ``np.add.at`` in float64 adds in the same order.
    Atomic adds would be as fast here but leave the order of a shared slot's additions (and
    so its rounding) to the scheduler.
    """
    _, h, e = tuple(g.shape)
    shape = tuple(int(n) for n in shape)
    n_slots = int(np.prod(shape, dtype=np.int64)) // max(h * e, 1) if h * e else 0
    rows_host = np.asarray(rows_host, np.int64)
    order = np.argsort(rows_host, kind="stable").astype(np.int64)
    start = np.zeros(n_slots + 1, np.int64)
    np.cumsum(np.bincount(rows_host, minlength=n_slots), out=start[1:])
    y = device_array(shape, g.dtype)
    n = n_slots * h * e
    if n:
        item = g.dtype.itemsize
        flat = as_strided(y, (n_slots, h, e), (h * e * item, e * item, item))
        _scatter_sum[_grid(n)](storage_view(flat), storage_view(g), cuda.to_device(start),
                               cuda.to_device(order), n)
    return y
