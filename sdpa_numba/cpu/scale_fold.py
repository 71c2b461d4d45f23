"""The score's factor folded into the packed queries, without overflow.

The kernels multiply the queries by the score's factor ``c`` (``scale``, over the soft cap in
the forward) as they pack them: once per query element instead of once per score. For a large
``c`` and large queries whose products with the keys are small, ``q · c`` overflows where the
score ``c · q · k`` does not (float32: q = 1e38, c = 4, k = 1e-3 gave NaN). Then, and only
then, the queries are packed again with ``f = c / 2**e`` (``math.frexp``: ``|f|`` in [0.5, 1),
so a finite query stays finite) and each score is multiplied by ``2**e`` once computed: a power
of two commutes with rounding outside the subnormal and overflow ranges, so these are the
scores the fold by ``c`` gives wherever it does not overflow. A packing that does not overflow
keeps the fold by ``c``: every other input keeps its bits, and the test costs one pass over
the packed queries. (An infinite query among them takes the split fold too: its own row is
NaN or infinite either way, and the others' scores are right.)
"""

import math

import numpy as np
from numba import njit

from .options import INLINE


@njit(**INLINE)
def any_inf(p, n):
    """Whether one of the ``n`` values from pointer (or array) ``p`` is infinite."""
    found = False
    for t in range(n):
        found |= abs(p[t]) == np.inf
    return found


@njit(**INLINE)
def split_power(p, n, c):
    """The power of two ``2**e`` to take out of the float64 factor ``c`` when the ``n`` queries
    packed with it (from ``p``) overflowed (``e > 0``, see the module doc); 1.0 otherwise."""
    if not any_inf(p, n):
        return 1.0
    _, e = math.frexp(c)
    return math.ldexp(1.0, e) if e > 0 else 1.0


@njit(**INLINE)
def times(p, n, w):
    """``p[0:n] *= w`` (pointer or array)."""
    for t in range(n):
        p[t] *= w
