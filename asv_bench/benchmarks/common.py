"""Shared by the benchmarks: inputs, FLOP counts, a timer.

Only the public API (``sdpa_numba.scaled_dot_product_attention``) is used, so that the suite
runs against every commit of the project's history, not just the newest; the FLOP count is the
package's own (:func:`sdpa_numba.problem.flops`) where the commit has it.
"""

import math
import time

import numpy as np

try:
    from sdpa_numba.problem import flops as _package_flops
except ImportError:  # commits before the problem layer
    _package_flops = None


def inputs(b, h, L, e, dtype, seed=0):
    """Standard-normal q, k, v of shape (b, h, L, e)."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, h, L, e), dtype=np.float32).astype(dtype)
                 for _ in range(3))


def flops(b, h, L, S, e, causal, backward=False):
    """FLOPs: 4·B·H·L·S·E for the forward (Q Kᵀ and P V), 8·B·H·L·S·E for the backward, half
    when causal (:func:`sdpa_numba.problem.flops`; the same count for older commits)."""
    if _package_flops is not None:
        return _package_flops(b, h, L, S, e, causal, backward=backward)
    f = (8 if backward else 4) * b * h * L * S * e
    return f // 2 if causal else f


def min_time(fn, repeats):
    """Minimum wall time of ``repeats`` calls."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
