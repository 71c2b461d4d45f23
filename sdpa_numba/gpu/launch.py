"""From a validated :class:`~sdpa_numba.problem.Plan` and Numba device arrays to the kernel.

The problem layer (:mod:`sdpa_numba.problem`) lays the operands out as strided 4-D views
``(batch, heads, rows, cols)`` (leading unit dims and broadcast dims at stride 0, nothing
copied) and splits the batch into launches exactly as on the CPU, with the device's
:func:`.arrays.as_strided`. Validation (the ``out`` checks, negative strides) happened in the
public layer.
"""

from ..problem import for_each_launch, operand_views, row_view
from .arrays import as_strided, device_array
from .forward import forward


def run(p, query, key, value, attn_mask, out, dropout=None):
    """Compute attention on the GPU for plan ``p``; returns ``(out, lse)`` as device arrays.

    The operands are Numba device arrays (see :func:`.arrays.adopt`); the kernel is launched
    asynchronously on the default stream. ``dropout``: None or
    :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    q, k, v, mask = operand_views(p, query, key, value, attn_mask, as_strided)
    result = device_array(p.out_shape, p.dtype) if out is None else out
    lse = device_array(p.out_shape[:-1], p.compute_dtype)

    def launch(arrays, drop):
        mq, mk, mv, mm, mo, ml = arrays
        forward(mq, mk, mv, mm, p.is_causal, p.scale, mo, ml, dropout=drop)

    for_each_launch(p.batch, [q, k, v, mask, row_view(p, result, p.Ev, as_strided),
                              row_view(p, lse, None, as_strided)], dropout, launch, as_strided)
    return result, lse
