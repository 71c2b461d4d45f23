"""Compilation options shared by every CPU kernel.

fastmath keeps the flags that preserve inf/NaN semantics: masks are -inf and must stay -inf,
and a NaN in a query row must show up in that row. ``nnan``/``ninf`` are therefore never set.
``error_model="numpy"`` removes the ZeroDivisionError checks that would stop vectorization.
The kernels are cached on disk where Numba can write a cache (see :mod:`sdpa_numba._runtime`).
"""

from .._runtime import caching_available


def _cache_probe():
    """Defined next to the kernels: Numba would put its cache where theirs goes."""


CACHE = caching_available(_cache_probe)

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: Options of the small, inlined helpers (they are compiled into their callers).
INLINE = dict(fastmath=FASTMATH, error_model="numpy", inline="always", boundscheck=False)

#: Options of helpers compiled as functions of their own: ``@njit`` functions kept out of line
#: with ``_llvm.no_inline``, and the implementations of ``@overload``-ed helpers.
CALLED = dict(fastmath=FASTMATH, error_model="numpy", boundscheck=False)

#: Options of the kernels and entry points (cached on disk: compile time counts).
KERNEL = dict(fastmath=FASTMATH, error_model="numpy", cache=CACHE, boundscheck=False, nogil=True)
