"""Rotary embedding on append and cache_batch_idx of attention_with_kvcache on CUDA arrays,
under the simulator: against the CPU path (itself checked against NumPy rotation in
tests/test_kvcache_rope.py) and a float64 rotation; inputs unmodified; refusals with the
device caches unwritten."""

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_cuda_testing import dev, rel_err, small_decode_blocks


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    small_decode_blocks(monkeypatch)


def tables(n, rd):
    ang = np.arange(n)[:, None] * 10000.0 ** (-np.arange(rd // 2) / (rd // 2))
    return np.cos(ang), np.sin(ang)


def rotate64(x, cos, sin, pos, interleaved):
    x = np.asarray(x, np.float64).copy()
    half = cos.shape[1]
    c, s = cos[pos][:, :, None, :], sin[pos][:, :, None, :]
    i0 = np.arange(half) * 2 if interleaved else np.arange(half)
    i1 = i0 + 1 if interleaved else i0 + half
    a, b = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0], x[..., i1] = a * c - b * s, b * c + a * s
    return x


@pytest.mark.parametrize("interleaved, device_tables", [(False, True), (True, True),
                                                        (False, False)])
@pytest.mark.parametrize("Lq, new, is_causal", [(2, 2, True), (2, 2, False)])
def test_rotation_matches_cpu_and_reference(rng, interleaved, device_tables, Lq, new,
                                            is_causal):
    """Device tables (rows gathered on the device) and host tables (rows gathered on the
    host, then copied)."""
    B, Hq, H, E, Ev, S = 3, 4, 2, 7, 3, 20
    q = rng.standard_normal((B, Lq, Hq, E))
    kc = rng.standard_normal((B, S, H, E))
    vc = rng.standard_normal((B, S, H, Ev))
    k = rng.standard_normal((B, new, H, E))
    v = rng.standard_normal((B, new, H, Ev))
    lens = np.array([0, 4, 11])
    cos, sin = tables(16, 6)  # rotary_dim 6 < E = 7
    dq, dk_new, dkc, dvc = dev(q), dev(k), dev(kc), dev(vc)
    put = dev if device_tables else (lambda x: x)
    res, lse = kvattn(dq, dkc, dvc, lens, k=dk_new, v=dev(v), rotary_cos=put(cos),
                      rotary_sin=put(sin), rotary_interleaved=interleaved, is_causal=is_causal,
                      return_lse=True)
    np.testing.assert_array_equal(dq.copy_to_host(), q)  # inputs unmodified
    np.testing.assert_array_equal(dk_new.copy_to_host(), k)
    hk, hv = kc.copy(), vc.copy()
    ref, ref_lse = kvattn(q, hk, hv, lens, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                          rotary_interleaved=interleaved, is_causal=is_causal,
                          return_lse=True)  # the CPU path
    np.testing.assert_allclose(dkc.copy_to_host(), hk, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(dvc.copy_to_host(), hv)
    assert rel_err(res.copy_to_host(), ref) < 1e-13
    np.testing.assert_allclose(lse.copy_to_host(), ref_lse, rtol=1e-13)
    # the appended keys are k rotated at cache_seqlens + i
    kr = rotate64(k, cos, sin, lens[:, None] + np.arange(new)[None, :], interleaved)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(dkc.copy_to_host()[b, n:n + new], kr[b], rtol=1e-15,
                                   atol=1e-15)


def test_cache_batch_idx_matches_cpu_and_refusals(rng):
    B, Lq, Hq, H, E, Ev, S, N = 2, 1, 2, 1, 4, 4, 10, 4
    q = rng.standard_normal((B, Lq, Hq, E))
    kc = rng.standard_normal((N, S, H, E))
    vc = rng.standard_normal((N, S, H, Ev))
    k = rng.standard_normal((B, 1, H, E))
    v = rng.standard_normal((B, 1, H, Ev))
    lens = np.array([3, 7])
    idx = np.array([3, 1], np.int32)
    dkc, dvc = dev(kc), dev(vc)
    res = kvattn(dev(q), dkc, dvc, lens, k=dev(k), v=dev(v), cache_batch_idx=dev(idx))
    hk, hv = kc.copy(), vc.copy()
    ref = kvattn(q, hk, hv, lens, k=k, v=v, cache_batch_idx=idx)
    np.testing.assert_array_equal(dkc.copy_to_host(), hk)
    np.testing.assert_array_equal(dvc.copy_to_host(), hv)
    assert rel_err(res.copy_to_host(), ref) < 1e-13
    before = dkc.copy_to_host()
    for bad in (np.array([1, 1]), np.array([0, 4]), np.array([0])):
        with pytest.raises(ValueError, match="cache_batch_idx"):
            kvattn(dev(q), dkc, dvc, lens, k=dev(k), v=dev(v), cache_batch_idx=bad)
    with pytest.raises(ValueError, match="pass k and v"):
        kvattn(dev(q), dkc, dvc, lens, cache_batch_idx=idx, rotary_cos=dev(tables(12, 4)[0]),
               rotary_sin=dev(tables(12, 4)[1]))
    np.testing.assert_array_equal(dkc.copy_to_host(), before)
    assert sdpa_numba.kvcache_plan(dev(q), dkc, dvc, lens, cache_batch_idx=idx) is not None
