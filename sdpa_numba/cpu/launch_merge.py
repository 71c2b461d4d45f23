"""From checked attention states (NumPy arrays) to the jitted merge kernels (:mod:`.merge`).

The outputs are read as row-major ``(rows, Ev)`` views (``(n, rows, Ev)`` stacked) in their
storage dtype, the ``lse`` arrays in the compute dtype. Every array is passed as an 'A'-layout
array: one compiled specialization per kernel and (storage, compute) dtype pair, cached on
disk.
"""

import math

import numpy as np

from .._runtime import compile_entry, kernel_launch

#: Bytes of outputs read below which a merge runs on the calling thread: waking the thread pool
#: costs ~0.5 ms (workqueue) to ~10 ms (after an idle pause), the time to stream several MiB.
PARALLEL_BYTES = 4 << 20

_entries: dict = {}


def _entry(kernel, ndims, st, ct):
    from numba import from_dtype, types

    from .storage import storage_view

    key = (kernel, st, ct)
    if key not in _entries:
        nst = from_dtype(storage_view(np.empty(0, st)).dtype)
        nct = from_dtype(ct)
        sig = tuple(types.Array(nct if is_lse else nst, nd, "A", readonly=not written)
                    for nd, is_lse, written in ndims)
        _entries[key] = compile_entry(kernel, sig)
    return _entries[key]


def run(parts, dt, ct, lead, ev):
    """Merge the states ``parts`` on the CPU: ``(out, lse)`` of shapes ``(*lead, ev)`` and
    ``lead``, dtypes ``dt`` (the outputs') and ``ct`` (the compute dtype).

    ``parts``: ``[out_a, lse_a, out_b, lse_b]`` or ``[outs, lses]`` (stacked along a leading
    axis), checked by the public layer; the lse arrays in any float dtype (converted to ``ct``).
    """
    parts = [np.asarray(x, ct) if i % 2 else x for i, x in enumerate(parts)]
    rows = math.prod(lead)  # ints: np.prod took ~3 us of a small call
    if len(parts) == 4:
        oa, la, ob, lb = parts
        nbytes = 2 * oa.size * dt.itemsize
        parts = [oa.reshape(rows, ev), la.reshape(rows), ob.reshape(rows, ev), lb.reshape(rows)]
        dims = [(2, False, False), (1, True, False), (2, False, False), (1, True, False)]
    else:
        outs, lses = parts
        n = outs.shape[0]
        nbytes = outs.size * dt.itemsize
        parts = [outs.reshape(n, rows, ev), lses.reshape(n, rows)]
        dims = [(3, False, False), (2, True, False)]
    out = np.empty((*lead, ev), dt)
    lse = np.empty(lead, ct)
    if out.size or lse.size:
        from . import merge as kernels
        from .storage import storage_view

        parallel = nbytes >= PARALLEL_BYTES
        if len(parts) == 4:
            kernel = kernels.merge_two if parallel else kernels.merge_two_serial
        else:
            kernel = kernels.merge_many if parallel else kernels.merge_many_serial
        dims = [*dims, (2, False, True), (1, True, True)]
        with kernel_launch():
            entry = _entry(kernel, dims, dt, ct)
            views = [x if i % 2 else storage_view(x) for i, x in enumerate(parts)]
            entry(*views, storage_view(out.reshape(rows, ev)), lse.reshape(rows))
    return out, lse
