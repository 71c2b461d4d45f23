"""``merge_attention_states``: attention over disjoint key sets, combined by log-sum-exp.

Attention of a query row over the union of disjoint key sets is a weighted mean of the partial
outputs, each weighted by ``exp(lse_i - lse)``: the split-KV (flash-decoding) kernels and ring
attention combine their parts this way. The math and its edge cases are in
:mod:`sdpa_numba.score.merge`; the launchers in :mod:`sdpa_numba.cpu.launch_merge` and
:mod:`sdpa_numba.gpu.launch_merge`, reached through the states' target
(:mod:`sdpa_numba.targets`).
"""

from typing import Any

import numpy as np

from .problem.arguments import shape_str
from .problem.dtypes import check_storage_dtype, compute_dtype
from .targets import target_of

__all__ = ["merge_attention_states"]


def _check_lse(name, lse, shape):
    """That ``lse`` is a float array of ``shape``."""
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"{name} must be a float array (log-sum-exp values), got dtype "
                        f"{np.dtype(lse.dtype)}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (the output's without its "
                         f"last dim), got {shape_str(lse)}")


def _stacked(target, name, parts):
    """The list or tuple ``parts`` of argument ``name`` stacked along a new leading axis (a
    copy) on ``target``; ValueError / TypeError naming the part that does not stack."""
    arrays, _ = target.adopt([(f"{name}[{i}]", x) for i, x in enumerate(parts)])
    first = arrays[0]
    for i, x in enumerate(arrays):
        if tuple(x.shape) != tuple(first.shape):
            raise ValueError(f"{name} must be arrays of one shape to stack: {name}[{i}] has "
                             f"shape {shape_str(x)}, {name}[0] {shape_str(first)}")
        if np.dtype(x.dtype) != np.dtype(first.dtype):
            raise TypeError(f"{name} must be arrays of one dtype to stack: {name}[{i}] has "
                            f"dtype {np.dtype(x.dtype)}, {name}[0] {np.dtype(first.dtype)}")
    return target.stack(name, arrays)


def merge_attention_states(out_a: Any, lse_a: Any, out_b: Any = None,
                           lse_b: Any = None) -> tuple[Any, Any]:
    """Combine attention over disjoint key sets into attention over their union.

    Two forms:

    * ``merge_attention_states(out_a, lse_a, out_b, lse_b)``: two parts;
    * ``merge_attention_states(outs, lses)``: ``n`` parts stacked along a leading axis,
      ``outs (n, ..., Ev)``, ``lses (n, ...)`` (a non-empty list or tuple of arrays of one
      shape and dtype is stacked first, a copy).

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
    named = []
    for name, x in zip(names, states):
        if isinstance(x, (list, tuple)):
            if len(states) == 4:
                raise TypeError(f"{name} must be an array, got a {type(x).__name__}: lists "
                                f"of parts are the (outs, lses) form's")
            if not x:
                raise ValueError(f"{name} is an empty {type(x).__name__}: give at least one "
                                 f"part to merge")
            named += [(f"{name}[{i}]", y) for i, y in enumerate(x)]
        else:
            named.append((name, x))
    target = target_of(named, [n for n, _ in named])
    states = tuple(_stacked(target, name, x) if isinstance(x, (list, tuple)) else x
                   for name, x in zip(names, states))
    arrays, restore = target.adopt(list(zip(names, states)))
    dt, ct, lead, ev, parts = _checked(arrays)
    out, lse = target.merge(parts, dt, ct, lead, ev)
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
        dt = check_storage_dtype("out_a", oa)
        check_storage_dtype("out_b", ob, ("out_a", dt))
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
    dt = check_storage_dtype("outs", outs)
    _check_lse("lses", lses, shape[:-1])
    return dt, compute_dtype(dt), shape[1:-1], shape[-1], list(arrays)
