"""From a validated :class:`~sdpa_numba.problem.Plan` and Numba device arrays to the backward
kernels.

As for the forward (:mod:`.launch`): the problem layer (:mod:`sdpa_numba.problem`) lays the
operands out as strided 4-D views (nothing copied) and splits the batch into launches (with the
dropout batch offset that keeps the mask's flat batch index), as on the CPU. The kernels write gradients at the full
broadcast shapes in the compute dtype; :func:`.reduce.sum_to` sums them over each input's
broadcast dims and casts them to the input's dtype, on the device. The gradient of sinks is
the public layer's (:func:`sdpa_numba.problem.variant_table.sinks_grad`).
"""

from ..score.blocks import K_BLOCK, Q_BLOCK
from ..dropout import NO_DROPOUT
from ..problem import for_each_launch, operand_views, row_view
from ..score.recipe import with_batch_offset
from .arrays import as_strided, device_array
from .backward import backward
from .reduce import sum_to
from .variants import copy_to_device


def run_backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout, mask_grad):
    """Gradients on the GPU for plan ``p``: ``(dq, dk, dv, dmask)`` as Numba device arrays of
    the inputs' shapes and dtypes (``dmask`` None unless ``mask_grad``).

    ``dropout``: None or :func:`sdpa_numba.dropout.params` (batch offset 0). The kernels are
    launched asynchronously on the default stream.
    """
    full = (*p.batch, p.hq)
    ct = p.compute_dtype
    q, k, v, mask = operand_views(p, query, key, value, attn_mask, as_strided)
    dout = row_view(p, grad_out, p.Ev, as_strided)
    o = row_view(p, out, p.Ev, as_strided)
    lse4 = row_view(p, lse, None, as_strided)
    dq = device_array((*full, p.L, p.E), ct)
    dk = device_array((*p.batch, p.h, p.S, p.E), ct)
    dv = device_array((*p.batch, p.h, p.S, p.Ev), ct)
    dmask = device_array((*full, p.L, p.S), ct) if mask_grad else None

    rc = copy_to_device(p.recipe)

    def launch(arrays, drop):
        bq, bk, bv, bm, bdo, bo, bl, bdq, bdk, bdv, bdm = arrays
        backward(bq, bk, bv, bm, p.is_causal, p.scale, bdo, bo, bl, bdq, bdk, bdv, drop, bdm,
                 recipe=with_batch_offset(rc, drop[3]), block_sizes=(Q_BLOCK, K_BLOCK))

    # NO_DROPOUT rather than None: each launch gets its batch offset (see .launch).
    for_each_launch(p.batch, [q, k, v, mask, dout, o, lse4, dq, dk, dv, dmask],
                    NO_DROPOUT if dropout is None else dropout, launch, as_strided)
    return (sum_to(dq, query.shape, p.dtype), sum_to(dk, key.shape, p.dtype),
            sum_to(dv, value.shape, p.dtype),
            None if dmask is None else sum_to(dmask, attn_mask.shape, attn_mask.dtype))
