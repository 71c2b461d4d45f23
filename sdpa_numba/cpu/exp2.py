"""A vectorizable 2**x for x <= 0 (and NaN), the only exponentials the online softmax needs.

Numba 0.68 has no SVML, so ``math.exp`` stays a scalar libm call inside loops (about 5x slower
than this). Here 2**x = 2**n * 2**f with n = round(x), f in [-1/2, 1/2]: 2**f is a Taylor
polynomial of e**(f ln 2) (degree 7 for float32, relative error < 5e-9; degree 13 for float64,
< 1e-17) and 2**n is written straight into the exponent bits. Scores are pre-multiplied by
log2(e), so exp2 of them is the softmax's exp.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._llvm import pow2_of_integral
from .options import FASTMATH, INLINE

_LN2 = math.log(2.0)
_C = tuple(_LN2**k / math.factorial(k) for k in range(14))

# float32: below 2**-126 a term is subnormal; it is flushed to an exact 0 (also makes
# exp2(-inf) == 0 exactly, which masks rely on).
_F32_MIN = -126.0
_F64_MIN = -1022.0


@njit(**INLINE)
def _exp2_f32(x):
    n = np.floor(x + np.float32(0.5))
    f = x - n
    c = np.float32
    p = c(_C[7])
    p = p * f + c(_C[6])
    p = p * f + c(_C[5])
    p = p * f + c(_C[4])
    p = p * f + c(_C[3])
    p = p * f + c(_C[2])
    p = p * f + c(_C[1])
    p = p * f + c(1.0)
    nc = max(n, c(_F32_MIN))
    r = p * pow2_of_integral(nc)
    return c(0.0) if x < c(_F32_MIN) else r


@njit(**INLINE)
def _exp2_f64(x):
    n = np.floor(x + 0.5)
    f = x - n
    p = _C[13]
    p = p * f + _C[12]
    p = p * f + _C[11]
    p = p * f + _C[10]
    p = p * f + _C[9]
    p = p * f + _C[8]
    p = p * f + _C[7]
    p = p * f + _C[6]
    p = p * f + _C[5]
    p = p * f + _C[4]
    p = p * f + _C[3]
    p = p * f + _C[2]
    p = p * f + _C[1]
    p = p * f + 1.0
    nc = max(n, _F64_MIN)
    r = p * pow2_of_integral(nc)
    return 0.0 if x < _F64_MIN else r


def exp2(x):
    """2**x for x <= 0 or NaN, in x's precision (jitted code only)."""
    raise NotImplementedError("exp2 is only callable from jitted code")


@overload(exp2, fastmath=FASTMATH)
def _exp2(x):
    if x == types.float32:
        return lambda x: _exp2_f32(x)
    if x == types.float64:
        return lambda x: _exp2_f64(x)
    return None
