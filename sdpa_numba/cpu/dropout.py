"""Dropout's random stream in jitted code: the functions of :mod:`sdpa_numba.dropout`.

Only 64-bit unsigned integer adds, multiplies, shifts and xors (wrapping), so that a CUDA
device function can mirror them bit for bit. The kernels take a ``dropout`` argument that is
None (no dropout) or the tuple ``(seed, threshold, inv_keep, batch_offset)`` of
:func:`sdpa_numba.dropout.params`.
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..dropout import GAMMA, MIX1, MIX2
from .options import FASTMATH, INLINE
from .storage import cast

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


def head_dropout(dropout, b, h):
    """Per-head dropout state ``(head_key, threshold, inv_keep)``, or None (jitted only)."""
    raise NotImplementedError("head_dropout is only callable from jitted code")


@overload(head_dropout, fastmath=FASTMATH)
def _head_dropout(dropout, b, h):
    if isinstance(dropout, (types.NoneType, types.Omitted)):
        return lambda dropout, b, h: None
    return lambda dropout, b, h: (head_key(dropout[0], dropout[3] + b, h), dropout[1],
                                  dropout[2])


def drop_tile(tile, ld, n_keys, dropout, i_first, j0):
    """Dropout on a transposed probability tile (jitted code only).

    ``tile`` points to ``n_keys`` rows (keys ``j0 ...``) of ``ld`` query lanes (rows
    ``i_first ...``); ``dropout`` is None (nothing happens) or :func:`head_dropout`'s state.
    Dropped entries become 0, kept ones are multiplied by ``1 / (1 - p)``.
    """
    raise NotImplementedError("drop_tile is only callable from jitted code")


@overload(drop_tile, fastmath=FASTMATH)
def _drop_tile(tile, ld, n_keys, dropout, i_first, j0):
    if isinstance(dropout, (types.NoneType, types.Omitted)):
        return lambda tile, ld, n_keys, dropout, i_first, j0: None

    def impl(tile, ld, n_keys, dropout, i_first, j0):
        thresh = dropout[1]
        inv = cast(dropout[2], tile[0])
        zero = cast(0.0, tile[0])
        for i in range(ld):
            rk = stream_step(dropout[0], i_first + i)
            for j in range(n_keys):
                t = j * ld + i
                tile[t] = tile[t] * inv if kept(rk, j0 + j, thresh) else zero

    return impl
