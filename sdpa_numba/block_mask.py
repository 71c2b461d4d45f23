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
gives wrong results. A call with a ``mask_mod`` and no block mask builds one for itself
(:func:`call_states`), under the call's window, except for small problems.
"""

import functools
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from .score.recipe import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, NO_LIMIT, key_range, recipe

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


@njit(cache=False)
def _keep_row(mask_mod, b, h, i, n, mod_args, keep):
    """``keep[j] = mask_mod(b, h, i, j, *mod_args)`` for keys ``0..n-1``. From 0, in a
    function of its own: then ``j >= 0`` is visible, the user's ``a[j]`` needs no
    wraparound select, and the loop vectorizes (from a run-time start it did not: a document
    mask took 1.8 ns per key against 0.2)."""
    for j in range(n):
        keep[j] = 1 if mask_mod(b, h, i, j, *mod_args) else 0


@njit(cache=False)
def _count(keep):
    """The number of nonzero entries of int8 ``keep`` (0 or 1 each)."""
    n = 0
    for j in range(keep.shape[0]):
        n += keep[j]
    return n


@njit(parallel=True, cache=False)
def _states(mask_mod, B, H, L, S, mod_args, offset, left, right, out):
    """``out[b, h, qb, kb]``: the state of each block, counting only the elements that the
    window (``offset``, ``left``, ``right``, as in a recipe) leaves; a block it leaves none
    of is empty."""
    nqb, nkb = out.shape[2], out.shape[3]
    for t in prange(B * H * nqb):
        window = recipe(offset=offset, left=left, right=right)  # (a recipe cannot enter prange)
        b = t // (H * nqb)
        h = (t // nqb) % H
        qb = t % nqb
        keep = np.empty(S, np.int8)
        kept = np.zeros(nkb, np.int64)
        seen = np.zeros(nkb, np.int64)
        for i in range(qb * Q_BLOCK, min(L, qb * Q_BLOCK + Q_BLOCK)):
            lo, hi = key_range(window, i, i, S)
            if lo >= hi:
                continue
            _keep_row(mask_mod, b, h, i, hi, mod_args, keep)
            for kb in range(lo // K_BLOCK, (hi - 1) // K_BLOCK + 1):
                j0 = max(lo, kb * K_BLOCK)
                j1 = min(hi, kb * K_BLOCK + K_BLOCK)
                kept[kb] += _count(keep[j0:j1])
                seen[kb] += j1 - j0
        for kb in range(nkb):
            out[b, h, qb, kb] = (BLOCK_EMPTY if kept[kb] == 0 else
                                 BLOCK_FULL if kept[kb] == seen[kb] else BLOCK_PARTIAL)


@functools.lru_cache(maxsize=256)
def _reads(f, n):
    """Whether Python function ``f`` may read its ``n``-th positional parameter: False only
    when that parameter is named and no instruction of ``f`` (or of a function nested in it)
    loads it, so its result cannot depend on it."""
    import dis
    import inspect

    params = list(inspect.signature(f).parameters.values())
    if n >= len(params) or params[n].kind not in (params[n].POSITIONAL_ONLY,
                                                  params[n].POSITIONAL_OR_KEYWORD):
        return True
    name = params[n].name

    def loads(code):
        for ins in dis.get_instructions(code):
            if ins.opname.startswith("LOAD_") and (
                    ins.argval == name or (isinstance(ins.argval, tuple) and name in ins.argval)):
                return True
        return any(loads(c) for c in code.co_consts if hasattr(c, "co_code"))

    return loads(f.__code__)


#: Scores of a call (B·Hq·L·S) below which its mask_mod gets no block mask built (every
#: block partial: the mask_mod per element, as without one): building costs a parallel
#: launch and host work (0.2-0.3 ms here) and a mask_mod call per score of each (b, h) it
#: depends on, more than it saves on small problems. Measured with
#: scripts/block_mask_build.py (4 documents, D64), the time built per call against per
#: element: H8 L=S=64 1.07, H8 128 1.08, H1 256 0.93, H1 512 0.81, H8 256 0.74.
BUILD_MIN_SCORES = 4 * 256 * 256


def call_states(mask_mod, B, H, L, S, mod_args, window):
    """The block states a call with this ``mask_mod`` (and no block mask of its own) runs
    with: evaluated under the recipe ``window`` (offset, sides) per batch entry and head — or
    once for all where ``mask_mod`` never reads ``b`` / ``h`` — or, for problems under
    :data:`BUILD_MIN_SCORES`, every block partial. ``mod_args`` may hold CUDA arrays (they
    are copied to the host). Arguments are trusted."""
    from .problem.variants import host_array

    shape = BlockMask.shape_for(L, S)
    if B * H * L * S < BUILD_MIN_SCORES:
        return np.full((1, 1, *shape), BLOCK_PARTIAL, np.int8)
    f = mask_mod.py_func
    B = B if _reads(f, 0) else 1
    H = H if _reads(f, 1) else 1
    mod_args = tuple(x if isinstance(x, (np.ndarray, bool, int, float, np.generic))
                     else host_array("mod_args", x) for x in mod_args)
    out = np.empty((B, H, *shape), np.int8)
    _states(mask_mod, B, H, L, S, mod_args, window.offset, window.left, window.right, out)
    return out


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
        _states(mask_mod, B, H, L, S, mod_args, 0, NO_LIMIT, NO_LIMIT, states)
    return BlockMask(states, mask_mod, B, H, L, S)

