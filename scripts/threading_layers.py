#!/usr/bin/env python
"""The CPU kernels' time under Numba's threading layers (tbb, omp, workqueue), side by side.

Each round starts one process per layer (``NUMBA_THREADING_LAYER``), in turn, that times the
dense forward, the dense backward and the decode (``attention_with_kvcache``) through the
public functions, all threads, and two small calls whose time is mostly the layer's launch
cost (a one-row forward, B1 H1 L1 S512 D64, and one decode step, B1 H8 D128 over 512 cached
keys, each timed over ``--small-reps`` calls), and prints each one's median; the driver
reports, per kernel and layer, the median over the rounds of its time divided by TBB's time in
the same round (alternating processes, so that a busy neighbour on a shared machine hits every layer alike).
A layer that does not load (``tbb`` without the wheel on the path) is reported as missing.

Usage::

    python scripts/threading_layers.py --rounds 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import json, sys, time
    import numba
    import numpy as np
    import sdpa_numba

    reps, small_reps = int(sys.argv[1]), int(sys.argv[2])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 2048, 64)).astype(np.float32) for _ in range(3))
    qb, kb, vb = (x[:, :, :1024] for x in (q, k, v))
    o, lse = sdpa_numba.scaled_dot_product_attention(qb, kb, vb, return_lse=True)
    dq = rng.standard_normal((8, 1, 32, 128)).astype(np.float32)
    kc = rng.standard_normal((8, 2048, 8, 128)).astype(np.float32)
    vc = rng.standard_normal((8, 2048, 8, 128)).astype(np.float32)
    lens = np.full(8, 2048, np.int32)
    q1, k1, v1 = (rng.standard_normal((1, 1, n, 64)).astype(np.float32) for n in (1, 512, 512))
    dq1 = rng.standard_normal((1, 1, 8, 128)).astype(np.float32)
    kc1 = rng.standard_normal((1, 512, 8, 128)).astype(np.float32)
    vc1 = rng.standard_normal((1, 512, 8, 128)).astype(np.float32)
    lens1 = np.full(1, 512, np.int32)
    calls = {
        "forward": lambda: sdpa_numba.scaled_dot_product_attention(q, k, v),
        "backward": lambda: sdpa_numba.scaled_dot_product_attention_backward(
            o, qb, kb, vb, o, lse),
        "decode": lambda: sdpa_numba.attention_with_kvcache(dq, kc, vc, lens),
        "small_fwd": lambda: sdpa_numba.scaled_dot_product_attention(q1, k1, v1),
        "small_dec": lambda: sdpa_numba.attention_with_kvcache(dq1, kc1, vc1, lens1),
    }
    res = {}
    for name, f in calls.items():
        f()  # compile / load
        t = []
        for _ in range(small_reps if name.startswith("small") else reps):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
        res[name] = float(np.median(t))
    res["layer"] = numba.threading_layer()
    print(json.dumps(res))
""")


NAMES = ("forward", "backward", "decode", "small_fwd", "small_dec")


def run(layer, reps, small_reps):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["NUMBA_THREADING_LAYER"] = layer
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", CHILD, str(reps), str(small_reps)], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per kernel and process")
    ap.add_argument("--small-reps", type=int, default=200,
                    help="timed calls per small call and process")
    ap.add_argument("--layers", default="tbb,omp,workqueue")
    a = ap.parse_args()
    layers = a.layers.split(",")
    rows = {lay: [] for lay in layers}
    for _ in range(a.rounds):
        for lay in layers:
            rows[lay].append(run(lay, a.reps, a.small_reps))
    base = layers[0]
    print(f"median time (ms) and median per-round ratio to {base}, {a.rounds} rounds, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")
    for name in NAMES:
        cells = []
        for lay in layers:
            got = [r for r in rows[lay] if r is not None]
            if not got:
                cells.append(f"{lay}: missing")
                continue
            ms = statistics.median(r[name] for r in got) * 1e3
            ratios = [r[name] / b[name] for r, b in zip(rows[lay], rows[base])
                      if r is not None and b is not None]
            ratio = f" x{statistics.median(ratios):.3f}" if ratios else ""
            cells.append(f"{lay}: {ms:.3f}{ratio}")
        print(f"{name:9s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
