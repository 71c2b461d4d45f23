"""Number conversions for jitted code on either target."""

import numpy as np
from numba import types
from numba.extending import overload

from ..options import FASTMATH


def cast(value, like):
    """``value`` converted to the float type of ``like``, a scalar or an array (jitted only)."""
    raise NotImplementedError("cast is only callable from jitted code")


@overload(cast, target="generic", fastmath=FASTMATH)
def _cast(value, like):
    if isinstance(like, types.Array):
        like = like.dtype
    if like == types.float32:
        return lambda value, like: np.float32(value)
    if like == types.float64:
        return lambda value, like: np.float64(value)
    return None
