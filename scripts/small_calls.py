#!/usr/bin/env python
"""The small-call benchmark: the host cost of one call, above its kernel.

    python scripts/small_calls.py [--repeats 3] [--pause 0.02] [--threads N] [--json]

Issue 33's small calls: one query row against 512 keys (B1 H1 L1 S512 D64, float32), where the
kernel's arithmetic takes microseconds and the host's work around it (validation, views,
planning, dispatch) is what a caller waits for. For each public function it prints, measured in
one process, side by side:

* ``call``: the public function, as a user calls it;
* ``kernel``: the compiled kernel alone, called with the very arguments the launcher passed it
  on its last call (the launcher's ``_entry`` is wrapped to record them: this reaches into the
  CPU launchers, which is why it is a script and not a preset of the CLI, whose benchmarks
  call the public functions only);
* ``host``: ``call - kernel`` (the difference of the medians: noisy where the kernel's own
  time moves);
* ``host only``: the public function with every kernel replaced by a Python no-op (the host
  path alone, steadier than the difference; it includes calling the no-op, ~0.1 us);
* torch's ``scaled_dot_product_attention`` for the dense forward.

Timing: blocks of :data:`CALLS` back-to-back calls of each callable, the callables alternated
block by block for ``rounds`` rounds with ``pause`` seconds of rest before each block; the
median of all calls is kept (after a warm-up of each).
"""

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

import numpy as np

#: Calls per block (back to back), and rounds per repeat of ``--repeats``.
CALLS = 50
ROUNDS_PER_REPEAT = 4
#: The case: batch, heads, query rows, keys, head dim.
B, H, L, S, D = 1, 1, 1, 512, 64


def _inputs(seed=0):
    rng = np.random.default_rng(seed)

    def f(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return f


def cases():
    """``{name: (call, launch_module)}``: the public calls of the preset, each a zero-argument
    callable, and the launcher module whose ``_entry`` gives its kernels."""
    import sdpa_numba as sn
    from sdpa_numba.cpu import launch, launch_backward, launch_merge, launch_varlen

    f = _inputs()
    q, k, v = f(B, H, L, D), f(B, H, S, D), f(B, H, S, D)
    out, lse = sn.scaled_dot_product_attention(q, k, v, return_lse=True)
    g = f(B, H, L, D)
    # varlen: one sequence of L query rows and S keys, packed (total, H, D)
    vq, vk, vv = f(L, H, D), f(S, H, D), f(S, H, D)
    cu_q, cu_k = np.array([0, L], np.int32), np.array([0, S], np.int32)
    # merge: two states of the dense output's shape
    oa, la = out, lse
    ob, lb = sn.scaled_dot_product_attention(q, f(B, H, S, D), f(B, H, S, D), return_lse=True)
    return {
        "forward": (lambda: sn.scaled_dot_product_attention(q, k, v), launch),
        "backward": (lambda: sn.scaled_dot_product_attention_backward(g, q, k, v, out, lse),
                     launch_backward),
        "varlen": (lambda: sn.varlen_attention(vq, vk, vv, cu_q, cu_k), launch_varlen),
        "merge": (lambda: sn.merge_attention_states(oa, la, ob, lb), launch_merge),
    }, (q, k, v)


class _Recorder:
    """A compiled entry point that records the arguments of its last call."""

    def __init__(self, entry):
        self.entry = entry
        self.args = None

    def __call__(self, *args):
        self.args = args
        return self.entry(*args)


@contextmanager
def _patched_entry(module, make):
    """``module._entry`` returning ``make(entry)`` for each entry it gives."""
    names = ["_entry"]
    real = {n: getattr(module, n) for n in names}
    for n in names:
        setattr(module, n, lambda *a, _real=real[n]: make(_real(*a)))
    try:
        yield
    finally:
        for n in names:
            setattr(module, n, real[n])


def kernel_call(call, module):
    """A zero-argument callable that runs the kernel(s) ``call`` launched last, with the same
    arguments, and nothing else."""
    recorders = []

    def make(entry):
        r = _Recorder(entry)
        recorders.append(r)
        return r

    with _patched_entry(module, make):
        call()
    calls = [(r.entry, r.args) for r in recorders if r.args is not None]
    if len(calls) == 1:
        (entry, args), = calls
        return lambda: entry(*args)
    return lambda: [entry(*args) for entry, args in calls]


def host_only_call(call, module):
    """``call`` with its kernels replaced by a Python no-op: the host path alone (the
    launcher's lookup of its compiled entry included)."""
    def run():
        with _patched_entry(module, _as_noop):
            call()
    # The patching itself is timed too: measure it alone and subtract it.
    return run


def _noop(*args):
    return None


def _as_noop(entry):
    return _noop


def _patch_cost():
    from sdpa_numba.cpu import launch

    def run():
        with _patched_entry(launch, _as_noop):
            pass
    return run


def median_blocks(fns, rounds, pause, calls=CALLS):
    """Median time of a call of each callable: ``rounds`` rounds of a block of ``calls``
    back-to-back calls of each, alternated, ``pause`` seconds of rest before each block."""
    for fn in fns.values():  # warm-up
        for _ in range(calls):
            fn()
    times = {name: [] for name in fns}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name, fn in fns.items():
            if pause:
                time.sleep(pause)
            ts = times[name]
            for _ in range(calls):
                t0 = clock()
                fn()
                ts.append(clock() - t0)
    return {name: statistics.median(ts) * 1e-9 for name, ts in times.items()}


def run(repeats, pause):
    """The preset's measurements: ``{"case": ..., "rows": [{"function", "call_s", "kernel_s",
    "host_s", "host_only_s", "torch_s"}]}``."""
    import numba

    fns_by_case, (q, k, v) = cases()
    rounds = max(1, repeats * ROUNDS_PER_REPEAT)
    torch_fn = None
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_torch():
            with torch.no_grad():
                return sdpa(tq, tk, tv)
        torch_fn = run_torch
    patch = _patch_cost()
    rows = []
    for name, (call, module) in fns_by_case.items():
        fns = {"call": call, "kernel": kernel_call(call, module),
               "host_only": host_only_call(call, module), "patch": patch}
        if name == "forward" and torch_fn is not None:
            fns["torch"] = torch_fn
        t = median_blocks(fns, rounds, pause)
        rows.append({"function": name, "call_s": t["call"], "kernel_s": t["kernel"],
                     "host_s": t["call"] - t["kernel"],
                     "host_only_s": max(t["host_only"] - t["patch"], 0.0),
                     "torch_s": t.get("torch")})
    return {"case": f"B{B} H{H} L{L} S{S} D{D} float32", "threads": numba.get_num_threads(),
            "calls_per_block": CALLS, "rounds": rounds, "pause_s": pause, "rows": rows}


def format_result(res):
    """The table of :func:`run`'s result."""
    us = lambda x: "-" if x is None else f"{x * 1e6:.1f}"  # noqa: E731
    lines = [f"small calls, {res['case']}: median of {res['rounds']} rounds x "
             f"{res['calls_per_block']} back-to-back calls (us)",
             f"{'function':<10} {'call':>8} {'kernel':>8} {'host':>8} {'host only':>10} "
             f"{'torch':>8}"]
    for r in res["rows"]:
        lines.append(f"{r['function']:<10} {us(r['call_s']):>8} {us(r['kernel_s']):>8} "
                     f"{us(r['host_s']):>8} {us(r['host_only_s']):>10} {us(r['torch_s']):>8}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3,
                    help=f"rounds, in units of {ROUNDS_PER_REPEAT} (default 3)")
    ap.add_argument("--pause", type=float, default=0.02,
                    help="seconds of rest before each block of calls (default 0.02)")
    ap.add_argument("--threads", type=int, help="Numba's (and torch's) thread count")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if args.threads is not None:
        import numba

        numba.set_num_threads(args.threads)
        try:
            import torch

            torch.set_num_threads(args.threads)
        except ImportError:
            pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None and load > 1.0:
        print(f"warning: load average {load:.1f} before the run: timings will be noisy",
              file=sys.stderr)
    res = run(args.repeats, args.pause)
    res["load_average_1min_before"] = load
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['threads']} threads")
        print(format_result(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
