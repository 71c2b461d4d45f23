"""The forward's scores of bfloat16 inputs by AVX-512 BF16's ``vdpbf16ps``, where the CPU has it.

Each float32 lane of ``vdpbf16ps`` adds the two products of a pair of bfloat16: one
instruction does the work of two float32 fused multiply-adds, at the same rate on the
measured AMD EPYC (Zen 4, 1 thread: 235 against 117 GFLOP/s in a register-only loop; the
forward's 6 x 64 score tile, D = 64: 2.40 against 4.70 us, 219 against 112 GFLOP/s). The
scores Sᵀ = K Qᵀ are half the forward's multiply-adds, so this is the scores' half only:

* the queries are packed as pairs along E (``qp``: per pair ``p`` of dims, per query lane
  ``l``, the two bfloat16 at ``2 * (p * BM + l)``), once per task, bit patterns scaled only by
  a power of two (exact); the rest of the score's factor multiplies the score tile (see
  :func:`pack_query_pairs`);
* the keys are read in place as stored (a pair of dims is one 32-bit broadcast), or copied
  bit for bit into ``kp`` where the block is partial or its rows are not contiguous;
* P·V stays in float32 (:func:`sdpa_numba.cpu.forward._accumulate`): P rounded to bfloat16
  would add an error of the order of the output's own rounding, past the tests' tolerance of
  one bfloat16 ulp against the float64 reference.

The products of bfloat16 are exact in float32 and each lane sums them in a fixed order (pair
by pair, a pair's first product first), so a row's scores do not depend on its tile or
thread. The instruction reads bfloat16 subnormals (below 1.2e-38) as zero, so a tile of BM
query rows (aligned to multiples of BM) and BN keys with a subnormal query or key (or a query
that its power of two makes subnormal) takes the float32 path: decided per tile, a row's bits
depend on its own tiles only, never on the other rows of its task (whose chunking depends on
the shape). It also flushes float32 subnormal partial sums to zero: scores below 1.2e-38 in
magnitude (times the factor left, under 2) that the float32 path would keep, which no softmax
can tell from 0.

Chosen at import (:data:`PAIR_DOT`) from the CPU Numba compiles for, and only for bfloat16
storage with an even E: :func:`pair_buffer` gives None for any other storage dtype, so that
their kernels contain no code of this path.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._llvm import (data_ptr, float32_to_bf16_bits, has_pair_dot, no_inline, pair_dots,
                    prefer_512_bit, ptr_add)
from .microkernel import LANE_CHUNK, MR_WIDE, NR
from .options import CALLED, INLINE
from .scratch import aligned_full
from .storage import load
from ..score.blocks import K_BLOCK

#: Keys per block and query lanes per tile: the forward's BN and BM.
BN = K_BLOCK
BM = NR

#: Whether this process's bfloat16 forward computes its scores with ``vdpbf16ps``: the CPU
#: Numba compiles for has AVX-512 BF16 (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` honoured).
#: A module constant is safe with Numba's cache, which keys on that CPU name and features.
PAIR_DOT = has_pair_dot()

_whole = pair_dots(MR_WIDE, BM // 16)
_chunk = pair_dots(MR_WIDE, LANE_CHUNK // 16)


def pair_buffer(q, n):
    """An int16 scratch buffer of ``n`` zeros for bfloat16 storage ``q`` on a CPU with
    :data:`PAIR_DOT`, else None (a compile-time choice; jitted code only)."""
    raise NotImplementedError("pair_buffer is only callable from jitted code")


@overload(pair_buffer, inline="always")
def _ol_pair_buffer(q, n):
    if PAIR_DOT and q.dtype == types.int16:
        return lambda q, n: aligned_full(n, 0, np.int16)
    return lambda q, n: None


@njit(**INLINE)
def _pack(q, i0, n, n_pad, qp, p2, ok):
    """Pack rows ``[i0, i0 + n)`` of ``q`` times ``p2`` (a power of two, or 1: the bits as
    they are) into ``qp`` as pairs; lanes past ``n`` are zeros. ``ok[t]``: whether no packed
    value of sub-block ``t`` (BM rows) is subnormal (``vdpbf16ps`` would read it as zero).
    Returns whether a packed value is infinite."""
    e_len = q.shape[1]
    inf = False
    for r0 in range(0, n_pad, BM):
        tiny = False
        blk = ptr_add(data_ptr(qp), r0 * e_len)
        rows = min(BM, n - r0)
        for rr in range(rows):
            i = i0 + r0 + rr
            for e in range(e_len):
                t = (e >> 1) * 2 * BM + 2 * rr + (e & 1)
                if p2 == 1:
                    bits = q[i, e]
                else:
                    y = load(q[i, e]) * p2  # exact, bar overflow and underflow (caught)
                    inf |= abs(y) == np.inf
                    bits = float32_to_bf16_bits(y)
                    tiny |= (y != 0) & (bits & 0x7FFF == 0)  # underflowed to zero
                tiny |= _subnormal(bits)
                blk[t] = bits
        for rr in range(rows, BM):
            for e in range(e_len):
                blk[(e >> 1) * 2 * BM + 2 * rr + (e & 1)] = 0
        ok[r0 // BM] = not tiny
    return inf


@njit(**INLINE)
def _subnormal(bits):
    """Whether the bfloat16 of int16 ``bits`` is subnormal (exponent field 0, not zero)."""
    return (bits & 0x7F80 == 0) & (bits & 0x7F != 0)


def pack_query_pairs(q, i0, n, n_pad, c, qp, ok):
    """Pack query rows ``[i0, i0 + n)`` of bfloat16 ``q`` into ``qp`` as pairs (see the module
    doc), scaled by the largest power of two ``2**k <= |c|``; returns the factor left, ``f =
    c / 2**k`` (``1 <= |f| < 2``), by which the caller multiplies the score tiles.

    A power of two multiplies a bfloat16 exactly (float32 has bfloat16's exponent range), so
    the queries keep their bits, where rounding ``q * c`` to bfloat16 would add an error of
    the inputs' own size. ``|f| >= 1``: a score that overflows before the multiply by ``f``
    overflows after it too (with the whole ``c`` folded afterwards, a scale below 1 made
    scores of large inputs overflow that the float32 path computes). A query that overflows
    when multiplied by ``2**k`` (k > 0) is packed unscaled, ``f = c``. ``c == 0``: zeros, f =
    1, as the float32 path (q * 0). ``ok[t]`` (uint8) is set to whether no packed query of
    sub-block ``t`` is subnormal (a subnormal query, or one that the power of two made
    subnormal): ``vdpbf16ps`` would read it as zero, so the caller takes the float32 path for
    that sub-block. Jitted code only; 1.0 and nothing else where ``qp`` is None.
    """
    raise NotImplementedError("pack_query_pairs is only callable from jitted code")


@overload(pack_query_pairs, inline="always")
def _ol_pack_query_pairs(q, i0, n, n_pad, c, qp, ok):
    if isinstance(qp, types.NoneType):
        return lambda q, i0, n, n_pad, c, qp, ok: 1.0
    return lambda q, i0, n, n_pad, c, qp, ok: _pack_query_pairs(q, i0, n, n_pad, c, qp, ok)


@njit(**INLINE)
def _pack_query_pairs(q, i0, n, n_pad, c, qp, ok):
    if c == 0:
        p2, f = 0.0, 1.0
    else:
        frac, ex = math.frexp(c)  # c = frac * 2**ex, 0.5 <= |frac| < 1
        p2, f = math.ldexp(1.0, ex - 1), 2.0 * frac
    if _pack(q, i0, n, n_pad, qp, np.float32(p2), ok):
        _pack(q, i0, n, n_pad, qp, np.float32(1.0), ok)
        f = c
    return f


@njit(**INLINE)
def _in_place(k, nj):
    """Whether a block of ``nj`` keys of ``k`` is read in place: a full block of contiguous
    rows (an even E: a pair is read as 32 bits, with no alignment needed)."""
    return (nj == BN and k.strides[1] == 2 and k.strides[0] > 0
            and k.strides[0] % 2 == 0)


@njit(**INLINE)
def _keys_normal(k, j_begin, j_end):
    """Whether no element of rows ``[j_begin, j_end)`` of ``k`` is a subnormal bfloat16.

    Per row, the unsigned minimum of ``(bits & 0x7fff) - 1`` in 16 bits (zero wraps to
    0xffff; subnormals give 0 .. 0x7e): 320 ns per 64 x 64 block (a boolean or per element,
    490 ns), about 0.5% of the block's score and P·V tiles of one 512-row task (~60 us)."""
    e_len = k.shape[1]
    count = 0
    if k.strides[1] == 2 and k.strides[0] % 2 == 0:
        ld = k.strides[0] // 2
        for j in range(j_begin, j_end):
            p = ptr_add(data_ptr(k), j * ld)
            lo = np.uint16(0xFFFF)
            for e in range(e_len):
                x = np.uint16(np.uint16(p[e]) & np.uint16(0x7FFF)) - np.uint16(1)
                lo = min(lo, np.uint16(x))
            count += lo < 0x7F
    else:
        for j in range(j_begin, j_end):
            for e in range(e_len):
                count += _subnormal(k[j, e])
    return count == 0


def pack_key_pairs(k, j0, nj, kp):
    """Copy keys ``[j0, j0 + nj)`` of ``k`` bit for bit into ``kp`` (BN x E int16) unless the
    block is read in place; returns whether none of them has a subnormal element (jitted
    code only; True and nothing else where ``kp`` is None).

    A pass over the block's keys (in L1 after it), against 2 E multiply-adds per key element
    and query row: measured in the noise."""
    raise NotImplementedError("pack_key_pairs is only callable from jitted code")


@overload(pack_key_pairs, inline="always")
def _ol_pack_key_pairs(k, j0, nj, kp):
    if isinstance(kp, types.NoneType):
        return lambda k, j0, nj, kp: True

    def copy(k, j0, nj, kp):
        if not _in_place(k, nj):
            e_len = k.shape[1]
            for j in range(nj):
                for e in range(e_len):
                    kp[j * e_len + e] = k[j0 + j, e]
        return _keys_normal(k, j0, j0 + nj)
    return copy


def pair_flags(q, n):
    """A uint8 array of ``n`` flags for bfloat16 storage ``q`` on a CPU with
    :data:`PAIR_DOT`, else None (as :func:`pair_buffer`; jitted code only)."""
    raise NotImplementedError("pair_flags is only callable from jitted code")


@overload(pair_flags, inline="always")
def _ol_pair_flags(q, n):
    if PAIR_DOT and q.dtype == types.int16:
        return lambda q, n: np.zeros(n, np.uint8)
    return lambda q, n: None


def all_flags(ok):
    """Whether every flag of ``ok`` is set; True where ``ok`` is None (jitted code only)."""
    raise NotImplementedError("all_flags is only callable from jitted code")


@overload(all_flags, inline="always")
def _ol_all_flags(ok):
    if isinstance(ok, types.NoneType):
        return lambda ok: True
    return lambda ok: np.all(ok != 0)


def flag(ok, t):
    """``ok[t] != 0``; False where ``ok`` is None (jitted code only)."""
    raise NotImplementedError("flag is only callable from jitted code")


@overload(flag, inline="always")
def _ol_flag(ok, t):
    if isinstance(ok, types.NoneType):
        return lambda ok, t: False
    return lambda ok, t: ok[t] != 0


def pair_scores(k, j0, nj, kp, qp, r0, st, n_keys, lanes):
    """Sᵀ = K Qᵀ for the first ``n_keys`` keys of the block at ``j0`` (rounded up to whole
    tiles) against the sub-block of packed queries at row ``r0`` of ``qp``, in its first
    ``lanes`` lanes, into ``st`` (a float32 pointer, BN x BM); as
    :func:`sdpa_numba.cpu.forward._scores` (jitted code only; nothing where ``kp`` is None)."""
    raise NotImplementedError("pair_scores is only callable from jitted code")


@overload(pair_scores, inline="always")
def _ol_pair_scores(k, j0, nj, kp, qp, r0, st, n_keys, lanes):
    if isinstance(kp, types.NoneType):
        return lambda k, j0, nj, kp, qp, r0, st, n_keys, lanes: None

    def scores(k, j0, nj, kp, qp, r0, st, n_keys, lanes):
        e_len = k.shape[1]
        if _in_place(k, nj):
            kb = ptr_add(data_ptr(k), j0 * (k.strides[0] // 2))
            ldk = k.strides[0] // 2
        else:
            kb = data_ptr(kp)
            ldk = e_len
        _tiles(kb, ldk, ptr_add(data_ptr(qp), r0 * e_len), st, e_len // 2, n_keys, lanes)
    return scores


@njit(**CALLED)
def _tiles(kb, ldk, qb, st, n_pairs, n_keys, lanes):
    """The 6 x BM tiles of :func:`pair_scores`, as a call of its own (as the float32 tiles)."""
    no_inline()
    prefer_512_bit()
    for jt in range(0, n_keys, MR_WIDE):
        # The last tile overlaps the one before, as the float32 path's (_scores).
        j = min(jt, BN - MR_WIDE)
        if lanes >= BM:
            _whole(ptr_add(kb, j * ldk), ldk, qb, ptr_add(st, j * BM), n_pairs)
        else:
            for l0 in range(0, lanes, LANE_CHUNK):
                _chunk(ptr_add(kb, j * ldk), ldk, ptr_add(qb, 2 * l0),
                       ptr_add(st, j * BM + l0), n_pairs)
