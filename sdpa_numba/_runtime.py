"""How the CPU kernels live with Numba's process-wide machinery: threading layer, fork and JIT
switch.

* Threading layer. GNU OpenMP (Numba's default choice on Linux when TBB is absent) cannot run a
  parallel region in a process forked after its parent ran one: Numba kills such a child with
  SIGTERM, and a ``multiprocessing`` fork pool then waits forever for the lost task. Unless the
  user chose a layer (``NUMBA_THREADING_LAYER``, ``NUMBA_THREADING_LAYER_PRIORITY``, a
  ``.numba_config.yaml`` or ``numba.config`` set before the first parallel launch),
  :func:`choose_threading_layer` asks Numba for its ``"forksafe"`` layers: TBB if installed,
  else ``workqueue``. Measured here, workqueue is as fast as OpenMP for these kernels (they
  schedule their own work through a task queue).
* ``workqueue`` is not thread-safe: two parallel launches at once from two Python threads
  abort the process. :func:`kernel_launch` serializes the CPU kernels' launches under it.
* A forked child of a process that ran GNU OpenMP regions gets a clear RuntimeError from
  :func:`kernel_launch` instead of being killed.
* ``NUMBA_DISABLE_JIT=1``: the kernels use LLVM intrinsics that have no Python form, so they
  cannot run uncompiled; a clear RuntimeError says so.
"""

import os
import sys
import threading
from contextlib import contextmanager

import numba
from numba.core import config

_DEFAULT_PRIORITY = ["tbb", "omp", "workqueue"]

#: Serializes the CPU kernels' launches under the workqueue layer (reentrant: a launch may
#: split into several).
_lock = threading.RLock()
#: Set in a forked child whose parent had started GNU OpenMP's thread pool.
_omp_inherited = False


def _user_chose_layer():
    return (config.THREADING_LAYER != "default"
            or list(config.THREADING_LAYER_PRIORITY) != _DEFAULT_PRIORITY
            or "NUMBA_THREADING_LAYER" in os.environ
            or "NUMBA_THREADING_LAYER_PRIORITY" in os.environ)


def _layer_started():
    from numba.np.ufunc import parallel

    return parallel._is_initialized


def choose_threading_layer():
    """Prefer Numba's fork-safe layers, unless the user chose one or a layer already runs."""
    if not _user_chose_layer() and not _layer_started():
        config.THREADING_LAYER = "forksafe"


def _gnu_omp_running():
    from numba.np.ufunc import parallel

    if not parallel._is_initialized or parallel._threading_layer != "omp":
        return False
    omppool = sys.modules.get("numba.np.ufunc.omppool")
    return getattr(omppool, "openmp_vendor", "GNU") == "GNU"


def _after_fork_in_child():
    global _lock, _omp_inherited
    _lock = threading.RLock()  # another thread of the parent may have held it
    _omp_inherited = _gnu_omp_running()


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_jit():
    """RuntimeError under ``NUMBA_DISABLE_JIT=1``, which the CPU kernels cannot run under."""
    if config.DISABLE_JIT:
        raise RuntimeError(
            "sdpa_numba's CPU kernels cannot run with NUMBA_DISABLE_JIT=1: they use LLVM "
            "intrinsics (stack buffers, half-precision conversions, atomics) that have no "
            "pure-Python form. Unset NUMBA_DISABLE_JIT; for a slow, plain NumPy result use "
            "sdpa_numba.reference.")


@contextmanager
def kernel_launch():
    """Around every launch of the parallel CPU kernels from Python: refuses what would crash
    the process and serializes launches where the threading layer is not thread-safe."""
    check_jit()
    if _omp_inherited:
        raise RuntimeError(
            "sdpa_numba cannot run in this process: it was forked after its parent ran Numba "
            "parallel code under GNU OpenMP, which cannot run again in a forked child (Numba "
            "would kill it). Use the 'spawn' or 'forkserver' start method, or choose a "
            "fork-safe threading layer in the parent before its first parallel call "
            "(NUMBA_THREADING_LAYER=workqueue, or 'tbb' with the tbb package installed).")
    numba.get_num_threads()  # starts the threading layer: now numba.threading_layer() answers
    if numba.threading_layer() == "workqueue":
        with _lock:
            yield
    else:
        yield
