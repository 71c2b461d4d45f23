"""Shared benchmark helpers."""

import numpy as np

from sdpa_numba.problem import flops

__all__ = ["flops", "inputs"]


def inputs(B, H, L, E, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, L, E)).astype(dtype) for _ in range(3))
