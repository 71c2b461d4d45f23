#!/usr/bin/env python
"""Ring attention against one process: P ranks x 1 thread vs 1 process x P threads.

Times, on the same cores, ``sdpa_numba.distributed.ring_attention`` (forward) and
``ring_attention_backward`` under ``mpiexec -n P`` with one Numba thread per rank, against
the dense ``scaled_dot_product_attention`` (and its backward) in one process with P threads,
for non-causal attention and causal attention in the zigzag (and contiguous) layout. The two
alternate (single process, then ranks, ``--rounds`` times) and each figure is the minimum;
the ranks' time is the slowest rank's, between barriers. It also times the exchange of one
key/value shard between ring neighbours (what one ring step sends) for the scaling model of
docs/distributed.md.

Figures printed: seconds, GFLOP/s (4 B H L S E for the forward, 8 B H L S E for the backward,
half when causal), the parallel efficiency (time of the P-thread process / time of the P
ranks: both use P cores), and causal per FLOP relative to non-causal.

Usage::

    python scripts/ring_bench.py                       # L 32768, H 8, D 64, float32, 2 ranks
    python scripts/ring_bench.py --L 8192 --ranks 2 --rounds 3
    python scripts/ring_bench.py --ranks 4 --L 16384 --no-single --json ring4.json

Needs mpi4py and an ``mpiexec`` (the ``mpi`` extra: MPICH's wheel puts it next to the
interpreter).
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: (name, is_causal, layout)
CONFIGS = [("non-causal", False, "contiguous"), ("causal zigzag", True, "zigzag"),
           ("causal contiguous", True, "contiguous")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--L", type=int, default=32768, help="sequence length (default 32768)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--D", type=int, default=64, help="head dim (default 64)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--ranks", type=int, default=2, help="P (default 2)")
    ap.add_argument("--threads", type=int, help="threads of the single process (default: "
                    "--ranks; fewer when the ranks oversubscribe the cores)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations (default 2)")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-single", action="store_true", help="only the ranks")
    ap.add_argument("--configs", default="non-causal,causal zigzag,causal contiguous")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: the rank's report path
    return ap.parse_args(argv)


def flops(args, causal, backward):
    f = (8 if backward else 4) * args.heads * args.L * args.L * args.D
    return f / 2 if causal else f


def inputs(args):
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.L, args.D)
    return [rng.standard_normal(shape, dtype=np.float32).astype(args.dtype) for _ in range(4)]


def configs(args):
    wanted = [c.strip() for c in args.configs.split(",")]
    return [c for c in CONFIGS if c[0] in wanted]


def single(args, threads):
    """The dense functions in this process with ``threads`` threads: {(config, dir): s}."""
    import numba

    import sdpa_numba

    numba.set_num_threads(threads)
    warm = np.ones((1, 1, 4, args.D), args.dtype)  # load the kernels before timing
    for causal in (False, True):
        o, lse = sdpa_numba.scaled_dot_product_attention(warm, warm, warm, is_causal=causal,
                                                         return_lse=True)
        sdpa_numba.scaled_dot_product_attention_backward(o, warm, warm, warm, o, lse,
                                                         is_causal=causal)
    q, k, v, g = inputs(args)
    out = {}
    seen = {}
    for name, causal, _layout in configs(args):
        if causal in seen:  # the layout does not matter in one process
            out[(name, "forward")], out[(name, "backward")] = seen[causal]
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        o, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                         return_lse=True)
        tf = (time.perf_counter() - t0, time.process_time() - c0)
        tb = (float("nan"), float("nan"))
        if not args.no_backward:
            t0, c0 = time.perf_counter(), time.process_time()
            sdpa_numba.scaled_dot_product_attention_backward(g, q, k, v, o, lse,
                                                             is_causal=causal)
            tb = (time.perf_counter() - t0, time.process_time() - c0)
        out[(name, "forward")], out[(name, "backward")] = seen[causal] = (tf, tb)
    return out


def worker(args):
    """One rank (run under mpiexec): times the ring functions; rank 0 writes the report."""
    from mpi4py import MPI

    from sdpa_numba.distributed import ring_attention, ring_attention_backward, shard

    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    warm = np.ones((1, 1, 4, args.D), args.dtype)  # load the kernels before timing
    for causal in (False, True):
        o, lse = ring_attention(warm, warm, warm, is_causal=causal, layout="zigzag",
                                return_lse=True)
        ring_attention_backward(o, warm, warm, warm, o, lse, is_causal=causal, layout="zigzag")
    q, k, v, g = inputs(args)
    report = {}
    for name, causal, layout in configs(args):
        ql, kl, vl, gl = (np.ascontiguousarray(shard(x, comm, layout)) for x in (q, k, v, g))
        # (wall time of the slowest rank, CPU time of all ranks together)
        comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        o, lse = ring_attention(ql, kl, vl, is_causal=causal, layout=layout, return_lse=True)
        report[f"{name}|forward"] = (
            comm.allreduce(time.perf_counter() - t0, op=MPI.MAX),
            comm.allreduce(time.process_time() - c0, op=MPI.SUM))
        if not args.no_backward:
            comm.Barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            ring_attention_backward(gl, ql, kl, vl, o, lse, is_causal=causal, layout=layout)
            report[f"{name}|backward"] = (
                comm.allreduce(time.perf_counter() - t0, op=MPI.MAX),
                comm.allreduce(time.process_time() - c0, op=MPI.SUM))
    # One ring step's transfer: this rank's K and V shards to rank + 1, from rank - 1.
    kl = np.ascontiguousarray(shard(k, comm))
    buf = np.empty_like(kl)
    best = float("inf")
    for _ in range(5):
        comm.Barrier()
        t0 = time.perf_counter()
        for _kv in range(2):  # K, then V (same shape here)
            comm.Sendrecv(kl, dest=(comm.rank + 1) % P, recvbuf=buf, source=(comm.rank - 1) % P)
        best = min(best, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    report["kv_shard_bytes"] = 2 * kl.nbytes
    report["kv_shard_transfer_s"] = best
    if comm.rank == 0:
        pathlib.Path(args.worker).write_text(json.dumps(report))


def mpiexec():
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec") or "mpiexec"


def ranks(args, argv):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ring.json")
        cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, str(__file__), *argv,
               "--worker", path]
        env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(cmd, check=True, env=env)
        raw = json.loads(pathlib.Path(path).read_text())
    return {tuple(k.split("|")) if "|" in k else k: v for k, v in raw.items()}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    import sdpa_numba  # noqa: F401 - compile or load the kernels once before timing

    threads = args.threads or args.ranks
    load_before = os.getloadavg()[0]
    best_single, best_ring = {}, {}
    inf = (float("inf"), float("inf"))
    for r in range(args.rounds):
        if not args.no_single:
            for key, t in single(args, threads).items():
                best_single[key] = tuple(map(min, best_single.get(key, inf), t))
            time.sleep(1)
        for key, t in ranks(args, argv).items():
            if isinstance(key, tuple):
                best_ring[key] = tuple(map(min, best_ring.get(key, inf), t))
            elif key == "kv_shard_transfer_s":
                best_ring[key] = min(best_ring.get(key, float("inf")), t)
            else:
                best_ring[key] = t
        time.sleep(1)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    rows = []
    print(f"L {args.L}, H {args.heads}, D {args.D}, {args.dtype}: {args.ranks} ranks x 1 thread"
          f" vs 1 process x {threads} threads (min of {args.rounds}); {os.cpu_count()} cores, "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'config':<20}{'dir':<10}{'1 proc s':>10}{'GFLOP/s':>9}{'ranks s':>10}{'GFLOP/s':>9}"
          f"{'efficiency':>12}{'1 proc CPU s':>14}{'ranks CPU s':>13}{'CPU-time eff.':>15}")
    for name, causal, _ in configs(args):
        for d in ("forward", "backward"):
            if (name, d) not in best_ring:
                continue
            f = flops(args, causal, d == "backward") / 1e9
            nan = (float("nan"), float("nan"))
            (ts, cs), (tr, cr) = best_single.get((name, d), nan), best_ring[(name, d)]
            rows.append({"config": name, "direction": d, "single_s": ts, "ranks_s": tr,
                         "single_gflops": f / ts, "ranks_gflops": f / tr,
                         "efficiency": ts / tr, "single_cpu_s": cs, "ranks_cpu_s": cr,
                         "cpu_efficiency": cs / cr})
            print(f"{name:<20}{d:<10}{ts:>10.2f}{f / ts:>9.1f}{tr:>10.2f}{f / tr:>9.1f}"
                  f"{ts / tr:>11.0%}{cs:>14.2f}{cr:>13.2f}{cs / cr:>14.0%}")
    for d in ("forward", "backward"):
        rate = {r["config"]: r["ranks_gflops"] for r in rows if r["direction"] == d}
        if "non-causal" in rate and "causal zigzag" in rate:
            line = (f"{d}: causal zigzag per FLOP = "
                    f"{rate['causal zigzag'] / rate['non-causal']:.0%} of non-causal")
            if "causal contiguous" in rate:
                line += f"; causal contiguous {rate['causal contiguous'] / rate['non-causal']:.0%}"
            print(line)
    nbytes, tt = best_ring["kv_shard_bytes"], best_ring["kv_shard_transfer_s"]
    print(f"one K/V shard ({nbytes / 1e6:.1f} MB) to the next rank: {tt * 1e3:.2f} ms "
          f"({nbytes / tt / 1e9:.1f} GB/s)")
    for r in rows:
        if r["direction"] == "forward" and r["config"] == "non-causal":
            step = r["ranks_s"] / args.ranks
            print(f"non-causal forward: one ring step computes in {step * 1e3:.0f} ms, "
                  f"{step / tt:.0f}x one shard's transfer")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "rows": rows,
             "kv_shard_bytes": nbytes, "kv_shard_transfer_s": tt}, indent=1))


if __name__ == "__main__":
    main()
