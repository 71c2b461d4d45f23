"""Decode against a key/value cache on the GPU: the CUDA twin of :mod:`sdpa_numba.cpu.decode`.

The same work and addressing as on the CPU: each sequence's keys are cut into chunks (split-KV),
key row ``j`` of sequence ``b`` is slot ``j % page_size`` of page ``block_table[b, j //
page_size]`` (a contiguous cache is the paged one with ``page_size = S_max`` and
``block_table[b] = [b]``), and causal is bottom-right aligned. A thread block computes one chunk
of one sequence for one key/value head and a tile of up to :data:`ROWS` of that head's query
rows (its GQA group's heads times the ``Lq`` tokens), so each key/value row is read once per
row tile (once per call for ``Hq / H * Lq <= ROWS``):

1. the block's queries, scaled, go to shared memory; per block of :data:`BN` keys, the threads
   look the keys' pages up once, then form the ``rows x BN`` scores (one dot product each);
2. one thread per row runs the online softmax on its row of scores;
3. the threads, one output column each, add ``P V`` into the rows' accumulators, reading each
   value row once, coalesced.

A chunk's rows end normalized as a partial ``(out, lse)``; a second kernel merges each row's
chunks by lse in chunk order (:func:`sdpa_numba.gpu.merge_rows`), so the result does not depend
on how the blocks are scheduled. Scores go through the score seam (:mod:`sdpa_numba.score.recipe`,
carried by :mod:`.variants`) as on the CPU: token ``t`` sits at position ``kv_len - Lq + t``;
soft cap, ALiBi and score_mod change scores, window and mask_mod mask them, and each head's sink
joins the merge. Kernels trust their arguments.
"""

import math

import numba
import numpy as np
from numba import cuda

from ..score.merge import merge_weights
from ..score.recipe import DENSE, keeps, modified_score, window_covers
from .arrays import device_array, is_simulated_mode
from .merge import merge_rows
from .options import FASTMATH
from .quant import quant_dot, quant_value
from .raising import refuse_raising
from .scale_fold import split_power
from .storage import load, store, storage_view
from .variants import compile_key, kernel_args, modifies, recipe_of, sink_of

#: Query rows per thread block, at most; keys per key block; threads per block.
ROWS = 8
BN = 32
THREADS = 128
#: Keys per chunk (one partial result), as on the CPU.
CHUNK = 512

_kernels = {}


def _make_kernels(ct, rows, bn, parts, quant=False):
    CT = ct
    RB, NB = rows, bn
    SCORE_MOD, MASK_MOD = parts.score_mod, parts.mask_mod
    ELEMENT_MASK = MASK_MOD is not None
    # A quantized cache (a compile-time constant: the float kernels' branches are pruned,
    # and their code is what it was without one).
    QUANT = quant

    @cuda.jit(fastmath=FASTMATH)
    def chunk_kernel(q, k_cache, v_cache, block_table, kv_lens, kv_lo, kv_hi, task_b, task_c,
                     chunk, scale, part_out, part_lse, ra, qrows, n_tiles, qz):
        task = cuda.blockIdx.x
        b = task_b[task]
        c = task_c[task]
        tid = cuda.threadIdx.x
        NT = cuda.blockDim.x
        hq, e_len = q.shape[2], q.shape[3]
        # Where sequence b's query rows are, how many, the first's position and the frame's
        # offset (sdpa_numba.problem.kvcache.query_rows).
        qb, q0, lq, i0, off = qrows[0, b], qrows[1, b], qrows[2, b], qrows[3, b], qrows[4, b]
        h_len = k_cache.shape[2]
        ev = v_cache.shape[3]
        g = hq // h_len
        rows = g * lq
        h = cuda.blockIdx.y // n_tiles
        r0 = (cuda.blockIdx.y % n_tiles) * RB
        if r0 >= rows:  # a tile past a shorter sequence's rows (the whole block leaves)
            return
        nr = min(RB, rows - r0)
        page_size = k_cache.shape[1]
        j0 = kv_lo[b] + c * chunk
        j1 = min(kv_hi[b], j0 + chunk)
        rc = recipe_of(ra, ra.offset + off, SCORE_MOD, MASK_MOD, None)
        mod_on = modifies(rc)

        sm = cuda.shared.array(0, CT)
        q_at = 0
        a_at = q_at + RB * e_len
        s_at = a_at + RB * ev
        m_at = s_at + RB * NB
        l_at = m_at + RB
        al_at = l_at + RB
        page = cuda.shared.array(NB, numba.int64)
        slot = cuda.shared.array(NB, numba.int64)
        zero = CT(0)
        neg_inf = CT(-math.inf)

        for x in range(tid, nr * e_len, NT):
            r, e = x // e_len, x % e_len
            rr = r0 + r
            sm[q_at + r * e_len + e] = (CT(load(q[qb, q0 + rr % lq, h * g + rr // lq, e]))
                                        * CT(scale))
        # Queries that overflowed times scale: restaged times scale / w, scores times w.
        w = split_power(sm, q_at, nr, e_len, e_len, scale, tid, NT)
        if w != 1.0:
            for x in range(tid, nr * e_len, NT):
                r, e = x // e_len, x % e_len
                rr = r0 + r
                sm[q_at + x] = CT(load(q[qb, q0 + rr % lq, h * g + rr // lq, e])) * CT(scale / w)
        score_w = CT(w)
        for x in range(tid, nr * ev, NT):
            sm[a_at + x] = zero
        for r in range(tid, nr, NT):
            sm[m_at + r] = neg_inf
            sm[l_at + r] = zero
        cuda.syncthreads()

        for kb in range(j0, j1, NB):
            n = min(NB, j1 - kb)
            for j in range(tid, n, NT):  # the addressing, once per key
                page[j] = block_table[b, (kb + j) // page_size]
                slot[j] = (kb + j) % page_size
            cuda.syncthreads()
            # Per-element window tests only where the window cuts the block (token t sits at
            # position i0 + t), or a mask_mod may mask.
            test = ELEMENT_MASK or not window_covers(rc, i0, i0 + lq - 1, kb, kb + n - 1)
            for x in range(tid, nr * NB, NT):
                r, j = x // NB, x % NB
                if j < n:
                    if QUANT:
                        s = quant_dot(sm, q_at + r * e_len, e_len, k_cache, page[j], slot[j],
                                      h, b, qz, zero)
                    else:
                        s = zero
                        for e in range(e_len):
                            s += (sm[q_at + r * e_len + e]
                                  * CT(load(k_cache[page[j], slot[j], h, e])))
                    if score_w != 1:
                        s *= score_w
                    rr = r0 + r
                    hq_r = h * g + rr // lq
                    i = i0 + rr % lq
                    if mod_on:  # (CT: the simulator's CPU-jitted calls return floats)
                        s = CT(modified_score(rc, s, b, hq_r, i, kb + j))
                    if test and not keeps(rc, b, hq_r, i, kb + j):
                        s = neg_inf
                    sm[s_at + r * NB + j] = s
            cuda.syncthreads()
            for r in range(tid, nr, NT):  # the online softmax, one thread per row
                m_old = sm[m_at + r]
                m_new = m_old
                for j in range(n):
                    m_new = max(m_new, sm[s_at + r * NB + j])
                # All masked so far: exponentiate against 0 (p = alpha = 0, not NaN).
                m_use = m_new if m_new != neg_inf else zero
                total = zero
                for j in range(n):
                    p = math.exp(sm[s_at + r * NB + j] - m_use)
                    sm[s_at + r * NB + j] = p
                    total += p
                alpha = math.exp(m_old - m_use)
                sm[al_at + r] = alpha
                sm[l_at + r] = alpha * sm[l_at + r] + total
                sm[m_at + r] = m_new
            cuda.syncthreads()
            for d in range(tid, ev, NT):  # P V, one output column per thread
                for r in range(nr):
                    sm[a_at + r * ev + d] *= sm[al_at + r]
                for j in range(n):
                    if QUANT:
                        vj = quant_value(v_cache, page[j], slot[j], h, d, b, qz, zero)
                    else:
                        vj = CT(load(v_cache[page[j], slot[j], h, d]))
                    for r in range(nr):
                        sm[a_at + r * ev + d] += sm[s_at + r * NB + j] * vj
            cuda.syncthreads()

        for x in range(tid, nr * ev, NT):
            r, d = x // ev, x % ev
            i = h * rows + r0 + r
            l = sm[l_at + r]
            part_out[task, i, d] = sm[a_at + r * ev + d] / l if l != zero else zero
        for r in range(tid, nr, NT):
            i = h * rows + r0 + r
            l = sm[l_at + r]
            part_lse[task, i] = sm[m_at + r] + math.log(l) if l != zero else neg_inf

    @cuda.jit(fastmath=FASTMATH)
    def merge_kernel(first, part_out, part_lse, out, lse, ra, qrows, mrow):
        x = cuda.grid(1)
        ev = out.shape[3]
        n_seq = first.shape[0] - 1
        if x >= mrow[n_seq]:
            return
        # The sequence of merged row x: the last b with mrow[b] <= x (mrow: Hq * Lq_b each).
        b = 0
        top = n_seq
        while top - b > 1:
            mid = (b + top) // 2
            if mrow[mid] <= x:
                b = mid
            else:
                top = mid
        i = x - mrow[b]
        qb, q0, lq = qrows[0, b], qrows[1, b], qrows[2, b]
        c0, c1 = first[b], first[b + 1]
        # Merged in place into the first chunk's row (merge_rows allows that), then stored.
        x_lse = merge_rows(part_out[c0:c1, i], part_lse[c0:c1, i], part_out[c0, i])
        h, t = i // lq, q0 + i % lq
        rc = recipe_of(ra, ra.offset, SCORE_MOD, MASK_MOD, None)
        sink = sink_of(rc, h)
        w = 1.0
        if sink != -math.inf:  # one more part, of output 0: it weighs in the lse only
            w, _, x_lse = merge_weights(x_lse, sink)
        for d in range(ev):
            out[qb, t, h, d] = store(part_out[c0, i, d] * w, out)
        lse[qb, h, t] = x_lse

    return chunk_kernel, merge_kernel


def _kernels_for(ct, parts, quant=False):
    key = (np.dtype(ct), ROWS, BN, parts, quant)
    if key not in _kernels:
        _kernels[key] = _make_kernels(numba.from_dtype(key[0]), ROWS, BN, parts, quant)
    return _kernels[key]


def plan_chunks(n_keys, chunk=CHUNK):
    """``(first, task_b, task_c)`` on the host: the first task of each sequence (and the
    total), and each task's sequence and chunk of its ``n_keys`` keys to read. A sequence with
    no keys still has one task."""
    n = np.maximum(1, -(-np.asarray(n_keys, np.int64) // chunk))
    first = np.zeros(len(n) + 1, np.int64)
    np.cumsum(n, out=first[1:])
    task_b = np.repeat(np.arange(len(n)), n)
    task_c = np.arange(first[-1]) - first[task_b]
    return first, task_b, task_c


def decode(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, out, lse, stream=0,
           chunk=None, threads=None, bounds=None, recipe=None, rows=None, quant=None):
    """Launch attention of ``Lq`` new tokens against a paged key/value cache (device arrays).

    Parameters
    ----------
    q : device array, shape (B, Lq, Hq, E)
    k_cache, v_cache : device arrays, shapes (num_pages, page_size, H, E) and (.., H, Ev)
    block_table : device array of int32, shape (B, max_pages)
    kv_lens : host array of int64, shape (B,)
        Keys of each sequence (read on the host, to cut the work into chunks).
    is_causal : bool
        Bottom-right aligned: token ``t`` sees keys ``j <= kv_lens[b] - Lq + t``.
    scale : float
    out : device array, shape (B, Lq, Hq, Ev)
        Written.
    lse : device array, shape (B, Hq, Lq), of the compute dtype
        Written.
    stream : cuda stream, optional
    chunk : int, optional
        Keys per chunk (one partial result; default :data:`CHUNK`): results depend on it, not
        on scheduling.
    threads : int, optional
        Threads per block of the chunk kernel (default :data:`THREADS`); any count works.
    bounds : (lo, hi) of host int64 arrays, shape (B,), optional
        The keys ``[lo[b], hi[b])`` of sequence ``b`` to read (left padding, a window's keys:
        :func:`sdpa_numba.kvcache.key_bounds`); keys outside are not attended. Default: all,
        ``[0, kv_lens[b])`` (with a window, pass its bounds: it is not applied to them here).
    recipe : Recipe, optional
        The variants (:func:`sdpa_numba.score.recipe.recipe`), in the cache's frame: token ``t``
        is row ``i = kv_lens[b] - Lq + t`` (plus the recipe's offset), key ``j`` is ``j``; its
        arrays (slopes, sinks, ``mod_args``) host or device arrays; no block mask. None: plain.
    rows : host array of int64, shape (5, B), optional
        A ragged batch (:func:`sdpa_numba.problem.kvcache.query_rows`): for each sequence
        ``b``, ``(qb, q0, lq_b, i0, off)``, its query rows ``q[qb, q0 .. q0 + lq_b - 1]``
        (``q``, ``out`` then ``(1, total_q, Hq, ..)`` views, ``lse`` ``(1, Hq, total_q)``),
        the first one's position and the recipe's offset. None: the rectangular batch,
        ``(b, 0, Lq, kv_lens[b] - Lq, 0)``. The partial results take ``Hq * max(lq_b)``
        rows per chunk.
    quant : tuple, optional
        A quantized cache (:mod:`.quant`): ``k_cache``, ``v_cache`` are then its bytes as
        uint8 device arrays and ``quant`` is :func:`sdpa_numba.gpu.quant.quant_operands`'s
        ``(k_scales, v_scales, k_descale, v_descale, fmt, table)``. Each key's scales fold
        into its score (before the variants see it), each value's into ``P V``. None: a
        float cache of q's dtype.

    Notes
    -----
    As :func:`sdpa_numba.cpu.decode` (see there); the same arguments except ``kv_lens`` on the
    host. E and Ev are limited by shared memory: ``ROWS * (E + Ev + BN + 3)`` compute-dtype
    numbers per block. Asynchronous on ``stream``.
    """
    q, k_cache, v_cache, out = (storage_view(a) for a in (q, k_cache, v_cache, out))
    _, lq, hq, e = q.shape
    h, ev = k_cache.shape[2], v_cache.shape[3]
    kv_lens = np.asarray(kv_lens, np.int64)
    B = len(kv_lens)
    if rows is None:
        rows = np.stack([np.arange(B), np.zeros(B, np.int64), np.full(B, lq), kv_lens - lq,
                         np.zeros(B, np.int64)]).astype(np.int64)
    seq_rows = np.ascontiguousarray(rows, np.int64)
    lq = int(seq_rows[2].max()) if B else 0
    if B == 0 or lq == 0 or hq == 0:
        return
    ct = np.dtype(lse.dtype)
    chunk = CHUNK if chunk is None else chunk
    if bounds is None:
        bounds = (np.zeros_like(kv_lens), kv_lens)
    lo, hi = (np.asarray(x, np.int64) for x in bounds)
    first, task_b, task_c = plan_chunks(hi - lo, chunk)
    n_tasks = int(first[-1])
    rows = hq // h * lq
    n_tiles = -(-rows // ROWS)
    part_out = device_array((n_tasks, hq * lq, ev), ct)
    part_lse = device_array((n_tasks, hq * lq), ct)
    rc = DENSE if recipe is None else recipe
    if is_causal and rc.right > 0:
        rc = rc._replace(right=np.int64(0))
    r_arg = kernel_args(rc, to_device=lambda x: cuda.to_device(x, stream=stream))
    chunk_kernel, merge_kernel = _kernels_for(ct, compile_key(rc), quant is not None)
    shared = ROWS * (e + ev + BN + 3) * ct.itemsize
    kv, d_lo, d_hi = (cuda.to_device(x, stream=stream) for x in (kv_lens, lo, hi))
    tb = cuda.to_device(task_b.astype(np.int64), stream=stream)
    tc = cuda.to_device(task_c.astype(np.int64), stream=stream)
    d_rows = cuda.to_device(seq_rows, stream=stream)
    mrow = np.zeros(B + 1, np.int64)
    np.cumsum(hq * seq_rows[2], out=mrow[1:])
    args = (q, k_cache, v_cache, block_table, kv, d_lo, d_hi, tb, tc, int(chunk),
            float(scale), part_out, part_lse, r_arg, d_rows, int(n_tiles),
            () if quant is None else quant)
    refuse_raising(chunk_kernel, compile_key(rc).functions, args)  # user functions: see .raising
    chunk_kernel[(n_tasks, h * n_tiles), threads or THREADS, stream, shared](*args)
    n = int(mrow[-1])
    mt = 32 if is_simulated_mode() else 128
    merge_kernel[-(-n // mt), mt, stream](
        cuda.to_device(first, stream=stream), part_out, part_lse, out, lse, r_arg, d_rows,
        cuda.to_device(mrow, stream=stream))


@cuda.jit
def _append_kernel(k, v, k_cache, v_cache, pages, slots):
    """Row ``n`` of the new keys/values (``k`` as ``(N, H, E)``) into ``(pages[n], slots[n])``."""
    x = cuda.grid(1)
    h_len = k.shape[1]
    if x >= k.shape[0] * h_len:
        return
    n, h = x // h_len, x % h_len
    for e in range(k.shape[2]):
        k_cache[pages[n], slots[n], h, e] = k[n, h, e]
    for e in range(v.shape[2]):
        v_cache[pages[n], slots[n], h, e] = v[n, h, e]


def append(k, v, k_cache, v_cache, pages, slots, stream=0):
    """Write new keys and values ``k (B, Lq_new, H, E)``, ``v (.., Ev)`` (device arrays, read as
    ``B * Lq_new`` rows in order) into the cache slots ``(pages[n], slots[n])`` (host ints)."""
    k, v, k_cache, v_cache = (storage_view(a) for a in (k, v, k_cache, v_cache))
    B, n_new, h = k.shape[:3]
    n = B * n_new * h
    if n == 0:
        return
    from .arrays import as_strided

    k3 = as_strided(k, (B * n_new, h, k.shape[3]), (k.strides[1], k.strides[2], k.strides[3]))
    v3 = as_strided(v, (B * n_new, h, v.shape[3]), (v.strides[1], v.strides[2], v.strides[3]))
    if B > 1 and (k.strides[0] != n_new * k.strides[1] or v.strides[0] != n_new * v.strides[1]):
        # the (B, Lq_new) dims do not merge into one: one launch per sequence
        for b in range(B):
            append(k[b:b + 1], v[b:b + 1], k_cache, v_cache, pages[b * n_new:(b + 1) * n_new],
                   slots[b * n_new:(b + 1) * n_new], stream)
        return
    mt = 32 if is_simulated_mode() else 128
    _append_kernel[-(-n // mt), mt, stream](
        k3, v3, k_cache, v_cache, cuda.to_device(np.asarray(pages, np.int64), stream=stream),
        cuda.to_device(np.asarray(slots, np.int64), stream=stream))
