"""Quantized key/value caches on the GPU: the CUDA twin of :mod:`sdpa_numba.cpu.quant`.

The formats are :mod:`sdpa_numba.quant`'s (codes ``FMT_INT8``, ``FMT_E4M3``, ``FMT_E5M2`` of
:mod:`sdpa_numba.cpu.quant`). The kernels read every cache element as a uint8 byte and turn
it into its value through :func:`value_table`, a ``(3, 256)`` float32 table (row ``fmt``,
column the byte): int8, e4m3fn and e5m2 values are all exact in float32, one table lookup
serves every format, and the format stays a run-time number, so one compiled decode kernel
serves all of them (per query dtype and scales' dtype). The scales fold into the scores and
``P V`` in :mod:`.decode`.

An append quantizes the new keys and values on the device (:func:`append_quantized`) exactly
as the CPU append does (bit for bit): in float64, ``scale = absmax / 127`` rounded to float32
(then to float16 for float16 scales), ``value = round(x / scale)`` to nearest even, clipped
to ``±127`` (a scale of 0 gives values 0); fp8 with the cache's descale, ``x / descale``
rounded to the nearest fp8 value, ties to the even code, saturating (a descale of 0 gives 0).
Its kernel is compiled without fastmath: a reciprocal in place of the division would change
the rounding.
"""

import math

import numba
import numpy as np
from numba import cuda

from ..score.formats import E4M3_MAX, E5M2_MAX, FMT_E4M3, FMT_E5M2, FMT_INT8, INT8_MAX
from .arrays import as_strided, is_simulated_mode
from .storage import load, storage_view

__all__ = ["value_table", "device_table", "quant_operands", "append_quantized", "quant_dot",
           "quant_value", "LARGEST"]

#: float16 (numba has no top-level name for it).
_F16 = numba.types.float16

#: The largest finite code of each format's positive half (its values increase with the
#: code up to there): 127 for int8, 0x7E for e4m3fn (0x7F is its NaN), 0x7B for e5m2 (0x7C
#: is inf).
LARGEST = (127, 0x7E, 0x7B)


def _fp8_values(m_bits, bias):
    """The float64 values of the 256 fp8 codes with ``m_bits`` mantissa bits and exponent
    ``bias`` (IEEE-like: subnormals at exponent field 0; the caller marks NaN / inf)."""
    u = np.arange(256)
    sign = np.where(u & 0x80, -1.0, 1.0)
    ex = (u >> m_bits) & ((0x80 >> m_bits) - 1)
    man = u & ((1 << m_bits) - 1)
    mag = np.where(ex == 0, np.ldexp(man.astype(np.float64), 1 - bias - m_bits),
                   np.ldexp((man + (1 << m_bits)).astype(np.float64), ex - bias - m_bits))
    return sign * mag


def value_table():
    """The ``(3, 256)`` float32 table of the values of every byte in each format: row
    ``FMT_INT8`` the byte as an int8, ``FMT_E4M3`` as ``float8_e4m3fn`` (0x7F, 0xFF: NaN),
    ``FMT_E5M2`` as ``float8_e5m2`` (0x7C / 0xFC: ±inf; 0x7D-0x7F, 0xFD-0xFF: NaN)."""
    t = np.empty((3, 256), np.float64)
    t[FMT_INT8] = np.arange(256).astype(np.uint8).view(np.int8)
    t[FMT_E4M3] = _fp8_values(3, 7)
    t[FMT_E4M3, [0x7F, 0xFF]] = np.nan
    e5 = _fp8_values(2, 15)
    e5[[0x7C, 0xFC]] = [np.inf, -np.inf]
    e5[0x7D:0x80] = e5[0xFD:] = np.nan
    t[FMT_E5M2] = e5
    assert t[FMT_E4M3, LARGEST[FMT_E4M3]] == E4M3_MAX and t[FMT_E5M2, 0x7B] == E5M2_MAX
    return t.astype(np.float32)


_tables = {}


def _once(name, make):
    """The device array ``make()`` made once per process (and per CUDA context)."""
    key = (name, 0 if is_simulated_mode() else id(cuda.current_context()))
    if key not in _tables:
        _tables[key] = cuda.to_device(make())
    return _tables[key]


def device_table():
    """:func:`value_table` on the device, copied once per process (and per context)."""
    return _once("values", value_table)


def _ones(shape):
    """A device view of float32 ones of ``shape`` (one element, zero strides; never
    written)."""
    one = _once("one", lambda: np.ones(1, np.float32))
    return as_strided(one, shape, (0,) * len(shape))


def _blocks(x):
    """Scales ``(N, S, H)`` (int8 per token and head) as ``(N, S, H, 1)``, a view; q8_0's
    ``(N, S, H, E // 32)`` as they are."""
    if x.ndim == 4:
        return x
    return as_strided(x, (*x.shape, 1), (*x.strides, 0))


def _descale(x, b, h):
    """An fp8 descale (a 0-d or ``(B, H)`` device array) as ``(B, H)``, a view."""
    if x.ndim == 2:
        return x
    return as_strided(x, (b, h), (0, 0))


def quant_operands(p, k_scale, v_scale):
    """The decode kernel's ``qz`` for problem ``p``'s quantized cache and its scales (device
    arrays): ``(ks, vs, kd, vd, fmt, table)``: the scales as ``(N, S, H, n_blocks)`` (ones for
    fp8), the descales as ``(B, H)`` (ones for int8 and q8_0), the format's code and
    :func:`device_table`; views, no copies of the scales."""
    n, s, h = p.k_cache_shape[:3]
    b = p.n_seq
    spec = p.quant
    if spec.fp8:
        ones = _ones((n, s, h, 1))
        return (ones, ones, _descale(k_scale, b, h), _descale(v_scale, b, h), spec.fmt,
                device_table())
    one = _ones((b, h))
    return (_blocks(k_scale), _blocks(v_scale), one, one, spec.fmt, device_table())


@cuda.jit(device=True, inline="always")
def quant_dot(sm, at, e_len, cache, pg, sl, h, b, qz, zero):
    """The score ``sm[at:at + e_len] . k`` against key ``(pg, sl, h)`` of a quantized cache
    (``cache``: its bytes as uint8; ``qz``: :func:`quant_operands`'s) of sequence ``b``, in
    ``zero``'s type: per block of the head dim, the dot product with the stored values, then
    times the block's scale; the descale last."""
    ks, vs, kd, vd, fmt, table = qz
    nb = ks.shape[3]
    blk = e_len // nb
    s = zero
    for c in range(nb):
        part = zero
        for e in range(c * blk, c * blk + blk):
            part += sm[at + e] * table[fmt, cache[pg, sl, h, e]]
        s += part * numba.float32(ks[pg, sl, h, c])
    return s * kd[b, h]


@cuda.jit(device=True, inline="always")
def quant_value(cache, pg, sl, h, d, b, qz, zero):
    """Element ``d`` of value ``(pg, sl, h)`` of a quantized cache of sequence ``b``,
    dequantized as the CPU kernel does (``value * float32(scale * descale)``, in float32),
    in ``zero``'s type."""
    ks, vs, kd, vd, fmt, table = qz
    blk = cache.shape[3] // vs.shape[3]
    return zero + table[fmt, cache[pg, sl, h, d]] * (numba.float32(vs[pg, sl, h, d // blk])
                                                     * vd[b, h])


@cuda.jit
def _append_kernel(x, cache_i8, cache_u8, scales, descale, seq, pages, slots, fmt, half,
                   table):
    """One (new row, head) per thread: row ``n`` of ``x`` (``(B, n_new, H, D)``, row ``n`` at
    ``[n // n_new, n % n_new]``) quantized into slot ``(pages[n], slots[n])`` of the cache
    (``cache_i8`` / ``cache_u8``: two views of its bytes), with its scales (int8, q8_0) or
    the descale of its sequence ``seq[n]`` (fp8)."""
    t = cuda.grid(1)
    n_new, h_len, d_len = x.shape[1], x.shape[2], x.shape[3]
    if t >= x.shape[0] * n_new * h_len:
        return
    row, h = t // h_len, t % h_len
    bq, i = row // n_new, row % n_new
    pg, sl = pages[row], slots[row]
    if fmt == FMT_INT8:
        nb = scales.shape[3]
        blk = d_len // nb
        for c in range(nb):
            amax = 0.0
            for e in range(c * blk, c * blk + blk):
                amax = max(amax, abs(numba.float64(load(x[bq, i, h, e]))))
            s32 = numba.float32(amax / INT8_MAX)
            if half:  # rounded as the CPU rounds it: to float32, then to float16
                s32 = numba.float32(_F16(s32))
            sc = numba.float64(s32)
            scales[pg, sl, h, c] = s32
            for e in range(c * blk, c * blk + blk):
                r = 0
                if sc != 0:
                    # Clipped before rounding (a huge quotient does not fit an integer), which
                    # gives what rounding then clipping to +-127 gives.
                    y = min(max(numba.float64(load(x[bq, i, h, e])) / sc, -128.0), 128.0)
                    r = min(max(round(y), -127), 127)
                cache_i8[pg, sl, h, e] = r
    else:
        d = numba.float64(descale[seq[row], h])
        top = LARGEST[FMT_E4M3] if fmt == FMT_E4M3 else LARGEST[FMT_E5M2]
        for e in range(d_len):
            code = 0
            if d != 0:
                y = numba.float64(load(x[bq, i, h, e])) / d
                a = min(abs(y), numba.float64(table[fmt, top]))
                # The largest code whose value is <= a (values increase with the codes 0 ..
                # top), then the nearer of it and the next, ties to the even code.
                lo, hi = 0, top
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if numba.float64(table[fmt, mid]) <= a:
                        lo = mid
                    else:
                        hi = mid - 1
                code = lo
                v0 = numba.float64(table[fmt, lo])
                if v0 != a:
                    # Exact differences: a and the codes' values are multiples of a's ulp.
                    below = a - v0
                    above = numba.float64(table[fmt, lo + 1]) - a
                    if above < below or (above == below and lo % 2 == 1):
                        code = lo + 1
                if math.copysign(1.0, y) < 0:
                    code += 0x80
            cache_u8[pg, sl, h, e] = code


def append_quantized(p, k, v, k_cache, v_cache, qz, stream=0):
    """The append of problem ``p`` into its quantized cache (device arrays): the new keys
    and values ``k``, ``v`` (``(B, n_new, H, D)``; a ragged batch's as ``(1, total, H, D)``)
    quantized into their slots, with their scales for int8 and q8_0 (``qz``:
    :func:`quant_operands`'s, whose scales are views of the caller's)."""
    if p.pages is None or len(p.pages) == 0:
        return
    ks, vs, kd, vd, fmt, table = qz
    half = bool(np.dtype(ks.dtype) == np.float16)
    to = lambda a: cuda.to_device(np.ascontiguousarray(a, np.int64), stream=stream)  # noqa: E731
    pages, slots, seq = to(p.pages), to(p.slots), to(p.append_b)
    mt = 32 if is_simulated_mode() else 128
    for x, cache, sc, d in ((k, k_cache, ks, kd), (v, v_cache, vs, vd)):
        x = storage_view(x)
        n = x.shape[0] * x.shape[1] * x.shape[2]
        i8 = as_strided(cache, cache.shape, cache.strides, np.int8)
        u8 = as_strided(cache, cache.shape, cache.strides, np.uint8)
        _append_kernel[-(-n // mt), mt, stream](x, i8, u8, sc, d, seq, pages, slots, fmt,
                                                half, table)
