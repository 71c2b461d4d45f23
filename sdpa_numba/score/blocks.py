"""Block masks as data: their block size, their states, and the :class:`BlockMask` type.

A block mask keeps, per block of :data:`Q_BLOCK` query rows by :data:`K_BLOCK` keys of a
``mask_mod``, one state:

* ``BLOCK_EMPTY``: no key of the block takes part in any of its rows: the kernels skip it;
* ``BLOCK_FULL``: every key takes part: the kernels skip the per-element ``mask_mod``;
* ``BLOCK_PARTIAL``: the kernels call ``mask_mod`` element by element.

This module owns the block size: the CPU forward's tile is tied to it (its key block is
:data:`K_BLOCK`, and it refuses to import if its query sub-block is not :data:`Q_BLOCK`), the
CPU backward reads the states at it, and the CUDA launchers pass it to their kernels (whose
tiles need not match it). The masks are built by :mod:`sdpa_numba.problem.block_mask`.
"""

from dataclasses import dataclass

import numpy as np

__all__ = ["Q_BLOCK", "K_BLOCK", "BLOCK_EMPTY", "BLOCK_PARTIAL", "BLOCK_FULL", "block_counts",
           "BlockMask"]

#: Query rows per block (the CPU forward's query sub-block).
Q_BLOCK = 64
#: Keys per block (the CPU forward's key block).
K_BLOCK = 64

#: Block-mask states of a (query block, key block) pair.
BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL = 0, 1, 2


def block_counts(L, S, q_block=Q_BLOCK, k_block=K_BLOCK):
    """``(query blocks, key blocks)`` of an ``L`` x ``S`` problem."""
    return (-(-L // q_block), -(-S // k_block))


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The block states of a ``mask_mod`` (made by :func:`sdpa_numba.create_block_mask`).

    Attributes
    ----------
    states : ndarray of int8, shape (B, H, ceil(L / q_block), ceil(S / k_block))
        ``BLOCK_EMPTY`` (0), ``BLOCK_PARTIAL`` (1) or ``BLOCK_FULL`` (2). ``B`` and ``H`` may
        be 1: the same states for every batch entry / head.
    mask_mod : Numba @njit function
        The ``mask_mod(b, h, i, j, *mod_args)`` the states were computed from.
    B, H, L, S : int
        The sizes it was made for (``B`` the flat batch size, ``H`` the query heads).
    q_block, k_block : int
        Query rows and keys per block: :data:`Q_BLOCK` and :data:`K_BLOCK`, the only sizes
        the kernels read.
    """

    states: np.ndarray
    mask_mod: object
    B: int
    H: int
    L: int
    S: int
    q_block: int = Q_BLOCK
    k_block: int = K_BLOCK

    @staticmethod
    def shape_for(L, S):
        """The (query blocks, key blocks) of an ``L`` x ``S`` problem."""
        return block_counts(L, S)

    def sparsity(self):
        """The fraction of blocks that are empty (skipped)."""
        n = self.states.size
        return float(np.count_nonzero(self.states == BLOCK_EMPTY)) / n if n else 0.0

    def __repr__(self):
        counts = [int(np.count_nonzero(self.states == s))
                  for s in (BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL)]
        return (f"BlockMask(B={self.B}, H={self.H}, L={self.L}, S={self.S}, blocks "
                f"{self.q_block}x{self.k_block}: {counts[0]} empty, {counts[1]} partial, "
                f"{counts[2]} full)")
