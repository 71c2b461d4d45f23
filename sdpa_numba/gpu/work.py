"""Which rows a thread block of the CUDA forward and backward kernels works on, and where they
live: the kernels' work lists and addressing, for dense batches and packed (varlen) ones.

A **dense** launch covers 4-D ``(B, H, L, D)`` operands: thread block ``bid`` of the grid over
(batch, head, row block) finds its batch entry, head and rows by arithmetic on ``bid``
(:func:`.tiles.grid_block`), every batch entry having ``L`` query rows and ``S`` keys.

A **packed** launch (FlashAttention's ``flash_attn_varlen_func``) covers a ragged batch of
sequences packed back to back along the rows of ``(1, H, total, D)`` views: sequence ``s`` has
query rows ``cu_q[s]:cu_q[s + 1]`` and keys ``cu_k[s]:cu_k[s + 1]``. The host builds a work
list from the cumulative lengths (:func:`work_list`), one row per (sequence, row block): the
sequence ``s``, the block's first row in the sequence, the sequence's first query row ``q0``,
its length ``L``, its first key ``k0``, its key count ``S`` and its alignment offset (``S - L``
bottom-right). Thread block ``bid`` of the grid over (work row, head) reads its row. The
list holds only blocks that exist (no block is launched for the tail of a shorter sequence, as
a grid over the longest one would), sorted costliest first (the blocks that see the most keys
or rows start first, so that the grid's tail is short).

Inside the kernel the rest is addressing: a block reads rows ``q0 + i`` and ``k0 + j`` of the
operands, while the score seam (:mod:`sdpa_numba.score.recipe`: window, alignment, ALiBi,
score_mod, mask_mod, the dropout stream) sees rows ``i`` and keys ``j`` counted from the
sequence's start, the sequence's offset and batch index ``s`` (plus the recipe's and the
dropout's batch offsets). A dense launch is the same code with ``q0 = k0 = 0``, ``L``, ``S``
the operands' and ``s`` the batch index: the kernels take the work list as an argument of
the same type in both cases, empty for a dense launch (:func:`no_work`: a null pointer, no
allocation), and branch on its length at run time, so that dense and packed launches share
one compiled kernel per (dtype, mask kind, tiling, recipe parts).

(The alternative to a work list, a binary search of ``cu_q`` by each block for its sequence,
would save the host the list's few microseconds and copy but costs each block ``log2 B``
dependent global loads, and cannot order blocks by cost.)

What sharing costs a dense kernel (PTX for cc 9.0, ``scripts/ptx_check.py``, against the
kernels before packed launches): the addressing adds some 70 to 100 instructions of setup per
kernel (some float64 kernels: up to 3 % more); in most kernels it also changes LLVM's loop
unrolling (the forward's online-softmax exponential loop is no longer versioned three ways;
the dQ, dK and dV accumulation loops over head-dim columns are no longer unrolled), which
leaves up to 17 % fewer instructions (float32, float16, bfloat16: 0.2-17 % fewer; float64:
8 % fewer to 3 % more). Not yet timed on a GPU.
"""

from collections import namedtuple

import numpy as np
from numba import cuda

from ..score.recipe import key_range
from .tiles import grid_block, query_block

#: A packed batch as the launchers take it: ``cu_q``, ``cu_k`` int64 NumPy arrays of shape
#: ``(B + 1,)`` (the cumulative sequence lengths, checked by the public layer) and whether the
#: window (causality) and ALiBi are aligned per sequence to the bottom right.
Sequences = namedtuple("Sequences", ["cu_q", "cu_k", "bottom_right"])

#: Columns of a work list's rows.
SEQ, FIRST, Q0, LQ, K0, LK, OFFSET = range(7)
N_COLUMNS = 7


def no_work():
    """The work list of a dense launch: empty (a device array of no size holds no memory)."""
    return cuda.device_array((0, N_COLUMNS), np.int64)


def work_list(seqs, block, by_keys, offset, left, right):
    """The work list of packed batch ``seqs`` (a :class:`Sequences`) as an int64 NumPy array
    of shape ``(n, N_COLUMNS)``: one row per block of ``block`` query rows (``by_keys``:
    keys) of each sequence that has any, costliest first.

    ``offset`` (the recipe's, used unless ``seqs.bottom_right``), ``left``, ``right``: the
    window in the kernels' encoding (:mod:`sdpa_numba.score.recipe`), which sets a block's
    cost: the keys its rows see (``by_keys``: the query rows that see its keys). Ties keep
    the sequences' order.
    """
    cu_q = np.asarray(seqs.cu_q, np.int64)
    cu_k = np.asarray(seqs.cu_k, np.int64)
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    off = lk - lq if seqs.bottom_right else np.full(lq.shape, offset, np.int64)
    n = lk if by_keys else lq
    per_seq = (n + block - 1) // block
    # Each sequence's row, repeated for its blocks (one repeat of all columns: faster than a
    # gather per column), then the blocks' first rows.
    table = np.repeat(np.stack([np.arange(n.shape[0], dtype=np.int64), np.zeros_like(n),
                                cu_q[:-1], lq, cu_k[:-1], lk, off], axis=1), per_seq, axis=0)
    first = (np.arange(table.shape[0], dtype=np.int64)
             - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * block
    table[:, FIRST] = first
    last = np.minimum(first + block, table[:, LK if by_keys else LQ]) - 1
    o = table[:, OFFSET]
    if by_keys:  # the rows i with j - offset - right <= i <= j - offset + left (query_range)
        lo = np.maximum(first - o - right, 0)
        hi = np.minimum(last - o + left + 1, table[:, LQ])
    else:  # the keys j with i' - left <= j <= i' + right (key_range)
        lo = np.maximum(first + o - left, 0)
        hi = np.minimum(last + o + right + 1, table[:, LK])
    order = np.argsort(lo - hi, kind="stable")  # the most keys (rows) first
    return np.ascontiguousarray(table[order])


# --- inside the kernels -------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def work_row(work, t):
    """Row ``t`` of a packed launch's work list: ``(s, first, q0, L, k0, S, offset)``."""
    return (work[t, SEQ], work[t, FIRST], work[t, Q0], work[t, LQ], work[t, K0], work[t, LK],
            work[t, OFFSET])


@cuda.jit(device=True, inline="always")
def query_work(q, k, bm, work, offset):
    """``(b, s, h, kh, i0, q0, L, k0, S, offset)`` of this thread block in a grid over (work
    row, query head) of a packed launch, else over (batch, query head, block of ``bm`` rows)
    (:func:`.tiles.query_block`): the batch entry ``b`` of the operands, the batch index ``s``
    the score seam sees, the query head and its key/value head, the block's first row ``i0``
    in its sequence, the sequence's rows ``q0 .. q0 + L - 1`` and keys ``k0 .. k0 + S - 1``
    in the operands, and its alignment offset (a dense launch: ``offset``)."""
    # One return statement: NVVM refuses the debug info (lineinfo) of two.
    if work.shape[0] == 0:
        b, h, kh, i0 = query_block(q, k, bm)
        s = b
        q0 = 0
        n_q = q.shape[2]
        k0 = 0
        n_k = k.shape[2]
    else:
        n_heads = q.shape[1]
        t = cuda.blockIdx.x // n_heads
        h = cuda.blockIdx.x - t * n_heads
        kh = h // (n_heads // k.shape[1])
        b = 0
        s, i0, q0, n_q, k0, n_k, offset = work_row(work, t)
    return b, s, h, kh, i0, q0, n_q, k0, n_k, offset


@cuda.jit(device=True, inline="always")
def key_work(q, k, bn, work, offset):
    """``(b, s, kh, j0, q0, L, k0, S, offset)`` of this thread block in a grid over (work
    row, key/value head) of a packed launch, else over (batch, key/value head, block of
    ``bn`` keys): as :func:`query_work`, with the block's first key ``j0`` in its sequence."""
    if work.shape[0] == 0:
        n_k = k.shape[2]
        b, kh, kb = grid_block(k.shape[1], (n_k + bn - 1) // bn)
        s = b
        j0 = kb * bn
        q0 = 0
        n_q = q.shape[2]
        k0 = 0
    else:
        n_heads = k.shape[1]
        t = cuda.blockIdx.x // n_heads
        kh = cuda.blockIdx.x - t * n_heads
        b = 0
        s, j0, q0, n_q, k0, n_k, offset = work_row(work, t)
    return b, s, kh, j0, q0, n_q, k0, n_k, offset


@cuda.jit(device=True, inline="always")
def key_blocks(rc, i0, bm, L, S, bn):
    """``(i_last, j_first, j_end)`` of the query block of rows ``i0 .. i_last`` (at most
    ``bm``, less past row ``L``): the blocks of ``bn`` keys it visits, from ``j_first`` (a
    multiple of ``bn``) up to key ``j_end`` (exclusive), are those that some row of it sees
    under recipe ``rc``'s window (:func:`~sdpa_numba.score.recipe.key_range`; ``(0, 0)`` when
    none: no block). The forward's and the dQ kernel's work: they go over the same blocks."""
    i_last = min(i0 + bm, L) - 1
    j_begin, j_end = key_range(rc, i0, i_last, S)  # (0, 0) when none: no block
    return i_last, j_begin - j_begin % bn, j_end
