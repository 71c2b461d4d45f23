#!/usr/bin/env python
"""Chunked local attention's speed target, measured against our own dense forward in one
process (issue 31: L 8192, chunk 1024, time <= 1.25x its ideal).

Times ``scaled_dot_product_attention`` on B1, ``--heads``, L = S = ``--L``, ``--D`` float32
in interleaved rounds: dense, ``is_causal``, and ``is_causal`` with ``chunk=--chunk``. Prints
the chunked call's time over its ideal, the visited work
(:func:`sdpa_numba.tiles.visited_fraction`) at the dense rate, and over the causal call's time,
as the minimum over rounds and the median of the per-round ratios.

Usage::

    python scripts/chunk_ratio.py --threads 2 --rounds 3
"""

import argparse
import pathlib
import sys
import time

import numba
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's package


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None, help="default: Numba's")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.05)
    args = ap.parse_args(argv)

    from sdpa_numba import scaled_dot_product_attention as sdpa
    from sdpa_numba.tiles import visited_fraction

    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, args.heads, args.L, args.D)).astype(np.float32)
               for _ in range(3))
    fns = {"dense": lambda o: sdpa(q, k, v, out=o),
           "causal": lambda o: sdpa(q, k, v, is_causal=True, out=o),
           "chunk": lambda o: sdpa(q, k, v, is_causal=True, chunk=args.chunk, out=o)}
    outs = {n: np.empty_like(q) for n in fns}
    small = tuple(x[:, :, :128] for x in (q, k, v))
    sdpa(*small, is_causal=True, chunk=64)  # compile
    times = {n: [] for n in fns}
    for _ in range(args.rounds):
        for n, f in fns.items():
            time.sleep(args.pause)
            t0 = time.perf_counter()
            f(outs[n])
            times[n].append(time.perf_counter() - t0)
    visited = visited_fraction(args.L, args.L, None, 0, chunk=args.chunk)
    ideal = [visited * t for t in times["dense"]]
    vs_ideal = [c / i for c, i in zip(times["chunk"], ideal)]
    vs_causal = [c / x for c, x in zip(times["chunk"], times["causal"])]
    print(f"B1 H{args.heads} L=S={args.L} D{args.D} float32, chunk {args.chunk} causal; "
          f"{numba.get_num_threads()} threads; {args.rounds} interleaved rounds")
    for n in fns:
        print(f"  {n:7s} min {min(times[n]) * 1e3:9.1f} ms")
    print(f"  visited fraction of the scores {visited:.4f}; ideal (visited work at the dense "
          f"rate) {min(ideal) * 1e3:.1f} ms")
    print(f"  chunk time / ideal: min-based {min(times['chunk']) / min(ideal):.2f}, median of "
          f"rounds {float(np.median(vs_ideal)):.2f}")
    print(f"  chunk time / causal time: min-based "
          f"{min(times['chunk']) / min(times['causal']):.3f}, median of rounds "
          f"{float(np.median(vs_causal)):.3f}")


if __name__ == "__main__":
    main()
