import zlib

import numpy as np
import pytest
from hypothesis import settings

# Property tests draw the same examples on every run: a failure reproduces, in CI and here.
settings.register_profile("deterministic", derandomize=True)
settings.load_profile("deterministic")


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test: the seed is derived from the test's name.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _lock_numba_cache_saves():
    """Make Numba's cache saves atomic across processes (the xdist workers share one cache).

    Numba saves an overload by reading the function's index, adding its key with the first
    free data-file number, writing the index, then the data file. Two processes saving two
    overloads of one function at once can both pick number 1: the index then names one key
    and the data file holds the other's code, which a later load runs for the wrong types.
    An exclusive lock on a file beside the index around each save closes that window.
    """
    import fcntl
    import functools

    from numba.core.caching import IndexDataCacheFile

    save = IndexDataCacheFile.save
    if getattr(save, "_sdpa_locked", False):
        return

    @functools.wraps(save)
    def locked_save(self, key, data):
        with open(self._index_path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    locked_save._sdpa_locked = True
    IndexDataCacheFile.save = locked_save


_lock_numba_cache_saves()


#: Test files that run on the same xdist worker, one after the other (``--dist loadfile``
#: otherwise hands each file to whichever worker is free). The MPI and the torch.distributed
#: ring files run the same cases (tests/ring_cases.py) through the same kernels, each
#: compiling them first (``warm``) so that their ranks load them from Numba's cache: on two
#: workers at once they compiled that set twice, side by side; on one, the second loads it.
#: test_chunk.py's varlen tests use 22 of test_varlen.py's specializations (float64 varlen
#: forward and backward and their tasks); the two are 4 apart in loadfile's largest-first queue.
SAME_WORKER = {"tests/test_distributed_torch.py": "tests/test_distributed.py",
               "tests/test_chunk.py": "tests/test_varlen.py"}


#: Files of few but slow tests, queued as if they held this many: ``--dist loadfile`` hands
#: out the files with the most tests first, which put these last, where the other worker,
#: done, waits for whichever runs them. CPU seconds of each file alone (-n 0, on a cache
#: holding what the suite compiles before them; load 4-8, two shared cores):
#: test_guard_pages.py 54, test_narrow_vectors.py 54, test_gpu_raising.py 50 (subprocesses
#: compiling), test_bench_decode.py 26, test_cold_start_lazy.py 22, test_threading_layer.py
#: 22, test_properties.py 18, test_packaging.py 16 (builds a wheel); the other files of four
#: tests or fewer take 3 to 12.
QUEUE_AS = {"tests/test_guard_pages.py": 35, "tests/test_narrow_vectors.py": 35,
            "tests/test_gpu_raising.py": 35, "tests/test_bench_decode.py": 20,
            "tests/test_cold_start_lazy.py": 20, "tests/test_threading_layer.py": 20,
            "tests/test_properties.py": 15, "tests/test_packaging.py": 15}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of :data:`SAME_WORKER` as one work unit, queued
    largest first with the sizes of :data:`QUEUE_AS`."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SameWorkerFiles(LoadFileScheduling):
        _ordered = False

        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

        def _assign_work_unit(self, node):
            if not self._ordered:  # the queue is whole here (the first assignment)
                units = sorted(self.workqueue.items(),
                               key=lambda unit: -QUEUE_AS.get(unit[0], len(unit[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._ordered = True
            super()._assign_work_unit(node)

    return SameWorkerFiles(config, log)
