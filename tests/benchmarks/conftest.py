import numba
import pytest


@pytest.fixture
def torch_sdpa():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(numba.get_num_threads())

    def run(q, k, v, causal):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return torch, run
