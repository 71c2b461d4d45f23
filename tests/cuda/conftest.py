"""The CUDA tests run on Numba's CUDA simulator unless SDPA_NUMBA_REAL_GPU=1.

The simulator must be chosen before ``numba.cuda`` is first imported, so this file sets
``NUMBA_ENABLE_CUDASIM=1`` at collection time. It stays set for the rest of the process:
Numba re-reads its environment on every compilation, and dropping the variable would switch
``numba.cuda`` to the real target halfway. Numba's CPU target ignores it.

On the simulator, uninitialized shared and local memory is filled with NaN, so that a kernel
reading memory it never wrote fails the tests instead of reading the simulator's zeros.
"""

import os
import sys

import numpy as np
import pytest

REAL_GPU = os.environ.get("SDPA_NUMBA_REAL_GPU") == "1"
_ALREADY_REAL = "numba.cuda" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
if not REAL_GPU and not _ALREADY_REAL:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # Another test module may have imported numba already, which read its environment then.
    from numba.core import config as _config

    _config.reload_config()

from numba import cuda  # noqa: E402

from sdpa_cuda_testing import SIMULATED  # noqa: E402

from sdpa_numba.gpu import options  # noqa: E402

#: Small blocks: tiny inputs still span several query blocks and several key blocks.
TINY = options.Blocks(block_m=4, block_n=4, threads=4, rows_per_thread=2)


def _poison_simulator():
    from numba.cuda.simulator import kernelapi

    shared_init = kernelapi.FakeCUDAShared.__init__

    def poisoned_shared_init(self, dynshared_size):
        shared_init(self, dynshared_size)
        self._dynshared[:] = -1  # all bits set: NaN as float32 and float64

    def poisoned_local_array(self, shape, dtype, alignment=None):
        a = kernelapi.FakeCUDALocal.__dict__["_sdpa_array"](self, shape, dtype, alignment)
        if a.dtype.kind == "f":
            a.fill(np.nan)
        return a

    if "_sdpa_array" not in kernelapi.FakeCUDALocal.__dict__:
        kernelapi.FakeCUDALocal._sdpa_array = kernelapi.FakeCUDALocal.array
        kernelapi.FakeCUDALocal.array = poisoned_local_array
        kernelapi.FakeCUDAShared.__init__ = poisoned_shared_init


if SIMULATED:
    _poison_simulator()


@pytest.fixture(autouse=True)
def _cuda_target(monkeypatch):
    """Skip when the target is wrong; tiny blocks; a quick GIL hand-off on the simulator."""
    if not SIMULATED and not REAL_GPU:
        pytest.skip("numba.cuda was imported before the simulator could be enabled; run "
                    "tests/cuda on its own, or with SDPA_NUMBA_REAL_GPU=1 on a GPU")
    if REAL_GPU and not cuda.is_available():
        pytest.skip("SDPA_NUMBA_REAL_GPU=1 but no CUDA GPU is available")
    monkeypatch.setattr(options, "BLOCKS", TINY)
    if SIMULATED:
        # The simulator's block manager busy-waits on its threads; with Python's default 5 ms
        # switch interval most of a launch is spent waiting for the GIL.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(2e-4)
        yield
        sys.setswitchinterval(interval)
    else:
        yield
