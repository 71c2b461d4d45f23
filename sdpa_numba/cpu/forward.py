"""The attention forward on the CPU, FlashAttention-2 style.

Work is split into tasks of (batch, head, chunk of query rows), which the threads take from
a shared queue. Each task packs its queries once (transposed, scaled, in the compute dtype),
then streams key/value blocks of ``BN`` keys:
it packs the block (a full block is read in place when its rows are already in the compute
dtype, and for V when its rows are not a multiple of SET_STRIDE bytes apart), and for each
sub-block of ``BM`` query rows computes the transposed score tile ``Sᵀ = K Qᵀ`` (BN x BM) with
the register-tiled passes of :func:`.microkernel.register_passes`, applies masks, runs the
online softmax and accumulates the transposed output ``Oᵀ += Vᵀ Pᵀ`` (Ev x BM) with the same register
passes, one factor of alpha per column (:func:`.microkernel.register_passes`). Memory per task
is O(chunk · (E + Ev) + BN · (E + Ev)); nothing of size L x S exists.

Why the transposed tiles: with queries along the vector lanes, the softmax's row max and row
sum become lane-wise max and add over keys, so every step of it vectorizes (a horizontal
max reduction would not: without the ``nnan`` flag LLVM keeps it scalar). In P·V, the same
layout reads Pᵀ as the softmax left it and V by broadcasts: V needs no alignment and Ev no
padding to whole vectors (only to a multiple of 4), and the rescaling by alpha is lane-wise.

Each query row is reduced by one task, over key blocks in a fixed order, with arithmetic that
does not depend on the row's place in its tile: the output is bitwise the same for any thread
count.
"""

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._llvm import (by_symbol, data_ptr, keep_alive, no_inline, prefer_512_bit, ptr_add,
                    stack_buffer, stash, unstash)
from .dropout import drop_tile, head_dropout
from .exp2 import exp2
from .from_python import one_type_per_argument
from .lazy import Lazy
from .microkernel import LANE_CHUNK, MR_WIDE, NR, register_passes
from .online_softmax import LOG2E
from .pair_scores import (all_flags, flag, pack_key_pairs, pack_query_pairs, pair_buffer,
                          pair_flags, pair_scores)
from .options import CALLED, FASTMATH, INLINE, JITTED_ONLY, KERNEL
from .scale_fold import split_power, times
from .scratch import LINE, aligned_empty
from ..score.blocks import K_BLOCK, Q_BLOCK
from ..score.numbers import cast
from ..score.recipe import (absent, BLOCK_EMPTY, BLOCK_PARTIAL, block_state, capped_score,
                            fold_sink, has_element_mask, in_one_chunk, kernel_recipe,
                            key_range, modifies_capped, modifies_scores, query_range,
                            sink_logit, user_keeps, window_covers)
from .storage import is_compute_dtype, load, store
from .tanh import scaled_tanh
from .tasks import (failed_task, next_task, raise_lost, record_failure, task_runner,
                    task_queue)

#: Keys per key/value block: the block masks' (block states are read per BM x BN tile).
BN = K_BLOCK
#: Query rows per score tile: the micro-kernel's width, queries along the vector lanes.
BM = NR
if BM != Q_BLOCK:  # a tile would read the state of a block mask's block it does not match
    raise ImportError(f"the CPU forward's query tile (BM = NR = {BM}) must be the block "
                      f"masks' query block (sdpa_numba.score.blocks.Q_BLOCK = {Q_BLOCK})")

#: V rows this many bytes apart (or a multiple) share few L1 sets: read down their columns, 64
#: rows per tile, they evicted each other (P·V at D = 128 float32: 164 GFLOP/s with rows 512
#: bytes apart, 171 at 576, 151 at 1024, 172 at 256). Such V is packed, with a padded stride.
SET_STRIDE = 512

#: Query rows per task, at most. A task packs every key/value block it reads once for all of
#: its rows and streams K and V through the caches once: 512 rows measured 2.5-4.5% faster
#: than 256 on one core at D = 64 and D = 128 (1024: no better at D = 64).
CHUNK = 512
#: Bytes of a task's packed queries and accumulator, at most (chunks are halved to fit): they
#: are swept once per key/value block and should stay in L2 (1-2 MiB per core on current
#: server CPUs). 512 KiB keeps CHUNK rows for float32 up to E = Ev = 128.
SCRATCH_BYTES = 512 * 1024
#: Tasks a launch is split into, at least, where the rows allow: chunks are halved (down to
#: BM rows) until there are this many, so that every core gets several tasks.
MIN_TASKS = 16

#: Key blocks whose P·V and row sums are added into the running ``acc`` and ``l`` before
#: those are folded into a second, outer total, at least; see :func:`_fold_every`.
MIN_FOLD_BLOCKS = 64

_lanes = stack_buffer(BM)

_CALLED_J = {**CALLED, **JITTED_ONLY}


def masked_score(s, x):
    """Score ``s`` (natural units) under mask element ``x`` (jitted code only)."""
    raise NotImplementedError("masked_score is only callable from jitted code")


@overload(masked_score, fastmath=FASTMATH)
def _masked_score(s, x):
    if isinstance(x, types.Boolean):  # True takes part
        return lambda s, x: s if x else cast(-np.inf, s)
    # Additive. Any finite mask value gives a finite score (np.finfo(np.float32).min is
    # Hugging Face's "masked"): only -inf masks.
    return lambda s, x: s + load(x)


@njit(**INLINE)
def _pack_row(src, i, n, dst, scale):
    """dst[0:n] = scale * src[i, 0:n] in the compute dtype; a contiguous fast path.

    Strides are in bytes and need not be multiples of the item size (a field of a structured
    array): the fast path counts in elements, so it is taken only when they are."""
    if src.strides[1] == src.itemsize and src.strides[0] % src.itemsize == 0:
        p = ptr_add(data_ptr(src), i * (src.strides[0] // src.itemsize))
        for e in range(n):
            dst[e] = load(p[e]) * scale
    else:
        for e in range(n):
            dst[e] = load(src[i, e]) * scale


@njit(**INLINE)
def _pack_queries(q, i0, n, n_pad, scale, qt):
    """qt holds, per sub-block of BM rows, Qᵀ (E x BM) scaled; padding rows are zeros.

    Written along qt's rows (contiguous stores, strided loads): along q's rows, with the
    stores BM elements apart, it took 2.2x as long (41 against 18.5 us for 512 rows, E = 128).
    """
    e_len = q.shape[1]
    for r0 in range(0, n_pad, BM):
        blk = ptr_add(data_ptr(qt), r0 * e_len)
        rows = min(BM, n - r0)
        for e in range(e_len):
            for rr in range(rows):
                blk[e * BM + rr] = load(q[i0 + r0 + rr, e]) * scale
            for rr in range(rows, BM):
                blk[e * BM + rr] = 0


@njit(**INLINE)
def _pack_kv(k, v, j0, nj, ks, vs, ldvs, one, pack_k, pack_v):
    """K block into ks (BN x E) and V block into vs (BN rows of ``ldvs``), where asked.

    K rows past ``nj`` are read only by the last score tile, whose scores for them are
    discarded. V rows past ``nj`` meet p = 0: they are zeroed, so that no NaN or denormal
    garbage enters. (So are vs's columns past Ev, once, when vs is made: they are
    accumulated but never output, and only rows past ``nj`` are written there.)
    """
    e_len = k.shape[1]
    ev = v.shape[1]
    p_ks, p_vs = data_ptr(ks), data_ptr(vs)
    for j in range(nj):
        if pack_k:
            _pack_row(k, j0 + j, e_len, ptr_add(p_ks, j * e_len), one)
        if pack_v:
            _pack_row(v, j0 + j, ev, ptr_add(p_vs, j * ldvs), one)
    if pack_v:
        for t in range(nj * ldvs, BN * ldvs):
            vs[t] = 0


def block_start(a, i, ld, packed, in_place):
    """Pointer to row ``i`` of ``a`` (row stride ``ld``) if ``in_place``, else ``packed``
    (jitted code only)."""
    raise NotImplementedError("block_start is only callable from jitted code")


@overload(block_start)
def _block_start(a, i, ld, packed, in_place):
    if a.dtype != packed.dtype:  # float16 storage: always packed
        return lambda a, i, ld, packed, in_place: packed
    return lambda a, i, ld, packed, in_place: (ptr_add(data_ptr(a), i * ld) if in_place
                                               else packed)


@njit(**INLINE)
def _row_stride(a, like, n_cols):
    """The row stride of ``a`` in elements if whole blocks of it can be read in place by the
    tile products, else 0 (then blocks are packed): rows of ``n_cols`` contiguous elements
    of the compute dtype of ``like`` and a positive row stride. Both K and V are read by
    broadcast loads, so no alignment is needed."""
    if not is_compute_dtype(a, like) or a.strides[1] != a.itemsize or a.shape[1] != n_cols:
        return 0
    if a.strides[0] <= 0 or a.strides[0] % a.itemsize != 0:
        return 0
    return a.strides[0] // a.itemsize


@njit(**INLINE)
def _mask_tile(st, n_keys, i_first, n_real, j0, mask, r, b, h, window, element):
    """Mask the first ``n_keys`` rows of Sᵀ (BN x BM): the recipe's window (and causality)
    where ``window``, the user's ``attn_mask`` (bool: True takes part; float: added), and the
    recipe's ``mask_mod`` where ``element``.

    Query lanes at or past ``n_real`` are padding: no mask is read for them (the window may
    write -inf there: they are never output).
    """
    neg_inf = cast(-np.inf, st)
    for j in range(n_keys):
        row = ptr_add(data_ptr(st), j * BM)
        jj = j0 + j
        if window:
            # The lanes (rows i_first + i) that see key jj: the window's query range, clamped
            # to the tile's BM lanes.
            i_begin, i_end = query_range(r, jj, jj, i_first + BM)
            for i in range(min(max(i_begin - i_first, 0), BM)):
                row[i] = neg_inf
            for i in range(max(i_end - i_first, 0), BM):
                row[i] = neg_inf
        if mask is not None:
            for i in range(n_real):
                row[i] = masked_score(row[i], mask[i_first + i, jj])
        if element:
            for i in range(n_real):
                if not user_keeps(r, b, h, i_first + i, jj):
                    row[i] = neg_inf


@njit(**_CALLED_J)
def _modify_tile(st, n_keys, n_real, r, b, h, i_first, j0):
    """The recipe's modified scores (:func:`sdpa_numba.score.recipe.modified_score`: soft cap,
    ALiBi, score_mod, in that order) on the first ``n_keys`` rows of Sᵀ, real lanes.

    The soft cap is the seam's ``c · tanh(s / c)`` with the vectorizable
    :func:`.tanh.scaled_tanh` over the whole tile (``math.tanh`` is a scalar call here), by
    :func:`_cap_pass` compiled on its first use; the tile holds ``s / c`` then
    (:func:`attend_rows` folds ``1 / c`` into the packed queries).
    What follows the cap is the seam's :func:`~sdpa_numba.score.recipe.capped_score`,
    element by element.
    """
    no_inline()
    prefer_512_bit()
    if r.softcap > 0:  # compiled on its first use (see _capped_tiles)
        _call_capped(st, 0, n_keys, st, st, st, cast(r.softcap, st[0]), 0, 0, 0)
    if modifies_capped(r):
        for j in range(n_keys):
            row = ptr_add(st, j * BM)
            for i in range(n_real):
                row[i] = capped_score(r, row[i], b, h, i_first + i, j0 + j)


def _modify(st, n_keys, n_real, r, b, h, i_first, j0):
    """:func:`_modify_tile`, or for a recipe whose type has no ALiBi nor score_mod (modified
    only by its soft cap, a runtime value) the soft cap's pass alone, so that the plain
    kernel compiles no _modify_tile (jitted code only)."""
    raise NotImplementedError("_modify is only callable from jitted code")


@overload(_modify, **_CALLED_J)
def _ol_modify(st, n_keys, n_real, r, b, h, i_first, j0):
    if not (absent(r, "alibi") and absent(r, "score_mod")):
        return lambda st, n_keys, n_real, r, b, h, i_first, j0: _modify_tile(
            st, n_keys, n_real, r, b, h, i_first, j0)

    def cap_only(st, n_keys, n_real, r, b, h, i_first, j0):
        if r.softcap > 0:
            _call_capped(st, 0, n_keys, st, st, st, cast(r.softcap, st[0]), 0, 0, 0)

    return cap_only


def _softmax_variant(capped):
    """The online softmax's tile pass, :func:`_softmax_tile`; ``capped``: with the soft cap
    (compiled on its first use, see :func:`_capped_tiles`), else without its code."""

    def softmax_tile(st, n_keys, m, l, alpha, cap, window, w_lo, w_hi):
        """Online softmax over the first ``n_keys`` rows of Sᵀ; lanes are query rows.

        Overwrites scores with p = exp(s - m_new) (and the rows past ``n_keys`` with 0) and
        updates ``m``, ``l``, ``alpha`` (pointers to BM lanes). ``cap > 0`` soft-caps the scores
        first, in the pass that finds their maximum: the tile then holds ``s / cap`` and becomes
        ``cap · tanh(s / cap)``; the caller passes it only for tiles that nothing else modifies
        (soft cap comes first in the score's order). 0 leaves the scores as they are.
        ``window``: that pass also masks (to -inf, after the soft cap) the scores of lane ``i``,
        tile row ``j`` with ``i - j`` outside ``[w_lo, w_hi]`` (the window's band, see
        :func:`attend_rows`); the caller passes it only for tiles that nothing else masks.

        Scores and ``m`` are in natural units; only the differences ``s - m_new <= 0`` are
        converted to base 2 for :func:`exp2`. Converting the scores themselves (folding log2(e)
        into the scale) would overflow for finite scores beyond FLT_MAX / log2(e) (a mask of
        np.finfo(np.float32).min became -inf, a fully masked row); a difference that overflows
        is below -FLT_MAX and its exponential is 0 anyway.
        """
        no_inline()  # as the tile products: a call of its own
        prefer_512_bit()
        if plain:  # (pruned at compile time: a constant)
            if cap > 0:
                _call_capped(st, 1, n_keys, m, l, alpha, cap, 1 if window else 0, w_lo, w_hi)
                return
        # The lane state is worked on in stack buffers and copied in and out: LLVM cannot prove
        # that the pointers m, l and alpha don't overlap, and kept the loops over them scalar
        # (64 scalar exp2 per tile for alpha alone); a private alloca overlaps nothing.
        m_old = _lanes(m)
        m_new = _lanes(m)
        m_use = _lanes(m)
        total = _lanes(m)
        a = _lanes(m)
        l_new = _lanes(m)
        for i in range(BM):
            m_old[i] = m[i]
        for i in range(BM):
            m_new[i] = m_old[i]
        if window:
            # The band test in the max pass, lane-wise: a pass of its own (_mask_tile, scalar
            # stores over a varying number of lanes per row) cost more than the test. Lane numbers
            # as floats compare in the scores' vector width; the bounds are small integers
            # (clamped by the caller), exact in any float type.
            lane = _lanes(m)
            for i in range(BM):
                lane[i] = i
            neg_inf = cast(-np.inf, m_old[0])
            for j in range(n_keys):
                row = ptr_add(st, j * BM)
                lo = cast(w_lo + j, m_old[0])
                hi = cast(w_hi + j, m_old[0])
                if capped and cap > 0:
                    for i in range(BM):
                        s = scaled_tanh(row[i], cap)
                        s = s if (lane[i] >= lo) & (lane[i] <= hi) else neg_inf
                        row[i] = s
                        m_new[i] = s if s > m_new[i] else m_new[i]
                else:
                    for i in range(BM):
                        s = row[i] if (lane[i] >= lo) & (lane[i] <= hi) else neg_inf
                        row[i] = s
                        m_new[i] = s if s > m_new[i] else m_new[i]
        elif capped and cap > 0:
            # Fused into the max pass: a pass of its own over the tile (which the tile products'
            # operands push out of L1) cost twice as much.
            for j in range(n_keys):
                row = ptr_add(st, j * BM)
                for i in range(BM):
                    s = scaled_tanh(row[i], cap)
                    row[i] = s
                    m_new[i] = s if s > m_new[i] else m_new[i]
        else:
            for j in range(n_keys):
                row = ptr_add(st, j * BM)
                for i in range(BM):
                    m_new[i] = row[i] if row[i] > m_new[i] else m_new[i]
        c = cast(LOG2E, m_old[0])
        for i in range(BM):
            # All masked so far: exponentiate against 0, so p = alpha = 0 instead of NaN.
            m_use[i] = m_new[i] if m_new[i] != -np.inf else cast(0.0, m_new[i])
            a[i] = exp2((m_old[i] - m_use[i]) * c)
            total[i] = 0
        for j in range(n_keys):
            row = ptr_add(st, j * BM)
            for i in range(BM):
                p = exp2((row[i] - m_use[i]) * c)
                row[i] = p
                total[i] += p
        for i in range(BM):
            l_new[i] = a[i] * l[i] + total[i]
        for i in range(BM):
            l[i] = l_new[i]
        for i in range(BM):
            m[i] = m_new[i]
        for i in range(BM):
            alpha[i] = a[i]
        # P·V always runs over all BN keys: a constant trip count keeps its accumulator in
        # registers (a runtime one measured 4x slower), so keys past n_keys get p = 0.
        for t in range(n_keys * BM, BN * BM):
            st[t] = 0

    plain = not capped
    softmax_tile.__name__ = softmax_tile.__qualname__ = (
        "_capped_softmax_tile" if capped else "_softmax_tile")
    return softmax_tile


#: The softmax tile pass of every call: a soft cap's passes are called through _call_capped.
_softmax_tile = njit(**_CALLED_J)(_softmax_variant(False))
#: The same with the soft cap, compiled on its first use (see _capped_tiles).
_capped_softmax_tile = njit(**_CALLED_J)(_softmax_variant(True))


@njit(**_CALLED_J)
def _cap_pass(st, n, c):
    """``st[0:n] = c · tanh(st[0:n])`` (the tile holds ``s / c``): the soft cap of a tile
    that something else also modifies or masks (see :func:`_modify_tile`)."""
    no_inline()
    prefer_512_bit()
    for t in range(n):
        st[t] = scaled_tanh(st[t], c)


def _capped_tiles(st, mode, n_keys, m, l, alpha, cap, window, w_lo, w_hi):
    """The soft cap's tile passes, compiled on their first use (a call with a soft cap, or
    :func:`ensure_soft_cap`) instead of with every kernel: mode 0, the cap alone over the first
    ``n_keys`` rows of Sᵀ (:func:`_cap_pass`; the other pointers unused); mode 1, the softmax
    pass with the cap fused into its max pass (:func:`_softmax_tile`'s arguments; ``window``
    0 or 1). Soft cap is a runtime parameter of the one kernel that plain, windowed and
    soft-capped calls share, whose first call compiled these passes, ~0.6 s of CPU, for every
    user (scripts/cold_start.py --events)."""
    if mode == 0:
        _cap_pass(st, n_keys * BM, cap)
    else:
        _capped_softmax_tile(st, n_keys, m, l, alpha, cap, window != 0, w_lo, w_hi)


def _capped_signature(dt):
    p = types.CPointer(dt)
    i = types.int64
    return types.void(p, i, i, p, p, p, dt, i, i, i)


#: :func:`_capped_tiles` for float32 and float64 tiles, through a cell of this process (the
#: name's version changes with the form of the cells' symbols, see .lazy.Lazy).
_CAPPED = Lazy("forward.capped_tiles.v2", [_capped_signature(types.float32),
                                        _capped_signature(types.float64)],
               lambda: _capped_tiles)
_call_capped = _CAPPED.call


def ensure_soft_cap(compute_dtype):
    """Compile (or load from the cache) the soft cap's tile passes for a compute dtype
    (``np.float32`` or ``np.float64``) ahead of a launch that needs them, so that no thread
    of the launch enters their first-call trampoline (see :mod:`.lazy`)."""
    _CAPPED.compile(*_capped_signature(types.float64 if np.dtype(compute_dtype) == np.float64
                                       else types.float32).args)


def _scores(kb, ldk, e_len, qt, st, n_keys, lanes):
    """Sᵀ = K Qᵀ for the first ``n_keys`` keys of a block (rounded up to whole tiles), in the
    first ``lanes`` query lanes (a multiple of LANE_CHUNK; BM: all).

    ``kb`` BN x E (row stride ``ldk``), ``qt`` E x BM (a sub-block of packed queries), ``st``
    BN x BM (jitted code only).
    """
    raise NotImplementedError("_scores is only callable from jitted code")


@overload(_scores, **_CALLED_J)
def _ol_scores(kb, ldk, e_len, qt, st, n_keys, lanes):
    # The register passes, picked here by type (see microkernel.register_passes: compiled
    # once).
    tile = register_passes(kb.dtype, False, False, False)

    def scores(kb, ldk, e_len, qt, st, n_keys, lanes):
        # The tile products are compiled as calls of their own (here and in _accumulate):
        # inlined into attend_rows, LLVM kept the 6-row P·V accumulator in memory.
        no_inline()
        prefer_512_bit()
        for jt in range(0, n_keys, MR_WIDE):
            # The last tile of a block overlaps the one before (it starts at BN - MR_WIDE): a
            # score is only written, so computing some twice changes nothing, and the one tile
            # shape compiles once (a remainder tile doubled this function's compile time).
            j = min(jt, BN - MR_WIDE)
            tile(ptr_add(kb, j * ldk), ldk, 1, qt, BM, ptr_add(st, j * BM), BM, e_len, None,
                 MR_WIDE, lanes)

    return scores


@njit(**INLINE)
def _acc_rows(ev):
    """Rows of the transposed accumulator: ``ev`` rounded up to whole tiles of MR_WIDE or 4
    rows (a multiple of 4)."""
    return (ev + 3) // 4 * 4


@njit(**INLINE)
def _few_sets(ld, itemsize):
    """Whether rows ``ld`` elements apart are a multiple of SET_STRIDE bytes apart."""
    return ld * itemsize % SET_STRIDE == 0


@njit(**INLINE)
def _packed_stride(ev_pad, itemsize):
    """Row stride (elements) of packed V blocks: ``ev_pad``, one cache line more if that
    would put rows a multiple of SET_STRIDE bytes apart."""
    if _few_sets(ev_pad, itemsize):
        return ev_pad + LINE // itemsize
    return ev_pad


def _accumulate(pt, vb, ldv, ev_pad, acc, alpha):
    """accᵀ = accᵀ diag(alpha) + Vᵀ Pᵀ for one sub-block: ``pt`` is Pᵀ (BN x BM), ``vb`` BN x
    ev_pad (row stride ``ldv``), ``acc`` is accᵀ, ev_pad x BM, all row-major (jitted code
    only).

    Queries on the lanes, as in the score tiles: V is read by broadcasts, so its rows need
    no alignment and full blocks are read in place whatever their address.
    """
    raise NotImplementedError("_accumulate is only callable from jitted code")


@overload(_accumulate, **_CALLED_J)
def _ol_accumulate(pt, vb, ldv, ev_pad, acc, alpha):
    # the passes with one factor of alpha per column, picked here by type (see _ol_scores).
    tile = register_passes(pt.dtype, True, True, True)

    def accumulate(pt, vb, ldv, ev_pad, acc, alpha):
        no_inline()
        prefer_512_bit()
        # All BM lanes, even for a partial sub-block (unlike the scores): with the constant
        # trip count over BN keys, LLVM reorders the whole tile's sums over keys (fast-math
        # reassoc), and the narrowed tile's chunks, summed in written order, gave other last
        # bits (measured). Lanes past the real rows hold finite values, whose P·V is never
        # output. ev_pad is a multiple of 4: what the 6-row tiles leave is done in 4-row tiles
        # (two of them in place of the last 6-row tile when 2 rows are left).
        rest = ev_pad % MR_WIDE
        n_six = max(ev_pad - rest - (MR_WIDE if rest == 2 else 0), 0)
        for d0 in range(0, n_six, MR_WIDE):
            tile(ptr_add(vb, d0), 1, ldv, pt, BM, ptr_add(acc, d0 * BM), BM, BN, alpha,
                 MR_WIDE)
        for d0 in range(n_six, ev_pad, 4):
            tile(ptr_add(vb, d0), 1, ldv, pt, BM, ptr_add(acc, d0 * BM), BM, BN, alpha, 4)

    return accumulate


@njit(**INLINE)
def _fold_every(s_len):
    """Key blocks between folds of the running totals into the outer ones: a power of two at
    least sqrt(blocks) and MIN_FOLD_BLOCKS (S > 4096 keys only), from S alone.

    Each block's P·V starts from zero (see the micro-kernel), but the running total still takes
    one block sum at a time: at S = 2**25 (2**19 blocks) with equal scores that alone was 7e-3
    off in float32. Two levels of about sqrt(blocks) terms each keep it near 1e-5. The fold
    points depend on S only, and a fold between blocks that add nothing to a row changes
    nothing in it (alpha = 1, p = 0, then 1 * outer + 0), so rows are bitwise the same whatever
    the chunking or the thread count.
    """
    n = (s_len + BN - 1) // BN
    f = MIN_FOLD_BLOCKS
    while f * f < n:
        f *= 2
    return f


@njit(**INLINE)
def _fold(n_pad, ev_pad, acc, m, l, acc_o, m_o, l_o):
    """Fold the running ``acc``, ``l`` (against max ``m``) into the outer ``acc_o``, ``l_o``
    (against ``m_o``), and restart the running ones from zero (accᵀ layout, see attend_rows)."""
    c = cast(LOG2E, l)
    beta = _lanes(data_ptr(m))
    for r0 in range(0, n_pad, BM):
        for i in range(BM):
            mi = m[r0 + i]
            mu = mi if mi != -np.inf else cast(0.0, mi)
            beta[i] = exp2((m_o[r0 + i] - mu) * c)  # 0 while m_o is -inf
        for i in range(BM):
            l_o[r0 + i] = beta[i] * l_o[r0 + i] + l[r0 + i]
            l[r0 + i] = 0
            m_o[r0 + i] = m[r0 + i]
        for d in range(ev_pad):
            t0 = r0 * ev_pad + d * BM
            for i in range(BM):
                acc_o[t0 + i] = beta[i] * acc_o[t0 + i] + acc[t0 + i]
                acc[t0 + i] = 0


@njit(**INLINE)
def _pack_float_queries(q, i0, n, n_pad, c, qt, like):
    """Pack query rows ``[i0, i0 + n)`` into ``qt`` times ``c`` (see :func:`_pack_queries`);
    returns the factor ``w`` the scores are multiplied by (1, or a power of two for queries
    that overflowed, see :mod:`.scale_fold`)."""
    _pack_queries(q, i0, n, n_pad, cast(c, like), qt)
    # Queries that overflowed with c are packed with c / w, the scores then times w.
    w = split_power(data_ptr(qt), n_pad * q.shape[1], c)
    if w != 1:
        _pack_queries(q, i0, n, n_pad, cast(c / w, like), qt)
    return w


@one_type_per_argument  # fill True and False: one compile, not one per literal
@njit(**_CALLED_J)
def _scratch(n, fill, value, like):
    """A scratch array of ``n`` elements of ``like``'s dtype that starts a cache line
    (:func:`.scratch.aligned_empty`), all ``value`` if ``fill``.

    A call of its own, compiled once: :func:`attend_rows` makes eleven, and each inlined
    allocation and fill was a copy of their code to compile (compile time, see
    scripts/cold_start.py --events).
    """
    a = aligned_empty(n, like.dtype)
    if fill:
        a[:] = value
    return a


@njit(**KERNEL, **JITTED_ONLY)
def attend_rows(q, k, v, mask, r, scale, out, lse, i0, i1, dropout=None, b=0, h=0):
    """Attention of query rows ``[i0, i1)`` of one head; writes ``out[i0:i1]``, ``lse[i0:i1]``.

    ``q`` (L, E), ``k`` (S, E), ``v`` (S, Ev), ``mask`` None or (L, S) (bool: True takes part;
    float: added), ``r`` the :class:`~sdpa_numba.score.recipe.Recipe` (causality already in
    its right side), ``out`` (L, Ev), ``lse`` (L,) whose dtype is the compute dtype.
    ``dropout``: None, or this head's state from :func:`~sdpa_numba.cpu.dropout.head_dropout`.
    ``b``, ``h``: the launch's batch index and the query head, as the recipe's functions see
    them. ``i0`` must be a multiple of BM (block-mask states are per BM x BN block).

    Work: key blocks of BN keys aligned to multiples of BN, from the first to the last key
    any row of ``[i0, i1)`` sees under the window (:func:`~sdpa_numba.score.recipe.key_range`);
    per sub-block of BM rows, the keys of a block past the sub-block's range are cut off the
    tile, blocks the block mask says are empty are skipped, and masks are applied per element
    only where the window does not cover the tile or the recipe masks per element.
    """
    s_len, e_len = k.shape
    ev = v.shape[1]
    n = i1 - i0
    n_pad = (n + BM - 1) // BM * BM
    ev_pad = _acc_rows(ev)
    qt = _scratch(max(n_pad * e_len, 1), False, 0.0, lse)
    ks = _scratch(max(BN * e_len, 1), False, 0.0, lse)
    ldvs = _packed_stride(ev_pad, lse.itemsize)
    vs = _scratch(max(BN * ldvs, 1), True, 0.0, lse)
    # Zeroed: a partial sub-block's score tiles leave its lanes past ``lanes`` as they were,
    # and the passes over all lanes (softmax, soft cap, dropout, P·V) should meet no garbage
    # there (their results in those lanes are never output).
    st = _scratch(BN * BM, True, 0.0, lse)
    acc = _scratch(max(n_pad * ev_pad, 1), True, 0.0, lse)
    m = _scratch(n_pad, True, -np.inf, lse)
    l = _scratch(n_pad, True, 0.0, lse)
    alpha = _scratch(n_pad, False, 0.0, lse)
    # Outer totals (see _fold_every), for long sequences only.
    fold_every = _fold_every(s_len)
    folds = s_len > fold_every * BN
    acc_o = _scratch(n_pad * ev_pad if folds else 1, True, 0.0, lse)
    m_o = _scratch(n_pad, True, -np.inf, lse)
    l_o = _scratch(n_pad, True, 0.0, lse)
    # A soft cap c takes the scores as s / c: its 1 / c is folded into the queries' scale
    # (one multiply per query element instead of one per score).
    c = scale if r.softcap <= 0 else scale / r.softcap
    # bfloat16 scores by vdpbf16ps (see .pair_scores): qp and kp are None for other storage
    # dtypes and CPUs, and pairs is then False at compile time.
    qp = pair_buffer(q, n_pad * e_len)
    kp = pair_buffer(q, BN * e_len)
    q_ok = pair_flags(q, n_pad // BM)
    pairs = qp is not None and e_len % 2 == 0
    p_qt, p_ks, p_vs, p_st = data_ptr(qt), data_ptr(ks), data_ptr(vs), data_ptr(st)
    j_begin, kv_end = key_range(r, i0, i1 - 1, s_len)
    # Subnormal queries or keys, which vdpbf16ps reads as zeros, take the float32 path, per
    # tile of BM rows (aligned to multiples of BM) and BN keys, so that a row's bits depend on
    # its own tiles only, never on the rows its task shares (chunks depend on the shape).
    wants = True  # whether the float32 path's queries are needed whatever the keys
    pair_w = 1.0
    if pairs:
        # The pair scores are multiplied by pair_w: the part of c not folded into qp.
        pair_w = pack_query_pairs(q, i0, n, n_pad, c, qp, q_ok)
        wants = not all_flags(q_ok)
    # The float32 path's queries are packed in the first key block that needs them: one call
    # site of _pack_float_queries (each is a copy of its code to compile).
    packs = False  # whether they are packed
    score_w = cast(1.0, lse)
    p_acc, p_m, p_l, p_alpha = data_ptr(acc), data_ptr(m), data_ptr(l), data_ptr(alpha)
    one = cast(1.0, lse)
    # Full blocks of K and V are read in place when they are already rows of the compute
    # dtype (float32, float64 storage): packing them cost ~5% of the time. Both are read by
    # broadcasts, so their rows need no alignment; but V is read down its columns, 64 rows
    # per tile, and rows a multiple of SET_STRIDE bytes apart fall in few L1 sets.
    ldk = _row_stride(k, lse, e_len)
    ldv = _row_stride(v, lse, ev)
    if _few_sets(ldv, lse.itemsize):
        ldv = 0

    element = has_element_mask(r)
    blocked = r.block_mask is not None
    zero = cast(0.0, lse)
    softcap = cast(r.softcap, lse)
    for j0 in range(j_begin // BN * BN, kv_end, BN):
        nj = min(BN, kv_end - j0)
        k_in_place = ldk > 0 and nj == BN
        # Tiles read ev_pad - Ev (up to 3) elements past the end of the block's last row:
        # in place only if they are still inside V (rows may overlap: ldv < Ev).
        v_in_place = ldv > 0 and nj == BN and ev_pad - ev <= (s_len - j0 - BN) * ldv
        k_ok = pairs and pack_key_pairs(k, j0, nj, kp)
        if not packs and (wants or not k_ok):  # (not k_ok: a block of subnormal keys)
            w = _pack_float_queries(q, i0, n, n_pad, c, qt, lse)
            score_w = cast(w, lse)
            packs = True
        _pack_kv(k, v, j0, nj, ks, vs, ldvs, one, not k_in_place and packs, not v_in_place)
        p_kb = block_start(k, j0, ldk, p_ks, k_in_place)
        p_vb = block_start(v, j0, ldv, p_vs, v_in_place)
        ldkb = ldk if k_in_place else e_len
        ldvb = ldv if v_in_place else ldvs
        for r0 in range(0, n_pad, BM):
            i_first = i0 + r0
            i_last = min(i1, i_first + BM) - 1
            # Keys past the last one the sub-block's rows see are cut off the tile; a block
            # wholly before the first is skipped (keys inside it before the first are masked).
            lo, hi = key_range(r, i_first, i_last, s_len)
            n_keys = min(nj, hi - j0)
            if n_keys <= 0 or lo >= j0 + nj:
                continue
            state = block_state(r, b, h, i_first // BM, j0 // BN)
            if state == BLOCK_EMPTY:
                continue
            n_real = min(BM, n - r0)
            # Only the lanes of real rows (whole chunks of LANE_CHUNK) are computed in the
            # score tile; the softmax and P·V take all BM lanes (see _accumulate; a softmax
            # in chunks of LANE_CHUNK lanes, fully unrolled, gave other last bits in some rows
            # of the parallel kernel). The scores' lanes are bitwise unchanged.
            lanes = min(BM, (n_real + LANE_CHUNK - 1) // LANE_CHUNK * LANE_CHUNK)
            sw = score_w
            if k_ok and flag(q_ok, r0 // BM):
                pair_scores(k, j0, nj, kp, qp, r0, p_st, n_keys, lanes)
                sw = cast(pair_w, lse)
            else:
                _scores(p_kb, ldkb, e_len, ptr_add(p_qt, r0 * e_len), p_st, n_keys, lanes)
            if sw != 1:
                times(p_st, n_keys * BM, sw)
            in_window = window_covers(r, i_first, i_last, j0, j0 + n_keys - 1)
            per_element = element and (not blocked or state == BLOCK_PARTIAL)
            # A tile that only the window masks is masked in the softmax's first pass (a
            # chunk boundary inside the tile is masked per element).
            band = (not in_window and mask is None and not per_element
                    and in_one_chunk(r, i_first, i_last, j0, j0 + n_keys - 1))
            masked = mask is not None or (not in_window and not band) or per_element
            # A soft cap alone on an unmasked tile is done by the softmax's first pass.
            cap = zero
            if r.softcap > 0 and not masked and not modifies_capped(r):
                cap = softcap
            elif modifies_scores(r):
                _modify(p_st, n_keys, n_real, r, b, h, i_first, j0)
            if masked:
                _mask_tile(st, n_keys, i_first, n_real, j0, mask, r, b, h, not in_window,
                           per_element)
            # Lane i (row i_first + i), tile row j (key j0 + j) is in the window iff
            # -right <= (i_first + i + offset) - (j0 + j) <= left. i - j is within
            # (-BN, BM): bounds clamped past that keep the band and fit any float.
            d = i_first + r.offset - j0
            w_lo = min(max(-r.right - d, -BN - 1), BM + 1)
            w_hi = min(max(r.left - d, -BN - 1), BM + 1)
            _softmax_tile(p_st, n_keys, ptr_add(p_m, r0), ptr_add(p_l, r0),
                          ptr_add(p_alpha, r0), cap, band, w_lo, w_hi)
            # Dropout (a no-op when None): in P·V only; l keeps the undropped sum.
            drop_tile(p_st, BM, n_keys, dropout, i0 + r0, j0)
            _accumulate(p_st, p_vb, ldvb, ev_pad, ptr_add(p_acc, r0 * ev_pad),
                        ptr_add(p_alpha, r0))
        if folds:
            # A fold after every fold_every-th block, and the last one after the last block
            # (both after a block that is both): one call site of _fold (each is a copy of
            # its code to compile).
            n_folds = 1 if (j0 // BN + 1) % fold_every == 0 else 0
            if j0 + BN >= kv_end:
                n_folds += 1
            for _ in range(n_folds):
                _fold(n_pad, ev_pad, acc, m, l, acc_o, m_o, l_o)
    if folds:  # the totals are the outer ones (without key blocks: their zeros and -inf,
        # as the running ones', which a fold would have left so)
        acc, m, l = acc_o, m_o, l_o
        p_acc = data_ptr(acc)

    sink = sink_logit(r, h)
    for row in range(n):
        i = i0 + row
        # The head's sink joins the row's denominator (no value row): acc scales by alpha.
        # Without one, alpha is 1 and m, l are unchanged (alpha / l is 1 / l exactly).
        m_r, l_r, a_r = fold_sink(m[row], l[row], sink)
        if l_r == 0:  # every key masked (or S == 0), no sink: zeros and -inf, as torch
            lse[i] = -np.inf
            for d in range(ev):
                out[i, d] = store(0.0, out)
        else:
            inv = 1 / l_r
            inv = inv * a_r  # exact when a_r is 1 (no sink): dense output bits unchanged
            lse[i] = m_r + math.log(l_r)
            acc_r = ptr_add(p_acc, (row - row % BM) * ev_pad + row % BM)  # accᵀ's row
            for d in range(ev):
                out[i, d] = store(acc_r[d * BM] * inv, out)
    # Numba frees an array after its last use by name; the loops above used them through
    # raw pointers, so they must live until here.
    keep_alive((qt, ks, vs, st, acc, m, l, alpha, acc_o, m_o, l_o, qp, kp, q_ok))


#: attend_rows called by symbol: compiled once, not again in each of the parallel kernel's
#: layers (see _llvm.by_symbol).
_attend_rows_by_symbol = by_symbol(attend_rows)


@njit(**INLINE)
def _task_rows(e_len, ev, itemsize):
    """Query rows of a task whose scratch fits SCRATCH_BYTES: CHUNK halved, down to BM."""
    per_row = (e_len + _acc_rows(ev)) * itemsize
    rows = CHUNK
    while rows > BM and rows * per_row > SCRATCH_BYTES:
        rows //= 2
    return rows


@njit(**INLINE)
def _chunk_rows(n_heads, L, e_len, ev, itemsize):
    """Query rows per task: big chunks amortize K/V packing, small ones fill the cores.

    Depends on the shape only, never on the thread count. (A row's result does not depend on
    its chunk either: the choice is about speed only.)
    """
    chunk = _task_rows(e_len, ev, itemsize)
    while chunk > BM and n_heads * ((L + chunk - 1) // chunk) < MIN_TASKS:
        chunk //= 2
    return chunk


@njit(**_CALLED_J)  # not inline: called through a task runner (.tasks)
def _forward_task(q, k, v, mask, r, scale, out, lse, dropout, t, n_chunks, chunk):
    """Task ``t`` of :func:`forward`: one chunk of ``chunk`` query rows of one head, each
    head's ``n_chunks`` chunks numbered costliest (last) first."""
    hq, L = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    bh = t // n_chunks
    c = n_chunks - 1 - t % n_chunks
    b = bh // hq
    h = bh % hq
    i0 = c * chunk
    i1 = min(L, i0 + chunk)
    kh = h // group
    dh = head_dropout(dropout, b, h)
    if mask is None:
        _attend_rows_by_symbol(q[b, h], k[b, kh], v[b, kh], None, r, scale,
                               out[b, h], lse[b, h], i0, i1, dh, b, h)
    else:
        _attend_rows_by_symbol(q[b, h], k[b, kh], v[b, kh], mask[b, h], r, scale,
                               out[b, h], lse[b, h], i0, i1, dh, b, h)


#: _forward_task that reports a user function's exception (see .tasks).
_run_forward_task = task_runner(_forward_task)


def _prange_only():
    """Numba's parallel options with the ``prange`` loops alone made parallel: array
    expressions and NumPy calls stay serial (``task_queue``'s ``np.zeros(2)`` was a parallel
    loop of its own, with its own compiled gufunc and wrappers: ~0.1 s of a first call).
    A new dict each time: Numba consumes it."""
    return dict(prange=True, comprehension=False, reduction=False, inplace_binop=False,
                setitem=False, numpy=False, stencil=False, fusion=False)


@njit(parallel=_prange_only(), **KERNEL)
def forward(q, k, v, mask, is_causal, scale, out, lse, dropout=None, recipe=None):
    """Batched attention forward, parallel over batch x head x query chunk.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, L, E)
    k : ndarray, shape (B, H, S, E)
        ``Hq`` must be a multiple of ``H``; query head ``h`` reads key/value head
        ``h // (Hq // H)`` (grouped-query attention; ``H == Hq`` is plain attention).
    v : ndarray, shape (B, H, S, Ev)
    mask : None or ndarray, shape (B, Hq, L, S)
        bool (True takes part) or float of the storage dtype (added to the scores). Broadcast
        views with zero strides are read in place.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (top-left aligned; with a recipe: ``j <= i'``, its
        right side at most 0).
    scale : float
        Multiplies ``q · k``.
    out : ndarray, shape (B, Hq, L, Ev)
        Written.
    lse : ndarray, shape (B, Hq, L)
        Written; its dtype is the compute dtype (float32, or float64 for float64 storage).
    dropout : None or tuple, optional
        ``(seed, threshold, inv_keep, batch_offset)`` typed ``(uint64, uint64, float64,
        int64)``, as made by :func:`sdpa_numba.dropout.params`: drops probabilities of
        (batch ``batch_offset + b``, query head ``h``, row, key) with the counter-based stream
        of :mod:`sdpa_numba.dropout`, scaling kept ones by ``inv_keep``. None: no dropout.
    recipe : None or Recipe, optional
        The variants (:func:`sdpa_numba.score.recipe.recipe`: window, alignment, soft cap,
        ALiBi slopes and sinks in the compute dtype, score_mod / mask_mod with their
        mod_args, a block mask of BM x BN blocks). Its ``batch_offset`` is added to the
        batch index the recipe's functions see. None: plain attention (``is_causal`` alone).

    Notes
    -----
    Storage dtypes are float32, float64, and float16 passed as ``uint16`` views. Any strides.
    Arguments are trusted: the Python API validates them.
    """
    # The recipe crosses into the parallel loop by address (see _llvm.stash).
    p_r = stash(kernel_recipe(recipe, is_causal))
    b_len, hq, L, _ = q.shape
    chunk = _chunk_rows(b_len * hq, L, q.shape[3], out.shape[3], lse.itemsize)
    n_chunks = (L + chunk - 1) // chunk
    n_tasks = b_len * hq * n_chunks
    # Tasks from the queue (.tasks): head by head (a thread's next task mostly reads the same
    # K and V), each head's costliest chunk first (causal chunks cost more the later they
    # are), so that the last tasks taken are the cheapest.
    queue = task_queue()
    for _ in prange(n_tasks):
        r = unstash(p_r)
        t = next_task(queue, n_tasks)
        while t >= 0:
            if not _run_forward_task(r, q, k, v, mask, r, scale, out, lse, dropout, t,
                            n_chunks, chunk):
                record_failure(queue, t)
            t = next_task(queue, n_tasks)
    t = failed_task(queue)
    if t >= 0:  # a user function raised in the loop: again here, where it reaches the caller
        _forward_task(q, k, v, mask, unstash(p_r), scale, out, lse, dropout, t, n_chunks, chunk)
        raise_lost()


@njit(**KERNEL)
def forward_head(q, k, v, mask, is_causal, scale, out, lse, recipe=None, b=0, h=0):
    """Serial attention forward of one head, for callers that parallelize themselves.

    Parameters
    ----------
    q : ndarray, shape (L, E)
    k : ndarray, shape (S, E)
    v : ndarray, shape (S, Ev)
    mask : None or ndarray, shape (L, S)
        bool (True takes part) or float (added to the scores).
    is_causal : bool
    scale : float
    out : ndarray, shape (L, Ev)
        Written.
    lse : ndarray, shape (L,)
        Written; its dtype is the compute dtype.
    recipe : None or Recipe, optional
        The variants, as for :func:`forward`.
    b, h : int, optional
        The batch index and query head this head is, as the recipe's ALiBi slopes, sinks,
        score_mod, mask_mod and block mask see them.

    Notes
    -----
    Runs on the calling thread only, so it can be called from a user's ``prange`` loop over
    heads. Gives bitwise the same rows as :func:`forward`.
    """
    r = kernel_recipe(recipe, is_causal)
    L = q.shape[0]
    rows = _task_rows(q.shape[1], out.shape[1], lse.itemsize)
    for i0 in range(0, L, rows):
        attend_rows(q, k, v, mask, r, scale, out, lse, i0, min(L, i0 + rows), None, b, h)
