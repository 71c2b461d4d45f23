"""Mixed, ragged batches over a cache on CUDA arrays (the decode kernel's CUDA twin with a
ragged batch's table), under the simulator: against the per-sequence float64 reference and
one call per request."""

import numpy as np
import pytest
from numba import cuda

from sdpa_numba import attention_with_kvcache, varlen_attention
from sdpa_cuda_testing import dev, small_decode_blocks
from test_ragged_paged import H, HQ, LQ, USED, _cu, _gather, _paged, _reference

E = 8  # small for the simulator
TOL = dict(rtol=1e-12, atol=1e-13)


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    small_decode_blocks(monkeypatch, chunk=16)


def _cache(rng, used, page_size):
    kc, vc, table = _paged(rng, used, page_size, dtype=np.float64)
    return kc[..., :E].copy(), vc[..., :E].copy(), table


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_varlen_block_table_on_device(rng, alignment):
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E))
    kc, vc, table = _cache(rng, USED, 7)
    used = np.array(USED)
    out = cuda.to_device(np.full((cu[-1], HQ, E), np.nan))
    got, lse = varlen_attention(dev(q), dev(kc), dev(vc), cu, block_table=table,
                                seqused_k=used, is_causal=True, alignment=alignment,
                                out=out, return_lse=True)
    assert got is out
    got, lse = got.copy_to_host(), lse.copy_to_host()
    keys = [_gather(kc, table, b, u) for b, u in enumerate(USED)]
    values = [_gather(vc, table, b, u) for b, u in enumerate(USED)]
    ref_out, ref_lse = _reference(q, cu, keys, values, is_causal=True, alignment=alignment)
    np.testing.assert_allclose(got, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


def test_varlen_seqused_k_packed_on_device(rng):
    lengths = [40, 24, 64, 16]
    cu, cu_k = _cu(LQ), _cu(lengths)
    q = rng.standard_normal((cu[-1], HQ, E))
    k = rng.standard_normal((cu_k[-1], H, E))
    v = rng.standard_normal((cu_k[-1], H, E))
    got = varlen_attention(dev(q), dev(k), dev(v), cu, cu_k, seqused_k=np.array(USED),
                           is_causal=True, alignment="bottom_right").copy_to_host()
    keys = [k[cu_k[b]:cu_k[b] + u] for b, u in enumerate(USED)]
    values = [v[cu_k[b]:cu_k[b] + u] for b, u in enumerate(USED)]
    ref_out, _ = _reference(q, cu, keys, values, is_causal=True, alignment="bottom_right")
    np.testing.assert_allclose(got, ref_out, **TOL)


def test_kvcache_ragged_append_on_device(rng):
    """A mixed batch with appends on the device: the per-request calls' results and caches,
    and the reference."""
    lq = [1, 5, 17, 0, 3]
    lens = np.array([36, 15, 43, 9, 0])
    cu = _cu(lq)
    q = rng.standard_normal((cu[-1], HQ, E))
    k = rng.standard_normal((cu[-1], H, E))
    v = rng.standard_normal((cu[-1], H, E))
    kc, vc, table = _cache(rng, list(lens + np.array(lq)), 16)
    d_kc, d_vc = dev(kc), dev(vc)
    got, lse = attention_with_kvcache(dev(q), d_kc, d_vc, lens, k=dev(k), v=dev(v),
                                      block_table=table, cu_seqlens_q=cu, return_lse=True)
    got, lse = got.copy_to_host(), lse.copy_to_host()
    kc1, vc1 = dev(kc), dev(vc)
    for b in range(len(lq)):
        r = slice(cu[b], cu[b + 1])
        o, l = attention_with_kvcache(dev(q[None, r]), kc1, vc1, lens[b:b + 1],
                                      k=dev(k[None, r]), v=dev(v[None, r]),
                                      block_table=table[b:b + 1], return_lse=True)
        np.testing.assert_array_equal(o.copy_to_host()[0], got[r])
        np.testing.assert_array_equal(l.copy_to_host()[0], lse[:, r])
    kc_after, vc_after = d_kc.copy_to_host(), d_vc.copy_to_host()
    np.testing.assert_array_equal(kc_after, kc1.copy_to_host())
    np.testing.assert_array_equal(vc_after, vc1.copy_to_host())
    n = lens + np.array(lq)
    keys = [_gather(kc_after, table, b, n[b]) for b in range(len(lq))]
    values = [_gather(vc_after, table, b, n[b]) for b in range(len(lq))]
    ref_out, ref_lse = _reference(q, cu, keys, values, is_causal=True,
                                  alignment="bottom_right")
    np.testing.assert_allclose(got, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


def test_kvcache_ragged_rotary_on_device(rng):
    lq = [1, 5, 0, 3]
    lens = np.array([20, 7, 4, 0])
    cu = _cu(lq)
    cos = rng.standard_normal((40, 3))
    sin = rng.standard_normal((40, 3))
    kc, vc, table = _cache(rng, list(lens + np.array(lq)), 16)
    q = rng.standard_normal((cu[-1], HQ, E))
    k = rng.standard_normal((cu[-1], H, E))
    v = rng.standard_normal((cu[-1], H, E))
    d_kc, d_vc = dev(kc), dev(vc)
    got = attention_with_kvcache(dev(q), d_kc, d_vc, lens, k=dev(k), v=dev(v),
                                 block_table=table, cu_seqlens_q=cu, rotary_cos=cos,
                                 rotary_sin=sin).copy_to_host()
    kc1, vc1 = dev(kc), dev(vc)
    for b in range(len(lq)):
        r = slice(cu[b], cu[b + 1])
        o = attention_with_kvcache(dev(q[None, r]), kc1, vc1, lens[b:b + 1],
                                   k=dev(k[None, r]), v=dev(v[None, r]),
                                   block_table=table[b:b + 1], rotary_cos=cos, rotary_sin=sin)
        np.testing.assert_array_equal(o.copy_to_host()[0], got[r])
    np.testing.assert_array_equal(d_kc.copy_to_host(), kc1.copy_to_host())
