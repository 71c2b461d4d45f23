"""The CPU forward's tiles, for tools that model its work without importing the kernels (the
``variants`` benchmark, scripts/variant_ratios.py): the block sizes of
:func:`sdpa_numba.cpu.forward.forward` and the fraction of the scores it computes under a
window and chunks.

The sizes come from the score seam (:mod:`sdpa_numba.score.blocks`), which owns them: the CPU
forward refuses to import unless its tile (``BM`` x ``BN``) is the seam's block."""

from .score.blocks import K_BLOCK, Q_BLOCK

#: Query rows per score tile of the CPU forward.
QUERY_BLOCK = Q_BLOCK
#: Keys per key/value block of the CPU forward.
KEY_BLOCK = K_BLOCK


def visited_fraction(L, S, left, right, offset=0, chunk=None):
    """The fraction of the L x S scores the CPU forward computes under a window (and chunks
    of ``chunk`` positions, None: none): per query
    sub-block of :data:`QUERY_BLOCK` rows, the key blocks of :data:`KEY_BLOCK` keys from the
    first to the last key any of its rows sees (cut at that last key), as
    :func:`sdpa_numba.cpu.forward.attend_rows` visits them. ``None``: an unlimited side."""
    left = S + L if left is None else left
    right = S + L if right is None else right
    total = 0
    for i_first in range(0, L, QUERY_BLOCK):
        i_last = min(L, i_first + QUERY_BLOCK) - 1
        lo = max(i_first + offset - left, 0)
        hi = min(i_last + offset + right + 1, S)
        if chunk is not None:  # the seam's key_range: from the first row's chunk to the last's
            lo = max(lo, (i_first + offset) // chunk * chunk)
            hi = min(hi, ((i_last + offset) // chunk + 1) * chunk)
        if hi > lo:
            total += (hi - lo // KEY_BLOCK * KEY_BLOCK) * (i_last - i_first + 1)
    return total / (L * S)
