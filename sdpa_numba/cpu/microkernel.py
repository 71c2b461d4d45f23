"""The register-tiled tile product at the heart of both attention matmuls
(:func:`register_passes`).

``c[0:rows, 0:NR] = a[0:rows, 0:K] @ b[0:K, 0:NR]`` (optionally ``+ diag(alpha) @ c``, or, the
forward's P·V, ``+ c @ diag(alpha)``), on raw pointers with leading dimensions, for
``rows`` = MR (4, the backward) or MR_WIDE (6, the forward; 4 for the forward's last value
rows). The accumulator is a fixed-size stack buffer indexed with constant bounds: once LLVM
unrolls the loops it lives in vector registers, which is what makes this run near the core's
FMA peak. A Numba array would stay in memory. With AVX-512 (32 zmm) a float32 pass holds the
whole rows x NR tile (16 or 24 zmm); with 16 ymm registers (AVX2) that tile would spill, so the
NR columns are done as column chunks of :data:`CHUNK_BYTES` per row (6 x 16 float32 = 12 ymm).
Each ``c[r, j]`` is summed over k in the same order either way, so the result does not depend
on the tile shape. The passes may be asked for only the first ``lanes`` columns (the
forward's partial block of query rows): they are done as chunks of :data:`LANE_CHUNK` columns
with either vector width. Rows are independent: row r of c depends only on row r of a, in a fixed
order, so the result of a row never depends on which tile or thread computed it.
"""

from numba import njit, types

from ._llvm import has_512_bit_vectors, ptr_add, row_mul_add, stack_buffer
from .options import INLINE

#: Rows of the backward's micro-tiles.
MR = 4
#: Rows of the forward's micro-tiles: a 6 x 64 float32 accumulator takes 24 of the 32 zmm
#: registers and needs 10 loads per 24 FMAs, against 8 per 16 at 4 x 64. The forward's 64-row
#: blocks are covered as ten tiles of 6 rows and one of 4.
MR_WIDE = 6
#: Columns of a micro-tile (keys for Q·Kᵀ, value dims for P·V). 64 measured fastest: 4 zmm
#: per row for float32. (NR = 32 kept the accumulator in memory in our measurements.)
NR = 64

#: Whether the CPU Numba compiles for has 32 512-bit vector registers (AVX-512), which pick the
#: register tile below. A module constant is safe with Numba's cache: the cache index keys on
#: the CPU name and features that Numba compiles for, the same ones this is derived from, so
#: code compiled with the other value is never loaded.
WIDE_VECTORS = has_512_bit_vectors()
#: Bytes of a row's accumulator in one register pass without AVX-512 (with it a pass holds all
#: NR columns): 2 ymm (float32: 16 columns, float64: 8), so a 6-row pass holds 12 of the 16
#: ymm and leaves room for the loads of b and the broadcast of a.
CHUNK_BYTES = 64
#: Columns of the chunks that the passes narrow the tile to when asked for fewer
#: than NR live columns (``lanes``): 16 float32 (one zmm, two ymm), a multiple of either
#: dtype's AVX2 chunk. A call of the forward with one query row computes 16 lanes of its
#: score tiles, not NR.
LANE_CHUNK = 16


def _make_pass(fold, width):
    """A register pass over ``mr`` rows and ``width`` columns: the product is summed from zero
    in registers, then ``fold`` writes it into ``c`` (``c = a @ b`` or
    ``c = alpha ∘ c + a @ b``).

    The old ``c`` is folded in once, at the end, rather than loaded as the sum's start: over
    a long sequence of calls (the forward's P·V over S / BN key blocks, the backward's dK,
    dV, dQ over blocks), each call's few terms are summed among themselves, and only their
    sum is added to the running total. Added one at a time to a running total, the terms
    lost their low bits to it: at S = 2**24 equal scores gave 3.667 for 3.0. Same loads,
    stores and FMAs. (The old ``c`` is folded into the register tile, which is then stored:
    storing into ``c`` while loading ``alpha``, which LLVM cannot prove apart, could keep the
    fold scalar.)
    """
    acc_buffer = stack_buffer(MR_WIDE * width)
    # The sum over k is written out in each pass rather than inlined from a helper of its
    # own: each inlined function is a Numba IR copy per call site, and the passes are
    # inlined many times over (compile time, see scripts/cold_start.py --events).
    if width == NR:
        @njit(**INLINE)
        def tile_pass(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, mr):
            acc = acc_buffer(a)
            for t in range(mr * width):
                acc[t] = 0
            for kk in range(k_len):
                bk = ptr_add(b, kk * ldb)
                for r in range(mr):
                    a_rk = a[r * a_rs + kk * a_ks]
                    for j in range(width):
                        acc[r * width + j] += a_rk * bk[j]
            fold(acc, c, ldc, alpha, mr, width)
            for r in range(mr):
                cr = ptr_add(c, r * ldc)
                for j in range(width):
                    cr[j] = acc[r * width + j]
    else:
        # A narrow tile leaves the loop vectorizer few enough scalar sums to vectorize the loop
        # over k as reductions (interleaved partial sums): one vector multiply-add per row
        # keeps each sum in the order of the wide tile, so the result does not depend on it.
        mul_add = row_mul_add(width)

        @njit(**INLINE)
        def tile_pass(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, mr):
            acc = acc_buffer(a)
            for t in range(mr * width):
                acc[t] = 0
            for kk in range(k_len):
                bk = ptr_add(b, kk * ldb)
                for r in range(mr):
                    mul_add(ptr_add(acc, r * width), a[r * a_rs + kk * a_ks], bk)
            fold(acc, c, ldc, alpha, mr, width)
            for r in range(mr):
                cr = ptr_add(c, r * ldc)
                for j in range(width):
                    cr[j] = acc[r * width + j]

    return tile_pass


@njit(**INLINE)
def _set(acc, c, ldc, alpha, mr, width):
    pass


@njit(**INLINE)
def _row_fold(acc, c, ldc, alpha, mr, width):
    for r in range(mr):
        cr = ptr_add(c, r * ldc)
        ar = alpha[r]
        for j in range(width):
            acc[r * width + j] += ar * cr[j]


@njit(**INLINE)
def _lane_fold(acc, c, ldc, alpha, mr, width):
    for r in range(mr):
        cr = ptr_add(c, r * ldc)
        for j in range(width):
            acc[r * width + j] += alpha[j] * cr[j]


#: The vector folds by (fold, columns), made on first use (see :func:`_vector_fold`).
_vector_folds = {}


def _vector_fold(fold, width):
    """``fold`` for the AVX2 column chunks of ``width`` columns, as one vector multiply-add
    per row (:func:`._llvm.row_mul_add`): ``c[r, j] * alpha`` fused into ``acc[r, j]`` as
    ``fold`` does, so the same bits. Written element by element, LLVM left the fold of a
    chunk pass unrolled over columns but not over rows, so the register tile went through
    the stack and was folded in scalar FMAs, loads and stores (96 of each per 6 x 16 chunk,
    against 768 vector FMAs in the pass over BN keys)."""
    if fold is _set:
        return fold
    key = (fold, width)
    if key not in _vector_folds:
        mul_add = row_mul_add(width, lanes=fold is _lane_fold)
        if fold is _lane_fold:
            @njit(**INLINE)
            def vector_fold(acc, c, ldc, alpha, mr, width):
                for r in range(mr):
                    mul_add(ptr_add(acc, r * width), alpha, ptr_add(c, r * ldc))
        else:
            @njit(**INLINE)
            def vector_fold(acc, c, ldc, alpha, mr, width):
                for r in range(mr):
                    mul_add(ptr_add(acc, r * width), alpha[r], ptr_add(c, r * ldc))
        _vector_folds[key] = vector_fold
    return _vector_folds[key]


#: The register passes by (fold, columns), made on first use: columns NR (AVX-512) or a chunk.
_tile_passes = {}


def _tile_pass(fold, width):
    key = (fold, width)
    if key not in _tile_passes:
        _tile_passes[key] = _make_pass(fold, width)
    return _tile_passes[key]


def _pick_passes(lane_alpha, scaled, whole_only, dtype):
    """The register passes of :func:`register_passes` (a Python function, to be compiled
    inlined, or with AVX-512 and ``whole_only`` the inlined pass itself: no wrapper, one
    inlined level less to compile per call)."""
    fold = (_lane_fold if lane_alpha else _row_fold) if scaled else _set
    per_column = scaled and lane_alpha
    if not WIDE_VECTORS:
        width = CHUNK_BYTES * 8 // dtype.bitwidth
        chunks = _column_chunks(_vector_fold(fold, width), width, per_column)
        if whole_only:
            def all_chunks(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
                chunks(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows, NR)

            return all_chunks

        def some_chunks(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows, lanes):
            chunks(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows, lanes)

        return some_chunks
    whole = _whole_tile(fold, dtype != types.float64, scaled and not lane_alpha)
    if whole_only:
        return whole
    narrow = _column_chunks(fold, LANE_CHUNK, per_column)

    def whole_or_chunks(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows, lanes):
        if lanes >= NR:
            whole(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows)
        else:
            narrow(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows, lanes)

    return whole_or_chunks


#: The passes of :func:`register_passes`, by what picks them.
_picked = {}


def register_passes(dtype, lane_alpha, scaled, whole_only):
    """The register passes of a tile product for operands of Numba type ``dtype``, as an
    ``@njit`` function inlined where it is called, ``f(a, a_rs, a_ks, b, ldb, c, ldc, k_len,
    alpha, rows, lanes)`` (``whole_only``: without ``lanes``): ``c = a @ b`` over a rows x NR
    tile, or with ``scaled`` ``c = alpha[:, None] * c + a @ b`` (``lane_alpha`` False: one
    factor of alpha per row) or ``c = c * alpha[None, :] + a @ b`` (True: per column, the
    forward's P·V). For a caller that is itself chosen by type (an ``@overload``), which adds
    ``prefer_512_bit()``.

    The passes' arguments: ``a[r, kk]`` is at ``a + r * a_rs + kk * a_ks`` (either layout: one
    scalar is broadcast per step), ``b`` row-major k_len x NR (leading dimension ``ldb``), ``c``
    row-major rows x NR (``ldc``), all pointers of the compute dtype; ``k_len`` the reduction
    length; ``alpha`` a pointer (None unless ``scaled``); ``rows`` a compile-time constant, MR
    or MR_WIDE (float64 tiles are done 2 rows at a time); ``lanes`` the columns of ``c`` to
    compute, a run-time multiple of :data:`LANE_CHUNK` up to NR (NR: the whole tile). Fewer are
    done as chunks of LANE_CHUNK columns, each summed over k in written order; columns past
    ``lanes`` are neither read nor written. Bitwise the whole tile's columns where LLVM keeps
    the whole tile's sums in written order too, as with a run-time ``k_len`` (the forward's
    scores, checked by tests/test_partial_lanes.py); with a constant one (the forward's P·V
    over BN keys) it reordered them under fast-math reassoc, and the chunks gave other last
    bits.

    Picked once per key, by type, so that no code for another dtype, kind of start or the
    narrow chunks reaches LLVM: an ``inline="always"`` overload would have Numba compile its
    implementation as a function of its own to type it (its machine code never used) and run
    its frontend again each time a call to it is typed (the forward's two tile helpers paid ~1
    s for that).
    """
    key = (dtype, lane_alpha, scaled, whole_only)
    if key not in _picked:
        f = _pick_passes(lane_alpha, scaled, whole_only, dtype)
        if not hasattr(f, "py_func"):  # a Python function (else already inlined @njit)
            f = njit(**INLINE)(f)
        _picked[key] = f
    return _picked[key]


def _whole_tile(fold, float32, per_row):
    """The whole rows x NR tile with AVX-512 (32 zmm): ``float32``, one pass; float64, passes
    of 2 rows; ``per_row``: ``alpha`` has one factor per row, so each pair takes its own."""
    tile_pass = _tile_pass(fold, NR)
    if float32:
        # float32 rows are 4 zmm each: the whole tile (4 or 6 rows) is one pass, called as
        # it is (a wrapper would be one more inlined level per call site).
        return tile_pass

    # float64 rows are 8 zmm each: 2 rows a pass (4 would need all 32 zmm and spill;
    # splitting columns instead kept the accumulator in memory in our measurements).
    if per_row:
        @njit(**INLINE)
        def row_pairs(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
            for r0 in range(0, rows, 2):
                tile_pass(ptr_add(a, r0 * a_rs), a_rs, a_ks, b, ldb, ptr_add(c, r0 * ldc),
                          ldc, k_len, ptr_add(alpha, r0), 2)
    else:  # no alpha, or one per column: the same for every pair of rows
        @njit(**INLINE)
        def row_pairs(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows):
            for r0 in range(0, rows, 2):
                tile_pass(ptr_add(a, r0 * a_rs), a_rs, a_ks, b, ldb, ptr_add(c, r0 * ldc),
                          ldc, k_len, alpha, 2)

    return row_pairs




def _column_chunks(fold, width, per_column):
    """The first ``lanes`` columns of the tile as ``lanes / width`` passes over all its rows,
    one per chunk of ``width`` columns (the register tile for CPUs with 16 vector registers,
    and the narrowed tile); ``per_column``: ``alpha`` has one factor per column, so each chunk
    takes its own."""
    tile_pass = _tile_pass(fold, width)
    if per_column:
        @njit(**INLINE)
        def chunks(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows, lanes):
            for j0 in range(0, lanes, width):
                tile_pass(a, a_rs, a_ks, ptr_add(b, j0), ldb, ptr_add(c, j0), ldc, k_len,
                          ptr_add(alpha, j0), rows)
    else:  # no alpha, or one per row: the same for every chunk
        @njit(**INLINE)
        def chunks(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, rows, lanes):
            for j0 in range(0, lanes, width):
                tile_pass(a, a_rs, a_ks, ptr_add(b, j0), ldb, ptr_add(c, j0), ldc, k_len,
                          alpha, rows)
    return chunks
