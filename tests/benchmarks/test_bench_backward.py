"""Speed of the CPU backward against torch's autograd backward (a benchmark, not a test).

Skipped by default (``--benchmark-skip`` in pyproject); run with::

    PYTHONPATH=. python -m pytest tests/benchmarks/test_bench_backward.py --benchmark-enable \
        --benchmark-only -s

or as a script (interleaved runs, prints a table)::

    PYTHONPATH=. python tests/benchmarks/test_bench_backward.py [repeats]

float32, B=1, H=8, L=S=2048, D=64, causal and not; torch uses as many threads as Numba. FLOPs
of the backward are counted as 8·B·H·L·S·D (the four L x S x D products of FlashAttention's
backward: dV, dP, dQ, dK; the recomputation of S is not counted), halved when causal.
Compilation happens in the warm-up, outside the timings.
"""

import time

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdpa_numba import scaled_dot_product_attention as sdpa  # noqa: E402
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward  # noqa: E402
from sdpa_numba.bench import PAUSE  # noqa: E402
from sdpa_numba.problem import flops as count_flops  # noqa: E402

B, H, L, D = 1, 8, 2048, 64


def flops(causal):
    return count_flops(B, H, L, L, D, causal, backward=True)


def make(causal, seed=0):
    """Inputs and two zero-argument callables: our backward and torch's."""
    torch.set_num_threads(numba.get_num_threads())
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(4))
    out, lse = sdpa(q, k, v, is_causal=causal, return_lse=True)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    tg = torch.from_numpy(g)

    def ours():
        return sdpa_backward(g, q, k, v, out, lse, is_causal=causal)

    def theirs():
        return torch.autograd.grad(tout, (tq, tk, tv), tg, retain_graph=True)

    ours()  # compile (or load from the cache) and warm up
    theirs()
    return ours, theirs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", ["sdpa_numba", "torch"])
def test_backward(benchmark, impl, causal):
    ours, theirs = make(causal)
    fn = ours if impl == "sdpa_numba" else theirs
    benchmark.extra_info.update(threads=numba.get_num_threads(), B=B, H=H, L=L, D=D,
                                flops=flops(causal))
    benchmark.pedantic(fn, rounds=10, warmup_rounds=1)
    benchmark.extra_info["GFLOP/s (min)"] = flops(causal) / benchmark.stats.stats.min / 1e9


def interleaved(causal, repeats=10):
    """Minimum times of interleaved runs: (ours, torch) in seconds."""
    ours, theirs = make(causal)
    t_ours, t_theirs = [], []
    for _ in range(repeats):
        for fn, ts in ((ours, t_ours), (theirs, t_theirs)):
            time.sleep(PAUSE)  # let the other library's spinning workers go to sleep
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return min(t_ours), min(t_theirs)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_vs_torch(benchmark, causal):
    """Our time / torch's, interleaved in one loop (the figure to report)."""
    result = {}

    def run():
        result["ours"], result["torch"] = interleaved(causal)

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        ours_ms=result["ours"] * 1e3, torch_ms=result["torch"] * 1e3,
        speedup=result["torch"] / result["ours"],
        ours_gflops=flops(causal) / result["ours"] / 1e9,
        torch_gflops=flops(causal) / result["torch"] / 1e9)
    print(f"\ncausal={causal}: {benchmark.extra_info}")


if __name__ == "__main__":
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    print(f"float32 B={B} H={H} L=S={L} D={D}, {numba.get_num_threads()} threads, "
          f"min of {n} interleaved runs; GFLOP/s with 8·B·H·L·S·D (half if causal)")
    for causal in (False, True):
        a, b = interleaved(causal, n)
        print(f"causal={causal!s:5}  sdpa_numba {a * 1e3:7.1f} ms {flops(causal) / a / 1e9:6.1f} "
              f"GFLOP/s | torch {b * 1e3:7.1f} ms {flops(causal) / b / 1e9:6.1f} GFLOP/s | "
              f"torch/ours {b / a:.2f}")
