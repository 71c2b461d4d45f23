"""Storage conversions of the CUDA kernels: bfloat16 held as int16 bit patterns.

As on the CPU (:mod:`sdpa_numba.cpu.storage`), bfloat16 operands reach the kernels as int16
views: the simulator has no bfloat16 type, and the Numba type alone then selects the
conversion, so float16, float32 and float64 kernels compile exactly as before. The kernels
call :func:`load` on every stored element they read and :func:`store` on every element they
write to an array of the storage dtype; for the other dtypes both return their argument
unchanged (the kernels' own casts convert, as they always did).

On the device the two are ``@overload``-ed (bit casts through libdevice, integer rounding);
on Numba's CUDA simulator, which runs kernels as Python, the Python bodies below run instead,
on NumPy scalars, with the same arithmetic.
"""

import numpy as np
from numba import cuda

from .._bf16 import is_bfloat16
from .arrays import as_strided, is_simulated_mode


def load(x):
    """The compute value (float32 for bfloat16 bits) of a stored element ``x``."""
    if isinstance(x, np.int16):
        bits = np.uint32(np.uint16(x.view(np.uint16))) << np.uint32(16)
        return bits.view(np.float32)
    return x


def store(x, like):
    """``x`` as an element of the array ``like``: bfloat16 bits (round to nearest even, a NaN
    kept a quiet NaN) for int16 storage, else ``x`` itself."""
    if like.dtype == np.int16:
        b = np.float32(x).view(np.uint32)
        r = _round_bits(int(b), bool(np.isnan(np.float32(x))))
        return np.array(r & 0xFFFF, np.uint16).view(np.int16)[()]
    return x


def _round_bits(b, is_nan):
    """The bfloat16 bits (low 16 bits of the result) of the float32 with bits ``b``: add
    0x7fff plus the lowest kept bit and drop the low 16 (ties to even; the carry reaches the
    exponent, and past the largest finite value gives inf); a NaN keeps its top bits with the
    quiet bit set."""
    if is_nan:
        return (b >> 16) | 0x40
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


def _register_device_overloads():
    import numba
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import overload

    @overload(load, inline="always")
    def _load(x):
        if x == types.int16:
            def impl(x):
                return libdevice.int_as_float(numba.int32(numba.uint16(x)) << 16)
            return impl
        return lambda x: x

    @overload(store, inline="always")
    def _store(x, like):
        if like.dtype == types.int16:
            def impl(x, like):
                f = numba.float32(x)
                b = numba.uint32(libdevice.float_as_int(f))
                hi = b >> 16
                rounded = (b + numba.uint32(0x7FFF) + (hi & numba.uint32(1))) >> 16
                quiet = hi | numba.uint32(0x40)
                # select without a branch (a branch here trips a Numba IR warning)
                nan = numba.uint32(0) - numba.uint32(f != f)
                return numba.int16(rounded ^ ((rounded ^ quiet) & nan))
            return impl
        return lambda x, like: x


if not is_simulated_mode():
    _register_device_overloads()


def storage_view(x):
    """The array the kernels read for device array ``x``: bfloat16 as an int16 view (no copy),
    others (and None) as they are."""
    if x is None or not is_bfloat16(x.dtype):
        return x
    return as_strided(x, x.shape, x.strides, np.int16)
