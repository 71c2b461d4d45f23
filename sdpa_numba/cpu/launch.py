"""From a validated :class:`~sdpa_numba.problem.Plan` and NumPy arrays to the jitted forward.

The problem layer (:mod:`sdpa_numba.problem`) lays the operands out as strided views and splits
the batch into launches, with NumPy's ``as_strided`` (:func:`as_strided`); float16 is read as
uint16, bfloat16 as int16: nothing is copied. Every array is passed as an 'A'-layout array,
so each (dtype, mask kind) pair is one compiled specialization, whatever the inputs' layouts,
cached on disk.

The variants travel as the plan's recipe (:mod:`sdpa_numba.score.recipe`), with each launch's
batch offset: dense, causal, windowed, bottom-right and soft-capped attention share the one
specialization of their (dtype, mask kind, dropout); ALiBi, sinks, a score_mod or mask_mod
and a block mask each change the recipe's type, so they compile their own.
"""

import numpy as np
from numba import from_dtype, typeof, types

from .._runtime import compile_entry, kernel_launch
from ..dropout import NO_DROPOUT
from ..problem import compute_dtype, for_each_launch, operand_views, row_view
from ..score.recipe import CAUSAL, DENSE, has_optional_parts, with_batch_offset
from .forward import ensure_soft_cap, forward
from .storage import is_bfloat16, storage_view

_NB = {np.dtype(np.float16): types.uint16, np.dtype(np.float32): types.float32,
       np.dtype(np.float64): types.float64}
_entries = {}
#: The Numba type of every recipe without optional parts (dense, causal, windows, soft cap).
PLAIN_RECIPE = typeof(DENSE)
#: Numba type of the kernels' ``dropout`` argument when dropout is on.
DROPOUT_TYPE = types.Tuple((types.uint64, types.uint64, types.float64, types.int64))


def arr(dt, nd, readonly):
    """An 'A'-layout (any strides) array type: one specialization whatever the layout."""
    return types.Array(dt, nd, "A", readonly=readonly)


def kernel_types(dtype, mask_kind):
    """Numba types of a storage dtype: (storage, compute, mask argument)."""
    st = types.int16 if is_bfloat16(dtype) else _NB[np.dtype(dtype)]
    ct = from_dtype(compute_dtype(dtype))
    mask_t = {"none": types.none, "bool": arr(types.boolean, 4, True),
              "additive": arr(st, 4, True)}[mask_kind]
    return st, ct, mask_t


#: The Python types of a recipe's numbers (offset, left, right, chunk, softcap, batch_offset)
#: whose Numba types are PLAIN_RECIPE's.
_PLAIN_NUMBERS = (np.int64, np.int64, np.int64, np.int64, np.float64, np.int64)


def recipe_type(r):
    """The Numba type of recipe ``r`` (cheap for the plain ones: dense, causal, windows, soft
    cap; ``typeof`` of a recipe took ~0.17 ms, 1% of a causal sliding-window call at B1 H8
    L2048 D64)."""
    if r is DENSE or r is CAUSAL:
        return PLAIN_RECIPE
    if (type(r.mod_args) is tuple and not has_optional_parts(r)
            and all(type(x) is t for x, t in zip(r[:len(_PLAIN_NUMBERS)], _PLAIN_NUMBERS))):
        return PLAIN_RECIPE
    return typeof(r)


def signature(dtype, mask_kind, dropout=False, recipe_t=PLAIN_RECIPE):
    """The forward's Numba signature for a storage dtype, mask kind, dropout on/off and the
    recipe's type."""
    st, ct, mask_t = kernel_types(dtype, mask_kind)
    return (arr(st, 4, True), arr(st, 4, True), arr(st, 4, True), mask_t, types.boolean,
            types.float64, arr(st, 4, False), arr(ct, 3, False),
            DROPOUT_TYPE if dropout else types.none, recipe_t)


#: The plain recipe's entries by (dtype, mask kind, dropout) alone: hashing a key that holds
#: a Numba type hashes its every field, ~5 us of a small call's host time.
_plain_entries = {}


def _entry(dtype, mask_kind, dropout=False, recipe_t=PLAIN_RECIPE):
    """The compiled forward for a storage dtype, mask kind, dropout on/off and recipe type
    (compiled once, then cached)."""
    if recipe_t is PLAIN_RECIPE:
        e = _plain_entries.get((dtype, mask_kind, dropout))
        if e is not None:
            return e
    key = (dtype, mask_kind, dropout, recipe_t)
    if key not in _entries:
        sig = signature(dtype, mask_kind, dropout, recipe_t)
        _entries[key] = compile_entry(forward, sig)
    if recipe_t is PLAIN_RECIPE:
        _plain_entries[(dtype, mask_kind, dropout)] = _entries[key]
    return _entries[key]


#: Storage dtypes that the kernels read as they are (no uint16 / int16 view).
_AS_IS = (np.dtype(np.float32), np.dtype(np.float64))


def _same(a):
    return a


def storage_views(dtype):
    """The function giving the kernels' view of an array of storage dtype ``dtype``:
    :func:`~.storage.storage_view`, or the identity where there is nothing to view (float32,
    float64: skips a dtype test per array and call)."""
    return _same if dtype in _AS_IS else storage_view


def as_strided(x, shape, strides):
    """The host target's ``as_strided`` for :mod:`sdpa_numba.problem` (NumPy's, keeping
    ``x``'s writeability); one leading dim of size 1 added is ``x[None]`` (much cheaper)."""
    if len(shape) == x.ndim + 1 and shape[0] == 1 and shape[1:] == x.shape \
            and strides[1:] == x.strides:
        return x[None]
    return np.lib.stride_tricks.as_strided(x, shape, strides)


def run(p, query, key, value, attn_mask, out, dropout=None):
    """Compute attention on the CPU for plan ``p``; returns ``(out, lse)``.

    ``dropout``: None or :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    q, k, v, mask = operand_views(p, query, key, value, attn_mask, as_strided)
    result = np.empty(p.out_shape, p.dtype) if out is None else out
    lse = np.empty((*p.batch, p.hq, p.L), p.compute_dtype)

    r = p.recipe
    sv = storage_views(p.dtype)  # a bool mask is read as it is in every case

    def launch(arrays, drop):
        fq, fk, fv, fm, fo, fl = arrays
        # drop always carries the launch's batch offset (NO_DROPOUT's when dropout is off).
        rl = r if drop[3] == 0 else with_batch_offset(r, drop[3])
        entry(sv(fq), sv(fk), sv(fv), None if fm is None else storage_view(fm), p.is_causal,
              p.scale, sv(fo), fl, None if dropout is None else drop, rl)

    with kernel_launch():  # first: it refuses what would crash the process
        entry = _entry(p.dtype, p.mask_kind, dropout is not None, recipe_type(r))
        if r.softcap > 0:  # its passes, compiled on first use, before the threads need them
            ensure_soft_cap(p.compute_dtype)
        for_each_launch(p.batch, [q, k, v, mask, row_view(p, result, p.Ev, as_strided), lse],
                        NO_DROPOUT if dropout is None else dropout, launch, as_strided)
    return result, lse.reshape(p.out_shape[:-1])
