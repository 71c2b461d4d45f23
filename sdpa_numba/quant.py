"""Quantized key/value caches: 8-bit formats that :func:`sdpa_numba.attention_with_kvcache`
reads (``k_scale=``, ``v_scale=``) and dequantizes inside its kernel, and the functions that
make and undo them.

Formats (``x ~ value * scale``):

``"int8"``
    int8 values in ``-127 .. 127``, one scale per token and head: scales ``(N, S, H)``,
    float32 or float16, ``scale = absmax(row) / 127``.
``"q8_0"``
    llama.cpp's blocks: int8 values, one scale per 32 values along the head dim: scales
    ``(N, S, H, E // 32)`` (``E`` a multiple of 32), ``scale = absmax(block) / 127``;
    float16 scales make it llama.cpp's 8.5 bits a value.
``"e4m3fn"``, ``"e5m2"``
    fp8 values (``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2``) with a descale per tensor (a
    scalar) or per (sequence, head) ``(B, H)``, FlashAttention 3's ``k_descale`` and vLLM's
    ``k_scale``: ``scale = absmax / 448`` (e4m3fn) or ``absmax / 57344`` (e5m2).

Rounding: ``value = round(x / scale)`` to nearest, ties to even, with the scale as stored
(rounded to the scales' dtype first), saturating at the format's largest value (127, 448,
57344); a block whose scale is 0 (all zeros) has values 0. An append into a quantized cache
quantizes the new keys and values the same way: int8 and q8_0 write their new scales, fp8
keeps its descale (values beyond it saturate).

``quantize_kv`` / ``dequantize_kv`` work on NumPy arrays; the jitted forms
(:func:`quantize_blocks`, :func:`quantize_fp8`, :func:`dequantize_blocks`,
:func:`dequantize_fp8`, and the element functions :func:`float_to_fp8`,
:func:`fp8_to_float32`) are callable from users' ``@njit`` code on 4-D float32/float64
arrays.
"""

import numpy as np

from ._bf16 import is_bfloat16
from .cpu.quant import (dequantize_blocks, dequantize_fp8, float_to_fp8, fp8_to_float32,
                        quantize_blocks, quantize_fp8)
from .problem.quant import Q8_0_BLOCK, quant_kind
from .score.formats import E4M3_MAX, E5M2_MAX, FMT_E4M3, FMT_E5M2

__all__ = ["quantize_kv", "dequantize_kv", "FORMATS", "quantize_blocks", "quantize_fp8",
           "dequantize_blocks", "dequantize_fp8", "float_to_fp8", "fp8_to_float32"]

#: The formats' names.
FORMATS = ("int8", "q8_0", "e4m3fn", "e5m2")
_FP8_MAX = {"e4m3fn": E4M3_MAX, "e5m2": E5M2_MAX}
_FP8_CODE = {"e4m3fn": FMT_E4M3, "e5m2": FMT_E5M2}


def _fp8_dtype(name):
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"the {name} format needs the ml_dtypes package (pip install "
                        f"ml-dtypes)") from None
    return np.dtype(ml_dtypes.float8_e4m3fn if name == "e4m3fn" else ml_dtypes.float8_e5m2)


def _as_float(name, x):
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dims (N, S, H, E), got shape {x.shape}")
    if not (x.dtype.kind == "f" or is_bfloat16(x.dtype)) or quant_kind(x.dtype):
        raise TypeError(f"{name} must be a float array (float16, bfloat16, float32, float64), "
                        f"got dtype {x.dtype}")
    x = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite to be quantized (it has NaN or inf)")
    return x


def quantize_kv(x, format, *, scale_dtype=np.float32, per_head=False):
    """Quantize a key or value cache into one of :data:`FORMATS`.

    Parameters
    ----------
    x : array, shape (N, S, H, E)
        A cache (``(B, S_max, H, E)`` or paged ``(num_pages, page_size, H, E)``), float16,
        bfloat16, float32 or float64; finite.
    format : {"int8", "q8_0", "e4m3fn", "e5m2"}
    scale_dtype : float32 or float16, keyword-only
        The scales' dtype for int8 and q8_0 (fp8 descales are float32).
    per_head : bool, keyword-only
        fp8 only: a descale per (N, H) (per sequence and head of a contiguous cache, as
        FlashAttention 3's ``k_descale``), instead of one for the tensor.

    Returns
    -------
    values : ndarray, shape (N, S, H, E)
        int8, or ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2``.
    scale : ndarray
        ``(N, S, H)`` (int8), ``(N, S, H, E // 32)`` (q8_0), ``()`` or ``(N, H)`` (fp8):
        ``x ~ values * scale`` (see the module for the rounding).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    x = _as_float("x", x)
    n, s, h, e = x.shape
    if format in _FP8_MAX:
        if per_head:
            amax = np.abs(x).max(axis=(1, 3), initial=0.0)
        else:
            amax = np.float64(np.abs(x).max(initial=0.0))
        descale = np.asarray(amax / _FP8_MAX[format], np.float32)
        bits = np.empty(x.shape, np.uint8)
        quantize_fp8(x, bits, np.broadcast_to(descale, (n, h)), _FP8_CODE[format])
        return bits.view(_fp8_dtype(format)), descale
    sdt = np.dtype(scale_dtype)
    if sdt not in (np.float32, np.float16):
        raise TypeError(f"scale_dtype must be float32 or float16, got {sdt}")
    if format == "q8_0" and e % Q8_0_BLOCK:
        raise ValueError(f"q8_0 needs a head dim that is a multiple of {Q8_0_BLOCK}, got {e}")
    nb = 1 if format == "int8" else e // Q8_0_BLOCK
    values = np.empty(x.shape, np.int8)
    scales = np.empty((n, s, h, nb), np.float32)
    quantize_blocks(x, values, scales, sdt == np.float16)
    scales = scales.astype(sdt)
    return values, scales[..., 0] if format == "int8" else scales


def dequantize_kv(values, scale, *, dtype=np.float32):
    """The float cache a quantized one stands for: ``values * scale`` (the format from the
    values' dtype and the scale's shape, as :func:`sdpa_numba.attention_with_kvcache` reads
    them), in ``dtype`` (float32 or float64).

    Parameters
    ----------
    values : ndarray, shape (N, S, H, E)
        int8, ``float8_e4m3fn`` or ``float8_e5m2``.
    scale : ndarray or float
        As :func:`quantize_kv` returns it (fp8: a scalar or ``(N, H)``).
    dtype : float32 or float64, keyword-only

    Returns
    -------
    ndarray, shape (N, S, H, E), of ``dtype``
    """
    values = np.asarray(values)
    kind = quant_kind(values.dtype)
    if kind is None or values.ndim != 4:
        raise TypeError(f"values must be a 4-D int8, float8_e4m3fn or float8_e5m2 array, got "
                        f"{values.dtype} of shape {values.shape}")
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    scale = np.asarray(scale)
    n, s, h, e = values.shape
    out = np.empty(values.shape, dtype)
    if kind == "int8":
        sc = scale[..., None] if scale.ndim == 3 else scale
        if sc.ndim != 4 or sc.shape[:3] != (n, s, h) or e % sc.shape[3]:
            raise ValueError(f"scale of an int8 cache {values.shape} must have shape "
                             f"{(n, s, h)} or (N, S, H, E // 32), got {scale.shape}")
        dequantize_blocks(values, sc.astype(dtype), out)
        return out
    if scale.ndim != 0 and scale.shape != (n, h):
        raise ValueError(f"scale of an fp8 cache must be a scalar or have shape {(n, h)}, got "
                         f"{scale.shape}")
    dequantize_fp8(values.view(np.uint8), np.broadcast_to(scale.astype(dtype), (n, h)),
                   _FP8_CODE[kind], out)
    return out
