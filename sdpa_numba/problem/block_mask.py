"""Block masks built: a ``mask_mod`` evaluated over a problem, per block of the score seam's
size (:mod:`sdpa_numba.score.blocks`), into the states the kernels read.

:func:`create_block_mask` is the public builder (re-exported as
:func:`sdpa_numba.create_block_mask`); :func:`with_block_mask` gives a call with a ``mask_mod``
and no block mask one of its own (:func:`call_states`), under the call's window, except for
small problems (:data:`BUILD_MIN_SCORES`).
"""

import functools
import math

import numpy as np
from numba import njit, prange

from ..score.blocks import (BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, K_BLOCK, Q_BLOCK, BlockMask,
                            block_counts)
from ..score.recipe import NO_LIMIT, key_range, recipe
from .variant_table import host_array
from .variants import check_function, check_mod_args


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
    shape = block_counts(L, S)
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
    states = np.empty((B, H, *block_counts(L, S)), np.int8)
    if states.size:
        _states(mask_mod, B, H, L, S, mod_args, 0, NO_LIMIT, NO_LIMIT, states)
    return BlockMask(states, mask_mod, B, H, L, S, Q_BLOCK, K_BLOCK)


def with_block_mask(r, batch, hq, L, S):
    """Recipe ``r`` of a (batch, Hq, L, S) attention call with a block mask for its
    ``mask_mod`` when it has none (:func:`call_states`: built under the window, or every
    block partial for small calls); else ``r``. For callers whose kernels read block masks of
    the call's L x S (the dense forward and backward, both targets)."""
    if r.mask_mod is None or r.block_mask is not None:
        return r
    return r._replace(block_mask=call_states(r.mask_mod, math.prod(batch), hq, L, S,
                                             r.mod_args, recipe(offset=r.offset,
                                                                left=r.left, right=r.right)))
