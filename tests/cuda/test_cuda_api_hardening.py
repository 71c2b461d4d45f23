"""The public API's hardening checks on CUDA arrays (issue 14): missing operands and a
self-overlapping ``out`` are refused before any kernel runs, as for NumPy arrays."""

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba.gpu.arrays import as_strided
from sdpa_cuda_testing import dev, randn


def test_missing_operand_is_type_error(rng):
    q = dev(randn(rng, (2, 5, 4), np.float32))
    with pytest.raises(TypeError, match="query must be .* got None"):
        sdpa_numba.scaled_dot_product_attention(None, q, q)
    with pytest.raises(TypeError, match="value must be .* got None"):
        sdpa_numba.scaled_dot_product_attention(q, q, None)
    out, lse = sdpa_numba.scaled_dot_product_attention(q, q, q, return_lse=True)
    with pytest.raises(TypeError, match="lse must be .* got None"):
        sdpa_numba.scaled_dot_product_attention_backward(out, q, q, q, out, None)


def test_out_with_overlapping_rows_is_refused(rng):
    q = dev(randn(rng, (2, 5, 4), np.float32))
    buf = dev(np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="overlap each other"):
        sdpa_numba.scaled_dot_product_attention(q, q, q, out=as_strided(buf, (2, 5, 4),
                                                                        (40, 8, 4)))
    assert not buf.copy_to_host().any()
