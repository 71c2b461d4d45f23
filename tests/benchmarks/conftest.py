import numba
import pytest

try:  # torch must start before Numba's threads do: imported later, its SDPA ran ~10x slower
    import torch
except ImportError:
    torch = None


@pytest.fixture
def torch_sdpa():
    if torch is None:
        pytest.skip("torch is not installed")
    torch.set_num_threads(numba.get_num_threads())

    def run(q, k, v, causal):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return torch, run
