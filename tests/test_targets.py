"""The targets seam: one device detector, one object per target, and the old names in
sdpa_numba.api kept for their callers."""

import numpy as np
import pytest

from sdpa_numba import api
from sdpa_numba.problem import host_address
from sdpa_numba.targets import CUDA, HOST, by_name, target_of


class _CudaLike:
    """Stands for a CUDA array of another library (only its interface is looked at)."""

    shape, ndim, dtype = (2,), 1, np.dtype(np.float32)
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False),
                                "version": 3, "strides": None}


def test_target_of_tells_host_from_cuda_and_refuses_a_mix():
    x = np.zeros(2)
    assert target_of([("query", x), ("mask", None)]) is HOST
    assert target_of([("query", _CudaLike())]) is CUDA
    with pytest.raises(TypeError, match=r"mix host and device arrays \(a on host, b on cuda\)"):
        target_of([("a", x), ("b", _CudaLike())])
    with pytest.raises(TypeError, match="key must be an array .* got None"):
        target_of([("query", x), ("key", None)], ("query", "key"))
    with pytest.raises(TypeError, match="query must be an array: NumPy"):
        target_of([("query", "text")])


def test_old_names_in_api_are_the_seams():
    x = np.zeros(3)
    assert api.address("host") is host_address and api.address(HOST) is host_address
    (y,), restore = api.adopt("host", [("query", x)])
    assert y is x and restore(y) is x
    assert api._is_device_array(_CudaLike()) and not api._is_device_array(x)
    assert by_name("cuda") is CUDA and by_name(HOST) is HOST
