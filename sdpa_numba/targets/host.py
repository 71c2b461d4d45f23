"""The host target: NumPy (and other host) arrays, the CPU kernels (:mod:`sdpa_numba.cpu`)."""

import numpy as np

from ..host_arrays import adopt as _adopt
from ..problem.out import host_address
from .base import Target


def _cpu_launchers():
    """The CPU launcher modules, in :class:`~.base.Launchers`' order."""
    from ..cpu import launch, launch_backward, launch_merge, launch_varlen

    return launch, launch_backward, launch_varlen, launch_merge


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


#: The host target.
HOST = Host("host", "CPU", _cpu_launchers)
