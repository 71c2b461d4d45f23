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
