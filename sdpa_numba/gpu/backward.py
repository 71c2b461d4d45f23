"""The attention backward on CUDA: FlashAttention-2's, deterministic, without atomics.

With ``P`` recomputed from the forward's ``lse`` (never stored), ``Z`` the dropout factors
(``kept / (1 - p)`` or 1, regenerated from the seed, :mod:`.dropout`) and
``D = rowsum(dO ∘ O)``::

    dV = (P Z)ᵀ dO,   dS = P ∘ ((dO Vᵀ) Z − D),   dK = scale · dSᵀ Q,   dQ = scale · dS K

(``rowsum(P ∘ (dO Vᵀ) Z) = rowsum(dO ∘ O)``, so ``D`` needs only the forward's output). Two
kernels, launched in this order on one stream:

* the **dQ kernel**: one thread block per (batch, query head, block of ``block_m`` query rows).
  It computes ``D`` of its rows (one thread per row, in order) and writes it out for the other
  kernel, then goes through the key blocks its rows see, recomputing the score tile, ``P`` and
  ``dO Vᵀ`` (:func:`_pair_grads`), and accumulates ``dQ += dS K``. With a mask gradient (a
  kernel of its own: the argument is ``(dmask,)``, or ``()`` for none) it also writes ``dS``,
  the gradient of an additive mask, for every (row, key): the only L x S array.
* the **dK/dV kernel**: one thread block per (batch, key/value head, block of ``block_n``
  keys). It goes through the query heads that read these keys (one, or the group under GQA, in
  order) and the query blocks that see them, recomputes the same tiles and accumulates
  ``dV += (P Z)ᵀ dO`` and ``dK += dSᵀ (scale · Q)``.

A packed (varlen) batch is one launch of each kernel too: "batch" above is then a sequence,
and each block finds its sequence's rows and keys in :mod:`.work`'s work list.

Every gradient element is accumulated by one thread, over keys (dQ) or over query heads and
rows (dK, dV), in a fixed order, and written once: there are no atomics, and results are bitwise
the same on every launch. The price is that the score tiles are computed twice, once per
kernel. Extra device memory: ``D`` (one value per query row); the accumulators live in shared
memory.

Tiling: the :class:`~.options.Blocks` of the forward. Each thread owns an ``RM x SC`` register
tile of every score tile (rows ``r0 ...``, keys ``tc, tc + TC, ...``), as in the forward. It
accumulates dQ for its rows and the head-dim columns ``tc, tc + TC, ...``; dK and dV for its
keys and the head-dim columns ``g, g + G, ...`` (``g``: its row group, ``G`` row groups). The
accumulators are in shared memory because their length (the head dims) is a runtime value.
"""

import math

import numba
import numpy as np
from numba import cuda, types

from ..score.recipe import BLOCK_EMPTY, DENSE, keeps, modified_score, query_range, score_slope
from .arrays import device_array
from .dropout import NO_DROPOUT, dropout_factor, row_keys
from .forward import DROPOUT_ARGS, WORK, arr, jit_options, launch_blocks, mask_kind_of, \
    operand_types, resolve_recipe
from .options import FASTMATH
from .raising import refuse_raising
from .scale_fold import refold_tile
from .storage import load, storage_view
from .tiles import clear, load_tile, tile_product, tile_thread, u
from .variants import NO_MASK, arg_type, compile_key, kernel_args, masked, modifies, \
    recipe_of, store_grad, tile_visit
from .work import key_blocks, key_work, no_work, query_work, work_list

_kernels = {}


def layout(bm, sp, e, ev):
    """Shared-memory layout (offsets in elements) of the tiles both kernels stage.

    Q (``bm`` rows of ``qp = e | 1``, pre-scaled), dO (``bm`` rows of ``dp = ev | 1``), the
    rows' ``lse`` and ``D``, Kᵀ (``e`` rows of ``sp = block_n + 1``), Vᵀ (``ev`` rows of
    ``sp``), then two score-sized tiles (``bm`` rows of ``sp``: P Z and dS, or dS alone), then
    the kernel's accumulators. Returns ``(qp, dp, do_at, lse_at, dd_at, kt_at, vt_at, pz_at,
    ds_at, end)``: ``ds_at`` and ``end`` as the dK/dV kernel has them; the dQ kernel uses
    ``pz_at`` for dS and ``ds_at`` for dQ. (Plain Python, also compiled as a device function:
    the host sizes shared memory with the kernels' own arithmetic.)
    """
    qp = e | 1
    dp = ev | 1
    do_at = bm * qp
    lse_at = do_at + bm * dp
    dd_at = lse_at + bm
    kt_at = dd_at + bm
    vt_at = kt_at + e * sp
    pz_at = vt_at + ev * sp
    ds_at = pz_at + bm * sp
    return qp, dp, do_at, lse_at, dd_at, kt_at, vt_at, pz_at, ds_at, ds_at + bm * sp


_layout = cuda.jit(device=True, inline="always")(layout)


def dq_shared_elements(blocks, e, ev):
    """Shared memory of the dQ kernel, in elements: the common tiles, dS and dQ
    (``block_m x e``)."""
    return layout(blocks.block_m, blocks.block_n + 1, e, ev)[8] + blocks.block_m * e


def dkv_shared_elements(blocks, e, ev):
    """Shared memory of the dK/dV kernel, in elements: the common tiles, P Z, dS and dKᵀ,
    dVᵀ (``(e + ev) x block_n``)."""
    return layout(blocks.block_m, blocks.block_n + 1, e, ev)[9] + (e + ev) * blocks.block_n


def _tiling(blocks):
    """The kernels' compile-time constants: ``(BM, BN, NT, RM, TC, G, SC, SP)`` (see the
    module doc)."""
    TC = blocks.threads_per_row
    return (blocks.block_m, blocks.block_n, blocks.threads, blocks.rows_per_thread, TC,
            blocks.row_groups, blocks.block_n // TC, blocks.block_n + 1)


def dq_signature(dtype, mask_kind, parts=compile_key(DENSE), mask_grad=False):
    """``(q, k, v, mask, scale, dout, out, lse, work, *dropout, D, dq, dmask_t, recipe)``:
    every array 'A', one compilation per dtype, mask kind, recipe parts
    (:func:`.variants.compile_key`) and ``mask_grad`` (``dmask_t`` is ``(dmask,)``, else
    ``()``), for dense and packed launches (``work``: :mod:`.work`)."""
    st, ct, mask = operand_types(dtype, mask_kind)
    dmask_t = types.UniTuple(arr(ct, 4), 1) if mask_grad else types.Tuple(())
    return numba.void(arr(st, 4), arr(st, 4), arr(st, 4), mask, numba.float64,
                      arr(st, 4), arr(st, 4), arr(ct, 3), WORK, *DROPOUT_ARGS, arr(ct, 3),
                      arr(ct, 4), dmask_t, arg_type(parts, ct)), ct


def dkv_signature(dtype, mask_kind, parts=compile_key(DENSE)):
    """``(q, k, v, mask, scale, dout, lse, work, *dropout, D, dk, dv, recipe)``."""
    st, ct, mask = operand_types(dtype, mask_kind)
    return numba.void(arr(st, 4), arr(st, 4), arr(st, 4), mask, numba.float64,
                      arr(st, 4), arr(ct, 3), WORK, *DROPOUT_ARGS, arr(ct, 3), arr(ct, 4),
                      arr(ct, 4), arg_type(parts, ct)), ct


def _pair_grads(blocks, mask_kind, ct):
    """The device function both kernels run on a (query block, key block) pair: one thread's
    ``RM x SC`` entries of ``P Z`` and ``dS``, written to shared tiles."""
    BM, BN, NT, RM, TC, G, SC, SP = _tiling(blocks)
    NS = RM * SC  # entries of a score tile per thread (a constant: local array size)
    CT = ct

    @cuda.jit(device=True, inline="always")
    def pair_grads(sm, at, r0, tc, i0, j0, nj, L, E, Ev, rc, test, mask, b, bs, q0, k0, h,
                   drop_on, rk, threshold, inv, dmask_t, score_w):
        """``at`` = (Q row length, dO row length, then the dO, lse, D, Kᵀ, Vᵀ, P Z and dS
        offsets; Q is at 0); a negative P Z offset: not wanted. Rows past ``L`` and keys past
        ``nj`` get zeros. ``rc``: the recipe; ``test``: whether the tile needs the
        per-element window and mask_mod tests. Rows ``i`` and keys ``j`` count from the
        sequence's start for the score seam (batch index ``bs``), from ``q0`` and ``k0`` in
        the operands (batch entry ``b``: the mask). With ``dmask_t = (dmask,)``, this thread's
        entries of dS with respect to the final score (the additive mask's gradient) go to
        ``dmask`` (``()``: none wanted);
        the shared dS is with respect to the scaled ``q · k`` (the recipe's slope applied)."""
        qp, dp, do_at, lse_at, dd_at, kt_at, vt_at, pz_at, ds_at = at
        zero = CT(0)
        neg_inf = CT(-math.inf)
        sreg = cuda.local.array(NS, CT)
        dpreg = cuda.local.array(NS, CT)
        kreg = cuda.local.array(SC, CT)
        clear(sreg, NS)
        tile_product(sm, 0, qp, kt_at, SP, E, r0, tc, TC, RM, SC, kreg, sreg)  # scaled S
        if score_w != 1:  # the Q tile was staged with scale / score_w (.scale_fold)
            for t in range(NS):
                sreg[t] *= score_w
        clear(dpreg, NS)
        tile_product(sm, do_at, dp, vt_at, SP, Ev, r0, tc, TC, RM, SC, kreg, dpreg)  # dO Vᵀ
        mod_on = modifies(rc)
        for a in range(RM):
            r = r0 + a
            i = i0 + r
            lse = sm[lse_at + r]
            dd = sm[dd_at + r]
            for c in range(SC):
                j = tc + TC * c
                s0 = sreg[a * SC + c]  # scale · q · k
                s = s0
                if j >= nj or i >= L:
                    s = neg_inf
                else:  # the score seam, as in the forward
                    if mod_on:  # (CT: the simulator's CPU-jitted calls return floats)
                        s = CT(modified_score(rc, s, bs, h, i, j0 + j))
                    s = masked(s, mask, b, h, q0 + i, k0 + j0 + j, neg_inf)
                    if test and not keeps(rc, bs, h, i, j0 + j):
                        s = neg_inf
                p = math.exp(s - lse)  # the forward's probability (0 where masked)
                z = CT(1)
                if drop_on:
                    z = dropout_factor(rk[a], j0 + j, threshold, inv, zero)
                if pz_at >= 0:
                    sm[pz_at + r * SP + j] = p * z
                ds = p * (dpreg[a * SC + c] * z - dd)
                if i < L and j < nj:
                    store_grad(dmask_t, b, h, q0 + i, k0 + j0 + j, ds)
                if mod_on and p != 0:  # chain rule through soft cap, ALiBi, score_mod
                    ds *= CT(score_slope(rc, s0, bs, h, i, j0 + j))
                sm[ds_at + r * SP + j] = ds

    return pair_grads


def _recipe_constants(parts):
    """``(HAS_BM, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD, ELEMENT_MASK)`` of compile key
    ``parts`` (:func:`.variants.compile_key`)."""
    return (parts.has("block_mask"), *parts.functions, parts.mask_mod is not None)


def _make_dq_kernel(dtype, mask_kind, blocks, parts=compile_key(DENSE), mask_grad=False):
    """The dQ kernel for storage ``dtype``, mask kind, tiling ``blocks``, recipe parts and
    whether it writes the mask gradient."""
    sig, CT = dq_signature(dtype, mask_kind, parts, mask_grad)
    MASK_GRAD = mask_grad
    BM, BN, NT, RM, TC, G, SC, SP = _tiling(blocks)
    pair_grads = _pair_grads(blocks, mask_kind, CT)
    HAS_BM, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD, ELEMENT_MASK = _recipe_constants(parts)

    @cuda.jit(sig, fastmath=FASTMATH, **jit_options(NT))
    def dq_kernel(q, k, v, mask, scale, dout, out, lse, work, seed, threshold, inv_keep, b_off,
                  D, dq, dmask_t, ra):
        E = q.shape[3]
        Ev = v.shape[3]
        # Operand rows q0 + i, keys k0 + j; the score seam sees i, j, batch index bs.
        b, bs, h, kh, i0, q0, L, k0, S, offset = query_work(q, k, BM, work, ra.offset)
        rc = recipe_of(ra, offset, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD)
        nv = min(BM, L - i0)
        tid, g, tc = tile_thread(TC)
        r0 = g * RM  # this thread's rows of the tiles; tc: its first key and column of dQ

        QP, DP, do_at, lse_at, dd_at, kt_at, vt_at, ds_at, dq_at, _ = _layout(BM, SP, E, Ev)
        at = (QP, DP, do_at, lse_at, dd_at, kt_at, vt_at, -1, ds_at)
        sm = cuda.shared.array(0, CT)
        zero = CT(0)
        one = CT(1)

        load_tile(q, b, h, q0 + i0, nv, BM, E, E, CT(scale), sm, 0, QP, 1, tid, NT)
        score_w = refold_tile(q, b, h, q0 + i0, nv, BM, E, scale, sm, 0, QP, tid, NT)
        load_tile(dout, b, h, q0 + i0, nv, BM, Ev, Ev, one, sm, do_at, DP, 1, tid, NT)
        for e in range(tc, E, TC):
            for a in range(RM):
                sm[dq_at + (r0 + a) * E + e] = zero
        cuda.syncthreads()  # dO is staged
        # D = rowsum(dO ∘ O), one thread per row in a fixed order, written out for the dK/dV
        # kernel (which then uses the very same values). A fully masked row has lse = -inf and
        # every score -inf: against 0 instead, its P is 0 rather than exp(-inf + inf) = NaN.
        for r in range(tid, BM, NT):
            x = zero
            dd = zero
            if r < nv:
                for d in range(Ev):
                    dd += sm[do_at + r * DP + d] * CT(load(out[b, h, q0 + i0 + r, d]))
                D[b, h, q0 + i0 + r] = dd
                x = lse[b, h, q0 + i0 + r]
                if x == -math.inf:
                    x = zero
            sm[lse_at + r] = x
            sm[dd_at + r] = dd
        acc = cuda.local.array(RM, CT)
        drop_on = inv_keep != 1.0  # 1: no dropout
        inv = CT(inv_keep)
        rk = cuda.local.array(RM, numba.uint64)
        if drop_on:
            row_keys(rk, RM, seed, b_off + bs, h, i0 + r0)

        # The forward's key blocks: those some row sees, less empty block-mask blocks.
        i_last, j_first, j_end = key_blocks(rc, i0, BM, L, S, BN)
        for j0 in range(j_first, j_end, BN):
            nj = min(BN, j_end - j0)
            state, test = tile_visit(rc, HAS_BM, ELEMENT_MASK, ra.bq, ra.bk, bs, h, i0, i_last,
                                     j0, j0 + nj - 1)
            if state == BLOCK_EMPTY:  # uniform across the thread block
                if MASK_GRAD:  # never visited: dS is 0
                    for a in range(RM):
                        if r0 + a < nv:
                            for j in range(tc, nj, TC):
                                store_grad(dmask_t, b, h, q0 + i0 + r0 + a, k0 + j0 + j,
                                           zero)
                continue
            cuda.syncthreads()  # the previous block's tiles are consumed (and lse, D written)
            load_tile(k, b, kh, k0 + j0, nj, BN, E, E, one, sm, kt_at, 1, SP, tid, NT)
            load_tile(v, b, kh, k0 + j0, nj, BN, Ev, Ev, one, sm, vt_at, 1, SP, tid, NT)
            cuda.syncthreads()
            pair_grads(sm, at, r0, tc, i0, j0, nj, L, E, Ev, rc, test, mask, b, bs, q0, k0, h,
                       drop_on, rk, threshold, inv, dmask_t, score_w)
            cuda.syncthreads()  # the dS tile is complete
            # dQ += dS K for this thread's rows and columns e = tc, tc + TC, ...
            for e in range(tc, E, TC):
                clear(acc, RM)
                for j in range(nj):
                    x = sm[u(kt_at + e * SP + j)]
                    for a in range(RM):
                        acc[a] += sm[u(ds_at + (r0 + a) * SP + j)] * x
                for a in range(RM):
                    sm[dq_at + (r0 + a) * E + e] += acc[a]

        if MASK_GRAD:  # keys outside the window were never visited: their dS is 0
            for a in range(RM):
                if r0 + a < nv:
                    for j in range(tc, j_first, TC):
                        store_grad(dmask_t, b, h, q0 + i0 + r0 + a, k0 + j, zero)
                    for j in range(max(j_end, j_first) + tc, S, TC):
                        store_grad(dmask_t, b, h, q0 + i0 + r0 + a, k0 + j, zero)
        sc = CT(scale)
        for e in range(tc, E, TC):
            for a in range(RM):
                if r0 + a < nv:
                    dq[b, h, q0 + i0 + r0 + a, e] = sm[dq_at + (r0 + a) * E + e] * sc

    return dq_kernel


def _make_dkv_kernel(dtype, mask_kind, blocks, parts=compile_key(DENSE)):
    """The dK/dV kernel for storage ``dtype``, mask kind, tiling ``blocks`` and recipe
    parts."""
    sig, CT = dkv_signature(dtype, mask_kind, parts)
    BM, BN, NT, RM, TC, G, SC, SP = _tiling(blocks)
    pair_grads = _pair_grads(blocks, mask_kind, CT)
    HAS_BM, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD, ELEMENT_MASK = _recipe_constants(parts)

    @cuda.jit(sig, fastmath=FASTMATH, **jit_options(NT))
    def dkv_kernel(q, k, v, mask, scale, dout, lse, work, seed, threshold, inv_keep, b_off, D,
                   dk, dv, ra):
        Hq, E = q.shape[1], q.shape[3]
        H = k.shape[1]
        Ev = v.shape[3]
        group = Hq // H
        # Operand rows q0 + i, keys k0 + j; the score seam sees i, j, batch index bs. (Under
        # causal the first key blocks are seen by the most rows: they go first.)
        b, bs, kh, j0, q0, L, k0, S, offset = key_work(q, k, BN, work, ra.offset)
        rc = recipe_of(ra, offset, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD)
        nj = min(BN, S - j0)
        tid, g, tc = tile_thread(TC)
        # g: this thread's row group (first column of dK, dV); tc: its first key
        r0 = g * RM  # its rows of the tiles

        QP, DP, do_at, lse_at, dd_at, kt_at, vt_at, pz_at, ds_at, dk_at = _layout(BM, SP, E,
                                                                                   Ev)
        dv_at = dk_at + E * BN  # dKᵀ (E rows of BN), then dVᵀ (Ev rows of BN)
        at = (QP, DP, do_at, lse_at, dd_at, kt_at, vt_at, pz_at, ds_at)
        sm = cuda.shared.array(0, CT)
        zero = CT(0)
        one = CT(1)
        qscale = CT(scale)

        load_tile(k, b, kh, k0 + j0, nj, BN, E, E, one, sm, kt_at, 1, SP, tid, NT)
        load_tile(v, b, kh, k0 + j0, nj, BN, Ev, Ev, one, sm, vt_at, 1, SP, tid, NT)
        for c in range(SC):
            j = tc + TC * c
            for e in range(g, E, G):
                sm[dk_at + e * BN + j] = zero
            for d in range(g, Ev, G):
                sm[dv_at + d * BN + j] = zero
        acc = cuda.local.array(SC, CT)
        drop_on = inv_keep != 1.0  # 1: no dropout
        inv = CT(inv_keep)
        rk = cuda.local.array(RM, numba.uint64)

        # The query blocks whose rows see some of these keys under the window (causal: none
        # above the diagonal), less empty block-mask blocks.
        i_begin, i_end = query_range(rc, j0, j0 + nj - 1, L)  # (0, 0) when none
        # Query heads of the group, then query blocks, in order: a fixed order of the sums.
        for h in range(kh * group, (kh + 1) * group):
            for i0 in range(i_begin - i_begin % BM, i_end, BM):
                nv = min(BM, L - i0)
                i_last = i0 + nv - 1
                state, test = tile_visit(rc, HAS_BM, ELEMENT_MASK, ra.bq, ra.bk, bs, h, i0,
                                         i_last, j0, j0 + nj - 1)
                if state == BLOCK_EMPTY:  # uniform across the thread block
                    continue
                cuda.syncthreads()  # the previous pair's tiles are consumed (K, V staged)
                load_tile(q, b, h, q0 + i0, nv, BM, E, E, qscale, sm, 0, QP, 1, tid, NT)
                score_w = refold_tile(q, b, h, q0 + i0, nv, BM, E, scale, sm, 0, QP, tid, NT)
                load_tile(dout, b, h, q0 + i0, nv, BM, Ev, Ev, one, sm, do_at, DP, 1, tid, NT)
                for r in range(tid, BM, NT):
                    x = zero
                    dd = zero
                    if r < nv:
                        x = lse[b, h, q0 + i0 + r]
                        dd = D[b, h, q0 + i0 + r]
                        if x == -math.inf:  # fully masked row: P = 0, not NaN (see dQ)
                            x = zero
                    sm[lse_at + r] = x
                    sm[dd_at + r] = dd
                if drop_on:
                    row_keys(rk, RM, seed, b_off + bs, h, i0 + r0)
                cuda.syncthreads()
                pair_grads(sm, at, r0, tc, i0, j0, nj, L, E, Ev, rc, test, mask, b, bs, q0, k0,
                           h, drop_on, rk, threshold, inv, NO_MASK, score_w)  # no dmask
                cuda.syncthreads()  # the P Z and dS tiles are complete
                # dV += (P Z)ᵀ dO and dK += dSᵀ (scale Q), this thread's keys and columns,
                # summed over the block's rows in order
                for d in range(g, Ev, G):
                    clear(acc, SC)
                    for r in range(nv):
                        x = sm[u(do_at + r * DP + d)]
                        for c in range(SC):
                            acc[c] += sm[u(pz_at + r * SP + tc + TC * c)] * x
                    for c in range(SC):
                        sm[dv_at + d * BN + tc + TC * c] += acc[c]
                for e in range(g, E, G):
                    clear(acc, SC)
                    for r in range(nv):
                        x = sm[u(r * QP + e)]
                        for c in range(SC):
                            acc[c] += sm[u(ds_at + r * SP + tc + TC * c)] * x
                    if score_w != one:  # Q staged times scale / score_w (.scale_fold)
                        for c in range(SC):
                            acc[c] *= score_w
                    for c in range(SC):
                        sm[dk_at + e * BN + tc + TC * c] += acc[c]

        for c in range(SC):
            j = tc + TC * c
            if j < nj:
                for e in range(g, E, G):
                    dk[b, kh, k0 + j0 + j, e] = sm[dk_at + e * BN + j]
                for d in range(g, Ev, G):
                    dv[b, kh, k0 + j0 + j, d] = sm[dv_at + d * BN + j]

    return dkv_kernel


_FACTORIES = {"dq": _make_dq_kernel, "dkv": _make_dkv_kernel}


def _kernel(which, dtype, mask_kind, blocks, parts=compile_key(DENSE), mask_grad=False):
    """The kernel ``which`` ("dq" or "dkv"), compiled once per key; ``mask_grad``: the dQ
    kernel writes the mask gradient (the dK/dV kernel never does)."""
    key = (which, np.dtype(dtype), mask_kind, blocks, parts, mask_grad)
    if key not in _kernels:
        _kernels[key] = _FACTORIES[which](*key[1:5], *((mask_grad,) if which == "dq" else ()))
    refuse_raising(_kernels[key], parts.functions)  # the user's functions: see .raising
    return _kernels[key]


def backward(q, k, v, mask, is_causal, scale, dout, out, lse, dq, dk, dv, dropout=None,
             dmask=None, blocks=None, stream=0, recipe=None, block_sizes=(1, 1),
             sequences=None):
    """Launch the attention backward on 4-D device arrays: the dQ kernel, then the dK/dV one,
    each one launch (one grid) for the whole batch, dense or packed.

    Parameters
    ----------
    q, k, v, mask, is_causal, scale
        As given to :func:`~sdpa_numba.gpu.forward` (``q`` (B, Hq, L, E), ``k`` (B, H, S, E),
        ``v`` (B, H, S, Ev), ``mask`` None or (B, Hq, L, S), bool or additive).
    dout, out : device arrays, shape (B, Hq, L, Ev)
        Gradient of the loss with respect to the forward's output, and that output (the
        inputs' dtype).
    lse : device array, shape (B, Hq, L)
        The forward's log-sum-exp, in the compute dtype (float32, or float64 for float64).
    dq, dk, dv : device arrays, shapes (B, Hq, L, E), (B, H, S, E), (B, H, S, Ev)
        Written, in the compute dtype: the gradients; ``dk``, ``dv`` summed over the query
        heads that read each key/value head (grouped-query attention).
    dropout : None or tuple, optional
        The forward's: :func:`sdpa_numba.dropout.params`; the same mask is regenerated.
    dmask : None or device array, shape (B, Hq, L, S), optional
        Written (compute dtype) when given: the gradient of an additive mask, i.e. of the
        final scores (after the recipe's soft cap, ALiBi and score_mod). Full size: reduce
        broadcast dims yourself.
    blocks : Blocks, optional
        Tiling of both kernels; default :data:`~.options.BLOCKS`, else, for each kernel, the
        largest of :data:`~.options.CANDIDATES` that fits the device's shared memory.
    stream : cuda stream, optional
    recipe, block_sizes
        The forward's (see :func:`~sdpa_numba.gpu.forward`). A recipe with a ``score_mod``
        needs its ``score_mod_grad`` (the public layer checks); ALiBi slopes get no gradient.
    sequences : Sequences, optional
        The forward's packed (varlen) batch (see :func:`~sdpa_numba.gpu.forward`): every
        array has batch dim 1, ``dq`` the rows of ``q``, ``dk``, ``dv`` those of ``k``;
        keys of sequences without query rows get zero gradients. No ``mask``, no ``dmask``.

    Returns
    -------
    D : device array, shape (B, Hq, L)
        ``rowsum(dO ∘ O)`` in the compute dtype (the gradient of sinks needs it:
        ``d sink_h = -sum exp(sink_h - lse) D``).

    Notes
    -----
    Arguments are trusted (:func:`sdpa_numba.scaled_dot_product_attention_backward` validates
    them); any non-negative strides; float16, bfloat16, float32 or float64 operands. The
    launches are asynchronous, on ``stream``. Bitwise the same results on every launch.
    """
    q, k, v, mask, dout, out = (storage_view(a) for a in (q, k, v, mask, dout, out))
    n_b, n_hq, L, e = q.shape
    n_h, S = k.shape[1], k.shape[2]
    ev = v.shape[3]
    itemsize = np.dtype(lse.dtype).itemsize
    mask_kind = mask_kind_of(mask)
    m = NO_MASK if mask is None else (mask,)
    rc = resolve_recipe(recipe, is_causal)
    parts = compile_key(rc)
    ra = kernel_args(rc, block_sizes)
    drop = NO_DROPOUT if dropout is None else dropout
    drop = (np.uint64(drop[0]), np.uint64(drop[1]), float(drop[2]), int(drop[3]))
    D = device_array((n_b, n_hq, L), lse.dtype)

    def grid_and_work(n, n_rows, block, by_keys):
        """The grid size and work list of a launch over ``n`` heads (:mod:`.work`)."""
        if sequences is None:
            return n_b * n * ((n_rows + block - 1) // block), no_work()
        items = work_list(sequences, block, by_keys, rc.offset, rc.left, rc.right)
        return items.shape[0] * n, (cuda.to_device(items, stream=stream) if items.shape[0]
                                    else None)

    if n_b * n_hq and L:
        bq, shared = launch_blocks(blocks, itemsize, e, ev, dq_shared_elements)
        grid, work = grid_and_work(n_hq, L, bq.block_m, False)
        if grid:
            _kernel("dq", q.dtype, mask_kind, bq, parts, dmask is not None)[
                grid, bq.threads, stream, shared](q, k, v, m, float(scale), dout, out, lse,
                                                  work, *drop, D, dq,
                                                  NO_MASK if dmask is None else (dmask,),
                                                  ra)
    if n_b * n_h and S:  # also with L == 0: dK and dV are then zeros
        bkv, shared = launch_blocks(blocks, itemsize, e, ev, dkv_shared_elements)
        grid, work = grid_and_work(n_h, S, bkv.block_n, True)
        if grid:
            _kernel("dkv", q.dtype, mask_kind, bkv, parts)[grid, bkv.threads, stream, shared](
                q, k, v, m, float(scale), dout, lse, work, *drop, D, dk, dv, ra)
    return D
