"""MPI plumbing of ring attention: mpi4py (imported when first needed), the caller's
communicator, whether device buffers go to MPI directly (:func:`mpi_cuda_aware`), arrays as
the bytes MPI moves, and the non-blocking exchange of arrays with the ring's neighbours."""

import os

import numpy as np

# Message tags (on a private duplicate of the caller's communicator).
TAG_K, TAG_V, TAG_DK, TAG_DV = 11, 12, 13, 14

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
    MPI = mpi()
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), "
                        f"got {type(comm).__name__}")
    return comm


def as_bytes(a):
    """A C-contiguous array's memory as a flat uint8 view: MPI moves bytes, whatever the
    dtype (float16 and bfloat16 have no MPI datatype). Device arrays stay on the device
    (a Numba device array, which mpi4py takes by its ``__cuda_array_interface__``)."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).view(np.uint8)
    from ..gpu.arrays import as_strided

    return as_strided(a, (a.size * a.dtype.itemsize,), (1,), np.uint8)


class Exchange:
    """Non-blocking exchange of a set of arrays with the ring's neighbours: send ours to
    ``rank + 1``, receive the same shapes from ``rank - 1`` into ``recv``."""

    def __init__(self, coll, send, recv, tags, ring):
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

                # MPI reads the device buffers itself: the kernels writing them must be done.
                cuda.synchronize()
        for s, r, tag in zip(send, recv, tags):
            self.requests.append(coll.comm.Irecv(as_bytes(r), source=prev, tag=tag))
            self.requests.append(coll.comm.Isend(as_bytes(s), dest=nxt, tag=tag))

    def wait(self):
        if self.requests:
            mpi().Request.Waitall(self.requests)
            self.requests = []
            for dev, host in self.unstage:
                dev.copy_to_device(host)
            self.unstage = []
