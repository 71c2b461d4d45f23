"""The operands as the kernels see them: ``(*batch, heads, rows, cols)`` views, never copies.

Worked out on shapes and strides alone; a target makes the view with its own ``as_strided(x,
shape, strides)`` (NumPy's for host arrays, :func:`sdpa_numba.gpu.arrays.as_strided` for
device arrays), so both back ends lay out their operands identically.
"""


def broadcast_strides(shape, strides, full):
    """Byte strides of an array of ``shape``/``strides`` seen with shape ``full`` (NumPy's
    broadcasting): the leading dims it lacks and the dims it stretches from 1 get stride 0."""
    pad = len(full) - len(shape)
    st = (0,) * pad + tuple(strides)
    xs = (1,) * pad + tuple(shape)
    return tuple(0 if n == 1 and t != 1 else s for n, s, t in zip(xs, st, full))


def broadcast_view(x, full, as_strided):
    """``x`` seen with shape ``full`` (a view made by the target's ``as_strided``); ``x``
    itself when it already has that shape and no dim to stretch."""
    full = tuple(full)
    if tuple(x.shape) == full:  # nothing to add or stretch (the common case: keep it cheap)
        return x
    return as_strided(x, full, broadcast_strides(x.shape, x.strides, full))


def operand_views(p, query, key, value, attn_mask, as_strided):
    """The kernels' views of query, key, value and the mask (None stays None) for plan ``p``:
    query ``(*batch, Hq, L, E)``, key ``(*batch, H, S, E)``, value ``(*batch, H, S, Ev)``,
    mask ``(*batch, Hq, L, S)``."""
    full = (*p.batch, p.hq)
    return (broadcast_view(query, (*full, p.L, p.E), as_strided),
            broadcast_view(key, (*p.batch, p.h, p.S, p.E), as_strided),
            broadcast_view(value, (*p.batch, p.h, p.S, p.Ev), as_strided),
            None if attn_mask is None else
            broadcast_view(attn_mask, (*full, p.L, p.S), as_strided))


def row_view(p, x, cols, as_strided):
    """An array of the query rows' shape (``out``, ``grad_out``: ``cols`` = Ev; ``lse``:
    ``cols`` None, no last dim) seen as ``(*batch, Hq, L[, cols])``."""
    full = (*p.batch, p.hq, p.L) if cols is None else (*p.batch, p.hq, p.L, cols)
    return broadcast_view(x, full, as_strided)
