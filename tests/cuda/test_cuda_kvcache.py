"""attention_with_kvcache on CUDA arrays (the CUDA twin of the decode kernel), under the
simulator: against the CPU path and the per-sequence float64 reference."""

import numpy as np
import pytest
from numba import cuda

from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_cuda_testing import dev, rel_err, small_decode_blocks
from kvcache_checks import VARIANTS, check_against_reference, paged_pair


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    small_decode_blocks(monkeypatch)


def test_contiguous_cache_gqa_causal_and_empty_sequences(rng):
    B, Lq, Hq, H, E, Ev, S = 3, 2, 6, 2, 5, 3, 30
    q = rng.standard_normal((B, Lq, Hq, E))
    kc = rng.standard_normal((B, S, H, E))
    vc = rng.standard_normal((B, S, H, Ev))
    seqlens = np.array([0, 1, 27])  # empty, fewer keys than tokens, several chunks
    out = cuda.to_device(np.full((B, Lq, Hq, Ev), np.nan))
    res, lse = kvattn(dev(q), dev(kc), dev(vc), seqlens, out=out, return_lse=True)
    assert res is out
    res, lse = res.copy_to_host(), lse.copy_to_host()
    check_against_reference(q, kc, vc, seqlens, res, lse, True)
    ref, ref_lse = kvattn(q, kc, vc, seqlens, return_lse=True)  # the CPU path
    assert rel_err(res, ref) < 1e-13
    np.testing.assert_allclose(lse[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)],
                               rtol=1e-13)


def test_paged_append_across_pages_not_causal(rng):
    B, Lq, Hq, H, E, Ev, ps = 2, 1, 4, 1, 4, 5, 3
    n_pages = 16
    pk = rng.standard_normal((n_pages, ps, H, E))
    pv = rng.standard_normal((n_pages, ps, H, Ev))
    table = rng.permutation(n_pages)[:2 * 6].reshape(2, 6).astype(np.int32)
    seqlens = np.array([ps + 1, 2 * ps - 1])
    q = rng.standard_normal((B, Lq, Hq, E))
    kn = rng.standard_normal((B, 4, H, E))
    vn = rng.standard_normal((B, 4, H, Ev))
    dk, dv = dev(pk), dev(pv)
    res, lse = kvattn(dev(q), dk, dv, dev(seqlens), k=dev(kn), v=dev(vn),
                      block_table=dev(table), is_causal=False, return_lse=True)
    # The same on the CPU, on copies of the caches: the same caches and results.
    hk, hv = pk.copy(), pv.copy()
    ref, ref_lse = kvattn(q, hk, hv, seqlens, k=kn, v=vn, block_table=table, is_causal=False,
                          return_lse=True)
    np.testing.assert_array_equal(dk.copy_to_host(), hk)
    np.testing.assert_array_equal(dv.copy_to_host(), hv)
    assert rel_err(res.copy_to_host(), ref) < 1e-13
    np.testing.assert_allclose(lse.copy_to_host(), ref_lse, rtol=1e-13)
    check_against_reference(q, hk, hv, seqlens + 4, res.copy_to_host(), lse.copy_to_host(),
                            False, table=table)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_narrow_dtypes(rng, dtype):
    q = rng.standard_normal((1, 1, 2, 8)).astype(dtype)
    kc = rng.standard_normal((1, 12, 2, 8)).astype(dtype)
    vc = rng.standard_normal((1, 12, 2, 8)).astype(dtype)
    res, lse = kvattn(dev(q), dev(kc), dev(vc), np.array([11]), return_lse=True)
    assert res.dtype == dtype and lse.dtype == np.float32
    check_against_reference(q, kc, vc, [11], res.copy_to_host(), lse.copy_to_host(), True,
                            tol=1e-3 if dtype == np.float16 else 1e-5)


def test_mixing_host_and_device_arrays_is_refused(rng):
    q = rng.standard_normal((1, 1, 2, 4))
    kc = rng.standard_normal((1, 5, 2, 4))
    with pytest.raises(TypeError, match="mix host and device"):
        kvattn(dev(q), kc, dev(kc), np.array([3]))


@pytest.mark.parametrize("page_size", [None, 3])
def test_cache_leftpad_skips_the_padding(rng, page_size):
    # Padding inside the first chunk, past whole chunks, and of every key (zeros, -inf).
    B, Lq, Hq, H, E, Ev, S = 3, 2, 4, 2, 4, 3, 30
    q = rng.standard_normal((B, Lq, Hq, E))
    kc = rng.standard_normal((B, S, H, E))
    vc = rng.standard_normal((B, S, H, Ev))
    seqlens = np.array([9, 27, 5])
    leftpad = np.array([3, 19, 6], np.int32)
    kn = rng.standard_normal((B, 1, H, E))
    vn = rng.standard_normal((B, 1, H, Ev))
    kc, vc, table = paged_pair(rng, kc, vc, page_size)
    kw = {} if table is None else {"block_table": table}
    hk, hv = kc.copy(), vc.copy()
    ref, ref_lse = kvattn(q, hk, hv, seqlens, k=kn, v=vn, cache_leftpad=leftpad,
                          return_lse=True, **kw)
    # NaN in the padding of the device caches: read, it would show (0 * NaN in P V).
    pk, pv = hk.copy(), hv.copy()
    for b in range(B):
        j = np.arange(leftpad[b])
        if table is None:
            pk[b, j], pv[b, j] = np.nan, np.nan
        else:
            pk[table[b, j // page_size], j % page_size] = np.nan
            pv[table[b, j // page_size], j % page_size] = np.nan
    res, lse = kvattn(dev(q), dev(pk), dev(pv), seqlens, k=dev(kn), v=dev(vn),
                      cache_leftpad=dev(leftpad), return_lse=True,
                      **{k: dev(x) for k, x in kw.items()})
    res, lse = res.copy_to_host(), lse.copy_to_host()
    check_against_reference(q, hk, hv, seqlens + 1, res, lse, True, table=table,
                            leftpad=leftpad)
    assert rel_err(res, ref) < 1e-13
    np.testing.assert_array_equal(res[2], 0)
    assert np.all(lse[2] == -np.inf)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_against_the_reference_and_the_cpu(rng, variant, paged):
    # Lq > 1, GQA, an append, left padding (one sequence entirely), several chunks.
    B, Lq, Hq, H, E, Ev, S, ps = 3, 2, 4, 2, 4, 3, 30, 3
    kw = VARIANTS[variant](rng, B, Hq)
    is_causal = kw.pop("is_causal", True)
    q = rng.standard_normal((B, Lq, Hq, E))
    kc = rng.standard_normal((B, S, H, E))
    vc = rng.standard_normal((B, S, H, Ev))
    kc, vc, table = paged_pair(rng, kc, vc, ps if paged else None)
    pkw = {} if table is None else {"block_table": table}
    seqlens = np.array([26, 4, 7])
    leftpad = np.array([3, 0, 8])
    kn = rng.standard_normal((B, 1, H, E))
    vn = rng.standard_normal((B, 1, H, Ev))
    hk, hv = kc.copy(), vc.copy()
    ref, ref_lse = kvattn(q, hk, hv, seqlens, k=kn, v=vn, cache_leftpad=leftpad,
                          is_causal=is_causal, return_lse=True, **pkw, **kw)
    dkw = {k: (tuple(dev(a) for a in x) if k == "mod_args" else
               dev(x) if isinstance(x, np.ndarray) else x) for k, x in kw.items()}
    res, lse = kvattn(dev(q), dev(kc), dev(vc), seqlens, k=dev(kn), v=dev(vn),
                      cache_leftpad=leftpad, is_causal=is_causal, return_lse=True,
                      **{k: dev(x) for k, x in pkw.items()}, **dkw)
    res, lse = res.copy_to_host(), lse.copy_to_host()
    check_against_reference(q, hk, hv, seqlens + 1, res, lse, is_causal, table=table,
                            leftpad=leftpad, **kw)
    assert rel_err(res, ref) < 1e-13
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(lse[~finite], ref_lse[~finite])
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-13)


def test_a_plan_runs_device_layers_as_the_one_shot_call(rng):
    from sdpa_numba import kvcache_plan

    B, Lq, Hq, H, E, Ev, ps = 2, 1, 4, 2, 4, 3, 4
    seqlens = np.array([9, 3])
    table = np.array([[2, 0, 5], [1, 4, 3]], np.int32)
    layers = [[dev(rng.standard_normal(s)) for s in
               ((B, Lq, Hq, E), (6, ps, H, E), (6, ps, H, Ev), (B, 1, H, E), (B, 1, H, Ev))]
              for _ in range(2)]
    copies = [[dev(x.copy_to_host()) for x in layer] for layer in layers]
    q, kc, vc, k, v = layers[0]
    plan = kvcache_plan(q, kc, vc, dev(seqlens), k=k, v=v, block_table=dev(table))
    for layer, copy in zip(layers, copies):
        q, kc, vc, k, v = layer
        res, lse = plan.run(q, kc, vc, k=k, v=v, return_lse=True)
        cq, ckc, cvc, ck, cv = copy
        want, want_lse = kvattn(cq, ckc, cvc, seqlens, k=ck, v=cv, block_table=table,
                                return_lse=True)
        np.testing.assert_array_equal(res.copy_to_host(), want.copy_to_host())
        np.testing.assert_array_equal(lse.copy_to_host(), want_lse.copy_to_host())
        np.testing.assert_array_equal(kc.copy_to_host(), ckc.copy_to_host())
    read = kvcache_plan(q, kc, vc, seqlens, block_table=table)
    with pytest.raises(TypeError, match="made for cuda arrays, got host arrays"):
        read.run(q.copy_to_host(), kc.copy_to_host(), vc.copy_to_host())
