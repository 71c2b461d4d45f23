"""Dropout's random stream as CUDA device functions: the same bits as the CPU kernels.

Whether probability ``P[b, h, i, j]`` is kept is the counter-based SplitMix64 stream of
:mod:`sdpa_numba.dropout` (64-bit unsigned adds, multiplies, shifts and xors only). Its jitted
functions (:func:`sdpa_numba.score.dropout.head_key`, ``stream_step``, ``kept``) are written
once, as target-neutral ``@njit`` functions: numba-cuda compiles any CPU-jitted function that a kernel calls as a
device function of its own, from the same Python source. So the GPU runs the very code the CPU
runs, and the two cannot drift apart; the tests compare the decisions of the device functions
below with the NumPy reference :func:`sdpa_numba.dropout.keep_mask`. (On Numba's CUDA simulator
the calls run the CPU-compiled functions, which also spares the simulator NumPy's overflow
warnings on the stream's intended uint64 wraparound.)

The kernels take dropout as four runtime arguments, ``(seed, threshold, inv_keep,
batch_offset)`` of :func:`sdpa_numba.dropout.params`; ``inv_keep == 1.0`` means "off" (see
:data:`NO_DROPOUT`). Runtime rather than compile-time: one compiled kernel serves training and
inference, and "off" costs one uniform branch per key block.
"""

import numba
from numba import cuda

from ..dropout import NO_DROPOUT
from ..score.dropout import head_key, kept, stream_step

__all__ = ["NO_DROPOUT", "row_key", "row_keys", "dropout_factor"]


@cuda.jit(device=True, inline="always")
def row_key(seed, b, h, i):
    """The stream's key (uint64) of query row ``i`` of (flat batch index ``b``, query head
    ``h``)."""
    # The casts are no-ops on the device; on the simulator, the CPU-compiled functions return
    # Python ints, which would be typed int64 by the next call.
    return numba.uint64(stream_step(numba.uint64(head_key(seed, b, h)), i))


@cuda.jit(device=True, inline="always")
def row_keys(rk, n, seed, b, h, i0):
    """``rk[a] = row_key(seed, b, h, i0 + a)`` for ``a < n``: the keys of a thread's rows, drawn
    once and kept in a local uint64 array."""
    for a in range(n):
        rk[a] = row_key(seed, b, h, i0 + a)


@cuda.jit(device=True, inline="always")
def dropout_factor(rkey, j, threshold, inv_keep, zero):
    """``inv_keep`` if key ``j`` of the row with key ``rkey`` is kept, else ``zero``.

    ``threshold`` is :func:`sdpa_numba.dropout.threshold`'s (uint64); ``inv_keep`` and
    ``zero`` are of the compute dtype.
    """
    return inv_keep if kept(rkey, j, threshold) else zero
