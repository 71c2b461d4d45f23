"""Dropout's random stream in jitted code: the functions of :mod:`sdpa_numba.dropout`, written
once for both targets.

Only 64-bit unsigned integer adds, multiplies, shifts and xors (wrapping), so that the CPU
kernels (:mod:`sdpa_numba.cpu.dropout`) and the CUDA kernels (:mod:`sdpa_numba.gpu.dropout`:
numba-cuda compiles these ``@njit`` functions as device functions of its own, from the same
source) draw the same bits.
"""

import numpy as np
from numba import njit

from ..dropout import GAMMA, MIX1, MIX2
from ..options import INLINE

_GAMMA = np.uint64(GAMMA)
_MIX1 = np.uint64(MIX1)
_MIX2 = np.uint64(MIX2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)


@njit(**INLINE)
def mix64(z):
    """SplitMix64's finalizer (Stafford's Mix13) on a uint64."""
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@njit(**INLINE)
def stream_step(key, n):
    """``mix64(key + (n + 1) * GAMMA)``: the key of element ``n`` (``n >= 0``) under ``key``."""
    return mix64(key + np.uint64(n + 1) * _GAMMA)


@njit(**INLINE)
def head_key(seed, b, h):
    """The key of (flat batch index ``b``, query head ``h``) under ``seed``."""
    return stream_step(stream_step(seed, b), h)


@njit(**INLINE)
def kept(row_key, j, thresh):
    """Whether key column ``j`` of the row with ``row_key`` is kept."""
    return (stream_step(row_key, j) >> _S32) >= thresh
