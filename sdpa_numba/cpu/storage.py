"""Storage dtypes and compute dtypes.

Arrays are stored as float32, float64, float16 held as uint16 bit patterns (Numba's CPU
target cannot type float16 arrays), or bfloat16 held as int16 bit patterns (nor bfloat16; the
signed type tells it from float16, so the Numba type alone selects the conversion and each
storage type is its own specialization, compiled only when used). Kernels compute in float32
for float16, bfloat16 and float32 storage and in float64 for float64 storage; these helpers convert one element on load and on store,
so no whole-array copy to a wider dtype is ever made.
"""

import numpy as np
from numba import types
from numba.extending import overload

from .._bf16 import is_bfloat16
from ._llvm import (bf16_bits_to_float32, float32_to_bf16_bits, float32_to_half_bits,
                    half_bits_to_float32)
from .options import FASTMATH


def load(x):
    """Convert one stored element to its compute dtype (jitted code only)."""
    raise NotImplementedError("load is only callable from jitted code")


def store(x, like):
    """Convert a compute value to the storage dtype of the array ``like`` (jitted code only)."""
    raise NotImplementedError("store is only callable from jitted code")


@overload(load, fastmath=FASTMATH)
def _load(x):
    if x == types.uint16:
        return lambda x: half_bits_to_float32(x)
    if x == types.int16:
        return lambda x: bf16_bits_to_float32(x)
    if isinstance(x, types.Float):
        return lambda x: x
    if isinstance(x, types.Boolean):
        return lambda x: x
    return None


@overload(store, fastmath=FASTMATH)
def _store(x, like):
    dt = like.dtype
    if dt == types.uint16:
        return lambda x, like: float32_to_half_bits(np.float32(x))
    if dt == types.int16:
        return lambda x, like: float32_to_bf16_bits(np.float32(x))
    if dt == types.float32:
        return lambda x, like: np.float32(x)
    if dt == types.float64:
        return lambda x, like: np.float64(x)
    return None


def storage_view(a):
    """The array that the CPU kernels read for ``a``: float16 as a uint16 view, bfloat16 as an
    int16 view, others as is."""
    if a.dtype == np.float16:
        return a.view(np.uint16)
    return a.view(np.int16) if is_bfloat16(a.dtype) else a


def is_compute_dtype(a, like):
    """Whether the array ``a`` is stored in the compute dtype of the array ``like`` (jitted
    code only; a compile-time constant)."""
    raise NotImplementedError("is_compute_dtype is only callable from jitted code")


@overload(is_compute_dtype)
def _is_compute_dtype(a, like):
    same = a.dtype == like.dtype
    return lambda a, like: same


