"""Device functions shared by the CUDA forward and backward kernels.

They stage tiles of the operands in shared memory and compute one thread's register tile of a
product of two shared tiles. (Scores are masked and modified by the score seam only:
:mod:`sdpa_numba.score.recipe`, with :mod:`.variants` for the attention mask.) All are inlined into the
kernels (``inline="always"``), which pass them their compile-time constants (tile sizes, thread
counts): after inlining, the compiler sees constants again, unrolls the loops over them and
keeps the register tiles in registers.

Tile layout (as in :mod:`.forward`): one dynamic shared array of the compute dtype holds every
tile at its own offset; rows of tiles read down a column are padded to an odd length, so that
threads reading consecutive rows hit distinct shared-memory banks.
"""

import numba
from numba import cuda

from .storage import load


@cuda.jit(device=True, inline="always")
def u(i):
    """``i`` as an unsigned index: Numba then drops its negative-index wraparound, three
    64-bit integer instructions per shared-memory load in the inner loops."""
    return numba.uint64(i)


@cuda.jit(device=True, inline="always")
def load_tile(src, b, h, row0, n_valid, n_rows, n_cols, n_pad, factor, sm, at, row_step,
              col_step, tid, nt):
    """Stage rows ``row0 ...`` of ``src[b, h]`` in shared memory, in the compute dtype::

        sm[at + r * row_step + c * col_step] = factor * src[b, h, row0 + r, c]

    for ``r < n_rows`` and ``c < n_pad``, with zeros for rows ``r >= n_valid`` and columns
    ``c >= n_cols``: padding must be zeros, never stale memory (``0 * NaN`` is NaN).
    ``row_step = 1`` stores the tile transposed. ``factor`` is of the compute dtype (the dtype
    of ``sm``). All ``nt`` threads of the block take part; the caller synchronizes.
    """
    if n_pad == 0:
        return
    # (r, c) walks the tile in steps of nt elements without a 64-bit division per element:
    # it advances by (nt // n_pad, nt % n_pad), carrying into r.
    r = tid // n_pad
    c = tid - r * n_pad
    r_step = nt // n_pad
    c_step = nt - r_step * n_pad
    ct = sm.dtype.type
    while r < n_rows:
        x = ct(0)
        if r < n_valid and c < n_cols:
            x = ct(load(src[b, h, row0 + r, c])) * factor
        sm[at + r * row_step + c * col_step] = x
        r += r_step
        c += c_step
        if c >= n_pad:
            c -= n_pad
            r += 1


@cuda.jit(device=True, inline="always")
def grid_block(n_heads, n_blocks):
    """``(b, h, n)``: batch, head and block index of this thread block in a grid over
    (batch, head, block of ``n_blocks``), blocks fastest."""
    bid = cuda.blockIdx.x
    bh = bid // n_blocks
    return bh // n_heads, bh % n_heads, bid % n_blocks


@cuda.jit(device=True, inline="always")
def query_block(q, k, bm):
    """``(b, h, kh, i0)``: batch, query head, its key/value head and first row of this thread
    block in a grid over (batch, query head, block of ``bm`` query rows). The heaviest query
    blocks (the last, under causal) go first, so that the tail of the grid is short."""
    n_heads, L = q.shape[1], q.shape[2]
    nqb = (L + bm - 1) // bm
    b, h, qb = grid_block(n_heads, nqb)
    return b, h, h // (n_heads // k.shape[1]), (nqb - 1 - qb) * bm


@cuda.jit(device=True, inline="always")
def tile_thread(tcn):
    """``(tid, g, tc)``: this thread, its row group ``g`` (rows ``g * rows_per_thread ...`` of
    the score tiles) and its first column ``tc`` (then ``tc + tcn``, ...) among the ``tcn``
    threads of the group."""
    tid = cuda.threadIdx.x
    return tid, tid // tcn, tid % tcn


@cuda.jit(device=True, inline="always")
def tile_product(sm, a_at, a_ld, bt_at, bt_ld, n, r0, tc, tcn, rm, sc, breg, acc):
    """Add one thread's ``rm x sc`` register tile of ``A Bᵀ`` from two shared tiles::

        acc[a * sc + c] += sum over e < n, in order, of
                           sm[a_at + (r0 + a) * a_ld + e] * sm[bt_at + e * bt_ld + tc + tcn * c]

    ``A`` is stored by rows (rows ``r0 ... r0 + rm - 1`` are the thread's), ``B`` transposed
    (the thread's columns ``tc, tc + tcn, ...``: consecutive threads read consecutive
    addresses). ``breg`` (``sc`` elements) and ``acc`` (``rm * sc``) are local arrays; zero
    ``acc`` first (:func:`clear`) for the product itself.
    """
    for e in range(n):
        for c in range(sc):
            breg[c] = sm[u(bt_at + e * bt_ld + tc + tcn * c)]
        for a in range(rm):
            x = sm[u(a_at + (r0 + a) * a_ld + e)]
            for c in range(sc):
                acc[a * sc + c] += x * breg[c]


@cuda.jit(device=True, inline="always")
def clear(acc, n):
    """``acc[:n] = 0`` (a local array)."""
    for t in range(n):
        acc[t] = 0
