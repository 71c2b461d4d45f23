"""Shared benchmark helpers."""

import numpy as np


def flops(B, H, L, S, E, causal):
    """4·B·H·L·S·E for the forward (two matmuls), half when causal."""
    return 4 * B * H * L * S * E / (2 if causal else 1)


def inputs(B, H, L, E, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, L, E)).astype(dtype) for _ in range(3))
