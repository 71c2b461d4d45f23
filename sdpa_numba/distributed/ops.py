"""The ring's buffer operations (copy, allocate, merge by lse, add, cast) on NumPy arrays
(:class:`HostOps`) and on Numba device arrays (:class:`DeviceOps`)."""

import numpy as np

from ..merge import merge_attention_states
from .steps import take_rows


class HostOps:
    """The ring's buffer operations on NumPy arrays."""

    @staticmethod
    def copy(x):
        return np.ascontiguousarray(x).copy()

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype)

    @staticmethod
    def from_host(x):
        return x

    @staticmethod
    def to_host(x):
        return x

    @staticmethod
    def merge(out, lse, o, lo, qs, n_q):
        """``(out, lse)`` with the state ``(o, lo)`` of rows ``qs`` merged in."""
        if qs == slice(0, n_q):
            return merge_attention_states(out, lse, o, lo)
        o2, l2 = merge_attention_states(take_rows(out, qs), take_rows(lse, qs, -1), o, lo)
        take_rows(out, qs)[...] = o2
        take_rows(lse, qs, -1)[...] = l2
        return out, lse

    @staticmethod
    def add(acc, x):
        acc[...] += x

    @staticmethod
    def cast(x, dtype):
        return x.astype(dtype)


class DeviceOps:
    """The same on Numba device arrays (:mod:`sdpa_numba.gpu.ring`'s kernels)."""

    @staticmethod
    def copy(x):
        from ..gpu.ring import contiguous_copy

        return contiguous_copy(x)

    @staticmethod
    def empty(shape, dtype):
        from ..gpu.arrays import device_array

        return device_array(shape, dtype)

    @staticmethod
    def zeros(shape, dtype):
        from ..gpu.ring import zeros

        return zeros(shape, dtype)

    @staticmethod
    def from_host(x):
        from numba import cuda

        return cuda.to_device(np.ascontiguousarray(x))

    @staticmethod
    def to_host(x):
        return x.copy_to_host()

    @staticmethod
    def merge(out, lse, o, lo, qs, n_q):
        from ..gpu.ring import merge_into

        merge_into(take_rows(out, qs), take_rows(lse, qs, -1), o, lo)
        return out, lse

    @staticmethod
    def add(acc, x):
        from ..gpu.ring import add_into

        add_into(acc, x)

    @staticmethod
    def cast(x, dtype):
        from ..gpu.reduce import sum_to

        return sum_to(x, tuple(x.shape), dtype)
