"""MPI plumbing of ring attention: mpi4py (imported when first needed), the caller's
communicator, whether device buffers go to MPI directly (:func:`mpi_cuda_aware`), arrays as
the bytes MPI moves, and :class:`MPIGroup`, the ring's transport over a communicator
(:mod:`~sdpa_numba.distributed.transport`)."""

import os
import sys

import numpy as np

#: The environment variable that overrides the detection of a CUDA-aware MPI library:
#: "1" passes device buffers to MPI, "0" stages them through host buffers.
CUDA_AWARE_ENV = "SDPA_NUMBA_MPI_CUDA_AWARE"


def mpi_cuda_aware():
    """Whether device buffers go to MPI directly (else through host buffers).

    ``SDPA_NUMBA_MPI_CUDA_AWARE=1`` or ``0`` decides; unset, the MPI library is asked:
    mpi4py's ``MPI.Query_cuda_support()`` where it has one, else the library's own
    ``MPIX_Query_cuda_support()`` (an extension of Open MPI and MPICH, found in the ``libmpi``
    this process loaded). A library that cannot say is taken as not CUDA-aware (staging:
    slower, never wrong). The CUDA simulator's arrays are host memory and always staged.
    """
    env = os.environ.get(CUDA_AWARE_ENV)
    if env is not None and env.strip() != "":
        if env.strip() not in ("0", "1"):
            raise ValueError(f"{CUDA_AWARE_ENV} must be 0 or 1, got {env!r}")
        return env.strip() == "1"
    query = getattr(mpi(), "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # an MPI library without the query (NotImplementedError in mpi4py)
            return False
    return bool(_mpix_query_cuda_support())


_MPIX_ANSWER: list = []  # the library's answer, asked once per process


def _mpix_query_cuda_support():
    """``MPIX_Query_cuda_support()`` of the MPI library mpi4py loaded (mpi4py 4.1 does not
    wrap it; the library is opened with local symbols, so it is found by its path among the
    process's mappings: Linux only). None when the library cannot be asked."""
    if _MPIX_ANSWER:
        return _MPIX_ANSWER[0]
    answer = None
    try:
        import ctypes

        mpi()  # initialized: the query must follow MPI_Init
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f
                           if "/libmpi" in line and ".so" in line.split()[-1]})
        for path in libs:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, "MPIX_Query_cuda_support", None)
            if fn is not None:
                fn.restype, fn.argtypes = ctypes.c_int, []
                answer = bool(fn())
                break
    except Exception:  # no /proc, no such symbol: cannot say
        answer = None
    _MPIX_ANSWER.append(answer)
    return answer


def mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("sdpa_numba.distributed needs mpi4py: pip install 'sdpa_numba[mpi]' "
                          "(mpi4py and the MPICH wheel), or mpi4py built against your "
                          "cluster's MPI") from e
    return MPI


def communicator(comm):
    """The caller's communicator: ``comm``, or ``MPI.COMM_WORLD`` for None (ValueError when
    ``torch.distributed`` runs more processes than that: the caller meant its group)."""
    if comm is None:
        try:
            MPI = mpi()
        except ImportError:
            _check_not_torch_world(None)
            raise
        _check_not_torch_world(MPI.COMM_WORLD.Get_size())
        return MPI.COMM_WORLD
    MPI = mpi()
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD) or "
                        f"a torch.distributed ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD), got {type(comm).__name__}")
    return comm


def _check_not_torch_world(mpi_size):
    """Under ``torchrun`` MPI's world is this process alone: ``comm=None`` would compute each
    rank's shard against its own keys only. Refused (on every rank alike: the sizes are the
    same everywhere)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    size = dist.get_world_size()
    if size != mpi_size:
        have = "no mpi4py" if mpi_size is None else f"{mpi_size} process(es)"
        raise ValueError(f"comm=None means MPI.COMM_WORLD ({have}), but "
                         f"torch.distributed is initialized with {size} processes: pass "
                         f"comm=torch.distributed.group.WORLD (or your ProcessGroup)")


def as_bytes(a):
    """A C-contiguous array's memory as a flat uint8 view: MPI moves bytes, whatever the
    dtype (float16 and bfloat16 have no MPI datatype). Device arrays stay on the device
    (a Numba device array, which mpi4py takes by its ``__cuda_array_interface__``)."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).view(np.uint8)
    from ..gpu.arrays import as_strided

    return as_strided(a, (a.size * a.dtype.itemsize,), (1,), np.uint8)


class MPIGroup:
    """The ring's transport (:mod:`~sdpa_numba.distributed.transport`) over an mpi4py
    intracommunicator: with ``dup``, a private duplicate of it (``Comm.Dup``: our messages
    never match the caller's), freed by :meth:`free`."""

    def __init__(self, comm, dup=True):
        self.comm = comm.Dup() if dup else comm
        self.owned = dup
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()

    def free(self):
        if self.owned:
            self.comm.Free()

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def allgather_bytes(self, send, recv):
        self.comm.Allgather(as_bytes(send), as_bytes(recv))

    def post(self, send, recv, dest, source, tag):
        return [self.comm.Irecv(as_bytes(recv), source=source, tag=tag),
                self.comm.Isend(as_bytes(send), dest=dest, tag=tag)]

    @staticmethod
    def wait(requests):
        mpi().Request.Waitall(requests)

    @staticmethod
    def device_buffers():
        return mpi_cuda_aware()
