"""From a validated :class:`~sdpa_numba.api.Plan` and Numba device arrays to the kernel.

Operands become strided 4-D views ``(batch, heads, rows, cols)``: leading unit dims and
broadcast dims get stride 0, and nothing is copied. Batch dims are merged into one where the
strides of every operand allow it (always, for contiguous or broadcast operands); otherwise
the kernel is launched once per index of the leading batch dim, as on the CPU.
"""

import dataclasses
import math

from .arrays import as_strided, broadcast_view, device_array, may_overlap
from .forward import forward


def _check_out(out, inputs):
    """What :func:`sdpa_numba.api._check_out` checks on NumPy arrays, for a device ``out``."""
    if any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape)):
        raise ValueError(f"out must not have zero strides (a broadcast view), got strides "
                         f"{tuple(out.strides)}")
    for name, x in inputs:
        if x is not None and may_overlap(out, x):
            raise ValueError(f"out overlaps {name}: pass a separate buffer")


def _merge_batch(arrays, nb):
    """The arrays with their ``nb`` batch dims merged where strides allow.

    Returns ``(arrays, n_left)``: ``n_left`` batch dims remain (1 unless some cannot merge;
    a dim of size 1 is dropped).
    """
    batch = arrays[0].shape[:nb]
    dims = []  # (size, [stride of each array])
    for d in range(nb):
        n = batch[d]
        st = [a.strides[d] for a in arrays]
        if n == 1:
            continue
        if dims and all(sp == n * s for sp, s in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * n, st)
        else:
            dims.append((n, st))
    if not dims:
        dims = [(1, [0] * len(arrays))]
    merged = [as_strided(a, tuple(n for n, _ in dims) + a.shape[nb:],
                         tuple(s[i] for _, s in dims) + a.strides[nb:])
              for i, a in enumerate(arrays)]
    return merged, len(dims)


def for_each_launch(p, arrays, dropout, launch):
    """Call ``launch(arrays4d, dropout)`` once per kernel launch that covers batch ``p.batch``.

    ``arrays``: device arrays with the batch dims of ``p`` leading (None entries pass through
    as None). Their batch dims are merged into one where strides allow; otherwise there is one
    launch per index of the leading (merged) batch dim, recursively. ``dropout`` (None or
    :func:`sdpa_numba.dropout.params`) gets the batch offset of each launch, so that the
    kernels' batch index stays the flat, row-major index into ``p.batch``: the mask does not
    depend on how the work was split.
    """
    present = [a for a in arrays if a is not None]
    merged, n_left = _merge_batch(present, len(p.batch))
    if n_left > 1:  # batch dims that no view can merge: one launch per leading index
        inner = math.prod(merged[0].shape[1:n_left])
        sub_p = dataclasses.replace(p, batch=merged[0].shape[1:n_left])
        for i in range(merged[0].shape[0]):
            sub = None if dropout is None else (*dropout[:3], dropout[3] + i * inner)
            for_each_launch(sub_p, _put_back(arrays, [a[i] for a in merged]), sub, launch)
        return
    launch(_put_back(arrays, merged), dropout)


def _put_back(arrays, present):
    """``present`` in the places of the non-None entries of ``arrays``."""
    it = iter(present)
    return [None if a is None else next(it) for a in arrays]


def operand_views(p, query, key, value, attn_mask):
    """The kernels' views ``(*batch, heads, rows, cols)`` of query, key, value and the mask
    (None stays None): leading unit dims and broadcast dims at stride 0, nothing copied."""
    full = (*p.batch, p.hq)
    return (broadcast_view(query, (*full, p.L, p.E)),
            broadcast_view(key, (*p.batch, p.h, p.S, p.E)),
            broadcast_view(value, (*p.batch, p.h, p.S, p.Ev)),
            None if attn_mask is None else broadcast_view(attn_mask, (*full, p.L, p.S)))


def check_strides(named):
    # Numba's own views with negative strides point at their lowest address, other libraries'
    # at element 0: no view could be built for both, so such operands are refused.
    for name, x in named:
        if x is not None and any(s < 0 for s in x.strides):
            raise ValueError(f"{name} has negative strides {tuple(x.strides)}, which the CUDA "
                             f"path does not support: pass a copy")


def run(p, query, key, value, attn_mask, out, dropout=None):
    """Compute attention on the GPU for plan ``p``; returns ``(out, lse)`` as device arrays.

    The operands are Numba device arrays (see :func:`.arrays.adopt`); the kernel is launched
    asynchronously on the default stream. ``dropout``: None or
    :func:`sdpa_numba.dropout.params` (batch offset 0).
    """
    check_strides([("query", query), ("key", key), ("value", value),
                    ("attn_mask", attn_mask), ("out", out)])
    if out is not None:
        _check_out(out, [("query", query), ("key", key), ("value", value),
                         ("attn_mask", attn_mask)])
    full = (*p.batch, p.hq)
    q, k, v, mask = operand_views(p, query, key, value, attn_mask)
    result = device_array(p.out_shape, p.dtype) if out is None else out
    lse = device_array(p.out_shape[:-1], p.compute_dtype)

    def launch(arrays, drop):
        mq, mk, mv, mm, mo, ml = arrays
        forward(mq, mk, mv, mm, p.is_causal, p.scale, mo, ml, dropout=drop)

    for_each_launch(p, [q, k, v, mask, broadcast_view(result, (*full, p.L, p.Ev)),
                        broadcast_view(lse, (*full, p.L))], dropout, launch)
    return result, lse
