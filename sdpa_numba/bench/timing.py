"""Timing and its conditions, shared by the benchmarks: interleaved rounds with a pause
before each call, the relative error of two results, the thread counts of Numba and torch."""

import math
import time

import numpy as np


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


#: Seconds of rest before each timed call. After a call, a library's worker threads spin for a
#: while before they sleep (OpenBLAS's for up to ~0.1 s by default); on a machine with few cores
#: they would steal the CPUs from the next implementation timed.
PAUSE = 0.2


def time_interleaved(fns, repeats, pause=None):
    """Minimum time of each callable over ``repeats`` interleaved rounds (warm them up first)."""
    pause = PAUSE if pause is None else pause
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def rel_error(x, ref):
    """Relative Frobenius error ``||x - ref|| / ||ref||`` in float64."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), np.finfo(float).tiny))


def set_threads(n=None, torch_too=True):
    """Set Numba's thread count (``n``, or leave it) and torch's to the same; return it.

    ``torch_too=False`` leaves torch alone (and unimported).

    torch is imported *before* Numba starts its threads: torch imported after Numba's OpenMP
    threading layer has started ran its SDPA about 10x slower here (torch 2.13, numba 0.68,
    2 cores), which would flatter sdpa_numba in every comparison.
    """
    if torch_too and torch_available():
        import torch  # noqa: F401  (first: see above)
    import numba

    if n is not None:
        numba.set_num_threads(n)
    n = numba.get_num_threads()
    if torch_too and torch_available():
        import torch

        torch.set_num_threads(n)
    return n
