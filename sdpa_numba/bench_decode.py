"""Decode benchmarks, for ``python -m sdpa_numba bench --preset decode``.

Decoding is memory-bound, so its figure is bandwidth: bytes of K and V read per second,
against a NumPy streaming read (``np.sum`` of a 256 MiB float32 array, one thread) measured in
the same run, and against torch's SDPA on the same cache (laid out ``(B, H, S, D)``, torch's
preferred layout; ``enable_gqa`` for GQA), with a pause before each timed call (see
:data:`sdpa_numba.bench.PAUSE`). ``attention_with_kvcache`` reads the cache in FlashAttention's
``(B, S, H, D)`` layout. Latency of a tiny call is the median after an idle pause of 50 ms,
since that is what a serving loop sees (a parallel launch after an idle pause pays for waking
the thread pool).
"""

import statistics
import time
from dataclasses import dataclass

import numpy as np

from .bench import time_interleaved, torch_available


@dataclass(frozen=True)
class DecodeCase:
    """One decode step: ``B`` sequences of one new token, ``Hq`` query heads, ``H`` key/value
    heads, ``S`` cached keys of dim ``D``. ``tiny``: timed as the median after an idle pause."""

    batch: int
    heads_q: int
    heads_kv: int
    cache: int
    dim: int
    dtype: str = "float32"
    tiny: bool = False

    @property
    def label(self):
        heads = (f"H{self.heads_q}" if self.heads_q == self.heads_kv
                 else f"Hq{self.heads_q} H{self.heads_kv}")
        return (f"{'tiny' if self.tiny else 'decode'} B{self.batch} {heads} L1 S{self.cache} "
                f"D{self.dim} {self.dtype}")

    @property
    def kv_bytes(self):
        itemsize = np.dtype(self.dtype).itemsize
        return 2 * self.batch * self.heads_kv * self.cache * self.dim * itemsize


#: The decode cases of issue 16's targets.
DECODE = [DecodeCase(1, 32, 32, 8192, 128), DecodeCase(1, 32, 8, 16384, 128),
          DecodeCase(1, 1, 1, 512, 64, tiny=True)]
PRESETS = {"decode": DECODE}

#: Idle pause before each call of a tiny case, and the number of calls (the median is kept).
IDLE = 0.05
TINY_CALLS = 41


def read_bandwidth(nbytes=256 << 20, repeats=5):
    """Bytes per second of ``np.sum`` over a float32 array of ``nbytes`` (best of ``repeats``)."""
    a = np.ones(nbytes // 4, np.float32)
    a.sum()
    return nbytes / time_interleaved({"read": a.sum}, repeats, pause=0.05)["read"]


def prepare(case, seed=0):
    """``{impl: zero-argument callable returning the output as (B, Hq, D)}``."""
    from . import attention_with_kvcache

    rng = np.random.default_rng(seed)
    dt = np.dtype(case.dtype)
    q = rng.standard_normal((case.batch, 1, case.heads_q, case.dim)).astype(dt)
    k = rng.standard_normal((case.batch, case.cache, case.heads_kv, case.dim)).astype(dt)
    v = rng.standard_normal((case.batch, case.cache, case.heads_kv, case.dim)).astype(dt)
    seqlens = np.full(case.batch, case.cache, np.int32)
    fns = {"sdpa_numba": lambda: attention_with_kvcache(q, k, v, seqlens)[:, 0]}
    if torch_available():
        import torch

        tq = torch.from_numpy(q).transpose(1, 2)  # (B, Hq, 1, D)
        tk = torch.from_numpy(k).permute(0, 2, 1, 3).contiguous()  # (B, H, S, D)
        tv = torch.from_numpy(v).permute(0, 2, 1, 3).contiguous()
        gqa = case.heads_q != case.heads_kv
        f = torch.nn.functional.scaled_dot_product_attention

        def run_torch():
            with torch.inference_mode():
                return f(tq, tk, tv, enable_gqa=gqa)[:, :, 0].numpy()

        fns["torch"] = run_torch
    return fns


def median_after_idle(fns, calls=TINY_CALLS, idle=IDLE):
    """Median time of each callable, each call after ``idle`` seconds of rest (interleaved)."""
    times = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            time.sleep(idle)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(cases=DECODE, repeats=7, pause=None):
    """Time every case; return ``(read_bytes_per_s, results)``."""
    bw = read_bandwidth()
    results = []
    for case in cases:
        fns = prepare(case)
        outs = {name: np.asarray(fn(), np.float64) for name, fn in fns.items()}  # warm-up
        if case.tiny:
            best = median_after_idle(fns)
        else:
            best = time_interleaved(fns, repeats, pause)
        r = {"case": case.label, "kv_bytes": case.kv_bytes, "time_s": best,
             "gb_per_s": {n: case.kv_bytes / t / 1e9 for n, t in best.items()},
             "of_read_bandwidth": best and case.kv_bytes / best["sdpa_numba"] / bw,
             "timing": f"median after {IDLE * 1e3:.0f} ms idle" if case.tiny
                       else f"min of {repeats}"}
        if "torch" in best:
            r["speed_vs_torch"] = best["torch"] / best["sdpa_numba"]
            ref = outs["torch"]
            r["rel_err_vs_torch"] = float(np.linalg.norm(outs["sdpa_numba"] - ref)
                                          / max(np.linalg.norm(ref), 1e-300))
        results.append(r)
    return bw, results
