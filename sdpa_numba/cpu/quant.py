"""Quantized key/value caches in jitted code: the 8-bit formats' quantize and dequantize
(callable from Python and from users' ``@njit`` code), and the vector loops in which the decode
kernel reads them (:func:`q_lane_dots`, :func:`q_rows_pv`: the 8-bit values converted to
float32 in registers, the scales folded into the sums).

The formats (:mod:`sdpa_numba.quant` documents them for users):

* ``FMT_INT8`` (0): int8 values ``-127 .. 127`` with a scale per block of ``block`` values
  along the head dim (``block = E``: one scale per token and head; ``block = 32``: llama.cpp's
  ``q8_0``). ``x ~ value * scale``, ``scale = absmax(block) / 127``.
* ``FMT_E4M3`` (1) and ``FMT_E5M2`` (2): fp8 ``float8_e4m3fn`` / ``float8_e5m2`` bit patterns
  (held as uint8 or int8) with a descale per (sequence, head) or per tensor: ``x ~ value *
  descale``.

Quantization rounds to nearest, ties to even, and saturates (int8 to ``±127``, e4m3fn to
``±448``, e5m2 to ``±57344``); a block whose scale is 0 (all zeros, or a scale that rounds
to 0 in its dtype) gets values 0. Values are ``x / scale`` rounded, with the scale as stored
(after its rounding to float16 where the scales are float16), so that ``value * scale`` is
what the kernels read.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._llvm import (_sum_tree, float32_to_half_bits, half_bits_to_float32, over_keys, splat,
                    store_rows)
from ..score.formats import E4M3_MAX, E5M2_MAX, FMT_E4M3, FMT_E5M2, FMT_INT8, INT8_MAX
from .options import CACHE, CALLED, INLINE


@njit(**INLINE)
def fp8_to_float32(bits, fmt):
    """The float32 value of an fp8 bit pattern ``bits`` (an int8 or uint8; ``fmt`` FMT_E4M3 or
    FMT_E5M2). e5m2 is float16's top byte; e4m3fn's seven magnitude bits shifted into
    float16's place are the value times 2^-8, subnormals included; 0x7F / 0xFF is its NaN."""
    if fmt == FMT_E5M2:
        return e5m2_value(bits)
    return e4m3_value(bits)


@njit(**INLINE)
def e5m2_value(bits):
    """The float32 value of the e5m2 bit pattern ``bits`` (int8 or uint8): float16's top
    byte."""
    return half_bits_to_float32(np.uint16((np.int32(bits) & 0xFF) << 8))


@njit(**INLINE)
def e4m3_value(bits):
    """The float32 value of the e4m3fn bit pattern ``bits`` (int8 or uint8), branch-free (a
    select for its NaN pattern), so that a loop of it vectorizes: its seven magnitude bits
    shifted into float16's place are the value times 2^-8, subnormals included."""
    u = np.int32(bits) & 0xFF
    mag = u & 0x7F
    x = half_bits_to_float32(np.uint16(((u & 0x80) << 8) | (mag << 7))) * np.float32(256.0)
    return np.float32(np.nan) if mag == 0x7F else x


@njit(**INLINE)
def e4m3_half_value(bits):
    """The float32 value of the e4m3fn bit pattern ``bits`` times 2^-8 (:data:`E4M3_FOLD`),
    NaN for its NaN pattern: as the vector loops read it (:func:`_convert`), the 2^8 folded
    into the scales."""
    u = np.int32(bits) & 0xFF
    mag = u & 0x7F
    x = half_bits_to_float32(np.uint16(((u & 0x80) << 8) | (mag << 7)))
    return np.float32(np.nan) if mag == 0x7F else x


@njit(**INLINE)
def float_to_fp8(x, fmt):
    """The fp8 bit pattern (an int in 0 .. 255) of the finite number ``x``: rounded to nearest
    even, saturated to the format's largest finite value (``fmt`` FMT_E4M3 or FMT_E5M2)."""
    m_bits = 3 if fmt == FMT_E4M3 else 2
    bias = 7 if fmt == FMT_E4M3 else 15
    top = E4M3_MAX if fmt == FMT_E4M3 else E5M2_MAX
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(np.float64(x)), top)
    _, e = math.frexp(a)  # a = f * 2^e, f in [0.5, 1)
    ex = max(e - 1, 1 - bias)  # a's binade, the subnormals' below the smallest normal
    n = np.rint(a / math.ldexp(1.0, ex - m_bits))  # quanta of the binade: exact, then RNE
    one = 1 << m_bits
    if n >= 2 * one:  # rounded up into the next binade
        ex += 1
        n = n / 2
    k = np.int64(n)
    if k < one:  # subnormal (ex is the smallest normal exponent)
        return sign | k
    return sign | ((ex + bias) << m_bits) | (k - one)


@njit(**INLINE)
def round_scale(s, half):
    """The scale ``s`` as it is stored: as is, or rounded to float16 (``half``)."""
    if half:
        return np.float64(half_bits_to_float32(float32_to_half_bits(np.float32(s))))
    return np.float64(np.float32(s))


@njit(cache=CACHE, **CALLED)  # cached: called from Python (a cold process compiles it)
def quantize_blocks(x, values, scales, half_scales):
    """int8 quantization of ``x`` (N, S, H, E), float32 or float64, into ``values`` (int8, same
    shape) and ``scales`` (N, S, H, E // block), both written: block ``c`` of row ``(n, s,
    h)`` is elements ``c * block .. (c + 1) * block - 1``, ``block = E // scales.shape[3]``.
    ``scale = absmax / 127`` (then rounded as stored: to float16 if ``half_scales``, else
    float32), ``value = rint(x / scale)`` clipped to ±127; a scale of 0 gives values 0.
    Callable from ``@njit`` code; ``x`` must be finite."""
    n_len, s_len, h_len, e_len = x.shape
    nb = scales.shape[3]
    blk = e_len // nb if nb else 0
    for n in range(n_len):
        for s in range(s_len):
            for h in range(h_len):
                for c in range(nb):
                    amax = 0.0
                    for e in range(c * blk, (c + 1) * blk):
                        amax = max(amax, abs(np.float64(x[n, s, h, e])))
                    sc = round_scale(amax / INT8_MAX, half_scales)
                    scales[n, s, h, c] = sc
                    for e in range(c * blk, (c + 1) * blk):
                        if sc == 0:
                            values[n, s, h, e] = 0
                        else:
                            r = np.rint(np.float64(x[n, s, h, e]) / sc)
                            values[n, s, h, e] = np.int8(min(max(r, -INT8_MAX), INT8_MAX))


@njit(cache=CACHE, **CALLED)
def quantize_fp8(x, bits, descale, fmt):
    """fp8 quantization of ``x`` (N, S, H, E), float32 or float64, into ``bits`` (uint8 or int8,
    same shape; written) with the given ``descale`` (N, H): ``float_to_fp8(x / descale[n,
    h])``, rounded to nearest even and saturating; a descale of 0 gives 0. Callable from
    ``@njit`` code; ``x`` must be finite."""
    n_len, s_len, h_len, e_len = x.shape
    for n in range(n_len):
        for h in range(h_len):
            d = np.float64(descale[n, h])
            for s in range(s_len):
                for e in range(e_len):
                    v = float_to_fp8(np.float64(x[n, s, h, e]) / d, fmt) if d != 0 else 0
                    bits[n, s, h, e] = v


@njit(cache=CACHE, **CALLED)
def dequantize_blocks(values, scales, out):
    """``out[n, s, h, e] = values[n, s, h, e] * scales[n, s, h, e // block]`` (block ``E //
    scales.shape[3]``), in ``out``'s dtype (float32 or float64). Callable from ``@njit``
    code."""
    n_len, s_len, h_len, e_len = values.shape
    nb = scales.shape[3]
    blk = e_len // nb if nb else 1
    for n in range(n_len):
        for s in range(s_len):
            for h in range(h_len):
                for e in range(e_len):
                    out[n, s, h, e] = values[n, s, h, e] * scales[n, s, h, e // blk]


@njit(cache=CACHE, **CALLED)
def dequantize_fp8(bits, descale, fmt, out):
    """``out[n, s, h, e] = fp8(bits[n, s, h, e]) * descale[n, h]`` (``fmt`` FMT_E4M3 or
    FMT_E5M2). Callable from ``@njit`` code."""
    n_len, s_len, h_len, e_len = bits.shape
    for n in range(n_len):
        for s in range(s_len):
            for h in range(h_len):
                d = descale[n, h]
                for e in range(e_len):
                    out[n, s, h, e] = fp8_to_float32(bits[n, s, h, e], fmt) * d


def is_quantized(qz):
    """Whether ``qz`` (the decode kernel's ``quant``) is a quantized cache's: a compile-time
    constant (jitted code only)."""
    raise NotImplementedError("is_quantized is only callable from jitted code")


@overload(is_quantized)
def _is_quantized(qz):
    q = not isinstance(qz, (types.NoneType, types.Omitted))
    return lambda qz: q


def quant_scratch(qz, h_len, n_rows, bn):
    """None for float caches; for a quantized one ``(ksc, vsc, wts)``, float32: the scales of a
    block of ``bn`` keys of all ``h_len`` heads with the descales folded in, ``ksc[(h * nbk +
    c) * bn + j]`` (``nbk`` blocks a key row; a head's keys next to each other, as the vector
    loops read them) and ``vsc`` alike, and the ``n_rows`` rows' weights of P V with the value
    scales folded in, ``wts[(i * nbv + c) * bn + j]`` (jitted code only)."""
    raise NotImplementedError("quant_scratch is only callable from jitted code")


@overload(quant_scratch)
def _quant_scratch(qz, h_len, n_rows, bn):
    if isinstance(qz, (types.NoneType, types.Omitted)):
        return lambda qz, h_len, n_rows, bn: None

    def scratch(qz, h_len, n_rows, bn):
        nbk = qz[0].shape[3]
        nbv = qz[1].shape[3]
        return (np.empty(bn * h_len * nbk, np.float32), np.empty(bn * h_len * nbv, np.float32),
                np.empty(n_rows * nbv * bn, np.float32))
    return scratch


# The decode kernel's reading of a quantized cache. The scales are folded into the sums, not
# into a dequantized copy of the block: a score is ``sum_c k_scale[c] * sum_{e in c} q_e
# k_e`` over the scale blocks ``c`` (one block per token and head for int8 and fp8: the scale
# then multiplies the reduced score), and ``P V`` adds ``(p_j * v_scale[j, c]) * v_j[e]``; the
# 8-bit values are converted to float32 in registers inside the vectorized loops. Against the
# dequantized float32 rows of before (an extra pass over an L2-sized buffer, and a branch per
# element for e4m3), see scripts/quant_decode_profile.py for the per (key, head) figures.

#: What the vector loops' e4m3fn values are short of (:func:`_convert`: float16's pattern of
#: the value times 2^-8), folded into the scales by the caller: exact, a power of two.
E4M3_FOLD = 256.0

#: Values per scale block of the ``q8_0`` format (the vector loops' block size; any other
#: block that is not a whole row goes through the scalar loops).
Q8_BLOCK = 32


def _convert(builder, x, fmt):
    """The float32 vector of the vector ``x`` of int8 values or fp8 bit patterns (format
    ``fmt``), branch-free: int8 by a conversion, e5m2 as float16's top byte, e4m3fn as its
    value times 2^-8 (:data:`E4M3_FOLD`: the caller folds 2^8 into the scales) with a select
    for its NaN pattern."""
    width = x.type.count
    fvty = ir.VectorType(ir.FloatType(), width)
    if fmt == FMT_INT8:
        return builder.sitofp(x, fvty)
    i16v = ir.VectorType(ir.IntType(16), width)
    hvty = ir.VectorType(ir.HalfType(), width)

    def c16(v):
        return ir.Constant(i16v, [v] * width)
    if fmt == FMT_E5M2:
        return builder.fpext(builder.bitcast(builder.shl(builder.zext(x, i16v), c16(8)), hvty),
                             fvty)
    # e4m3fn s.eeee.mmm: sign-extended to 16 bits and shifted left by 7, the sign fills bits
    # 15 and 14 and eeee.mmm lands in float16's bits 13 .. 7; with bit 14 cleared that is
    # float16's pattern of the value times 2^-8, subnormals included (three integer
    # operations, where the sign and the magnitude placed apart took five).
    h = builder.and_(builder.shl(builder.sext(x, i16v), c16(7)), c16(0xBF80))
    f = builder.fpext(builder.bitcast(h, hvty), fvty)
    i8v = x.type
    mag = builder.and_(x, ir.Constant(i8v, [0x7F] * width))
    return builder.select(builder.icmp_unsigned("==", mag, ir.Constant(i8v, [0x7F] * width)),
                          ir.Constant(fvty, [float("nan")] * width), f)


def _fma(builder, vty):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty] * 3),
                                          f"llvm.fma.v{vty.count}f32")


def q_lane_dots(n_rows, n_keys, width, fmt, qblk):
    """Make an intrinsic ``f(q, q_stride, kbase, koff, kh, e_len, sc, sc_cstride, out)``: as
    :func:`._llvm.lane_dots` (float32 rows ``q + r * q_stride``, keys ``kbase + koff[kk] +
    kh``, ``out[r * n_keys + kk]``), the keys 8-bit values of format ``fmt`` (int8 pointers),
    converted in registers, and the scales folded in: key ``kk``'s scale of its block ``c`` is
    ``sc[kk + c * sc_cstride]`` (the keys' scales of a block next to each other). ``qblk``
    None: one scale a row, the reduced dot products multiplied by their keys' scales (one
    vector multiply). ``qblk`` (a multiple of ``width``): each block of ``qblk`` elements'
    lane sums (a fresh product, ``qblk / width`` vectors) are added into the accumulators by
    one multiply-add with its scale. ``e_len`` a positive multiple of ``width`` (and of
    ``qblk``).

    The keys are addressed from ``kbase`` and their offsets (reloaded from ``koff`` in the
    loop), not by ``n_keys`` pointers: these stay live across the loop, and with the
    accumulators, the row pointers and the counters they outnumber x86-64's 16 integer
    registers and spill."""
    assert n_rows * n_keys == width
    n_sub = 1 if qblk is None else qblk // width
    f32p = types.CPointer(types.float32)

    @intrinsic
    def _q_lane_dots(typingctx, q, q_stride, kbase, koff, kh, e_len, sc, sc_cstride, out):
        if not (q == f32p == sc == out and kbase == types.CPointer(types.int8)
                and koff == types.CPointer(types.int64)
                and all(isinstance(t, types.Integer) for t in (q_stride, kh, e_len, sc_cstride))):
            return None
        sig = types.void(q, q_stride, kbase, koff, kh, e_len, sc, sc_cstride, out)

        def codegen(context, builder, signature, args):
            qp, _, kb, ko, _, _, scp, _, op = args
            i64 = ir.IntType(64)
            i32 = ir.IntType(32)
            qs, khv, el, scs = (context.cast(builder, args[i], signature.args[i], types.int64)
                                for i in (1, 4, 5, 7))
            vty = ir.VectorType(ir.FloatType(), width)
            bvty = ir.VectorType(ir.IntType(8), width)
            fma = _fma(builder, vty)
            rows = [builder.gep(qp, [builder.mul(qs, ir.Constant(i64, r))])
                    for r in range(n_rows)]
            # Key kk's row from the base: its offset plus the head's (loaded in the loop).
            kbh = builder.gep(kb, [khv])
            entry = builder.block
            loop = builder.append_basic_block("q_lane_dots.loop")
            done = builder.append_basic_block("q_lane_dots.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            e = builder.phi(i64)
            e.add_incoming(ir.Constant(i64, 0), entry)
            c = builder.phi(i64)
            c.add_incoming(ir.Constant(i64, 0), entry)
            accs = []
            for _ in range(width):
                a = builder.phi(vty)
                a.add_incoming(ir.Constant(vty, None), entry)
                accs.append(a)

            def vload(p, off, ty, sub, align):
                at = builder.add(off, ir.Constant(i64, sub * width))
                return builder.load(builder.bitcast(builder.gep(p, [at]), ty.as_pointer()),
                                    align=align)

            qv = [[vload(p, e, vty, u, 4) for u in range(n_sub)] for p in rows]
            kv = []
            for k in range(n_keys):
                off = builder.add(builder.load(builder.gep(ko, [ir.Constant(i64, k)])), e)
                kv.append([_convert(builder, vload(kbh, off, bvty, u, 1), fmt)
                           for u in range(n_sub)])
            new = []
            if qblk is not None:
                cs = builder.mul(c, scs)
            for r in range(n_rows):
                for k in range(n_keys):
                    acc = accs[r * n_keys + k]
                    if qblk is None:
                        new.append(builder.call(fma, [qv[r][0], kv[k][0], acc]))
                        continue
                    t = builder.fmul(qv[r][0], kv[k][0], flags=("contract",))
                    for u in range(1, n_sub):
                        t = builder.call(fma, [qv[r][u], kv[k][u], t])
                    at = builder.add(cs, ir.Constant(i64, k))
                    s = splat(builder, builder.load(builder.gep(scp, [at])), vty)
                    new.append(builder.call(fma, [s, t, acc]))
            e_next = builder.add(e, ir.Constant(i64, width * n_sub))
            e.add_incoming(e_next, builder.block)
            c.add_incoming(builder.add(c, ir.Constant(i64, 1)), builder.block)
            for a, x in zip(accs, new):
                a.add_incoming(x, builder.block)
            builder.cbranch(builder.icmp_signed("<", e_next, el), loop, done)
            builder.position_at_end(done)
            res = _sum_tree(builder, new, width)
            if qblk is None:  # times the keys' scales: lane r * n_keys + kk takes sc[kk]
                kvty = ir.VectorType(ir.FloatType(), n_keys)
                ks = builder.load(builder.bitcast(scp, kvty.as_pointer()), align=4)
                idx = ir.Constant(ir.VectorType(i32, width),
                                  [kk for _ in range(n_rows) for kk in range(n_keys)])
                res = builder.fmul(res, builder.shuffle_vector(ks, ks, idx))
            builder.store(res, builder.bitcast(op, vty.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _q_lane_dots


def q_rows_pv(n_rows, n_vec, width, fmt, qblk):
    """Make an intrinsic ``f(acc, acc_stride, p, p_stride, p_cstride, vbase, voff, vh, n)``: as
    :func:`._llvm.rows_pv` (``acc[r * acc_stride + d] += w * v_j[d]`` over the keys ``j < n``
    in order, ``v_j = vbase + voff[j] + vh``, ``d < n_vec * width``), the values 8-bit of
    format ``fmt`` (int8 pointers) converted in registers, and the weight of row ``r``, key
    ``j``, vector ``u`` (elements ``u * width ..``) ``p[r * p_stride + c * p_cstride + j]``
    with ``c = u * width // qblk`` (``qblk`` None: ``c = 0``): the probabilities with the
    values' scales of their blocks folded in."""
    f32p = types.CPointer(types.float32)

    @intrinsic
    def _q_rows_pv(typingctx, acc, acc_stride, p, p_stride, p_cstride, vbase, voff, vh, n):
        if not (acc == p == f32p and vbase == types.CPointer(types.int8)
                and voff == types.CPointer(types.int64)
                and all(isinstance(t, types.Integer)
                        for t in (acc_stride, p_stride, p_cstride, vh, n))):
            return None
        sig = types.void(acc, acc_stride, p, p_stride, p_cstride, vbase, voff, vh, n)

        def codegen(context, builder, signature, args):
            ap, _, pp, _, _, vb, vo, _, _ = args
            i64 = ir.IntType(64)
            as_, ps, pcs, vhv, nv = (context.cast(builder, args[i], signature.args[i],
                                                  types.int64) for i in (1, 3, 4, 7, 8))
            vty = ir.VectorType(ir.FloatType(), width)
            bvty = ir.VectorType(ir.IntType(8), width)
            fma = _fma(builder, vty)

            def vptr(base, off, u, ty):
                return builder.bitcast(
                    builder.gep(base, [builder.add(off, ir.Constant(i64, u * width))]),
                    ty.as_pointer())

            aptrs = [[vptr(ap, builder.mul(as_, ir.Constant(i64, r)), u, vty)
                      for u in range(n_vec)] for r in range(n_rows)]
            n_c = 1 if qblk is None else (n_vec * width + qblk - 1) // qblk
            prows = [[builder.gep(pp, [builder.add(builder.mul(ps, ir.Constant(i64, r)),
                                                   builder.mul(pcs, ir.Constant(i64, cc)))])
                      for cc in range(n_c)] for r in range(n_rows)]
            init = [[builder.load(a, align=4) for a in row] for row in aptrs]

            def step(j, accs):
                off = builder.add(builder.load(builder.gep(vo, [j])), vhv)
                vs = [_convert(builder, builder.load(vptr(vb, off, u, bvty), align=1), fmt)
                      for u in range(n_vec)]
                new = []
                for r in range(n_rows):
                    ws = [splat(builder, builder.load(builder.gep(prows[r][cc], [j])), vty)
                          for cc in range(n_c)]
                    new.append([builder.call(fma, [ws[0 if qblk is None else u * width // qblk],
                                                   vs[u], accs[r][u]]) for u in range(n_vec)])
                return new

            store_rows(builder, over_keys(builder, "q_rows_pv", init, nv, step), aptrs)
            return context.get_dummy_value()

        return sig, codegen

    return _q_rows_pv
