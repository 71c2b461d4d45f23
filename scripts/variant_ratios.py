#!/usr/bin/env python
"""The variants' speed targets, measured against our own dense forward in one process.

Times ``scaled_dot_product_attention`` on B1, ``--heads``, L = S = ``--L``, ``--D`` float32 in
interleaved rounds (a pause before each call, so that every call starts from the same idle
thread pool): dense, ``softcap=``, ``is_causal`` with ``window=(--window, 0)``, and
``is_causal`` with ``chunk=--chunk`` (chunked local attention). Prints three figures, each as the minimum over rounds and as the median of the per-round ratios (the
calls of one round ran seconds apart, so a machine whose speed drifts moves both alike):

* soft cap: its speed over the dense speed (the target: >= 0.90);
* window: its time over the ideal, the visited work (:func:`sdpa_numba.tiles.visited_fraction`)
  at the dense rate (the target: <= 1.25);
* chunk: its time over its ideal, likewise (the target: <= 1.25 at L 8192, chunk 1024:
  ``--L 8192 --chunk 1024``).

Usage::

    python scripts/variant_ratios.py --rounds 20
    python scripts/variant_ratios.py --threads 1 --rounds 10 --clock cpu
"""

import argparse
import time

import numba
import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="default: Numba's")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.05)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (time.process_time), which a core taken "
                         "by another process does not count: with --threads 1, the kernel's "
                         "own time on a shared machine")
    args = ap.parse_args(argv)

    from sdpa_numba import scaled_dot_product_attention as sdpa
    from sdpa_numba.tiles import visited_fraction

    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, args.heads, args.L, args.D)).astype(np.float32)
               for _ in range(3))
    outs = {n: np.empty_like(q) for n in ("dense", "softcap", "window", "chunk")}
    fns = {"dense": lambda o: sdpa(q, k, v, out=o),
           "softcap": lambda o: sdpa(q, k, v, softcap=args.softcap, out=o),
           "window": lambda o: sdpa(q, k, v, is_causal=True, window=(args.window, 0), out=o),
           "chunk": lambda o: sdpa(q, k, v, is_causal=True, chunk=args.chunk, out=o)}
    for n, f in fns.items():  # compile and warm up
        f(outs[n])
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times = {n: [] for n in fns}
    for _ in range(args.rounds):
        for n, f in fns.items():
            time.sleep(args.pause)
            t0 = clock()
            f(outs[n])
            times[n].append(clock() - t0)
    t = {n: np.array(x) for n, x in times.items()}
    frac = visited_fraction(args.L, args.L, args.window, 0)
    cap_speed = t["dense"] / t["softcap"]
    chunk_frac = visited_fraction(args.L, args.L, None, 0, chunk=args.chunk)
    print(f"B1 H{args.heads} L{args.L} D{args.D} float32, {numba.get_num_threads()} threads, "
          f"{args.rounds} rounds, {args.clock} clock; min ms: " + ", ".join(
              f"{n} {x.min() * 1e3:.2f}" for n, x in t.items()))
    print(f"softcap={args.softcap:g} speed / dense: min-based "
          f"{t['dense'].min() / t['softcap'].min():.3f}, median of rounds "
          f"{np.median(cap_speed):.3f} (quartiles {np.quantile(cap_speed, 0.25):.3f}.."
          f"{np.quantile(cap_speed, 0.75):.3f})")
    for name, label, f in (("window", f"causal window {args.window}", frac),
                           ("chunk", f"causal chunk {args.chunk}", chunk_frac)):
        ideal = t[name] / (f * t["dense"])
        print(f"{label} time / ideal (visited {f:.4f} at the dense rate): min-based "
              f"{t[name].min() / (f * t['dense'].min()):.3f}, median of rounds "
              f"{np.median(ideal):.3f} (quartiles {np.quantile(ideal, 0.25):.3f}.."
              f"{np.quantile(ideal, 0.75):.3f})")


if __name__ == "__main__":
    main()
