"""Compilation options shared by the CPU and the CUDA kernels.

fastmath keeps only the flags that preserve inf/NaN semantics: masks are -inf and must stay
-inf, and a NaN in a query row must show up in that row, so ``nnan``/``ninf`` are never set.
"""

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: Options of small ``@njit`` helpers inlined into their callers, on either target (numba-cuda
#: compiles them as device functions): ``error_model="numpy"`` removes the ZeroDivisionError
#: checks that would stop vectorization.
INLINE = dict(fastmath=FASTMATH, error_model="numpy", inline="always", boundscheck=False)
