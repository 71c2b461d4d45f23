"""The CUDA target: CUDA arrays (Numba device arrays, real or simulated, CuPy, PyTorch CUDA
tensors), the CUDA kernels (:mod:`sdpa_numba.gpu`), imported on first use."""

from ..host_arrays import is_device_array  # noqa: F401 - re-exported by the package
from .base import Target


def _gpu_launchers():
    """The CUDA launcher modules, in :class:`~.base.Launchers`' order."""
    from ..gpu import launch, launch_backward, launch_decode, launch_merge, launch_varlen

    return launch, launch_backward, launch_varlen, launch_merge, launch_decode


class Cuda(Target):
    """What running on a CUDA device means: see :mod:`sdpa_numba.targets`."""

    @staticmethod
    def adopt(named, out=None):
        """Numba device arrays of the operands and ``restore``
        (:func:`sdpa_numba.gpu.arrays.adopt`)."""
        from ..gpu.arrays import adopt

        return adopt(named, out)

    @property
    def address(self):
        """The device address of an array's element 0 (:func:`sdpa_numba.gpu.arrays.address`)."""
        from ..gpu.arrays import address

        return address

    @property
    def as_strided(self):
        """Strided views of device arrays (:func:`sdpa_numba.gpu.arrays.as_strided`)."""
        from ..gpu.arrays import as_strided

        return as_strided

    @staticmethod
    def empty(shape, dtype):
        """An uninitialized Numba device array."""
        from ..gpu.arrays import device_array

        return device_array(shape, dtype)

    @staticmethod
    def stack(name, arrays):
        """Numba device arrays of one shape and dtype, each C-contiguous (ValueError naming
        ``name[i]`` otherwise), stacked along a new leading axis (a copy, on the device)."""
        for i, x in enumerate(arrays):
            if not x.is_c_contiguous():
                raise ValueError(f"{name}[{i}] is not contiguous: pass a stacked array ({name} "
                                 f"of shape (n, ...)) instead of a list")
        y = Cuda.empty((len(arrays), *arrays[0].shape), arrays[0].dtype)
        for i, x in enumerate(arrays):
            y[i].copy_to_device(x)
        return y

    @staticmethod
    def to_host(x):
        """A NumPy copy of device array ``x``."""
        return x.copy_to_host()

    @staticmethod
    def check_strides(named):
        """No negative strides (:func:`sdpa_numba.problem.check_device_strides`)."""
        from ..problem import check_device_strides

        check_device_strides(named)

    # The ring's buffer operations (sdpa_numba.distributed), by sdpa_numba.gpu.ring's kernels.

    @staticmethod
    def copy(x):
        """A C-contiguous copy of device array ``x``, on the device (any strides)."""
        return Cuda.packed(x, tuple(x.shape))

    # Moves between layouts (sdpa_numba.cascade, the paged varlen backward), by the bit-copy
    # kernels of sdpa_numba.gpu.gather.

    @staticmethod
    def packed(view, shape):
        """A new C-contiguous device array of ``shape`` with ``view``'s elements in C order
        (:func:`sdpa_numba.gpu.gather.packed_copy`)."""
        from ..gpu.gather import packed_copy

        return packed_copy(view, shape)

    @staticmethod
    def copy_into(dst, src):
        """``dst[...] = src`` on the device (:func:`sdpa_numba.gpu.gather.copy_into`)."""
        from ..gpu.gather import copy_into

        copy_into(dst, src)

    @staticmethod
    def gather_rows(cache, rows):
        """The flat slots ``rows`` (a NumPy int64 array) of the device ``cache (num_pages,
        page_size, H, E)``, packed (:func:`sdpa_numba.gpu.gather.gather_rows`)."""
        from numba import cuda

        from ..gpu.gather import gather_rows

        return gather_rows(cache, cuda.to_device(rows))

    @staticmethod
    def scatter_sum_rows(g, rows, cache, shape):
        """The packed rows' gradients ``g`` summed into the slots ``rows`` of a device array
        of zeros of ``shape``, deterministically
        (:func:`sdpa_numba.gpu.gather.scatter_sum_rows`)."""
        from ..gpu.gather import scatter_sum_rows

        return scatter_sum_rows(g, rows, shape)

    @staticmethod
    def zeros(shape, dtype):
        """A device array of zeros."""
        from ..gpu.ring import zeros

        return zeros(shape, dtype)

    @staticmethod
    def from_host(x):
        """A device copy of NumPy array ``x``."""
        import numpy as np
        from numba import cuda

        return cuda.to_device(np.ascontiguousarray(x))

    @staticmethod
    def merge_into(out, lse, o, lo):
        """Merge the attention state ``(o, lo)`` into ``(out, lse)`` in place (by lse)."""
        from ..gpu.ring import merge_into

        merge_into(out, lse, o, lo)

    @staticmethod
    def add_into(acc, x):
        """``acc += x`` in place, on the device."""
        from ..gpu.ring import add_into

        add_into(acc, x)

    @staticmethod
    def cast(x, dtype):
        """``x`` converted to ``dtype`` (a device copy)."""
        from ..gpu.reduce import sum_to

        return sum_to(x, tuple(x.shape), dtype)


#: The CUDA target.
CUDA = Cuda("cuda", "CUDA", _gpu_launchers)
