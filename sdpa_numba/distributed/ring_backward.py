"""The ring backward: :func:`ring_attention_backward`, dQ kept on its rank while dK/dV
travel around the ring with the keys they belong to, back to their owners."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..problem import compute_dtype
from ..problem.variant_table import sinks_grad
from .agreement import Collective
from .call import prepare
from .steps import block_plan, take_rows
from .transport import TAG_DK, TAG_DV, TAG_K, TAG_V, Exchange


def _attend_backward(grad_out, q, k, v, out, lse, ring, offset, left, right):
    """``(dq, dk, dv)`` of one dense call, from the GLOBAL ``out`` and ``lse`` rows."""
    p = block_plan(q, k, v, ring, offset, left, right)
    return ring.target.backward(p, grad_out, q, k, v, None, out, lse, None, False)[:3]


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
    coll = Collective(comm)
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
        ring, arrays, restore = prepare(
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
    ops = ring.target
    cur = [ops.copy(k), ops.copy(v)]
    nxt = [ops.empty(tuple(x.shape), x.dtype) for x in cur]
    # dK/dV accumulators in the compute dtype: the one for the shard held now, the one coming.
    acc = [ops.zeros(tuple(k.shape), ct), ops.zeros(tuple(v.shape), ct)]
    acc_next = [ops.empty(tuple(x.shape), ct) for x in acc]
    dq = ops.zeros(tuple(q.shape), ct)
    grads_exchange = None  # the dK/dV accumulators in flight, for the next step
    for t in range(P):
        src = (rank - t) % P
        exchange = Exchange(coll, cur, nxt, (TAG_K, TAG_V), ring) if t < P - 1 else None
        errors = []
        parts = []
        try:
            for qs, ks, offset, left, right in ring.work(n_q, n_k, P, rank, src):
                dq_p, dk_p, dv_p = _attend_backward(
                    take_rows(grad_out, qs), take_rows(q, qs), take_rows(cur[0], ks),
                    take_rows(cur[1], ks), take_rows(out, qs), take_rows(lse, qs, -1), ring,
                    offset, left, right)
                parts.append((qs, ks, dq_p, dk_p, dv_p))
        except Exception as e:
            errors.append(e)
        # The accumulators of this step's shard arrive (sent by rank - 1 during the step).
        if grads_exchange is not None:
            grads_exchange.wait()
            acc, acc_next = acc_next, acc
        if not errors:
            try:
                for qs, ks, dq_p, dk_p, dv_p in parts:
                    ops.add_into(take_rows(dq, qs), dq_p)
                    ops.add_into(take_rows(acc[0], ks), dk_p)
                    ops.add_into(take_rows(acc[1], ks), dv_p)
            except Exception as e:
                errors.append(e)
        # Send them on; after the last step's hop each shard's gradients reach their owner.
        grads_exchange = Exchange(coll, acc, acc_next, (TAG_DK, TAG_DV), ring)
        if exchange is not None:
            exchange.wait()
        if t == P - 1:
            grads_exchange.wait()
        # On failure, finish the dK/dV messages every rank has posted, then raise everywhere.
        coll.agree(errors, f"at ring step {t}", cleanup=grads_exchange.wait)
        cur, nxt = nxt, cur
    if P > 1:
        acc = acc_next  # our own shard's gradients, home after P hops
    grads = (ops.cast(dq, q.dtype), ops.cast(acc[0], k.dtype), ops.cast(acc[1], v.dtype))
    if ring.sinks is None:
        return grads
    # d sinks: each rank's rows (global out and lse, sinks included), summed over the ranks
    # in rank order (deterministic), in float64.
    errors, part = [], None
    try:
        part = sinks_grad(ring.sinks, ops.to_host(grad_out), ops.to_host(out), ops.to_host(lse))
    except Exception as e:
        errors.append(e)
    coll.agree(errors, "computing the sinks' gradient")
    dsinks = np.zeros_like(part)
    for x in coll.allgather(part):
        dsinks += x
    return (*grads, dsinks.astype(np.asarray(sinks).dtype))
