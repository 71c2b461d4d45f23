"""Device arrays: adopting the caller's kind of array, handing results back, strided views.

Inputs with ``__cuda_array_interface__`` (CuPy arrays, PyTorch CUDA tensors, ...) are wrapped
as Numba device arrays without copying, so that validation sees NumPy dtypes and shapes; the
results are handed back as the same kind of array as the query. Views (leading unit dims,
broadcast dims with stride 0) are built from shapes and strides directly: nothing is copied and
no broadcast is materialized. The CUDA simulator's arrays (which wrap NumPy arrays and have no
``__cuda_array_interface__``) are handled alongside.
"""

import numpy as np
from numba import cuda

from .._bf16 import bfloat16, is_bfloat16
from ..problem.views import broadcast_view as _broadcast_view


def is_simulated(x):
    """Whether ``x`` is an array of Numba's CUDA simulator."""
    return type(x).__name__ == "FakeCUDAArray"


def _is_numba(x):
    # Numba's device arrays, real or simulated, mark themselves so.
    return bool(getattr(type(x), "__cuda_ndarray__", False))


def _kind(x):
    module = type(x).__module__.split(".")[0]
    if _is_numba(x):
        return "numba"
    if module in ("torch", "cupy"):
        return module
    return "other"


def _adopt_one(name, x):
    if x is None or _is_numba(x):
        return x
    torch_bf16 = _kind(x) == "torch" and str(x.dtype) == "torch.bfloat16"
    if "bfloat16" in str(getattr(x, "dtype", "")) and not torch_bf16:
        raise NotImplementedError(
            f"{name} is a bfloat16 {type(x).__name__}: only torch tensors and Numba device "
            f"arrays of ml_dtypes.bfloat16 are taken as bfloat16 on the GPU")
    if is_simulated_mode():
        raise TypeError(f"{name} is a {type(x).__name__}, but Numba runs the CUDA simulator "
                        f"(NUMBA_ENABLE_CUDASIM=1), which takes only its own arrays")
    if torch_bf16:
        # torch's __cuda_array_interface__ has no bfloat16: adopt the int16 bits, then read
        # them as ml_dtypes.bfloat16 (no copy either way)
        import torch

        bits = cuda.as_cuda_array(x.view(torch.int16))
        return as_strided(bits, bits.shape, bits.strides, bfloat16())
    return cuda.as_cuda_array(x)


def adopt(named, out=None):
    """Numba device arrays for the CUDA operands, and a function that hands results back.

    ``named``: ``(name, array)`` pairs (None stays None), the first one the query, whose kind
    of array the results take; ``out``: the caller's output buffer or None, adopted last.
    Returns ``(arrays, restore)``: the adopted operands in order (then ``out`` if given), and
    ``restore(x)``, which gives ``x`` as the query's kind of array (CuPy, PyTorch or Numba;
    anything else stays a Numba device array), and the caller's own ``out`` object for the
    adopted ``out``.
    """
    if out is not None:
        named = [*named, ("out", out)]
    arrays = tuple(_adopt_one(n, x) for n, x in named)
    query = named[0][1]
    kind = _kind(query)
    adopted_out = arrays[-1] if out is not None else None

    def restore(x):
        if out is not None and x is adopted_out:
            return out
        if kind == "torch":
            import torch

            if is_bfloat16(x.dtype):  # no bfloat16 in __cuda_array_interface__: as int16
                bits = as_strided(x, x.shape, x.strides, np.int16)
                return torch.as_tensor(bits, device=query.device).view(torch.bfloat16)
            return torch.as_tensor(x, device=query.device)
        if kind == "cupy":
            import cupy

            with cupy.cuda.Device(query.device.id):
                return cupy.asarray(x)
        return x

    return arrays, restore


def is_simulated_mode():
    """Whether Numba's CUDA target is the simulator."""
    from numba.cuda.core import config

    return bool(config.ENABLE_CUDASIM)


def device_array(shape, dtype):
    """An uninitialized Numba device array."""
    return cuda.device_array(shape, dtype=np.dtype(dtype))


def as_strided(x, shape, strides, dtype=None):
    """A view of device array ``x`` with ``shape`` and byte ``strides``, starting at ``x``'s
    first element, as :func:`numpy.lib.stride_tricks.as_strided` (and as unchecked); its
    elements read as ``dtype`` (of the same size) if given."""
    shape = tuple(int(n) for n in shape)
    strides = tuple(int(s) for s in strides)
    dtype = x.dtype if dtype is None else np.dtype(dtype)
    if is_simulated(x):
        # a view of the same itemsize works whatever the strides; through unsigned ints of
        # that size, since NumPy's as_strided does not take every dtype (ml_dtypes' float8)
        raw = np.dtype(f"u{x.dtype.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else x.dtype
        return type(x)(np.lib.stride_tricks.as_strided(x._ary.view(raw), shape, strides)
                       .view(dtype))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape, strides, dtype, stream=x.stream, gpu_data=x.gpu_data)


def broadcast_view(x, shape):
    """``x`` seen with ``shape``: missing leading dims and broadcast dims get stride 0
    (:func:`sdpa_numba.problem.broadcast_view` with the device's :func:`as_strided`)."""
    return _broadcast_view(x, shape, as_strided)


def address(x):
    """The device address of element 0 of device array ``x`` (for the problem layer's ``out``
    checks, :func:`sdpa_numba.problem.check_out`); the host address of a simulator array's
    data."""
    if is_simulated(x):
        return x._ary.__array_interface__["data"][0]
    return x.device_ctypes_pointer.value or 0
