"""A vectorizable tanh for the soft cap (``c · tanh(s / c)``) in float32.

``math.tanh`` is a scalar libm call here (no SVML in Numba 0.68), so a soft-capped score tile
would cost more than its Q·Kᵀ. For float32 this is a
truncation of Lambert's continued fraction ``tanh x = x / (1 + x²/(3 + x²/(5 + ...)))``: its
13th convergent is ``x · P(x²) / Q(x²)`` with P and Q of degree 6 in ``x²`` and positive
coefficients (no pole, no cancellation), computed below from the fraction itself. ``x`` is
clamped to ±7.9053111 (where float32 tanh is 1). Twelve FMAs and one division by a reciprocal
estimate (vrcp14ps and a Newton step), no exponential. Measured here: 3.2e-7 relative error at
most (about 3 ulp), odd, exact at 0, |tanh| <= 1; NaN stays NaN. A 64 x 64 score tile costs
about 0.3 ns per score on one core (the softmax's pass over it: 0.21-0.26; an exp2-based tanh
with a polynomial near 0: about twice as much). float64 uses ``math.tanh`` (its scalar speed is
that dtype's usual price). tests/test_variants.py checks the bound on a grid.
"""

import math

import numpy as np
from numba import literal_unroll, njit, types
from numba.extending import intrinsic, overload

from .options import FASTMATH, INLINE

#: Convergents of Lambert's continued fraction taken: 13 is the first whose float32 error
#: (with the division below) stays within 3 ulp on [-8, 8].
_TERMS = 13


def _lambert(n):
    """``(P, Q)``, lowest degree first, of the ``n``-th convergent of Lambert's continued
    fraction, ``tanh x = x · P(x²) / Q(x²)``, scaled so that ``Q(0) = 1``: the fraction is
    folded from its last term up, ``K_k = (2k - 1) + x² / K_{k+1}`` as numerator/denominator
    polynomials in ``x²``, in exact integers."""
    num, den = [2 * n - 1], [1]  # K_n
    for k in range(n - 1, 0, -1):  # K_k = ((2k - 1) num + x² den) / num
        shifted = [0] + den
        new = [(2 * k - 1) * (num[i] if i < len(num) else 0)
               + (shifted[i] if i < len(shifted) else 0)
               for i in range(max(len(num), len(shifted)))]
        num, den = new, num
    # tanh x = x / K_1 = x · den / num
    return tuple(c / num[0] for c in den), tuple(c / num[0] for c in num)


_P, _Q = _lambert(_TERMS)
#: The coefficients below the leading one, highest degree first (Horner's order).
_P_REST = _P[-2::-1]
_Q_REST = _Q[-2::-1]
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
    p = c(_P[-1])
    for n in literal_unroll(_P_REST):
        p = p * y2 + c(n)
    q = c(_Q[-1])
    for n in literal_unroll(_Q_REST):
        q = q * y2 + c(n)
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
