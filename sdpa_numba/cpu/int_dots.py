"""Scores of float32 query rows against int8 keys by AVX-512 VNNI's integer dot products
(``vpdpwssd``), exact in integers: the int8 cache's (one scale per token and head) ``q k`` of
:mod:`.decode` where the CPU has VNNI (:data:`HAS_VNNI`), E is a multiple of 64 from 128 on
(at 64 the gain is about what preparing the rows costs) and a key/value head has fewer than four query rows (MHA;
the four-row passes of GQA convert a key once for four rows, and there the float loop is as
cheap: see below).

The queries are not rounded to 8 bits (llama.cpp's way): each row is written as block floating
point, ``Q_e = rint(q_e * 2^-x)`` integers with ``|Q_e| <= QMAX`` (``x`` from the row's
largest ``|q|``: that element keeps 31 or 32 significant bits, so all its 24 and those of
every element within 7 binades of it; the others what lies above ``2^(x-1)``, an error at
most ``2^-31`` of the row's largest element each), and ``Q`` as two balanced int16 digits
``Q = d1 * 2^16 + d0``. The keys are sign-extended to int16 in registers (one
``vpmovsxbw`` per 32 elements, shared by the digits) and each digit's lane sums taken by
``vpdpwssd`` (16 int32 lanes, each adding two products of int16): per 64 elements of a key two
conversions and four dot products, where the float loop spends four ``vpmovsxbd``, four
``vcvtdq2ps`` and four FMAs.

Each lane's two digit sums are exact integers (bounds in :func:`vnni_lane_dots`); they are
combined into float32 per lane (``cvt(A1) * 2^16 + cvt(A0)``: the product exact, two or three
roundings, where the float loop rounds once per FMA, E / 16 times a lane), reduced by the same
transpose-and-add tree as the float loop, then multiplied once by the key's scale times
``2^x`` (``2^x`` as two factors, both normal floats for every finite float32 row; their
product with the scale exact while it is a normal float). Against the float loop the
last bits move in the lane sums (exact here, rounded per FMA there) and where an element has
bits below ``2^(x-1)``; the result depends on the row and the key only, so it stays bitwise
independent of the thread count and of the rows sharing a pass.

Measured in isolation (16 keys of D128 in L1, one row, AMD EPYC Zen 4; scripts/
quant_decode_profile.py ``--micro``): the float loop 4.7 ns per (key, head), this 3.35 ns
(D64: 2.6 and 2.3; D256: 8.7 and 5.6);
``vpdpbusd`` with three int8 digits of the query (keys made unsigned by flipping their sign
bit, ``-128 sum d`` starting the accumulators) 3.6 ns against this one's 3.5 before both
combined their lanes' digits by an FMA, with queries of 23 bits. Four rows against four keys:
the float loop 2.8 ns, this 3.3 ns (its dot products per element are not fewer than the float
loop's FMAs once a key's conversion serves four rows).
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import _sum_tree, has_vnni, ptr_add
from .options import INLINE

#: Whether the CPU that Numba compiles for has AVX-512 VNNI (asked once, at import, as
#: :func:`._llvm.has_vnni`: ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` honoured).
HAS_VNNI = has_vnni()

#: Elements of a key per step of the loop (two ``vpdpwssd`` a digit).
CHUNK = 64

#: The largest ``|Q|`` two balanced int16 digits hold: 32767 * (2^16 + 1).
QMAX = 32767 * 65537


@njit(**INLINE)
def prepare_rows(qp, n_rows, e_len, dig, fac):
    """Write the float32 rows ``qp + i * e_len`` (a pointer; ``i < n_rows``, ``e_len`` a
    multiple of :data:`CHUNK`) for :func:`vnni_lane_dots`: ``Q = d1 * 2^16 + d0`` (module
    doc), int16 digits in ``-32768 .. 32767``, ``dig[i * 2 * e_len + c * 64 + t * 32 + m]``
    digit ``t`` of element ``c * 32 + m`` (a vector of each per 32 elements); ``fac[2 i]``,
    ``fac[2 i + 1]`` two powers of two whose product is ``2^x``. A row with a NaN or an
    infinity gets factors NaN (its scores NaN, as the float loop's are or turn to in the
    softmax); a zero row digits 0 (scores 0)."""
    # No branch inside the loops over the elements (1.6 -> 1.1 ns per element: over a chunk
    # of 512 keys of MHA D128, 0.4 -> 0.3 ns per (key, head) of the 1.2 the integer scores
    # save).
    for i in range(n_rows):
        row = ptr_add(qp, i * e_len)
        amax = np.float32(0.0)
        nan = np.float32(0.0)  # NaN where the row has a NaN or an infinity (inf * 0)
        for e in range(e_len):
            amax = max(amax, abs(row[e]))
            nan += row[e] * np.float32(0.0)
        finite = nan == 0
        x = 0
        if finite and amax > 0:
            _, ex = math.frexp(np.float64(amax))  # amax 2^-x in [2^30, 2^31)
            x = ex - 31
            if np.rint(math.ldexp(np.float64(amax), -x)) > QMAX:
                x += 1
        inv = math.ldexp(1.0, -x)
        db = dig[i * 2 * e_len:(i + 1) * 2 * e_len]
        if not finite:
            db[:] = 0
        for c in range(e_len // 32 if finite else 0):
            for m in range(32):
                qq = np.int64(np.rint(np.float64(row[c * 32 + m]) * inv))
                d0 = ((qq + 32768) & 65535) - 32768
                db[c * 64 + m] = d0
                db[c * 64 + 32 + m] = (qq - d0) >> 16
        x1 = x >> 1
        if finite:
            fac[2 * i] = np.float32(math.ldexp(1.0, x1))
            fac[2 * i + 1] = np.float32(math.ldexp(1.0, x - x1))
        else:
            fac[2 * i] = np.float32(np.nan)
            fac[2 * i + 1] = np.float32(np.nan)


def _vpdpwssd(builder):
    v = ir.VectorType(ir.IntType(32), 16)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v, [v, v, v]),
                                          "llvm.x86.avx512.vpdpwssd.512")


def vnni_lane_dots(n_rows, n_keys, group):
    """Make an intrinsic ``f(dig, dstride, fac, kbase, koff, kh, e_len, sc, out)``: the
    ``n_rows x n_keys`` (16 in all) scores of the rows prepared by :func:`prepare_rows` (row
    ``r``: int16 digits at ``dig + r * dstride``, factors at ``fac + 2 r``) with the int8
    keys ``kbase + koff[kk] + kh`` over ``e_len`` elements (a positive multiple of
    :data:`CHUNK`), times the keys' scales ``sc[kk]``, into ``out[r * n_keys + kk]``, laid
    out as :func:`.quant.q_lane_dots`'s. Only for CPUs with :data:`HAS_VNNI`.

    The dot products go ``group`` at a time, each with two int32 accumulators and a loop over
    E of its own, so that accumulators, digits and keys fit the 32 zmm registers. Bounds, per
    lane and digit: ``E / 16`` products of at most ``2^7 * 2^15`` (int8 times a balanced
    int16 digit), ``|A| <= 2^18 E``: int32 holds it for E up to 2^13 (decode's E: 256 at
    most here).
    """
    assert n_rows * n_keys == 16 and 16 % group == 0
    dots = [(r, k) for r in range(n_rows) for k in range(n_keys)]
    groups = [dots[g:g + group] for g in range(0, 16, group)]
    f32p = types.CPointer(types.float32)
    i8p = types.CPointer(types.int8)

    @intrinsic
    def _vnni_lane_dots(typingctx, dig, dstride, fac, kbase, koff, kh, e_len, sc, out):
        if not (dig == types.CPointer(types.int16) and kbase == i8p
                and fac == sc == out == f32p and koff == types.CPointer(types.int64)
                and all(isinstance(t, types.Integer) for t in (dstride, kh, e_len))):
            return None
        sig = types.void(dig, dstride, fac, kbase, koff, kh, e_len, sc, out)

        def codegen(context, builder, signature, args):
            dp, _, fp, kb, ko, _, _, scp, op = args
            i64, i32 = ir.IntType(64), ir.IntType(32)
            ds, khv, el = (context.cast(builder, args[i], signature.args[i], types.int64)
                           for i in (1, 5, 6))
            ivty = ir.VectorType(i32, 16)
            bvty = ir.VectorType(ir.IntType(8), 32)
            wvty = ir.VectorType(ir.IntType(16), 32)
            fvty = ir.VectorType(ir.FloatType(), 16)
            dot = _vpdpwssd(builder)
            kbh = builder.gep(kb, [khv])
            rows = [builder.gep(dp, [builder.mul(ds, ir.Constant(i64, r))])
                    for r in range(n_rows)]
            lanes = {}
            for gi, grp in enumerate(groups):
                g_rows = sorted({r for r, _ in grp})
                g_keys = sorted({k for _, k in grp})
                entry = builder.block
                loop = builder.append_basic_block(f"vnniw.loop{gi}")
                done = builder.append_basic_block(f"vnniw.done{gi}")
                builder.branch(loop)
                builder.position_at_end(loop)
                e = builder.phi(i64)
                e.add_incoming(ir.Constant(i64, 0), entry)
                accs = {}
                for d in grp:
                    accs[d] = []
                    for t in range(2):
                        a = builder.phi(ivty)
                        a.add_incoming(ir.Constant(ivty, None), entry)
                        accs[d].append(a)
                new = {d: list(accs[d]) for d in grp}
                for u in range(2):  # two halves of 32 elements
                    kv = {}
                    for k in g_keys:
                        off = builder.add(builder.load(builder.gep(ko, [ir.Constant(i64, k)])),
                                          builder.add(e, ir.Constant(i64, 32 * u)))
                        raw = builder.load(builder.bitcast(builder.gep(kbh, [off]),
                                                           bvty.as_pointer()), align=1)
                        kv[k] = builder.bitcast(builder.sext(raw, wvty), ivty)
                    dv = {}
                    e2 = builder.add(builder.mul(e, ir.Constant(i64, 2)),
                                     ir.Constant(i64, 64 * u))
                    for r in g_rows:
                        for t in range(2):
                            p = builder.gep(rows[r], [builder.add(e2, ir.Constant(i64, 32 * t))])
                            dv[r, t] = builder.load(builder.bitcast(p, ivty.as_pointer()),
                                                    align=2)
                    for d in grp:
                        for t in range(2):
                            new[d][t] = builder.call(dot, [new[d][t], kv[d[1]], dv[d[0], t]])
                e_next = builder.add(e, ir.Constant(i64, CHUNK))
                e.add_incoming(e_next, builder.block)
                for d in grp:
                    for t in range(2):
                        accs[d][t].add_incoming(new[d][t], builder.block)
                builder.cbranch(builder.icmp_signed("<", e_next, el), loop, done)
                builder.position_at_end(done)
                for d in grp:
                    a0, a1 = new[d]
                    # one FMA: the product is exact, so fused or not the bits are the same
                    hi = builder.fmul(builder.sitofp(a1, fvty),
                                      ir.Constant(fvty, [65536.0] * 16), flags=("contract",))
                    lanes[d] = builder.fadd(hi, builder.sitofp(a0, fvty), flags=("contract",))
            res = _sum_tree(builder, [lanes[d] for d in dots], 16)
            # times key scale x 2^x, lane r * n_keys + kk: sc[kk] times row r's two factors,
            # exact while sc[kk] 2^x is a normal float (powers of two), so that the score is
            # rounded once, as the float loop's (three multiplies of the score: one row's
            # scores at q x 30 had twice the float loop's error)
            kvty = ir.VectorType(ir.FloatType(), n_keys)
            ks = builder.load(builder.bitcast(scp, kvty.as_pointer()), align=4)
            idx = ir.Constant(ir.VectorType(i32, 16), [k for _, k in dots])
            scale = builder.shuffle_vector(ks, ks, idx)
            fty = ir.VectorType(ir.FloatType(), 2 * n_rows)
            fv = builder.load(builder.bitcast(fp, fty.as_pointer()), align=4)
            for t in range(2):
                ix = ir.Constant(ir.VectorType(i32, 16), [2 * r + t for r, _ in dots])
                scale = builder.fmul(scale, builder.shuffle_vector(fv, fv, ix))
            res = builder.fmul(res, scale)
            builder.store(res, builder.bitcast(op, fvty.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _vnni_lane_dots
