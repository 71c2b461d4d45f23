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
* Variants. ``window``, ``alignment``, ``is_causal`` and ``alibi_slopes`` act on the global
  positions: each dense call runs with the recipe offset ``qs - ks + offset`` (its first
  query row's and first key's global positions, and the whole sequence's alignment offset),
  so that ``i' - j`` is the global one; ``softcap`` is local to each score; ``sinks`` join each
  row once, after the last step. Work a window leaves empty is skipped (the shards still
  travel). ``score_mod``/``mask_mod``/``block_mask`` are refused (they see one call's
  positions); so is a dense ``attn_mask``.
* CUDA arrays (Numba device arrays, CuPy, torch CUDA tensors) run on the GPU launchers, their
  partial results merged and summed on the device (:mod:`sdpa_numba.gpu.ring`). The shards
  go to MPI as device buffers when the MPI library is CUDA-aware (:func:`mpi_cuda_aware`:
  ``MPIX_Query_cuda_support``, overridden by ``SDPA_NUMBA_MPI_CUDA_AWARE=0/1``), else
  through host buffers (a copy each way per message); the CUDA simulator's arrays are always
  staged. See docs/distributed.md.

mpi4py is imported when a function here is called, not when this module is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import os
from typing import Any

import numpy as np

from ..merge import merge_attention_states
from ..problem import compute_dtype
from ..problem.arguments import check_flag
from ..problem.variants import sinks_grad
from ..score.recipe import NO_LIMIT

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard", "shard_rows",
           "mpi_cuda_aware", "LAYOUTS", "CUDA_AWARE_ENV"]

#: The sharding layouts along the sequence axis.
LAYOUTS = ("contiguous", "zigzag")

#: The attention variants of the dense API that ring attention shards (validated as the
#: dense functions do, with the same keywords and defaults).
_SHARDED = ("window", "alignment", "softcap", "alibi_slopes", "sinks")

#: The variants it refuses unless off: the user's functions see the positions of one dense
#: call, and a block mask is laid out for the whole (L, S) problem.
_REFUSED = ("score_mod", "mask_mod", "mod_args", "score_mod_grad", "block_mask")

# Message tags (on a private duplicate of the caller's communicator).
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14

#: The environment variable that overrides the detection of a CUDA-aware MPI library:
#: "1" passes device buffers to MPI, "0" stages them through host buffers.
CUDA_AWARE_ENV = "SDPA_NUMBA_MPI_CUDA_AWARE"


def mpi_cuda_aware():
    """Whether device buffers go to MPI directly (else through host buffers).

    ``SDPA_NUMBA_MPI_CUDA_AWARE=1`` or ``0`` decides; unset, the MPI library is asked:
    mpi4py's ``MPI.Query_cuda_support()`` where it has one, else the library's own
    ``MPIX_Query_cuda_support()`` (an extension of Open MPI and MPICH, found in the ``libmpi``
    this process loaded). A library that cannot say is taken as not CUDA-aware (staging:
    slower, never wrong). The CUDA simulator's arrays are host memory and always staged.
    """
    env = os.environ.get(CUDA_AWARE_ENV)
    if env is not None and env.strip() != "":
        if env.strip() not in ("0", "1"):
            raise ValueError(f"{CUDA_AWARE_ENV} must be 0 or 1, got {env!r}")
        return env.strip() == "1"
    query = getattr(_mpi(), "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # an MPI library without the query (NotImplementedError in mpi4py)
            return False
    return bool(_mpix_query_cuda_support())


_MPIX_ANSWER: list = []  # the library's answer, asked once per process


def _mpix_query_cuda_support():
    """``MPIX_Query_cuda_support()`` of the MPI library mpi4py loaded (mpi4py 4.1 does not
    wrap it; the library is opened with local symbols, so it is found by its path among the
    process's mappings: Linux only). None when the library cannot be asked."""
    if _MPIX_ANSWER:
        return _MPIX_ANSWER[0]
    answer = None
    try:
        import ctypes

        _mpi()  # initialized: the query must follow MPI_Init
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f
                           if "/libmpi" in line and ".so" in line.split()[-1]})
        for path in libs:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, "MPIX_Query_cuda_support", None)
            if fn is not None:
                fn.restype, fn.argtypes = ctypes.c_int, []
                answer = bool(fn())
                break
    except Exception:  # no /proc, no such symbol: cannot say
        answer = None
    _MPIX_ANSWER.append(answer)
    return answer


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
    dtype (float16 and bfloat16 have no MPI datatype). Device arrays stay on the device
    (a Numba device array, which mpi4py takes by its ``__cuda_array_interface__``)."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).view(np.uint8)
    from ..gpu.arrays import as_strided

    return as_strided(a, (a.size * a.dtype.itemsize,), (1,), np.uint8)


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
    unknown = sorted(set(variants) - set(_SHARDED) - set(_REFUSED))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
    if attn_mask is not None:
        raise ValueError("ring attention takes no dense attn_mask: an (L, S) mask cannot be "
                         "sharded along with the keys; use is_causal, window, alignment, "
                         "alibi_slopes, softcap or sinks, which depend on positions only")
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real) \
            or dropout_p != 0:
        raise NotImplementedError(f"ring attention has no dropout yet (dropout_p={dropout_p!r}):"
                                  f" pass dropout_p=0")
    used = [name for name in _REFUSED if variants.get(name) is not None
            and not (name == "mod_args" and isinstance(variants[name], (tuple, list))
                     and len(variants[name]) == 0)]
    if used:
        raise NotImplementedError(
            f"ring attention does not shard {', '.join(used)}: a score_mod or mask_mod is "
            f"called with the positions i, j of one dense call (not the global ones), and a "
            f"block_mask covers the whole (L, S) problem; the variants that depend on global "
            f"positions only (is_causal, window, alignment, alibi_slopes) and softcap and "
            f"sinks are sharded")
    return {name: variants[name] for name in _SHARDED if name in variants}


def _is_host_array(x):
    return isinstance(x, np.ndarray) and not hasattr(x, "__cuda_array_interface__")


def _device_kind(named):
    """'host' for NumPy arrays, 'cuda' for CUDA arrays (Numba device arrays, real or
    simulated, CuPy, torch CUDA tensors); TypeError for anything else or a mix."""
    from ..api import _is_device_array

    kinds = {}
    for name, x in named:
        if _is_device_array(x):
            kinds[name] = "cuda"
        elif _is_host_array(x):
            kinds[name] = "host"
        else:
            raise TypeError(f"{name} must be a NumPy array or a CUDA array, got "
                            f"{type(x).__name__}")
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{n} on {k}" for n, k in kinds.items())
        raise TypeError(f"inputs mix host and device arrays ({desc}): put them on one device")
    return next(iter(kinds.values()))


def _check_arrays(named):
    for name, x in named:
        least = 1 if name == "lse" else 2
        if x.ndim < least:
            raise ValueError(f"{name} must have at least {least} dims, got shape {x.shape}")


def _check_local(q, k, layout):
    # tuple(): the CUDA simulator's shapes take no negative index
    L, S = tuple(q.shape)[-2], tuple(k.shape)[-2]
    if layout == "zigzag" and (L % 2 or S % 2):
        raise ValueError(f"the zigzag layout needs shards of even length (two equal chunks "
                         f"each): query {q.shape}, key {k.shape}")


def _digest(a):
    """A small array (ALiBi slopes, sinks) as something the ranks can compare."""
    if a is None:
        return None
    return (a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16])


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
#
# Every position-dependent variant (causality, the window, ALiBi) is a function of the global
# aligned row i' = gi + goff and the global key gj (goff = S - L for bottom-right alignment
# over the WHOLE sequence, else 0). A dense call on query rows starting at global row qs and
# keys starting at global key ks sees local rows i = gi - qs and keys j = gj - ks, so it runs
# the same variants with the recipe's offset qs - ks + goff: i + offset - j = gi' - gj.
# Causality is the window's right side 0 (folded in by the plan), so one mechanism serves all.

def _chunks(layout, n, size, rank):
    """The chunks of rank ``rank``'s shard: ``(local start, local stop, global start)``; one
    for "contiguous", two for "zigzag" (chunks ``rank`` and ``2 size - 1 - rank``)."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2
    return [(0, c, rank * c), (c, n, (2 * size - 1 - rank) * c)]


def _classify(nq, nk, offset, left, right):
    """"empty", "full" or "partial": which of the ``nq x nk`` (row, key) pairs of a dense call
    with this offset and window are seen (the window's rows are intervals that slide with
    the row, so the keys seen by any row form one interval)."""
    if nq <= 0 or nk <= 0:
        return "empty"
    if max(offset - left, 0) >= min(nq + offset + right, nk):
        return "empty"
    if nq - 1 + offset - left <= 0 and nk - 1 <= offset + right:
        return "full"
    return "partial"


def _work(layout, n_q, n_k, size, rank, src, goff, left, right, alibi):
    """What rank ``rank``'s queries do against the key/value shard of rank ``src``: a list of
    ``(query rows, key rows, offset, left, right)`` (slices of the local shards and the
    recipe's window in the frame of that dense call), possibly empty.

    ``goff``: the global alignment offset; ``left``/``right``: the window (causality folded
    in; ``NO_LIMIT`` for unlimited); ``alibi``: whether the scores depend on ``|i' - j|``.
    Without a window or ALiBi the whole shard pair is one call. Otherwise the shard pair is one
    call when a single offset gives every chunk pair the right keys (e.g. the zigzag diagonal
    under causality: local causal is global causal there); else each chunk pair is trimmed to
    the rows that see a key and the keys that a row sees, empty ones are skipped, and wholly
    visible ones next to each other are joined (without ALiBi they need no offset).
    """
    whole = (slice(0, n_q), slice(0, n_k))
    if not alibi and left >= NO_LIMIT and right >= NO_LIMIT:
        return [(*whole, 0, NO_LIMIT, NO_LIMIT)]
    qch, kch = _chunks(layout, n_q, size, rank), _chunks(layout, n_k, size, src)
    o_one = qch[0][2] - kch[0][2] + goff  # the whole-shard call's offset (both start at 0)
    one = True
    for qa, qb, gq in qch:
        for ka, kb, gk in kch:
            o, o_call = gq - gk + goff, o_one + qa - ka
            if o == o_call:
                continue
            state = _classify(qb - qa, kb - ka, o, left, right)
            if alibi or state == "partial" or \
                    state != _classify(qb - qa, kb - ka, o_call, left, right):
                one = False
    if one:
        if _classify(n_q, n_k, o_one, left, right) == "empty":
            return []
        return [(*whole, o_one, left, right)]
    items = []
    for qa, qb, gq in qch:
        for ka, kb, gk in kch:
            o, nq, nk = gq - gk + goff, qb - qa, kb - ka
            # Rows that see a key: i + o - left <= nk - 1 and i + o + right >= 0.
            i0, i1 = max(-o - right, 0), min(nk - 1 - o + left, nq - 1)
            if i0 > i1:
                continue
            j0, j1 = max(i0 + o - left, 0), min(i1 + o + right, nk - 1)
            if j0 > j1:
                continue
            o2 = o + i0 - j0
            rows, keys = slice(qa + i0, qa + i1 + 1), slice(ka + j0, ka + j1 + 1)
            if not alibi and _classify(i1 - i0 + 1, j1 - j0 + 1, o2, left, right) == "full":
                items.append((rows, keys, 0, NO_LIMIT, NO_LIMIT))
            else:
                items.append((rows, keys, o2, left, right))
    return items if alibi else _join(items)


def _join(items):
    """Join wholly visible items (no window, no offset) that share their keys and have
    adjacent rows, or share their rows and have adjacent keys: fewer, larger dense calls.
    Without ALiBi only: with it, every call needs its true offset."""
    def free(it):
        return it[3] >= NO_LIMIT and it[4] >= NO_LIMIT

    joined = True
    while joined:
        joined = False
        for a in range(len(items)):
            for b in range(len(items)):
                x, y = items[a], items[b]
                if a == b or not (free(x) and free(y)):
                    continue
                if x[1] == y[1] and x[0].stop == y[0].start:
                    new = (slice(x[0].start, y[0].stop), x[1], 0, NO_LIMIT, NO_LIMIT)
                elif x[0] == y[0] and x[1].stop == y[1].start:
                    new = (x[0], slice(x[1].start, y[1].stop), 0, NO_LIMIT, NO_LIMIT)
                else:
                    continue
                items = [it for n, it in enumerate(items) if n not in (a, b)]
                items.insert(min(a, b), new)
                joined = True
                break
            if joined:
                break
    return items


def _rows(x, s, axis=-2):
    index = [slice(None)] * x.ndim
    index[axis] = s
    return x[tuple(index)]


def _block_plan(q, k, v, ring, offset, left, right):
    """The plan of one dense call: the ring's scale, GQA, soft cap and ALiBi, with the
    call's offset and window in its recipe (sinks are folded in once per row, by the ring)."""
    from ..problem import plan

    p = plan(q, k, v, None, False, ring.scale, ring.enable_gqa)
    r = ring.recipe._replace(offset=np.int64(offset), left=np.int64(left),
                             right=np.int64(right))
    return dataclasses.replace(p, recipe=r)


def _attend(q, k, v, ring, offset, left, right):
    """``(out, lse)`` of one dense call (the CPU or GPU launcher, with the ring's recipe)."""
    if ring.device == "cuda":
        from ..gpu import launch
    else:
        from ..cpu import launch

    return launch.run(_block_plan(q, k, v, ring, offset, left, right), q, k, v, None, None)


def _attend_backward(grad_out, q, k, v, out, lse, ring, offset, left, right):
    """``(dq, dk, dv)`` of one dense call, from the GLOBAL ``out`` and ``lse`` rows."""
    if ring.device == "cuda":
        from ..gpu import launch_backward
    else:
        from ..cpu import launch_backward

    p = _block_plan(q, k, v, ring, offset, left, right)
    return launch_backward.run_backward(p, grad_out, q, k, v, None, out, lse, None, False)[:3]


class _HostOps:
    """The ring's buffer operations on NumPy arrays."""

    @staticmethod
    def copy(x):
        return np.ascontiguousarray(x).copy()

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype)

    @staticmethod
    def from_host(x):
        return x

    @staticmethod
    def to_host(x):
        return x

    @staticmethod
    def merge(out, lse, o, lo, qs, n_q):
        """``(out, lse)`` with the state ``(o, lo)`` of rows ``qs`` merged in."""
        if qs == slice(0, n_q):
            return merge_attention_states(out, lse, o, lo)
        o2, l2 = merge_attention_states(_rows(out, qs), _rows(lse, qs, -1), o, lo)
        _rows(out, qs)[...] = o2
        _rows(lse, qs, -1)[...] = l2
        return out, lse

    @staticmethod
    def add(acc, x):
        acc[...] += x

    @staticmethod
    def cast(x, dtype):
        return x.astype(dtype)


class _DeviceOps:
    """The same on Numba device arrays (:mod:`sdpa_numba.gpu.ring`'s kernels)."""

    @staticmethod
    def copy(x):
        from ..gpu.ring import contiguous_copy

        return contiguous_copy(x)

    @staticmethod
    def empty(shape, dtype):
        from ..gpu.arrays import device_array

        return device_array(shape, dtype)

    @staticmethod
    def zeros(shape, dtype):
        from ..gpu.ring import zeros

        return zeros(shape, dtype)

    @staticmethod
    def from_host(x):
        from numba import cuda

        return cuda.to_device(np.ascontiguousarray(x))

    @staticmethod
    def to_host(x):
        return x.copy_to_host()

    @staticmethod
    def merge(out, lse, o, lo, qs, n_q):
        from ..gpu.ring import merge_into

        merge_into(_rows(out, qs), _rows(lse, qs, -1), o, lo)
        return out, lse

    @staticmethod
    def add(acc, x):
        from ..gpu.ring import add_into

        add_into(acc, x)

    @staticmethod
    def cast(x, dtype):
        from ..gpu.reduce import sum_to

        return sum_to(x, tuple(x.shape), dtype)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The validated call: what every ring step needs."""

    scale: float
    enable_gqa: bool
    layout: str
    recipe: Any       # the dense calls' recipe: soft cap, ALiBi; no sinks (offset/window per call)
    goff: int         # the global alignment offset (S - L over the whole sequence, or 0)
    left: int         # the window, causality folded in (NO_LIMIT: unlimited)
    right: int
    sinks: Any        # the plan's recipe with the sinks (None without)
    hq: int
    batch: tuple
    L: int
    out_shape: tuple  # this rank's output shard
    dtype: Any
    device: str       # "host" (NumPy arrays) or "cuda" (Numba device arrays)
    stage: bool       # device buffers go through host buffers to MPI (not CUDA-aware)

    @property
    def ops(self):
        return _DeviceOps if self.device == "cuda" else _HostOps

    def work(self, n_q, n_k, size, rank, src):
        return _work(self.layout, n_q, n_k, size, rank, src, self.goff, self.left,
                     self.right, self.recipe.alibi is not None)


class _Exchange:
    """Non-blocking exchange of a set of arrays with the ring's neighbours: send ours to
    ``rank + 1``, receive the same shapes from ``rank - 1`` into ``recv``."""

    def __init__(self, coll, send, recv, tags, ring):
        self.requests = []
        self.unstage = []  # (device buffer, host buffer) to copy once the messages are in
        if coll.size == 1:
            return
        nxt, prev = (coll.rank + 1) % coll.size, (coll.rank - 1) % coll.size
        if ring.device == "cuda":
            if ring.stage:
                # Through the host: the sent shards copied out now, the received ones copied
                # in by wait(). Blocking copies on the default stream: they follow the kernels
                # that wrote the buffers.
                send = [s.copy_to_host() for s in send]
                host = [np.empty(tuple(r.shape), r.dtype) for r in recv]
                self.unstage = list(zip(recv, host))
                recv = host
            else:
                from numba import cuda

                # MPI reads the device buffers itself: the kernels writing them must be done.
                cuda.synchronize()
        for s, r, tag in zip(send, recv, tags):
            self.requests.append(coll.comm.Irecv(_as_bytes(r), source=prev, tag=tag))
            self.requests.append(coll.comm.Isend(_as_bytes(s), dest=nxt, tag=tag))

    def wait(self):
        if self.requests:
            _mpi().Request.Waitall(self.requests)
            self.requests = []
            for dev, host in self.unstage:
                dev.copy_to_device(host)
            self.unstage = []


def _prepare(coll, arrays, names, is_causal, scale, enable_gqa, layout, attn_mask, dropout_p,
             variants, extra=None):
    """The local and the collective checks; every rank raises if one fails. Returns the
    validated call as a :class:`_Ring`."""
    error = None
    device, restore = "host", None
    try:
        sharded = _check_variants(attn_mask, dropout_p, variants)
        _check_layout(layout)
        is_causal = check_flag("is_causal", is_causal)
        enable_gqa = check_flag("enable_gqa", enable_gqa)
        device = _device_kind(list(zip(names, arrays)))
        if device == "cuda":
            from ..api import adopt
            from ..gpu.arrays import is_simulated_mode
            from ..problem import check_device_strides

            arrays, restore = adopt(device, list(zip(names, arrays)))
            check_device_strides(list(zip(names, arrays)))
            from .._bf16 import is_bfloat16

            if any(is_bfloat16(x.dtype) for x in arrays):
                # The ring's merge and sum kernels (sdpa_numba.gpu.ring) read and write plain
                # floats; bfloat16 storage would need the kernels' storage views.
                raise NotImplementedError("ring attention on bfloat16 CUDA arrays is not built "
                                          "yet: pass float16, float32 or float64, or NumPy "
                                          "arrays")
            # The simulator's arrays are host memory without __cuda_array_interface__.
            stage = is_simulated_mode() or not mpi_cuda_aware()
        else:
            stage = False
        _check_arrays(list(zip(names, arrays)))
        if extra is not None:
            extra(arrays)
        q, k = arrays[names.index("query")], arrays[names.index("key")]
        _check_local(q, k, layout)
        from ..problem import plan

        # The dense functions' checks of the shards and of the variants (its recipe's offset
        # is the shards' S - L; the whole sequence's is size times that).
        p = plan(q, k, arrays[names.index("value")], None, is_causal, scale, enable_gqa,
                 **sharded)
        r = p.recipe
        ring = _Ring(scale=p.scale, enable_gqa=enable_gqa, layout=layout,
                     recipe=r._replace(sinks=None, offset=np.int64(0)),
                     goff=coll.size * int(r.offset), left=int(r.left), right=int(r.right),
                     sinks=None if r.sinks is None else r, hq=p.hq, batch=p.batch, L=p.L,
                     out_shape=p.out_shape, dtype=p.dtype, device=device, stage=stage)
    except Exception as e:  # every rank must hear of it before anyone communicates
        error = e
    coll.agree(error, "before the first step (bad input)")
    sig = _signature(arrays, is_causal=is_causal, scale=ring.scale, enable_gqa=enable_gqa,
                     device=device, layout=layout, window=(ring.left, ring.right), offset=ring.goff,
                     softcap=float(r.softcap), alibi_slopes=_digest(r.alibi),
                     sinks=_digest(r.sinks))
    _compare(coll, sig, names)
    return ring, arrays, (restore or (lambda x: x))


def ring_attention(q: Any, k: Any, v: Any, *, comm: Any = None, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False,
                   layout: str = "contiguous", return_lse: bool = False,
                   attn_mask: Any = None, dropout_p: float = 0.0, **variants: Any) -> Any:
    """Exact attention of this rank's queries against the whole sharded sequence.

    Collective: every rank of ``comm`` calls it with its own shards, of the same shapes.

    Parameters
    ----------
    q : ndarray or CUDA array, shape (..., Hq, L_local, E)
        This rank's shard of the queries (rows in the order ``layout`` says, see
        :func:`shard`). float16, bfloat16, float32 or float64, any strides. NumPy arrays run
        on the CPU; CUDA arrays (Numba device arrays, CuPy, torch CUDA tensors; all operands
        on the device) on the GPU, with device buffers to MPI if it is CUDA-aware
        (:func:`mpi_cuda_aware`), else staged through host buffers.
    k : ndarray, shape (..., H, S_local, E)
    v : ndarray, shape (..., H, S_local, Ev)
        This rank's shards of the keys and values. Leading dims broadcast as in
        :func:`~sdpa_numba.scaled_dot_product_attention`.
    comm : mpi4py.MPI.Intracomm, keyword-only, optional
        Default ``MPI.COMM_WORLD``. A communicator of size 1 computes plain attention.
    is_causal : bool, keyword-only
        Causal over the global positions (query ``i`` sees keys ``j <= i'``, ``i'`` the
        global row in the aligned frame, see ``alignment``).
    scale : float, keyword-only, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool, keyword-only
        Grouped-query attention, as in the dense function.
    layout : {"contiguous", "zigzag"}, keyword-only
        How the sequence is sharded (see :mod:`sdpa_numba.distributed`). ``"zigzag"`` needs
        even shard lengths and balances the causal work.
    return_lse : bool, keyword-only
        Also return the log-sum-exp of each query row over the whole sequence.
    attn_mask, dropout_p
        A dense ``attn_mask`` is refused (ValueError): it cannot be sharded with the keys.
        ``dropout_p`` must be 0 (NotImplementedError otherwise).
    **variants
        ``window``, ``alignment``, ``softcap``, ``alibi_slopes`` and ``sinks``, with the dense
        function's meaning over the WHOLE sequence (global positions ``i`` and ``j``; for
        ``alignment="bottom_right"``, ``i' = i + S - L`` with the whole lengths). ALiBi slopes
        and sinks must be the same on every rank. ``score_mod``, ``mask_mod``, ``mod_args``,
        ``score_mod_grad`` and ``block_mask`` are refused (NotImplementedError) unless off.

    Returns
    -------
    out : ndarray, shape (..., Hq, L_local, Ev)
        This rank's shard of the output, the inputs' dtype (the query's kind of array).
    lse : ndarray, shape (..., Hq, L_local), only with ``return_lse=True``
        In the compute dtype (float32, or float64 for float64 inputs), the sinks included;
        pass it with ``out`` to :func:`ring_attention_backward`.

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
    neighbours) before the current step is computed. A step whose keys no query of this
    rank sees (causality, a window narrower than a shard) computes nothing, but the shard is
    still passed on. Sinks join each row once, after the last step (a part with no value and
    ``lse = sink``). Memory: two key/value shards and one partial output beyond the result.
    Bitwise reproducible for a given number of ranks and any thread count.
    """
    comm = _comm(comm)
    coll = _Collective(comm)
    try:
        ring, (q, k, v), restore = _prepare(
            coll, [q, k, v], ["query", "key", "value"], is_causal, scale, enable_gqa, layout,
            attn_mask, dropout_p, variants, extra=lambda _: check_flag("return_lse", return_lse))
        out, lse = _forward(coll, q, k, v, ring)
        return (restore(out), restore(lse)) if return_lse else restore(out)
    finally:
        coll.free()


def _sink_part(ring, out, lse):
    """The sinks as one more part to merge: ``out`` 0, ``lse`` the head's sink."""
    s = ring.sinks.sinks.reshape(ring.hq, 1)
    sink_lse = np.broadcast_to(s, (*ring.batch, ring.hq, ring.L)).reshape(lse.shape)
    return (ring.ops.zeros(tuple(out.shape), out.dtype),
            ring.ops.from_host(np.ascontiguousarray(sink_lse, dtype=lse.dtype)))


def _nothing_seen(ring):
    """The result of rows that saw no key: ``out`` 0, ``lse`` -inf (as the dense API)."""
    return (ring.ops.zeros(ring.out_shape, ring.dtype),
            ring.ops.from_host(np.full(ring.out_shape[:-1], -np.inf, compute_dtype(ring.dtype))))


def _forward(coll, q, k, v, ring):
    P, rank = coll.size, coll.rank
    n_q, n_k = tuple(q.shape)[-2], tuple(k.shape)[-2]
    ops = ring.ops
    # Two key/value buffers: the one being computed (and sent on) and the one being received.
    cur = [ops.copy(k), ops.copy(v)]
    nxt = [ops.empty(tuple(x.shape), x.dtype) for x in cur]
    out = lse = None
    for t in range(P):
        src = (rank - t) % P
        exchange = _Exchange(coll, cur, nxt, (_TAG_K, _TAG_V), ring) if t < P - 1 else None
        error = None
        try:
            for qs, ks, offset, left, right in ring.work(n_q, n_k, P, rank, src):
                o, l_ = _attend(_rows(q, qs), _rows(cur[0], ks), _rows(cur[1], ks), ring,
                                offset, left, right)
                if out is None and qs == slice(0, n_q):
                    out, lse = o, l_
                    continue
                if out is None:  # no call so far covered every row: start from "no key"
                    out, lse = _nothing_seen(ring)
                out, lse = ops.merge(out, lse, o, l_, qs, n_q)
            if t == P - 1:
                if out is None:  # no row of this rank sees any key (a narrow window)
                    out, lse = _nothing_seen(ring)
                if ring.sinks is not None:
                    out, lse = ops.merge(out, lse, *_sink_part(ring, out, lse),
                                         slice(0, n_q), n_q)
        except Exception as e:  # finish the step's messages, then tell every rank
            error = e
        if exchange is not None:
            exchange.wait()
        coll.agree(error, f"at ring step {t}")
        cur, nxt = nxt, cur
    return out, lse


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
        The gradients of this rank's ``q``, ``k`` and ``v`` shards, their shapes and dtype
        (the query's kind of array: on the device for CUDA inputs).
    grad_sinks : ndarray, only with ``sinks``
        The whole gradient of the sinks (the same on every rank), shape ``(Hq,)``, the sinks'
        dtype, a NumPy array (also for CUDA inputs, as the dense backward):
        ``-sum exp(sink - lse) rowsum(grad_out * out)`` over every rank's rows, the
        ranks' sums added in rank order. The soft cap's gradient is analytic; ALiBi slopes
        get none, as in the dense backward.

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

    def check_like(arrays):
        from ..problem import plan

        q_, k_, v_, grad_out_, out_, lse_ = arrays
        p0 = plan(q_, k_, v_, None, bool(is_causal), scale, bool(enable_gqa))
        for name, x, shape, dt in (("grad_out", grad_out_, p0.out_shape, p0.dtype),
                                   ("out", out_, p0.out_shape, p0.dtype),
                                   ("lse", lse_, p0.out_shape[:-1], p0.compute_dtype)):
            if tuple(x.shape) != tuple(shape) or x.dtype != dt:
                raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dt}, got "
                                 f"{tuple(x.shape)} {x.dtype}")

    try:
        ring, arrays, restore = _prepare(
            coll, [q, k, v, grad_out, out, lse], names, is_causal, scale, enable_gqa, layout,
            attn_mask, dropout_p, variants, extra=check_like)
        q, k, v, grad_out, out, lse = arrays
        grads = _backward(coll, grad_out, q, k, v, out, lse, ring, variants.get("sinks"))
        return (*(restore(g) for g in grads[:3]), *grads[3:])
    finally:
        coll.free()


def _backward(coll, grad_out, q, k, v, out, lse, ring, sinks):
    P, rank = coll.size, coll.rank
    n_q, n_k = tuple(q.shape)[-2], tuple(k.shape)[-2]
    ct = compute_dtype(q.dtype)
    ops = ring.ops
    cur = [ops.copy(k), ops.copy(v)]
    nxt = [ops.empty(tuple(x.shape), x.dtype) for x in cur]
    # dK/dV accumulators in the compute dtype: the one for the shard held now, the one coming.
    acc = [ops.zeros(tuple(k.shape), ct), ops.zeros(tuple(v.shape), ct)]
    acc_next = [ops.empty(tuple(x.shape), ct) for x in acc]
    dq = ops.zeros(tuple(q.shape), ct)
    grads_exchange = None  # the dK/dV accumulators in flight, for the next step
    for t in range(P):
        src = (rank - t) % P
        exchange = _Exchange(coll, cur, nxt, (_TAG_K, _TAG_V), ring) if t < P - 1 else None
        error = None
        parts = []
        try:
            for qs, ks, offset, left, right in ring.work(n_q, n_k, P, rank, src):
                dq_p, dk_p, dv_p = _attend_backward(
                    _rows(grad_out, qs), _rows(q, qs), _rows(cur[0], ks), _rows(cur[1], ks),
                    _rows(out, qs), _rows(lse, qs, -1), ring, offset, left, right)
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
                    ops.add(_rows(dq, qs), dq_p)
                    ops.add(_rows(acc[0], ks), dk_p)
                    ops.add(_rows(acc[1], ks), dv_p)
            except Exception as e:
                error = e
        # Send them on; after the last step's hop each shard's gradients reach their owner.
        grads_exchange = _Exchange(coll, acc, acc_next, (_TAG_DK, _TAG_DV), ring)
        if exchange is not None:
            exchange.wait()
        if t == P - 1:
            grads_exchange.wait()
        # On failure, finish the dK/dV messages every rank has posted, then raise everywhere.
        coll.agree(error, f"at ring step {t}", cleanup=grads_exchange.wait)
        cur, nxt = nxt, cur
    if P > 1:
        acc = acc_next  # our own shard's gradients, home after P hops
    grads = (ops.cast(dq, q.dtype), ops.cast(acc[0], k.dtype), ops.cast(acc[1], v.dtype))
    if ring.sinks is None:
        return grads
    # d sinks: each rank's rows (global out and lse, sinks included), summed over the ranks
    # in rank order (deterministic), in float64.
    error = part = None
    try:
        part = sinks_grad(ring.sinks, ops.to_host(grad_out), ops.to_host(out), ops.to_host(lse))
    except Exception as e:
        error = e
    coll.agree(error, "computing the sinks' gradient")
    dsinks = np.zeros_like(part)
    for x in coll.comm.allgather(part):
        dsinks += x
    return (*grads, dsinks.astype(np.asarray(sinks).dtype))
