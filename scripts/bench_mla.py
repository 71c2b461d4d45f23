#!/usr/bin/env python
"""Absorbed MLA decode (DeepSeek's multi-head latent attention) at memory bandwidth: one
decode step of ``Hq`` query heads over one latent key/value head, keys ``E = 576`` wide
(512 latent + 64 rotary), values the first ``Ev = 512`` columns of the same cache rows, as
``attention_with_kvcache`` takes them with ``v_cache = k_cache[..., :512]`` (a view, no copy).

Timed side by side (minimum of interleaved rounds, :mod:`sdpa_numba.bench.timing`):

* ``MLA, values a view of the keys``: the cache's bytes are those of ``k_cache`` alone;
* ``values a separate copy``: the same numbers with ``v_cache`` its own array (the bytes of
  both caches), to show what reading the shared rows once saves;
* NumPy's streaming read of 256 MiB (:class:`sdpa_numba.bench.decode.StreamingRead`, the
  decode preset's reference) in the same rounds.

Prints each call's time, its GB/s counting each cache byte once, and that rate as a % of the
read. Run from the repository root with ``PYTHONPATH=.`` to time the working tree::

    python scripts/bench_mla.py [--hq 16] [--seq 16384] [--page-size 64] [--rounds 7]
        [--threads N]
"""

import argparse

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=64, help="0: a contiguous cache")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)

    from sdpa_numba.bench.timing import set_threads, time_interleaved

    threads = set_threads(a.threads, torch_too=False)
    from sdpa_numba import attention_with_kvcache
    from sdpa_numba.bench.decode import StreamingRead

    e, ev, s, ps = 576, 512, a.seq, a.page_size
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, a.hq, e)).astype(np.float32)
    lens = np.array([s])
    if ps:
        n_pages = -(-s // ps)
        kc = rng.standard_normal((n_pages, ps, 1, e)).astype(np.float32)
        table = rng.permutation(n_pages).astype(np.int32)[None]
    else:
        kc = rng.standard_normal((1, s, 1, e)).astype(np.float32)
        table = None
    vc_view = kc[..., :ev]
    vc_copy = np.ascontiguousarray(vc_view)
    scale = 1 / np.sqrt(e)  # what absorbed MLA folds in is the model's choice; any number
    fns = {
        "MLA, values a view of the keys": lambda: attention_with_kvcache(
            q, kc, vc_view, lens, block_table=table, scale=scale),
        "values a separate copy": lambda: attention_with_kvcache(
            q, kc, vc_copy, lens, block_table=table, scale=scale),
    }
    results = {name: fn() for name, fn in fns.items()}  # compiles, warms
    read = StreamingRead(threads=threads)
    try:
        best = time_interleaved({**fns, **read.fns}, a.rounds)
        read_bps = read.bytes_per_s(best)
    finally:
        read.close()
    nbytes = {"MLA, values a view of the keys": s * e * 4,
              "values a separate copy": s * (e + ev) * 4}
    layout = f"pages of {ps}" if ps else "contiguous"
    print(f"MLA decode B1 Hq{a.hq} H1 S{s} E{e} Ev{ev} float32, {layout}, {threads} "
          f"thread{'s' if threads > 1 else ''}; NumPy read {read_bps / 1e9:.1f} GB/s in the "
          f"same rounds")
    for name in fns:
        t = best[name]
        bps = nbytes[name] / t
        print(f"  {name:32s} {t * 1e3:8.3f} ms  {nbytes[name] / 1e6:7.1f} MB  "
              f"{bps / 1e9:6.1f} GB/s  {100 * bps / read_bps:4.0f}% of read")
    diff = np.abs(results["MLA, values a view of the keys"] - results["values a separate copy"])
    print(f"  the two outputs: max |diff| {diff.max():.1e}")


if __name__ == "__main__":
    main()
