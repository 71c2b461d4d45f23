"""Quantized key/value caches in jitted code: the 8-bit formats' quantize and dequantize
(callable from Python and from users' ``@njit`` code) and the decode kernel's dequantization
of a block of keys or values.

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
from numba import njit, types
from numba.extending import overload

from ._llvm import data_ptr, float32_to_half_bits, half_bits_to_float32, ptr_add
from .options import CALLED, FASTMATH, INLINE
from .storage import load

FMT_INT8 = 0
FMT_E4M3 = 1
FMT_E5M2 = 2

#: Saturation bound (the largest finite value) of each format, and absmax / MAX is the scale.
INT8_MAX = 127.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0


@njit(**INLINE)
def fp8_to_float32(bits, fmt):
    """The float32 value of an fp8 bit pattern ``bits`` (an int8 or uint8; ``fmt`` FMT_E4M3 or
    FMT_E5M2). e5m2 is float16's top byte; e4m3fn's seven magnitude bits shifted into
    float16's place are the value times 2^-8, subnormals included; 0x7F / 0xFF is its NaN."""
    u = np.int32(bits) & 0xFF
    if fmt == FMT_E5M2:
        return half_bits_to_float32(np.uint16(u << 8))
    mag = u & 0x7F
    if mag == 0x7F:
        return np.float32(np.nan)
    return half_bits_to_float32(np.uint16(((u & 0x80) << 8) | (mag << 7))) * np.float32(256.0)


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


@njit(**CALLED)
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


@njit(**CALLED)
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


@njit(**CALLED)
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


@njit(**CALLED)
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


@njit(**INLINE)
def dequantize_row(src, dst, e_len, fmt, scales, page, slot, h, descale):
    """The kernels' dequantization of one key or value row: ``dst[e]`` (float32, a pointer)
    ``= value(src[e]) * scales[page, slot, h, e // block] * descale`` for ``e < e_len``
    (``src``: a pointer to int8 values or fp8 bits of format ``fmt``; ``block = e_len //
    scales.shape[3]``). The format's branch is outside the element loops, which vectorize."""
    nb = scales.shape[3]
    blk = e_len // nb
    for c in range(nb):
        sc = np.float32(load(scales[page, slot, h, c]) * descale)
        e0 = c * blk
        if fmt == FMT_INT8:
            for e in range(e0, e0 + blk):
                dst[e] = np.float32(src[e]) * sc
        elif fmt == FMT_E5M2:
            for e in range(e0, e0 + blk):
                dst[e] = half_bits_to_float32(np.uint16((np.int32(src[e]) & 0xFF) << 8)) * sc
        else:
            for e in range(e0, e0 + blk):
                dst[e] = fp8_to_float32(src[e], FMT_E4M3) * sc


def is_quantized(qz):
    """Whether ``qz`` (the decode kernel's ``quant``) is a quantized cache's: a compile-time
    constant (jitted code only)."""
    raise NotImplementedError("is_quantized is only callable from jitted code")


@overload(is_quantized)
def _is_quantized(qz):
    q = not isinstance(qz, (types.NoneType, types.Omitted))
    return lambda qz: q


def quant_scratch(qz, h_len, e_len, ev, bn):
    """None for float caches; for a quantized one ``(kx, vx, kqo, vqo)``: float32 rows for a
    block of ``bn`` keys of all ``h_len`` heads, keys ``(bn, h_len, e_len)`` and values
    ``(bn, h_len, ev)``, and the offsets of their key rows (jitted code only)."""
    raise NotImplementedError("quant_scratch is only callable from jitted code")


@overload(quant_scratch)
def _quant_scratch(qz, h_len, e_len, ev, bn):
    if isinstance(qz, (types.NoneType, types.Omitted)):
        return lambda qz, h_len, e_len, ev, bn: None

    def scratch(qz, h_len, e_len, ev, bn):
        kqo = np.arange(bn) * (h_len * e_len)
        vqo = np.arange(bn) * (h_len * ev)
        return (np.empty(bn * h_len * e_len, np.float32), np.empty(bn * h_len * ev, np.float32),
                kqo, vqo)
    return scratch


def quant_block(qz, scr, k_cache, v_cache, block_table, b, b0, n, page_size, h_lo, h_hi,
                kbase, vbase, koff, voff, khs, vhs):
    """Where the decode kernel reads a block's keys and values: ``(kbase, vbase, koff, voff,
    khs, vhs)``, key ``j`` of head ``h`` at ``kbase + koff[j] + h * khs``. A float cache's are
    returned as they are; a quantized cache's block (keys ``b0 .. b0 + n - 1`` of sequence
    ``b``, heads ``h_lo .. h_hi - 1``, at ``koff`` / ``voff`` in the cache) is dequantized
    into the float32 rows ``scr``, the scales folded in, and those are returned (jitted code
    only)."""
    raise NotImplementedError("quant_block is only callable from jitted code")


@overload(quant_block, fastmath=FASTMATH)
def _quant_block(qz, scr, k_cache, v_cache, block_table, b, b0, n, page_size, h_lo, h_hi,
                 kbase, vbase, koff, voff, khs, vhs):
    if isinstance(qz, (types.NoneType, types.Omitted)):
        return (lambda qz, scr, k_cache, v_cache, block_table, b, b0, n, page_size, h_lo, h_hi,
                kbase, vbase, koff, voff, khs, vhs: (kbase, vbase, koff, voff, khs, vhs))

    def dequantized(qz, scr, k_cache, v_cache, block_table, b, b0, n, page_size, h_lo, h_hi,
                    kbase, vbase, koff, voff, khs, vhs):
        ks, vs, kd, vd, fmt = qz
        kx, vx, kqo, vqo = scr
        e_len = k_cache.shape[3]
        ev = v_cache.shape[3]
        kxp = data_ptr(kx)
        vxp = data_ptr(vx)
        page = b0 // page_size
        slot = b0 - page * page_size
        for j in range(n):
            p = block_table[b, page]
            for h in range(h_lo, h_hi):
                dequantize_row(ptr_add(kbase, koff[j] + h * khs), ptr_add(kxp, kqo[j] + h * e_len),
                               e_len, fmt, ks, p, slot, h, kd[b, h])
                dequantize_row(ptr_add(vbase, voff[j] + h * vhs), ptr_add(vxp, vqo[j] + h * ev),
                               ev, fmt, vs, p, slot, h, vd[b, h])
            slot += 1
            if slot == page_size:
                slot = 0
                page += 1
        return kxp, vxp, kqo, vqo, e_len, ev
    return dequantized
