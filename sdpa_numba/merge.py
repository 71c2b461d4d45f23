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


def _check_lse(name, lse, shape):
    """That ``lse`` is a float array of ``shape``."""
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"{name} must be a float array (log-sum-exp values), got dtype "
                        f"{np.dtype(lse.dtype)}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (the output's without its "
                         f"last dim), got {shape_str(lse)}")


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


def merge_attention_states(out_a: Any, lse_a: Any, out_b: Any = None,
                           lse_b: Any = None) -> tuple[Any, Any]:
    """Combine attention over disjoint key sets into attention over their union.

    Two forms:

    * ``merge_attention_states(out_a, lse_a, out_b, lse_b)``: two parts;
    * ``merge_attention_states(outs, lses)``: ``n`` parts stacked along a leading axis,
      ``outs (n, ..., Ev)``, ``lses (n, ...)`` (a list or tuple of arrays is stacked first, a
      copy).

    Parameters
    ----------
    out_a, out_b : ndarray or CUDA array, shape (..., Ev)
        Normalized attention outputs over two disjoint key sets (e.g. the dense API's output
        over two halves of the keys), of one dtype: float16, bfloat16, float32 or float64.
        Any leading shape (e.g. ``(B, Hq, L, Ev)``). In the n-ary form, ``out_a`` is
        ``outs (n, ..., Ev)`` and ``out_b`` is not given.
    lse_a, lse_b : ndarray, shape (...)
        Their log-sum-exp of the scores (``return_lse=True``), any float dtype. In the n-ary
        form, ``lse_a`` is ``lses (n, ...)`` and ``lse_b`` is not given.

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

    Notes
    -----
    Host arrays run on the CPU kernels (:mod:`sdpa_numba.cpu.merge`), CUDA arrays (Numba,
    CuPy, PyTorch; all of them on the device) on the CUDA kernels
    (:func:`sdpa_numba.gpu.merge.merge_states`), and the results come back as the first
    output's kind of array. On the device, lse arrays are read in their own float dtype.

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
    if out_b is not None and lse_b is not None:
        states: tuple = (out_a, lse_a, out_b, lse_b)
        names: tuple = ("out_a", "lse_a", "out_b", "lse_b")
    elif out_b is None and lse_b is None:
        states, names = (out_a, lse_a), ("outs", "lses")
    else:
        raise TypeError("merge_attention_states takes (out_a, lse_a, out_b, lse_b) or "
                        "(outs, lses): out_b and lse_b go together")
    flat = [y for x in states for y in (x if isinstance(x, (list, tuple)) else [x])]
    on_device = [_is_device(x) for x in flat]
    if any(on_device):
        if not all(on_device):
            raise TypeError("merge_attention_states got host and device arrays: put every "
                            "output and lse on one device")
        return _merge_cuda(states, names)
    if len(states) == 2:
        states = tuple(np.stack([np.asarray(a) for a in x]) if isinstance(x, (list, tuple))
                       else x for x in states)
    arrays, restore = adopt_host(list(zip(names, states)))
    dt, ct, lead, ev, operands = _checked(arrays)
    operands = [np.asarray(x, ct) if i % 2 else x for i, x in enumerate(operands)]
    rows = int(np.prod(lead))
    if len(arrays) == 4:
        oa, la, ob, lb = operands
        nbytes = 2 * oa.size * dt.itemsize
        operands = [oa.reshape(rows, ev), la.reshape(rows), ob.reshape(rows, ev),
                    lb.reshape(rows)]
        dims = [(2, False, False), (1, True, False), (2, False, False), (1, True, False)]
    else:
        outs, lses = operands
        n = outs.shape[0]
        nbytes = outs.size * dt.itemsize
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


def _checked(arrays):
    """``(dt, ct, lead, ev, arrays)`` of the checked states (host or device arrays; the lse
    arrays as given, checked to be floats of the outputs' leading shape)."""
    # (shapes as tuples: the CUDA simulator's shapes take no negative indices)
    if len(arrays) == 4:
        oa, la, ob, lb = arrays
        shape = tuple(oa.shape)
        if oa.ndim < 1:
            raise ValueError(f"out_a must have at least 1 dim (..., Ev), got shape "
                             f"{shape_str(oa)}")
        dt = _check_out_dtype("out_a", oa)
        _check_out_dtype("out_b", ob, dt)
        if tuple(ob.shape) != tuple(oa.shape):
            raise ValueError(f"out_b's shape {shape_str(ob)} differs from out_a's "
                             f"{shape_str(oa)}")
        _check_lse("lse_a", la, shape[:-1])
        _check_lse("lse_b", lb, shape[:-1])
        return dt, compute_dtype(dt), shape[:-1], shape[-1], list(arrays)
    outs, lses = arrays
    shape = tuple(outs.shape)
    if outs.ndim < 2:
        raise ValueError(f"outs must have at least 2 dims (n, ..., Ev), got shape "
                         f"{shape_str(outs)}")
    dt = _check_out_dtype("outs", outs)
    _check_lse("lses", lses, shape[:-1])
    return dt, compute_dtype(dt), shape[1:-1], shape[-1], list(arrays)


def _rows_view(x, first, last, as_strided):
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


def _launch_cuda(parts, out, lse, lead_at):
    """Merge device states whose leading dims start at dim ``lead_at`` of each part (1 for the
    stacked form): as rows in one launch where the dims merge, else one leading index at a
    time."""
    from .gpu.arrays import as_strided
    from .gpu.merge import merge_states

    if lse.ndim == 0:  # one row
        parts = [as_strided(x, (*tuple(x.shape)[:lead_at], 1, *tuple(x.shape)[lead_at:]),
                            (*tuple(x.strides)[:lead_at], 0, *tuple(x.strides)[lead_at:]))
                 for x in parts]
        out = as_strided(out, (1, *tuple(out.shape)), (0, *tuple(out.strides)))
        lse = as_strided(lse, (1,), (0,))
    nd = lse.ndim
    views = [_rows_view(x, lead_at, lead_at + nd, as_strided) for x in parts]
    row_out = _rows_view(out, 0, nd, as_strided)
    row_lse = _rows_view(lse, 0, nd, as_strided)
    if all(v is not None for v in (*views, row_out, row_lse)):
        merge_states(tuple(views), row_out, row_lse)
        return
    for i in range(lse.shape[0]):
        _launch_cuda([x[(slice(None),) * lead_at + (i,)] for x in parts], out[i], lse[i],
                     lead_at)


def _merge_cuda(states, names):
    """merge_attention_states on CUDA arrays (checked as on the host), results as the first
    output's kind of array."""
    from numba import cuda

    from .gpu.arrays import adopt, device_array

    if len(states) == 2:
        stacked = []
        for x, name in zip(states, names):
            if isinstance(x, (list, tuple)):
                xs = [a for a, in (adopt([(f"{name}[{i}]", a)])[0] for i, a in enumerate(x))]
                if not xs or any(tuple(a.shape) != tuple(xs[0].shape) or a.dtype != xs[0].dtype
                                 for a in xs):
                    raise ValueError(f"{name} must be arrays of one shape and dtype to stack")
                y = cuda.device_array((len(xs), *xs[0].shape), xs[0].dtype)
                for i, a in enumerate(xs):
                    if not a.is_c_contiguous():
                        raise ValueError(f"{name}[{i}] is not contiguous: pass a stacked "
                                         f"array ({name} of shape (n, ...)) instead of a list")
                    y[i].copy_to_device(a)
                x = y
            stacked.append(x)
        states = tuple(stacked)
    arrays, restore = adopt(list(zip(names, states)))
    dt, ct, lead, ev, operands = _checked(arrays)
    out = device_array((*lead, ev), dt)
    lse = device_array(lead, ct)
    if out.size or lse.size:
        _launch_cuda(operands, out, lse, 1 if len(operands) == 2 else 0)
    return restore(out), restore(lse)
