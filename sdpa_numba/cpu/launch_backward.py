"""From a validated :class:`~sdpa_numba.api.Plan` and NumPy arrays to the jitted backward.

As for the forward (:mod:`.launch`): operands become strided 4-D views (nothing copied), every
array is passed as an 'A'-layout array, one compiled specialization per dtype and mask kind
(bool or additive; no mask is an empty bool mask), cached on disk. Dropout and the mask
gradient are runtime arguments of that one specialization (a dropout tuple with
``inv_keep == 1`` is "off"; an empty ``dmask`` is "not wanted"), so they cost no extra
compilation.

The kernel writes gradients of the full broadcast shapes in the compute dtype; they are then
summed over each input's broadcast dims (NumPy's deterministic reductions) and cast to the
input dtype.
"""

import dataclasses
import math

import numpy as np
from numba import types

from .._runtime import compile_entry, kernel_launch
from .backward import backward
from .launch import (DROPOUT_TYPE, _flatten_batch, arr, batched_view, kernel_types,
                     operand_views)
from .storage import storage_view

_entries = {}
_NO_DROPOUT = (np.uint64(0), np.uint64(0), 1.0, 0)
_NO_MASK = np.zeros((0, 0, 0, 0), np.bool_)


def signature(dtype, mask_kind):
    """The backward's Numba signature for a storage dtype and mask kind."""
    st, ct, mask_t = kernel_types(dtype, mask_kind)
    ro = arr(st, 4, True)
    return (ro, ro, ro, mask_t, types.boolean, types.float64, ro, ro, arr(ct, 3, True),
            arr(ct, 4, False), arr(ct, 4, False), arr(ct, 4, False), DROPOUT_TYPE,
            arr(ct, 4, False))


def _entry(dtype, mask_kind):
    """The compiled backward for a storage dtype and mask kind (compiled once, then cached)."""
    key = (dtype, mask_kind)
    if key not in _entries:
        sig = signature(dtype, mask_kind)
        _entries[key] = compile_entry(backward, sig)
    return _entries[key]


def _launch(p, arrays, dropout):
    """``arrays``: q, k, v, mask, dout, out, lse, dq, dk, dv, dmask (mask, dmask may be None)."""
    nb = len(p.batch)
    if nb == 1:
        flat = list(arrays)
    elif nb == 0:
        flat = [None if a is None else a[None] for a in arrays]
    else:
        flat = _flatten_batch(arrays, nb)
        if flat is None:  # batch dims that no view can merge: one launch per leading index
            inner = math.prod(p.batch[1:])
            for i in range(p.batch[0]):
                sub = (*dropout[:3], dropout[3] + i * inner)
                _launch(dataclasses.replace(p, batch=p.batch[1:]),
                        [None if a is None else a[i] for a in arrays], sub)
            return
    q, k, v, mask, dout, out, lse, dq, dk, dv, dmask = flat
    if dmask is None:
        dmask = np.zeros((0, 0, 0, 0), p.compute_dtype)
    if mask is None:  # no mask: an empty bool mask, so it shares the bool specialization
        mask = _NO_MASK
    sv = storage_view
    _entry(p.dtype, "additive" if p.mask_kind == "additive" else "bool")(
        sv(q), sv(k), sv(v), None if mask is None else sv(mask), p.is_causal, p.scale,
        sv(dout), sv(out), lse, dq, dk, dv, dropout, dmask)


def reduce_to(x, shape):
    """Sum ``x`` over the dims that broadcasting added or stretched to reach ``x.shape``."""
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    if lead:
        x = x.sum(axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


def run_backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout, mask_grad):
    """Gradients on the CPU for plan ``p``: ``(dq, dk, dv, dmask)`` in the inputs' dtype and
    shapes (``dmask`` None unless ``mask_grad``).

    ``dropout``: None or :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    full = (*p.batch, p.hq)
    ct = p.compute_dtype
    q, k, v, mask = operand_views(p, query, key, value, attn_mask)
    dout = batched_view(p, grad_out, p.hq, p.L, p.Ev)
    o = batched_view(p, out, p.hq, p.L, p.Ev)
    lse4 = np.reshape(lse, (*full, p.L))
    dq = np.empty((*full, p.L, p.E), ct)
    dk = np.empty((*p.batch, p.h, p.S, p.E), ct)
    dv = np.empty((*p.batch, p.h, p.S, p.Ev), ct)
    dmask = np.empty((*full, p.L, p.S), ct) if mask_grad else None
    with kernel_launch():
        _launch(p, [q, k, v, mask, dout, o, lse4, dq, dk, dv, dmask],
                _NO_DROPOUT if dropout is None else dropout)

    def final(g, x):
        return reduce_to(g, x.shape).astype(p.dtype, copy=False)

    return (final(dq, query), final(dk, key), final(dv, value),
            None if dmask is None else final(dmask, attn_mask))
