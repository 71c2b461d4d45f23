"""Block masks: which (query block, key block) pairs of a ``mask_mod`` are empty, full or partial.

FlexAttention's idea (torch's ``create_block_mask``), for this library's kernels: a
:class:`BlockMask` evaluates a ``mask_mod`` once over every (batch, head, query, key) and keeps,
per block of :data:`Q_BLOCK` queries by :data:`K_BLOCK` keys, one state:

* ``BLOCK_EMPTY``: no key of the block takes part in any of its rows: the kernels skip it;
* ``BLOCK_FULL``: every key takes part: the kernels skip the per-element ``mask_mod``;
* ``BLOCK_PARTIAL``: the kernels call ``mask_mod`` element by element.

The block sizes are the CPU forward's query sub-block and key block (64 and 64); other kernels
read the states of the blocks their tiles cover. Pass the result as
``scaled_dot_product_attention(..., mask_mod=f, block_mask=bm)`` (or ``block_mask=bm`` alone:
it carries its ``mask_mod``); it is reusable across calls with the same shapes and the same
``mod_args`` contents — it is not recomputed, so a block mask built for other ``mod_args``
gives wrong results. Without a block mask, a ``mask_mod`` is evaluated at every element of
every block the window leaves (no block is skipped for it).
"""

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from .score.recipe import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL

#: Query rows per block (the CPU forward's query sub-block).
Q_BLOCK = 64
#: Keys per block (the CPU forward's key block).
K_BLOCK = 64

__all__ = ["BlockMask", "create_block_mask", "Q_BLOCK", "K_BLOCK", "BLOCK_EMPTY",
           "BLOCK_PARTIAL", "BLOCK_FULL"]


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The block states of a ``mask_mod`` (made by :func:`create_block_mask`).

    Attributes
    ----------
    states : ndarray of int8, shape (B, H, ceil(L / Q_BLOCK), ceil(S / K_BLOCK))
        ``BLOCK_EMPTY`` (0), ``BLOCK_PARTIAL`` (1) or ``BLOCK_FULL`` (2). ``B`` and ``H`` may
        be 1: the same states for every batch entry / head.
    mask_mod : Numba @njit function
        The ``mask_mod(b, h, i, j, *mod_args)`` the states were computed from.
    B, H, L, S : int
        The sizes it was made for (``B`` the flat batch size, ``H`` the query heads).
    """

    states: np.ndarray
    mask_mod: object
    B: int
    H: int
    L: int
    S: int

    @staticmethod
    def shape_for(L, S):
        """The (query blocks, key blocks) of an ``L`` x ``S`` problem."""
        return (-(-L // Q_BLOCK), -(-S // K_BLOCK))

    def sparsity(self):
        """The fraction of blocks that are empty (skipped)."""
        n = self.states.size
        return float(np.count_nonzero(self.states == BLOCK_EMPTY)) / n if n else 0.0

    def __repr__(self):
        counts = [int(np.count_nonzero(self.states == s))
                  for s in (BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL)]
        return (f"BlockMask(B={self.B}, H={self.H}, L={self.L}, S={self.S}, blocks "
                f"{Q_BLOCK}x{K_BLOCK}: {counts[0]} empty, {counts[1]} partial, "
                f"{counts[2]} full)")


@njit(parallel=True, cache=False)
def _states(mask_mod, B, H, L, S, mod_args, out):
    nqb, nkb = out.shape[2], out.shape[3]
    for t in prange(B * H * nqb):
        b = t // (H * nqb)
        h = (t // nqb) % H
        qb = t % nqb
        i0 = qb * Q_BLOCK
        i1 = min(L, i0 + Q_BLOCK)
        for kb in range(nkb):
            j0 = kb * K_BLOCK
            j1 = min(S, j0 + K_BLOCK)
            some = False
            every = True
            for i in range(i0, i1):
                for j in range(j0, j1):
                    if mask_mod(b, h, i, j, *mod_args):
                        some = True
                    else:
                        every = False
                if some and not every:
                    break
            out[b, h, qb, kb] = BLOCK_FULL if every else (BLOCK_PARTIAL if some
                                                          else BLOCK_EMPTY)


def create_block_mask(mask_mod, B, H, L, S, mod_args=()):
    """Evaluate ``mask_mod`` over a problem and keep each block's state (a :class:`BlockMask`).

    Parameters
    ----------
    mask_mod : Numba @njit function
        ``mask_mod(b, h, i, j, *mod_args) -> bool`` (True: key ``j`` takes part in row ``i``).
    B : int or None
        The flat batch size of the calls (the product of the batch dims), or None / 1 when the
        mask does not depend on ``b`` (then it is evaluated at ``b = 0``).
    H : int or None
        The query heads, or None / 1 when the mask does not depend on ``h`` (``h = 0``).
    L, S : int
        Query and key lengths.
    mod_args : tuple
        The arrays / numbers the calls pass as ``mod_args`` (their contents at this moment).

    Returns
    -------
    BlockMask

    Notes
    -----
    Costs one ``mask_mod`` call per element (``B·H·L·S``), in parallel; compiles once per
    ``mask_mod``.
    """
    from .problem.variants import check_function, check_mod_args

    sizes = {}
    for name, x in (("B", B), ("H", H), ("L", L), ("S", S)):
        if x is None and name in ("B", "H"):
            x = 1
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
        if x < (1 if name in ("B", "H") else 0):
            raise ValueError(f"{name} must be >= {1 if name in ('B', 'H') else 0}, got {x}")
        sizes[name] = int(x)
    mod_args = check_mod_args(mod_args)
    check_function("mask_mod", mask_mod, "mask", mod_args, np.dtype(np.float32))
    B, H, L, S = sizes["B"], sizes["H"], sizes["L"], sizes["S"]
    states = np.empty((B, H, *BlockMask.shape_for(L, S)), np.int8)
    if states.size:
        _states(mask_mod, B, H, L, S, mod_args, states)
    return BlockMask(states, mask_mod, B, H, L, S)

