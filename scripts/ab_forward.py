#!/usr/bin/env python
"""In-process A/B of the serial CPU forward: a git revision against the working tree.

On a shared machine two runs of the same command differ by 10-20%, so a kernel change worth a
few percent cannot be judged by two separate benchmark runs. This script loads both versions
of the package into one process (copied under the names ``sdpa_old`` and ``sdpa_new``; the
package imports itself relatively), runs ``sdpa_numba.cpu.forward_head`` (or, with
``--backward``, ``sdpa_numba.cpu.backward``) on one thread for each in alternation, keeps each
one's minimum and median, and checks that both give the same output (dQ for the backward).
With ``--api`` it times ``scaled_dot_product_attention`` (or
``scaled_dot_product_attention_backward``) instead, on ``(1, H, L, D)`` NumPy inputs with all
of Numba's threads (``--threads``), optionally with ``--softcap`` or ``--window``: what
``python -m sdpa_numba bench`` times, launch layer included.

Read the median of the per-round ratios (each round times both copies back to back), with its
quartiles: on a 2-core machine shared with other jobs, a 2-thread call stalls whenever another
process takes a core, and the minimum is one lucky call. An A/A test (``main`` against an
unchanged tree, ``--api --heads 8 --L 2048``, 2 threads, 30 rounds) read 0.728, 0.991 and
0.967 by the minima in three runs, 0.997 and 0.999 by the median of the ratios (quartiles
0.97..1.04). ``--order new,old`` swaps which copy is imported and called first.

Usage::

    python scripts/ab_forward.py HEAD~1 --L 1024 --D 64 --rounds 200
    python scripts/ab_forward.py main --D 128 --causal --dtype float64
    python scripts/ab_forward.py HEAD~1 --backward
    python scripts/ab_forward.py HEAD~1 --api --heads 4 --L 4096 --D 128
    python scripts/ab_forward.py HEAD~1 --api --backward --heads 8 --L 2048 --causal
    python scripts/ab_forward.py main --api --heads 8 --L 2048 --softcap 50 --threads 1
    python scripts/ab_forward.py main --api --heads 8 --L 2048 --causal --window 256

The copies live in a temporary folder, so the first call of each compiles (seconds).
"""

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git revision to compare the working tree with")
    ap.add_argument("--L", type=int, default=1024, help="L = S (default 1024)")
    ap.add_argument("--D", type=int, default=64, help="head dim (default 64)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float16", "bfloat16", "float32",
                                                                  "float64"))
    ap.add_argument("--rounds", type=int, default=100, help="alternations (default 100)")
    ap.add_argument("--backward", action="store_true",
                    help="time the backward (one head; FLOPs 8 L S D) instead of the forward")
    ap.add_argument("--api", action="store_true",
                    help="time the public function on (1, H, L, D) with all threads")
    ap.add_argument("--heads", type=int, default=4, help="H for --api (default 4)")
    ap.add_argument("--order", default="old,new", choices=("old,new", "new,old"),
                    help="which copy is imported, compiled and called first in each round")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds of sleep before each timed call (default 0)")
    ap.add_argument("--times", action="store_true", help="print every round's two times")
    ap.add_argument("--softcap", type=float, default=None, help="--api: softcap= (default none)")
    ap.add_argument("--window", type=int, default=None,
                    help="--api: window=(WINDOW, 0) (with --causal: a causal sliding window)")
    ap.add_argument("--threads", type=int, default=None,
                    help="--api: Numba threads (default: all)")
    return ap.parse_args(argv)


def _copy_packages(rev, where):
    archive = os.path.join(where, "old.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", ROOT, "archive", rev, "sdpa_numba"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(os.path.join(where, "old"), filter="data")
    shutil.move(os.path.join(where, "old", "sdpa_numba"), os.path.join(where, "sdpa_old"))
    shutil.copytree(os.path.join(ROOT, "sdpa_numba"), os.path.join(where, "sdpa_new"),
                    ignore=shutil.ignore_patterns("__pycache__"))


def _stored(a):
    """What the CPU kernels take: float16 as its uint16 bits, bfloat16 as its int16 bits."""
    if a.dtype.name == "bfloat16":
        return a.view(np.int16)
    return a.view(np.uint16) if a.dtype == np.float16 else a


def _loaded(a):
    if a.dtype == np.int16:
        from ml_dtypes import bfloat16
        a = a.view(bfloat16)
    return (a.view(np.float16) if a.dtype == np.uint16 else a).astype(np.float64)


def main(argv=None):
    args = parse_args(argv)
    import numba

    if not args.api:
        numba.set_num_threads(1)
    elif args.threads:
        numba.set_num_threads(args.threads)
    variants = {}
    if args.softcap is not None:
        variants["softcap"] = args.softcap
    if args.window is not None:
        variants["window"] = (args.window, 0 if args.causal else None)
    heads = args.heads if args.api else 1
    with tempfile.TemporaryDirectory() as where:
        _copy_packages(args.rev, where)
        sys.path.insert(0, where)
        pkgs = {name: importlib.import_module(f"sdpa_{name}.cpu")
                for name in args.order.split(",")}
        rng = np.random.default_rng(0)
        if args.dtype == "bfloat16":
            from ml_dtypes import bfloat16
            dt = np.dtype(bfloat16)
        else:
            dt = np.dtype(args.dtype)
        q, k, v = (rng.standard_normal((1, heads, args.L, args.D)).astype(dt) for _ in range(3))
        if not args.api:
            q, k, v = (_stored(x) for x in (q, k, v))
        ct = np.float64 if dt == np.float64 else np.float32
        scale = 1 / np.sqrt(args.D)
        if args.api and args.backward:
            apis = {name: importlib.import_module(f"sdpa_{name}") for name in pkgs}
            out, lse = apis["new"].scaled_dot_product_attention(q, k, v, is_causal=args.causal,
                                                                return_lse=True)
            dout = rng.standard_normal(q.shape).astype(dt)
            calls = {name: (lambda cpu, res, name=name: res.__setitem__(0, apis[
                name].scaled_dot_product_attention_backward(
                    dout, q, k, v, out, lse, is_causal=args.causal)[0])) for name in pkgs}
            outs = {name: [None] for name in pkgs}
        elif args.api:
            apis = {name: importlib.import_module(f"sdpa_{name}") for name in pkgs}
            calls = {name: (lambda cpu, res, name=name: apis[name].scaled_dot_product_attention(
                q, k, v, is_causal=args.causal, out=res[0], **variants)) for name in pkgs}
            outs = {name: (np.empty_like(q),) for name in pkgs}
        elif args.backward:  # the working tree's forward gives both backwards their out, lse
            out, lse = np.empty_like(q), np.empty((1, 1, args.L), ct)  # q: stored dtype
            pkgs["new"].forward(q, k, v, None, args.causal, scale, out, lse)
            dout = _stored(rng.standard_normal(q.shape).astype(dt))
            calls = {name: (lambda cpu, res: cpu.backward(
                q, k, v, None, args.causal, scale, dout, out, lse, *res)) for name in pkgs}
            outs = {name: tuple(np.empty(q.shape, ct) for _ in range(3)) for name in pkgs}
        else:
            calls = {name: (lambda cpu, res: cpu.forward_head(
                q[0, 0], k[0, 0], v[0, 0], None, args.causal, scale, *res)) for name in pkgs}
            outs = {name: (np.empty((args.L, args.D), q.dtype), np.empty(args.L, ct))
                    for name in pkgs}
        for name, cpu in pkgs.items():  # compile and warm up
            calls[name](cpu, outs[name])
        times = {name: [] for name in pkgs}
        for _ in range(args.rounds):
            for name, cpu in pkgs.items():
                if args.pause:
                    time.sleep(args.pause)
                t0 = time.perf_counter()
                calls[name](cpu, outs[name])
                times[name].append(time.perf_counter() - t0)
        best = {name: min(t) for name, t in times.items()}
        median = {name: np.median(t) for name, t in times.items()}
        pair = np.array(times["old"]) / np.array(times["new"])
    flops = ((8 if args.backward else 4) * heads * args.L * args.L * args.D
             / (2 if args.causal else 1))
    diff = np.max(np.abs(_loaded(outs["old"][0]) - _loaded(outs["new"][0])))
    what = "backward" if args.backward else "forward"
    what += "".join(f" {n}={x}" for n, x in variants.items())
    print(f"{what} L=S={args.L} D={args.D} {args.dtype}{' causal' if args.causal else ''}, "
          f"{f'H={heads}, API, {numba.get_num_threads()} threads' if args.api else '1 thread'}, "
          f"min of {args.rounds} alternations (and medians): "
          f"{args.rev} {flops / best['old'] / 1e9:.1f} "
          f"GFLOP/s, working tree {flops / best['new'] / 1e9:.1f} GFLOP/s "
          f"(new/old speed {best['old'] / best['new']:.3f}; of the medians "
          f"{median['old'] / median['new']:.3f}; median of the per-round ratios "
          f"{np.median(pair):.3f}, quartiles {np.quantile(pair, 0.25):.3f}.."
          f"{np.quantile(pair, 0.75):.3f}); max |difference| {diff:.2e}; "
          f"V starts {v.ctypes.data % 64} bytes into a cache line; order {args.order}")
    if args.times:
        for a, b in zip(times["old"], times["new"]):
            print(f"{a * 1e3:8.2f} {b * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
