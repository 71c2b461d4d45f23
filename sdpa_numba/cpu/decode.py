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
  contiguous run of memory, read key by key for all heads at once; a head-major cache (a
  ``(B, H, S, E)`` array viewed as ``(B, S, H, E)``) is read head by head instead.
* **Addressing.** Key row ``j`` of sequence ``b`` lives at ``(page, slot) = (block_table[b, j //
  page_size], j % page_size)`` of a cache ``(num_pages, page_size, H, E)``. A contiguous cache
  ``(B, S_max, H, E)`` is the paged cache with ``page_size = S_max`` and ``block_table[b] = [b]``:
  one kernel body serves both (:func:`block_offsets`).
* **Ragged batches** (``cu_seqlens_q``; ``varlen_attention`` over a cache): each sequence's
  query rows, their number, the first one's position and its frame's offset come from a
  run-time table (:func:`query_rows`, carried in ``kv_begin``), the packed rows seen as one
  batch entry; a rectangular batch is the table the kernel derives itself, so both share one
  compiled kernel. The partial results are flat, each sequence's chunks ``Hq * Lq_b`` rows.
* **Scores** of float32 caches are summed lane-wise over E, four query rows against
  ``LANES / 4`` keys per pass (one row against ``LANES`` keys where a key/value head has fewer
  than four rows, as MHA), the ``LANES`` dot products reduced together
  (:func:`._llvm.lane_dots`): reduced one by one, their horizontal sums cost about as much as
  their multiply-adds. With GQA, a block's values and the next block's keys are prefetched
  into L2 while the block is worked on.
* **P V** of float32 values (``Ev`` a multiple of ``PV_VEC * LANES``) keeps four rows'
  accumulators in registers over :data:`PV_KEYS` keys of a head (:func:`._llvm.rows_pv`), each
  value vector loaded once for the four rows; the adds into an element stay in key order, one
  fused multiply-add each, as the plain loops that do the other dtypes.
* **Quantized caches** (int8, q8_0, fp8: :mod:`.quant`) are read where they lie, never
  dequantized into a copy: the key scales multiply each scale block's lane sums of ``q k``
  (one block a row: the reduced score), the value scales the weights ``p_j`` of ``P V``, and
  the 8-bit values are converted to float32 in registers inside the same lane-wise and
  register-tile loops as float32's (:func:`quant_scores`, :func:`quant_pv`). One compiled
  kernel per query dtype and scale dtype serves every format (a run-time value); each
  format's block loops (:func:`_scores_int8`, :func:`_pv_int8`, ...) are cached functions of
  their own, called by symbol once a block, compiled once and shared by every specialization.
* **Compiled once:** :func:`_chunk` is called by symbol from the task (``_chunk_by_symbol``),
  so that LLVM optimizes and emits it once per specialization, not again in each library
  above it (the task, the task runner, the parfor's wrappers, the entry point).
* **Scores** go through the score seam (:mod:`sdpa_numba.score.recipe`) in the cache's frame:
  query token ``t`` of ``Lq`` sits at position ``i = kv_len - Lq + t`` (bottom-right), key ``j``
  at ``j``. Causal is the recipe's right side folded to 0 (``j <= i``); a window's
  (:func:`~sdpa_numba.score.recipe.key_range`) and the left padding's (``kv_begin``) keys are
  not chunked at all, so a window of 256 keys over a long cache reads ~256 keys. Soft cap,
  ALiBi and score_mod change scores (``modified_score``), window and mask_mod mask them, and a
  head's sink joins each row's denominator in the merge of the chunks.

Serial entry points (``*_serial``) run on the calling thread: small calls, where waking the
thread pool would cost more than the work, and callers that parallelize themselves. Kernels
trust their arguments; the caches' last dim must be contiguous (unit stride).
"""

import numpy as np
from numba import njit, prange

from numba import types
from numba.extending import overload

from ..score.recipe import (has_element_mask, in_window, kernel_recipe, key_range,
                            modified_score, modifies_scores, sequence_recipe, sink_logit,
                            user_keeps, window_covers)
from ._llvm import (by_symbol, data_ptr, has_512_bit_vectors, keep_alive, lane_dots,
                    no_inline, prefer_512_bit, prefetch, ptr_add, rows_pv, stack_buffer, stash,
                    unstash)
from ..problem.kvcache import key_bounds_loop
from .merge import part_weights
from .online_softmax import finalize_row, softmax_row
from .int_dots import CHUNK as VNNI_STEP, HAS_VNNI, prepare_rows, vnni_lane_dots
from .quant import (E4M3_FOLD, FMT_E5M2, FMT_INT8, FMT_E4M3, Q8_BLOCK, e4m3_half_value,
                    e5m2_value, is_quantized, q_lane_dots, q_rows_pv, quant_scratch)
from .options import CALLED, FASTMATH, INLINE, KERNEL
from .scale_fold import split_power, times
from .scratch import aligned_empty
from ..score.numbers import cast
from .storage import load, store
from .tasks import (failed_task, next_task, raise_lost, record_failure, task_runner,
                    task_queue)

#: Keys per chunk (a task, and a partial result merged by lse). Large enough that a chunk's
#: partial output (``Hq * Lq * Ev`` numbers) is small next to the keys and values it reads
#: (``CHUNK * H * (E + Ev)``), small enough that one long sequence splits among the cores.
CHUNK = 512
#: Keys per block: a block's scores of all rows of one key/value head are kept in a scratch row
#: (``BN`` per row) between the score, softmax and ``P V`` loops.
BN = 32
#: Lanes of the score loop's partial sums: one vector of float32 (16 with AVX-512, else 8).
#: A score is summed lane-wise over E (lane ``l`` takes elements ``e = l mod LANES``), and
#: LANES such dot products are reduced together (:func:`._llvm.lane_dots`).
LANES = 16 if has_512_bit_vectors() else 8
#: Keys per pass of four query rows: 4 x KB dot products, LANES in all.
KB = LANES // 4

_sums = stack_buffer(LANES)
_dots_4xkb = lane_dots(4, KB, LANES)
_dots_1xlanes = lane_dots(1, LANES, LANES)
#: Value vectors per row of one P V pass (:func:`._llvm.rows_pv`): 4 rows x PV_VEC accumulator
#: vectors in registers (16 of AVX-512's 32 registers, 8 of AVX2's 16).
PV_VEC = 4 if LANES == 16 else 2
_pv_4 = rows_pv(4, PV_VEC, LANES)
_pv_1 = rows_pv(1, PV_VEC, LANES)
#: Keys per P V pass of all heads (:func:`registers_pv`): the values are read in address order,
#: PV_KEYS keys of a head, then the next head's. Against 4 and 32, one thread, CPU time, AMD
#: EPYC Zen 4, D128 (``scripts/ab_decode.py --cpu``, new/old against the Numba loops):
#: Hq32 H8 S16384 1.14 / 1.22 / 1.08, H32 S8192 1.02 / 1.06 / 0.78 (a block's 32 keys of one
#: head jump over 16 KiB between keys, where the hardware prefetchers stop).
PV_KEYS = 8


@njit(**INLINE)
def n_chunks(n_keys):
    """The chunks of a range of ``n_keys`` keys (at least one, so that a sequence with no
    keys to read still gets its rows written: 0 and lse -inf)."""
    return max(1, (n_keys + CHUNK - 1) // CHUNK)


def leftpad(kv_begin, b):
    """Sequence ``b``'s first key, ``kv_begin[b]``, or 0 without ``kv_begin`` (jitted code
    only)."""
    raise NotImplementedError("leftpad is only callable from jitted code")


@overload(leftpad)
def _leftpad(kv_begin, b):
    if isinstance(kv_begin, (types.NoneType, types.Omitted)):
        return lambda kv_begin, b: 0
    return lambda kv_begin, b: kv_begin[b]


def query_rows(kv_begin, n_seq, b, kv_len, lq):
    """``(qb, q0, lq_b, i0, off)``: where sequence ``b``'s query rows are and where they sit
    (:func:`sdpa_numba.problem.kvcache.query_rows`'s rule, jitted code only)."""
    raise NotImplementedError("query_rows is only callable from jitted code")


@overload(query_rows)
def _query_rows(kv_begin, n_seq, b, kv_len, lq):
    if isinstance(kv_begin, (types.NoneType, types.Omitted)):
        return lambda kv_begin, n_seq, b, kv_len, lq: (b, 0, lq, kv_len - lq, 0)

    def rows(kv_begin, n_seq, b, kv_len, lq):
        if kv_begin.shape[0] == n_seq:  # left padding alone: q (B, Lq, Hq, E)
            return b, 0, lq, kv_len - lq, 0
        x = kv_begin  # a ragged batch's table (see the problem layer)
        return (x[n_seq + b], x[2 * n_seq + b], x[3 * n_seq + b], x[4 * n_seq + b],
                x[5 * n_seq + b])
    return rows


@njit(**CALLED)
def _recipe_block(s, r, b, h, g, lq, i0, b0, n, cut):
    """The score seam on a block's scores ``s`` (rows of key/value head ``h``; row ``rr`` is
    query head ``h * g + rr // lq`` at position ``i0 + rr % lq``, keys ``b0 ..
    b0 + n - 1``): soft cap, ALiBi, score_mod, then -inf where mask_mod is False or, if
    ``cut``, outside the window. A call of its own, not inlined: the plain kernel's loops
    around it compile as without it (inlined, the GQA decode lost ~20% on one thread)."""
    no_inline()
    element = has_element_mask(r)
    if modifies_scores(r) or element:
        for rr in range(g * lq):
            hq = h * g + rr // lq
            i = i0 + rr % lq
            for j in range(n):
                x = modified_score(r, s[rr * BN + j], b, hq, i, b0 + j)
                if element and not user_keeps(r, b, hq, i, b0 + j):
                    x = -np.inf
                s[rr * BN + j] = x
    if cut:
        for rr in range(g * lq):
            i = i0 + rr % lq
            for j in range(n):
                if not in_window(r, i, b0 + j):
                    s[rr * BN + j] = -np.inf


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


@njit(**INLINE)
def _key_scores(qp, kp, s, i0, rr, rows, e_len, j, zero):
    """Scores ``s[(i0 + rr') * BN + j]`` of key ``j`` (at ``kp``) for rows ``rr' = rr ..
    rows - 1`` (queries at ``qp + (i0 + rr') * e_len``), each dot product summed over E and
    reduced on its own."""
    # Four rows at once (GQA, Lq > 1): each key element is loaded once for them (CPU time of
    # one thread, B1 Hq32 H8 S256 D128 in cache: 22 -> 25 GFLOP/s).
    while rr + 4 <= rows:
        q0 = ptr_add(qp, (i0 + rr) * e_len)
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
        i = i0 + rr
        s[i * BN + j] = x0
        s[(i + 1) * BN + j] = x1
        s[(i + 2) * BN + j] = x2
        s[(i + 3) * BN + j] = x3
        rr += 4
    for rr in range(rr, rows):
        qr = ptr_add(qp, (i0 + rr) * e_len)
        x = zero
        for e in range(e_len):
            x += qr[e] * load(kp[e])
        s[(i0 + rr) * BN + j] = x


@njit(**INLINE)
def _scores_4xkb(qp, kbase, kof, kh, e_len, sp, i, j):
    """Scores of rows ``i .. i + 3`` (queries at ``qp + row * e_len``) against keys ``j .. j +
    KB - 1`` (key ``jj`` at ``kbase + kof[jj] + kh``) into ``sp[row * BN + jj]``
    (:func:`._llvm.lane_dots`). E a multiple of LANES."""
    sums = _sums(sp)
    _dots_4xkb(ptr_add(qp, i * e_len), e_len, kbase, ptr_add(kof, j), kh, e_len, sums)
    for r in range(4):
        for kk in range(KB):
            sp[(i + r) * BN + j + kk] = sums[r * KB + kk]


@njit(**INLINE)
def _scores_1xlanes(qp, kbase, kof, kh, e_len, sp, i, j):
    """Scores of row ``i`` against keys ``j .. j + LANES - 1`` (as :func:`_scores_4xkb`)."""
    _dots_1xlanes(ptr_add(qp, i * e_len), e_len, kbase, ptr_add(kof, j), kh, e_len,
                  ptr_add(sp, i * BN + j))


def lanewise_scores(qp, kbase, kofp, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, zero,
                    vbase, vofp, vhs, ev):
    """The scores of a block's first keys by :func:`._llvm.lane_dots`, for the heads ``h_lo ..
    h_hi - 1``: KB keys x 4 rows per pass (LANES keys x 1 row where a head has fewer than four
    rows), the keys in address order; returns the keys done, the others are left to the
    caller. Only where the keys are stored in the compute dtype float32 (LANES partial sums in
    one vector) and E is a multiple of LANES: else none (jitted code only)."""
    raise NotImplementedError("lanewise_scores is only callable from jitted code")


def _lanewise_scores_impl(qp, kbase, kofp, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, zero,
                          vbase, vofp, vhs, ev):
    j = 0
    if e_len == 0 or e_len % LANES != 0:
        return j
    kb = KB if rows >= 4 else LANES
    while j + kb <= n:
        for h in range(h_lo, h_hi):
            i0 = h * rows
            kh = h * khs
            # These keys' values, asked for now into L2, are read by P V after the block's
            # scores: with them and the next block's keys (see _chunk) asked for ahead, GQA
            # went 1.33x (CPU time of one thread, AMD EPYC Zen 4, B1 Hq32 H8 S16384 D128; the
            # values alone 1.1x, the keys alone 0.83x of both). Not for MHA (a block of 32
            # heads is 1 MiB of keys and values, L2's size): its keys ahead lost 0.91x.
            for jj in range(j, j + kb if rows >= 4 else j):
                vp = ptr_add(vbase, vofp[jj] + h * vhs)
                for d in range(0, ev, 16):
                    prefetch(ptr_add(vp, d))
            if rows >= 4:
                rr = 0
                while rr + 4 <= rows:
                    _scores_4xkb(qp, kbase, kofp, kh, e_len, sp, i0 + rr, j)
                    rr += 4
                for jj in range(j, j + kb):  # the rows left over, key by key
                    kp = ptr_add(kbase, koff[jj] + kh)
                    _key_scores(qp, kp, s, i0, rr, rows, e_len, jj, zero)
            else:
                for rr in range(rows):
                    _scores_1xlanes(qp, kbase, kofp, kh, e_len, sp, i0 + rr, j)
        j += kb
    return j


@overload(lanewise_scores, fastmath=FASTMATH)
def _lanewise_scores(qp, kbase, kofp, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, zero,
                     vbase, vofp, vhs, ev):
    if qp.dtype == kbase.dtype == types.float32:
        return _lanewise_scores_impl
    return (lambda qp, kbase, kofp, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, zero,
            vbase, vofp, vhs, ev: 0)


def registers_pv(ap, ev, sp, vbase, vofp, vhs, rows, h_lo, h_hi, n, kbase, koff, kss,
                 khs, e_len, ahead):
    """P V of a block (keys ``0 .. n - 1``, weights ``sp[i * BN + j]``) into the accumulator
    rows ``ap + i * ev`` of the heads ``h_lo .. h_hi - 1`` by :func:`._llvm.rows_pv`; returns
    whether it did (float32 values, ``ev`` a multiple of ``PV_VEC * LANES``), else the caller
    does (jitted code only)."""
    raise NotImplementedError("registers_pv is only callable from jitted code")


def _registers_pv_impl(ap, ev, sp, vbase, vofp, vhs, rows, h_lo, h_hi, n, kbase, koff,
                       kss, khs, e_len, ahead):
    step = PV_VEC * LANES
    if ev == 0 or ev % step != 0:
        return False
    for j0 in range(0, n, PV_KEYS):
        nk = min(PV_KEYS, n - j0)
        for h in range(h_lo, h_hi):
            if ahead:
                for jj in range(j0, j0 + nk):
                    kn = ptr_add(kbase, koff[jj] + BN * kss + h * khs)
                    for e in range(0, e_len, 16):  # float32: 16 a cache line
                        prefetch(ptr_add(kn, e))
            rr = 0
            while rr < rows:
                i = h * rows + rr
                for d0 in range(0, ev, step):
                    if rr + 4 <= rows:
                        _pv_4(ptr_add(ap, i * ev + d0), ev, ptr_add(sp, i * BN + j0), BN,
                              vbase, ptr_add(vofp, j0), h * vhs + d0, nk)
                    else:
                        _pv_1(ptr_add(ap, i * ev + d0), ev, ptr_add(sp, i * BN + j0), BN,
                              vbase, ptr_add(vofp, j0), h * vhs + d0, nk)
                rr += 4 if rr + 4 <= rows else 1
    return True


@overload(registers_pv, fastmath=FASTMATH)
def _registers_pv(ap, ev, sp, vbase, vofp, vhs, rows, h_lo, h_hi, n, kbase, koff, kss,
                  khs, e_len, ahead):
    if ap.dtype == vbase.dtype == kbase.dtype == types.float32:
        return _registers_pv_impl
    return (lambda ap, ev, sp, vbase, vofp, vhs, rows, h_lo, h_hi, n, kbase, koff, kss,
            khs, e_len, ahead: False)


#: A stack buffer of BN offsets (:func:`_block_scales`' scale rows).
_row_offsets = stack_buffer(BN)


@njit(**INLINE)
def _block_scales(sc, d, fold, b, block_table, b0, n, page_size, h_lo, h_hi, out, like):
    """``out[(h * nb + c) * BN + j] = sc[page, slot, h, c] * (d[b, h] * fold)`` (float32) for
    the keys ``j < n`` of the block from key ``b0`` of sequence ``b`` and the heads ``h_lo ..
    h_hi - 1``: a quantized cache's scales (float32 or float16 as uint16) times its descales
    (and ``fold``, a power of two: :data:`.quant.E4M3_FOLD`), once a block (``nb / E`` of the
    values' work), a head's keys next to each other (the vector loops read them as one
    vector). By pointers from the arrays' strides: indexing the 4-d scales checked each index
    for wraparound, a few ns per (key, head), a tenth of a quantized key's time. ``like``: any
    int64 pointer (the type of a stack buffer of the scale rows' offsets)."""
    nb = sc.shape[3]
    isz = sc.itemsize
    sps, sss = sc.strides[0] // isz, sc.strides[1] // isz
    shs, scs = sc.strides[2] // isz, sc.strides[3] // isz
    scp = data_ptr(sc)
    dp = ptr_add(data_ptr(d), b * (d.strides[0] // d.itemsize))
    dhs = d.strides[1] // d.itemsize
    op = data_ptr(out)
    # The keys' scale rows once a block, then head by head a loop over the keys, stored in
    # out's order: with the heads inner (stores BN apart), LLVM vectorized the loop over the
    # heads with scatters, 1.9 ns per (key, head) and scale array against 0.27 ns now (in
    # isolation, H8 S128 float32 scales, AMD EPYC Zen 4; the loads are scalar, 3 instructions
    # an element). Int8 MHA H32 S8192 D128 from memory, one thread: 24.7 -> 23.9 ns per
    # (key, head).
    ro = _row_offsets(like)
    page = b0 // page_size
    slot = b0 - page * page_size
    for j in range(n):
        ro[j] = block_table[b, page] * sps + slot * sss
        slot += 1
        if slot == page_size:
            slot = 0
            page += 1
    for h in range(h_lo, h_hi):
        dh = dp[h * dhs] * fold
        for c in range(nb):
            o = ptr_add(op, (h * nb + c) * BN)
            hc = h * shs + c * scs
            for j in range(n):
                o[j] = np.float32(load(scp[ro[j] + hc]) * dh)


@njit(**INLINE)
def _int8_value(x):
    return np.float32(x)


def _quant_format(fmt, value, vector):
    """The score and P V loops of a quantized block of format ``fmt`` (``value``: one element's
    float32 value): ``(scores, pv)``. ``vector``: by the intrinsics of :mod:`.quant` where the
    shapes allow (float32 queries, E a multiple of LANES, one scale block a row or blocks of
    Q8_BLOCK), with scalar loops for the keys and rows left over; else scalar loops only."""
    d4 = q_lane_dots(4, KB, LANES, fmt, None)
    d1 = q_lane_dots(1, LANES, LANES, fmt, None)
    d4b = q_lane_dots(4, KB, LANES, fmt, Q8_BLOCK)
    d1b = q_lane_dots(1, LANES, LANES, fmt, Q8_BLOCK)
    pv4 = q_rows_pv(4, PV_VEC, LANES, fmt, None)
    pv1 = q_rows_pv(1, PV_VEC, LANES, fmt, None)
    pv4b = q_rows_pv(4, PV_VEC, LANES, fmt, Q8_BLOCK)
    pv1b = q_rows_pv(1, PV_VEC, LANES, fmt, Q8_BLOCK)
    # int8 with one scale a row, fewer than four rows a head: the scores in integers, by
    # VNNI (.int_dots), where quant_queries prepared the rows (qi[2])
    # (built only where it applies: LLVM cannot select the instruction elsewhere)
    if vector and HAS_VNNI and LANES == 16 and fmt == FMT_INT8:
        dv1 = vnni_lane_dots(1, LANES, 8)

        @njit(**INLINE)
        def int_scores(qi, i, e_len, kbase, kofp, kh, scp, o):
            if not qi[2]:
                return False
            dv1(ptr_add(data_ptr(qi[0]), i * 2 * e_len), 2 * e_len,
                ptr_add(data_ptr(qi[1]), 2 * i), kbase, kofp, kh, e_len, scp, o)
            return True
    else:
        @njit(**INLINE)
        def int_scores(qi, i, e_len, kbase, kofp, kh, scp, o):
            return False

    @njit(**INLINE)
    def qdot(qr, kp, e_len, nb, scp):
        # sum_c scale_c * sum_{e in c} q_e k_e (block c's scale at scp[c * BN])
        blk = e_len // nb
        x = np.float32(0.0)
        for c in range(nb):
            t = np.float32(0.0)
            for e in range(c * blk, (c + 1) * blk):
                t += qr[e] * value(kp[e])
            x += t * scp[c * BN]
        return x

    @njit(**INLINE)
    def scores(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
               vhs, ev, qi):
        j = 0
        if vector and e_len > 0 and e_len % LANES == 0 and (nb == 1 or e_len == nb * Q8_BLOCK):
            kofp = data_ptr(koff)
            sums = _sums(sp)
            kb = KB if rows >= 4 else LANES
            while j + kb <= n:
                for h in range(h_lo, h_hi):
                    i0 = h * rows
                    kh = h * khs
                    scp = ptr_add(kscp, h * nb * BN + j)  # the keys' scales, block c at c * BN
                    if rows >= 4:
                        # These keys' values into L2 for P V, as lanewise_scores does (GQA).
                        for jj in range(j, j + kb):
                            vp = ptr_add(vbase, voff[jj] + h * vhs)
                            for d in range(0, ev, 64):  # 8-bit values: 64 a cache line
                                prefetch(ptr_add(vp, d))
                        rr = 0
                        while rr + 4 <= rows:
                            q0 = ptr_add(qp, (i0 + rr) * e_len)
                            if nb == 1:  # one scale a key: times the reduced score
                                d4(q0, e_len, kbase, ptr_add(kofp, j), kh, e_len, scp, BN, sums)
                            else:
                                d4b(q0, e_len, kbase, ptr_add(kofp, j), kh, e_len, scp, BN, sums)
                            for r in range(4):
                                for kk in range(KB):
                                    sp[(i0 + rr + r) * BN + j + kk] = sums[r * KB + kk]
                            rr += 4
                        for jj in range(j, j + kb):  # the rows left over, key by key
                            kp = ptr_add(kbase, koff[jj] + kh)
                            sc = ptr_add(kscp, h * nb * BN + jj)
                            for r2 in range(rr, rows):
                                sp[(i0 + r2) * BN + jj] = qdot(ptr_add(qp, (i0 + r2) * e_len),
                                                               kp, e_len, nb, sc)
                    else:
                        for rr in range(rows):
                            o = ptr_add(sp, (i0 + rr) * BN + j)
                            q0 = ptr_add(qp, (i0 + rr) * e_len)
                            if int_scores(qi, i0 + rr, e_len, kbase, ptr_add(kofp, j), kh, scp,
                                          o):
                                pass  # by VNNI: see quant_queries
                            elif nb == 1:
                                d1(q0, e_len, kbase, ptr_add(kofp, j), kh, e_len, scp, BN, o)
                            else:
                                d1b(q0, e_len, kbase, ptr_add(kofp, j), kh, e_len, scp, BN, o)
                j += kb
        for jj in range(j, n):
            for h in range(h_lo, h_hi):
                kp = ptr_add(kbase, koff[jj] + h * khs)
                sc = ptr_add(kscp, h * nb * BN + jj)
                for rr in range(rows):
                    i = h * rows + rr
                    sp[i * BN + jj] = qdot(ptr_add(qp, i * e_len), kp, e_len, nb, sc)

    @njit(**INLINE)
    def pv(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss, khs,
           e_len, ahead):
        step = PV_VEC * LANES
        if (vector and ev > 0 and ev % step == 0
                and (nb == 1 or (ev == nb * Q8_BLOCK and step % Q8_BLOCK == 0))):
            vofp = data_ptr(voff)
            for j0 in range(0, n, PV_KEYS):
                nk = min(PV_KEYS, n - j0)
                for h in range(h_lo, h_hi):
                    if ahead:  # the next block's keys into L2, as registers_pv does (GQA)
                        for jj in range(j0, j0 + nk):
                            kn = ptr_add(kbase, koff[jj] + BN * kss + h * khs)
                            for e in range(0, e_len, 64):
                                prefetch(ptr_add(kn, e))
                    rr = 0
                    while rr < rows:
                        i = h * rows + rr
                        for d0 in range(0, ev, step):
                            c0 = d0 // Q8_BLOCK if nb > 1 else 0
                            pw = ptr_add(wp, (i * nb + c0) * BN + j0)
                            a = ptr_add(ap, i * ev + d0)
                            vo = ptr_add(vofp, j0)
                            vh = h * vhs + d0
                            if rr + 4 <= rows:
                                if nb == 1:
                                    pv4(a, ev, pw, nb * BN, BN, vbase, vo, vh, nk)
                                else:
                                    pv4b(a, ev, pw, nb * BN, BN, vbase, vo, vh, nk)
                            elif nb == 1:
                                pv1(a, ev, pw, nb * BN, BN, vbase, vo, vh, nk)
                            else:
                                pv1b(a, ev, pw, nb * BN, BN, vbase, vo, vh, nk)
                        rr += 4 if rr + 4 <= rows else 1
            return
        blk = ev // nb if nb else 0
        for j in range(n):
            for h in range(h_lo, h_hi):
                vp = ptr_add(vbase, voff[j] + h * vhs)
                for rr in range(rows):
                    i = h * rows + rr
                    ar = ptr_add(ap, i * ev)
                    for c in range(nb):
                        w = wp[(i * nb + c) * BN + j]
                        for d in range(c * blk, (c + 1) * blk):
                            ar[d] += w * value(vp[d])

    return scores, pv


#: The loops of float32 queries (every storage dtype but float64), per format.
_VECTOR = {fmt: _quant_format(fmt, value, True)
           for fmt, value in ((FMT_INT8, _int8_value), (FMT_E4M3, e4m3_half_value),
                              (FMT_E5M2, e5m2_value))}
_int8_scores, _int8_pv = _VECTOR[FMT_INT8]
_e4m3_scores, _e4m3_pv = _VECTOR[FMT_E4M3]
_e5m2_scores, _e5m2_pv = _VECTOR[FMT_E5M2]
#: The scalar loops of float64 queries, inlined into _chunk: a rare case, left as it was.
_SCALAR = {fmt: _quant_format(fmt, value, False)
           for fmt, value in ((FMT_INT8, _int8_value), (FMT_E4M3, e4m3_half_value),
                              (FMT_E5M2, e5m2_value))}

# Each format's vector loops are a cached function of their own, called by symbol
# (_llvm.by_symbol) once a block: they depend on the pointers, sizes and query rows only, so
# they are compiled once per format, not again inside every specialization of _chunk (query
# dtype, scales' dtype, recipe type) and every layer above it. Inlined into _chunk, all three
# formats' loops went through LLVM in each specialization, and again in each library above.
# One function per format and loop, written out: a factory's closures would share one cache
# entry's name, and one function for the three formats took LLVM ~4 s more CPU on the first
# int8 decode (scripts/quant_compile_profile.py: 24.4 against 20.0 s).


@njit(**KERNEL)
def _scores_int8(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                 vhs, ev, qi):
    """The scores of a block of an int8 (or q8_0) cache: :func:`_quant_format`'s loops."""
    prefer_512_bit()
    _int8_scores(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                 vhs, ev, qi)


@njit(**KERNEL)
def _scores_e4m3(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                 vhs, ev, qi):
    """The scores of a block of an fp8 e4m3fn cache: :func:`_quant_format`'s loops."""
    prefer_512_bit()
    _e4m3_scores(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                 vhs, ev, qi)


@njit(**KERNEL)
def _scores_e5m2(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                 vhs, ev, qi):
    """The scores of a block of an fp8 e5m2 cache: :func:`_quant_format`'s loops."""
    prefer_512_bit()
    _e5m2_scores(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                 vhs, ev, qi)


@njit(**KERNEL)
def _pv_int8(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss, khs,
             e_len, ahead):
    """P V of a block of an int8 (or q8_0) cache: :func:`_quant_format`'s loops."""
    prefer_512_bit()
    _int8_pv(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss, khs,
             e_len, ahead)


@njit(**KERNEL)
def _pv_e4m3(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss, khs,
             e_len, ahead):
    """P V of a block of an fp8 e4m3fn cache: :func:`_quant_format`'s loops."""
    prefer_512_bit()
    _e4m3_pv(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss, khs,
             e_len, ahead)


@njit(**KERNEL)
def _pv_e5m2(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss, khs,
             e_len, ahead):
    """P V of a block of an fp8 e5m2 cache: :func:`_quant_format`'s loops."""
    prefer_512_bit()
    _e5m2_pv(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss, khs,
             e_len, ahead)


_scores_int8_by_symbol = by_symbol(_scores_int8)
_scores_e4m3_by_symbol = by_symbol(_scores_e4m3)
_scores_e5m2_by_symbol = by_symbol(_scores_e5m2)
_pv_int8_by_symbol = by_symbol(_pv_int8)
_pv_e4m3_by_symbol = by_symbol(_pv_e4m3)
_pv_e5m2_by_symbol = by_symbol(_pv_e5m2)


def quant_scores(qz, scr, qp, kbase, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, b,
                 block_table, b0, page_size, vbase, voff, vhs, ev, qi):
    """A quantized cache's scores of a block (keys ``b0 .. b0 + n - 1`` of sequence ``b``, at
    ``koff`` in the cache, heads ``h_lo .. h_hi - 1``) into ``sp[i * BN + j]``, the key scales
    and descales folded in (``qi``: :func:`quant_queries`'); nothing for a float cache
    (jitted code only)."""
    raise NotImplementedError("quant_scores is only callable from jitted code")


@overload(quant_scores, fastmath=FASTMATH, inline="always")
def _quant_scores(qz, scr, qp, kbase, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, b,
                  block_table, b0, page_size, vbase, voff, vhs, ev, qi):
    if not is_quantized_type(qz):
        return (lambda qz, scr, qp, kbase, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, b,
                block_table, b0, page_size, vbase, voff, vhs, ev, qi: None)
    if qp.dtype == types.float32:
        s_int8, s_e4m3, s_e5m2 = (_scores_int8_by_symbol, _scores_e4m3_by_symbol,
                                  _scores_e5m2_by_symbol)
    else:
        s_int8, s_e4m3, s_e5m2 = (_SCALAR[f][0] for f in (FMT_INT8, FMT_E4M3, FMT_E5M2))

    def impl(qz, scr, qp, kbase, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, b,
             block_table, b0, page_size, vbase, voff, vhs, ev, qi):
        ks, _, kd, _, fmt = qz
        ksc = scr[0]
        fold = np.float32(E4M3_FOLD if fmt == FMT_E4M3 else 1.0)
        _block_scales(ks, kd, fold, b, block_table, b0, n, page_size, h_lo, h_hi, ksc,
                      data_ptr(koff))
        nb = ks.shape[3]
        kscp = data_ptr(ksc)
        if fmt == FMT_INT8:
            s_int8(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                   vhs, ev, qi)
        elif fmt == FMT_E5M2:
            s_e5m2(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                   vhs, ev, qi)
        else:
            s_e4m3(qp, kbase, koff, sp, rows, h_lo, h_hi, khs, e_len, n, nb, kscp, vbase, voff,
                   vhs, ev, qi)
    return impl


def quant_queries(qz, qp, n_rows, rows, e_len):
    """None for a float cache; for a quantized one ``(dig, fac, use)``: where ``use``, the
    ``n_rows`` float32 query rows at ``qp`` (``E = e_len``) written for the VNNI scores of an
    int8 cache with one scale a row (:func:`.int_dots.prepare_rows`), once a chunk; ``use``
    is false (and the arrays empty) where those do not apply: no VNNI, another format, blocks
    of scales, E not a multiple of 64 or below 128, four rows a head or more (jitted code
    only)."""
    raise NotImplementedError("quant_queries is only callable from jitted code")


@overload(quant_queries, inline="always")
def _quant_queries(qz, qp, n_rows, rows, e_len):
    if not is_quantized_type(qz):
        return lambda qz, qp, n_rows, rows, e_len: None
    vnni = HAS_VNNI and LANES == 16 and qp.dtype == types.float32

    def impl(qz, qp, n_rows, rows, e_len):
        # E of 128 and more: at 64 the per-score combination of the lanes and the rows'
        # preparation (.int_dots.prepare_rows, ~1.1 ns an element once a chunk) leave no gain
        # (16 keys in L1, one row, AMD EPYC Zen 4, ns per (key, head): D64 float loop 2.6,
        # VNNI 2.3; D128 4.7, 3.35; D256 8.7, 5.6; scripts/quant_decode_profile.py --micro)
        use = (vnni and qz[4] == FMT_INT8 and qz[0].shape[3] == 1 and rows < 4
               and e_len >= 2 * VNNI_STEP and e_len % VNNI_STEP == 0)
        m = n_rows if use else 0
        dig = aligned_empty(m * 2 * e_len, np.int16)
        fac = np.empty(2 * m, np.float32)
        if use:
            prepare_rows(qp, n_rows, e_len, dig, fac)
        return dig, fac, use
    return impl


def quant_pv(qz, scr, ap, ev, sp, vbase, voff, rows, h_lo, h_hi, n, vhs, b, block_table, b0,
             page_size, kbase, koff, kss, khs, e_len, ahead):
    """A quantized cache's P V of a block (as :func:`quant_scores`; weights ``sp[i * BN +
    j]``) into the accumulator rows ``ap + i * ev``, the value scales and descales folded into
    the weights; nothing for a float cache (jitted code only)."""
    raise NotImplementedError("quant_pv is only callable from jitted code")


@overload(quant_pv, fastmath=FASTMATH, inline="always")
def _quant_pv(qz, scr, ap, ev, sp, vbase, voff, rows, h_lo, h_hi, n, vhs, b, block_table, b0,
              page_size, kbase, koff, kss, khs, e_len, ahead):
    if not is_quantized_type(qz):
        return (lambda qz, scr, ap, ev, sp, vbase, voff, rows, h_lo, h_hi, n, vhs, b,
                block_table, b0, page_size, kbase, koff, kss, khs, e_len, ahead: None)
    if ap.dtype == types.float32:
        p_int8, p_e4m3, p_e5m2 = _pv_int8_by_symbol, _pv_e4m3_by_symbol, _pv_e5m2_by_symbol
    else:
        p_int8, p_e4m3, p_e5m2 = (_SCALAR[f][1] for f in (FMT_INT8, FMT_E4M3, FMT_E5M2))

    def impl(qz, scr, ap, ev, sp, vbase, voff, rows, h_lo, h_hi, n, vhs, b, block_table, b0,
             page_size, kbase, koff, kss, khs, e_len, ahead):
        _, vs, _, vd, fmt = qz
        vsc, wts = scr[1], scr[2]
        fold = np.float32(E4M3_FOLD if fmt == FMT_E4M3 else 1.0)
        _block_scales(vs, vd, fold, b, block_table, b0, n, page_size, h_lo, h_hi, vsc,
                      data_ptr(koff))
        nb = vs.shape[3]
        wp = data_ptr(wts)
        vscp = data_ptr(vsc)
        # The weights with the values' scales folded in, per scale block (by pointers: a
        # vector loop).
        for h in range(h_lo, h_hi):
            for rr in range(rows):
                i = h * rows + rr
                for c in range(nb):
                    wr = ptr_add(wp, (i * nb + c) * BN)
                    pr = ptr_add(sp, i * BN)
                    vr = ptr_add(vscp, (h * nb + c) * BN)
                    for j in range(n):
                        wr[j] = pr[j] * vr[j]
        if fmt == FMT_INT8:
            p_int8(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss,
                   khs, e_len, ahead)
        elif fmt == FMT_E5M2:
            p_e5m2(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss,
                   khs, e_len, ahead)
        else:
            p_e4m3(ap, ev, wp, vbase, voff, rows, h_lo, h_hi, n, vhs, nb, kbase, koff, kss,
                   khs, e_len, ahead)
    return impl


def float_rows(qz, kbase, vbase, qp):
    """The key and value pointers of the float score and P V loops: the cache's for a float
    cache; for a quantized one (whose blocks :func:`quant_scores` and :func:`quant_pv` do, so
    that those loops never run) float pointers that they compile against (jitted code
    only)."""
    raise NotImplementedError("float_rows is only callable from jitted code")


@overload(float_rows, inline="always")
def _float_rows(qz, kbase, vbase, qp):
    if not is_quantized_type(qz):
        return lambda qz, kbase, vbase, qp: (kbase, vbase)
    return lambda qz, kbase, vbase, qp: (qp, qp)


def is_quantized_type(qz):
    """Whether the Numba type ``qz`` is a quantized cache's ``quant`` tuple."""
    return not isinstance(qz, (types.NoneType, types.Omitted))


@njit(**INLINE)
def _pack_queries(q, qb, q0, lq, scale, qs, zero):
    """``qs`` (Hq * Lq rows of E, row ``h * Lq + t``) = ``scale`` · ``q[qb, q0 + t, h]``, in
    the compute dtype of ``zero``."""
    hq, e_len = q.shape[2], q.shape[3]
    for h in range(hq):
        for t in range(lq):
            x = h * lq + t
            for e in range(e_len):
                qs[x * e_len + e] = cast(load(q[qb, q0 + t, h, e]) * scale, zero)


@njit(**KERNEL)  # cached: called by symbol (see _chunk_by_symbol)
def _chunk(q, k_cache, v_cache, block_table, kv_lens, r, scale, b, j0, j1, part_out,
           part_lse, qz, kv_begin):
    """Attention of all query rows of sequence ``b`` over its keys ``[j0, j1)`` under recipe
    ``r`` (causality folded in): normalized partial output ``part_out (Hq * Lq, Ev)`` (row
    ``hq * Lq + t``) and ``part_lse``; the rows, their positions and the recipe's offset of
    the sequence from ``kv_begin`` (:func:`query_rows`)."""
    # One compiled body for the serial and the parallel kernel (called by symbol from both):
    # inlined into each, LLVM may vectorize (and contract to FMAs) differently, and the two
    # would differ in the last bit.
    no_inline()
    # 512-bit vectors: ~2x LLVM's default 256-bit code here (CPU time of one thread, Emerald
    # Rapids: B1 H32 S256 D128 in cache 5.3 -> 11.3 GFLOP/s; S8192 from memory 16.4 GB/s,
    # NumPy's read 16-17 GB/s in the same run)
    prefer_512_bit()
    hq, e_len = q.shape[2], q.shape[3]
    kv_len = kv_lens[b]
    qb, q0, lq, i0, off = query_rows(kv_begin, kv_lens.shape[0], b, kv_len, q.shape[1])
    # The sequence's recipe: its offset moved by off (0 but for a varlen call's alignment).
    r = sequence_recipe(r, b - b, 0, r.offset + off, True)
    h_len = k_cache.shape[2]
    ev = v_cache.shape[3]
    g = hq // h_len
    rows = g * lq  # query rows per key/value head
    page_size = k_cache.shape[1]
    ksz, vsz = k_cache.itemsize, v_cache.itemsize
    kps, kss, khs = k_cache.strides[0] // ksz, k_cache.strides[1] // ksz, k_cache.strides[2] // ksz
    vps, vss, vhs = v_cache.strides[0] // vsz, v_cache.strides[1] // vsz, v_cache.strides[2] // vsz
    # Address order: where a key's heads lie nearer than the next key (the FlashAttention
    # layout, pages), a block is done for all heads at once, key j of every head, then key
    # j + 1; else (transformers' (B, H, S, E) viewed as (B, S, H, E)) the chunk is done head
    # by head, each head's keys one contiguous run. Against
    # the grain the reads jump from page to page, where the hardware prefetchers stop (CPU
    # time of one thread, AMD EPYC Zen 4, B1 H32 S8192 D128: pages of 16 keys 9.4 -> 17 GB/s;
    # (B, H, S, E) 15.5 -> 9.0 GB/s).
    h_step = h_len if khs < kss else 1
    zero = cast(0.0, part_lse)
    # Queries of all rows, scaled, in the compute dtype, E contiguous; those that overflowed
    # with scale are packed with scale / w, and the scores are then multiplied by w.
    qs = aligned_empty(hq * lq * e_len, part_lse.dtype)
    _pack_queries(q, qb, q0, lq, scale, qs, zero)
    w = split_power(qs, hq * lq * e_len, scale)
    if w != 1:
        _pack_queries(q, qb, q0, lq, scale / w, qs, zero)
    score_w = cast(w, zero)
    acc = aligned_empty(hq * lq * max(ev, 1), part_lse.dtype)
    acc[:] = 0
    m = np.full(hq * lq, -np.inf, part_lse.dtype)
    l = np.zeros(hq * lq, part_lse.dtype)
    s = aligned_empty(hq * lq * BN, part_lse.dtype)
    koff = np.empty(BN, np.int64)
    voff = np.empty(BN, np.int64)
    kbase = data_ptr(k_cache)
    vbase = data_ptr(v_cache)
    qp = data_ptr(qs)
    sp = data_ptr(s)
    ap = data_ptr(acc)
    # None, or a quantized cache's scales and weights of a block (.quant.quant_scratch).
    scr = quant_scratch(qz, h_len, hq * lq, BN)
    # None, or a quantized cache's query rows for the int8 VNNI scores (once a chunk).
    qi = quant_queries(qz, qp, hq * lq, rows, e_len)
    # A quantized cache's blocks are read by quant_scores and quant_pv, the float loops never.
    kb, vb = float_rows(qz, kbase, vbase, qp)
    ko, vo, kh_s, vh_s = koff, voff, khs, vhs
    # Block by block, the block's keys, then its values, in address order (see h_step).
    for h_lo in range(0, h_len, h_step):
        h_hi = h_lo + h_step
        for b0 in range(j0, j1, BN):
            n = min(BN, j1 - b0)
            block_offsets(block_table, b, b0, n, page_size, kps, kss, vps, vss, koff, voff)
            # The window (and causality) per element only where it cuts the block.
            cut = not window_covers(r, i0, i0 + lq - 1, b0, b0 + n - 1)
            # Scores s[h * rows + rr, j] of the rows of head h (rr = hg * lq + t). Lane-wise
            # where it applies: KB keys x 4 rows, or LANES keys x 1 row, per pass.
            # `qz is not None`: a test of an argument's type, which Numba folds before typing,
            # so that a quantized specialization never compiles the float loops (nor a float
            # one the quantized).
            if qz is not None:  # the scales folded into the sums (.quant)
                quant_scores(qz, scr, qp, kbase, koff, s, sp, rows, h_lo, h_hi, khs, e_len, n, b,
                             block_table, b0, page_size, vbase, voff, vhs, ev, qi)
            else:
                j = lanewise_scores(qp, kb, data_ptr(ko), ko, s, sp, rows, h_lo, h_hi, kh_s,
                                    e_len, n, zero, vb, data_ptr(vo), vh_s, ev)
                for j in range(j, n):
                    for h in range(h_lo, h_hi):
                        kp = ptr_add(kb, ko[j] + h * kh_s)
                        _key_scores(qp, kp, s, h * rows, 0, rows, e_len, j, zero)
            if w != 1:
                for i in range(h_lo * rows, h_hi * rows):
                    times(ptr_add(sp, i * BN), n, score_w)
            for h in range(h_lo, h_hi):
                if cut or modifies_scores(r) or has_element_mask(r):
                    _recipe_block(s[h * rows * BN:(h + 1) * rows * BN], r, b, h, g, lq, i0,
                                  b0, n, cut)
            for i in range(h_lo * rows, h_hi * rows):
                m_new, alpha, total = softmax_row(ptr_add(sp, i * BN), n, m[i])
                m[i] = m_new
                l[i] = alpha * l[i] + total
                if alpha != 1:  # rescaled here; rare once the row's maximum has settled
                    ar = ptr_add(ap, i * ev)
                    for d in range(ev):
                        ar[d] *= alpha
            # P V: by registers_pv where it applies (float32, see PV_KEYS); else here, for all
            # dtypes. Heads inner, four keys at a time: each accumulator row is loaded and stored
            # once for four value rows, the adds in key order, so bitwise as one at a time
            # (CPU time of one thread, AMD EPYC Zen 4: B1 H32 S8192 D128 1.10x, B1 Hq32 H8
            # S16384 1.21x). Head by head it lost (B1 H32 S8192 D128 on (B, H, S, E): 0.72x):
            # there the four value rows are neighbours, and one stream beats four.
            j = 0
            # The next block's keys, where they lie in this page at the same stride, asked for
            # into L2 while these values are summed (GQA only: see lanewise_scores). Head-major
            # caches too, through registers_pv (B1 Hq32 H8 S16384 D128 on (B, H, S, E): 2.0x
            # with the P V change, CPU time of one thread).
            ahead = (rows >= 4 and b0 % page_size + 2 * BN <= page_size
                     and b0 + 2 * BN <= j1 and not is_quantized(qz))
            # Head-major with fewer than four rows (no prefetch), only where one pass covers a
            # value row: the loops below read each row once, in address order, where rows_pv
            # reads a key group's rows once per PV_VEC * LANES elements (CPU time of one
            # thread, on (B, H, S, E) D128: B1 H32 S8192 0.83x, B1 Hq8 H4 S4096 0.80-0.89x;
            # D64: B1 Hq12 H4 S2080 1.24-1.28x).
            if qz is not None:  # the value scales folded into the weights (.quant)
                quant_pv(qz, scr, ap, ev, sp, vbase, voff, rows, h_lo, h_hi, n, vhs, b,
                         block_table, b0, page_size, kbase, koff, kss, khs, e_len,
                         rows >= 4 and b0 % page_size + 2 * BN <= page_size
                         and b0 + 2 * BN <= j1)
                j = n
            elif (h_step > 1 or rows >= 4 or ev == PV_VEC * LANES) and registers_pv(
                    ap, ev, sp, vb, data_ptr(vo), vh_s, rows, h_lo, h_hi, n, kb, ko, kss,
                    kh_s, e_len, ahead):
                j = n
            while j + 4 <= n and h_step > 1:
                for h in range(h_lo, h_hi):
                    if ahead:
                        for jj in range(j, j + 4):
                            kn = ptr_add(kb, ko[jj] + BN * kss + h * kh_s)
                            for e in range(0, e_len, 64 // ksz):
                                prefetch(ptr_add(kn, e))
                    v0 = ptr_add(vb, vo[j] + h * vh_s)
                    v1 = ptr_add(vb, vo[j + 1] + h * vh_s)
                    v2 = ptr_add(vb, vo[j + 2] + h * vh_s)
                    v3 = ptr_add(vb, vo[j + 3] + h * vh_s)
                    for rr in range(rows):
                        i = h * rows + rr
                        p0 = s[i * BN + j]
                        p1 = s[i * BN + j + 1]
                        p2 = s[i * BN + j + 2]
                        p3 = s[i * BN + j + 3]
                        ar = ptr_add(ap, i * ev)
                        for d in range(ev):
                            x = ar[d]
                            x += p0 * load(v0[d])
                            x += p1 * load(v1[d])
                            x += p2 * load(v2[d])
                            x += p3 * load(v3[d])
                            ar[d] = x
                j += 4
            for j in range(j, n):
                for h in range(h_lo, h_hi):
                    vp = ptr_add(vb, vo[j] + h * vh_s)
                    for rr in range(rows):
                        i = h * rows + rr
                        p = s[i * BN + j]
                        ar = ptr_add(ap, i * ev)
                        for d in range(ev):
                            ar[d] += p * load(vp[d])
    keep_alive((k_cache, v_cache, qs, s, acc, koff))
    keep_alive(scr)
    keep_alive(qi)
    for i in range(hq * lq):
        part_lse[i] = finalize_row(m[i], l[i], acc[i * ev:(i + 1) * ev], part_out[i])


#: _chunk called by symbol (_llvm.by_symbol): compiled once per specialization, in its own
#: library, not again in each layer above it (the task, the task runner, the parfor's
#: wrappers, decode; the task and decode_serial), where LLVM optimized and emitted it anew.
_chunk_by_symbol = by_symbol(_chunk)


@njit(**INLINE)
def _parts_of(part_out, part_lse, first, prow, b, ev):
    """Sequence ``b``'s partial results: views ``(n_b, R_b, Ev)`` and ``(n_b, R_b)`` of the
    flat buffers (its ``n_b`` chunks, ``R_b = Hq * Lq_b`` rows each, from row ``prow[b]``)."""
    n_b = first[b + 1] - first[b]
    rows = (prow[b + 1] - prow[b]) // n_b
    return (part_out[prow[b] * ev:prow[b + 1] * ev].reshape((n_b, rows, ev)),
            part_lse[prow[b]:prow[b + 1]].reshape((n_b, rows)))


@njit(**CALLED)  # not inline: called through a task runner (.tasks)
def _task(q, k_cache, v_cache, block_table, kv_lens, r, scale, first, lo, hi, t, part_out,
          part_lse, qz, kv_begin, prow):
    """Task ``t``: chunk ``t - first[b]`` of the keys ``[lo[b], hi[b])`` of the sequence ``b``
    it belongs to."""
    b = np.searchsorted(first, t, side="right") - 1
    c = t - first[b]
    j0 = lo[b] + c * CHUNK
    j1 = min(hi[b], j0 + CHUNK)
    po, pl = _parts_of(part_out, part_lse, first, prow, b, v_cache.shape[3])
    _chunk_by_symbol(q, k_cache, v_cache, block_table, kv_lens, r, scale, b, j0, max(j0, j1),
                     po[c], pl[c], qz, kv_begin)


@njit(**CALLED)
def _merge(first, part_out, part_lse, out, lse, b, i, r, prow, kv_begin, kv_lens):
    """Row ``i = hq * Lq + t`` of sequence ``b``: its chunks merged by lse, in chunk order,
    with the weights of :func:`.merge.part_weights` (query head ``hq``'s sink logit, recipe
    ``r``, as one more part of output 0), written to its place in ``out`` and ``lse``
    (:func:`query_rows`)."""
    no_inline()  # as _chunk
    qb, q0, lq, _, _ = query_rows(kv_begin, kv_lens.shape[0], b, kv_lens[b], out.shape[1])
    ev = out.shape[3]
    h, t = i // lq, q0 + i % lq
    po, pl = _parts_of(part_out, part_lse, first, prow, b, ev)
    n_b = po.shape[0]
    sink = sink_logit(r, h)
    if n_b == 1 and sink == -np.inf:  # one chunk: already the result
        for d in range(ev):
            out[qb, t, h, d] = store(po[0, i, d], out)
        lse[qb, h, t] = pl[0, i]
        return
    w = np.empty(n_b, lse.dtype)
    lse[qb, h, t] = part_weights(pl, 0, n_b, i, sink, w)
    # Chunk by chunk into a row of sums, each element's adds in chunk order (a vector loop
    # over the elements: element by element over the chunks, the loop over the chunks stayed
    # scalar, ~2 ns a number, 0.13 ms of a 16-chunk MHA D128 call).
    acc = np.zeros(ev, lse.dtype)
    for c in range(n_b):
        wc = w[c]
        if wc != 0:  # a chunk of weight 0 is skipped, as merge_attention_states does
            pc = po[c, i]
            for d in range(ev):
                acc[d] += wc * pc[d]
    for d in range(ev):
        out[qb, t, h, d] = store(acc[d], out)


#: The keys each sequence's kernel reads: the problem layer's rule
#: (:func:`sdpa_numba.problem.kvcache.key_bounds_loop`), the host's bounds, compiled here.
_key_bounds = njit(**INLINE)(key_bounds_loop(key_range, leftpad, query_rows))


@njit(**INLINE)
def _plan(kv_lens, kv_begin, r, lq):
    """``(first, lo, hi)``: the keys ``[lo[b], hi[b])`` any query token of sequence ``b`` sees
    (:data:`_key_bounds`), and ``first[b]``, the first task (chunk of those keys) of sequence
    ``b`` (``first[B]``: the number of tasks). Depends on the lengths only."""
    b_len = kv_lens.shape[0]
    first = np.empty(b_len + 1, np.int64)
    lo = np.empty(b_len, np.int64)
    hi = np.empty(b_len, np.int64)
    _key_bounds(r, kv_lens, kv_begin, lq, lo, hi)
    first[0] = 0
    for b in range(b_len):
        first[b + 1] = first[b] + n_chunks(hi[b] - lo[b])
    return first, lo, hi


@njit(**INLINE)
def _rows_plan(kv_lens, kv_begin, lq, hq, first):
    """``(prow, mrow)``: ``prow[b]``, the first partial row of sequence ``b``'s tasks (each
    has ``Hq * Lq_b`` rows; ``prow[B]``: all) and ``mrow[b]``, its first row to merge
    (``mrow[B] = Hq * total_q``), for the tasks ``first`` of :func:`_plan`."""
    b_len = kv_lens.shape[0]
    prow = np.empty(b_len + 1, np.int64)
    mrow = np.empty(b_len + 1, np.int64)
    prow[0] = 0
    mrow[0] = 0
    for b in range(b_len):
        rows = hq * query_rows(kv_begin, b_len, b, kv_lens[b], lq)[2]
        prow[b + 1] = prow[b] + (first[b + 1] - first[b]) * rows
        mrow[b + 1] = mrow[b] + rows
    return prow, mrow


@njit(**INLINE)
def _partials(prow, out, lse):
    """``(part_out, part_lse)``: the tasks' partial results, unwritten, in the compute dtype,
    flat: ``prow[-1] * Ev`` and ``prow[-1]`` numbers (:func:`_parts_of`'s views)."""
    return (np.empty(prow[-1] * out.shape[3], lse.dtype), np.empty(prow[-1], lse.dtype))


#: _task that reports a user function's exception (see .tasks).
_run_task = task_runner(_task)


@njit(parallel=True, **KERNEL)
def decode(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, out, lse, recipe=None,
           kv_begin=None, quant=None):
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
    recipe : None or Recipe, optional
        The variants (:func:`sdpa_numba.score.recipe.recipe`), in the cache's frame: token
        ``t`` is row ``i = kv_lens[b] - Lq + t`` (plus the recipe's ``offset``, which the
        public layer leaves 0), key ``j`` is ``j``; ``b`` the batch index, ``h`` the query
        head. ALiBi slopes and sinks in the compute dtype; no block mask. None: plain.
    kv_begin : None or ndarray of int64, shape (B,) or (6 * B,), optional
        The first key of each sequence (left padding, ``<= kv_lens[b]``): keys before it are
        neither read nor attended. None: 0. Of ``6 * B`` entries, a ragged batch's table
        (:func:`sdpa_numba.problem.kvcache.ragged_table`): the left padding, then where each
        sequence's query rows are (``q`` and ``out`` then ``(1, total_q, Hq, E)`` views of
        the packed rows, ``lse`` ``(1, Hq, total_q)``), how many, the position of its first
        row and its recipe offset. A run-time array in one argument, so that ragged and
        rectangular batches share one compiled kernel (and this signature).
    quant : None or tuple, optional
        A quantized cache (:func:`quant_scores`, :func:`quant_pv`): the caches hold int8
        values or fp8 bits (as int8), and
        ``quant = (k_scale, v_scale, k_descale, v_descale, fmt)``, the
        scales ``(num_pages, page_size, H, n_blocks)`` (float32, or float16 as uint16), the
        descales ``(B, H)`` float32, ``fmt`` the format's code. None: float caches.

    Notes
    -----
    Storage: float32, float64, float16 as uint16 views, bfloat16 as int16 views; ``q``,
    ``out`` any strides. Arguments are trusted (see :func:`sdpa_numba.attention_with_kvcache`,
    which checks them). The result does not depend on the thread count, and equals
    :func:`decode_serial`'s bitwise.
    """
    rc = kernel_recipe(recipe, is_causal)
    first, lo, hi = _plan(kv_lens, kv_begin, rc, q.shape[1])
    prow, mrow = _rows_plan(kv_lens, kv_begin, q.shape[1], q.shape[2], first)
    n_tasks = first[-1]
    part_out, part_lse = _partials(prow, out, lse)
    # The recipe crosses into the parallel loops by address (see _llvm.stash).
    p_r = stash(rc)
    queue = task_queue()
    for _ in prange(n_tasks):
        r = unstash(p_r)
        t = next_task(queue, n_tasks)
        while t >= 0:
            if not _run_task(r, q, k_cache, v_cache, block_table, kv_lens, r, scale, first,
                            lo, hi, t, part_out, part_lse, quant, kv_begin, prow):
                record_failure(queue, t)
            t = next_task(queue, n_tasks)
    t = failed_task(queue)
    if t >= 0:  # a user function raised in the loop: again here, where it reaches the caller
        _task(q, k_cache, v_cache, block_table, kv_lens, rc, scale, first, lo, hi, t, part_out,
              part_lse, quant, kv_begin, prow)
        raise_lost()
    for br in prange(mrow[-1]):
        r = unstash(p_r)
        b = np.searchsorted(mrow, br, side="right") - 1
        _merge(first, part_out, part_lse, out, lse, b, br - mrow[b], r, prow, kv_begin,
               kv_lens)
    keep_alive(rc)


@njit(**KERNEL)
def decode_serial(q, k_cache, v_cache, block_table, kv_lens, is_causal, scale, out, lse,
                  recipe=None, kv_begin=None, quant=None):
    """:func:`decode` on the calling thread (the same arguments; bitwise the same result)."""
    r = kernel_recipe(recipe, is_causal)
    first, lo, hi = _plan(kv_lens, kv_begin, r, q.shape[1])
    prow, mrow = _rows_plan(kv_lens, kv_begin, q.shape[1], q.shape[2], first)
    part_out, part_lse = _partials(prow, out, lse)
    for t in range(first[-1]):
        _task(q, k_cache, v_cache, block_table, kv_lens, r, scale, first, lo, hi, t,
              part_out, part_lse, quant, kv_begin, prow)
    for b in range(kv_lens.shape[0]):
        for i in range(mrow[b + 1] - mrow[b]):
            _merge(first, part_out, part_lse, out, lse, b, i, r, prow, kv_begin, kv_lens)
