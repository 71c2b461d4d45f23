"""Agreement across ranks: the ring's private channel on the caller's communicator, whose
ranks raise together when one fails (:class:`Collective`), and the comparison of every
rank's arguments (shapes, dtypes, flags, digests of small arrays) before anything is
computed."""

import hashlib

import numpy as np

from .transport import group_of


class Collective:
    """The ring's transport on the caller's communicator (an mpi4py communicator or a
    ``torch.distributed`` process group: :func:`~.transport.group_of`, private: our messages
    never match theirs), with the error exchange that keeps the ranks together."""

    def __init__(self, comm):
        self.group = group_of(comm)
        self.size = self.group.size
        self.rank = self.group.rank

    def free(self):
        self.group.free()

    def allgather(self, obj):
        """Every rank's ``obj``, in rank order."""
        return self.group.allgather(obj)

    def agree(self, errors, what, cleanup=None):
        """Every rank learns whether any rank failed; all raise if one did.

        ``errors``: a list holding this rank's exception, or empty; it is emptied. The failing
        rank re-raises its own; the others raise an exception of the same kind (ValueError,
        TypeError, NotImplementedError; RuntimeError for anything else) naming the rank and
        its message. ``cleanup`` (e.g. waiting for messages every rank has posted) runs
        before raising.

        The exception travels in a list, not a local of the caller's, because a frame that
        holds the exception it raises is in a reference cycle with it (exception → traceback
        → frame → exception): everything the frame holds, the caller's tensors and process
        group among them, would then live until Python's cyclic collector runs, possibly
        past ``dist.destroy_process_group()`` and into interpreter shutdown, where releasing
        gloo's objects aborts the process.
        """
        error = errors.pop() if errors else None
        try:
            self._agree(error, what, cleanup)
        finally:
            error = None

    def _agree(self, error, what, cleanup):
        summary = None if error is None else (type(error).__name__, str(error))
        summaries = self.allgather(summary)
        failed = [(r, s) for r, s in enumerate(summaries) if s is not None]
        if not failed:
            return
        if cleanup is not None:
            cleanup()
        if error is not None:
            try:
                raise error
            finally:
                error = None
        r, (name, message) = failed[0]
        kind = {"ValueError": ValueError, "TypeError": TypeError,
                "NotImplementedError": NotImplementedError}.get(name, RuntimeError)
        raise kind(f"ring attention stopped {what}: rank {r} raised {name}: {message}")


def digest(a):
    """A small array (ALiBi slopes, sinks) as something the ranks can compare."""
    if a is None:
        return None
    return (a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16])


def signature(arrays, **flags):
    return tuple((tuple(a.shape), a.dtype.str) for a in arrays) + tuple(sorted(flags.items()))


def compare(coll, sig, names):
    sigs = coll.allgather(sig)
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if bad:
        def show(s):
            arrays = ", ".join(f"{n} {shape} {dt}" for n, (shape, dt) in
                               zip(names, s[:len(names)]))
            return arrays + "; " + ", ".join(f"{k}={v!r}" for k, v in s[len(names):])
        raise ValueError(f"ring attention needs the same shapes, dtypes and arguments on "
                         f"every rank: rank 0 has {show(sigs[0])}; rank {bad[0]} has "
                         f"{show(sigs[bad[0]])}")
