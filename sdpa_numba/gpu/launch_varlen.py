"""From a validated :class:`~sdpa_numba.problem.varlen.VarlenPlan` and Numba device arrays to
the CUDA kernels: one launch of the forward kernel, and one of each backward kernel, for the
whole packed batch, whatever the number of sequences.

Varlen is addressing, not copies of the kernel (as FlashAttention's
``flash_attn_varlen_func``): the packed ``(total, H, D)`` arrays are seen as ``(1, H, total,
D)`` strided views (nothing copied), and the dense kernels (:func:`.forward.forward`,
:func:`.backward.backward`, with the compilations the dense calls use) run on them with the
batch's cumulative lengths (:class:`~.work.Sequences`). Each thread block looks up its
sequence and block in a work list the launcher builds from them (:mod:`.work`) and applies the
plan's recipe in the sequence's frame, as
:func:`~sdpa_numba.score.recipe.sequence_recipe` defines it: rows and keys counted from the
sequence's start, the window aligned per sequence (bottom right: offset ``S_b - L_b``), and
batch index ``b``, the sequence's, for the user's functions, ALiBi and the dropout stream.
"""


from ..block_mask import K_BLOCK, Q_BLOCK
from .arrays import as_strided, device_array
from .backward import backward
from .forward import forward
from .launch import device_recipe
from .reduce import sum_to
from .work import Sequences


def _rows(x):
    """Packed ``(total, H, D)`` device array ``x`` as ``(1, H, total, D)``."""
    s0, s1, s2 = x.strides
    return as_strided(x, (1, x.shape[1], x.shape[0], x.shape[2]), (0, s1, s0, s2))


def _lse_rows(lse):
    """An ``(Hq, total)`` device array as ``(1, Hq, total)``."""
    return as_strided(lse, (1, *lse.shape), (0, *lse.strides))


def _sequences(p):
    return Sequences(p.cu_q, p.cu_k, p.bottom_right)


def run(p, q, k, v, out, dropout=None):
    """The forward on the GPU for plan ``p``: ``(out, lse)`` as device arrays, lse
    ``(Hq, total_q)``; one launch, asynchronous on the default stream."""
    result = device_array(p.out_shape, p.dtype) if out is None else out
    lse = device_array(p.lse_shape, p.compute_dtype)
    forward(_rows(q), _rows(k), _rows(v), None, p.is_causal, p.scale, _rows(result),
            _lse_rows(lse), dropout=dropout, recipe=device_recipe(p.recipe),
            block_sizes=(Q_BLOCK, K_BLOCK), sequences=_sequences(p))
    return result, lse


def run_backward(p, grad_out, q, k, v, out, lse, dropout=None):
    """Gradients on the GPU for plan ``p``: ``(dq, dk, dv)`` as device arrays of the inputs'
    dtype; one launch of each backward kernel."""
    ct = p.compute_dtype
    dq = device_array(q.shape, ct)
    dk = device_array(k.shape, ct)
    dv = device_array(v.shape, ct)
    backward(_rows(q), _rows(k), _rows(v), None, p.is_causal, p.scale, _rows(grad_out),
             _rows(out), _lse_rows(lse), _rows(dq), _rows(dk), _rows(dv), dropout, None,
             recipe=device_recipe(p.recipe), block_sizes=(Q_BLOCK, K_BLOCK),
             sequences=_sequences(p))
    return tuple(sum_to(g, g.shape, p.dtype) for g in (dq, dk, dv))
