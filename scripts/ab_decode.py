#!/usr/bin/env python
"""In-process A/B of the CPU decode kernel (``sdpa_numba.cpu.decode``): a git revision
against the working tree, on one thread (``decode_serial``) or all (``--par``).

Both versions are loaded into one process as ``sdpa_old`` and ``sdpa_new`` (as
``scripts/ab_forward.py`` does) and timed in alternation after a pause; each case prints the
minimum and median of each and the new/old speed. The compiled functions are called
directly, not through their dispatchers: through them, the copy imported second paid ~0.3 ms
more a call with the same source (an A/A test read 0.55x in one import order, 1.8x in the
other), which swamped any kernel change. ``--order new,old`` imports the working tree first.

Usage::

    python scripts/ab_decode.py T=1,12,4,2080,64,bhsd G=1,32,8,1024,128
    python scripts/ab_decode.py --order new,old --rev HEAD~1 P=1,32,32,2048,128,fa,16
    python scripts/ab_decode.py --cpu M=1,32,32,8192,128   # CPU time, on a shared machine

A case is ``name=B,Hq,H,S,D[,layout[,page_size[,Lq]]]``: layout ``fa`` (the cache
``(B, S, H, D)``), ``ragged`` (the same, cache lengths ``np.linspace(128, S, B)``, as the
bench's ragged case) or ``bhsd`` (transformers' ``(B, H, S, D)`` viewed as ``(B, S, H, D)``);
page_size > 0 pages the cache in shuffled pages; Lq > 1 is causal.
"""

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_forward import _copy_packages  # noqa: E402  (the two copies of the package)


def _cache(rng, spec):
    """``(q, k_cache, v_cache, block_table, kv_lens, Lq)`` of a case's spec."""
    f = spec.split(",")
    B, Hq, H, S, D = map(int, f[:5])
    layout = f[5] if len(f) > 5 else "fa"
    page = int(f[6]) if len(f) > 6 else 0
    lq = int(f[7]) if len(f) > 7 else 1
    q = rng.standard_normal((B, lq, Hq, D)).astype(np.float32)
    if layout == "bhsd":
        k, v = (rng.standard_normal((B, H, S, D)).astype(np.float32).transpose(0, 2, 1, 3)
                for _ in range(2))
    else:
        k, v = (rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(2))
    table = np.arange(B, dtype=np.int32).reshape(B, 1)
    if page:
        per = -(-S // page)
        order = rng.permutation(B * per)
        table = order.reshape(B, per).astype(np.int32)
        pad = ((0, 0), (0, per * page - S), (0, 0), (0, 0))
        caches = []
        for x in (k, v):
            c = np.empty((B * per, page, H, D), np.float32)
            c[order] = np.pad(x, pad).reshape(B * per, page, H, D)
            caches.append(c)
        k, v = caches
    lens = np.full(B, S, np.int64)
    if layout == "ragged":
        lens = np.linspace(128, S, B).astype(np.int64)
    return q, k, v, table, lens, lq


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", help="name=B,Hq,H,S,D[,layout[,page_size[,Lq]]]")
    ap.add_argument("--rev", default="main", help="the revision to compare with (main)")
    ap.add_argument("--order", default="old,new", help="import order (see above)")
    ap.add_argument("--rounds", type=int, default=40, help="alternations (40)")
    ap.add_argument("--par", action="store_true", help="the parallel kernel, all threads")
    ap.add_argument("--cpu", action="store_true",
                    help="time the calling thread's CPU time (time.thread_time), not wall time: "
                    "one thread only; steadier where other processes share the cores")
    args = ap.parse_args(argv)
    import numba

    if args.cpu and args.par:
        ap.error("--cpu times one thread: not with --par")
    clock = time.thread_time if args.cpu else time.perf_counter
    if not args.par:
        numba.set_num_threads(1)
    where = tempfile.mkdtemp()
    try:
        _copy_packages(args.rev, where)
        sys.path.insert(0, where)
        pkgs = {n: (importlib.import_module(f"sdpa_{n}.cpu.decode"),
                    importlib.import_module(f"sdpa_{n}.problem.variants"))
                for n in args.order.split(",")}
        rng = np.random.default_rng(0)
        for case in args.cases:
            name, spec = case.split("=")
            q, kc, vc, table, lens, lq = _cache(rng, spec)
            B, _, Hq, D = q.shape
            lo = np.zeros(B, np.int64)
            calls, outs = {}, {}
            for n, (dec, var) in pkgs.items():
                r = var.variants_recipe((B,), Hq, lq, lq, np.float32, lq > 1,
                                        alignment="top_left")
                out = np.full((B, lq, Hq, D), np.nan, np.float32)
                lse = np.empty((B, Hq, lq), np.float32)
                fn = dec.decode if args.par else dec.decode_serial
                fn(q, kc, vc, table, lens, lq > 1, D ** -0.5, out, lse, r, lo)
                # The compiled function itself: through the dispatcher, the copy imported
                # second paid ~0.3 ms a call (its arguments' types looked up anew).
                fn = fn.overloads[fn.signatures[-1]].entry_point
                calls[n] = (lambda fn=fn, r=r, out=out, lse=lse: fn(
                    q, kc, vc, table, lens, lq > 1, D ** -0.5, out, lse, r, lo))
                outs[n] = out
                calls[n]()
            times = {n: [] for n in pkgs}
            for _ in range(args.rounds):
                for n in pkgs:
                    time.sleep(0.01)
                    calls[n]()  # one warm call: back-to-back, as a model's layers
                    t0 = clock()
                    calls[n]()
                    times[n].append(clock() - t0)
            nbytes = 2 * kc.shape[2] * kc.shape[3] * 4 * int(lens.sum())
            lo_t = {n: min(t) for n, t in times.items()}
            med = {n: statistics.median(t) for n, t in times.items()}
            diff = float(np.abs(outs["old"] - outs["new"]).max())
            how = ("parallel" if args.par else "1 thread") + (", CPU time" if args.cpu else "")
            print(f"{name} {spec} ({how}, order {args.order}): " + " | ".join(
                      f"{n} min {lo_t[n] * 1e3:.3f} med {med[n] * 1e3:.3f} ms "
                      f"({nbytes / lo_t[n] / 1e9:.1f} GB/s)" for n in ("old", "new"))
                  + f" | new/old speed {lo_t['old'] / lo_t['new']:.3f} (medians "
                  f"{med['old'] / med['new']:.3f}); max |difference| {diff:.1e}", flush=True)
    finally:
        shutil.rmtree(where)


if __name__ == "__main__":
    main()
