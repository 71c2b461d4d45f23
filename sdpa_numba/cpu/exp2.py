"""A vectorizable 2**x for x <= 0 (and NaN), the only exponentials the online softmax needs.

Numba 0.68 has no SVML, so ``math.exp`` stays a scalar libm call inside loops (about 5x slower
than this). Here 2**x = 2**n * 2**f with n = rint(x), f in [-1/2, 1/2]: 2**f is a polynomial
and 2**n is written straight into the exponent bits (both n and 2**n come from one add of a
magic number: ``_llvm.split_pow2``). Scores are pre-multiplied by log2(e), so
exp2 of them is the softmax's exp. (Adding n to the polynomial's exponent bits instead of
multiplying would save nothing — the multiply also does the final select, as a zero-masked
vmulps — and would turn a NaN into a number.)

The polynomials are near-minimax for the relative error on [-1/2, 1/2] with the constant term
pinned to 1 (so exp2(0) == 1 exactly: a row's maximum always gets p = 1), fitted by Lawson's
iteratively reweighted least squares on 8000 Chebyshev nodes in extended precision:

* float32, degree 5: 9.1e-8 in exact arithmetic, 1.9e-7 (about 2 ulp) evaluated in float32 —
  against 1.4e-8 for float32 rounding of the scores themselves; torch's CPU flash attention uses
  an exp with a larger bound (``exp_u20``). Degree 7 Taylor (the previous version) was 7e-8
  and cost two more FMAs per element.
* float64, degree 10: 3.8e-16 (about 2 ulp) evaluated in float64, three FMAs fewer than the
  degree-13 Taylor polynomial of the same accuracy.

tests/test_exp2.py checks both bounds on a dense grid.
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._llvm import split_pow2
from .options import FASTMATH, INLINE

_C32 = (1.0, 0.693146977598993, 0.24022242085262305, 0.0555073374349715,
        0.009671512644822727, 0.0013264727123553598)
_C64 = (1.0, 0.6931471805599492, 0.240226506959091, 0.05550410866448181,
        0.009618129107983105, 0.001333355822580133, 0.00015403529994287895,
        1.525265942707477e-05, 1.3215653573745904e-06, 1.0208323115462288e-07,
        7.03818324355824e-09)

# Below 2**-126 (float32) / 2**-1022 (float64) a result would be subnormal: it is flushed to an
# exact 0. That also makes exp2(-inf) == 0 exactly, which masks rely on.
_F32_MIN = -126.0
_F64_MIN = -1022.0


@njit(**INLINE)
def _exp2_f32(x):
    c = np.float32
    f, pow2_n = split_pow2(x)
    p = c(_C32[5])
    p = p * f + c(_C32[4])
    p = p * f + c(_C32[3])
    p = p * f + c(_C32[2])
    p = p * f + c(_C32[1])
    p = p * f + c(_C32[0])
    r = p * pow2_n
    return c(0.0) if x < c(_F32_MIN) else r


@njit(**INLINE)
def _exp2_f64(x):
    f, pow2_n = split_pow2(x)
    p = _C64[10]
    p = p * f + _C64[9]
    p = p * f + _C64[8]
    p = p * f + _C64[7]
    p = p * f + _C64[6]
    p = p * f + _C64[5]
    p = p * f + _C64[4]
    p = p * f + _C64[3]
    p = p * f + _C64[2]
    p = p * f + _C64[1]
    p = p * f + _C64[0]
    r = p * pow2_n
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
