"""Decode benchmarks, for ``python -m sdpa_numba bench --preset decode``.

Decoding is memory-bound, so its figure is bandwidth: bytes of K and V read per second, against
a NumPy streaming read on as many threads as the kernels run (:class:`StreamingRead`: each
thread reduces its part of a 256 MiB float32 array) timed in the same interleaved rounds as the
case, and against torch's SDPA on the same cache (laid out ``(B, H, S, D)``, torch's preferred
layout; ``enable_gqa`` for GQA), with a pause before each timed call (see
:data:`sdpa_numba.bench.timing.PAUSE`). ``attention_with_kvcache`` reads the cache in
FlashAttention's ``(B, S, H, D)`` layout. Latency of a tiny call is the median after an idle
pause of 50 ms, since that is what a serving loop sees (a parallel launch after an idle pause
pays for waking the thread pool).
"""

import statistics
import time
from dataclasses import dataclass

import numpy as np

from .timing import time_interleaved, torch_available


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
    #: A paged cache of this page size (shuffled pages) for sdpa_numba; 0: contiguous.
    page_size: int = 0
    #: Ragged batch: cache lengths spaced evenly from 128 to ``cache`` (torch: the padded
    #: batch with a mask).
    ragged: bool = False
    #: Also time sdpa_numba on one thread (the split-KV speedup).
    one_thread: bool = False
    #: A quantized cache of this format (:mod:`sdpa_numba.quant`; q8_0 with float16 scales),
    #: timed against our float32 and float16 caches of the same tokens; "": a float cache.
    quant: str = ""

    def lengths(self):
        if self.ragged and self.batch > 1:
            return np.linspace(128, self.cache, self.batch).astype(np.int64)
        return np.full(self.batch, self.cache, np.int64)

    @property
    def label(self):
        heads = (f"H{self.heads_q}" if self.heads_q == self.heads_kv
                 else f"Hq{self.heads_q} H{self.heads_kv}")
        cache = f"S128..{self.cache}" if self.ragged else f"S{self.cache}"
        return (f"{'tiny' if self.tiny else 'decode'} B{self.batch} {heads} L1 {cache} "
                f"D{self.dim} {self.dtype}"
                + (f" paged {self.page_size}" if self.page_size else "")
                + (f" {self.quant} cache" if self.quant else ""))

    @property
    def kv_bytes(self):
        """Bytes of keys and values read (a quantized cache's with its scales)."""
        per_value = np.dtype(self.dtype).itemsize
        keys = int(self.lengths().sum()) * self.heads_kv
        if self.quant:
            scales = {"int8": 4 * 2, "q8_0": 2 * 2 * self.dim // 32}.get(self.quant, 0)
            return keys * (2 * self.dim + scales)
        return 2 * keys * self.dim * per_value


#: The decode cases of issue 16's targets.
DECODE = [DecodeCase(1, 32, 32, 8192, 128), DecodeCase(1, 32, 8, 16384, 128),
          DecodeCase(1, 1, 1, 512, 64, tiny=True)]
#: Paged against contiguous, a ragged batch, and split-KV on one long sequence.
DECODE_MORE = [DecodeCase(1, 32, 32, 8192, 128, page_size=16),
               DecodeCase(16, 8, 2, 8192, 128, ragged=True),
               DecodeCase(1, 1, 1, 1 << 20, 128, one_thread=True)]
#: Quantized caches (issue 29): every format on decode's MHA and GQA cases, float32 queries.
DECODE_QUANT = [DecodeCase(1, hq, h, s, 128, quant=f) for hq, h, s in ((32, 32, 8192),
                                                                       (32, 8, 16384))
                for f in ("int8", "q8_0", "e4m3fn", "e5m2")]
PRESETS = {"decode": DECODE, "decode-more": DECODE_MORE, "decode-quant": DECODE_QUANT}

#: Idle pause before each call of a tiny case, and the number of calls (the median is kept).
IDLE = 0.05
TINY_CALLS = 41


#: Bytes of the NumPy streaming read that decode's bandwidth is compared with.
READ_BYTES = 256 << 20


class StreamingRead:
    """NumPy's streaming read of ``nbytes`` of float32, split in ``threads`` parts (default:
    Numba's thread count, what the kernels run on) reduced at once in as many Python threads
    (NumPy releases the GIL): ``fns`` holds the read by ``np.sum`` and by ``np.max``. One
    thread read less than the decode kernel on two (over 100% of it), so the reference reads
    with the same cores. ``np.sum``'s pairwise summation is compute-bound on some CPUs (9 GB/s
    of CPU time against 17 for ``np.max``), which would flatter every ratio to it: the
    reference is the faster of the two."""

    def __init__(self, nbytes=None, threads=None):
        from concurrent.futures import ThreadPoolExecutor

        import numba

        self.nbytes = READ_BYTES if nbytes is None else nbytes
        threads = numba.get_num_threads() if threads is None else threads
        self.parts = np.array_split(np.ones(self.nbytes // 4, np.float32), threads)
        self.pool = ThreadPoolExecutor(threads)
        self.fns = {f"read {name}": self._reader(reduce)
                    for name, reduce in (("sum", np.sum), ("max", np.max))}
        for fn in self.fns.values():
            fn()

    def _reader(self, reduce):
        return lambda: list(self.pool.map(reduce, self.parts))

    def bytes_per_s(self, best):
        """The read's bytes per second from ``best``, times of :attr:`fns` among others."""
        return self.nbytes / min(best[name] for name in self.fns)

    def close(self):
        self.pool.shutdown()


def read_bandwidth(nbytes=None, repeats=5, threads=None):
    """Bytes per second of :class:`StreamingRead` (best of ``repeats``)."""
    read = StreamingRead(nbytes, threads)
    try:
        return read.bytes_per_s(time_interleaved(read.fns, repeats, pause=0.05))
    finally:
        read.close()


def read_label(threads):
    """What :func:`read_bandwidth` measured, for the bench's header line."""
    return (f"NumPy streaming read (the faster of np.sum and np.max of 256 MiB float32, "
            f"{threads} thread{'s' if threads > 1 else ''} each reducing its part)")


def prepare(case, seed=0):
    """``{impl: zero-argument callable returning the output as (B, Hq, D)}``."""
    from .. import attention_with_kvcache

    rng = np.random.default_rng(seed)
    dt = np.dtype(case.dtype)
    q = rng.standard_normal((case.batch, 1, case.heads_q, case.dim)).astype(dt)
    k = rng.standard_normal((case.batch, case.cache, case.heads_kv, case.dim)).astype(dt)
    v = rng.standard_normal((case.batch, case.cache, case.heads_kv, case.dim)).astype(dt)
    seqlens = case.lengths()
    k_cache, v_cache, table = k, v, None
    if case.page_size:  # the same keys in shuffled pages
        ps = case.page_size
        per = -(-case.cache // ps)
        order = rng.permutation(case.batch * per)
        table = order.reshape(case.batch, per).astype(np.int32)
        k_cache = np.empty((case.batch * per, ps, case.heads_kv, case.dim), dt)
        v_cache = np.empty_like(k_cache)
        pad = per * ps - case.cache
        kp = np.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(case.batch * per, ps,
                                                                  case.heads_kv, case.dim)
        vp = np.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(case.batch * per, ps,
                                                                  case.heads_kv, case.dim)
        k_cache[order] = kp
        v_cache[order] = vp
    fns = {"sdpa_numba": lambda: attention_with_kvcache(q, k_cache, v_cache, seqlens,
                                                        block_table=table)[:, 0]}
    if case.quant:
        fns = _quantized(case, q, k, v, seqlens)
    if case.one_thread:
        import numba

        def one_thread():
            n = numba.get_num_threads()
            numba.set_num_threads(1)
            try:
                return attention_with_kvcache(q, k_cache, v_cache, seqlens)[:, 0]
            finally:
                numba.set_num_threads(n)

        fns["sdpa_numba 1 thread"] = one_thread
    if torch_available():
        import torch

        tq = torch.from_numpy(q).transpose(1, 2)  # (B, Hq, 1, D)
        tk = torch.from_numpy(k).permute(0, 2, 1, 3).contiguous()  # (B, H, S, D)
        tv = torch.from_numpy(v).permute(0, 2, 1, 3).contiguous()
        gqa = case.heads_q != case.heads_kv
        mask = None
        if case.ragged:  # the padded batch: keys past each length masked out
            mask = torch.from_numpy(np.arange(case.cache)[None, :] < seqlens[:, None])
            mask = mask[:, None, None, :]
        f = torch.nn.functional.scaled_dot_product_attention

        def run_torch():
            with torch.inference_mode():
                return f(tq, tk, tv, attn_mask=mask, enable_gqa=gqa)[:, :, 0].numpy()

        fns["torch"] = run_torch
    return fns


def _quantized(case, q, k, v, seqlens):
    """A quantized case's callables: ``sdpa_numba`` on the quantized cache, and on float32
    and float16 caches of the same tokens (float32 queries: the float16 cache's queries are
    cast in the call, as a float16 model would hold them)."""
    from .. import attention_with_kvcache, quantize_kv

    sd = np.float16 if case.quant == "q8_0" else np.float32
    kq, ks = quantize_kv(k, case.quant, scale_dtype=sd)
    vq, vs = quantize_kv(v, case.quant, scale_dtype=sd)
    k16, v16, q16 = k.astype(np.float16), v.astype(np.float16), q.astype(np.float16)
    return {"sdpa_numba": lambda: attention_with_kvcache(q, kq, vq, seqlens, k_scale=ks,
                                                         v_scale=vs)[:, 0],
            "float32 cache": lambda: attention_with_kvcache(q, k, v, seqlens)[:, 0],
            "float16 cache": lambda: attention_with_kvcache(q16, k16, v16, seqlens)[:, 0]}


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
    """Time every case; return ``(read_bytes_per_s, results)``: the read before the cases,
    and per case its figures. A case's share of the read (``of_read_bandwidth``) is against
    the read timed in the case's own interleaved rounds (``read_bytes_per_s``; a tiny case:
    the read before the cases): on a shared machine the bandwidth left to us moves by 10-20%
    within a minute, and a reference timed minutes before would move every share with it."""
    bw = read_bandwidth()
    read = StreamingRead()
    results = []
    try:
        for case in cases:
            results.append(_run_case(case, repeats, pause, read, bw))
    finally:
        read.close()
    return bw, results


def _run_case(case, repeats, pause, read, bw):
    """The figures of ``case``; ``read``'s functions join its interleaved rounds (a
    :class:`StreamingRead`), ``bw`` is the read timed before the cases."""
    fns = prepare(case)
    outs = {name: np.asarray(fn(), np.float64) for name, fn in fns.items()}  # warm-up
    if case.tiny:
        best = median_after_idle(fns)
        case_bw = bw
    else:
        best = time_interleaved({**read.fns, **fns}, repeats, pause)
        case_bw = read.bytes_per_s(best)
        best = {name: t for name, t in best.items() if name not in read.fns}
    r = {"case": case.label, "kv_bytes": case.kv_bytes, "time_s": best,
         "gb_per_s": {n: case.kv_bytes / t / 1e9 for n, t in best.items()},
         "read_bytes_per_s": case_bw,
         "of_read_bandwidth": best and case.kv_bytes / best["sdpa_numba"] / case_bw,
         "timing": f"median after {IDLE * 1e3:.0f} ms idle" if case.tiny
                   else f"min of {repeats}"}
    if "sdpa_numba 1 thread" in best:
        r["speedup_vs_one_thread"] = best["sdpa_numba 1 thread"] / best["sdpa_numba"]
    for name in ("float32 cache", "float16 cache"):
        if name in best:
            r["speed_vs_" + name.replace(" ", "_")] = best[name] / best["sdpa_numba"]
    if "float32 cache" in outs:  # the quantized cache's output error against the float one
        ref = outs["float32 cache"]
        r["rel_err_vs_float32_cache"] = float(np.linalg.norm(outs["sdpa_numba"] - ref)
                                              / max(np.linalg.norm(ref), 1e-300))
    if "torch" in best:
        r["speed_vs_torch"] = best["torch"] / best["sdpa_numba"]
        ref = outs["torch"]
        r["rel_err_vs_torch"] = float(np.linalg.norm(outs["sdpa_numba"] - ref)
                                      / max(np.linalg.norm(ref), 1e-300))
    return r
