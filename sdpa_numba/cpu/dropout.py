"""Dropout in the CPU kernels: the stream of :mod:`sdpa_numba.score.dropout` (written once for
both targets; its functions are re-exported here) applied per head and per tile. The kernels
take a ``dropout`` argument that is None (no dropout) or the tuple ``(seed, threshold, inv_keep, batch_offset)`` of
:func:`sdpa_numba.dropout.params`.
"""

from numba import types
from numba.extending import overload

from ..score.dropout import head_key, kept, mix64, stream_step
from .options import FASTMATH
from ..score.numbers import cast

__all__ = ["mix64", "stream_step", "head_key", "kept", "head_dropout", "drop_tile"]


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
