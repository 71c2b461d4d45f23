"""The polynomial exp2 behind every softmax: accuracy bounds and special values."""

import numpy as np
import pytest
from numba import njit

from sdpa_numba.cpu.exp2 import exp2


@njit
def _exp2_all(x, out):
    for i in range(x.size):
        out[i] = exp2(x[i])


def _exp2(x):
    out = np.full_like(x, np.nan)
    _exp2_all(x, out)
    return out


@pytest.mark.parametrize("dtype, bound, lowest", [(np.float32, 2.5e-7, -126.0),
                                                  (np.float64, 5e-16, -1022.0)])
def test_relative_error_bound(dtype, bound, lowest):
    # Every fraction the reduction can produce, over the whole normal range and near 0.
    x = np.concatenate([np.linspace(lowest, 0.0, 2_000_003),
                        -np.geomspace(1e-30, 1.0, 100_001)]).astype(dtype)
    ref = np.exp2(x.astype(np.longdouble))
    err = np.abs(_exp2(x).astype(np.longdouble) / ref - 1)
    assert float(err.max()) < bound


@pytest.mark.parametrize("dtype, lowest", [(np.float32, -126.0), (np.float64, -1022.0)])
def test_special_values(dtype, lowest):
    x = np.array([0.0, -0.0, -np.inf, np.nan, lowest, np.nextafter(lowest, -np.inf, dtype=dtype),
                  -2000.0, -1.0], dtype)
    r = _exp2(x)
    assert r[0] == 1 and r[1] == 1  # the row maximum gets p = 1 exactly
    assert r[2] == 0 and r[6] == 0  # masks: exactly 0
    assert np.isnan(r[3])  # a NaN score stays NaN (it must show in its row)
    assert r[4] == np.exp2(dtype(lowest))  # smallest normal result
    assert r[5] == 0  # would be subnormal: flushed to an exact 0
    assert r[7] == 0.5
