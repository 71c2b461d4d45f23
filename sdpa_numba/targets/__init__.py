"""The targets: one object per place the kernels run, owning everything that differs there.

:func:`target_of` tells the operands' target, :data:`HOST` (NumPy and other host arrays: the
CPU kernels) or :data:`CUDA` (CUDA arrays: the CUDA kernels); the public functions then go
through that object alone, never through a branch on the device or a module named by a string:

* ``adopt(named, out=None)``: the operands as the arrays the kernels read (no copies) and
  ``restore(x)``, which hands a result back as the caller's kind of array;
* ``address``: the address of an array's element 0, for the ``out`` checks
  (:func:`sdpa_numba.problem.check_out`); ``as_strided``: strided views for the problem layer;
* ``empty(shape, dtype)``, ``to_host(x)``, ``stack(name, arrays)``;
* ``check_strides(named)``: the target's layout limits;
* the launchers: ``forward``, ``backward``, ``varlen_forward``, ``varlen_backward``, ``merge``
  (:class:`~.base.Target`, through the back end's launcher modules, ``launchers()``).

The back ends are imported where a target first needs them, so that importing ``sdpa_numba``
or running on the host never imports ``numba.cuda``.
"""

import numpy as np

from ..host_arrays import is_host_array
from .cuda import CUDA, is_device_array
from .host import HOST

__all__ = ["HOST", "CUDA", "target_of", "is_device_array", "by_name"]

_BY_NAME = {HOST.name: HOST, CUDA.name: CUDA}


def by_name(name):
    """The target called ``name`` (``"host"`` or ``"cuda"``); a target is returned as is."""
    return _BY_NAME.get(name, name) if isinstance(name, str) else name


def target_of(named, required=()):
    """The target of the operands, :data:`HOST` or :data:`CUDA`; TypeError for anything else
    or a mix.

    ``named``: ``(name, array or None)`` pairs; ``required``: the names that may not be None
    (the others are optional arguments).
    """
    # The common case first, cheaply: NumPy arrays (exactly: not a masked array nor a matrix)
    # and optional arguments left out.
    seen = False
    for name, x in named:
        if type(x) is np.ndarray:
            seen = True
        elif x is not None or name in required:
            break
    else:
        if seen:
            return HOST
    kinds = {}
    for name, x in named:
        if x is None:
            if name in required:
                raise TypeError(f"{name} must be an array (NumPy, another host array or a "
                                f"CUDA array), got None")
            continue
        if isinstance(x, np.ma.MaskedArray):  # the kernels would read masked values as data
            raise TypeError(f"{name} is a masked array, whose mask attention would ignore: "
                            f"pass np.ma.filled({name}, value) or use attn_mask")
        if isinstance(x, np.matrix):
            raise TypeError(f"{name} is a np.matrix: pass np.asarray({name})")
        if is_device_array(x):
            kinds[name] = CUDA
        elif is_host_array(x):
            kinds[name] = HOST
        else:
            raise TypeError(f"{name} must be an array: NumPy, any host array with the array "
                            f"interface, DLPack or the buffer protocol (torch CPU tensors, JAX "
                            f"arrays, ...), or a CUDA array (an object with "
                            f"__cuda_array_interface__), got {type(x).__name__}")
    if not kinds:
        raise TypeError("no array given: query, key and value must be arrays")
    targets = set(kinds.values())
    if len(targets) > 1:
        desc = ", ".join(f"{n} on {t.name}" for n, t in kinds.items())
        raise TypeError(f"inputs mix host and device arrays ({desc}): put them on one device")
    return targets.pop()
