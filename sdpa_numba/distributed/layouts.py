"""The sharding layouts along the sequence axis: which rows a rank holds
(:func:`shard_rows`), a rank's shard of a whole array (:func:`shard`) and the whole array
from every rank's shard (:func:`unshard`)."""

import numbers

import numpy as np

from ..host_arrays import adopt
from .transport import group_of

#: The sharding layouts along the sequence axis.
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def shard_rows(n, size, rank, layout="contiguous"):
    """The rows of a sequence of length ``n`` that rank ``rank`` of ``size`` holds.

    Parameters
    ----------
    n : int
        Length of the whole sequence; ``size`` must divide it (``2 * size`` for ``"zigzag"``).
    size, rank : int
        The communicator's size and this rank.
    layout : {"contiguous", "zigzag"}

    Returns
    -------
    rows : ndarray of int64
        The global row indices of the shard, in the order the shard stores them.

    Raises
    ------
    TypeError
        ``n``, ``size`` or ``rank`` not an integer.
    ValueError
        ``n < 0``, ``size < 1``, ``rank`` outside ``[0, size)``, a length that does not split
        into equal parts, or an unknown layout.
    """
    for name, x in (("n", n), ("size", size), ("rank", rank)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(x).__name__}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if size < 1:
        raise ValueError(f"size must be >= 1 (the number of ranks), got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, size) = [0, {size}), got {rank}")
    check_layout(layout)
    parts = size if layout == "contiguous" else 2 * size
    if n % parts:
        raise ValueError(f"a sequence of length {n} does not split into {parts} equal parts "
                         f"({layout} layout over {size} ranks)")
    c = n // parts
    if layout == "contiguous":
        return np.arange(rank * c, (rank + 1) * c)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)])


def _axis(x, axis):
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of shape {x.shape}")
    return axis % x.ndim


def _host(name, x):
    """``x`` as a NumPy array (no copy; nested sequences too) and how to hand a result back
    as its kind (a torch tensor for a tensor)."""
    if isinstance(x, (list, tuple)):
        return np.asarray(x), (lambda y: y)
    (a,), restore = adopt([(name, x)])
    return a, restore


def shard(x, comm=None, layout="contiguous", *, axis=-2):
    """This rank's shard of a full array, along the sequence axis.

    Parameters
    ----------
    x : ndarray or torch.Tensor (CPU)
        The whole array, the same on every rank (e.g. ``q`` of shape ``(..., H, L, E)``).
    comm : mpi4py.MPI.Intracomm or torch.distributed.ProcessGroup, optional
        Default ``MPI.COMM_WORLD``.
    layout : {"contiguous", "zigzag"}
        See :mod:`sdpa_numba.distributed`.
    axis : int, keyword-only
        The sequence axis; default -2 (``(..., L, E)``; use -1 for an ``lse`` of shape
        ``(..., L)``).

    Returns
    -------
    ndarray or torch.Tensor
        A view of ``x`` for ``"contiguous"``, a new array for ``"zigzag"``; a tensor for a
        tensor.

    Notes
    -----
    Local: nothing is communicated.
    """
    group = group_of(comm, private=False)
    x, restore = _host("x", x)
    ax = _axis(x, axis)
    rows = shard_rows(x.shape[ax], group.size, group.rank, layout)
    if layout == "contiguous":
        index = [slice(None)] * x.ndim
        index[ax] = slice(int(rows[0]), int(rows[-1]) + 1) if len(rows) else slice(0, 0)
        return restore(x[tuple(index)])
    return restore(np.take(x, rows, axis=ax))


def unshard(x_local, comm=None, layout="contiguous", *, axis=-2):
    """The whole array from every rank's shard (the inverse of :func:`shard`), on every rank.

    Parameters
    ----------
    x_local : ndarray or torch.Tensor (CPU)
        This rank's shard; every rank passes the same shape and dtype.
    comm : mpi4py.MPI.Intracomm or torch.distributed.ProcessGroup, optional
        Default ``MPI.COMM_WORLD``.
    layout : {"contiguous", "zigzag"}
    axis : int, keyword-only
        The sequence axis; default -2.

    Returns
    -------
    ndarray or torch.Tensor
        The whole array (a new C-contiguous array), length ``size * n_local`` along ``axis``;
        a tensor for a tensor.

    Raises
    ------
    ValueError
        On every rank when the shards' shapes or dtypes differ across ranks.

    Notes
    -----
    Collective: every rank of ``comm`` must call it.
    """
    group = group_of(comm, private=False)
    check_layout(layout)
    x_local, restore = _host("x_local", x_local)
    x_local = np.ascontiguousarray(x_local)
    ax = _axis(x_local, axis)
    sig = (tuple(x_local.shape), x_local.dtype.str, ax)
    sigs = group.allgather(sig)
    if any(s != sigs[0] for s in sigs):
        raise ValueError(f"unshard: shards differ across ranks (shape, dtype, axis): {sigs}")
    P = group.size
    parts = np.empty((P, *x_local.shape), x_local.dtype)
    group.allgather_bytes(x_local.reshape(-1).view(np.uint8), parts.reshape(-1).view(np.uint8))
    n = x_local.shape[ax]
    full_shape = list(x_local.shape)
    full_shape[ax] = P * n
    full = np.empty(full_shape, x_local.dtype)
    for r in range(P):
        rows = shard_rows(P * n, P, r, layout)
        index = [slice(None)] * full.ndim
        index[ax] = rows
        full[tuple(index)] = parts[r]
    return restore(full)
