#!/usr/bin/env python
"""Shared-prefix (cascade) attention against per-request paged decode, side by side in one
process (issue 31's case by default): ``B`` requests sharing a ``P``-token prefix, each with
``S`` tokens of its own, one decode step, ``Hq`` query heads over ``H`` key/value heads.

Timed (minimum of interleaved rounds, a pause before each call, :mod:`sdpa_numba.bench.timing`):

* ``cascade``: :func:`sdpa_numba.cascade_attention` (the prefix one contiguous copy, the
  suffixes in shuffled pages);
* ``per-request``: ``B`` independent :func:`sdpa_numba.attention_with_kvcache` calls, each
  over its request's full cache (prefix + suffix) in shuffled pages;
* ``batched, shared pages``: one paged call for the batch whose block tables point at the
  prefix's pages shared (each prefix key still read once per request).

Run from the repository root with ``PYTHONPATH=.`` to time the working tree. Also prints
the bytes each reads (cascade: the prefix once and the suffixes) as GB/s, and the
largest difference of the outputs. Usage::

    python scripts/bench_cascade.py [--batch 16] [--prefix 4096] [--suffix 256] [--hq 32]
        [--h 8] [--dim 128] [--page-size 16] [--rounds 7] [--threads N]
"""

import argparse

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--h", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)

    from sdpa_numba.bench.timing import set_threads, time_interleaved

    threads = set_threads(a.threads, torch_too=False)
    from sdpa_numba import attention_with_kvcache, cascade_attention

    rng = np.random.default_rng(0)
    b, p, s, hq, h, d, ps = a.batch, a.prefix, a.suffix, a.hq, a.h, a.dim, a.page_size
    f32 = np.float32
    q = rng.standard_normal((b, 1, hq, d)).astype(f32)
    pk = rng.standard_normal((p, h, d)).astype(f32)
    pv = rng.standard_normal((p, h, d)).astype(f32)
    sk = rng.standard_normal((b, s, h, d)).astype(f32)
    sv = rng.standard_normal((b, s, h, d)).astype(f32)

    def paged(x, order):
        """``x (B, n, H, D)`` in the pages ``order`` (one row of pages per request)."""
        n = x.shape[1]
        per = -(-n // ps)
        c = np.empty((order.size, ps, h, d), f32)
        c[order.reshape(-1)] = np.pad(x, ((0, 0), (0, per * ps - n), (0, 0), (0, 0))).reshape(
            -1, ps, h, d)
        return c

    s_per = -(-s // ps)
    s_table = rng.permutation(b * s_per).reshape(b, s_per).astype(np.int32)
    skc, svc = paged(sk, s_table), paged(sv, s_table)
    suffix_lens = np.full(b, s)

    full_k = np.concatenate([np.broadcast_to(pk, (b, p, h, d)), sk], 1)
    full_v = np.concatenate([np.broadcast_to(pv, (b, p, h, d)), sv], 1)
    f_per = -(-(p + s) // ps)
    f_table = rng.permutation(b * f_per).reshape(b, f_per).astype(np.int32)
    fkc, fvc = paged(full_k, f_table), paged(full_v, f_table)
    full_lens = np.full(b, p + s)

    # Shared pages: the prefix's pages once (p a multiple of ps), each request's own after.
    shared = None
    if p % ps == 0:
        p_per = p // ps
        sh_k = np.concatenate([pk.reshape(p_per, ps, h, d), skc])
        sh_v = np.concatenate([pv.reshape(p_per, ps, h, d), svc])
        shared = (sh_k, sh_v, np.concatenate([np.arange(p_per)[None].repeat(b, 0),
                                              p_per + s_table], 1).astype(np.int32))

    fns = {
        "cascade": lambda: cascade_attention(q, pk, pv, skc, svc, suffix_lens,
                                             block_table=s_table),
        "per-request": lambda: np.concatenate([
            attention_with_kvcache(q[i:i + 1], fkc, fvc, full_lens[i:i + 1],
                                   block_table=f_table[i:i + 1]) for i in range(b)]),
    }
    if shared is not None:
        fns["batched, shared pages"] = lambda: attention_with_kvcache(
            q, shared[0], shared[1], full_lens, block_table=shared[2])
    results = {name: fn() for name, fn in fns.items()}  # compiles, warms
    ref = results["per-request"]
    best = time_interleaved(fns, a.rounds)
    itemsize = 4
    read = {"cascade": (p + b * s) * h * 2 * d * itemsize}
    read["per-request"] = read["batched, shared pages"] = b * (p + s) * h * 2 * d * itemsize
    print(f"B{b} prefix {p} suffix {s} Hq{hq} H{h} D{d} float32, page size {ps}, "
          f"{threads} thread{'s' if threads > 1 else ''}")
    for name, t in best.items():
        print(f"  {name:22s} {t * 1e3:8.2f} ms  {read[name] / t / 1e9:6.1f} GB/s of keys "
              f"and values read  per-request / this {best['per-request'] / t:5.2f}x  "
              f"max |diff| {np.abs(results[name] - ref).max():.1e}")


if __name__ == "__main__":
    main()
