"""bfloat16, told apart without importing ml_dtypes.

NumPy has no bfloat16 of its own; ``ml_dtypes.bfloat16`` (what JAX uses) is the usual one.
The package does not need ml_dtypes: a dtype is recognized by its name, and ml_dtypes is only
imported where a bfloat16 array must be made for a caller that has none (torch tensors).
"""

import numpy as np


def is_bfloat16(dtype):
    """Whether ``dtype`` (a NumPy dtype, a type, or the name ``"bfloat16"``) is bfloat16."""
    if isinstance(dtype, str):
        return dtype == "bfloat16"
    if isinstance(dtype, np.dtype) and dtype.kind != "V":  # cheap: dtype.name builds a string
        return False
    try:
        return np.dtype(dtype).name == "bfloat16"
    except TypeError:
        return False


def bfloat16():
    """``ml_dtypes.bfloat16``'s NumPy dtype; TypeError naming the missing package if absent."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 needs the ml_dtypes package (pip install ml-dtypes, or the "
                        "bf16 extra: pip install sdpa_numba[bf16])") from None
    return np.dtype(ml_dtypes.bfloat16)
