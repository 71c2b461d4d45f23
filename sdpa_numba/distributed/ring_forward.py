"""The ring forward: :func:`ring_attention`, each rank's queries against every key/value
shard as it passes, the partial results merged by their log-sum-exp in ring order."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..problem import compute_dtype
from ..problem.arguments import check_flag
from .agreement import Collective
from .call import prepare
from .steps import block_plan, take_rows
from .transport import TAG_K, TAG_V, Exchange


def _attend(q, k, v, ring, offset, left, right):
    """``(out, lse)`` of one dense call (the CPU or GPU launcher, with the ring's recipe)."""
    return ring.target.forward(block_plan(q, k, v, ring, offset, left, right), q, k, v, None,
                               None, None)


def ring_attention(q: Any, k: Any, v: Any, *, comm: Any = None, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False,
                   layout: str = "contiguous", return_lse: bool = False,
                   attn_mask: Any = None, dropout_p: float = 0.0, **variants: Any) -> Any:
    """Exact attention of this rank's queries against the whole sharded sequence.

    Collective: every rank of ``comm`` calls it with its own shards, of the same shapes.

    Parameters
    ----------
    q : ndarray, torch.Tensor or CUDA array, shape (..., Hq, L_local, E)
        This rank's shard of the queries (rows in the order ``layout`` says, see
        :func:`shard`). float16, bfloat16, float32 or float64, any strides. Host arrays
        (NumPy, torch CPU tensors: read without copies) run on the CPU; CUDA arrays (Numba
        device arrays, CuPy, torch CUDA tensors; all operands on the device) on the GPU, with
        device buffers to MPI if it is CUDA-aware (:func:`mpi_cuda_aware`), else (and always
        on a torch.distributed group) staged through host buffers.
    k : ndarray, shape (..., H, S_local, E)
    v : ndarray, shape (..., H, S_local, Ev)
        This rank's shards of the keys and values. Leading dims broadcast as in
        :func:`~sdpa_numba.scaled_dot_product_attention`.
    comm : mpi4py.MPI.Intracomm or torch.distributed.ProcessGroup, keyword-only, optional
        Default ``MPI.COMM_WORLD``. A process group (e.g. ``torch.distributed.group.WORLD``
        under ``torchrun``) needs a backend that moves CPU tensors (gloo; NotImplementedError
        for an NCCL-only group). A communicator of size 1 computes plain attention.
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
        This rank's shard of the output, the inputs' dtype (the query's kind of array: a
        torch tensor for a torch tensor).
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
    coll = Collective(comm)
    try:
        ring, (q, k, v), restore = prepare(
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
    return (ring.target.zeros(tuple(out.shape), out.dtype),
            ring.target.from_host(np.ascontiguousarray(sink_lse, dtype=lse.dtype)))


def _nothing_seen(ring):
    """The result of rows that saw no key: ``out`` 0, ``lse`` -inf (as the dense API)."""
    return (ring.target.zeros(ring.out_shape, ring.dtype),
            ring.target.from_host(np.full(ring.out_shape[:-1], -np.inf, compute_dtype(ring.dtype))))


def _forward(coll, q, k, v, ring):
    P, rank = coll.size, coll.rank
    n_q, n_k = tuple(q.shape)[-2], tuple(k.shape)[-2]
    ops = ring.target
    # Two key/value buffers: the one being computed (and sent on) and the one being received.
    cur = [ops.copy(k), ops.copy(v)]
    nxt = [ops.empty(tuple(x.shape), x.dtype) for x in cur]
    out = lse = None
    for t in range(P):
        src = (rank - t) % P
        exchange = Exchange(coll, cur, nxt, (TAG_K, TAG_V), ring) if t < P - 1 else None
        errors = []
        try:
            for qs, ks, offset, left, right in ring.work(n_q, n_k, P, rank, src):
                o, l_ = _attend(take_rows(q, qs), take_rows(cur[0], ks),
                                take_rows(cur[1], ks), ring, offset, left, right)
                if out is None and qs == slice(0, n_q):
                    out, lse = o, l_
                    continue
                if out is None:  # no call so far covered every row: start from "no key"
                    out, lse = _nothing_seen(ring)
                ops.merge_into(take_rows(out, qs), take_rows(lse, qs, -1), o, l_)
            if t == P - 1:
                if out is None:  # no row of this rank sees any key (a narrow window)
                    out, lse = _nothing_seen(ring)
                if ring.sinks is not None:
                    ops.merge_into(out, lse, *_sink_part(ring, out, lse))
        except Exception as e:  # finish the step's messages, then tell every rank
            errors.append(e)
        if exchange is not None:
            exchange.wait()
        coll.agree(errors, f"at ring step {t}")
        cur, nxt = nxt, cur
    return out, lse
