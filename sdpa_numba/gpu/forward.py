"""The attention forward on CUDA, FlashAttention-2 style, without tensor cores.

One thread block computes ``block_m`` query rows of one (batch, head), or of one (sequence,
head) of a packed (varlen) batch: the whole batch is one grid either way, each block's rows
found by :mod:`.work` (work list and addressing). Its Q tile, pre-scaled, stays in shared
memory; key/value blocks of ``block_n`` keys are staged through shared memory one after the
other (keys transposed, so that threads of a warp read consecutive keys). For each
key block the threads compute the score tile, each a small register tile of it; the online
softmax of each row runs on one thread (:func:`~.online_softmax.online_softmax_update`); then
each thread folds ``p · V`` into its register tile of the output. Shared memory is
O(block · head dim); nothing of size L x S exists anywhere.

Scores are formed by the score seam (:mod:`sdpa_numba.score.recipe`; the kernel's arguments
carry a recipe, :mod:`.variants`): the key blocks a query block visits are those of the
recipe's window (:func:`~sdpa_numba.score.recipe.key_range`: causal and windowed attention
never load the others), less those a block mask marks empty; a tile the window covers
(:func:`~sdpa_numba.score.recipe.window_covers`) and no mask_mod cuts skips the per-element
tests; soft cap, ALiBi and score_mod change each score (``modified_score``), window and
mask_mod mask it (``keeps``); sinks join each row's denominator at the end (``fold_sink``).

With dropout, each thread drops its entries of the probability tile after the online-softmax
step (so ``l`` and ``lse`` are those of the softmax before dropout) with the counter-based stream
of :mod:`.dropout`, the same bits as the CPU kernels, and scales the kept ones by ``1 / (1 - p)``.

Each output element is accumulated by one thread over keys in a fixed order, so results do not
depend on scheduling: runs are bitwise reproducible.

Rows of the shared tiles are padded to an odd length so that threads reading a column of a tile
hit distinct shared-memory banks.
"""

import math

import numba
import numpy as np
from numba import cuda
from numba.np import numpy_support

from . import options
from .arrays import is_simulated_mode
from .dropout import NO_DROPOUT, dropout_factor, row_keys
from ..score.recipe import BLOCK_EMPTY, CAUSAL, DENSE, fold_sink, keeps, modified_score
from .online_softmax import online_softmax_lse, online_softmax_update
from .raising import refuse_raising
from .scale_fold import refold_tile
from .options import CANDIDATES, FASTMATH, Blocks
from .storage import storage_view, store
from .tiles import clear, load_tile, tile_product, tile_thread
from .variants import NO_MASK, arg_type, compile_key, kernel_args, masked, modifies, recipe_of, \
    sink_of, tile_visit
from .work import key_blocks, no_work, query_work, work_list

_kernels = {}

#: Numba types of the kernels' dropout arguments (seed, threshold, inv_keep, batch_offset).
DROPOUT_ARGS = (numba.uint64, numba.uint64, numba.float64, numba.int64)

#: Numba type of the kernels' work list (:mod:`.work`; empty for a dense launch).
WORK = numba.types.Array(numba.int64, 2, "A")


def arr(t, nd):
    """An 'A'-layout (any strides) array type: one compilation whatever the layout."""
    return numba.types.Array(t, nd, "A")


def operand_types(dtype, mask_kind):
    """Numba types of a storage ``dtype``: (storage, compute, mask argument).

    Numba cannot pass None to a kernel: the mask travels as a tuple, empty without a mask
    (:data:`.variants.NO_MASK`; a kernel argument of no size), else of the one mask.
    """
    st = numpy_support.from_dtype(dtype)
    ct = numba.float64 if st == numba.float64 else numba.float32
    if mask_kind == "none":
        return st, ct, numba.types.Tuple(())
    return st, ct, numba.types.UniTuple(arr(numba.boolean, 4) if mask_kind == "bool"
                                        else arr(st, 4), 1)


def _signature(dtype, mask_kind, parts=compile_key(DENSE)):
    """Every array 'A' (any strides): one compilation per dtype, mask kind and recipe parts
    (:func:`.variants.compile_key`), whatever the operands' layouts (each compilation takes
    seconds). Dropout is four runtime arguments (see :mod:`.dropout`), the recipe one more
    (:class:`.variants.RecipeArg`: its numbers, window, alignment and soft cap, are run-time
    values), the work list (:mod:`.work`) one more: dense and packed (varlen) launches share
    the compilation."""
    st, ct, mask = operand_types(dtype, mask_kind)
    return numba.void(arr(st, 4), arr(st, 4), arr(st, 4), mask, numba.float64,
                      arr(st, 4), arr(ct, 3), WORK, *DROPOUT_ARGS, arg_type(parts, ct)), ct


def jit_options(threads):
    """Bounding the threads lets the compiler budget registers for them; the simulator has no
    such option."""
    return {} if is_simulated_mode() else {"launch_bounds": threads}


def _make_kernel(dtype, mask_kind, blocks, dc, parts=compile_key(DENSE)):
    """The forward kernel for storage ``dtype``, mask kind ("none", "bool" or "additive"),
    tiling ``blocks``, ``dc`` output columns per thread and recipe parts ``parts``
    (:func:`.variants.compile_key`: the user's functions are compiled in)."""
    sig, ct = _signature(dtype, mask_kind, parts)
    BM, BN, NT, RM = blocks.block_m, blocks.block_n, blocks.threads, blocks.rows_per_thread
    TC = blocks.threads_per_row
    SC = BN // TC  # score columns per thread
    DC = dc  # output columns per thread
    NS = RM * SC
    NA = RM * DC
    VP = DC * TC  # V tile row length: zero-padded to whole thread columns
    SP = BN + 1  # score and Kᵀ tile row lengths
    CT = ct
    HAS_SINKS, HAS_BM = parts.has("sinks"), parts.has("block_mask")
    SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD = parts.functions
    ELEMENT_MASK = MASK_MOD is not None  # a mask_mod: tested per element unless a block is full

    @cuda.jit(sig, fastmath=FASTMATH, **jit_options(NT))
    def kernel(q, k, v, mask, scale, out, lse, work, seed, threshold, inv_keep, b_off, ra):
        E = q.shape[3]
        Ev = v.shape[3]
        # Operand rows q0 + i, keys k0 + j; the score seam sees i, j, batch index bs.
        b, bs, h, kh, i0, q0, L, k0, S, offset = query_work(q, k, BM, work, ra.offset)
        rc = recipe_of(ra, offset, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD)
        tid, g, tc = tile_thread(TC)
        r0 = g * RM  # this thread's first row in the tile; tc: its column in the row group

        QP = E | 1
        kt_at = BM * QP
        vs_at = kt_at + E * SP
        ss_at = vs_at + BN * VP
        m_at = ss_at + BM * SP
        l_at = m_at + BM
        a_at = l_at + BM
        sm = cuda.shared.array(0, CT)
        zero = CT(0)
        one = CT(1)
        neg_inf = CT(-math.inf)

        load_tile(q, b, h, q0 + i0, L - i0, BM, E, E, CT(scale), sm, 0, QP, 1, tid, NT)
        # 1, or the power of two taken out of an overflowing fold (the scores' factor)
        score_w = refold_tile(q, b, h, q0 + i0, L - i0, BM, E, scale, sm, 0, QP, tid, NT)
        for r in range(tid, BM, NT):
            sm[m_at + r] = neg_inf
            sm[l_at + r] = zero
        acc = cuda.local.array(NA, CT)
        clear(acc, NA)
        pv = cuda.local.array(NA, CT)  # one key block's P·V, summed from zero
        sreg = cuda.local.array(NS, CT)
        kreg = cuda.local.array(SC, CT)
        vreg = cuda.local.array(DC, CT)
        # Dropout (inv_keep == 1: off): the stream's keys of this thread's rows.
        drop_on = inv_keep != 1.0
        inv = CT(inv_keep)
        rk = cuda.local.array(RM, numba.uint64)
        if drop_on:
            row_keys(rk, RM, seed, b_off + bs, h, i0 + r0)

        # The block's key blocks (aligned to BN): those some row of the block sees under the
        # window (causal: none above the diagonal), less those the block mask says are empty.
        i_last, j_first, j_end = key_blocks(rc, i0, BM, L, S, BN)
        mod_on = modifies(rc)
        for j0 in range(j_first, j_end, BN):
            nj = min(BN, j_end - j0)
            # Per-element tests only where the window cuts the tile or a mask_mod may.
            state, test = tile_visit(rc, HAS_BM, ELEMENT_MASK, ra.bq, ra.bk, bs, h, i0, i_last,
                                     j0, j0 + nj - 1)
            if state == BLOCK_EMPTY:
                continue  # uniform across the thread block
            cuda.syncthreads()  # the previous block's tiles are consumed
            load_tile(k, b, kh, k0 + j0, nj, BN, E, E, one, sm, kt_at, 1, SP, tid, NT)  # Kᵀ
            # V rows zero-padded to whole thread columns
            load_tile(v, b, kh, k0 + j0, nj, BN, Ev, VP, one, sm, vs_at, VP, 1, tid, NT)
            cuda.syncthreads()

            clear(sreg, NS)
            tile_product(sm, 0, QP, kt_at, SP, E, r0, tc, TC, RM, SC, kreg, sreg)
            if score_w != one:
                for t in range(NS):
                    sreg[t] *= score_w
            for a in range(RM):
                i = i0 + r0 + a
                for c in range(SC):
                    j = tc + TC * c
                    s = sreg[a * SC + c]
                    if j >= nj:
                        s = neg_inf
                    elif i < L:
                        # the score seam: soft cap, ALiBi, score_mod; the attention mask;
                        # window, causality and mask_mod
                        if mod_on:  # (CT: the simulator's CPU-jitted calls return floats)
                            s = CT(modified_score(rc, s, bs, h, i, j0 + j))
                        s = masked(s, mask, b, h, q0 + i, k0 + j0 + j, neg_inf)
                        if test and not keeps(rc, bs, h, i, j0 + j):
                            s = neg_inf
                    sm[ss_at + (r0 + a) * SP + j] = s
            cuda.syncthreads()

            for r in range(tid, BM, NT):
                m, l, alpha = online_softmax_update(sm, ss_at + r * SP, nj, sm[m_at + r],
                                                    sm[l_at + r])
                sm[m_at + r] = m
                sm[l_at + r] = l
                sm[a_at + r] = alpha
            cuda.syncthreads()

            if drop_on:
                # Dropout of this thread's tile entries, now probabilities: in P·V only, so
                # that l keeps the sum before dropout (lse is that of the undropped softmax).
                for a in range(RM):
                    for c in range(SC):
                        j = tc + TC * c
                        if j < nj:
                            t = ss_at + (r0 + a) * SP + j
                            sm[t] *= dropout_factor(rk[a], j0 + j, threshold, inv, zero)
                cuda.syncthreads()

            # acc = alpha acc + P V, the block's P V summed on its own first: added one key at
            # a time to the running acc, terms lost their low bits to it over long sequences.
            clear(pv, NA)
            tile_product(sm, ss_at, SP, vs_at, VP, nj, r0, tc, TC, RM, DC, vreg, pv)
            for a in range(RM):
                alpha = sm[a_at + r0 + a]
                for c in range(DC):
                    acc[a * DC + c] = alpha * acc[a * DC + c] + pv[a * DC + c]

        cuda.syncthreads()  # the last block's m and l are written
        sink = sink_of(rc, h)  # -inf without sinks
        for a in range(RM):
            i = i0 + r0 + a
            if i < L:
                l = sm[l_at + r0 + a]
                alpha = one
                if HAS_SINKS:  # the sink joins the denominator
                    _, l, alpha = fold_sink(sm[m_at + r0 + a], l, sink)
                    l, alpha = CT(l), CT(alpha)
                for c in range(DC):
                    d = tc + TC * c
                    if d < Ev:
                        if l == 0:  # every key masked (or S == 0): zeros, as torch
                            out[b, h, q0 + i, d] = store(zero, out)
                        elif HAS_SINKS:
                            out[b, h, q0 + i, d] = store(alpha * acc[a * DC + c] / l, out)
                        else:
                            out[b, h, q0 + i, d] = store(acc[a * DC + c] / l, out)
        for t in range(tid, BM, NT):
            if i0 + t < L:
                m = sm[m_at + t]
                l = sm[l_at + t]
                if HAS_SINKS:
                    m, l, _ = fold_sink(m, l, sink)
                    m, l = CT(m), CT(l)
                lse[b, h, q0 + i0 + t] = online_softmax_lse(m, l)

    return kernel


def _kernel(dtype, mask_kind, blocks, dc, parts=compile_key(DENSE)):
    key = (np.dtype(dtype), mask_kind, blocks, dc, parts)
    if key not in _kernels:
        _kernels[key] = _make_kernel(*key)
    refuse_raising(_kernels[key], parts.functions)  # the user's functions: see .raising
    return _kernels[key]


def device_limits():
    """``(shared memory bytes, threads)`` a thread block may use on the current device.

    The shared memory figure is the default per-block limit (48 KiB on current GPUs), not the
    larger opt-in limit, which needs a per-kernel attribute Numba does not set. The CUDA
    simulator has no such attributes: it gets the same defaults as a real device.
    """
    dev = cuda.get_current_device()
    return (int(getattr(dev, "MAX_SHARED_MEMORY_PER_BLOCK", 48 * 1024)),
            int(getattr(dev, "MAX_THREADS_PER_BLOCK", 1024)))


def choose_blocks(itemsize, e, ev, elements=Blocks.shared_elements):
    """The largest tiling of :data:`~.options.CANDIDATES` that fits the device's limits.

    ``elements(blocks, e, ev)``: the shared memory a kernel needs, in elements of
    ``itemsize`` bytes (default: the forward's).
    """
    shared, threads = device_limits()
    for blocks in CANDIDATES:
        if blocks.threads <= threads and elements(blocks, e, ev) * itemsize <= shared:
            return blocks
    raise ValueError(f"head dims E={e}, Ev={ev} are too large for the CUDA kernel: even the "
                     f"smallest tiling needs more than the {shared} bytes of shared memory "
                     f"a block may use")


def launch_blocks(blocks, itemsize, e, ev, elements=Blocks.shared_elements):
    """The tiling of a launch and its shared memory in bytes: ``blocks``, else
    :data:`~.options.BLOCKS`, else :func:`choose_blocks`'s; ValueError if it does not fit."""
    if blocks is None:
        blocks = options.BLOCKS or choose_blocks(itemsize, e, ev, elements)
    if not isinstance(blocks, Blocks):
        raise TypeError(f"blocks must be a Blocks, got {type(blocks).__name__}")
    shared = elements(blocks, e, ev) * itemsize
    limit, max_threads = device_limits()
    if shared > limit or blocks.threads > max_threads:
        raise ValueError(f"{blocks} needs {shared} bytes of shared memory and {blocks.threads} "
                         f"threads for E={e}, Ev={ev}; a block may have {limit} and "
                         f"{max_threads} on this device")
    return blocks, shared


def mask_kind_of(mask):
    """"none", "bool" or "additive" for a mask argument (None or a device array)."""
    if mask is None:
        return "none"
    return "bool" if np.dtype(mask.dtype) == np.bool_ else "additive"


def forward(q, k, v, mask, is_causal, scale, out, lse, blocks=None, stream=0, dropout=None,
            recipe=None, block_sizes=(1, 1), sequences=None):
    """Launch the batched attention forward on 4-D device arrays: one launch (one grid) for
    the whole batch, dense or packed.

    Parameters
    ----------
    q : device array, shape (B, Hq, L, E)
    k : device array, shape (B, H, S, E)
        ``Hq`` must be a multiple of ``H``; query head ``h`` reads key/value head
        ``h // (Hq // H)`` (grouped-query attention; ``H == Hq`` is plain attention).
    v : device array, shape (B, H, S, Ev)
    mask : None or device array, shape (B, Hq, L, S)
        bool (True takes part) or of the inputs' dtype (added to the scores). Broadcast views
        with zero strides are read in place.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (in the recipe's aligned frame: top-left without a
        recipe).
    scale : float
        Multiplies ``q · k``.
    out : device array, shape (B, Hq, L, Ev)
        Written.
    lse : device array, shape (B, Hq, L)
        Written; its dtype is the compute dtype: float32 for 16-bit and float32 inputs,
        float64 for float64. With dropout, that of the softmax before dropout; with sinks, it
        includes them.
    blocks : Blocks, optional
        Tiling; default :data:`~.options.BLOCKS`, else the largest that fits the device.
    stream : cuda stream, optional
    dropout : None or tuple, optional
        ``(seed, threshold, inv_keep, batch_offset)`` of :func:`sdpa_numba.dropout.params`:
        drops probability ``(b, h, i, j)`` (``b``: ``batch_offset`` plus the index into this
        launch's batch dim) as the CPU kernels do, bit for bit (:mod:`.dropout`), and scales
        the kept ones by ``inv_keep``. None: no dropout.
    recipe : Recipe, optional
        The score's variants (:func:`sdpa_numba.score.recipe.recipe`: window, alignment, soft
        cap, ALiBi, sinks, score_mod, mask_mod and their mod_args, block mask), its
        ``batch_offset`` that of this launch; arrays in the compute dtype, NumPy (copied) or
        device arrays. None: from ``is_causal`` alone. ``is_causal`` applies on top of it
        (right side of the window at most 0).
    block_sizes : (int, int), optional
        Query rows and keys per block of the recipe's block mask.
    sequences : Sequences, optional
        A packed (varlen) batch (:class:`~.work.Sequences`: ``cu_q``, ``cu_k`` int64 NumPy
        arrays of shape ``(n + 1,)``, ``bottom_right``): ``q``, ``k``, ``v``, ``out``,
        ``lse`` have batch dim 1 and sequence ``s`` is rows ``cu_q[s]:cu_q[s + 1]`` of
        ``q``, ``out`` and ``lse`` and ``cu_k[s]:cu_k[s + 1]`` of ``k`` and ``v``, attended
        on its own (:mod:`.work`): rows and keys count from the sequence's start, the
        window is aligned per sequence (``bottom_right``: offset ``S_s - L_s``, else the
        recipe's), and the recipe's functions, ALiBi and the dropout stream see batch index
        ``s`` (plus the batch offsets). No ``mask``, no block mask. Rows of sequences without
        keys get zeros and lse ``-inf``. None: a dense batch.

    Notes
    -----
    Inputs are float16, bfloat16 (``ml_dtypes.bfloat16``; computed in float32, read and
    written as int16 bit patterns, see :mod:`.storage`), float32 or float64 Numba device
    arrays with any non-negative strides (:func:`sdpa_numba.gpu.arrays.adopt` wraps CuPy
    arrays and torch tensors as such). Arguments are trusted:
    :func:`sdpa_numba.scaled_dot_product_attention` validates them. The launch is
    asynchronous, on ``stream``. One compiled kernel per (dtype, mask kind, tiling, optional
    recipe parts and user functions); the window, alignment and soft cap are run-time values,
    and so is ``sequences`` (dense and packed launches share the compilation).
    """
    q, k, v, mask, out = (storage_view(a) for a in (q, k, v, mask, out))
    n_bh, L, e = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
    ev = v.shape[3]
    if n_bh == 0 or L == 0:
        return
    rc = resolve_recipe(recipe, is_causal)
    blocks, shared = launch_blocks(blocks, np.dtype(lse.dtype).itemsize, e, ev)
    parts = compile_key(rc)
    kernel = _kernel(q.dtype, mask_kind_of(mask), blocks, blocks.out_cols(ev), parts)
    if sequences is None:
        work = no_work()
        grid = n_bh * ((L + blocks.block_m - 1) // blocks.block_m)
    else:
        items = work_list(sequences, blocks.block_m, False, rc.offset, rc.left, rc.right)
        if items.shape[0] == 0:
            return
        work = cuda.to_device(items, stream=stream)
        grid = items.shape[0] * n_bh
    seed, threshold, inv_keep, b_off = NO_DROPOUT if dropout is None else dropout
    kernel[grid, blocks.threads, stream, shared](
        q, k, v, NO_MASK if mask is None else (mask,), float(scale), out, lse, work,
        np.uint64(seed), np.uint64(threshold), float(inv_keep), int(b_off),
        kernel_args(rc, block_sizes))


def resolve_recipe(recipe, is_causal):
    """The recipe a launch runs: ``recipe`` (None: plain attention) with ``is_causal`` folded
    into its window's right side."""
    if recipe is None:
        return CAUSAL if is_causal else DENSE
    if is_causal and recipe.right > 0:
        recipe = recipe._replace(right=np.int64(0))
    return recipe
