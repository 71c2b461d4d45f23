import numba
import numpy as np
import pytest


def flops(B, H, L, S, E, causal):
    """4·B·H·L·S·E for the forward (two matmuls), half when causal (DESIGN.md §5)."""
    return 4 * B * H * L * S * E / (2 if causal else 1)


@pytest.fixture
def torch_sdpa():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(numba.get_num_threads())

    def run(q, k, v, causal):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return torch, run


def inputs(B, H, L, E, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, L, E)).astype(dtype) for _ in range(3))
