"""The register-tiled tile product at the heart of both attention matmuls.

``c[0:MR, 0:NR] = a[0:MR, 0:K] @ b[0:K, 0:NR]`` (optionally ``+ diag(alpha) @ c``), on raw
pointers with leading dimensions. The MR x NR accumulator is a fixed-size stack buffer indexed
with constant bounds: once LLVM unrolls the loops it lives in vector registers (16 zmm for
float32), which is what makes this run near the core's FMA peak. A Numba array would stay in
memory. Rows are independent: row r of c depends only on row r of a, in a fixed order, so the
result of a row never depends on which tile or thread computed it.
"""

from numba import njit, types
from numba.extending import overload

from ._llvm import prefer_512_bit, ptr_add, stack_buffer
from .options import INLINE

#: Rows of a micro-tile (query rows).
MR = 4
#: Columns of a micro-tile (keys for Q·Kᵀ, value dims for P·V). 64 measured fastest: 4 zmm
#: per row for float32. (NR = 32 kept the accumulator in memory in our measurements.)
NR = 64

_acc_buffer = stack_buffer(MR * NR)


def pass_rows(ptr):
    """Rows per register pass for the element type of ``ptr`` (jitted code only)."""
    raise NotImplementedError("pass_rows is only callable from jitted code")


@overload(pass_rows)
def _pass_rows(ptr):
    # 16 zmm of accumulators: 4 float32 rows of 4 vectors, or 2 float64 rows of 8 vectors
    # (4 float64 rows would need all 32 zmm and spill; splitting columns instead kept the
    # accumulator in memory in our measurements).
    if ptr.dtype == types.float64:
        return lambda ptr: MR // 2
    return lambda ptr: MR


@njit(**INLINE)
def _tile_pass(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, mr):
    """Rows ``0 : mr`` of :func:`tile_product`, accumulated in registers."""
    acc = _acc_buffer(a)
    if alpha is None:
        for t in range(mr * NR):
            acc[t] = 0
    else:
        for r in range(mr):
            cr = ptr_add(c, r * ldc)
            ar = alpha[r]
            for j in range(NR):
                acc[r * NR + j] = ar * cr[j]
    for kk in range(k_len):
        bk = ptr_add(b, kk * ldb)
        for r in range(mr):
            a_rk = a[r * a_rs + kk * a_ks]
            for j in range(NR):
                acc[r * NR + j] += a_rk * bk[j]
    for r in range(mr):
        cr = ptr_add(c, r * ldc)
        for j in range(NR):
            cr[j] = acc[r * NR + j]


@njit(**INLINE)
def tile_product(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha):
    """``c = a @ b`` over an MR x NR tile, or ``c = alpha[:, None] * c + a @ b``.

    Parameters
    ----------
    a, b, c : CPointer
        ``a[r, kk]`` is at ``a + r * a_rs + kk * a_ks`` (either layout: one scalar is
        broadcast per step), ``b`` is row-major k_len x NR (leading dimension ``ldb``),
        ``c`` is row-major MR x NR (``ldc``). All of the compute dtype.
    k_len : int
        The reduction length.
    alpha : CPointer or None
        Per-row factors of the old ``c``; None overwrites ``c``.
    """
    prefer_512_bit()
    mr = pass_rows(a)
    _tile_pass(a, a_rs, a_ks, b, ldb, c, ldc, k_len, alpha, mr)
    if mr < MR:  # float64: the second half of the rows
        _tile_pass(ptr_add(a, mr * a_rs), a_rs, a_ks, b, ldb, ptr_add(c, mr * ldc), ldc,
                   k_len, None if alpha is None else ptr_add(alpha, mr), mr)
