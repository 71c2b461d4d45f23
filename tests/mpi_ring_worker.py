"""Run under ``mpiexec -n P`` by tests/test_distributed.py (not collected by pytest).

Every rank builds the same full inputs, shards them, runs ring attention forward and backward,
and gathers the results; rank 0 compares them with the single-process dense functions on the
full arrays and writes a JSON report (relative Frobenius errors, bitwise checks, and what each
rank raised in the error cases) to the path given as the first argument. The cases and checks
are tests/ring_cases.py's (shared with the torch.distributed worker). ``--cases a,b`` runs
only those cases and no error cases (to compare with another transport's bits).
"""

import json
import os
import sys
import zlib

import numpy as np
from mpi4py import MPI

import sdpa_numba
from sdpa_numba import distributed
from sdpa_numba.distributed import (ring_attention, ring_attention_backward, shard,
                                    unshard)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_cases import CASES, error_cases, rel, run_case, shard_roundtrip  # noqa: E402

comm = MPI.COMM_WORLD
P, rank = comm.Get_size(), comm.Get_rank()

class MPIRanks:
    """The MPI communicator as tests/ring_cases.py sees it: NumPy arrays as they are."""

    comm, size, rank = comm, P, rank

    @staticmethod
    def allgather(obj):
        return comm.allgather(obj)

    @staticmethod
    def wrap(x):
        return x

    @staticmethod
    def unwrap(x):
        return x


#: Device cases (``--cuda``, under the CUDA simulator: host staging), tiny: the simulator runs
#: every GPU thread in Python. (name, dtype, is_causal, layout, variants).
CUDA_CASES = [
    ("cuda-f64-causal-zigzag-gqa-window-softcap-sinks", "float64", True, "zigzag",
     {"window": (3, None), "softcap": 2.0, "sinks": True}),
    ("cuda-f32-noncausal-contiguous", "float32", False, "contiguous", {}),
]


def run_cuda_case(case):
    """Ring attention on device arrays (forward and backward) against the same call on the
    host arrays (the host ring) and against the single-process dense functions."""
    from numba import cuda

    name, dt, causal, layout, spec = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    gqa = bool(spec.get("sinks"))  # GQA in the first case: 4 query heads on 2 kv heads
    hq, h = (4, 2) if gqa else (2, 2)
    L = P * 4
    q = rng.standard_normal((hq, L, 4)).astype(dt)
    k = rng.standard_normal((h, L, 4)).astype(dt)
    v = rng.standard_normal((h, L, 3)).astype(dt)
    variants = {key: value for key, value in spec.items() if key != "sinks"}
    if spec.get("sinks"):
        variants["sinks"] = rng.standard_normal(hq)
        variants["sinks"][0] = -np.inf
    kw = dict(is_causal=causal, layout=layout, enable_gqa=gqa, **variants)
    ql, kl, vl = (shard(x, comm, layout) for x in (q, k, v))
    out_h, lse_h = ring_attention(ql, kl, vl, return_lse=True, **kw)
    g = rng.standard_normal(out_h.shape).astype(dt)
    grads_h = ring_attention_backward(g, ql, kl, vl, out_h, lse_h, **kw)
    dev = [cuda.to_device(np.ascontiguousarray(x)) for x in (ql, kl, vl, g)]
    out_d, lse_d = ring_attention(*dev[:3], return_lse=True, **kw)
    grads_d = ring_attention_backward(dev[3], *dev[:3], out_d, lse_d, **kw)
    host = [x.copy_to_host() for x in (out_d, lse_d, *grads_d[:3])]
    local = {"device_results": all(hasattr(x, "copy_to_host") for x in (out_d, lse_d,
                                                                         *grads_d[:3])),
             "kinds": [type(x).__name__ for x in (out_d, *grads_d)],
             "vs_host_ring": max(rel(a, b) for a, b in zip(host, (out_h, lse_h, *grads_h[:3]))),
             "dsinks_vs_host_ring": (rel(grads_d[3], grads_h[3]) if len(grads_h) > 3
                                     else None),
             "inputs_unchanged": bool(np.array_equal(dev[1].copy_to_host(), kl))}
    ref_out, ref_lse = sdpa_numba.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True, **variants)
    ref_grads = sdpa_numba.scaled_dot_product_attention_backward(
        g_full := unshard(g, comm, layout), q, k, v, ref_out, ref_lse, is_causal=causal,
        enable_gqa=gqa, **variants)
    del g_full
    full = [unshard(host[0], comm, layout), unshard(host[1], comm, layout, axis=-1),
            *(unshard(x, comm, layout) for x in host[2:])]
    local["vs_dense"] = max(rel(a, b) for a, b in zip(full, (ref_out, ref_lse,
                                                             *ref_grads[:3])))
    return comm.gather(local, root=0)


def main_cuda(path):
    from sdpa_numba.gpu.arrays import is_simulated_mode

    report = {"size": P, "simulated": is_simulated_mode(),
              "cuda_aware": distributed.mpi_cuda_aware(), "cases": {}}
    for case in CUDA_CASES:
        report["cases"][case[0]] = run_cuda_case(case)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def main():
    path = sys.argv[1]
    if "--cuda" in sys.argv[2:]:
        return main_cuda(path)
    import numba

    only = None
    if "--cases" in sys.argv[2:]:
        only = sys.argv[sys.argv.index("--cases") + 1].split(",")
    report = {"size": P, "cases": {}, "threads": numba.get_num_threads()}
    for case in CASES:
        if only is not None and case[0] not in only:
            continue
        r = run_case(MPIRanks, case)
        if rank == 0:
            report["cases"][case[0]] = r
    if only is None:
        report["errors"] = error_cases(MPIRanks)
        report["shard_roundtrip"] = shard_roundtrip(MPIRanks)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
