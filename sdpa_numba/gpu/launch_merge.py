"""From checked attention states (Numba device arrays) to the merge kernel
(:func:`.merge.merge_states`).

The leading dims of the states are merged into one dim of rows where their strides allow it (a
view, nothing copied), for one launch; where they do not, the launcher recurses over the first
leading dim, one launch per index.
"""

import numpy as np

from .arrays import as_strided, device_array
from .merge import merge_states


def _rows_view(x, first, last):
    """Device array ``x`` with its dims ``first .. last - 1`` merged into one (a view), or
    None if their strides do not allow it."""
    shape, strides = list(tuple(x.shape)[first:last]), list(tuple(x.strides)[first:last])
    kept = [(n, st) for n, st in zip(shape, strides) if n != 1]
    for (n0, s0), (n1, s1) in zip(kept, kept[1:]):
        if s0 != n1 * s1:
            return None
    stride = kept[-1][1] if kept else x.dtype.itemsize
    xs, xst = tuple(x.shape), tuple(x.strides)
    return as_strided(x, (*xs[:first], int(np.prod(shape)), *xs[last:]),
                      (*xst[:first], stride, *xst[last:]))


def _launch(parts, out, lse, lead_at):
    """Merge device states whose leading dims start at dim ``lead_at`` of each part (1 for the
    stacked form): as rows in one launch where the dims merge, else one leading index at a
    time."""
    if lse.ndim == 0:  # one row
        parts = [as_strided(x, (*tuple(x.shape)[:lead_at], 1, *tuple(x.shape)[lead_at:]),
                            (*tuple(x.strides)[:lead_at], 0, *tuple(x.strides)[lead_at:]))
                 for x in parts]
        out = as_strided(out, (1, *tuple(out.shape)), (0, *tuple(out.strides)))
        lse = as_strided(lse, (1,), (0,))
    nd = lse.ndim
    views = [_rows_view(x, lead_at, lead_at + nd) for x in parts]
    row_out = _rows_view(out, 0, nd)
    row_lse = _rows_view(lse, 0, nd)
    if all(v is not None for v in (*views, row_out, row_lse)):
        merge_states(tuple(views), row_out, row_lse)
        return
    for i in range(lse.shape[0]):
        _launch([x[(slice(None),) * lead_at + (i,)] for x in parts], out[i], lse[i], lead_at)


def run(parts, dt, ct, lead, ev):
    """Merge the states ``parts`` on the GPU: ``(out, lse)`` as device arrays of shapes
    ``(*lead, ev)`` and ``lead``, dtypes ``dt`` and ``ct``; asynchronous on the default
    stream.

    ``parts``: ``[out_a, lse_a, out_b, lse_b]`` or ``[outs, lses]`` (stacked along a leading
    axis), checked by the public layer; the lse arrays are read in their own float dtype.
    """
    out = device_array((*lead, ev), dt)
    lse = device_array(lead, ct)
    if out.size or lse.size:
        _launch(list(parts), out, lse, 1 if len(parts) == 2 else 0)
    return out, lse
