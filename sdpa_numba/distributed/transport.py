"""What ring attention needs of a communication library, and the choice of one.

A *group* (the transport) is the caller's communicator seen through five operations, which
the ring (:mod:`~sdpa_numba.distributed.agreement`, :mod:`~sdpa_numba.distributed.layouts`,
the ring steps) uses and nothing else:

* ``size`` and ``rank``: the ring's order is the caller's communicator's;
* ``allgather(obj)``: every rank's Python object, in rank order (argument agreement, error
  flags, the sinks' gradient);
* ``allgather_bytes(send, recv)``: every rank's uint8 array, concatenated in rank order;
* ``post(send, recv, dest, source, tag)``: a non-blocking send of a buffer to ``dest`` and a
  receive from ``source`` into ``recv`` (C-contiguous arrays, moved as bytes), returning
  requests that ``wait(requests)`` completes;
* ``device_buffers()``: whether CUDA buffers may be passed to ``post`` (else they are staged
  through host buffers); ``free()``: release what the group holds.

Two implementations: :class:`~sdpa_numba.distributed.mpi.MPIGroup` (an mpi4py communicator)
and :class:`~sdpa_numba.distributed.torch_group.TorchGroup` (a ``torch.distributed``
process group). Each library is imported only when a communicator of its kind is used.
"""

import sys

import numpy as np

# Message tags of the ring's exchanges (a group may offset them into its own range).
TAG_K, TAG_V, TAG_DK, TAG_DV = 11, 12, 13, 14


def is_torch_group(comm):
    """Whether ``comm`` is a ``torch.distributed`` process group (without importing torch:
    a process group exists only if ``torch.distributed`` was imported)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(comm, getattr(dist, "ProcessGroup", ()))


def group_of(comm, private=True):
    """The transport for the caller's ``comm``: a ``torch.distributed`` process group, an
    mpi4py intracommunicator, or None (``MPI.COMM_WORLD``). ``private``: our messages must
    never match the caller's (a collective call's own channel); ``False`` for the local
    :func:`~sdpa_numba.distributed.shard`, which must not communicate at all."""
    if comm is not None and is_torch_group(comm):
        from .torch_group import TorchGroup

        return TorchGroup(comm)
    from .mpi import MPIGroup, communicator

    return MPIGroup(communicator(comm), dup=private)


class Exchange:
    """Non-blocking exchange of a set of arrays with the ring's neighbours: send ours to
    ``rank + 1``, receive the same shapes from ``rank - 1`` into ``recv``."""

    def __init__(self, coll, send, recv, tags, ring):
        self.group = coll.group
        self.requests = []
        self.unstage = []  # (device buffer, host buffer) to copy once the messages are in
        if coll.size == 1:
            return
        nxt, prev = (coll.rank + 1) % coll.size, (coll.rank - 1) % coll.size
        if ring.device == "cuda":
            if ring.stage:
                # Through the host: the sent shards copied out now, the received ones copied
                # in by wait(). Blocking copies on the default stream: they follow the kernels
                # that wrote the buffers.
                send = [s.copy_to_host() for s in send]
                host = [np.empty(tuple(r.shape), r.dtype) for r in recv]
                self.unstage = list(zip(recv, host))
                recv = host
            else:
                from numba import cuda

                # The library reads the device buffers itself: the kernels writing them must
                # be done.
                cuda.synchronize()
        for s, r, tag in zip(send, recv, tags):
            self.requests += self.group.post(s, r, nxt, prev, tag)

    def wait(self):
        if self.requests:
            self.group.wait(self.requests)
            self.requests = []
            for dev, host in self.unstage:
                dev.copy_to_device(host)
            self.unstage = []
