"""Ring attention over MPI (mpi4py): exact attention on a sequence sharded across processes.

Each rank of a communicator holds a shard of the queries, keys and values along the sequence
axis (the second-to-last axis). The key/value shards travel around the ring (rank ``r`` sends
to ``r + 1`` and receives from ``r - 1``) while each rank attends its queries to the shard it
holds; the partial results are combined exactly by their log-sum-exp
(:func:`~sdpa_numba.merge_attention_states`). After ``P`` steps every rank has the exact output
of its queries against the whole sequence. The backward keeps dQ on its rank and sends dK/dV
around the ring with the keys they belong to, back to their owners (Liu et al. 2023, "Ring
attention with blockwise transformers"; the zigzag layout and the backward's schedule follow
zhuzilin/ring-flash-attention). Only keys, values and their gradients travel; scores never do.

* Layouts. ``"contiguous"``: rank ``r`` of ``P`` holds rows ``[r n, (r + 1) n)`` of the
  sequence. ``"zigzag"``: the sequence is cut into ``2 P`` equal chunks and rank ``r`` holds
  chunks ``r`` and ``2 P - 1 - r``, concatenated; with ``is_causal`` every rank then does the
  same work at every step (half of a full block), where the contiguous layout leaves rank 0
  idle for all but one step. :func:`shard` and :func:`unshard` convert full arrays to and
  from either layout.
* Determinism. Every rank merges its partial results in a fixed order (ring step 0, 1, ...)
  and every dK/dV is accumulated in a fixed order (its owner's contribution first, then the
  next ranks' in ring order), on top of kernels whose results do not depend on the thread
  count: repeated runs give bitwise the same result for any thread count (not, in general,
  for another number of ranks: the sums are grouped differently).
* Overlap. The next key/value shard is posted (``Isend``/``Irecv``) before the current one is
  computed, and a dK/dV shard travels while the next step is computed. Whether the transfer
  really progresses during the computation is the MPI library's business: over shared memory
  and most network transports large messages move at the next MPI call unless the library
  runs an asynchronous progress thread (MPICH: ``MPICH_ASYNC_PROGRESS=1``, which costs a core).
  On a cluster, see docs/distributed.md for when the transfer is hidden at all.
* Errors. Arguments are checked on every rank, then compared across ranks (one small
  ``allgather``) before anything is computed; after every ring step the ranks exchange an
  error flag, so that an exception on one rank (bad input, a failing kernel) is raised on every
  rank instead of leaving the others waiting for a message that never comes.
* CUDA arrays are not supported yet (NotImplementedError): a CUDA-aware MPI could send device
  buffers directly, see docs/distributed.md.

mpi4py is imported when a function here is called, not when this module is imported.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .api import scaled_dot_product_attention
from .backward import scaled_dot_product_attention_backward
from .merge import merge_attention_states
from .problem import compute_dtype
from .problem.arguments import check_flag

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard", "shard_rows",
           "LAYOUTS"]

#: The sharding layouts along the sequence axis.
LAYOUTS = ("contiguous", "zigzag")

#: The attention variants of the dense API that ring attention does not shard yet; each is
#: accepted only at its "off" value (None, or top-left alignment).
_VARIANTS = {"window": None, "alignment": "top_left", "softcap": None, "alibi_slopes": None,
             "sinks": None, "score_mod": None, "mask_mod": None, "mod_args": None,
             "score_mod_grad": None}

# Message tags (on a private duplicate of the caller's communicator).
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("sdpa_numba.distributed needs mpi4py: pip install 'sdpa_numba[mpi]' "
                          "(mpi4py and the MPICH wheel), or mpi4py built against your "
                          "cluster's MPI") from e
    return MPI


def _comm(comm):
    MPI = _mpi()
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), "
                        f"got {type(comm).__name__}")
    return comm


def _check_layout(layout):
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
    """
    _check_layout(layout)
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


def shard(x, comm=None, layout="contiguous", *, axis=-2):
    """This rank's shard of a full array, along the sequence axis.

    Parameters
    ----------
    x : ndarray
        The whole array, the same on every rank (e.g. ``q`` of shape ``(..., H, L, E)``).
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``.
    layout : {"contiguous", "zigzag"}
        See :mod:`sdpa_numba.distributed`.
    axis : int, keyword-only
        The sequence axis; default -2 (``(..., L, E)``; use -1 for an ``lse`` of shape
        ``(..., L)``).

    Returns
    -------
    ndarray
        A view of ``x`` for ``"contiguous"``, a new array for ``"zigzag"``.

    Notes
    -----
    Local: nothing is communicated.
    """
    comm = _comm(comm)
    x = np.asarray(x)
    ax = _axis(x, axis)
    rows = shard_rows(x.shape[ax], comm.Get_size(), comm.Get_rank(), layout)
    if layout == "contiguous":
        index = [slice(None)] * x.ndim
        index[ax] = slice(int(rows[0]), int(rows[-1]) + 1) if len(rows) else slice(0, 0)
        return x[tuple(index)]
    return np.take(x, rows, axis=ax)


def _as_bytes(a):
    """A C-contiguous array's memory as a flat uint8 view: MPI moves bytes, whatever the
    dtype (float16 and bfloat16 have no MPI datatype)."""
    return a.reshape(-1).view(np.uint8)


def unshard(x_local, comm=None, layout="contiguous", *, axis=-2):
    """The whole array from every rank's shard (the inverse of :func:`shard`), on every rank.

    Parameters
    ----------
    x_local : ndarray
        This rank's shard; every rank passes the same shape and dtype.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``.
    layout : {"contiguous", "zigzag"}
    axis : int, keyword-only
        The sequence axis; default -2.

    Returns
    -------
    ndarray
        The whole array (a new C-contiguous array), length ``size * n_local`` along ``axis``.

    Raises
    ------
    ValueError
        On every rank when the shards' shapes or dtypes differ across ranks.

    Notes
    -----
    Collective: every rank of ``comm`` must call it.
    """
    comm = _comm(comm)
    _check_layout(layout)
    x_local = np.ascontiguousarray(x_local)
    ax = _axis(x_local, axis)
    sig = (tuple(x_local.shape), x_local.dtype.str, ax)
    sigs = comm.allgather(sig)
    if any(s != sigs[0] for s in sigs):
        raise ValueError(f"unshard: shards differ across ranks (shape, dtype, axis): {sigs}")
    P = comm.Get_size()
    parts = np.empty((P, *x_local.shape), x_local.dtype)
    comm.Allgather(_as_bytes(x_local), _as_bytes(parts))
    n = x_local.shape[ax]
    full_shape = list(x_local.shape)
    full_shape[ax] = P * n
    full = np.empty(full_shape, x_local.dtype)
    for r in range(P):
        rows = shard_rows(P * n, P, r, layout)
        index = [slice(None)] * full.ndim
        index[ax] = rows
        full[tuple(index)] = parts[r]
    return full


# ------------------------------------------------------------------------------------------
# Collective checks and error propagation.

class _Collective:
    """A private duplicate of the caller's communicator (our messages never match theirs),
    with the error exchange that keeps the ranks together."""

    def __init__(self, comm):
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()

    def free(self):
        self.comm.Free()

    def agree(self, error, what, cleanup=None):
        """Every rank learns whether any rank failed; all raise if one did.

        ``error``: this rank's exception or None. The failing rank re-raises its own; the
        others raise an exception of the same kind (ValueError, TypeError,
        NotImplementedError; RuntimeError for anything else) naming the rank and its message.
        ``cleanup`` (e.g. waiting for messages every rank has posted) runs before raising.
        """
        summary = None if error is None else (type(error).__name__, str(error))
        summaries = self.comm.allgather(summary)
        failed = [(r, s) for r, s in enumerate(summaries) if s is not None]
        if not failed:
            return
        if cleanup is not None:
            cleanup()
        if error is not None:
            raise error
        r, (name, message) = failed[0]
        kind = {"ValueError": ValueError, "TypeError": TypeError,
                "NotImplementedError": NotImplementedError}.get(name, RuntimeError)
        raise kind(f"ring attention stopped {what}: rank {r} raised {name}: {message}")


def _check_variants(attn_mask, dropout_p, variants):
    unknown = sorted(set(variants) - set(_VARIANTS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
    if attn_mask is not None:
        raise ValueError("ring attention takes no dense attn_mask: an (L, S) mask cannot be "
                         "sharded along with the keys; use is_causal (windows, ALiBi, softcap "
                         "and sinks will come as keyword arguments)")
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real) \
            or dropout_p != 0:
        raise NotImplementedError(f"ring attention has no dropout yet (dropout_p={dropout_p!r}):"
                                  f" pass dropout_p=0")
    used = sorted(name for name, value in variants.items()
                  if value is not None and not (isinstance(value, str)
                                                and value == _VARIANTS[name]))
    if used:
        raise NotImplementedError(f"ring attention does not support the variant(s) "
                                  f"{', '.join(used)} yet: only causal and non-causal attention "
                                  f"(with GQA) are sharded")


def _is_host_array(x):
    return isinstance(x, np.ndarray) and not hasattr(x, "__cuda_array_interface__")


def _check_arrays(named):
    for name, x in named:
        if hasattr(x, "__cuda_array_interface__"):
            raise NotImplementedError(f"{name} is a CUDA array: ring attention runs on NumPy "
                                      f"arrays only for now (a CUDA-aware MPI could send device "
                                      f"buffers; see docs/distributed.md)")
        if not _is_host_array(x):
            raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
        least = 1 if name == "lse" else 2
        if x.ndim < least:
            raise ValueError(f"{name} must have at least {least} dims, got shape {x.shape}")


def _check_local(q, k, is_causal, layout):
    L, S = q.shape[-2], k.shape[-2]
    if is_causal and L != S:
        raise ValueError(f"causal ring attention needs query and key shards of the same "
                         f"length (the global positions must line up): query {q.shape}, "
                         f"key {k.shape}")
    if layout == "zigzag" and (L % 2 or S % 2):
        raise ValueError(f"the zigzag layout needs shards of even length (two equal chunks "
                         f"each): query {q.shape}, key {k.shape}")


def _signature(arrays, **flags):
    return tuple((tuple(a.shape), a.dtype.str) for a in arrays) + tuple(sorted(flags.items()))


def _compare(coll, sig, names):
    sigs = coll.comm.allgather(sig)
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if bad:
        def show(s):
            arrays = ", ".join(f"{n} {shape} {dt}" for n, (shape, dt) in
                               zip(names, s[:len(names)]))
            return arrays + "; " + ", ".join(f"{k}={v!r}" for k, v in s[len(names):])
        raise ValueError(f"ring attention needs the same shapes, dtypes and arguments on "
                         f"every rank: rank 0 has {show(sigs[0])}; rank {bad[0]} has "
                         f"{show(sigs[bad[0]])}")


# ------------------------------------------------------------------------------------------
# The work of one ring step.

def _blocks(layout, is_causal, n_q, n_k, rank, src):
    """What rank ``rank``'s queries do against the key/value shard of rank ``src``: a list
    of ``(query rows, key rows, causal)`` (slices of the local shards), possibly empty.

    Both layouts cut the sequence into chunks of equal length aligned for queries and keys,
    so each (query chunk, key chunk) pair is wholly visible (earlier keys), causal on the
    diagonal (top-left aligned, as the dense kernels' ``is_causal``), or wholly masked.
    """
    full_q, full_k = slice(0, n_q), slice(0, n_k)
    if not is_causal:
        return [(full_q, full_k, False)]
    if src == rank:  # the diagonal: local causal is global causal in both layouts
        return [(full_q, full_k, True)]
    if layout == "contiguous":
        return [(full_q, full_k, False)] if src < rank else []
    c = n_q // 2  # zigzag: chunks (rank, 2P-1-rank) against (src, 2P-1-src)
    if src < rank:  # both query chunks see the first key chunk, neither sees the second
        return [(full_q, slice(0, c), False)]
    # src > rank: only the second query chunk (2P-1-rank) sees keys, and it sees both chunks
    return [(slice(c, n_q), full_k, False)]


def _rows(x, s, axis=-2):
    index = [slice(None)] * x.ndim
    index[axis] = s
    return x[tuple(index)]


class _Exchange:
    """Non-blocking exchange of a set of arrays with the ring's neighbours: send ours to
    ``rank + 1``, receive the same shapes from ``rank - 1`` into ``recv``."""

    def __init__(self, coll, send, recv, tags):
        self.requests = []
        if coll.size == 1:
            return
        nxt, prev = (coll.rank + 1) % coll.size, (coll.rank - 1) % coll.size
        for s, r, tag in zip(send, recv, tags):
            self.requests.append(coll.comm.Irecv(_as_bytes(r), source=prev, tag=tag))
            self.requests.append(coll.comm.Isend(_as_bytes(s), dest=nxt, tag=tag))

    def wait(self):
        if self.requests:
            _mpi().Request.Waitall(self.requests)
            self.requests = []


def _prepare(coll, arrays, names, is_causal, scale, enable_gqa, layout, attn_mask, dropout_p,
             variants, extra=None):
    """The local and the collective checks; every rank raises if one fails."""
    error = None
    try:
        _check_variants(attn_mask, dropout_p, variants)
        _check_layout(layout)
        is_causal = check_flag("is_causal", is_causal)
        enable_gqa = check_flag("enable_gqa", enable_gqa)
        _check_arrays(list(zip(names, arrays)))
        if extra is not None:
            extra()
        q, k = arrays[names.index("query")], arrays[names.index("key")]
        _check_local(q, k, is_causal, layout)
        from .problem import plan

        p = plan(q, k, arrays[names.index("value")], None, is_causal, scale, enable_gqa)
    except Exception as e:  # every rank must hear of it before anyone communicates
        error = e
    coll.agree(error, "before the first step (bad input)")
    sig = _signature(arrays, is_causal=is_causal, scale=p.scale, enable_gqa=enable_gqa,
                     layout=layout)
    _compare(coll, sig, names)
    return p, is_causal, enable_gqa


def ring_attention(q: Any, k: Any, v: Any, *, comm: Any = None, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False,
                   layout: str = "contiguous", return_lse: bool = False,
                   attn_mask: Any = None, dropout_p: float = 0.0, **variants: Any) -> Any:
    """Exact attention of this rank's queries against the whole sharded sequence.

    Collective: every rank of ``comm`` calls it with its own shards, of the same shapes.

    Parameters
    ----------
    q : ndarray, shape (..., Hq, L_local, E)
        This rank's shard of the queries (rows in the order ``layout`` says, see
        :func:`shard`). float16, bfloat16, float32 or float64, any strides.
    k : ndarray, shape (..., H, S_local, E)
    v : ndarray, shape (..., H, S_local, Ev)
        This rank's shards of the keys and values. Leading dims broadcast as in
        :func:`~sdpa_numba.scaled_dot_product_attention`.
    comm : mpi4py.MPI.Intracomm, keyword-only, optional
        Default ``MPI.COMM_WORLD``. A communicator of size 1 computes plain attention.
    is_causal : bool, keyword-only
        Causal over the global positions (query ``i`` sees keys ``j <= i``); needs
        ``S_local == L_local``.
    scale : float, keyword-only, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool, keyword-only
        Grouped-query attention, as in the dense function.
    layout : {"contiguous", "zigzag"}, keyword-only
        How the sequence is sharded (see :mod:`sdpa_numba.distributed`). ``"zigzag"`` needs
        even shard lengths and balances the causal work.
    return_lse : bool, keyword-only
        Also return the log-sum-exp of each query row over the whole sequence.
    attn_mask, dropout_p, **variants
        A dense ``attn_mask`` is refused (ValueError): it cannot be sharded with the keys.
        ``dropout_p`` must be 0 and the dense API's variants (``window``, ``alignment``,
        ``softcap``, ``alibi_slopes``, ``sinks``, ``score_mod``, ``mask_mod``, ``mod_args``,
        ``score_mod_grad``) are accepted only when off (None, ``alignment="top_left"``);
        otherwise NotImplementedError names them.

    Returns
    -------
    out : ndarray, shape (..., Hq, L_local, Ev)
        This rank's shard of the output, the inputs' dtype.
    lse : ndarray, shape (..., Hq, L_local), only with ``return_lse=True``
        In the compute dtype (float32, or float64 for float64 inputs); pass it with ``out``
        to :func:`ring_attention_backward`.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        For bad input on any rank or shapes, dtypes or arguments that differ across ranks:
        raised on every rank, before any key or value is sent.
    RuntimeError (or the failing rank's exception kind)
        When a rank fails during the ring: every rank raises after the step in progress.

    Notes
    -----
    The key/value shard for the next step is sent (``Isend``/``Irecv`` to the ring's
    neighbours) before the current step is computed. Memory: two key/value shards and one
    partial output beyond the result. Bitwise reproducible for a given number of ranks and
    any thread count.
    """
    comm = _comm(comm)
    coll = _Collective(comm)
    try:
        p, is_causal, enable_gqa = _prepare(
            coll, [q, k, v], ["query", "key", "value"], is_causal, scale, enable_gqa, layout,
            attn_mask, dropout_p, variants, extra=lambda: check_flag("return_lse", return_lse))
        return _forward(coll, q, k, v, p, is_causal, enable_gqa, layout, bool(return_lse))
    finally:
        coll.free()


def _forward(coll, q, k, v, p, is_causal, enable_gqa, layout, return_lse):
    P, rank = coll.size, coll.rank
    n_q, n_k = q.shape[-2], k.shape[-2]
    # Two key/value buffers: the one being computed (and sent on) and the one being received.
    cur = [np.ascontiguousarray(k).copy(), np.ascontiguousarray(v).copy()]
    nxt = [np.empty_like(cur[0]), np.empty_like(cur[1])]
    out = lse = None
    for t in range(P):
        src = (rank - t) % P
        exchange = _Exchange(coll, cur, nxt, (_TAG_K, _TAG_V)) if t < P - 1 else None
        error = None
        try:
            for qs, ks, causal in _blocks(layout, is_causal, n_q, n_k, rank, src):
                o, l_ = scaled_dot_product_attention(
                    _rows(q, qs), _rows(cur[0], ks), _rows(cur[1], ks), is_causal=causal,
                    scale=p.scale, enable_gqa=enable_gqa, return_lse=True)
                if out is None:  # step 0 (the diagonal) always covers every query row
                    out, lse = o, l_
                elif qs == slice(0, n_q):
                    out, lse = merge_attention_states(out, lse, o, l_)
                else:
                    o2, l2 = merge_attention_states(_rows(out, qs), _rows(lse, qs, -1), o, l_)
                    _rows(out, qs)[...] = o2
                    _rows(lse, qs, -1)[...] = l2
        except Exception as e:  # finish the step's messages, then tell every rank
            error = e
        if exchange is not None:
            exchange.wait()
        coll.agree(error, f"at ring step {t}")
        cur, nxt = nxt, cur
    return (out, lse) if return_lse else out


def ring_attention_backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                            comm: Any = None, is_causal: bool = False,
                            scale: float | None = None, enable_gqa: bool = False,
                            layout: str = "contiguous", attn_mask: Any = None,
                            dropout_p: float = 0.0, **variants: Any) -> tuple[Any, Any, Any]:
    """Gradients of :func:`ring_attention` with respect to this rank's shards.

    Collective: every rank of ``comm`` calls it with its own shards.

    Parameters
    ----------
    grad_out : ndarray, shape (..., Hq, L_local, Ev)
        Gradient of the loss with respect to this rank's output shard.
    q, k, v
        This rank's shards, as given to :func:`ring_attention`.
    out, lse : ndarray
        What :func:`ring_attention` returned on this rank with ``return_lse=True`` (the
        output and log-sum-exp over the whole sequence).
    comm, is_causal, scale, enable_gqa, layout, attn_mask, dropout_p, **variants
        As given to :func:`ring_attention` (same checks).

    Returns
    -------
    grad_q, grad_k, grad_v : ndarray
        The gradients of this rank's ``q``, ``k`` and ``v`` shards, their shapes and dtype.

    Raises
    ------
    TypeError, ValueError, NotImplementedError, RuntimeError
        As :func:`ring_attention`: on every rank.

    Notes
    -----
    FlashAttention-2's backward per ring step
    (:func:`~sdpa_numba.scaled_dot_product_attention_backward` with the global ``out`` and
    ``lse``, so that each key/value shard's contribution is exact). dQ stays on its rank; the keys and values travel ``P - 1`` hops and their
    gradients ``P`` hops, accumulated in the compute dtype along the way and so arriving at
    their owners. The next key/value shard is sent before the current step is computed, and
    a dK/dV shard travels while the next step is computed. Bitwise reproducible for a given
    number of ranks and any thread count: every sum has a fixed order.
    """
    comm = _comm(comm)
    coll = _Collective(comm)
    names = ["query", "key", "value", "grad_out", "out", "lse"]

    def check_like():
        from .problem import plan

        p0 = plan(q, k, v, None, bool(is_causal), scale, bool(enable_gqa))
        for name, x, shape, dt in (("grad_out", grad_out, p0.out_shape, p0.dtype),
                                   ("out", out, p0.out_shape, p0.dtype),
                                   ("lse", lse, p0.out_shape[:-1], p0.compute_dtype)):
            if tuple(x.shape) != tuple(shape) or x.dtype != dt:
                raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dt}, got "
                                 f"{tuple(x.shape)} {x.dtype}")

    try:
        p, is_causal, enable_gqa = _prepare(
            coll, [q, k, v, grad_out, out, lse], names, is_causal, scale, enable_gqa, layout,
            attn_mask, dropout_p, variants, extra=check_like)
        return _backward(coll, grad_out, q, k, v, out, lse, p, is_causal, enable_gqa, layout)
    finally:
        coll.free()


def _backward(coll, grad_out, q, k, v, out, lse, p, is_causal, enable_gqa, layout):
    P, rank = coll.size, coll.rank
    n_q, n_k = q.shape[-2], k.shape[-2]
    ct = compute_dtype(q.dtype)
    cur = [np.ascontiguousarray(k).copy(), np.ascontiguousarray(v).copy()]
    nxt = [np.empty_like(cur[0]), np.empty_like(cur[1])]
    # dK/dV accumulators in the compute dtype: the one for the shard held now, the one coming.
    acc = [np.zeros(k.shape, ct), np.zeros(v.shape, ct)]
    acc_next = [np.empty_like(acc[0]), np.empty_like(acc[1])]
    dq = np.zeros(q.shape, ct)
    grads_exchange = None  # the dK/dV accumulators in flight, for the next step
    for t in range(P):
        src = (rank - t) % P
        exchange = _Exchange(coll, cur, nxt, (_TAG_K, _TAG_V)) if t < P - 1 else None
        error = None
        parts = []
        try:
            for qs, ks, causal in _blocks(layout, is_causal, n_q, n_k, rank, src):
                dq_p, dk_p, dv_p = scaled_dot_product_attention_backward(
                    _rows(grad_out, qs), _rows(q, qs), _rows(cur[0], ks), _rows(cur[1], ks),
                    _rows(out, qs), _rows(lse, qs, -1), is_causal=causal, scale=p.scale,
                    enable_gqa=enable_gqa)
                parts.append((qs, ks, dq_p, dk_p, dv_p))
        except Exception as e:
            error = e
        # The accumulators of this step's shard arrive (sent by rank - 1 during the step).
        if grads_exchange is not None:
            grads_exchange.wait()
            acc, acc_next = acc_next, acc
        if error is None:
            try:
                for qs, ks, dq_p, dk_p, dv_p in parts:
                    _rows(dq, qs)[...] += dq_p
                    _rows(acc[0], ks)[...] += dk_p
                    _rows(acc[1], ks)[...] += dv_p
            except Exception as e:
                error = e
        # Send them on; after the last step's hop each shard's gradients reach their owner.
        grads_exchange = _Exchange(coll, acc, acc_next, (_TAG_DK, _TAG_DV))
        if exchange is not None:
            exchange.wait()
        if t == P - 1:
            grads_exchange.wait()
        # On failure, finish the dK/dV messages every rank has posted, then raise everywhere.
        coll.agree(error, f"at ring step {t}", cleanup=grads_exchange.wait)
        cur, nxt = nxt, cur
    if P > 1:
        acc = acc_next  # our own shard's gradients, home after P hops
    return dq.astype(q.dtype), acc[0].astype(k.dtype), acc[1].astype(v.dtype)
