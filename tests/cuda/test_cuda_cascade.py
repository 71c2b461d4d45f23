"""cascade_attention on CUDA arrays: refused with NotImplementedError (its shared level folds
the batch's queries with host code), nothing written."""

import numpy as np
import pytest

from sdpa_numba import cascade_attention
from sdpa_cuda_testing import dev


def test_cuda_arrays_are_refused_and_nothing_is_written(rng):
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    pk = rng.standard_normal((5, 2, 8)).astype(np.float32)
    kc = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    d_kc, d_vc = dev(kc), dev(kc)
    with pytest.raises(NotImplementedError, match="cascade_attention runs on the CPU only"):
        cascade_attention(dev(q), dev(pk), dev(pk), d_kc, d_vc, np.array([2, 3]),
                          k=dev(k_new), v=dev(k_new))
    assert d_kc.copy_to_host().tobytes() == kc.tobytes()
    assert d_vc.copy_to_host().tobytes() == kc.tobytes()
    with pytest.raises(TypeError):  # a mix of host and device arrays: the target's refusal
        cascade_attention(q, dev(pk), pk, kc, kc, 2)
