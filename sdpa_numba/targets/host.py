"""The host target: NumPy (and other host) arrays, the CPU kernels (:mod:`sdpa_numba.cpu`)."""

import numpy as np

from ..host_arrays import adopt as _adopt
from ..problem.out import host_address


class Host:
    """What running on the host means: see :mod:`sdpa_numba.targets`."""

    name = "host"
    #: The back end's name in messages.
    label = "CPU"
    #: The address of a NumPy array's element 0 (the ``out`` checks).
    address = staticmethod(host_address)

    def __repr__(self):
        return "sdpa_numba.targets.HOST"

    @staticmethod
    def adopt(named, out=None):
        """NumPy views of the operands and ``restore`` (:func:`sdpa_numba.host_arrays.adopt`)."""
        return _adopt(named, out)

    @property
    def as_strided(self):
        """NumPy's ``as_strided`` for the problem layer (:func:`sdpa_numba.cpu.launch.as_strided`)."""
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

    @staticmethod
    def forward(p, query, key, value, attn_mask, out, dropout):
        """:func:`sdpa_numba.cpu.launch.run`."""
        from ..cpu.launch import run

        return run(p, query, key, value, attn_mask, out, dropout)

    @staticmethod
    def backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout, mask_grad):
        """:func:`sdpa_numba.cpu.launch_backward.run_backward`."""
        from ..cpu.launch_backward import run_backward

        return run_backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout,
                            mask_grad)

    @staticmethod
    def varlen_forward(p, q, k, v, out, dropout):
        """:func:`sdpa_numba.cpu.launch_varlen.run`."""
        from ..cpu.launch_varlen import run

        return run(p, q, k, v, out, dropout)

    @staticmethod
    def varlen_backward(p, grad_out, q, k, v, out, lse, dropout):
        """:func:`sdpa_numba.cpu.launch_varlen.run_backward`."""
        from ..cpu.launch_varlen import run_backward

        return run_backward(p, grad_out, q, k, v, out, lse, dropout)


    @staticmethod
    def merge(parts, dt, ct, lead, ev):
        """:func:`sdpa_numba.cpu.launch_merge.run`."""
        from ..cpu.launch_merge import run

        return run(parts, dt, ct, lead, ev)


#: The host target.
HOST = Host()
