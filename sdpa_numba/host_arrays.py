"""Host arrays of any kind in, results as the caller's kind out (the host twin of
:func:`sdpa_numba.gpu.arrays.adopt`).

The CPU kernels read NumPy arrays. Other host arrays are seen as NumPy arrays without a copy
where their protocol allows it, in this order:

1. ``__array_interface__`` or the buffer protocol (NumPy's own views of them);
2. DLPack (``__dlpack__`` on the CPU: torch CPU tensors, JAX CPU arrays, ...); a torch tensor
   that requires grad is read through ``detach()``, which shares its memory;
3. ``__array__`` (which may copy: only inputs may come this way, never ``out``).

Results come back as the query's kind where that kind wraps our NumPy buffer without a copy
(torch tensors, through ``torch.from_numpy``), as NumPy arrays otherwise; an ``out`` buffer
comes back as the caller's own object.
"""

import sys

import numpy as np

#: DLPack's device type of host memory (kDLCPU).
_DLPACK_CPU = 1


def is_device_array(x):
    """Whether ``x`` is a CUDA array (without importing ``numba.cuda``): what the host path
    never takes. The one device test of the package (:func:`sdpa_numba.targets.target_of`,
    the ``out`` checks)."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    # Numba's CUDA simulator arrays have no __cuda_array_interface__.
    return type(x).__name__ in ("FakeCUDAArray", "DeviceNDArray") and hasattr(x, "copy_to_host")


def is_host_array(x):
    """Whether ``x`` is a host array the CPU path can read (NumPy or another kind)."""
    if isinstance(x, np.ndarray):
        return True
    if hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        return True
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            return int(x.__dlpack_device__()[0]) == _DLPACK_CPU
        except Exception:
            return False
    try:
        memoryview(x)
    except TypeError:
        return False
    return not isinstance(x, (bytes, bytearray, str))


def _is_torch(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def as_numpy(name, x, writable=False):
    """``x`` as a NumPy array sharing its memory (see the module's order); TypeError naming
    ``name`` if it cannot be read. ``writable``: buffers to be written (``out``, a cache to
    append to), never copied; ValueError naming ``name`` if read-only."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        x = x.detach()  # shares memory; DLPack refuses tensors that require grad
    if hasattr(x, "__array_interface__"):
        a = np.asarray(x)
    elif hasattr(x, "__dlpack__"):
        try:
            a = np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise TypeError(f"{name} ({type(x).__name__}) cannot be read as a NumPy array "
                            f"through DLPack: {exc}") from None
    elif not writable and hasattr(x, "__array__"):
        a = np.asarray(x)
    else:
        try:
            a = np.asarray(memoryview(x))
        except TypeError:
            raise TypeError(f"{name} must be an array (NumPy, or an object with the array "
                            f"interface, DLPack or the buffer protocol), got "
                            f"{type(x).__name__}") from None
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} ({type(x).__name__}) is read-only")
    return a


#: The types of arguments :func:`adopt` passes through untouched (None: left out).
_PLAIN_OUT = (np.ndarray, type(None))


def _as_is(x):
    return x


def adopt(named, out=None):
    """NumPy views of the host operands, and a function that hands results back.

    ``named``: ``(name, array)`` pairs (None stays None), the first one the query, whose kind
    the results take; ``out``: the caller's output buffer or None, adopted last. Returns
    ``(arrays, restore)`` as :func:`sdpa_numba.gpu.arrays.adopt` does.
    """
    if type(out) in _PLAIN_OUT and all(type(x) in _PLAIN_OUT for _, x in named):
        # NumPy arrays in (the common case): nothing to convert, results handed back as they are
        return [x for _, x in named] + ([] if out is None else [out]), _as_is
    arrays = [None if x is None else as_numpy(n, x) for n, x in named]
    adopted_out = None if out is None else as_numpy("out", out, writable=True)
    if out is not None:
        arrays.append(adopted_out)
    as_torch = _is_torch(named[0][1])

    def restore(x):
        if out is not None and x is adopted_out:
            return out
        if as_torch and isinstance(x, np.ndarray):
            import torch

            return torch.from_numpy(x)
        return x

    return arrays, restore
