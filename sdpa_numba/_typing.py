"""Types of the public signatures.

Results come back as the caller's kind of array (a NumPy array for NumPy inputs, the same kind
of CUDA array for CUDA inputs): the functions are generic in that kind, ``ArrayT``. For NumPy
inputs the overloads also say the dtypes: the output has the inputs' dtype, ``lse`` the compute
dtype (float32 for float16 and float32 inputs, float64 for float64).
"""

from typing import Any, Literal, TypedDict, TypeVar

import numpy as np
import numpy.typing as npt

#: The caller's kind of array; results are returned as the same kind.
ArrayT = TypeVar("ArrayT")
#: Storage dtypes whose compute dtype is themselves.
SelfComputed = TypeVar("SelfComputed", np.float32, np.float64)

F16 = npt.NDArray[np.float16]
F32 = npt.NDArray[np.float32]
#: What the reference functions take: anything NumPy converts to an array.
ArrayLike = npt.ArrayLike
F64 = npt.NDArray[np.float64]
#: A mask: bool or float, any kind of array the operands are.
Mask = Any


class Variants(TypedDict, total=False):
    """The attention variants, keyword-only on the forward and the backward (see
    :func:`sdpa_numba.scaled_dot_product_attention`); the backward takes ``sinks`` on its own
    (it changes what the backward returns)."""

    window: tuple[int | None, int | None] | None
    chunk: int | None
    alignment: Literal["top_left", "bottom_right"]
    softcap: float | None
    alibi_slopes: Any
    score_mod: Any
    mask_mod: Any
    mod_args: tuple[Any, ...]
    score_mod_grad: Any
    block_mask: Any


class ForwardVariants(Variants, total=False):
    """:class:`Variants` and ``sinks``."""

    sinks: Any
