"""From a validated :class:`~sdpa_numba.problem.Plan` and NumPy arrays to the jitted backward.

As for the forward (:mod:`.launch`): the problem layer lays the operands out as strided views
(nothing copied) and splits the batch into launches; every array is passed as an 'A'-layout
array, one compiled specialization per dtype, mask kind (bool or additive) and recipe type,
cached on disk. "No mask" and "no mask gradient" are None, passed as Numba Optional types:
no mask shares the bool mask's specialization, and the mask gradient is a run-time choice of
that one specialization, as is dropout (a dropout tuple with ``inv_keep == 1`` is "off"), so
they cost no extra compilation.

The kernel writes gradients of the full broadcast shapes in the compute dtype; they are then
summed over each input's broadcast dims (:func:`sdpa_numba.problem.sum_to`: NumPy's
deterministic reductions) and cast to the input dtype.
"""

import numpy as np
from numba import types

from .._runtime import compile_entry, kernel_launch
from ..dropout import NO_DROPOUT
from ..problem import for_each_launch, operand_views, row_view, sum_to
from ..score.recipe import with_batch_offset
from .backward import backward
from .launch import (DROPOUT_TYPE, PLAIN_RECIPE, arr, as_strided, kernel_types, recipe_type,
                     storage_views)
from .storage import storage_view

_entries = {}


def signature(dtype, mask_kind, recipe_type=PLAIN_RECIPE):
    """The backward's Numba signature for a storage dtype, mask kind and recipe type (the
    Numba type of a :class:`~sdpa_numba.score.recipe.Recipe`: every recipe without optional
    parts, i.e. dense, causal, windowed, bottom-right and soft-capped attention, has one)."""
    st, ct, mask_t = kernel_types(dtype, mask_kind)
    if mask_kind != "additive":  # None or a bool mask: one specialization
        mask_t = types.Optional(kernel_types(dtype, "bool")[2])
    ro = arr(st, 4, True)
    return (ro, ro, ro, mask_t, types.boolean, types.float64, ro, ro, arr(ct, 3, True),
            arr(ct, 4, False), arr(ct, 4, False), arr(ct, 4, False), DROPOUT_TYPE,
            types.Optional(arr(ct, 4, False)), recipe_type)


#: The plain recipe's entries by (dtype, mask kind) alone (as the forward's: hashing a Numba
#: type costs microseconds of a small call).
_plain_entries = {}


def _entry(dtype, mask_kind, recipe_type=PLAIN_RECIPE):
    """The compiled backward for a storage dtype, mask kind and recipe type (compiled once,
    then cached)."""
    if recipe_type is PLAIN_RECIPE:
        e = _plain_entries.get((dtype, mask_kind))
        if e is not None:
            return e
    key = (dtype, mask_kind, recipe_type)
    if key not in _entries:
        sig = signature(dtype, mask_kind, recipe_type)
        _entries[key] = compile_entry(backward, sig)
    if recipe_type is PLAIN_RECIPE:
        _plain_entries[(dtype, mask_kind)] = _entries[key]
    return _entries[key]


def run_backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout, mask_grad):
    """Gradients on the CPU for plan ``p``: ``(dq, dk, dv, dmask)`` in the inputs' dtype and
    shapes (``dmask`` None unless ``mask_grad``).

    ``dropout``: None or :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    full = (*p.batch, p.hq)
    ct = p.compute_dtype
    q, k, v, mask = operand_views(p, query, key, value, attn_mask, as_strided)
    dout = row_view(p, grad_out, p.Ev, as_strided)
    o = row_view(p, out, p.Ev, as_strided)
    lse4 = np.reshape(lse, (*full, p.L))
    dq = np.empty((*full, p.L, p.E), ct)
    dk = np.empty((*p.batch, p.h, p.S, p.E), ct)
    dv = np.empty((*p.batch, p.h, p.S, p.Ev), ct)
    dmask = np.empty((*full, p.L, p.S), ct) if mask_grad else None
    sv = storage_views(p.dtype)

    def launch(arrays, drop):
        bq, bk, bv, bm, bdo, bo, bl, bdq, bdk, bdv, bdm = arrays
        entry(sv(bq), sv(bk), sv(bv), None if bm is None else storage_view(bm), p.is_causal,
              p.scale, sv(bdo), sv(bo), bl, bdq, bdk, bdv, drop, bdm,
              r if drop[3] == 0 else with_batch_offset(r, drop[3]))

    with kernel_launch():  # first: it refuses what would crash the process
        r = p.recipe
        # recipe_type: typeof(r), cheaply for the plain recipes (typeof took ~20 us)
        entry = _entry(p.dtype, "additive" if p.mask_kind == "additive" else "bool",
                       recipe_type(r))
        for_each_launch(p.batch, [q, k, v, mask, dout, o, lse4, dq, dk, dv, dmask],
                        NO_DROPOUT if dropout is None else dropout, launch, as_strided)

    def final(g, x):
        return sum_to(g, x.shape).astype(p.dtype, copy=False)

    return (final(dq, query), final(dk, key), final(dv, value),
            None if dmask is None else final(dmask, attn_mask))

