"""The register-tiled tile product at the heart of both attention matmuls.

``c[0:rows, 0:NR] = a[0:rows, 0:K] @ b[0:K, 0:NR]`` (optionally ``+ diag(alpha) @ c``, or with
:func:`tile_product_lanes` ``+ c @ diag(alpha)``), on raw pointers with leading dimensions, for
``rows`` = MR (4, the backward) or MR_WIDE (6, the forward; 4 for the forward's last value
rows). The rows x NR accumulator is a fixed-size stack buffer indexed with constant bounds:
once LLVM unrolls the loops it lives in vector registers (16 or 24 zmm for float32), which is
what makes this run near the core's FMA peak. A Numba array would stay in
memory. Rows are independent: row r of c depends only on row r of a, in a fixed order, so the
result of a row never depends on which tile or thread computed it.
"""

from numba import njit, types
from numba.extending import overload

from ._llvm import prefer_512_bit, ptr_add, stack_buffer
from .options import CALLED, INLINE

#: Rows of the backward's micro-tiles.
MR = 4
#: Rows of the forward's micro-tiles: a 6 x 64 float32 accumulator takes 24 of the 32 zmm
#: registers and needs 10 loads per 24 FMAs, against 8 per 16 at 4 x 64. The forward's 64-row
#: blocks are covered as ten tiles of 6 rows and one of 4.
MR_WIDE = 6
#: Columns of a micro-tile (keys for Q·Kᵀ, value dims for P·V). 64 measured fastest: 4 zmm
#: per row for float32. (NR = 32 kept the accumulator in memory in our measurements.)
NR = 64

_acc_buffer = stack_buffer(MR_WIDE * NR)


@njit(**INLINE)
def _set(acc, c, ldc, alpha, mr):
    pass


@njit(**INLINE)
def _row_fold(acc, c, ldc, alpha, mr):
    for r in range(mr):
        cr = ptr_add(c, r * ldc)
        ar = alpha[r]
        for j in range(NR):
            acc[r * NR + j] += ar * cr[j]


@njit(**INLINE)
def _lane_fold(acc, c, ldc, alpha, mr):
    for r in range(mr):
        cr = ptr_add(c, r * ldc)
        for j in range(NR):
            acc[r * NR + j] += alpha[j] * cr[j]


def _make_pass(fold):
    """A register pass over ``mr`` rows: the product is summed from zero in registers, then
    ``fold`` writes it into ``c`` (``c = a @ b`` or ``c = alpha ∘ c + a @ b``).

    The old ``c`` is folded in once, at the end, rather than loaded as the sum's start: over
    a long sequence of calls (the forward's P·V over S / BN key blocks, the backward's dK,
    dV, dQ over blocks), each call's few terms are summed among themselves, and only their
    sum is added to the running total. Added one at a time to a running total, the terms
    lost their low bits to it: at S = 2**24 equal scores gave 3.667 for 3.0. Same loads,
    stores and FMAs. (The old ``c`` is folded into the register tile, which is then stored:
    storing into ``c`` while loading ``alpha``, which LLVM cannot prove apart, could keep the
    fold scalar.)
    """

    @njit(**INLINE)
    def tile_pass(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, mr):
        acc = _acc_buffer(a)
        for t in range(mr * NR):
            acc[t] = 0
        for kk in range(k_len):
            bk = ptr_add(b, kk * ldb)
            for r in range(mr):
                a_rk = a[r * a_rs + kk * a_ks]
                for j in range(NR):
                    acc[r * NR + j] += a_rk * bk[j]
        fold(acc, c, ldc, alpha, mr)
        for r in range(mr):
            cr = ptr_add(c, r * ldc)
            for j in range(NR):
                cr[j] = acc[r * NR + j]

    return tile_pass


_set_pass = _make_pass(_set)
_add_pass = _make_pass(_row_fold)
_lane_add_pass = _make_pass(_lane_fold)


@njit(**INLINE)
def tile_product(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows=MR):
    """``c = a @ b`` over a rows x NR tile, or ``c = alpha[:, None] * c + a @ b``.

    Parameters
    ----------
    a, b, c : CPointer
        ``a[r, kk]`` is at ``a + r * a_rs + kk * a_ks`` (either layout: one scalar is
        broadcast per step), ``b`` is row-major k_len x NR (leading dimension ``ldb``),
        ``c`` is row-major rows x NR (``ldc``). All of the compute dtype.
    k_len : int
        The reduction length.
    alpha : CPointer or None
        Per-row factors of the old ``c``; None overwrites ``c``.
    rows : int
        Rows of the tile, a compile-time constant: ``MR`` or ``MR_WIDE`` (float64 tiles are
        done 2 rows at a time).
    """
    prefer_512_bit()
    _passes(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows)


@njit(**INLINE)
def tile_product_lanes(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
    """``c = alpha[None, :] * c + a @ b``: :func:`tile_product` with one factor per column
    (``alpha`` holds NR of them) instead of one per row."""
    prefer_512_bit()
    _lane_passes(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows)


def _make_passes(lane_alpha):
    """The register passes of :func:`tile_product` (``lane_alpha`` False: one factor of alpha
    per row) or :func:`tile_product_lanes` (True: one per column), for jitted code only."""

    def passes(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
        raise NotImplementedError("the register passes are only callable from jitted code")

    @overload(passes, inline="always", **CALLED)
    def _ol_passes(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
        # Chosen by type when the caller is typed, so that no code for the other dtype's
        # passes or the other kind of start reaches LLVM (it did, as dead branches, and
        # doubled the forward's compile time).
        scaled = not isinstance(alpha, types.NoneType)
        tile_pass = (_lane_add_pass if lane_alpha else _add_pass) if scaled else _set_pass
        if a.dtype != types.float64:
            # float32 rows are 4 zmm each: the whole tile (4 or 6 rows) is one pass.
            def one_pass(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
                tile_pass(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows)

            return one_pass

        # float64 rows are 8 zmm each: 2 rows a pass (4 would need all 32 zmm and spill;
        # splitting columns instead kept the accumulator in memory in our measurements).
        if scaled and not lane_alpha:
            def row_pairs(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
                for r0 in range(0, rows, 2):
                    tile_pass(ptr_add(a, r0 * a_rs), a_rs, a_ks, b, ldb, ptr_add(c, r0 * ldc),
                              ldc, k_len, ptr_add(alpha, r0), 2)
        else:  # no alpha, or one per column: the same for every pair of rows
            def row_pairs(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
                for r0 in range(0, rows, 2):
                    tile_pass(ptr_add(a, r0 * a_rs), a_rs, a_ks, b, ldb, ptr_add(c, r0 * ldc),
                              ldc, k_len, alpha, 2)

        return row_pairs

    return passes


_passes = _make_passes(False)
_lane_passes = _make_passes(True)
