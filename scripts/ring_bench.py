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

The ranks talk over MPI (``mpiexec``, an mpi4py communicator) or over torch.distributed
(``torchrun``, a gloo process group): ``--transport mpi,torch`` times both, alternating with
the single process in each round, and prints one table per transport.

Usage::

    python scripts/ring_bench.py                       # L 32768, H 8, D 64, float32, 2 ranks
    python scripts/ring_bench.py --L 8192 --ranks 2 --rounds 3
    python scripts/ring_bench.py --ranks 4 --L 16384 --no-single --json ring4.json
    python scripts/ring_bench.py --L 8192 --transport mpi,torch   # MPI and gloo side by side

Needs mpi4py and an ``mpiexec`` (the ``mpi`` extra: MPICH's wheel puts it next to the
interpreter) for ``mpi``, torch for ``torch``.
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
    ap.add_argument("--transport", default="mpi",
                    help="mpi, torch, or both as mpi,torch (default mpi)")
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


class MPIRanks:
    """What the worker needs of its communicator, over mpi4py (under mpiexec)."""

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()

    def barrier(self):
        self.comm.Barrier()

    def max(self, x):
        return self.comm.allreduce(x, op=self.MPI.MAX)

    def sum(self, x):
        return self.comm.allreduce(x, op=self.MPI.SUM)

    def sendrecv(self, send, recv):
        self.comm.Sendrecv(send, dest=(self.rank + 1) % self.size, recvbuf=recv,
                           source=(self.rank - 1) % self.size)


class TorchRanks:
    """The same over torch.distributed (under torchrun: a gloo group from the environment)."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        self.torch, self.dist, self.comm = torch, dist, dist.group.WORLD
        self.size, self.rank = dist.get_world_size(), dist.get_rank()

    def barrier(self):
        self.dist.barrier()

    def _reduce(self, x, op):
        t = self.torch.tensor([x], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=op)
        return float(t[0])

    def max(self, x):
        return self._reduce(x, self.dist.ReduceOp.MAX)

    def sum(self, x):
        return self._reduce(x, self.dist.ReduceOp.SUM)

    def sendrecv(self, send, recv):
        works = [self.dist.irecv(self.torch.from_numpy(recv), (self.rank - 1) % self.size),
                 self.dist.isend(self.torch.from_numpy(send), (self.rank + 1) % self.size)]
        for w in works:
            w.wait()


def worker(args):
    """One rank (under mpiexec or torchrun): times the ring functions; rank 0 writes the
    report."""
    from sdpa_numba.distributed import ring_attention, ring_attention_backward, shard

    ranks = MPIRanks() if args.transport == "mpi" else TorchRanks()
    try:
        _time_ring(args, ranks, ring_attention, ring_attention_backward, shard)
    finally:
        if args.transport != "mpi":
            ranks.dist.destroy_process_group()


def _time_ring(args, ranks, ring_attention, ring_attention_backward, shard):
    comm = ranks.comm
    warm = np.ones((1, 1, 4, args.D), args.dtype)  # load the kernels before timing
    for causal in (False, True):
        o, lse = ring_attention(warm, warm, warm, comm=comm, is_causal=causal,
                                layout="zigzag", return_lse=True)
        ring_attention_backward(o, warm, warm, warm, o, lse, comm=comm, is_causal=causal,
                                layout="zigzag")
    q, k, v, g = inputs(args)
    report = {}
    for name, causal, layout in configs(args):
        ql, kl, vl, gl = (np.ascontiguousarray(shard(x, comm, layout)) for x in (q, k, v, g))
        # (wall time of the slowest rank, CPU time of all ranks together)
        ranks.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        o, lse = ring_attention(ql, kl, vl, comm=comm, is_causal=causal, layout=layout,
                                return_lse=True)
        report[f"{name}|forward"] = (ranks.max(time.perf_counter() - t0),
                                     ranks.sum(time.process_time() - c0))
        if not args.no_backward:
            ranks.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            ring_attention_backward(gl, ql, kl, vl, o, lse, comm=comm, is_causal=causal,
                                    layout=layout)
            report[f"{name}|backward"] = (ranks.max(time.perf_counter() - t0),
                                          ranks.sum(time.process_time() - c0))
    # One ring step's transfer: this rank's K and V shards to rank + 1, from rank - 1.
    kl = np.ascontiguousarray(shard(k, comm))
    buf = np.empty_like(kl)
    best = float("inf")
    for _ in range(5):
        ranks.barrier()
        t0 = time.perf_counter()
        for _kv in range(2):  # K, then V (same shape here)
            ranks.sendrecv(kl, buf)
        best = min(best, ranks.max(time.perf_counter() - t0))
    report["kv_shard_bytes"] = 2 * kl.nbytes
    report["kv_shard_transfer_s"] = best
    if ranks.rank == 0:
        pathlib.Path(args.worker).write_text(json.dumps(report))


def mpiexec():
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec") or "mpiexec"


def ranks(args, argv, transport):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ring.json")
        if transport == "mpi":
            launcher = [mpiexec(), "-n", str(args.ranks), sys.executable]
        else:  # torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT for the gloo group
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(args.ranks)]
        cmd = [*launcher, str(__file__), *argv, "--transport", transport, "--worker", path]
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

    transports = [t.strip() for t in args.transport.split(",")]
    if not set(transports) <= {"mpi", "torch"}:
        raise SystemExit(f"--transport: mpi, torch or mpi,torch, got {args.transport!r}")
    threads = args.threads or args.ranks
    load_before = os.getloadavg()[0]
    best_single = {}
    best_ring = {t: {} for t in transports}
    inf = (float("inf"), float("inf"))
    for r in range(args.rounds):
        if not args.no_single:
            for key, t in single(args, threads).items():
                best_single[key] = tuple(map(min, best_single.get(key, inf), t))
            time.sleep(1)
        for transport in transports:
            best = best_ring[transport]
            for key, t in ranks(args, argv, transport).items():
                if isinstance(key, tuple):
                    best[key] = tuple(map(min, best.get(key, inf), t))
                elif key == "kv_shard_transfer_s":
                    best[key] = min(best.get(key, float("inf")), t)
                else:
                    best[key] = t
            time.sleep(1)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    load_after = os.getloadavg()[0]
    results = {t: table(args, threads, best_single, best_ring[t], t, (load_before, load_after))
               for t in transports}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "worker"},
             "transports": results, **(results[transports[0]] if len(transports) == 1
                                        else {})}, indent=1))


def table(args, threads, best_single, best_ring, transport, load):
    """Print one transport's figures; return them (rows, the shard transfer)."""
    launcher = "mpiexec" if transport == "mpi" else "torchrun, gloo"
    rows = []
    print(f"[{transport}: {launcher}] L {args.L}, H {args.heads}, D {args.D}, {args.dtype}: "
          f"{args.ranks} ranks x 1 thread vs 1 process x {threads} threads (min of "
          f"{args.rounds}); {os.cpu_count()} cores, load average {load[0]:.1f} before, "
          f"{load[1]:.1f} after")
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
    return {"rows": rows, "kv_shard_bytes": nbytes, "kv_shard_transfer_s": tt}


if __name__ == "__main__":
    main()
