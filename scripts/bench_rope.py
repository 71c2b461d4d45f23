#!/usr/bin/env python
"""The cost of rotary embedding on append: one decode step of ``attention_with_kvcache`` with
``rotary_cos`` / ``rotary_sin`` against the same step without them (both append one new key),
timed in alternation; and the compile time of the rotation pass.

Usage::

    python scripts/bench_rope.py                      # B1 Hq32 H8 S8192 D128 float32, 2 threads
    python scripts/bench_rope.py --calls 40 --threads 2 --B 1 --Hq 32 --H 8 --S 8192 --D 128
    python scripts/bench_rope.py --compile            # compile time of the rotation pass only

Prints the median (and minimum) time of each over ``--calls`` alternating pairs and their
ratio (rotation / none). ``--compile`` compiles the rotation pass for float32 into an empty
Numba cache directory (a cold compile) and prints the seconds it took.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

# This checkout's package, not an installed one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile_time():
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_rope_")
    import numpy as np  # noqa: F401
    from numba import types

    from sdpa_numba.cpu import rope

    for st in (types.float32, types.float64):
        t = time.perf_counter()
        rope._entry(st)
        print(f"rotation pass compile ({st}): {time.perf_counter() - t:.2f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--Hq", type=int, default=32)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--interleaved", action="store_true")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    if a.compile:
        _compile_time()
        return
    os.environ.setdefault("NUMBA_NUM_THREADS", str(a.threads))
    import numba
    import numpy as np

    import sdpa_numba

    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    f32 = np.float32
    q = rng.standard_normal((a.B, 1, a.Hq, a.D)).astype(f32)
    kc = rng.standard_normal((a.B, a.S, a.H, a.D)).astype(f32)
    vc = rng.standard_normal((a.B, a.S, a.H, a.D)).astype(f32)
    k = rng.standard_normal((a.B, 1, a.H, a.D)).astype(f32)
    v = rng.standard_normal((a.B, 1, a.H, a.D)).astype(f32)
    lens = np.full(a.B, a.S - 1)  # the new key fills the cache: S keys read
    ang = np.arange(a.S)[:, None] * 10000.0 ** (-np.arange(a.D // 2) / (a.D // 2))
    cos, sin = np.cos(ang).astype(f32), np.sin(ang).astype(f32)
    rot = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=a.interleaved)

    def call(kw):
        t = time.perf_counter()
        sdpa_numba.attention_with_kvcache(q, kc, vc, lens, k=k, v=v, **kw)
        return time.perf_counter() - t

    for _ in range(3):  # compile and warm up both
        call({}), call(rot)
    plain, rotated = [], []
    for i in range(a.calls):  # ABBA: neither always runs first
        if i % 2:
            rotated.append(call(rot))
            plain.append(call({}))
        else:
            plain.append(call({}))
            rotated.append(call(rot))
    mp, mr = statistics.median(plain), statistics.median(rotated)
    print(f"B{a.B} Hq{a.Hq} H{a.H} S{a.S} D{a.D} float32, 1 new token, {a.threads} threads, "
          f"{a.calls} alternating (ABBA) pairs")
    print(f"without rotation: median {mp * 1e3:.3f} ms (min {min(plain) * 1e3:.3f})")
    print(f"with rotation:    median {mr * 1e3:.3f} ms (min {min(rotated) * 1e3:.3f})")
    print(f"ratio (median): {mr / mp:.3f}; (min): {min(rotated) / min(plain):.3f}")

    # The added work alone (less exposed to a loaded machine than whole steps): the plan's
    # extra checks and row gathering, and the rotation pass over q and k.
    from sdpa_numba.cpu.rope import rotate

    def med(fn):
        ts = []
        for _ in range(a.calls):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    plan_plain = med(lambda: sdpa_numba.kvcache_plan(q, kc, vc, lens, k=k, v=v))
    plan_rot = med(lambda: sdpa_numba.kvcache_plan(q, kc, vc, lens, k=k, v=v, **rot))
    r = sdpa_numba.kvcache_plan(q, kc, vc, lens, k=k, v=v, **rot).problem.rope
    rot_q = med(lambda: rotate(q, r.q_cos, r.q_sin, r.interleaved))
    rot_k = med(lambda: rotate(k, r.k_cos, r.k_sin, r.interleaved))
    added = plan_rot - plan_plain + rot_q + rot_k
    print(f"added work: plan {(plan_rot - plan_plain) * 1e6:.1f} us, rotation of q "
          f"{rot_q * 1e6:.1f} us and k {rot_k * 1e6:.1f} us; (step min + added) / step min = "
          f"{(min(plain) + added) / min(plain):.3f}")


if __name__ == "__main__":
    sys.exit(main())
