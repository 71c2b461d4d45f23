"""One rank of ring attention over torch.distributed (gloo), run by
tests/test_distributed_torch.py (not collected by pytest).

``python tests/torch_ring_worker.py REPORT INIT_FILE`` with ``RANK`` and ``WORLD_SIZE`` in the
environment (as ``torchrun`` sets them): joins the gloo group through ``file://INIT_FILE``,
runs tests/ring_cases.py's cases (the MPI worker's) on torch CPU tensors with
``comm=torch.distributed.group.WORLD`` and a subgroup, and rank 0 writes the JSON report.
``--cases a,b`` runs only those cases and no error cases.
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_cases import CASES, error_cases, run_case, shard_roundtrip  # noqa: E402


class TorchRanks:
    """A process group as tests/ring_cases.py sees it: torch CPU tensors in and out."""

    def __init__(self, group):
        self.comm = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def allgather(self, obj):
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.comm)
        return out

    @staticmethod
    def wrap(x):
        return torch.from_numpy(x) if isinstance(x, np.ndarray) else x

    @staticmethod
    def unwrap(x):
        return x.numpy() if isinstance(x, torch.Tensor) else x


def subgroup_case(world):
    """A ring on the group of the last two ranks (global ranks 1, 2 of 3: neighbours
    addressed by their global ranks), against the dense result; the other rank does not
    call it. Every rank reports whether it took part and what it saw."""
    import sdpa_numba
    from sdpa_numba.distributed import ring_attention, shard, unshard

    members = list(range(world.size - 2, world.size))
    sub = dist.new_group(members)  # every process of the job creates it
    result = None
    if world.rank in members:
        ranks = TorchRanks(sub)
        rng = np.random.default_rng(7)
        q, k, v = (rng.standard_normal((2, 8, 8)) for _ in range(3))
        ql, kl, vl = (torch.from_numpy(shard(x, sub, "zigzag")) for x in (q, k, v))
        out = ring_attention(ql, kl, vl, comm=sub, is_causal=True, layout="zigzag")
        full = unshard(out, sub, "zigzag").numpy()
        ref = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True)
        result = {"group_rank": ranks.rank, "max_err": float(np.abs(full - ref).max())}
    dist.destroy_process_group(sub)
    return world.allgather(result)


def main():
    path, init = sys.argv[1], sys.argv[2]
    only = None
    if "--cases" in sys.argv[3:]:
        only = sys.argv[sys.argv.index("--cases") + 1].split(",")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        import numba

        world = TorchRanks(dist.group.WORLD)
        report = {"size": size, "cases": {}, "threads": numba.get_num_threads(),
                  "backend": str(dist.get_backend())}
        for case in CASES:
            if only is not None and case[0] not in only:
                continue
            print(f"rank {rank}: {case[0]}", flush=True)  # where a timed-out run was
            r = run_case(world, case)
            if rank == 0:
                report["cases"][case[0]] = r
        if only is None:
            print(f"rank {rank}: error cases", flush=True)
            report["errors"] = error_cases(world)
            report["shard_roundtrip"] = shard_roundtrip(world)
            if size >= 3:
                report["subgroup"] = subgroup_case(world)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
