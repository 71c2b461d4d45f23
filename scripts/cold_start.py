"""The README's run command (``python -m sdpa_numba``: the default check) on a cold Numba cache,
as a fresh clone sees it, and then warm (a second process on that cache).

Each run is a new process with ``NUMBA_CACHE_DIR`` set to a new empty folder, so nothing
compiled before is reused; the figures are the check's own "first call" (compile or cache
load, then the call) and the whole process's wall time. ``--vs ROOT`` runs a second source
tree's command in turn with this one's (A B A B ...), for a comparison that holds while the
machine's speed drifts. ``--events`` breaks one cold run down by compiled function (Numba's
``numba:compile`` events: CPU seconds of the compiling thread, inclusive of the functions
compiled while compiling it, and exclusive of them), with the wall time the LLVM lock was held;
CPU times are the figures to compare on a shared machine (compiling runs on one thread).

    python scripts/cold_start.py --runs 3
    python scripts/cold_start.py --runs 3 --vs /path/to/other/checkout
    python scripts/cold_start.py --events --runs 1 --vs /path/to/other/checkout -- -L 256 --heads 1
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(root, cache_dir, args):
    """One process of ``python -m sdpa_numba check --json`` in ``root`` on ``cache_dir``:
    (first call s, process wall s, process CPU s). On a busy machine the CPU time (user +
    system) moves much less than the wall times: compiling runs on one thread."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=root)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "sdpa_numba", "check", "--json", *args],
                         cwd=root, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if res.returncode != 0:
        raise SystemExit(f"{root}: exit {res.returncode}\n{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout)["first_call_s"], wall, cpu


def compile_times():
    """Listen to Numba's ``numba:compile`` events from now on: ``(incl, excl, count)``, dicts by
    function name of the compiling thread's CPU seconds, inclusive and exclusive of the
    functions compiled while compiling it, and of the number of compiles (filled as they run)."""
    import collections

    from numba.core import event

    stack = []
    incl = collections.defaultdict(float)
    excl = collections.defaultdict(float)
    count = collections.Counter()

    class Compile(event.Listener):
        def on_start(self, ev):
            d = ev.data.get("dispatcher")
            name = getattr(getattr(d, "py_func", None), "__qualname__", str(d))
            stack.append([name, time.thread_time(), 0.0])

        def on_end(self, ev):
            name, t0, child = stack.pop()
            dt = time.thread_time() - t0
            incl[name] += dt
            excl[name] += dt - child
            count[name] += 1
            if stack:
                stack[-1][2] += dt

    event.register("numba:compile", Compile())
    return incl, excl, count


def _events_child(check_args):
    """In a cold child process: run the check with listeners on Numba's compile events and
    print a JSON breakdown (per function: inclusive and exclusive seconds, count) to stderr's
    last line."""
    from numba.core import event

    incl, excl, count = compile_times()
    lock = [0.0, 0.0]

    class Lock(event.Listener):
        def on_start(self, ev):
            lock[1] = time.perf_counter()

        def on_end(self, ev):
            lock[0] += time.perf_counter() - lock[1]

    event.register("numba:llvm_lock", Lock())
    from sdpa_numba.cli import main as cli_main

    rc = cli_main(["check", "--json", *check_args])
    ru = resource.getrusage(resource.RUSAGE_SELF)
    doc = {"rc": rc, "cpu_s": ru.ru_utime + ru.ru_stime, "llvm_lock_s": lock[0],
           "functions": [[k, incl[k], excl[k], count[k]] for k in incl]}
    print(json.dumps(doc), file=sys.stderr)
    sys.exit(rc)


def events(root, check_args, top):
    """One cold run of source tree ``root`` with the per-function breakdown printed (this
    script's listeners, whichever tree is run)."""
    with tempfile.TemporaryDirectory(prefix="cold_start_") as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d, PYTHONPATH=root)
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--events-child",
                              "--", *check_args], cwd=root, env=env, capture_output=True,
                             text=True, check=False)
        wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"exit {res.returncode}\n{res.stdout}\n{res.stderr}")
    doc = json.loads(res.stderr.strip().splitlines()[-1])
    first = json.loads(res.stdout)["first_call_s"]
    print(f"{root}: cold first call {first:.2f} s; process {wall:.2f} s wall, {doc['cpu_s']:.2f} s CPU; "
          f"LLVM lock held {doc['llvm_lock_s']:.2f} s; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'exclusive':>10} {'inclusive':>10} {'count':>6}  compiled function (CPU s)")
    for name, inc, exc, n in sorted(doc["functions"], key=lambda f: -f[2])[:top]:
        print(f"{exc:10.2f} {inc:10.2f} {n:6d}  {name}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--events-child":
        _events_child(sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="cold runs per tree (default 3)")
    p.add_argument("--vs", default=None, help="a second source tree, run in turn with this one")
    p.add_argument("--events", action="store_true",
                   help="cold runs (--runs per tree), each broken down by compiled function "
                        "(Numba's events)")
    p.add_argument("--top", type=int, default=25, help="functions listed by --events")
    p.add_argument("check_args", nargs="*", help="arguments of the check (default: none)")
    a = p.parse_args()
    roots = [HERE] + ([os.path.abspath(a.vs)] if a.vs else [])
    if a.events:
        for i in range(a.runs):
            for r in roots:
                events(r, a.check_args, a.top)
        return
    cold = {r: [] for r in roots}
    warm = {r: [] for r in roots}
    for i in range(a.runs):
        for r in roots:
            with tempfile.TemporaryDirectory(prefix="cold_start_") as d:
                cold[r].append(one_run(r, d, a.check_args))
                warm[r].append(one_run(r, d, a.check_args))
            c, w = cold[r][-1], warm[r][-1]
            print(f"run {i + 1} {r}: cold first call {c[0]:.2f} s (process {c[1]:.2f} s wall, "
                  f"{c[2]:.2f} s CPU), warm first call {w[0]:.3f} s (process {w[1]:.2f} s "
                  f"wall, {w[2]:.2f} s CPU)", flush=True)
    for r in roots:
        c, w = ([statistics.median(x[k] for x in runs) for k in range(3)]
                for runs in (cold[r], warm[r]))
        print(f"{r}: median of {a.runs}: cold first call {c[0]:.2f} s (process {c[1]:.2f} s "
              f"wall, {c[2]:.2f} s CPU); warm first call {w[0]:.3f} s (process {w[1]:.2f} s "
              f"wall, {w[2]:.2f} s CPU)")
    if a.vs:
        for k, what in ((0, "first call"), (2, "process CPU")):
            ratios = [x[k] / y[k] for x, y in zip(cold[roots[0]], cold[roots[1]])]
            print(f"cold {what}, this tree / --vs, per pair: "
                  f"{', '.join(f'{x:.2f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
