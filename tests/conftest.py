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
