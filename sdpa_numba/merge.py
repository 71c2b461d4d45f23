"""``merge_attention_states``: attention over disjoint key sets, combined by log-sum-exp.

Attention of a query row over the union of disjoint key sets is a weighted mean of the partial
outputs, each weighted by ``exp(lse_i - lse)``: the split-KV (flash-decoding) kernels and ring
attention combine their parts this way. The math and its edge cases are in
:mod:`sdpa_numba.score.merge`; the CPU kernels in :mod:`sdpa_numba.cpu.merge`.
"""

from typing import Any

import numpy as np

from ._bf16 import is_bfloat16
from ._runtime import compile_entry, kernel_launch
from .host_arrays import adopt as adopt_host
from .problem.arguments import shape_str
from .problem.dtypes import FLOATS, compute_dtype

__all__ = ["merge_attention_states"]

#: Bytes of outputs read below which a merge runs on the calling thread: waking the thread pool
#: costs ~0.5 ms (workqueue) to ~10 ms (after an idle pause), the time to stream several MiB.
PARALLEL_BYTES = 4 << 20

_entries: dict = {}


def _is_device(x):
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ in (
        "FakeCUDAArray", "DeviceNDArray")


def _check_out_dtype(name, x, dtype=None):
    dt = np.dtype(x.dtype)
    if dt not in FLOATS and not is_bfloat16(dt):
        raise TypeError(f"{name} dtype {dt} is not supported: use float16, bfloat16 "
                        f"(ml_dtypes.bfloat16), float32 or float64")
    if dtype is not None and dt != dtype:
        raise TypeError(f"{name} dtype {dt} differs from {dtype} (the first output's)")
    return dt


def _check_lse(name, lse, shape, ct):
    """``lse`` of ``shape`` as the compute dtype ``ct`` (a copy only if its dtype differs)."""
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"{name} must be a float array (log-sum-exp values), got dtype "
                        f"{np.dtype(lse.dtype)}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (the output's without its "
                         f"last dim), got {shape_str(lse)}")
    return np.asarray(lse, dtype=ct)


def _entry(kernel, ndims, st, ct):
    from numba import from_dtype, types

    from .cpu.storage import storage_view

    key = (kernel, st, ct)
    if key not in _entries:
        nst = from_dtype(storage_view(np.empty(0, st)).dtype)
        nct = from_dtype(ct)
        sig = tuple(types.Array(nct if is_lse else nst, nd, "A", readonly=not written)
                    for nd, is_lse, written in ndims)
        _entries[key] = compile_entry(kernel, sig)
    return _entries[key]


def merge_attention_states(*states: Any) -> tuple[Any, Any]:
    """Combine attention over disjoint key sets into attention over their union.

    Two forms:

    * ``merge_attention_states(out_a, lse_a, out_b, lse_b)``: two parts;
    * ``merge_attention_states(outs, lses)``: ``n`` parts stacked along a leading axis,
      ``outs (n, ..., Ev)``, ``lses (n, ...)`` (a list or tuple of arrays is stacked first, a
      copy).

    Parameters
    ----------
    out_a, out_b : ndarray, shape (..., Ev)
        Normalized attention outputs over two disjoint key sets (e.g. the dense API's output
        over two halves of the keys), of one dtype: float16, bfloat16, float32 or float64.
        Any leading shape (e.g. ``(B, Hq, L, Ev)``).
    lse_a, lse_b : ndarray, shape (...)
        Their log-sum-exp of the scores (``return_lse=True``), any float dtype.

    Returns
    -------
    out : ndarray of the outputs' dtype, shape (..., Ev)
        ``sum_i exp(lse_i - lse) out_i``.
    lse : ndarray of the compute dtype (float64 for float64 outputs, else float32), shape (...)
        ``log(sum_i exp(lse_i))``.

    Raises
    ------
    TypeError, ValueError
        For bad input (dtypes, shapes, number of arguments), naming the argument, before any
        jitted code runs.
    NotImplementedError
        For CUDA arrays (not built yet; the device functions of :mod:`sdpa_numba.gpu.merge`
        serve users' kernels).

    Notes
    -----
    A part with ``lse = -inf`` (no key took part) contributes nothing; if every part has
    ``-inf``, the row is 0 with ``lse = -inf``, as a fully masked row of the dense API. A part
    with ``lse`` NaN or ``+inf`` (which finite scores never give) makes its row NaN, ``out`` and
    ``lse``, so the error stays visible. The combination is exact up to rounding; each row is
    combined by one thread with the parts in index order, so the result does not depend on the
    thread count. Merging in another order gives the same result up to rounding.

    Examples
    --------
    >>> import numpy as np, sdpa_numba
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 2, 3, 8)); k = rng.standard_normal((1, 2, 10, 8))
    >>> v = rng.standard_normal((1, 2, 10, 8))
    >>> oa, la = sdpa_numba.scaled_dot_product_attention(q, k[..., :4, :], v[..., :4, :],
    ...                                                  return_lse=True)
    >>> ob, lb = sdpa_numba.scaled_dot_product_attention(q, k[..., 4:, :], v[..., 4:, :],
    ...                                                  return_lse=True)
    >>> out, lse = sdpa_numba.merge_attention_states(oa, la, ob, lb)
    >>> whole, whole_lse = sdpa_numba.scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, whole) and np.allclose(lse, whole_lse))
    True
    """
    if len(states) == 4:
        names = ("out_a", "lse_a", "out_b", "lse_b")
    elif len(states) == 2:
        names = ("outs", "lses")
    else:
        raise TypeError(f"merge_attention_states takes (out_a, lse_a, out_b, lse_b) or "
                        f"(outs, lses), got {len(states)} arguments")
    if any(_is_device(x) for x in states):
        raise NotImplementedError("merge_attention_states on CUDA arrays is not built yet: "
                                  "copy them to the host, or call sdpa_numba.gpu.merge_row / "
                                  "merge_rows from your own kernel")
    if len(states) == 2:
        states = tuple(np.stack([np.asarray(a) for a in x]) if isinstance(x, (list, tuple))
                       else x for x, n in zip(states, names))
    arrays, restore = adopt_host(list(zip(names, states)))
    if len(arrays) == 4:
        oa, la, ob, lb = arrays
        if oa.ndim < 1:
            raise ValueError(f"out_a must have at least 1 dim (..., Ev), got shape "
                             f"{shape_str(oa)}")
        dt = _check_out_dtype("out_a", oa)
        _check_out_dtype("out_b", ob, dt)
        if ob.shape != oa.shape:
            raise ValueError(f"out_b's shape {shape_str(ob)} differs from out_a's "
                             f"{shape_str(oa)}")
        ct = compute_dtype(dt)
        la = _check_lse("lse_a", la, oa.shape[:-1], ct)
        lb = _check_lse("lse_b", lb, oa.shape[:-1], ct)
        lead, ev = oa.shape[:-1], oa.shape[-1]
        nbytes = 2 * oa.size * dt.itemsize
        rows = int(np.prod(lead))
        operands = [oa.reshape(rows, ev), la.reshape(rows), ob.reshape(rows, ev),
                    lb.reshape(rows)]
        dims = [(2, False, False), (1, True, False), (2, False, False), (1, True, False)]
    else:
        outs, lses = arrays
        if outs.ndim < 2:
            raise ValueError(f"outs must have at least 2 dims (n, ..., Ev), got shape "
                             f"{shape_str(outs)}")
        dt = _check_out_dtype("outs", outs)
        ct = compute_dtype(dt)
        lses = _check_lse("lses", lses, outs.shape[:-1], ct)
        n, lead, ev = outs.shape[0], outs.shape[1:-1], outs.shape[-1]
        nbytes = outs.size * dt.itemsize
        rows = int(np.prod(lead))
        operands = [outs.reshape(n, rows, ev), lses.reshape(n, rows)]
        dims = [(3, False, False), (2, True, False)]
    out = np.empty((*lead, ev), dt)
    lse = np.empty(lead, ct)
    if out.size or lse.size:
        from .cpu import merge as kernels
        from .cpu.storage import storage_view

        parallel = nbytes >= PARALLEL_BYTES
        if len(arrays) == 4:
            kernel = kernels.merge_two if parallel else kernels.merge_two_serial
        else:
            kernel = kernels.merge_many if parallel else kernels.merge_many_serial
        dims = [*dims, (2, False, True), (1, True, True)]
        with kernel_launch():
            entry = _entry(kernel, dims, dt, ct)
            views = [x if i % 2 else storage_view(x) for i, x in enumerate(operands)]
            entry(*views, storage_view(out.reshape(rows, ev)), lse.reshape(rows))
    return restore(out), restore(lse)
