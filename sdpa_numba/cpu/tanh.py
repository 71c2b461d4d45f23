"""A vectorizable tanh for the soft cap (``c · tanh(s / c)``) in float32.

``math.tanh`` is a scalar libm call here (no SVML in Numba 0.68), so a soft-capped score tile
would cost more than its Q·Kᵀ. For float32 this is the rational approximation of Eigen's
``generic_fast_tanh_float`` (its coefficients; Eigen is MPL-2.0): ``x`` clamped to
±7.9053111 (where float32 tanh is 1), then ``x · P(x²) / Q(x²)`` with P of degree 6 and Q of
degree 3 in ``x²`` — ten FMAs and one division by a reciprocal estimate (vrcp14ps and a
Newton step), no exponential. Measured here: 3.2e-7 relative error at most (about 3 ulp), odd,
exact at 0, ±(1 - 2.4e-7) beyond the clamp; NaN stays NaN. A 64 x 64 score tile costs about
0.27 ns per score on one core (the softmax's pass over it: 0.21-0.26; an exp2-based tanh with
a polynomial near 0: 1.9x as much). float64 uses ``math.tanh`` (its scalar speed is that
dtype's usual price). tests/test_variants.py checks the bound on a grid.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

from .options import FASTMATH, INLINE

#: Numerator (odd: x · P(x²)) and denominator (Q(x²)) coefficients, lowest degree first.
_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05,
      5.12229709037114e-08, -8.60467152213735e-11, 2.00018790482477e-13,
      -2.76076847742355e-16)
_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04,
      1.19825839466702e-06)
#: Beyond this, float32 tanh rounds to ±1 (and P/Q stays bounded).
_CLAMP = 7.90531110763549805


@intrinsic
def _ratio(typingctx, p, q):
    """``p / q`` for a finite ``p`` and a finite ``q > 0``, as an ``fdiv`` with the ``ninf``
    flag (true of these operands; never set kernel-wide, where -inf masks live): with it and
    ``arcp``, LLVM divides vectors by a reciprocal estimate refined by one Newton step
    (vrcp14ps and FMAs instead of vdivps, whose throughput bound the soft cap)."""
    sig = p(p, q)

    def codegen(context, builder, signature, args):
        return builder.fdiv(args[0], args[1], flags=("ninf", "arcp", "nsz", "contract", "afn",
                                                     "reassoc"))

    return sig, codegen


@njit(**INLINE)
def _tanh_f32(x):
    c = np.float32
    # Clamped so that a NaN passes through (a compare with NaN is false): vmaxps/vminps.
    y = c(-_CLAMP) if x < c(-_CLAMP) else x
    y = c(_CLAMP) if y > c(_CLAMP) else y
    y2 = y * y
    p = c(_P[6])
    p = p * y2 + c(_P[5])
    p = p * y2 + c(_P[4])
    p = p * y2 + c(_P[3])
    p = p * y2 + c(_P[2])
    p = p * y2 + c(_P[1])
    p = p * y2 + c(_P[0])
    q = c(_Q[3])
    q = q * y2 + c(_Q[2])
    q = q * y2 + c(_Q[1])
    q = q * y2 + c(_Q[0])
    return _ratio(y * p, q)


def tanh(x):
    """tanh(x) in x's precision (jitted code only)."""
    raise NotImplementedError("tanh is only callable from jitted code")


@overload(tanh, fastmath=FASTMATH)
def _tanh(x):
    if x == types.float32:
        return lambda x: _tanh_f32(x)
    if x == types.float64:
        return lambda x: math.tanh(x)
    return None
