"""Decode against a key/value cache on the CPU: the kernel of
:func:`sdpa_numba.attention_with_kvcache`.

Decoding is memory-bound: a few query rows read the whole cache. So each key/value row is read
once per call, for every query head of its GQA group and every query token at once:

* **Work.** Each sequence's keys are cut into chunks of :data:`CHUNK` keys (the split-KV of
  flash-decoding); a task is one chunk of one sequence, for all its key/value heads. A task
  streams its chunk in blocks of :data:`BN` keys; per block and key/value head it forms the
  scores of the ``Hq / H * Lq`` query rows of that head, runs the online softmax
  (:func:`.online_softmax.softmax_row`, with the vectorizable exp2) and adds ``P V`` into the
  rows' accumulators. A chunk's rows are then normalized into a partial ``(out, lse)``, and the
  chunks of a sequence are merged by lse (:mod:`sdpa_numba.score.merge`) in chunk order. The
  chunks depend on the cache lengths only, and each partial is made by one thread, so the result
  is bitwise the same for any thread count. Taking all heads of a key range in one task reads
  the FlashAttention layout ``(.., S, H, E)`` in address order: one key row of all heads is one
  contiguous run of memory.
* **Addressing.** Key row ``j`` of sequence ``b`` lives at ``(page, slot) = (block_table[b, j //
  page_size], j % page_size)`` of a cache ``(num_pages, page_size, H, E)``. A contiguous cache
  ``(B, S_max, H, E)`` is the paged cache with ``page_size = S_max`` and ``block_table[b] = [b]``:
  one kernel body serves both (:func:`block_offsets`).
* **Causal** is bottom-right aligned: query token ``t`` of ``Lq`` sees keys
  ``j <= kv_len - Lq + t``.

Serial entry points (``*_serial``) run on the calling thread: small calls, where waking the
thread pool would cost more than the work, and callers that parallelize themselves. Kernels
trust their arguments; the caches' last dim must be contiguous (unit stride).
"""

import numpy as np
from numba import njit, prange

from ..score.merge import merge_finish, merge_max, merge_weight
from ._llvm import data_ptr, keep_alive, no_inline, prefer_512_bit, ptr_add
from .online_softmax import softmax_row
from .options import CALLED, INLINE, KERNEL
from .scratch import aligned_empty
from ..score.numbers import cast
from .storage import load, store
from .tasks import next_task, task_queue

#: Keys per chunk (a task, and a partial result merged by lse). Large enough that a chunk's
#: partial output (``Hq * Lq * Ev`` numbers) is small next to the keys and values it reads
#: (``CHUNK * H * (E + Ev)``), small enough that one long sequence splits among the cores.
CHUNK = 512
#: Keys per block: a block's scores of all rows of one key/value head are kept in a scratch row
#: (``BN`` per row) between the score, softmax and ``P V`` loops.
BN = 32


@njit(**INLINE)
def n_chunks(kv_len):
    """The chunks of a sequence of ``kv_len`` keys (at least one, so that a sequence with no
    keys still gets its rows written: 0 and lse -inf)."""
    return max(1, (kv_len + CHUNK - 1) // CHUNK)


@njit(**INLINE)
def block_offsets(block_table, b, j0, n, page_size, kps, kss, vps, vss, koff, voff):
    """The addressing rule: ``koff[j]``, ``voff[j]``, the offsets in elements (head 0, element
    0) of keys ``j0 .. j0 + n - 1`` of sequence ``b`` in the key and value caches, i.e. of
    ``(page, slot) = (block_table[b, j // page_size], j % page_size)``, once per key for all
    heads. The page and slot are stepped, not divided out for each key: two integer divisions
    per key cost more than a key's arithmetic at small H (CPU time of one thread, D128 float32:
    B1 H1 from 9.8 to 11.1 GB/s; B1 H32 with pages of 16 from 13.2 to 15.6 GB/s, the
    contiguous cache's 14.4-15.2 in the same runs)."""
    page = j0 // page_size
    slot = j0 - page * page_size
    for j in range(n):
        p = block_table[b, page]
        koff[j] = p * kps + slot * kss
        voff[j] = p * vps + slot * vss
        slot += 1
        if slot == page_size:
            slot = 0
            page += 1


@njit(**CALLED)
def _chunk(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, b, j0, j1,
           part_out, part_lse):
    """Attention of all query rows of sequence ``b`` over its keys ``[j0, j1)``: normalized
    partial output ``part_out (Hq * Lq, Ev)`` (row ``hq * Lq + t``) and ``part_lse``."""
    # One compiled body for the serial and the parallel kernel: inlined into each, LLVM may
    # vectorize (and contract to FMAs) differently, and the two would differ in the last bit.
    no_inline()
    # 512-bit vectors: ~2x LLVM's default 256-bit code here (CPU time of one thread, Emerald
    # Rapids: B1 H32 S256 D128 in cache 5.3 -> 11.3 GFLOP/s; S8192 from memory 16.4 GB/s,
    # NumPy's read 16-17 GB/s in the same run)
    prefer_512_bit()
    lq, hq, e_len = q.shape[1], q.shape[2], q.shape[3]
    h_len = k_cache.shape[2]
    ev = v_cache.shape[3]
    g = hq // h_len
    rows = g * lq  # query rows per key/value head
    page_size = k_cache.shape[1]
    ksz, vsz = k_cache.itemsize, v_cache.itemsize
    kps, kss, khs = k_cache.strides[0] // ksz, k_cache.strides[1] // ksz, k_cache.strides[2] // ksz
    vps, vss, vhs = v_cache.strides[0] // vsz, v_cache.strides[1] // vsz, v_cache.strides[2] // vsz
    kv_len = kv_lens[b]
    zero = cast(0.0, part_lse)
    # Queries of all rows, scaled, in the compute dtype, E contiguous.
    qs = aligned_empty(hq * lq * e_len, part_lse.dtype)
    for h in range(hq):
        for t in range(lq):
            r = h * lq + t
            for e in range(e_len):
                qs[r * e_len + e] = cast(load(q[b, t, h, e]) * scale, zero)
    acc = aligned_empty(hq * lq * max(ev, 1), part_lse.dtype)
    acc[:] = 0
    m = np.full(hq * lq, -np.inf, part_lse.dtype)
    l = np.zeros(hq * lq, part_lse.dtype)
    s = aligned_empty(rows * BN, part_lse.dtype)
    koff = np.empty(BN, np.int64)
    voff = np.empty(BN, np.int64)
    kbase = data_ptr(k_cache)
    vbase = data_ptr(v_cache)
    qp = data_ptr(qs)
    sp = data_ptr(s)
    ap = data_ptr(acc)
    for b0 in range(j0, j1, BN):
        n = min(BN, j1 - b0)
        block_offsets(block_table, b, b0, n, page_size, kps, kss, vps, vss, koff, voff)
        for h in range(h_len):
            # Scores s[r, j] of the rows of head h (r = hg * lq + t) against the block's keys.
            for j in range(n):
                kp = ptr_add(kbase, koff[j] + h * khs)
                r = 0
                # Four rows at once (GQA, Lq > 1): each key element is loaded once for them
                # (CPU time of one thread, B1 Hq32 H8 S256 D128 in cache: 22 -> 25 GFLOP/s).
                while r + 4 <= rows:
                    q0 = ptr_add(qp, (h * rows + r) * e_len)
                    q1 = ptr_add(q0, e_len)
                    q2 = ptr_add(q1, e_len)
                    q3 = ptr_add(q2, e_len)
                    x0 = zero
                    x1 = zero
                    x2 = zero
                    x3 = zero
                    for e in range(e_len):
                        kv = load(kp[e])
                        x0 += q0[e] * kv
                        x1 += q1[e] * kv
                        x2 += q2[e] * kv
                        x3 += q3[e] * kv
                    s[r * BN + j] = x0
                    s[(r + 1) * BN + j] = x1
                    s[(r + 2) * BN + j] = x2
                    s[(r + 3) * BN + j] = x3
                    r += 4
                for r in range(r, rows):
                    qr = ptr_add(qp, (h * rows + r) * e_len)
                    x = zero
                    for e in range(e_len):
                        x += qr[e] * load(kp[e])
                    s[r * BN + j] = x
            if is_causal:  # bottom-right: token t sees keys j <= kv_len - lq + t
                for r in range(rows):
                    last = kv_len - lq + r % lq
                    for j in range(n):
                        if b0 + j > last:
                            s[r * BN + j] = -np.inf
            for r in range(rows):
                i = h * rows + r
                m_new, alpha, total = softmax_row(ptr_add(sp, r * BN), n, m[i])
                m[i] = m_new
                l[i] = alpha * l[i] + total
                if alpha != 1:  # rescaled here; rare once the row's maximum has settled
                    ar = ptr_add(ap, i * ev)
                    for d in range(ev):
                        ar[d] *= alpha
            for j in range(n):  # each value row once, for all the head's rows
                vp = ptr_add(vbase, voff[j] + h * vhs)
                for r in range(rows):
                    p = s[r * BN + j]
                    ar = ptr_add(ap, (h * rows + r) * ev)
                    for d in range(ev):
                        ar[d] += p * load(vp[d])
    keep_alive((k_cache, v_cache, qs, s, acc))
    for i in range(hq * lq):
        if l[i] == 0:
            part_lse[i] = -np.inf
            for d in range(ev):
                part_out[i, d] = 0
        else:
            inv = 1 / l[i]
            part_lse[i] = m[i] + np.log(l[i])
            for d in range(ev):
                part_out[i, d] = acc[i * ev + d] * inv


@njit(**INLINE)
def _task(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, first, t, part_out,
          part_lse):
    """Task ``t``: chunk ``t - first[b]`` of the sequence ``b`` it belongs to."""
    b = np.searchsorted(first, t, side="right") - 1
    c = t - first[b]
    j0 = c * CHUNK
    j1 = min(kv_lens[b], j0 + CHUNK)
    _chunk(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, b, j0, max(j0, j1),
           part_out[t], part_lse[t])


@njit(**CALLED)
def _merge(first, part_out, part_lse, out, lse, b, i):
    """Row ``i = hq * Lq + t`` of sequence ``b``: its chunks merged by lse, in chunk order."""
    no_inline()  # as _chunk
    lq = out.shape[1]
    ev = out.shape[3]
    h, t = i // lq, i % lq
    c0, c1 = first[b], first[b + 1]
    if c1 - c0 == 1:  # one chunk: already the result
        for d in range(ev):
            out[b, t, h, d] = store(part_out[c0, i, d], out)
        lse[b, h, t] = part_lse[c0, i]
        return
    mx = -np.inf
    for c in range(c0, c1):
        mx = merge_max(mx, part_lse[c, i])
    total = 0.0
    for c in range(c0, c1):
        total += merge_weight(part_lse[c, i], mx)
    x, inv = merge_finish(mx, total)
    w = np.empty(c1 - c0, lse.dtype)
    for c in range(c0, c1):
        w[c - c0] = cast(merge_weight(part_lse[c, i], mx) * inv, lse)
    for d in range(ev):
        a = cast(0.0, lse)
        for c in range(c0, c1):
            if w[c - c0] != 0:  # a chunk of weight 0 is skipped, as merge_attention_states does
                a += w[c - c0] * part_out[c, i, d]
        out[b, t, h, d] = store(a, out)
    lse[b, h, t] = x


@njit(**INLINE)
def _plan(kv_lens):
    """``first[b]``: the first task of sequence ``b`` (``first[B]``: the number of tasks)."""
    b_len = kv_lens.shape[0]
    first = np.empty(b_len + 1, np.int64)
    first[0] = 0
    for b in range(b_len):
        first[b + 1] = first[b] + n_chunks(kv_lens[b])
    return first


@njit(parallel=True, **KERNEL)
def decode(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, out, lse):
    """Attention of ``Lq`` new query tokens against a paged key/value cache, parallel over
    (sequence, chunk of keys) tasks.

    Parameters
    ----------
    q : ndarray, shape (B, Lq, Hq, E)
    k_cache : ndarray, shape (num_pages, page_size, H, E)
        Last dim contiguous. ``Hq`` a multiple of ``H`` (query head ``hq`` reads key/value
        head ``hq // (Hq // H)``).
    v_cache : ndarray, shape (num_pages, page_size, H, Ev)
    block_table : ndarray of int32, shape (B, max_pages)
        Pages of each sequence, in key order: key ``j`` of sequence ``b`` is slot
        ``j % page_size`` of page ``block_table[b, j // page_size]``. (A contiguous cache
        ``(B, S_max, H, E)`` is ``page_size = S_max`` with ``block_table[b, 0] = b``.)
    kv_lens : ndarray of int64, shape (B,)
        Keys of each sequence (``<= max_pages * page_size``).
    is_causal : bool
        Bottom-right aligned: token ``t`` sees keys ``j <= kv_lens[b] - Lq + t``.
    scale : float
    out : ndarray, shape (B, Lq, Hq, Ev)
        Written.
    lse : ndarray, shape (B, Hq, Lq)
        Written, in the compute dtype (float32, or float64 for float64 storage).

    Notes
    -----
    Storage: float32, float64, float16 as uint16 views, bfloat16 as int16 views; ``q``,
    ``out`` any strides. Arguments are trusted (see :func:`sdpa_numba.attention_with_kvcache`,
    which checks them). The result does not depend on the thread count, and equals
    :func:`decode_serial`'s bitwise.
    """
    first = _plan(kv_lens)
    n_tasks = first[-1]
    rows = q.shape[2] * q.shape[1]
    part_out = np.empty((n_tasks, rows, out.shape[3]), lse.dtype)
    part_lse = np.empty((n_tasks, rows), lse.dtype)
    queue = task_queue()
    for _ in prange(n_tasks):
        t = next_task(queue, n_tasks)
        while t >= 0:
            _task(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, first, t,
                  part_out, part_lse)
            t = next_task(queue, n_tasks)
    b_len = kv_lens.shape[0]
    for br in prange(b_len * rows):
        _merge(first, part_out, part_lse, out, lse, br // rows, br % rows)


@njit(**KERNEL)
def decode_serial(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, out, lse):
    """:func:`decode` on the calling thread (the same arguments; bitwise the same result)."""
    first = _plan(kv_lens)
    n_tasks = first[-1]
    rows = q.shape[2] * q.shape[1]
    part_out = np.empty((n_tasks, rows, out.shape[3]), lse.dtype)
    part_lse = np.empty((n_tasks, rows), lse.dtype)
    for t in range(n_tasks):
        _task(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, first, t,
              part_out, part_lse)
    for b in range(kv_lens.shape[0]):
        for i in range(rows):
            _merge(first, part_out, part_lse, out, lse, b, i)
