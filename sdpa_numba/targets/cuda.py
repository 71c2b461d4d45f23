"""The CUDA target: CUDA arrays (Numba device arrays, real or simulated, CuPy, PyTorch CUDA
tensors), the CUDA kernels (:mod:`sdpa_numba.gpu`), imported on first use."""


def is_device_array(x):
    """Whether ``x`` is a CUDA array (without importing ``numba.cuda``)."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    # Numba's CUDA simulator arrays have no __cuda_array_interface__.
    return type(x).__name__ in ("FakeCUDAArray", "DeviceNDArray") and hasattr(x, "copy_to_host")


class Cuda:
    """What running on a CUDA device means: see :mod:`sdpa_numba.targets`."""

    name = "cuda"
    #: The back end's name in messages.
    label = "CUDA"

    def __repr__(self):
        return "sdpa_numba.targets.CUDA"

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
        from ..gpu.arrays import device_array

        for i, x in enumerate(arrays):
            if not x.is_c_contiguous():
                raise ValueError(f"{name}[{i}] is not contiguous: pass a stacked array ({name} "
                                 f"of shape (n, ...)) instead of a list")
        y = device_array((len(arrays), *arrays[0].shape), arrays[0].dtype)
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

    @staticmethod
    def forward(p, query, key, value, attn_mask, out, dropout):
        """:func:`sdpa_numba.gpu.launch.run`."""
        from ..gpu.launch import run

        return run(p, query, key, value, attn_mask, out, dropout)

    @staticmethod
    def backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout, mask_grad):
        """:func:`sdpa_numba.gpu.launch_backward.run_backward`."""
        from ..gpu.launch_backward import run_backward

        return run_backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout,
                            mask_grad)

    @staticmethod
    def varlen_forward(p, q, k, v, out, dropout):
        """:func:`sdpa_numba.gpu.launch_varlen.run`."""
        from ..gpu.launch_varlen import run

        return run(p, q, k, v, out, dropout)

    @staticmethod
    def varlen_backward(p, grad_out, q, k, v, out, lse, dropout):
        """:func:`sdpa_numba.gpu.launch_varlen.run_backward`."""
        from ..gpu.launch_varlen import run_backward

        return run_backward(p, grad_out, q, k, v, out, lse, dropout)


    @staticmethod
    def merge(parts, dt, ct, lead, ev):
        """:func:`sdpa_numba.gpu.launch_merge.run`."""
        from ..gpu.launch_merge import run

        return run(parts, dt, ct, lead, ev)


#: The CUDA target.
CUDA = Cuda()
