"""The host target: NumPy (and other host) arrays, the CPU kernels (:mod:`sdpa_numba.cpu`)."""

import numpy as np

from ..host_arrays import adopt as _adopt
from ..problem.dtypes import compute_dtype
from ..problem.out import host_address
from .base import Target


def _cpu_launchers():
    """The CPU launcher modules, in :class:`~.base.Launchers`' order."""
    from ..cpu import launch, launch_backward, launch_decode, launch_merge, launch_varlen

    return launch, launch_backward, launch_varlen, launch_merge, launch_decode


class Host(Target):
    """What running on the host means: see :mod:`sdpa_numba.targets`."""

    #: The address of a NumPy array's element 0 (the ``out`` checks).
    address = staticmethod(host_address)

    @staticmethod
    def adopt(named, out=None):
        """NumPy views of the operands and ``restore`` (:func:`sdpa_numba.host_arrays.adopt`)."""
        return _adopt(named, out)

    @property
    def as_strided(self):
        """NumPy's ``as_strided`` for the problem layer
        (:func:`sdpa_numba.cpu.launch.as_strided`)."""
        from ..cpu.launch import as_strided

        return as_strided

    @staticmethod
    def empty(shape, dtype):
        """An uninitialized NumPy array."""
        return np.empty(shape, dtype)

    @staticmethod
    def stack(name, arrays):
        """NumPy arrays of one shape and dtype stacked along a new leading axis (a copy)."""
        return np.stack(arrays)

    @staticmethod
    def to_host(x):
        """``x`` as a NumPy array (no copy)."""
        return np.asarray(x)

    @staticmethod
    def check_strides(named):
        """The CPU kernels take any strides: nothing to check."""

    # The ring's buffer operations (sdpa_numba.distributed).

    @staticmethod
    def copy(x):
        """A C-contiguous copy of ``x``."""
        return np.array(x, order="C")

    # Moves between layouts (sdpa_numba.cascade, the paged varlen backward).

    @staticmethod
    def packed(view, shape):
        """A new C-contiguous array of ``shape`` with ``view``'s elements in C order."""
        return np.array(view, order="C").reshape(shape)

    @staticmethod
    def copy_into(dst, src):
        """``dst[...] = src``."""
        dst[...] = src

    @staticmethod
    def gather_rows(cache, rows):
        """The flat slots ``rows`` (int64) of ``cache (num_pages, page_size, H, E)``, packed
        as ``(len(rows), H, E)``."""
        return cache.reshape((-1,) + cache.shape[2:])[rows]

    @staticmethod
    def scatter_sum_rows(g, rows, cache, shape):
        """The packed rows' gradients ``g`` summed into the slots ``rows`` of an array of zeros
        of ``shape`` (``cache``'s slots): pages read by several sequences add, in float64,
        rounded once."""
        n_slots = cache.shape[0] * cache.shape[1]
        shared = np.unique(rows).size < rows.size
        full = np.zeros((n_slots,) + g.shape[1:], np.float64 if shared else g.dtype)
        if shared:
            np.add.at(full, rows, g)
        else:
            full[rows] = g
        return full.astype(g.dtype, copy=False).reshape(shape)

    @staticmethod
    def zeros(shape, dtype):
        """A NumPy array of zeros."""
        return np.zeros(shape, dtype)

    @staticmethod
    def from_host(x):
        """NumPy array ``x`` as this target's array (itself)."""
        return x

    def merge_into(self, out, lse, o, lo):
        """Merge the attention state ``(o, lo)`` into ``(out, lse)`` in place (by lse, with
        :meth:`merge`'s kernels)."""
        dt = np.dtype(out.dtype)
        merged, merged_lse = self.merge([out, lse, o, lo], dt, compute_dtype(dt),
                                        tuple(out.shape[:-1]), out.shape[-1])
        out[...] = merged
        lse[...] = merged_lse

    @staticmethod
    def add_into(acc, x):
        """``acc += x`` in place."""
        acc[...] += x

    @staticmethod
    def cast(x, dtype):
        """``x`` converted to ``dtype`` (a copy)."""
        return x.astype(dtype)

    @staticmethod
    def caching():
        """Whether Numba caches the CPU kernels (then it can cache code built beside them)."""
        from ..cpu.options import CACHE

        return CACHE

    @staticmethod
    def native_kernel(direction, dtype, mask_kind, recipe_type):
        """The jitted CPU kernel of ``direction`` ("forward", "backward") and the exact
        signature the NumPy API's launchers compile it with, for a native caller that calls it
        by address (:mod:`sdpa_numba.jax`'s XLA handlers): one compiled kernel for both."""
        if direction == "forward":
            from ..cpu.forward import forward
            from ..cpu.launch import signature

            return forward, signature(dtype, mask_kind, False, recipe_type)
        from ..cpu.backward import backward
        from ..cpu.launch_backward import signature

        return backward, signature(dtype, "additive" if mask_kind == "additive" else "bool",
                                   recipe_type)


#: The host target.
HOST = Host("host", "CPU", _cpu_launchers)
