"""From a validated :class:`~sdpa_numba.api.Plan` and NumPy arrays to the jitted forward.

Operands become strided 4-D views (broadcast dims get stride 0, float16 is read as uint16,
bfloat16 as int16): nothing is copied. Every array is passed as an 'A'-layout array, so each (dtype, mask kind)
pair is one compiled specialization, whatever the inputs' layouts, cached on disk.
"""

import dataclasses
import math

import numpy as np
from numba import types

from .._runtime import compile_entry, kernel_launch
from .forward import forward
from .storage import is_bfloat16, storage_view

_NB = {np.dtype(np.float16): types.uint16, np.dtype(np.float32): types.float32,
       np.dtype(np.float64): types.float64}
_entries = {}
#: Numba type of the kernels' ``dropout`` argument when dropout is on.
DROPOUT_TYPE = types.Tuple((types.uint64, types.uint64, types.float64, types.int64))


def arr(dt, nd, readonly):
    """An 'A'-layout (any strides) array type: one specialization whatever the layout."""
    return types.Array(dt, nd, "A", readonly=readonly)


def kernel_types(dtype, mask_kind):
    """Numba types of a storage dtype: (storage, compute, mask argument)."""
    st = types.int16 if is_bfloat16(dtype) else _NB[np.dtype(dtype)]
    ct = types.float64 if st == types.float64 else types.float32
    mask_t = {"none": types.none, "bool": arr(types.boolean, 4, True),
              "additive": arr(st, 4, True)}[mask_kind]
    return st, ct, mask_t


def signature(dtype, mask_kind, dropout=False):
    """The forward's Numba signature for a storage dtype, mask kind and dropout on/off."""
    st, ct, mask_t = kernel_types(dtype, mask_kind)
    return (arr(st, 4, True), arr(st, 4, True), arr(st, 4, True), mask_t, types.boolean,
            types.float64, arr(st, 4, False), arr(ct, 3, False),
            DROPOUT_TYPE if dropout else types.none)


def _entry(dtype, mask_kind, dropout=False):
    """The compiled forward for a storage dtype, mask kind and dropout on/off (compiled once,
    then cached)."""
    key = (dtype, mask_kind, dropout)
    if key not in _entries:
        sig = signature(dtype, mask_kind, dropout)
        _entries[key] = compile_entry(forward, sig)
    return _entries[key]


def _flatten_batch(arrays, nb):
    """Merge the ``nb`` leading dims of every array into one, as views; None if impossible."""
    merged = []
    for a in arrays:
        if a is None:
            merged.append(None)
            continue
        try:
            merged.append(a.reshape((math.prod(a.shape[:nb]),) + a.shape[nb:], copy=False))
        except ValueError:
            return None
    return merged


def _launch(p, q, k, v, mask, out, lse, dropout=None):
    nb = len(p.batch)
    if nb == 1:
        flat = [q, k, v, mask, out, lse]
    elif nb == 0:
        flat = [None if a is None else a[None] for a in (q, k, v, mask, out, lse)]
    else:
        flat = _flatten_batch([q, k, v, mask, out, lse], nb)
        if flat is None:  # batch dims that no view can merge: one launch per leading index
            inner = math.prod(p.batch[1:])
            for i in range(p.batch[0]):
                # dropout's batch index stays the flat index into the whole batch
                sub = None if dropout is None else (*dropout[:3], dropout[3] + i * inner)
                _launch(dataclasses.replace(p, batch=p.batch[1:]),
                        *(None if a is None else a[i] for a in (q, k, v, mask, out, lse)), sub)
            return
    fq, fk, fv, fm, fo, fl = flat
    _entry(p.dtype, p.mask_kind, dropout is not None)(
        storage_view(fq), storage_view(fk), storage_view(fv),
        None if fm is None else storage_view(fm), p.is_causal, p.scale, storage_view(fo), fl,
        dropout)


def batched_view(p, x, heads, rows, cols):
    """``x`` seen as ``(*p.batch, heads, rows, cols)``: leading 1s added, broadcast dims at
    stride 0 (a view, never a copy)."""
    x = x.reshape((1,) * (len(p.batch) + 3 - x.ndim) + x.shape)
    return np.broadcast_to(x, (*p.batch, heads, rows, cols))


def operand_views(p, query, key, value, attn_mask):
    """The kernels' views of query, key, value and the mask (None stays None)."""
    return (batched_view(p, query, p.hq, p.L, p.E), batched_view(p, key, p.h, p.S, p.E),
            batched_view(p, value, p.h, p.S, p.Ev),
            None if attn_mask is None else batched_view(p, attn_mask, p.hq, p.L, p.S))


def run(p, query, key, value, attn_mask, out, dropout=None):
    """Compute attention on the CPU for plan ``p``; returns ``(out, lse)``.

    ``dropout``: None or :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    full = (*p.batch, p.hq)
    q, k, v, mask = operand_views(p, query, key, value, attn_mask)
    result = np.empty(p.out_shape, p.dtype) if out is None else out
    o = result.reshape((*full, p.L, p.Ev), copy=False)
    lse = np.empty((*full, p.L), p.compute_dtype)
    with kernel_launch():
        _launch(p, q, k, v, mask, o, lse, dropout)
    return result, lse.reshape(p.out_shape[:-1])
