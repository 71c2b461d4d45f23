"""From a validated :class:`~sdpa_numba.problem.varlen.VarlenPlan` and Numba device arrays to
the dense CUDA kernels, one launch per sequence.

The addressing rule is a view: sequence ``b`` of a packed ``(total, H, D)`` array is the
strided ``(1, H, L_b, D)`` view of its rows (nothing copied), and its recipe is the plan's in
the sequence's frame (:func:`~sdpa_numba.score.recipe.sequence_recipe`: window and ALiBi
aligned per sequence, ``b`` the batch index the user's functions, ALiBi and the dropout stream
see). The dense kernels (:func:`.forward.forward`, :func:`.backward.backward`) run on those
views unchanged, with the compilations the dense calls use. A launch per sequence costs a
launch overhead per sequence; one grid over the whole batch would need the kernels to look up
their sequence, which they do not do yet.
"""


from ..block_mask import K_BLOCK, Q_BLOCK
from ..dropout import NO_DROPOUT
from ..score.recipe import sequence_recipe
from .arrays import as_strided, device_array
from .backward import backward
from .forward import forward
from .launch import device_recipe
from .reduce import sum_to

#: The kernels run the plan's recipe.
TAKES_RECIPE = True


def _rows(x, i0, i1):
    """Rows ``[i0, i1)`` of packed ``(total, H, D)`` device array ``x`` as ``(1, H, n, D)``."""
    part = x[i0:i1]
    s0, s1, s2 = part.strides
    return as_strided(part, (1, part.shape[1], part.shape[0], part.shape[2]), (0, s1, s0, s2))


def _lse_rows(lse, i0, i1):
    """Columns ``[i0, i1)`` of an ``(Hq, total)`` device array as ``(1, Hq, n)``."""
    part = lse[:, i0:i1]
    return as_strided(part, (1, *part.shape), (0, *part.strides))


def _sequences(p, dropout):
    """Per sequence: ``(b, q0, q1, k0, k1, recipe, dropout)`` with the sequence's recipe (host
    arrays already on the device) and dropout batch offset."""
    rc = device_recipe(p.recipe)
    drop = NO_DROPOUT if dropout is None else dropout
    for b in range(p.n_seq):
        q0, q1 = int(p.cu_q[b]), int(p.cu_q[b + 1])
        k0, k1 = int(p.cu_k[b]), int(p.cu_k[b + 1])
        rs = sequence_recipe.py_func(rc, b, q1 - q0, k1 - k0, p.bottom_right)
        yield b, q0, q1, k0, k1, rs, (drop[0], drop[1], drop[2], drop[3] + b)


def run(p, q, k, v, out, dropout=None):
    """The forward on the GPU for plan ``p``: ``(out, lse)`` as device arrays, lse
    ``(Hq, total_q)``; the launches are asynchronous on the default stream."""
    result = device_array(p.out_shape, p.dtype) if out is None else out
    lse = device_array(p.lse_shape, p.compute_dtype)
    for b, q0, q1, k0, k1, rs, drop in _sequences(p, dropout):
        if q1 == q0:
            continue
        forward(_rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1), None, p.is_causal,
                p.scale, _rows(result, q0, q1), _lse_rows(lse, q0, q1), dropout=drop,
                recipe=rs, block_sizes=(Q_BLOCK, K_BLOCK))
    return result, lse


def run_backward(p, grad_out, q, k, v, out, lse, dropout=None):
    """Gradients on the GPU for plan ``p``: ``(dq, dk, dv)`` as device arrays of the inputs'
    dtype."""
    ct = p.compute_dtype
    dq = device_array(q.shape, ct)
    dk = device_array(k.shape, ct)
    dv = device_array(v.shape, ct)
    for b, q0, q1, k0, k1, rs, drop in _sequences(p, dropout):
        if q1 == q0 and k1 == k0:
            continue
        backward(_rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1), None, p.is_causal,
                 p.scale, _rows(grad_out, q0, q1), _rows(out, q0, q1), _lse_rows(lse, q0, q1),
                 _rows(dq, q0, q1), _rows(dk, k0, k1), _rows(dv, k0, k1), drop, None,
                 recipe=rs, block_sizes=(Q_BLOCK, K_BLOCK))
    return tuple(sum_to(g, g.shape, p.dtype) for g in (dq, dk, dv))
