"""A score_mod or mask_mod that raises: the user sees the error (see sdpa_numba.gpu.raising).

On the simulator the kernel runs as Python and the exception reaches the caller; on a real
GPU such a function is refused before the launch (tests/test_gpu_raising.py checks the
detection without a GPU; scripts/gpu_check.py the refusal on one)."""

import numba
import numpy as np
import pytest

from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_cuda_testing import REAL_GPU, dev


def _says(users_message):
    """On the simulator the user's own exception; on a GPU the refusal before launch."""
    return "can raise an exception" if REAL_GPU else users_message


@numba.njit
def raising_mod(s, b, h, i, j):
    if j == 3:
        raise ValueError("user score_mod says no")
    return s


@numba.njit
def raising_keep(b, h, i, j):
    if i == 2:
        raise ValueError("user mask_mod says no")
    return True


def test_dense_forward_reports_the_users_exception(rng):
    q = dev(rng.standard_normal((1, 1, 4, 8)).astype(np.float32))
    with pytest.raises(ValueError, match=_says("score_mod says no")):
        sdpa(q, q, q, score_mod=raising_mod)
    with pytest.raises(ValueError, match=_says("mask_mod says no")):
        sdpa(q, q, q, mask_mod=raising_keep)


def test_decode_reports_the_users_exception(rng):
    q = dev(rng.standard_normal((1, 1, 2, 8)).astype(np.float32))
    kc = dev(rng.standard_normal((1, 6, 2, 8)).astype(np.float32))
    with pytest.raises(ValueError, match=_says("score_mod says no")):
        kvattn(q, kc, kc, dev(np.array([6], np.int32)), score_mod=raising_mod)
