"""Storage dtypes and the compute-dtype rule.

The inputs are float16, bfloat16, float32 or float64 (:func:`check_storage_dtype`, the one
check of them); the kernels accumulate in float64 for float64 and in float32 for everything
narrower. That rule is :func:`compute_dtype`, the only place it is written: the plan, both
back ends' kernel types and the PyTorch operator's ``lse`` use it.
"""

import numpy as np

from .._bf16 import is_bfloat16

#: The storage dtypes the public functions accept.
FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def compute_dtype(dtype):
    """The accumulation (compute) dtype of a storage dtype, as a NumPy dtype: float64 for
    float64, float32 for float32, float16 and bfloat16.

    ``dtype``: anything :class:`numpy.dtype` reads, or a dtype named like NumPy's (e.g. a
    ``torch.dtype``, whose ``str`` ends in the name).
    """
    try:
        wide = np.dtype(dtype) == _F64
    except TypeError:  # not a NumPy dtype (torch's, bfloat16 without ml_dtypes): by its name
        wide = str(dtype).rsplit(".", 1)[-1] == "float64"
    return _F64 if wide else _F32


def check_storage_dtype(name, x, like=None):
    """``x``'s dtype, checked to be a storage dtype (float16, bfloat16, float32 or float64);
    TypeError naming ``name`` otherwise (a float dtype in the other byte order is told so).

    ``like``: None, or ``(like_name, dtype)``: ``x``'s dtype must also be that one (e.g.
    ``("query", np.dtype(query.dtype))``).
    """
    dt = np.dtype(x.dtype)
    if dt not in FLOATS and not is_bfloat16(dt):
        if dt.kind == "f" and dt.newbyteorder("=") in FLOATS:
            raise TypeError(f"{name} dtype {dt.str} is not in the machine's byte order: "
                            f"pass {name}.astype({name}.dtype.newbyteorder('='))")
        raise TypeError(f"{name} dtype {dt} is not supported: use float16, bfloat16 "
                        f"(ml_dtypes.bfloat16), float32 or float64")
    if like is not None and dt != like[1]:
        raise TypeError(f"{name} dtype {dt} differs from {like[0]} dtype {like[1]}")
    return dt
