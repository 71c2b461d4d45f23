"""Compilation options shared by every CPU kernel.

``FASTMATH`` and ``INLINE`` are the target-neutral ones of :mod:`sdpa_numba.options` (see
there why ``nnan``/``ninf`` are never set). ``error_model="numpy"`` removes the
ZeroDivisionError checks that would stop vectorization. The kernels are cached on disk where Numba can write a cache (see :mod:`sdpa_numba._runtime`).
"""

from .._runtime import caching_available
from ..options import FASTMATH, INLINE

__all__ = ["FASTMATH", "INLINE", "CALLED", "KERNEL", "CACHE", "JITTED_ONLY"]


def _cache_probe():
    """Defined next to the kernels: Numba would put its cache where theirs goes."""


CACHE = caching_available(_cache_probe)

#: Options of helpers compiled as functions of their own: ``@njit`` functions kept out of line
#: with ``_llvm.no_inline``, and the implementations of ``@overload``-ed helpers.
CALLED = dict(fastmath=FASTMATH, error_model="numpy", boundscheck=False)

#: Options of the kernels and entry points (cached on disk: compile time counts).
KERNEL = dict(fastmath=FASTMATH, error_model="numpy", cache=CACHE, boundscheck=False, nogil=True)

#: Extra options of the functions that only jitted code calls: without the CPython and C
#: wrappers that Numba otherwise compiles for every function (never called: about a tenth of
#: the forward's first compile, scripts/cold_start.py --events).
JITTED_ONLY = dict(no_cpython_wrapper=True, no_cfunc_wrapper=True)
