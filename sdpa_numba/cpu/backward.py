"""The attention backward on the CPU, FlashAttention-2 style, deterministic.

With ``P`` recomputed from the forward's ``lse`` (never stored), ``Z`` the dropout factors
(``kept / (1 - p)`` or 1, regenerated from the seed) and ``D = rowsum(dO ∘ O)``::

    dV = (P Z)ᵀ dO,   dS = P ∘ ((dO Vᵀ) Z - D),   dK = scale · dSᵀ Q,   dQ = scale · dS K

(``rowsum(P ∘ (dO Vᵀ) Z) = rowsum(dO ∘ O)``, so ``D`` needs only the forward's output).

Variants come as the forward's :class:`~sdpa_numba.score.recipe.Recipe`: the scores are
recomputed by the score seam (soft cap, ALiBi, score_mod; the window, mask_mod and the block
mask's states mask them), and ``dS`` is multiplied by the slope of the modified score with
respect to ``scale · q · k`` (``1 - tanh²`` of the soft cap, ``score_mod_grad``) before dQ and
dK. Sinks need nothing here (``lse`` includes them). Work lists: a task visits only the query
blocks that see its keys (:func:`~sdpa_numba.score.recipe.query_range`), and each of them only
over the key blocks it sees (:func:`~sdpa_numba.score.recipe.key_range`) that the block mask
does not empty; dense and causal attention are such recipes, with the same arithmetic as
before them (bitwise).

Work is split into tasks of (batch, key/value head, group of key blocks), run in parallel.
A task packs its keys once (in the compute dtype; float16 converted here), then for every
query head that reads them (one, or a group with GQA) and every block of ``BQ`` query rows
that sees them: packs the query block (Q, dO, ``lse``, ``D``), and for each of its
key blocks of ``BK`` keys recomputes the scores and accumulates dK, dV (held by the task for
all its keys) and the block's dQ (held for the query block), which it writes out at the end
of the block. When batch x heads alone gives enough tasks, a task holds every key of its head
and writes dQ directly; otherwise the keys are split into a few groups (shape-only: never the
thread count) whose partial dQs are summed, in group order, by a second parallel loop.

No two tasks write the same element and every sum runs in a fixed order, so the gradients are
bitwise the same for any thread count. Memory beyond the gradients: per running task, its
keys packed and their dK/dV accumulators (O(S/groups · (E + Ev))) and one query block; with
several groups, ``groups x`` the size of dQ. Nothing of size L x S.

All five products go through the forward's register-tiled passes (.microkernel; MR x NR
tiles) in its natural layout, because every score-sized tile is kept *transposed*: keys are
rows, ``BQ = NR`` query rows are columns::

    Sᵀ  = K  · (scale·Q)ᵀ            a: K rows (BK x E),   b: Qᵀ block (E x BQ)
    dPᵀ = V  · dOᵀ                   a: V rows (BK x Ev),  b: dOᵀ block (Ev x BQ)
    dV += (P Z)ᵀ · dO                a: (P Z)ᵀ (BK x BQ),  b: dO block (BQ x Ev)
    dK += dSᵀ · Q                    a: dSᵀ (BK x BQ),     b: Q block (BQ x E)
    dQᵀ += Kᵀ · dSᵀ                  a: Kᵀ (E x BK),       b: dSᵀ (BK x BQ)

so the per-column values (``lse``, ``D``, dropout row keys) are vectors along the tile rows.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._llvm import data_ptr, keep_alive, no_inline, prefer_512_bit, ptr_add, stash, unstash
from .dropout import kept, stream_step, head_key
from .exp2 import exp2
from .forward import masked_score
from .microkernel import MR, NR, register_passes
from .online_softmax import LOG2E
from .options import CALLED, FASTMATH, INLINE, JITTED_ONLY, KERNEL
from .scale_fold import split_power, times
from .scratch import aligned_empty
from ..score.blocks import K_BLOCK, Q_BLOCK
from ..score.numbers import cast
from ..score.recipe import (BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL,
                            covered_block_state, has_element_mask, kernel_recipe, key_range,
                            modifies_capped, modifies_scores,
                            query_range, score_and_slope, user_keeps, window_covers)
from .storage import load
from .tanh import tanh
from .tasks import (failed_task, next_task, raise_lost, record_failure, task_runner,
                    task_queue)

#: Query rows per tile (the tiles' columns): one micro-tile wide.
BQ = NR
#: Keys per block (the tiles' rows).
BK = 128
#: Tasks the key-group split aims at when batch x heads is small (shape-only, never the
#: thread count, so that results do not depend on the thread count).
TASKS = 16
#: At most this many key groups (each one holds a partial dQ).
MAX_GROUPS = 16
#: At least this many key blocks per group: every group packs each query block it sees,
#: which must stay cheap next to the products with its keys.
MIN_GROUP_BLOCKS = 4
#: A task holds at most this many key blocks at a time (4096 keys): its memory is bounded
#: whatever the sequence length.
CHUNK_BLOCKS = 32


@njit(**INLINE)
def round_up(n, m):
    return (n + m - 1) // m * m


@njit(**INLINE)
def key_groups(n_bh, n_kb):
    """Key groups per (batch, kv head) for ``n_bh`` of them and ``n_kb`` key blocks."""
    if n_bh >= TASKS:
        return 1
    g = (TASKS + n_bh - 1) // n_bh
    return max(1, min(g, n_kb // MIN_GROUP_BLOCKS, MAX_GROUPS))


def as_dropout(dropout):
    """The kernels' dropout tuple for ``dropout`` (None becomes "off") (jitted only)."""
    raise NotImplementedError("as_dropout is only callable from jitted code")


@overload(as_dropout, fastmath=FASTMATH)
def _as_dropout(dropout):
    if isinstance(dropout, (types.NoneType, types.Omitted)):
        # typed as the Python API's tuple (..dropout.params), not with a literal 0: one
        # specialization of the kernels below for both
        return lambda dropout: (np.uint64(0), np.uint64(0), 1.0, np.int64(0))
    return lambda dropout: dropout


def has_block_mask(r):
    """Whether recipe ``r`` carries a block mask (jitted only; a compile-time constant)."""
    raise NotImplementedError("has_block_mask is only callable from jitted code")


@overload(has_block_mask)
def _has_block_mask(r):
    const = not isinstance(r.types[r.fields.index("block_mask")], types.NoneType)
    return lambda r: const


@njit(**INLINE)
def pair_state(r, b, h, i0, nv, j0, nk):
    """BLOCK_EMPTY, BLOCK_PARTIAL or BLOCK_FULL: what the recipe's mask_mod does to query rows
    ``[i0, i0 + nv)`` against keys ``[j0, j0 + nk)`` (window and ``attn_mask`` aside).

    The block mask is at :mod:`sdpa_numba.score.blocks`'s granularity (``Q_BLOCK`` query
    rows, ``K_BLOCK`` keys); the states of the blocks the pair covers combine (all empty: empty; all full:
    full). Without a block mask: PARTIAL with a mask_mod (test every element), else FULL.
    """
    if not has_block_mask(r):
        return BLOCK_PARTIAL if has_element_mask(r) else BLOCK_FULL
    return covered_block_state(r, b, h, i0, i0 + nv - 1, j0, j0 + nk - 1, Q_BLOCK, K_BLOCK)


def given(x):
    """Whether optional argument ``x`` was given: False for None (or omitted), a run-time
    test for an Optional type (the launcher's one specialization for "mask or none" and
    "mask gradient or none"), True for an array (jitted only)."""
    raise NotImplementedError("given is only callable from jitted code")


@overload(given, fastmath=FASTMATH)
def _given(x):
    if isinstance(x, (types.NoneType, types.Omitted)):
        return lambda x: False
    if isinstance(x, types.Optional):
        return lambda x: x is not None
    return lambda x: True


def as_none(x):
    """``x``, with an omitted argument as None (jitted only)."""
    raise NotImplementedError("as_none is only callable from jitted code")


@overload(as_none, fastmath=FASTMATH)
def _as_none(x):
    if isinstance(x, types.Omitted):
        return lambda x: None
    return lambda x: x


def _tile_set(a, lda, b, ldb, c, ldc, k_len):
    """``c = a @ b`` on an MR x NR tile: the register passes (.microkernel), compiled once per
    dtype for the backward's several call sites (jitted code only)."""
    raise NotImplementedError("_tile_set is only callable from jitted code")


@overload(_tile_set, **CALLED, **JITTED_ONLY)
def _ol_tile_set(a, lda, b, ldb, c, ldc, k_len):
    # The passes picked here by type (microkernel.register_passes): an inline="always"
    # overload would have each implementation compiled as a function of its own just to type
    # it (machine code never used) on every backward's first call.
    tile = register_passes(a.dtype, False, False, True)

    def tile_set(a, lda, b, ldb, c, ldc, k_len):
        prefer_512_bit()
        tile(a, lda, 1, b, ldb, c, ldc, k_len, None, MR)

    return tile_set


def _tile_add(a, lda, b, ldb, c, ldc, k_len, ones):
    """``c += a @ b`` on an MR x NR tile (``ones``: MR ones, the passes' alpha;
    jitted code only)."""
    raise NotImplementedError("_tile_add is only callable from jitted code")


@overload(_tile_add, **CALLED, **JITTED_ONLY)
def _ol_tile_add(a, lda, b, ldb, c, ldc, k_len, ones):
    tile = register_passes(a.dtype, False, True, True)  # as _tile_set, one alpha per row

    def tile_add(a, lda, b, ldb, c, ldc, k_len, ones):
        prefer_512_bit()
        tile(a, lda, 1, b, ldb, c, ldc, k_len, ones, MR)

    return tile_add


@njit(**INLINE)
def _pack_scaled(q, i0, nv, scale2, qt):
    """``qt`` (E x BQ, pointer) = scale2 · Qᵀ of query rows ``[i0, i0 + nv)``, zero padded."""
    zero = cast(0.0, scale2)
    for e in range(q.shape[1]):
        for c in range(nv):
            qt[e * BQ + c] = load(q[i0 + c, e]) * scale2
        for c in range(nv, BQ):
            qt[e * BQ + c] = zero


@njit(**INLINE)
def prepare_block(q, dout, out, lse, i0, nv, scale2, e_pad, ev_pad, qt, qr, dot, dor, l2, dd):
    """Pack query rows ``[i0, i0 + nv)`` of one head for the key loop (pointers, see module doc).

    ``qt`` (E x BQ) = scale2 · Qᵀ, ``qr`` (BQ x e_pad) = Q, ``dot`` (Ev x BQ) = dOᵀ,
    ``dor`` (BQ x ev_pad) = dO, ``l2`` = lse (0 for fully masked rows, whose scores are all
    -inf), ``dd`` = rowsum(dO ∘ O); zeros past ``nv`` rows and in the padding.
    """
    e_len = q.shape[1]
    ev = dout.shape[1]
    zero = cast(0.0, lse)
    _pack_scaled(q, i0, nv, scale2, qt)
    for d in range(ev):
        for c in range(nv):
            dot[d * BQ + c] = load(dout[i0 + c, d])
        for c in range(nv, BQ):
            dot[d * BQ + c] = zero
    for c in range(BQ):
        if c < nv:
            for e in range(e_len):
                qr[c * e_pad + e] = load(q[i0 + c, e])
            for e in range(e_len, e_pad):
                qr[c * e_pad + e] = zero
            acc = zero
            for d in range(ev):
                g = load(dout[i0 + c, d])
                dor[c * ev_pad + d] = g
                acc += g * load(out[i0 + c, d])
            for d in range(ev, ev_pad):
                dor[c * ev_pad + d] = zero
            x = lse[i0 + c]
            l2[c] = zero if x == -np.inf else x
            dd[c] = acc
        else:
            for e in range(e_pad):
                qr[c * e_pad + e] = zero
            for d in range(ev_pad):
                dor[c * ev_pad + d] = zero
            l2[c] = zero
            dd[c] = zero


@njit(**INLINE)
def _pack_keys(k, v, j0, nk, zero, kp, kt, vp):
    """Key block ``[j0, j0 + nk)`` into kp (BK x E, K rows), kt (e4 x BK, Kᵀ) and vp (BK x Ev,
    V rows), pointers; zero padding up to MR-multiple rows (kp, vp), BK columns and e4 rows
    (kt)."""
    e_len = k.shape[1]
    ev = v.shape[1]
    nk4 = round_up(nk, MR)
    for r in range(nk):
        for e in range(e_len):
            x = load(k[j0 + r, e])
            kp[r * e_len + e] = x
            kt[e * BK + r] = x
        for d in range(ev):
            vp[r * ev + d] = load(v[j0 + r, d])
    for t in range(nk * e_len, nk4 * e_len):
        kp[t] = zero
    for t in range(nk * ev, nk4 * ev):
        vp[t] = zero
    for e in range(e_len):
        for r in range(nk, BK):
            kt[e * BK + r] = zero
    for t in range(e_len * BK, round_up(e_len, MR) * BK):
        kt[t] = zero


@njit(**INLINE)
def _mask_scores(st, gt, nk, nv, j0, i0, mask, use_mask, r, b, h, elem, mods):
    """Form the scores of the transposed tile (pointers) by the recipe ``r``: key ``j0 + r``
    (row) against query ``i0 + c`` (column), scores ``s = scale · q · k`` on entry.

    Outside the window: -inf. Inside: with ``mods``, the modified score (soft cap, ALiBi,
    score_mod) and its slope d s' / d s into ``gt`` (0 outside the window; both by
    :func:`~sdpa_numba.score.recipe.score_and_slope`); then the user's
    ``mask`` (None or (B, Hq, L, S), read at ``[b, h]`` when ``use_mask``), then with
    ``elem`` the recipe's mask_mod. The order of the score seam (sdpa_numba.score.recipe).
    """
    neg_inf = -np.inf
    for rr in range(nk):
        j = j0 + rr
        row = ptr_add(st, rr * BQ)
        # the columns (queries i0 + c) that see key j: the window's query range
        i_begin, i_end = query_range(r, j, j, i0 + nv)
        lo = min(max(i_begin - i0, 0), nv)
        hi = max(min(i_end - i0, nv), lo)
        for c in range(lo):
            row[c] = neg_inf
        for c in range(hi, nv):
            row[c] = neg_inf
        if mods:
            grow = ptr_add(gt, rr * BQ)
            for c in range(BQ):
                grow[c] = 0
            for c in range(lo, hi):
                row[c], grow[c] = score_and_slope(r, row[c], b, h, i0 + c, j)
        if mask is not None and use_mask:
            for c in range(lo, hi):
                row[c] = masked_score(row[c], mask[b, h, i0 + c, j])
        if elem:
            for c in range(lo, hi):
                if not user_keeps(r, b, h, i0 + c, j):
                    row[c] = neg_inf


@njit(**CALLED, **JITTED_ONLY)
def _cap_tile(st, gt, n, cap):
    """The soft cap on the first ``n`` scores of a tile (pointers), all lanes: ``st`` gets
    ``cap · tanh(s / cap)`` and ``gt`` its slope ``1 - tanh²`` (``cap > 0``, in the compute
    dtype).

    The soft-capped recipe's fast path (no ALiBi, no score_mod): one lane-wise pass over the
    whole tile with the vectorizable :func:`.tanh.tanh`, as the forward's ``_modify_tile``.
    The per-element path (:func:`~sdpa_numba.score.recipe.score_and_slope` on each row's
    window ``[lo, hi)``, inlined into the big task function, two results per call) makes a
    scalar libm ``math.tanh`` call per score: the capped backward ran at a quarter of the
    dense rate (0.25, B1 H8 L2048 D64 float32, one thread; 0.88 with this pass). Scores outside the
    window are capped too (they are finite here) and set to -inf afterwards; their
    probability is 0, so their slope is never used. A call of its own, like the tile
    products, so that LLVM vectorizes it on its own terms.
    """
    no_inline()
    prefer_512_bit()
    inv_c = cast(1.0, cap) / cap  # in the compute dtype: 1 / cap would be float64
    one = cast(1.0, cap)
    for t in range(n):
        th = tanh(st[t] * inv_c)
        st[t] = cap * th
        gt[t] = one - th * th


@njit(**INLINE)
def _score_grads(st, dpt, nk, nk4, nv, l2, dd, zero, drop_on, rk, thresh, inv, j0, gt, mods):
    """In place on the tiles (pointers): ``st`` (Sᵀ) becomes (P Z)ᵀ and ``dpt`` (dPᵀ before
    dropout) becomes dSᵀ; with ``mods``, dSᵀ is multiplied by the scores' slopes ``gt``
    (the chain rule through soft cap and score_mod), and ``gt`` gets dSᵀ before it (the
    gradient of the final scores, which the mask gradient is). Padding (key rows past ``nk``,
    query columns past ``nv``) gets exact zeros. As in the forward, only ``s - lse`` is
    converted to base 2, so that no finite score overflows."""
    c2 = cast(LOG2E, zero)
    for r in range(nk4):
        srow = ptr_add(st, r * BQ)
        drow = ptr_add(dpt, r * BQ)
        if r >= nk:
            for c in range(BQ):
                srow[c] = zero
                drow[c] = zero
        elif mods:
            grow = ptr_add(gt, r * BQ)
            j = j0 + r
            for c in range(BQ):
                p = exp2((srow[c] - l2[c]) * c2)
                z = (inv if kept(rk[c], j, thresh) else zero) if drop_on else inv
                valid = c < nv
                ds = p * (drow[c] * z - dd[c])
                srow[c] = p * z if valid else zero
                drow[c] = ds * grow[c] if valid else zero
                grow[c] = ds if valid else zero
        elif drop_on:
            j = j0 + r
            for c in range(BQ):
                p = exp2((srow[c] - l2[c]) * c2)
                z = inv if kept(rk[c], j, thresh) else zero
                valid = c < nv
                srow[c] = p * z if valid else zero
                drow[c] = p * (drow[c] * z - dd[c]) if valid else zero
        else:
            for c in range(BQ):
                p = exp2((srow[c] - l2[c]) * c2)
                valid = c < nv
                srow[c] = p if valid else zero
                drow[c] = p * (drow[c] - dd[c]) if valid else zero


@njit(**KERNEL, **JITTED_ONLY)
def pair_scores(keys, e_len, ev, nk, queries):
    """Sᵀ and dPᵀ tiles of one key block against one query block (before masking).

    Pointers: ``keys`` = (kp, kt, vp, st, dpt, dka, dva, ones), the packed key block and the
    task's tiles; ``queries`` = (qt, qr, dot, dor, l2, dd, dqt), the packed query block.
    Depends on the compute dtype only: one compilation serves every mask kind and storage
    dtype.
    """
    prefer_512_bit()  # also for the tiles, should LLVM inline them here
    kp, kt, vp, st, dpt, dka, dva, ones = keys
    qt, qr, dot, dor, l2, dd, dqt = queries
    for rt in range(0, round_up(nk, MR), MR):
        _tile_set(ptr_add(kp, rt * e_len), e_len, qt, BQ, ptr_add(st, rt * BQ), BQ, e_len)
        _tile_set(ptr_add(vp, rt * ev), ev, dot, BQ, ptr_add(dpt, rt * BQ), BQ, ev)


@njit(**KERNEL, **JITTED_ONLY)
def pair_grads(keys, e_len, ev, nk, nv, j0, queries, drop, gt, mods):
    """From the masked tiles of :func:`pair_scores`: (P Z)ᵀ and dSᵀ in place, then adds the
    pair's dK, dV into ``dka``, ``dva`` and its dQᵀ into ``dqt``.

    ``drop`` = (on, row keys of the query block, threshold, 1 / (1 - p)); ``gt``, ``mods``:
    the scores' slopes, see :func:`_score_grads`. Depends on the compute dtype only.
    """
    prefer_512_bit()
    kp, kt, vp, st, dpt, dka, dva, ones = keys
    qt, qr, dot, dor, l2, dd, dqt = queries
    drop_on, rk, thresh, inv = drop
    nk4 = round_up(nk, MR)
    e4 = round_up(e_len, MR)
    e_pad = round_up(e_len, NR)
    ev_pad = round_up(ev, NR)
    _score_grads(st, dpt, nk, nk4, nv, l2, dd, inv - inv, drop_on, rk, thresh, inv, j0, gt,
                 mods)
    for rt in range(0, nk4, MR):
        for d0 in range(0, ev_pad, NR):
            _tile_add(ptr_add(st, rt * BQ), BQ, ptr_add(dor, d0), ev_pad,
                      ptr_add(dva, rt * ev_pad + d0), ev_pad, nv, ones)
        for e0 in range(0, e_pad, NR):
            _tile_add(ptr_add(dpt, rt * BQ), BQ, ptr_add(qr, e0), e_pad,
                      ptr_add(dka, rt * e_pad + e0), e_pad, nv, ones)
    for et in range(0, e4, MR):
        _tile_add(ptr_add(kt, et * BK), BK, dpt, BQ, ptr_add(dqt, et * BQ), BQ, nk, ones)


@njit(**KERNEL, **JITTED_ONLY)
def key_group(q, k, v, mask, r, scale, dout, out, lse, b, kh, heads, kb0, kb1,
              dq, dq_part, g, dk, dv, dropout, dmask):
    """Everything that key blocks ``[kb0, kb1)`` of key/value head (``b``, ``kh``) contribute.

    Arrays as in :func:`backward`; ``r`` the recipe (causality folded in, see
    :func:`as_recipe`). Works through the keys in chunks of at most ``CHUNK_BLOCKS`` blocks
    (bounded memory): packs a chunk's keys; then for each query head ``kh * heads ...`` that
    reads them and each block of ``BQ`` query rows that sees them under the window
    (:func:`~sdpa_numba.score.recipe.query_range`), packs the query block, accumulates the
    pair products (dK, dV of the chunk, dQᵀ of the query block) over the key blocks that the
    block sees (:func:`~sdpa_numba.score.recipe.key_range`) and that the block mask does not
    empty, and writes (the first chunk it sees) or adds (later chunks) the block's dQ:
    ``scale`` x it into ``dq`` when this task holds every key (``dq_part`` empty), else
    unscaled into ``dq_part[g]``; then writes the chunk's rows of ``dk``, ``dv``. With
    ``dmask`` (not None), also the group's columns of the mask gradient.
    """
    prefer_512_bit()
    L, e_len = q.shape[2], q.shape[3]
    s_len = k.shape[2]
    ev = v.shape[3]
    ct = lse.dtype
    zero = cast(0.0, lse)
    e4 = round_up(e_len, MR)
    e_pad = round_up(e_len, NR)
    ev_pad = round_up(ev, NR)
    nqb = (L + BQ - 1) // BQ
    kk, vv = k[b, kh], v[b, kh]
    direct = dq_part.shape[0] == 0
    want_dm = given(dmask)
    h0, h1 = kh * heads, (kh + 1) * heads
    if dmask is not None and want_dm:
        for h in range(h0, h1):
            dmask[b, h, :, kb0 * BK:min(s_len, kb1 * BK)] = 0
    if direct:
        # Rows that see no key at all (S == 0, or a window past the keys) are never visited:
        # their dQ is 0.
        for qb in range(nqb):
            i0 = qb * BQ
            nv = min(BQ, L - i0)
            jb, je = key_range(r, i0, i0 + nv - 1, s_len)
            if je <= jb:
                for h in range(h0, h1):
                    dq[b, h, i0:i0 + nv] = 0
    if kb1 <= kb0:  # no keys (S == 0)
        return
    # a chunk of keys, packed: per key block kp (BK x E), kt (e4 x BK), vp (BK x Ev), and
    # its dK, dV accumulators (BK x e_pad, BK x ev_pad)
    nb = min(kb1 - kb0, CHUNK_BLOCKS)
    kp = aligned_empty(max(nb * BK * e_len, 1), ct)
    kt = aligned_empty(max(nb * e4 * BK, 1), ct)
    vp = aligned_empty(max(nb * BK * ev, 1), ct)
    dka = aligned_empty(max(nb * BK * e_pad, 1), ct)
    dva = aligned_empty(max(nb * BK * ev_pad, 1), ct)
    p_kp, p_kt, p_vp, p_dka, p_dva = (data_ptr(kp), data_ptr(kt), data_ptr(vp), data_ptr(dka),
                                      data_ptr(dva))
    # one query block, packed; its dQᵀ accumulator; the score tiles (gt: the scores' slopes,
    # with a recipe that changes scores)
    qt = aligned_empty(max(e_len * BQ, 1), ct)
    qr = aligned_empty(max(BQ * e_pad, 1), ct)
    dot = aligned_empty(max(ev * BQ, 1), ct)
    dor = aligned_empty(max(BQ * ev_pad, 1), ct)
    l2 = aligned_empty(BQ, ct)
    dd = aligned_empty(BQ, ct)
    dqt = aligned_empty(max(e4 * BQ, 1), ct)
    st = aligned_empty(BK * BQ, ct)
    dpt = aligned_empty(BK * BQ, ct)
    gt = aligned_empty(BK * BQ, ct)
    ones = np.ones(MR, ct)
    rk = np.zeros(BQ, np.uint64)
    queries = (data_ptr(qt), data_ptr(qr), data_ptr(dot), data_ptr(dor), data_ptr(l2),
               data_ptr(dd), data_ptr(dqt))
    p_st, p_dpt, p_gt, p_ones = data_ptr(st), data_ptr(dpt), data_ptr(gt), data_ptr(ones)
    scale2 = cast(scale, lse)
    sc = cast(scale, lse)
    seed, thresh, inv_keep, b_off = dropout
    drop_on = inv_keep != 1.0
    inv = cast(inv_keep, lse)
    use_mask = given(mask)
    mods = modifies_scores(r)
    # The soft cap alone (the common case, Gemma 2) goes lane-wise over whole tiles
    # (_cap_tile); with ALiBi or a score_mod every score takes the per-element path.
    cap_only = r.softcap > 0 and not modifies_capped(r)
    cap = cast(r.softcap, lse)
    elem_mods = mods and not cap_only
    for c0 in range(kb0, kb1, CHUNK_BLOCKS):
        c1 = min(kb1, c0 + CHUNK_BLOCKS)
        for kb in range(c0, c1):
            t = kb - c0
            j0 = kb * BK
            _pack_keys(kk, vv, j0, min(BK, s_len - j0), zero, ptr_add(p_kp, t * BK * e_len),
                       ptr_add(p_kt, t * e4 * BK), ptr_add(p_vp, t * BK * ev))
        dka[:] = 0
        dva[:] = 0
        # the query blocks that see some key of the chunk
        i_begin, i_end = query_range(r, c0 * BK, min(c1 * BK, s_len) - 1, L)
        for h in range(h0, h1):
            hkey = head_key(seed, b_off + b, h)
            for qb in range(i_begin // BQ, (i_end + BQ - 1) // BQ):
                i0 = qb * BQ
                nv = min(BQ, L - i0)
                # the key blocks that the block's rows see (causal: not past its last row)
                jb, je = key_range(r, i0, i0 + nv - 1, s_len)
                kb_first = max(kb0, jb // BK)
                kb_start = max(c0, kb_first)
                kb_stop = min(c1, (je + BK - 1) // BK)
                if kb_stop <= kb_start:
                    continue
                prepare_block(q[b, h], dout[b, h], out[b, h], lse[b, h], i0, nv, scale2,
                              e_pad, ev_pad, queries[0], queries[1], queries[2], queries[3],
                              queries[4], queries[5])
                # Queries that overflowed with scale: packed with scale / w, scores times w.
                w = split_power(queries[0], e_len * BQ, scale)
                if w != 1:
                    _pack_scaled(q[b, h], i0, nv, cast(scale / w, lse), queries[0])
                score_w = cast(w, lse)
                dqt[:] = 0
                if drop_on:
                    for c in range(nv):
                        rk[c] = stream_step(hkey, i0 + c)
                for kb in range(kb_start, kb_stop):
                    t = kb - c0
                    j0 = kb * BK
                    nk = min(BK, s_len - j0)
                    state = pair_state(r, b, h, i0, nv, j0, nk)
                    if state == BLOCK_EMPTY:
                        continue
                    elem = has_element_mask(r) and state == BLOCK_PARTIAL
                    keys = (ptr_add(p_kp, t * BK * e_len), ptr_add(p_kt, t * e4 * BK),
                            ptr_add(p_vp, t * BK * ev), p_st, p_dpt,
                            ptr_add(p_dka, t * BK * e_pad), ptr_add(p_dva, t * BK * ev_pad),
                            p_ones)
                    pair_scores(keys, e_len, ev, nk, queries)
                    if w != 1:
                        times(p_st, nk * BQ, score_w)
                    if cap_only:
                        _cap_tile(p_st, p_gt, nk * BQ, cap)
                    if (use_mask or elem_mods or elem
                            or not window_covers(r, i0, i0 + nv - 1, j0, j0 + nk - 1)):
                        _mask_scores(p_st, p_gt, nk, nv, j0, i0, mask, use_mask, r, b, h,
                                     elem, elem_mods)
                    pair_grads(keys, e_len, ev, nk, nv, j0, queries,
                               (drop_on, rk, thresh, inv), p_gt, mods)
                    if dmask is not None and want_dm:
                        dsm = gt if mods else dpt  # dS of the final scores
                        for rr in range(nk):
                            for c in range(nv):
                                dmask[b, h, i0 + c, j0 + rr] = dsm[rr * BQ + c]
                # the first chunk that this block sees writes its dQ, later ones add to it
                first = c0 == kb0 + (kb_first - kb0) // CHUNK_BLOCKS * CHUNK_BLOCKS
                for c in range(nv):
                    for e in range(e_len):
                        x = dqt[e * BQ + c]
                        if direct:
                            if first:
                                dq[b, h, i0 + c, e] = x * sc
                            else:
                                dq[b, h, i0 + c, e] += x * sc
                        elif first:
                            dq_part[g, b, h, i0 + c, e] = x
                        else:
                            dq_part[g, b, h, i0 + c, e] += x
        for kb in range(c0, c1):
            t = kb - c0
            j0 = kb * BK
            for rr in range(min(BK, s_len - j0)):
                for e in range(e_len):
                    dk[b, kh, j0 + rr, e] = dka[(t * BK + rr) * e_pad + e] * sc
                for d in range(ev):
                    dv[b, kh, j0 + rr, d] = dva[(t * BK + rr) * ev_pad + d]
    # The loops above reach these arrays through pointers only: keep them alive until here.
    keep_alive((kp, kt, vp, dka, dva, qt, qr, dot, dor, l2, dd, dqt, st, dpt, gt, ones, rk))


@njit(**KERNEL, **JITTED_ONLY)
def _sum_dq(dq_part, scale, dq, b, h, qb):
    """dq rows of query block ``qb`` of head (``b``, ``h``) = scale · the sum of the groups'
    partials, in group order."""
    L, e_len = dq.shape[2], dq.shape[3]
    i0 = qb * BQ
    sc = cast(scale, dq_part)
    for i in range(i0, min(L, i0 + BQ)):
        for e in range(e_len):
            acc = dq_part[0, b, h, i, e]
            for g in range(1, dq_part.shape[0]):
                acc += dq_part[g, b, h, i, e]
            dq[b, h, i, e] = acc * sc


#: key_group that reports a user function's exception (see .tasks).
_run_key_group = task_runner(key_group)


@njit(parallel=True, **KERNEL)
def backward(q, k, v, mask, is_causal, scale, dout, out, lse, dq, dk, dv, dropout=None,
             dmask=None, recipe=None):
    """Gradients of the batched attention forward, parallel and deterministic.

    Parameters
    ----------
    q, k, v, mask, is_causal, scale
        As given to :func:`~sdpa_numba.cpu.forward` (``q`` (B, Hq, L, E), ``k`` (B, H, S, E),
        ``v`` (B, H, S, Ev), ``mask`` None or (B, Hq, L, S)); any strides, float16 as uint16.
        ``mask`` may be typed Optional (None or a bool array at run time: one compiled
        specialization for both, as the launcher compiles it).
    dout : ndarray, shape (B, Hq, L, Ev)
        Gradient of the loss with respect to the forward's output (storage dtype).
    out : ndarray, shape (B, Hq, L, Ev)
        The forward's output (storage dtype).
    lse : ndarray, shape (B, Hq, L)
        The forward's log-sum-exp, in the compute dtype (float32, or float64 for float64).
    dq : ndarray, shape (B, Hq, L, E)
        Written: gradient of ``q``, in the compute dtype.
    dk, dv : ndarray, shapes (B, H, S, E), (B, H, S, Ev)
        Written: gradients of ``k``, ``v`` in the compute dtype, summed over the query heads
        that read each key/value head (grouped-query attention).
    dropout : None or tuple, optional
        The forward's ``dropout`` argument, :func:`sdpa_numba.dropout.params`; the same seed
        regenerates the same mask. ``inv_keep == 1.0`` (``p == 0``) means no dropout.
    dmask : None or ndarray, shape (B, Hq, L, S), optional
        Written (compute dtype) when given (it too may be typed Optional): the gradient of an additive mask, i.e. of the
        final scores (``scale · q · k`` modified by the recipe, plus ``mask``). Full size:
        reduce broadcast dims yourself.
    recipe : None or Recipe, optional
        The variants, as given to the forward (:func:`sdpa_numba.score.recipe.recipe`):
        window and alignment, soft cap, ALiBi, score_mod with its ``score_mod_grad``,
        mask_mod, block mask. None is plain attention, top-left causal with ``is_causal``;
        with a recipe, ``is_causal`` still limits the window's right side to 0. Sinks need
        nothing here (``lse`` includes them); their gradient is
        ``-sum_i exp(sink - lse_i) · rowsum(dO ∘ O)_i`` (the caller's). Gradients flow
        through the soft cap and score_mod (by ``score_mod_grad``: without it, score_mod is
        taken as having slope 1 — the public layer refuses that), not to ALiBi slopes.

    Notes
    -----
    Gradients of broadcast inputs come per batch/head: sum them over the broadcast dims.
    Arguments are trusted (the Python API validates them). Bitwise the same for any thread
    count. Calls from users' jitted code compile their own specialization.
    """
    b_len, n_heads, L, e_len = q.shape
    h_len, s_len = k.shape[1], k.shape[2]
    group = n_heads // h_len if h_len else 1
    drop = as_dropout(dropout)
    dm = as_none(dmask)
    r = kernel_recipe(recipe, is_causal)
    # The recipe, the mask and the mask gradient enter the parallel region through a pointer
    # (see _llvm.stash): a parfor takes no tuple nested in a tuple, nor a function, and
    # mishandles Optional arguments (None is refused when the function is called).
    p_args = stash((r, mask, dm))
    n_kb = (s_len + BK - 1) // BK
    groups = key_groups(b_len * h_len, n_kb)
    # With several key groups, each writes its part of dQ apart; they are summed in order.
    np_ = groups if groups > 1 else 0
    dq_part = np.zeros((np_, b_len, n_heads, L, e_len), lse.dtype)

    # Tasks from the queue (.tasks): a head's groups in order, costliest first (causal: later
    # keys are seen by fewer rows).
    n_tasks = b_len * h_len * groups
    queue = task_queue()
    for _ in prange(n_tasks):
        t = next_task(queue, n_tasks)
        while t >= 0:
            bkh = t // groups
            g = t % groups
            b = bkh // h_len
            kh = bkh % h_len
            kb0 = g * n_kb // groups
            kb1 = (g + 1) * n_kb // groups
            # (one call for any mask type: an `if mask is None` branch here would compile
            # both)
            r_t, mask_t, dm_t = unstash(p_args)
            if not _run_key_group(r_t, q, k, v, mask_t, r_t, scale, dout, out, lse, b, kh,
                            group, kb0, kb1, dq, dq_part, g, dk, dv, drop, dm_t):
                record_failure(queue, t)
            t = next_task(queue, n_tasks)
    t = failed_task(queue)
    if t >= 0:  # a user function raised in the loop: again here, where it reaches the caller
        g = t % groups
        r_t, mask_t, dm_t = unstash(p_args)
        key_group(q, k, v, mask_t, r_t, scale, dout, out, lse, t // groups // h_len,
                  t // groups % h_len, group, g * n_kb // groups, (g + 1) * n_kb // groups,
                  dq, dq_part, g, dk, dv, drop, dm_t)
        raise_lost()

    if groups > 1:
        nqb = (L + BQ - 1) // BQ
        for t in prange(b_len * n_heads * nqb):
            bh = t // nqb
            _sum_dq(dq_part, scale, dq, bh // n_heads, bh % n_heads, t % nqb)
    keep_alive((r, mask, dm))
