"""Shared by the benchmarks: inputs, FLOP counts, a timer.

Only the public API (``sdpa_numba.scaled_dot_product_attention``) is used, so that the suite
runs against every commit of the project's history, not just the newest.
"""

import math
import time

import numpy as np


def inputs(b, h, L, e, dtype, seed=0):
    """Standard-normal q, k, v of shape (b, h, L, e)."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, h, L, e), dtype=np.float32).astype(dtype)
                 for _ in range(3))


def flops(b, h, L, S, e, causal):
    """Forward FLOPs, 4·B·H·L·S·E (Q Kᵀ and P V), half when causal."""
    f = 4 * b * h * L * S * e
    return f // 2 if causal else f


def min_time(fn, repeats):
    """Minimum wall time of ``repeats`` calls."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
