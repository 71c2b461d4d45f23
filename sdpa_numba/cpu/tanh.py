"""A vectorizable tanh for the soft cap (``c · tanh(s / c)``) in float32.

``math.tanh`` is a scalar libm call here (no SVML in Numba 0.68), so a soft-capped score tile
would cost more than its Q·Kᵀ. Here, for float32:

* ``|x| <= 0.55``: ``x + x³ · P(x²)``, P of degree 4 fitted (least squares on the relative
  error, 20000 Chebyshev nodes) to (tanh(x)/x - 1)/x²: 1.1e-9 in exact arithmetic, 7.1e-8
  (about 1 ulp) evaluated in float32 — no cancellation near 0, where ``1 - e^{-2|x|}`` would
  lose all relative accuracy;
* beyond: ``(1 - t) / (1 + t)``, ``t = e^{-2|x|}`` from :func:`.exp2.exp2` (2 ulp), where
  ``1 - t >= 0.67`` loses nothing; ``t`` flushes to 0 for ``|x| > 44``, giving 1 exactly;

with the sign of ``x`` put back; NaN stays NaN. Both branches are computed and one is selected,
so the loop over a tile vectorizes. float64 uses ``math.tanh`` (its scalar speed is that
dtype's usual price). tests/test_variants.py checks the bound on a dense grid.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from .exp2 import exp2
from .options import FASTMATH, INLINE

#: P's coefficients, constant term first.
_P32 = (-0.3333331865208115, 0.13332616866544583, -0.0538551198490805, 0.021082059476388772,
        -0.006287662852089413)
#: Where the polynomial hands over to the exponential form.
_SMALL = 0.55
#: -2 · log2(e): e^{-2|x|} = 2^{-2 log2(e) |x|}.
_M2LOG2E = -2.0 * 1.4426950408889634


@njit(**INLINE)
def _tanh_f32(x):
    c = np.float32
    a = abs(x)
    u = x * x
    p = c(_P32[4])
    p = p * u + c(_P32[3])
    p = p * u + c(_P32[2])
    p = p * u + c(_P32[1])
    p = p * u + c(_P32[0])
    small = x + x * u * p
    t = exp2(a * c(_M2LOG2E))
    big = (c(1.0) - t) / (c(1.0) + t)
    big = big if x >= c(0.0) else -big
    big = big if x == x else x  # NaN: NaN (a compare, kept without nnan)
    return small if a <= c(_SMALL) else big


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
