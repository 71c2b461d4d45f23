#!/usr/bin/env python
"""Host cost of one layer's decode call: a reused plan's ``run`` against the compiled decode
kernel alone, called with the plan's prepared arguments, in one process.

The issue's bar: at B1 Hq32 H8 S1024 D128 float32 (contiguous cache, no append, 2 threads) a
layer's ``plan.run`` costs at most 25 us above the kernel alone. Printed, as medians of many
calls timed in alternation (the machine is shared: the kernel's own time moves by more than the
host cost from run to run, so the differences of medians are noisy):

* ``kernel``: the compiled entry point called directly (what ``plan.run`` ends in);
* ``plan.run``, ``plan.run(out=)``: the reused plan, with a new result array or a buffer;
* ``attention_with_kvcache``: the one-shot call (a plan made and run at every call);
* ``host only``: ``plan.run`` of a plan whose kernel is a Python no-op, the host path alone
  (steady: no kernel time in it), in wall time and in the calling thread's CPU time (the
  steadiest where other processes share the cores).

``--profile`` adds cProfile's view of ``plan.run`` (host only), where the cost goes.

Usage::

    python scripts/decode_host_cost.py                 # the issue's case
    python scripts/decode_host_cost.py --case 1,32,8,256,128 --calls 4000 --profile
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import numba
import numpy as np

# This checkout's package, not an installed one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="1,32,8,1024,128", help="B,Hq,H,S,D (1,32,8,1024,128)")
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (2)")
    ap.add_argument("--calls", type=int, default=2000, help="calls of each, alternated (2000)")
    ap.add_argument("--profile", action="store_true", help="cProfile plan.run's host path")
    args = ap.parse_args(argv)

    import sdpa_numba
    from sdpa_numba.cpu import launch_decode
    from sdpa_numba.cpu.launch import recipe_type

    numba.set_num_threads(args.threads)
    B, Hq, H, S, D = map(int, args.case.split(","))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
    kc = rng.standard_normal((B, S, H, D)).astype(np.float32)
    vc = rng.standard_normal((B, S, H, D)).astype(np.float32)
    lens = np.full(B, S, np.int64)
    out = np.empty((B, 1, Hq, D), np.float32)

    plan = sdpa_numba.kvcache_plan(q, kc, vc, lens)
    p = plan.problem
    parallel = p.read_bytes >= launch_decode.SERIAL_BYTES
    fn = launch_decode.entry(parallel, p.dtype, recipe_type(p.recipe))
    lse = np.empty(p.lse_shape, p.compute_dtype)
    res = np.empty(p.out_shape, p.dtype)
    kernel_args = (q, kc, vc, p.table, p.kv_lens, p.is_causal, p.scale, res, lse, p.recipe,
                   p.lo)

    # The same plan with a Python no-op for a kernel: the host path alone.
    real_entry = launch_decode.entry
    launch_decode.entry = lambda *a: (lambda *args: None)
    try:
        host_plan = sdpa_numba.kvcache_plan(q, kc, vc, lens)
    finally:
        launch_decode.entry = real_entry

    calls = {
        "kernel": lambda: fn(*kernel_args),
        "plan.run": lambda: plan.run(q, kc, vc),
        "plan.run(out=)": lambda: plan.run(q, kc, vc, out=out),
        "attention_with_kvcache": lambda: sdpa_numba.attention_with_kvcache(q, kc, vc, lens),
        "host only": lambda: host_plan.run(q, kc, vc),
        "host only (out=)": lambda: host_plan.run(q, kc, vc, out=out),
    }
    for f in calls.values():
        f()
    np.testing.assert_array_equal(plan.run(q, kc, vc),
                                  sdpa_numba.attention_with_kvcache(q, kc, vc, lens))
    times = {n: [] for n in calls}
    cpu, cpu_out = [], []
    clock = time.perf_counter
    for _ in range(args.calls):
        for n, f in calls.items():
            t0 = clock()
            f()
            times[n].append(clock() - t0)
        t0 = time.thread_time()
        host_plan.run(q, kc, vc)
        cpu.append(time.thread_time() - t0)
        t0 = time.thread_time()
        host_plan.run(q, kc, vc, out=out)
        cpu_out.append(time.thread_time() - t0)
    med = {n: statistics.median(t) * 1e6 for n, t in times.items()}
    print(f"B{B} Hq{Hq} H{H} S{S} D{D} float32, contiguous, no append, "
          f"{args.threads} threads ({'parallel' if parallel else 'serial'} kernel), "
          f"median of {args.calls} alternated calls (wall time; in brackets, the median of "
          f"each round's difference to the kernel's call):")
    for n in calls:
        extra = ""
        if not n.startswith(("kernel", "host only")):
            paired = statistics.median(a - b for a, b in zip(times[n], times["kernel"]))
            extra = f"  {med[n] - med['kernel']:+.1f} us  [{paired * 1e6:+.1f} us]"
        print(f"  {n:24s} {med[n]:8.1f} us{extra}")
    for n, t in (("host only", cpu), ("host only (out=)", cpu_out)):
        print(f"  {n + ', CPU time':24s} {statistics.median(t) * 1e6:8.1f} us "
              f"(the calling thread's time.thread_time)")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            host_plan.run(q, kc, vc)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
