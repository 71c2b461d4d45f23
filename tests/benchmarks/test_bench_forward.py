"""Forward speed: sdpa_numba vs torch's SDPA vs the NumPy reference (run with --benchmark-only).

    python -m pytest tests/benchmarks --benchmark-only --benchmark-group-by=param:case

GFLOP/s are in each benchmark's extra_info (``--benchmark-json`` keeps them).
"""

import numpy as np
import pytest

from bench_utils import flops, inputs
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention

CASES = {
    "B1H8L2048D64": (1, 8, 2048, 64, False),
    "B1H8L2048D64-causal": (1, 8, 2048, 64, True),
    "B1H4L4096D128": (1, 4, 4096, 128, False),
}


def _record(benchmark, case):
    B, H, L, E, causal = CASES[case]
    benchmark.extra_info["gflops"] = flops(B, H, L, L, E, causal) / benchmark.stats["min"] / 1e9


@pytest.mark.parametrize("case", CASES)
def test_sdpa_numba(benchmark, case):
    B, H, L, E, causal = CASES[case]
    q, k, v = inputs(B, H, L, E)
    out = np.empty_like(q)
    sdpa(q, k, v, is_causal=causal, out=out)  # compile / load from cache outside the timing
    benchmark.pedantic(sdpa, (q, k, v), dict(is_causal=causal, out=out), rounds=10,
                       warmup_rounds=1)
    _record(benchmark, case)


@pytest.mark.parametrize("case", CASES)
def test_torch(benchmark, case, torch_sdpa):
    torch, run = torch_sdpa
    B, H, L, E, causal = CASES[case]
    q, k, v = (torch.from_numpy(a) for a in inputs(B, H, L, E))
    benchmark.pedantic(run, (q, k, v, causal), rounds=10, warmup_rounds=1)
    _record(benchmark, case)


@pytest.mark.parametrize("case", ["B1H8L2048D64", "B1H8L2048D64-causal"])
def test_numpy_reference(benchmark, case):
    B, H, L, E, causal = CASES[case]
    q, k, v = inputs(B, H, L, E)
    benchmark.pedantic(attention, (q, k, v), dict(is_causal=causal), rounds=2, warmup_rounds=0)
    _record(benchmark, case)
