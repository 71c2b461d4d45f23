"""Rotary position embedding of a decode step's q and new keys on the CPU: one small jitted
pass into scratch before the decode kernel (:mod:`.launch_decode`), so the decode kernel
itself has no new specialization.

Each element is loaded, rotated in float64 and rounded once to the storage dtype (float16 and
bfloat16 by way of float32), without fastmath: for float32 and float64 arrays the result is
bitwise that of the float64 NumPy rotation
(:func:`sdpa_numba.problem.rope.rotate_reference`) rounded to the dtype. The inputs are only
read.
"""

import numpy as np
from numba import njit, types

from .._runtime import compile_entry
from .launch import arr
from .options import CACHE
from .storage import load, store, storage_view


@njit(error_model="numpy", cache=CACHE, boundscheck=False, nogil=True)
def _rotate(x, cos, sin, interleaved, out):
    """``out`` (B, L, H, E) = ``x`` with its first ``2 * R`` dims of each head rotated by rows
    ``cos``, ``sin`` (B, L, R): pairs ``(2i, 2i+1)`` if ``interleaved``, else ``(i, i + R)``;
    the other dims copied."""
    B, L, H, E = x.shape
    R = cos.shape[2]
    for b in range(B):
        for t in range(L):
            for h in range(H):
                for i in range(R):
                    i0 = 2 * i if interleaved else i
                    i1 = i0 + 1 if interleaved else i + R
                    a = np.float64(load(x[b, t, h, i0]))
                    c = np.float64(load(x[b, t, h, i1]))
                    co = cos[b, t, i]
                    si = sin[b, t, i]
                    out[b, t, h, i0] = store(a * co - c * si, out)
                    out[b, t, h, i1] = store(c * co + a * si, out)
                for e in range(2 * R, E):
                    out[b, t, h, e] = x[b, t, h, e]


_entries = {}


def _entry(st):
    """The rotation compiled for storage type ``st`` (any layout of x; out C-contiguous)."""
    if st not in _entries:
        f64 = arr(types.float64, 3, True)
        sig = (arr(st, 4, True), f64, f64, types.boolean, types.Array(st, 4, "C"))
        _entries[st] = compile_entry(_rotate, sig)
    return _entries[st]


_TYPES = {np.dtype(np.float32): types.float32, np.dtype(np.float64): types.float64,
          np.dtype(np.uint16): types.uint16, np.dtype(np.int16): types.int16}


def rotate(x, cos, sin, interleaved):
    """A new C-contiguous array: ``x`` (B, L, H, E, NumPy, a storage dtype) with each head's
    first ``2 * cos.shape[2]`` dims rotated by ``cos``, ``sin`` (B, L, R, float64) (see the
    module). ``x`` is not written."""
    out = np.empty(x.shape, x.dtype)
    xs, os_ = storage_view(x), storage_view(out)
    if x.size:
        _entry(_TYPES[xs.dtype])(xs, cos, sin, bool(interleaved), os_)
    return out
