"""The rules of quantized key/value caches (host side): which format a cache and its scales
are, and the checks of the scales, run before anything is read or written.

The format follows from the cache's dtype and the scale's shape (see
:mod:`sdpa_numba.quant`):

* int8 cache, scale ``(N, S, H)``: ``"int8"``, one scale per token and head;
* int8 cache, scale ``(N, S, H, E // 32)``: ``"q8_0"``, one scale per 32 values along the head
  dim (``E`` a multiple of 32);
* ``float8_e4m3fn`` / ``float8_e5m2`` cache (ml_dtypes), scale a scalar or ``(B, H)``:
  ``"e4m3fn"`` / ``"e5m2"``, a descale per tensor or per (sequence, head) as FlashAttention
  3's ``k_descale`` / ``v_descale``.

``N, S`` are the cache's first two dims (``(B, S_max)`` or ``(num_pages, page_size)``).
Scales are float32 or float16 (fp8 descales float32); finite; any strides.
"""

from dataclasses import dataclass

import numpy as np

from ..score.formats import FMT_E4M3, FMT_E5M2, FMT_INT8
from .arguments import shape_str

#: The block of values a q8_0 scale covers along the head dim.
Q8_0_BLOCK = 32

#: Format codes of the kernels (:mod:`sdpa_numba.score.formats`).
_FMT = {"int8": FMT_INT8, "q8_0": FMT_INT8, "e4m3fn": FMT_E4M3, "e5m2": FMT_E5M2}
_FP8 = {"float8_e4m3fn": "e4m3fn", "float8_e5m2": "e5m2"}


def quant_kind(dtype):
    """``"int8"``, ``"e4m3fn"``, ``"e5m2"`` for a quantized cache's dtype, else None."""
    dt = np.dtype(dtype)
    if dt == np.int8:
        return "int8"
    return _FP8.get(dt.name)


@dataclass(frozen=True)
class QuantSpec:
    """A quantized cache's format, as checked: ``name`` (``"int8"``, ``"q8_0"``, ``"e4m3fn"``,
    ``"e5m2"``), ``fmt`` (the kernels' code), ``cache_dtype``, ``scale_dtype``, the scales'
    shapes as given (``k_scale_shape``, ``v_scale_shape``)."""

    name: str
    fmt: int
    cache_dtype: np.dtype
    scale_dtype: np.dtype
    k_scale_shape: tuple
    v_scale_shape: tuple

    @property
    def fp8(self):
        """Whether the scales are fp8 descales (per tensor or per (B, H)), not per token."""
        return self.fmt != 0

    def scale_bytes(self, e, ev):
        """Bytes of scales read per (key, head) for head dims ``e`` and ``ev``."""
        if self.fp8:
            return 0
        n = 2 if self.name == "int8" else (e + ev) // Q8_0_BLOCK
        return n * self.scale_dtype.itemsize


def _scale_dtype(name, s, fp8):
    dt = np.dtype(s.dtype)
    allowed = (np.float32,) if fp8 else (np.float32, np.float16)
    if dt not in [np.dtype(a) for a in allowed]:
        raise TypeError(f"{name} dtype {dt} is not supported: use "
                        + ("float32 (an fp8 cache's descale)" if fp8 else "float32 or float16"))
    return dt


def quant_spec(k_cache, v_cache, k_scale, v_scale, batch):
    """The :class:`QuantSpec` of caches ``k_cache``, ``v_cache`` and scales ``k_scale``,
    ``v_scale`` (arrays or None), or None for float caches given no scales. ``batch``: q's
    batch size ``B`` (an fp8 descale is ``(B, H)``). TypeError / ValueError naming the
    argument."""
    kind = quant_kind(k_cache.dtype)
    v_kind = quant_kind(v_cache.dtype)
    if kind is None and v_kind is None:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{name} is for a quantized cache (int8, float8_e4m3fn or "
                                 f"float8_e5m2), got a {np.dtype(k_cache.dtype)} k_cache: "
                                 f"pass no scales with a float cache")
        return None
    if np.dtype(k_cache.dtype) != np.dtype(v_cache.dtype):
        raise TypeError(f"v_cache dtype {np.dtype(v_cache.dtype)} differs from k_cache dtype "
                        f"{np.dtype(k_cache.dtype)} (a quantized cache's keys and values are "
                        f"stored alike)")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"a {np.dtype(k_cache.dtype)} cache needs {name}: the scales "
                             f"that dequantize it (see sdpa_numba.quant)")
    n, s_len, h, e = k_cache.shape
    ev = v_cache.shape[3]
    fp8 = kind != "int8"
    sdt = _scale_dtype("k_scale", k_scale, fp8)
    if _scale_dtype("v_scale", v_scale, fp8) != sdt:
        raise TypeError(f"v_scale dtype {np.dtype(v_scale.dtype)} differs from k_scale dtype "
                        f"{sdt}")
    if fp8:
        name = kind
        for arg, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s.ndim != 0 and tuple(s.shape) != (batch, h):
                raise ValueError(f"{arg} of a {kind} cache must be a scalar or have shape "
                                 f"(B, H) = ({batch}, {h}), got {shape_str(s)}")
    else:
        name = "int8" if k_scale.ndim == 3 else "q8_0"
        for arg, s, d in (("k_scale", k_scale, e), ("v_scale", v_scale, ev)):
            if name == "q8_0" and d % Q8_0_BLOCK:
                raise ValueError(f"a q8_0 cache's head dim must be a multiple of "
                                 f"{Q8_0_BLOCK}, got {d} ({arg} has one scale per "
                                 f"{Q8_0_BLOCK} values)")
            want = (n, s_len, h) if name == "int8" else (n, s_len, h, d // Q8_0_BLOCK)
            if tuple(s.shape) != want:
                raise ValueError(
                    f"{arg} of an int8 cache must have shape (N, S, H) = {(n, s_len, h)} (one "
                    f"scale per token and head) or (N, S, H, E // {Q8_0_BLOCK}) (q8_0), the "
                    f"same for k_scale and v_scale, got k_scale {shape_str(k_scale)}, "
                    f"v_scale {shape_str(v_scale)}")
    return QuantSpec(name, _FMT[name], np.dtype(k_cache.dtype), sdt, tuple(k_scale.shape),
                     tuple(v_scale.shape))


def _all_finite(s):
    """Whether every number of ``s`` (a float32 or float16 array, any strides) is finite. A
    call checks the whole cache's scales, so this is per-step host time: NumPy's isfinite
    converts float16 number by number (1.7 ms for one scale array of a q8_0 cache B1 S8192 H32
    D128, half the kernel's time), so float16 is read as its bits instead, inf and NaN being
    the exponent all ones: from 0x7C00 as int16 (positive) and from 0xFC00 as uint16
    (negative), two vectorized maxima without a temporary (90 us)."""
    if s.dtype != np.float16:
        return bool(np.isfinite(s).all())
    return s.size == 0 or (int(s.view(np.int16).max()) < 0x7C00
                           and int(s.view(np.uint16).max()) < 0xFC00)


def check_scales(spec, k_scale, v_scale, k, v):
    """A run's scales against ``spec`` (shapes, dtype), finite; the new keys and values of an
    append (``k``, ``v``, host arrays, or None) finite, since they are quantized. ValueError /
    TypeError naming the argument, before anything is written."""
    for name, s, want in (("k_scale", k_scale, spec.k_scale_shape),
                          ("v_scale", v_scale, spec.v_scale_shape)):
        if s is None:
            raise ValueError(f"a {spec.cache_dtype} cache needs {name}")
        if tuple(s.shape) != want or np.dtype(s.dtype) != spec.scale_dtype:
            raise ValueError(f"{name} of shape {shape_str(s)} and dtype {np.dtype(s.dtype)} is "
                             f"not what the plan was made for: shape {want} and dtype "
                             f"{spec.scale_dtype}")
        if isinstance(s, np.ndarray) and not _all_finite(s):
            raise ValueError(f"{name} must be finite (it has NaN or inf)")
    for name, x in (("k", k), ("v", v)):
        if isinstance(x, np.ndarray) and x.size and not np.isfinite(
                x if x.dtype.kind == "f" else x.astype(np.float32)).all():
            raise ValueError(f"{name} must be finite to be quantized into a {spec.name} cache "
                             f"(it has NaN or inf)")
