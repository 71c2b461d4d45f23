"""Checks of the scalar arguments shared by the forward and the backward: flags, the dropout
probability and the seed (:func:`sdpa_numba.dropout.check_seed`, kept with the dropout
stream's seeds and re-exported here). Each returns the value in its canonical Python type or raises
TypeError / ValueError naming the argument."""

import math
import numbers

import numpy as np

from ..dropout import check_seed  # noqa: F401 - the seed's check, with the others here


def shape_str(x):
    """``x.shape`` as ``(a, b, c)`` for error messages."""
    return "(" + ", ".join(str(int(n)) for n in x.shape) + ")"


def check_flag(name, value):
    """``value`` as a bool; TypeError unless it is a Python or NumPy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_scale(scale, E):
    """``scale`` as a finite float; None gives ``1 / sqrt(E)`` (1 for ``E == 0``)."""
    if scale is None:
        return 1.0 / math.sqrt(E) if E else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_dropout(dropout_p):
    """``dropout_p`` as a float in [0, 1); TypeError / ValueError otherwise."""
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0:  # the common case, cheaply
        return dropout_p
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:  # also rejects NaN
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_device_strides(named):
    """The CUDA path's one layout limit: no negative strides. Numba's own views with negative
    strides point at their lowest address, other libraries' at element 0: no view could be
    built for both, so such operands are refused. ``named``: ``(name, array or None)``."""
    for name, x in named:
        if x is not None and any(s < 0 for s in x.strides):
            raise ValueError(f"{name} has negative strides {tuple(x.strides)}, which the CUDA "
                             f"path does not support: pass a copy")
