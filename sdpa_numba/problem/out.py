"""Checks of a caller's ``out`` buffer, on shapes, strides and byte addresses alone, so that
one function serves NumPy and device arrays.

A target gives the address of an array's element 0 (``address(x)``: :func:`host_address` for
NumPy arrays, :func:`sdpa_numba.gpu.arrays.address` for device arrays); the byte ranges two
arrays may touch then say whether they may overlap (a bounds test, as
:func:`numpy.may_share_memory`'s default).
"""

import numpy as np

from .arguments import shape_str
from .variant_table import ARRAYS
from ..host_arrays import is_device_array


def host_address(x):
    """The address of a NumPy array's element 0."""
    return x.__array_interface__["data"][0]


def may_self_overlap(shape, strides, itemsize):
    """Whether two elements of a strided array may share bytes (False: they never do).

    Dims of size 1 don't move; the others, taken by increasing |stride|, must each step over
    everything the smaller dims span. That is exact for every layout made by slicing,
    transposing or reshaping a contiguous array, and conservative for the rest (interleaved
    layouts that happen not to overlap are reported as overlapping). NumPy has no public test.
    """
    if any(n == 0 for n in shape):
        return False
    span = itemsize  # bytes covered by one element and the dims already checked
    for n, s in sorted(((n, abs(int(s))) for n, s in zip(shape, strides) if n > 1),
                       key=lambda d: d[1]):
        if s < span:
            return True
        span += s * (n - 1)
    return False


def byte_extent(base, shape, strides, itemsize):
    """``(first, last)`` byte addresses (``last`` exclusive) that an array with element 0 at
    ``base`` may touch; None if it is empty."""
    if any(n == 0 for n in shape):
        return None
    lo = base + sum(s * (n - 1) for n, s in zip(shape, strides) if s < 0)
    hi = base + sum(s * (n - 1) for n, s in zip(shape, strides) if s > 0)
    return lo, hi + itemsize


def may_overlap(a, b, address):
    """Whether arrays ``a`` and ``b`` (of one target, ``address`` its) may share memory."""
    if type(a) is np.ndarray and type(b) is np.ndarray:
        # The same bounds test in C, ~50x faster (a decode step's host budget is ~25 us)
        return np.may_share_memory(a, b)
    ea = byte_extent(address(a), a.shape, a.strides, np.dtype(a.dtype).itemsize)
    eb = byte_extent(address(b), b.shape, b.strides, np.dtype(b.dtype).itemsize)
    return ea is not None and eb is not None and ea[0] < eb[1] and eb[0] < ea[1]


#: The variants' arguments that may hold arrays (besides the operands).
VARIANT_ARRAYS = ARRAYS


def given_arrays(variants, **named):
    """The arrays among a call's arguments other than the operands, as ``(name, array)``
    pairs for :func:`check_out`, from a plan's validated arguments: those of ``variants``
    (the public functions' keyword variants, a dict; see :data:`VARIANT_ARRAYS`) and
    ``named`` (more of the function's own). ``mod_args`` (a tuple) gives ``mod_args[n]``
    for each array in it, a block mask its ``states``; None and numbers
    are left out. Host arrays (torch CPU tensors, ...) are seen through
    :func:`numpy.asarray`, which shares their memory; device arrays are kept as given."""
    if not named and not any(variants.get(n) is not None for n in VARIANT_ARRAYS):
        return ()  # a plain call: nothing to look at
    pairs = []
    for name, x in [*((n, variants.get(n)) for n in VARIANT_ARRAYS), *named.items()]:
        if name == "mod_args":
            pairs += [(f"mod_args[{n}]", a) for n, a in enumerate(x or ())]
        elif name == "block_mask":
            pairs.append((name, getattr(x, "states", None)))
        else:
            pairs.append((name, x))
    arrays = []
    for name, x in pairs:
        if x is None or np.isscalar(x):
            continue
        if not is_device_array(x):
            x = np.asarray(x)
            if x.ndim == 0:
                continue
        arrays.append((name, x))
    return tuple(arrays)


def _overlaps(out, x, address):
    """Whether ``x`` may share memory with ``out``; False when ``address`` cannot place
    ``x`` (an array of another memory space than ``out``'s target: host against device)."""
    try:
        return may_overlap(out, x, address)
    except (AttributeError, KeyError, TypeError):
        return False


def check_out(p, out, inputs, address):
    """``out`` must match plan ``p``'s result exactly and be safe to write: no zero strides,
    no element sharing memory with another, writeable (NumPy), apart from every array of
    ``inputs`` (``(name, array or None)`` pairs: the operands) and every other array the
    call was given (``p.given``, see :func:`given_arrays`: a kernel
    reading one of them after writing ``out`` would read its own output). ``address``: the
    target's, see above."""
    if tuple(out.shape) != p.out_shape or np.dtype(out.dtype) != p.dtype:
        raise ValueError(f"out must have shape {p.out_shape} and dtype {p.dtype}, got "
                         f"{shape_str(out)} {np.dtype(out.dtype)}")
    # Overlapping elements would be written by several threads, in no fixed order.
    if out.size and any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape)):
        raise ValueError(f"out must not have zero strides (a broadcast view), got strides "
                         f"{tuple(out.strides)}")
    if may_self_overlap(out.shape, out.strides, np.dtype(out.dtype).itemsize):
        raise ValueError(f"out's elements overlap each other (strides {tuple(out.strides)} "
                         f"for shape {shape_str(out)}): pass a buffer in which every "
                         f"element has memory of its own")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out must be writeable")
    for name, x in (*inputs, *p.given):
        if x is not None and _overlaps(out, x, address):
            raise ValueError(f"out overlaps {name}: pass a separate buffer")

