"""cascade_attention on CUDA arrays (Numba's simulator unless SDPA_NUMBA_REAL_GPU=1): against
the CPU cascade_attention on the same inputs and the float64 reference over each request's
concatenated cache; GQA, paged suffixes, the append, an empty prefix, out= and lse; bad input
refused with nothing written. Tiny sizes: the simulator runs every thread in Python."""

import numpy as np
import pytest

from sdpa_numba import cascade_attention
from sdpa_cuda_testing import SIMULATED, dev, permuted
from test_cascade import _check, _paged, _reference

# Odd sizes: GQA (Hq 6 over H 2), Ev != E; suffix lengths with one shorter than Lq (a causal
# token that sees no suffix key still sees the prefix) and an empty one.
B, LQ, HQ, H, E, EV, S_MAX = 3, 2, 6, 2, 8, 6, 7
LENS = np.array([4, 1, 0])


def _make(rng, p, dtype=np.float32):
    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)

    return r(B, LQ, HQ, E), r(p, H, E), r(p, H, EV), r(B, S_MAX, H, E), r(B, S_MAX, H, EV)


def _close_to_cpu(x, ref):
    """The CUDA result against the CPU's: the simulator computes in NumPy with the same
    steps, a GPU in other orders."""
    np.testing.assert_allclose(x, ref, rtol=1e-6 if SIMULATED else 1e-5,
                               atol=1e-6 if SIMULATED else 1e-5)


@pytest.mark.parametrize("page_size,causal,dtype", [
    (None, True, np.float32), (1, True, np.float32), (3, True, np.float32),
    (None, False, np.float32), (3, False, np.float64)])
def test_against_the_cpu_and_the_concatenated_cache(rng, page_size, causal, dtype):
    q, pk, pv, kc, vc = _make(rng, 5, dtype)
    ks = [kc[i, :LENS[i]] for i in range(B)]
    vs = [vc[i, :LENS[i]] for i in range(B)]
    table = None
    if page_size is not None:
        kc, vc, table = _paged(rng, kc, vc, page_size)
    cpu_out, cpu_lse = cascade_attention(q, pk, pv, kc, vc, LENS, block_table=table,
                                         is_causal=causal, return_lse=True)
    out = dev(np.full((B, LQ, HQ, EV), np.nan, dtype))
    res, lse = cascade_attention(dev(q), dev(pk), dev(pv), dev(kc), dev(vc), LENS,
                                 block_table=table, is_causal=causal, return_lse=True, out=out)
    assert res is out
    res, lse = res.copy_to_host(), lse.copy_to_host()
    assert lse.shape == (B, HQ, LQ) and lse.dtype == dtype
    _check(res, lse, *_reference(q, pk, pv, ks, vs, causal), dtype)
    _close_to_cpu(res, cpu_out)
    _close_to_cpu(lse, cpu_lse)


def test_append_writes_the_paged_suffix_as_the_cpu_does(rng):
    q, pk, pv, kc, vc = _make(rng, 4)
    k_new, v_new = (rng.standard_normal((B, LQ, H, d)).astype(np.float32) for d in (E, EV))
    ks = [np.concatenate([kc[i, :LENS[i]], k_new[i]]) for i in range(B)]
    vs = [np.concatenate([vc[i, :LENS[i]], v_new[i]]) for i in range(B)]
    kc, vc, table = _paged(rng, kc, vc, 3)
    cpu_kc, cpu_vc = kc.copy(), vc.copy()
    cpu_out = cascade_attention(q, pk, pv, cpu_kc, cpu_vc, LENS, k=k_new, v=v_new,
                                block_table=table)
    d_kc, d_vc = dev(kc), dev(vc)
    out, lse = cascade_attention(dev(q), dev(pk), dev(pv), d_kc, d_vc, LENS, k=dev(k_new),
                                 v=dev(v_new), block_table=table, return_lse=True)
    _check(out.copy_to_host(), lse.copy_to_host(), *_reference(q, pk, pv, ks, vs, True),
           np.float32)
    _close_to_cpu(out.copy_to_host(), cpu_out)
    # the new keys written where the CPU writes them, and nothing else touched (NaN pages
    # compared as bits)
    assert d_kc.copy_to_host().tobytes() == cpu_kc.tobytes()
    assert d_vc.copy_to_host().tobytes() == cpu_vc.tobytes()


def test_empty_prefix_and_strided_query(rng):
    # P = 0: the shared level sees no key (lse -inf), the result is the suffix's alone; the
    # query a permuted view (its fold reads the strides).
    q, pk, pv, kc, vc = _make(rng, 0)
    lens = np.array([4, 2, 7])
    ks = [kc[i, :lens[i]] for i in range(B)]
    vs = [vc[i, :lens[i]] for i in range(B)]
    d_q = permuted(dev(q.transpose(0, 2, 1, 3)), (0, 2, 1, 3))
    assert not d_q.is_c_contiguous()
    out, lse = cascade_attention(d_q, dev(pk), dev(pv), dev(kc), dev(vc), lens,
                                 return_lse=True)
    _check(out.copy_to_host(), lse.copy_to_host(), *_reference(q, pk, pv, ks, vs, True),
           np.float32)
    _close_to_cpu(out.copy_to_host(), cascade_attention(q, pk, pv, kc, vc, lens))


def test_bad_input_is_refused_and_nothing_is_written(rng):
    q, pk, pv, kc, vc = _make(rng, 5)
    k_new = rng.standard_normal((B, 1, H, E)).astype(np.float32)
    v_new = rng.standard_normal((B, 1, H, EV)).astype(np.float32)
    d_kc, d_vc = dev(kc), dev(vc)
    out = dev(np.full((B, LQ, HQ, EV), np.nan, np.float32))
    good = dict(k=dev(k_new), v=dev(v_new), out=out)
    bad_calls = [
        # the prefix's H differs from the caches'
        ((dev(q), dev(pk[:, :1]), dev(pv), d_kc, d_vc, LENS), good, ValueError, "prefix_k"),
        # the prefix's dtype differs from q's
        ((dev(q), dev(pk.astype(np.float64)), dev(pv), d_kc, d_vc, LENS), good, TypeError,
         "prefix_k"),
        # as many prefix keys as values
        ((dev(q), dev(pk), dev(pv[:3]), d_kc, d_vc, LENS), good, ValueError, "prefix_v"),
        # out of the wrong shape
        ((dev(q), dev(pk), dev(pv), d_kc, d_vc, LENS),
         dict(good, out=dev(np.zeros((B, LQ, HQ, E), np.float32))), ValueError, "out"),
        # a suffix beyond the cache after the append
        ((dev(q), dev(pk), dev(pv), d_kc, d_vc, np.array([4, 7, 0])), good, ValueError,
         "cache"),
    ]
    for args, kw, err, name in bad_calls:
        with pytest.raises(err, match=name):
            cascade_attention(*args, **kw)
    assert d_kc.copy_to_host().tobytes() == kc.tobytes()
    assert d_vc.copy_to_host().tobytes() == vc.tobytes()
    assert np.isnan(out.copy_to_host()).all()
    with pytest.raises(TypeError):  # a mix of host and device arrays: the target's refusal
        cascade_attention(q, dev(pk), pk, kc, kc, 2)


def test_float16_against_the_cpu(rng):
    # float16 storage, float32 compute: each level rounded to float16 before the merge, on
    # both targets; within a unit or two in the last place of the CPU's result.
    q, pk, pv, kc, vc = _make(rng, 5, np.float16)
    kc, vc, table = _paged(rng, kc, vc, 3)
    cpu_out, cpu_lse = cascade_attention(q, pk, pv, kc, vc, LENS, block_table=table,
                                         return_lse=True)
    out, lse = cascade_attention(dev(q), dev(pk), dev(pv), dev(kc), dev(vc), LENS,
                                 block_table=table, return_lse=True)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    assert out.dtype == np.float16 and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float32), cpu_out.astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, cpu_lse, rtol=1e-5, atol=1e-5)
