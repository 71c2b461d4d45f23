"""Attention on packed ragged batches (varlen) on the CPU: the dense kernels' row code, read
through a per-sequence addressing rule.

A packed batch holds ``B`` sequences back to back: ``q (total_q, Hq, E)``, ``k (total_k, H,
E)``, ``v (total_k, H, Ev)``; sequence ``b`` has query rows ``cu_q[b] .. cu_q[b + 1]`` and keys
``cu_k[b] .. cu_k[b + 1]`` (FlashAttention's ``flash_attn_varlen_func`` layout). The
addressing rule is a slice: sequence ``b``, head ``h`` is the 2-D strided view
``q[cu_q[b]:cu_q[b + 1], h]`` (no copy), on which the dense forward's
:func:`~sdpa_numba.cpu.forward.attend_rows` and the dense backward's
:func:`~sdpa_numba.cpu.backward.key_group` run unchanged, with the recipe of that sequence
(:func:`~sdpa_numba.score.recipe.sequence_recipe`: window aligned per sequence, the user's
functions and ALiBi see ``b`` as the batch index). The dropout stream is the dense one with
batch index ``b``.

Work lists span the whole batch, so that one parallel launch balances long and short
sequences: the forward's tasks are (sequence, query head, chunk of query rows), the
backward's (sequence, key/value head, group of key blocks), taken from the task queue
(:mod:`.tasks`) costliest first. Chunk sizes and key groups depend on the lengths and shapes
only, never on the thread count, and every row or key is reduced by one task in a fixed order:
results are bitwise the same for any thread count.
"""

import numpy as np
from numba import njit, prange

from ._llvm import keep_alive, stash, unstash
from .backward import BK, BQ, MAX_GROUPS, MIN_GROUP_BLOCKS, TASKS, _sum_dq, as_dropout, \
    key_group
from .dropout import head_dropout
from .forward import BM, MIN_TASKS, _task_rows, attend_rows
from .options import KERNEL
from .tasks import (failed_task, next_task, raise_lost, record_failure, task_runner,
                    task_queue)
from ..score.recipe import kernel_recipe, key_range, sequence_recipe


@njit(**KERNEL)
def varlen_chunk_rows(cu_q, n_heads, e_len, ev, itemsize):
    """Query rows per forward task: the dense forward's chunk (scratch in L2), halved (down
    to BM) until the batch has MIN_TASKS tasks. Lengths and shapes only."""
    rows = _task_rows(e_len, ev, itemsize)
    while rows > BM:
        n = 0
        for b in range(cu_q.shape[0] - 1):
            n += (cu_q[b + 1] - cu_q[b] + rows - 1) // rows
        if n * n_heads >= MIN_TASKS:
            break
        rows //= 2
    return rows


@njit(**KERNEL)
def _costliest_first(parts, cost, n_heads):
    """A work list ``(seq, head, part)`` from the costs of the parts of every sequence
    (sequence ``b`` has ``parts[b]`` of them; ``cost`` lists them sequence by sequence, in
    part order): each part for every head, costliest first; ties in that order, then head
    order (a stable sort)."""
    n = cost.shape[0] * n_heads
    seq = np.empty(n, np.int64)
    head = np.empty(n, np.int64)
    part = np.empty(n, np.int64)
    neg_cost = np.empty(n, np.float64)
    t = 0
    u = 0
    for b in range(parts.shape[0]):
        for p in range(parts[b]):
            for h in range(n_heads):
                seq[t], head[t], part[t], neg_cost[t] = b, h, p, -cost[u]
                t += 1
            u += 1
    order = np.argsort(neg_cost, kind="mergesort")
    return seq[order], head[order], part[order]


@njit(**KERNEL)
def forward_tasks(cu_q, cu_k, r, bottom_right, n_heads, chunk):
    """The forward's work list: ``(seq, head, i0)`` per task, costliest first (the rows of
    a chunk times the keys they see; ties in a fixed order)."""
    n_seq = cu_q.shape[0] - 1
    parts = np.empty(n_seq, np.int64)
    for b in range(n_seq):
        parts[b] = (cu_q[b + 1] - cu_q[b] + chunk - 1) // chunk
    cost = np.empty(parts.sum(), np.float64)
    u = 0
    for b in range(n_seq):
        lq = cu_q[b + 1] - cu_q[b]
        lk = cu_k[b + 1] - cu_k[b]
        rs = sequence_recipe(r, b, lq, lk, bottom_right)
        for i0 in range(0, lq, chunk):
            i1 = min(lq, i0 + chunk)
            jb, je = key_range(rs, i0, i1 - 1, lk)
            # per row: its keys, plus the fixed work of packing and writing it
            cost[u] = (i1 - i0) * (je - jb + 64.0)
            u += 1
    seq, head, part = _costliest_first(parts, cost, n_heads)
    return seq, head, part * chunk


@njit(**KERNEL)
def _forward_task(q, k, v, cu_q, cu_k, r, bottom_right, scale, out, lse, dropout, b, h, i0,
                  chunk):
    """Rows ``[i0, i0 + chunk)`` of sequence ``b``, query head ``h``: the dense
    :func:`~sdpa_numba.cpu.forward.attend_rows` on the sequence's views."""
    q0, q1 = cu_q[b], cu_q[b + 1]
    k0, k1 = cu_k[b], cu_k[b + 1]
    rs = sequence_recipe(r, b, q1 - q0, k1 - k0, bottom_right)
    kh = h // (q.shape[1] // k.shape[1])
    zero = b - b  # batch index 0 of the views: rs carries b (an int64, as the dense call's)
    attend_rows(q[q0:q1, h], k[k0:k1, kh], v[k0:k1, kh], None, rs, scale, out[q0:q1, h],
                lse[h, q0:q1], i0, min(q1 - q0, i0 + chunk), head_dropout(dropout, b, h),
                zero, h)


#: _forward_task that reports a user function's exception (see .tasks).
_run_forward_task = task_runner(_forward_task)


@njit(parallel=True, **KERNEL)
def varlen_forward(q, k, v, cu_q, cu_k, is_causal, scale, out, lse, dropout=None,
                   recipe=None, bottom_right=False):
    """Attention forward of a packed ragged batch, parallel over (sequence, query head, query
    chunk) tasks of the whole batch.

    Parameters
    ----------
    q : ndarray, shape (total_q, Hq, E)
    k : ndarray, shape (total_k, H, E)
        ``Hq`` a multiple of ``H`` (query head ``h`` reads key/value head ``h // (Hq // H)``).
    v : ndarray, shape (total_k, H, Ev)
    cu_q, cu_k : ndarray of int64, shape (B + 1,)
        Sequence ``b`` has query rows ``cu_q[b] .. cu_q[b + 1]`` and keys ``cu_k[b] ..
        cu_k[b + 1]``: both start at 0, never decrease and end at ``total_q``, ``total_k``.
    is_causal : bool
        Query ``i`` of a sequence sees its keys ``j <= i'`` (see ``bottom_right``).
    scale : float
    out : ndarray, shape (total_q, Hq, Ev)
        Written.
    lse : ndarray, shape (Hq, total_q)
        Written (FlashAttention's varlen layout); its dtype is the compute dtype.
    dropout : None or tuple, optional
        As for :func:`~sdpa_numba.cpu.forward`: sequence ``b`` draws the dense stream of batch
        index ``batch_offset + b``.
    recipe : None or Recipe, optional
        The variants, as for :func:`~sdpa_numba.cpu.forward`, applied per sequence (rows and
        keys counted from the sequence's first, ``b`` the sequence index); no block mask.
    bottom_right : bool, optional
        Align the causal mask, window and ALiBi per sequence to the bottom right (``i' = i +
        S_b - L_b``) instead of the recipe's offset.

    Notes
    -----
    Storage dtypes as for the dense forward; any strides. Arguments are trusted: the Python
    API (:func:`sdpa_numba.varlen_attention`) validates them. Bitwise the same for any
    thread count.
    """
    r = kernel_recipe(recipe, is_causal)
    p_r = stash(r)
    chunk = varlen_chunk_rows(cu_q, q.shape[1], q.shape[2], out.shape[2], lse.itemsize)
    seq, head, row = forward_tasks(cu_q, cu_k, r, bottom_right, q.shape[1], chunk)
    n_tasks = seq.shape[0]
    queue = task_queue()
    for _ in prange(n_tasks):
        rt = unstash(p_r)
        t = next_task(queue, n_tasks)
        while t >= 0:
            if not _run_forward_task(rt, q, k, v, cu_q, cu_k, rt, bottom_right, scale, out,
                            lse, dropout, seq[t], head[t], row[t], chunk):
                record_failure(queue, t)
            t = next_task(queue, n_tasks)
    t = failed_task(queue)
    if t >= 0:  # a user function raised in the loop: again here, where it reaches the caller
        _forward_task(q, k, v, cu_q, cu_k, r, bottom_right, scale, out, lse, dropout, seq[t],
                      head[t], row[t], chunk)
        raise_lost()
    keep_alive(r)


@njit(**KERNEL)
def varlen_key_groups(cu_k, n_kv_heads):
    """Key groups per sequence for the backward: as the dense backward's
    (:func:`~sdpa_numba.cpu.backward.key_groups`), from the sequence's share of all key
    blocks, so that a long sequence among short ones is split too. Lengths only."""
    n_seq = cu_k.shape[0] - 1
    groups = np.ones(n_seq, np.int64)
    total = 0
    for b in range(n_seq):
        total += (cu_k[b + 1] - cu_k[b] + BK - 1) // BK
    if total == 0:
        return groups
    for b in range(n_seq):
        n_kb = (cu_k[b + 1] - cu_k[b] + BK - 1) // BK
        g = (TASKS * n_kb + n_kv_heads * total - 1) // (n_kv_heads * total)
        groups[b] = max(1, min(g, n_kb // MIN_GROUP_BLOCKS, MAX_GROUPS))
    return groups


@njit(**KERNEL)
def backward_tasks(cu_q, cu_k, n_kv_heads, group, groups):
    """The backward's work list: ``(seq, kv head, key group)`` per task, costliest first
    (the keys of the group times the query rows of the sequence)."""
    cost = np.empty(groups.sum(), np.float64)
    u = 0
    for b in range(groups.shape[0]):
        lq = cu_q[b + 1] - cu_q[b]
        lk = cu_k[b + 1] - cu_k[b]
        n_kb = (lk + BK - 1) // BK
        for g in range(groups[b]):
            kb0 = g * n_kb // groups[b]
            kb1 = (g + 1) * n_kb // groups[b]
            cost[u] = (min(kb1 * BK, lk) - kb0 * BK + 64.0) * (lq + 64.0) * group
            u += 1
    return _costliest_first(groups, cost, n_kv_heads)


@njit(**KERNEL)
def _dq_parts(dq_part, cu_q, groups, n_heads, e_len, b):
    """Sequence ``b``'s partial dQs, a (groups, 1, Hq, L_b, E) view of ``dq_part`` (each
    sequence with more than one key group has its own block, in sequence order), or an empty
    one (the key group writes dQ directly)."""
    off = 0
    for s in range(b):
        if groups[s] > 1:
            off += groups[s] * n_heads * (cu_q[s + 1] - cu_q[s]) * e_len
    lq = cu_q[b + 1] - cu_q[b]
    g = groups[b] if groups[b] > 1 else 0
    return dq_part[off:off + g * n_heads * lq * e_len].reshape((g, 1, n_heads, lq, e_len))


@njit(**KERNEL)
def _heads_view(x, i0, i1):
    """Rows ``[i0, i1)`` of a packed ``(total, H, D)`` array as the dense kernels' ``(1, H,
    i1 - i0, D)`` (a view)."""
    return x[i0:i1].transpose((1, 0, 2))[None]


@njit(**KERNEL)
def _backward_task(q, k, v, cu_q, cu_k, r, bottom_right, scale, dout, out, lse, dq, dk, dv,
                   drop, dq_part, groups, b, kh, g):
    """Key group ``g`` of sequence ``b``, key/value head ``kh``: the dense
    :func:`~sdpa_numba.cpu.backward.key_group` on the sequence's views."""
    q0, q1 = cu_q[b], cu_q[b + 1]
    k0, k1 = cu_k[b], cu_k[b + 1]
    rs = sequence_recipe(r, b, q1 - q0, k1 - k0, bottom_right)
    n_kb = (k1 - k0 + BK - 1) // BK
    n_g = groups[b]
    seed, thresh, inv_keep, b_off = drop
    zero = b - b
    key_group(_heads_view(q, q0, q1), _heads_view(k, k0, k1), _heads_view(v, k0, k1), None,
              rs, scale, _heads_view(dout, q0, q1), _heads_view(out, q0, q1),
              lse[:, q0:q1][None], zero, kh, q.shape[1] // k.shape[1], g * n_kb // n_g,
              (g + 1) * n_kb // n_g, _heads_view(dq, q0, q1),
              _dq_parts(dq_part, cu_q, groups, q.shape[1], q.shape[2], b), g,
              _heads_view(dk, k0, k1), _heads_view(dv, k0, k1),
              (seed, thresh, inv_keep, b_off + b), None)


@njit(**KERNEL)
def _sum_task(cu_q, scale, dq, dq_part, groups, n_heads, b, h, qb):
    """dQ rows of query block ``qb`` of sequence ``b``, head ``h``: its groups' partials
    summed in group order (the dense :func:`~sdpa_numba.cpu.backward._sum_dq`)."""
    q0, q1 = cu_q[b], cu_q[b + 1]
    _sum_dq(_dq_parts(dq_part, cu_q, groups, n_heads, dq.shape[2], b), scale,
            _heads_view(dq, q0, q1), b - b, h, qb)


#: _backward_task that reports a user function's exception (see .tasks).
_run_backward_task = task_runner(_backward_task)


@njit(parallel=True, **KERNEL)
def varlen_backward(q, k, v, cu_q, cu_k, is_causal, scale, dout, out, lse, dq, dk, dv,
                    dropout=None, recipe=None, bottom_right=False):
    """Gradients of :func:`varlen_forward`, parallel over (sequence, key/value head, group of
    key blocks) tasks of the whole batch; deterministic.

    Parameters
    ----------
    q, k, v, cu_q, cu_k, is_causal, scale, recipe, bottom_right
        As given to :func:`varlen_forward`.
    dout, out : ndarray, shape (total_q, Hq, Ev)
        The loss's gradient with respect to the output, and the forward's output.
    lse : ndarray, shape (Hq, total_q)
        The forward's log-sum-exp (compute dtype).
    dq, dk, dv : ndarray, shapes of q, k, v, compute dtype
        Written; ``dk``, ``dv`` summed over the query heads of each key/value head.
    dropout : None or tuple, optional
        The forward's (None or ``inv_keep == 1``: no dropout).

    Notes
    -----
    A sequence whose keys are split into several groups (a long one, or few sequences and
    heads) gets one partial dQ per group, summed in group order by a second parallel loop.
    Bitwise the same for any thread count. Arguments are trusted.
    """
    r = kernel_recipe(recipe, is_causal)
    p_r = stash(r)
    drop = as_dropout(dropout)
    n_heads, e_len = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    group = n_heads // n_kv if n_kv else 1
    groups = varlen_key_groups(cu_k, n_kv)
    n_part = 0
    for b in range(cu_q.shape[0] - 1):
        if groups[b] > 1:
            n_part += groups[b] * n_heads * (cu_q[b + 1] - cu_q[b]) * e_len
    dq_part = np.zeros(n_part, lse.dtype)
    seq, head, grp = backward_tasks(cu_q, cu_k, n_kv, group, groups)
    n_tasks = seq.shape[0]
    queue = task_queue()
    for _ in prange(n_tasks):
        r_t = unstash(p_r)
        t = next_task(queue, n_tasks)
        while t >= 0:
            if not _run_backward_task(r_t, q, k, v, cu_q, cu_k, r_t, bottom_right, scale,
                            dout, out, lse, dq, dk, dv, drop, dq_part, groups, seq[t], head[t],
                            grp[t]):
                record_failure(queue, t)
            t = next_task(queue, n_tasks)
    t = failed_task(queue)
    if t >= 0:  # a user function raised in the loop: again here, where it reaches the caller
        _backward_task(q, k, v, cu_q, cu_k, r, bottom_right, scale, dout, out, lse, dq, dk, dv,
                       drop, dq_part, groups, seq[t], head[t], grp[t])
        raise_lost()
    if n_part:
        # (sequence, head, query block) of the split sequences
        n_sum = 0
        for b in range(cu_q.shape[0] - 1):
            if groups[b] > 1:
                n_sum += n_heads * ((cu_q[b + 1] - cu_q[b] + BQ - 1) // BQ)
        s_seq = np.empty(n_sum, np.int64)
        s_blk = np.empty(n_sum, np.int64)
        t = 0
        for b in range(cu_q.shape[0] - 1):
            if groups[b] > 1:
                for u in range(n_heads * ((cu_q[b + 1] - cu_q[b] + BQ - 1) // BQ)):
                    s_seq[t], s_blk[t] = b, u
                    t += 1
        for t in prange(n_sum):
            b = s_seq[t]
            nqb = (cu_q[b + 1] - cu_q[b] + BQ - 1) // BQ
            _sum_task(cu_q, scale, dq, dq_part, groups, n_heads, b, s_blk[t] // nqb,
                      s_blk[t] % nqb)
    keep_alive(r)
