"""A vectorizable tanh for the soft cap (``c · tanh(s / c)``) in float32.

``math.tanh`` is a scalar libm call here (no SVML in Numba 0.68), so a soft-capped score tile
would cost more than its Q·Kᵀ. For float32 this is ``x · P(x²) / Q(x²)`` with P of degree 6 and
Q of degree 3 in ``x²``, a near-minimax rational for the relative error on [0, 7.9053111]
(fitted by iteratively reweighted linear least squares on 6000 Chebyshev nodes, ``P - tanh(x)/x
· Q`` weighted by the previous round's ``1 / (tanh(x)/x · Q)`` and error: 2.9e-9 in exact
arithmetic, P(0) then pinned to 1). ``x`` is clamped to ±7.9053111 (where float32 tanh is 1).
Nine FMAs and one division by a reciprocal estimate (vrcp14ps and a Newton step), no
exponential; the 13th convergent of Lambert's continued fraction, of the same accuracy in
float32, took twelve FMAs. Measured here: 2.4e-7 relative error at most (about 2 ulp, the
float32 evaluation's; 3.1e-7 for :func:`scaled_tanh`), odd, exact at 0, |tanh| <= 1; NaN stays
NaN. The soft cap's pass over
a 64 x 64 score tile costs about 0.3 ns per score on one core (the softmax's pass over it:
0.21-0.26; an exp2-based tanh with a polynomial near 0: about twice as much). float64 uses
``math.tanh`` (its scalar speed is that dtype's usual price). tests/test_variants.py checks the
bound on a grid.
"""

import math

import numpy as np
from numba import literal_unroll, njit, types
from numba.extending import intrinsic, overload

from .options import FASTMATH, INLINE

#: P and Q, lowest degree first, in ``x²``: ``tanh x ≈ x · P(x²) / Q(x²)``.
_P = (1.0, 0.13128039581959738, 0.003153553667595499, 1.168885925606434e-05,
      -2.2525310618627864e-08, 6.484600216247213e-11, -1.1935671873931358e-13)
_Q = (1.0, 0.4646137135106223, 0.024691486600474224, 0.0002619212106737747)
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
def _scaled_tanh_f32(x, a):
    """``a · tanh(x)``, with ``a`` folded into P's coefficients: loop-invariant where ``a``
    is, so the product costs no operation per element."""
    c = np.float32
    # Clamped so that a NaN passes through (a compare with NaN is false): vmaxps/vminps.
    y = c(-_CLAMP) if x < c(-_CLAMP) else x
    y = c(_CLAMP) if y > c(_CLAMP) else y
    y2 = y * y
    p = a * c(_P[-1])
    for n in literal_unroll(_P_REST):
        p = p * y2 + a * c(n)
    q = c(_Q[-1])
    for n in literal_unroll(_Q_REST):
        q = q * y2 + c(n)
    return _ratio(y * p, q)


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


def scaled_tanh(x, a):
    """``a · tanh(x)`` in x's precision, ``a`` of x's type (jitted code only). For float32,
    ``a`` is folded into the polynomial's coefficients (a soft cap ``c · tanh(s / c)`` whose
    ``1 / c`` is already in the scores then costs no multiply per score): within an ulp or two
    of ``a * tanh(x)``, not bitwise."""
    raise NotImplementedError("scaled_tanh is only callable from jitted code")


@overload(scaled_tanh, fastmath=FASTMATH)
def _scaled_tanh(x, a):
    if x == types.float32 and a == types.float32:
        return lambda x, a: _scaled_tanh_f32(x, a)
    if x == types.float64 and a == types.float64:
        return lambda x, a: a * math.tanh(x)
    return None
