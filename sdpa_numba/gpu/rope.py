"""Rotary position embedding of a decode step's q and new keys on the GPU: the CUDA twin of
:mod:`sdpa_numba.cpu.rope`, a small kernel into scratch before the decode launch
(:mod:`.launch_decode`), one thread per rotated pair (and per passed-through element).

Each element is rotated in float64 (table rows float64) and rounded once to the storage dtype
(bfloat16 by way of float32, as :func:`.storage.store`).
"""

import numpy as np
from numba import cuda

from .arrays import device_array, is_simulated_mode
from .storage import load, store, storage_view


@cuda.jit
def _rotate_kernel(x, cos, sin, interleaved, out):
    """Thread ``n`` of ``B * L * H * (E - R)``: pair ``i < R`` of head ``(b, t, h)`` rotated
    (``(2i, 2i+1)`` if ``interleaved``, else ``(i, i + R)``), or element ``2R + (i - R)``
    copied."""
    n = cuda.grid(1)
    B, L, H, E = x.shape
    R = cos.shape[2]
    per_head = E - R  # R pairs, then the E - 2R passed-through elements
    if n >= B * L * H * per_head:
        return
    i = n % per_head
    bth = n // per_head
    h = bth % H
    t = (bth // H) % L
    b = bth // (H * L)
    if i < R:
        i0 = 2 * i if interleaved else i
        i1 = i0 + 1 if interleaved else i + R
        a = float(load(x[b, t, h, i0]))
        c = float(load(x[b, t, h, i1]))
        co = cos[b, t, i]
        si = sin[b, t, i]
        out[b, t, h, i0] = store(a * co - c * si, out)
        out[b, t, h, i1] = store(c * co + a * si, out)
    else:
        e = i + R
        out[b, t, h, e] = x[b, t, h, e]


@cuda.jit
def _gather_kernel(table, pos, rows):
    """``rows[b, t, i] = table[pos[b, t], i]`` as float64."""
    n = cuda.grid(1)
    B, L, R = rows.shape
    if n >= B * L * R:
        return
    i = n % R
    bt = n // R
    t = bt % L
    b = bt // L
    rows[b, t, i] = float(load(table[pos[b, t], i]))


def gather_rows(table, pos, stream=0):
    """A new float64 device array (B, L, R): the rows of device array ``table`` (seqlen_ro,
    R) at host positions ``pos`` (B, L, int64, checked in range), gathered on the device (a
    device table is never copied whole)."""
    B, L = pos.shape
    R = table.shape[1]
    rows = device_array((B, L, R), np.float64)
    n = B * L * R
    if n:
        mt = 32 if is_simulated_mode() else 128
        _gather_kernel[-(-n // mt), mt, stream](storage_view(table),
                                               cuda.to_device(pos, stream=stream), rows)
    return rows


def rotate(x, cos, sin, interleaved, stream=0):
    """A new device array: ``x`` (B, L, H, E, a device array) with each head's first ``2 *
    R`` dims rotated by the device arrays ``cos``, ``sin`` (B, L, R, float64); ``x`` is not
    written. Asynchronous on ``stream``."""
    out = device_array(x.shape, x.dtype)
    B, L, H, E = x.shape
    n = B * L * H * (E - cos.shape[2])
    if n:
        mt = 32 if is_simulated_mode() else 128
        _rotate_kernel[-(-n // mt), mt, stream](storage_view(x), cos, sin, bool(interleaved),
                                                storage_view(out))
    return out
