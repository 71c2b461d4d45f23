"""The ring's transport over a ``torch.distributed`` process group (:class:`TorchGroup`).

torch is imported only when a process group is passed (``torch.distributed`` is then already
imported by the caller). The ring's buffers are NumPy arrays (host memory); they go to
``dist.isend``/``dist.irecv`` as uint8 tensors made by ``torch.from_numpy`` of their byte
views (no copies). So the group needs a backend that moves CPU tensors: gloo, MPI, or a
mixed backend with a CPU part (``"cpu:gloo,cuda:nccl"``). CUDA arrays are staged through
host buffers (a copy each way per message); device-to-device NCCL transfers are not built,
and a group whose only backend is NCCL is refused (NotImplementedError).

Our messages use the caller's group itself, apart from its own traffic by their tags
(:data:`TAG_BASE` plus the ring's tags): a private duplicate as MPI's ``Comm.Dup`` would be a
``dist.new_group``, which every process of the job must enter (a hang when the caller's group
is a subgroup and the others do not call us), or, with ``use_local_synchronization``, one
named after the ranks and the number of groups each process has made (a hang when the
members have made different numbers), and ~10 ms per call on gloo. Our collectives
(``all_gather_object``, ``all_gather``) are ordered with the caller's like any collective;
our point-to-point messages are all completed before the ring function returns, so only
the caller's own unfinished ``isend``/``irecv`` on the same group with a tag in
``TAG_BASE + [11, 14]`` could be confused with ours.
"""

import numpy as np

#: Added to the ring's message tags on a torch.distributed group, to keep them apart from the
#: caller's (small tags, 0 by default).
TAG_BASE = 0x5D9A0000


def _torch():
    import torch
    import torch.distributed as dist

    return torch, dist


def _check_backend(dist, group):
    name = str(dist.get_backend(group))
    backends = [b.split(":")[-1].strip().lower() for b in name.split(",")]
    cpu = [b for b in name.split(",") if ":" not in b or b.split(":")[0].strip() == "cpu"]
    if not cpu or all(b == "nccl" for b in backends):
        raise NotImplementedError(
            f"ring attention over torch.distributed moves host buffers, which a group with "
            f"backend {name!r} cannot: pass a gloo group (dist.new_group(backend='gloo')) "
            f"or initialize with backend='cpu:gloo,cuda:nccl'; device-to-device NCCL "
            f"transfers are not built")


class TorchGroup:
    """The ring's transport (:mod:`~sdpa_numba.distributed.transport`) over a
    ``torch.distributed`` process group: ring ranks are the group's ranks; messages go to
    the neighbours' global ranks."""

    def __init__(self, group):
        torch, dist = _torch()
        if not dist.is_initialized():
            raise ValueError("comm is a torch.distributed ProcessGroup but torch.distributed "
                             "is not initialized (dist.init_process_group)")
        _check_backend(dist, group)
        self.torch, self.dist, self.group = torch, dist, group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the ProcessGroup passed as comm")
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)]

    def free(self):
        """Drop our reference to the caller's group: nothing of the call outlives it."""
        self.group = None

    def allgather(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def _tensor(self, a):
        """A host array's bytes as a uint8 tensor sharing its memory."""
        return self.torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))

    def allgather_bytes(self, send, recv):
        n = send.size
        parts = [self._tensor(recv[r * n:(r + 1) * n]) for r in range(self.size)]
        self.dist.all_gather(parts, self._tensor(send), group=self.group)

    def post(self, send, recv, dest, source, tag):
        if not isinstance(recv, np.ndarray) or not recv.flags.c_contiguous:
            raise AssertionError("the ring receives into C-contiguous host buffers")
        return [self.dist.irecv(self._tensor(recv), src=self.global_ranks[source],
                                group=self.group, tag=TAG_BASE + tag),
                self.dist.isend(self._tensor(send), dst=self.global_ranks[dest],
                                group=self.group, tag=TAG_BASE + tag)]

    @staticmethod
    def wait(requests):
        for work in requests:
            work.wait()

    @staticmethod
    def device_buffers():
        """CUDA buffers are staged through host memory (no NCCL route)."""
        return False
