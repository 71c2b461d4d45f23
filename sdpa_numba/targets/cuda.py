"""The CUDA target: CUDA arrays (Numba device arrays, real or simulated, CuPy, PyTorch CUDA
tensors), the CUDA kernels (:mod:`sdpa_numba.gpu`), imported on first use."""

from .base import Target


def is_device_array(x):
    """Whether ``x`` is a CUDA array (without importing ``numba.cuda``)."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    # Numba's CUDA simulator arrays have no __cuda_array_interface__.
    return type(x).__name__ in ("FakeCUDAArray", "DeviceNDArray") and hasattr(x, "copy_to_host")


def _gpu_launchers():
    """The CUDA launcher modules, in :class:`~.base.Launchers`' order."""
    from ..gpu import launch, launch_backward, launch_merge, launch_varlen

    return launch, launch_backward, launch_varlen, launch_merge


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


#: The CUDA target.
CUDA = Cuda("cuda", "CUDA", _gpu_launchers)
