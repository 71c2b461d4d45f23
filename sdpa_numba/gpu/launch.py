"""From a validated :class:`~sdpa_numba.problem.Plan` and Numba device arrays to the kernel.

The problem layer (:mod:`sdpa_numba.problem`) lays the operands out as strided 4-D views
``(batch, heads, rows, cols)`` (leading unit dims and broadcast dims at stride 0, nothing
copied) and splits the batch into launches exactly as on the CPU, with the device's
:func:`.arrays.as_strided`. Validation (the ``out`` checks, negative strides, the variants) happened in the
public layer.

The plan's recipe (:mod:`sdpa_numba.score.recipe`) goes to every launch with the launch's batch
offset (:func:`~sdpa_numba.score.recipe.with_batch_offset`), and its small host arrays (ALiBi
slopes, sinks, block-mask states, NumPy ``mod_args``) are copied to the device once per call.
"""

from ..block_mask import K_BLOCK, Q_BLOCK
from ..dropout import NO_DROPOUT
from ..problem import for_each_launch, operand_views, row_view
from ..score.recipe import with_batch_offset
from .arrays import as_strided, device_array
from .forward import forward


def device_recipe(r):
    """Recipe ``r`` with its NumPy arrays (slopes, sinks, block mask, ``mod_args``) copied to
    the device, once per call rather than once per launch."""
    from numba import cuda
    import numpy as np

    def dev(x):
        return cuda.to_device(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x

    return r._replace(alibi=dev(r.alibi), sinks=dev(r.sinks), block_mask=dev(r.block_mask),
                      mod_args=tuple(dev(x) for x in r.mod_args))


def run(p, query, key, value, attn_mask, out, dropout=None):
    """Compute attention on the GPU for plan ``p``; returns ``(out, lse)`` as device arrays.

    The operands are Numba device arrays (see :func:`.arrays.adopt`); the kernel is launched
    asynchronously on the default stream. ``dropout``: None or
    :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    q, k, v, mask = operand_views(p, query, key, value, attn_mask, as_strided)
    result = device_array(p.out_shape, p.dtype) if out is None else out
    lse = device_array(p.out_shape[:-1], p.compute_dtype)

    rc = device_recipe(p.recipe)

    def launch(arrays, drop):
        mq, mk, mv, mm, mo, ml = arrays
        # drop[3]: the launch's first flat batch index (no dropout: inv_keep 1, off)
        forward(mq, mk, mv, mm, p.is_causal, p.scale, mo, ml, dropout=drop,
                recipe=with_batch_offset(rc, drop[3]), block_sizes=(Q_BLOCK, K_BLOCK))

    # NO_DROPOUT rather than None: for_each_launch then hands each launch its batch offset.
    for_each_launch(p.batch, [q, k, v, mask, row_view(p, result, p.Ev, as_strided),
                              row_view(p, lse, None, as_strided)],
                    NO_DROPOUT if dropout is None else dropout, launch, as_strided)
    return result, lse
