"""Regression: the CUDA kernels with queries whose product with ``scale`` overflows while the
scores do not (see tests/test_scale_overflow.py), under the simulator, against the float64
reference."""

import numpy as np
import pytest

import sdpa_numba.gpu.decode as gpu_decode
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward
from sdpa_cuda_testing import dev
from test_scale_overflow import SCALE, grads_close, overflowing


def test_forward_and_backward(rng):
    q, k = overflowing(rng, ((1, 1, 9, 8), (1, 1, 12, 8)))
    v = rng.standard_normal((1, 1, 12, 8)).astype(np.float32)
    g = (rng.standard_normal((1, 1, 9, 8)) * 1e-2).astype(np.float32)  # dK fits float32
    out, lse = sdpa(dev(q), dev(k), dev(v), scale=SCALE, return_lse=True)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    want, want_lse = reference.attention(q, k, v, scale=SCALE)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    grads = sdpa_backward(dev(g), dev(q), dev(k), dev(v), dev(out), dev(lse), scale=SCALE)
    grads_close([x.copy_to_host() for x in grads],
                reference.attention_backward(g, q, k, v, scale=SCALE), 12 * 8)


@pytest.mark.parametrize("hq", [1, 4])
def test_kvcache_decode(rng, monkeypatch, hq):
    monkeypatch.setattr(gpu_decode, "THREADS", 8)
    monkeypatch.setattr(gpu_decode, "CHUNK", 8)
    monkeypatch.setattr(gpu_decode, "ROWS", 4)
    monkeypatch.setattr(gpu_decode, "BN", 4)
    B, S, H, E = 2, 11, 1, 8
    q, kc = overflowing(rng, ((B, 1, hq, E), (B, S, H, E)))
    vc = rng.standard_normal((B, S, H, E)).astype(np.float32)
    lens = np.array([11, 6], np.int32)
    got = kvattn(dev(q), dev(kc), dev(vc), dev(lens), scale=SCALE).copy_to_host()
    for b in range(B):
        n = lens[b]
        want, _ = reference.attention(q[b].transpose(1, 0, 2)[None],
                                      kc[b, :n].transpose(1, 0, 2)[None],
                                      vc[b, :n].transpose(1, 0, 2)[None],
                                      scale=SCALE, enable_gqa=True)
        np.testing.assert_allclose(got[b].transpose(1, 0, 2), want[0], rtol=1e-5, atol=1e-5)
