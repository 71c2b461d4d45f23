"""From a validated :class:`~sdpa_numba.problem.varlen.VarlenPlan` and NumPy arrays to the
jitted varlen kernels (:mod:`.varlen`).

The packed operands are passed as they are (any strides, float16 as uint16, bfloat16 as
int16: nothing copied), as 'A'-layout arrays: one compiled specialization per storage dtype,
dropout on/off (forward) and recipe type, cached on disk, as for the dense launchers. The
alignment is a run-time flag.
"""

import numpy as np
from numba import types

from .._runtime import compile_entry, kernel_launch
from ..dropout import NO_DROPOUT
from .launch import DROPOUT_TYPE, PLAIN_RECIPE, arr, kernel_types, recipe_type, storage_views
from .varlen import varlen_backward, varlen_forward

_entries = {}
_CU = arr(types.int64, 1, True)


def forward_signature(dtype, dropout, recipe_t):
    """The varlen forward's Numba signature."""
    st, ct, _ = kernel_types(dtype, "none")
    ro = arr(st, 3, True)
    return (ro, ro, ro, _CU, _CU, types.boolean, types.float64, arr(st, 3, False),
            arr(ct, 2, False), DROPOUT_TYPE if dropout else types.none, recipe_t,
            types.boolean)


def backward_signature(dtype, recipe_t):
    """The varlen backward's Numba signature (dropout always a tuple: ``inv_keep == 1`` is
    off, as in the dense backward)."""
    st, ct, _ = kernel_types(dtype, "none")
    ro = arr(st, 3, True)
    return (ro, ro, ro, _CU, _CU, types.boolean, types.float64, ro, ro, arr(ct, 2, True),
            arr(ct, 3, False), arr(ct, 3, False), arr(ct, 3, False), DROPOUT_TYPE, recipe_t,
            types.boolean)


#: The plain recipe's entries by (kind, dtype, dropout) alone (as the dense forward's:
#: hashing a Numba type costs microseconds of a small call).
_plain_entries = {}


def _entry(kind, dtype, dropout, recipe_t):
    if recipe_t is PLAIN_RECIPE:
        e = _plain_entries.get((kind, dtype, dropout))
        if e is not None:
            return e
    key = (kind, dtype, dropout, recipe_t)
    if recipe_t is PLAIN_RECIPE and key in _entries:
        _plain_entries[(kind, dtype, dropout)] = _entries[key]
    if key not in _entries:
        if kind == "forward":
            _entries[key] = compile_entry(varlen_forward,
                                          forward_signature(dtype, dropout, recipe_t))
        else:
            _entries[key] = compile_entry(varlen_backward, backward_signature(dtype, recipe_t))
    return _entries[key]


def run(p, q, k, v, out, dropout=None):
    """The forward on the CPU for plan ``p``: ``(out, lse)``, ``lse`` of shape (Hq, total_q).

    ``dropout``: None or :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    result = np.empty(p.out_shape, p.dtype) if out is None else out
    lse = np.empty(p.lse_shape, p.compute_dtype)
    with kernel_launch():
        entry = _entry("forward", p.dtype, dropout is not None, recipe_type(p.recipe))
        sv = storage_views(p.dtype)
        entry(sv(q), sv(k), sv(v), p.cu_q, p.cu_k, p.is_causal, p.scale, sv(result), lse,
              dropout, p.recipe, p.bottom_right)
    return result, lse


def run_backward(p, grad_out, q, k, v, out, lse, dropout=None):
    """Gradients on the CPU for plan ``p``: ``(dq, dk, dv)`` in the inputs' dtype."""
    ct = p.compute_dtype
    dq = np.empty(q.shape, ct)
    dk = np.empty(k.shape, ct)
    dv = np.empty(v.shape, ct)
    with kernel_launch():
        entry = _entry("backward", p.dtype, True, recipe_type(p.recipe))
        sv = storage_views(p.dtype)
        entry(sv(q), sv(k), sv(v), p.cu_q, p.cu_k, p.is_causal, p.scale, sv(grad_out), sv(out),
              lse, dq, dk, dv, NO_DROPOUT if dropout is None else dropout, p.recipe,
              p.bottom_right)
    return tuple(g.astype(p.dtype, copy=False) for g in (dq, dk, dv))
