"""cascade_attention: a prefix shared by the batch, then each request's own cache, merged by
lse; against the float64 reference over each request's concatenated cache."""

import numpy as np
import pytest

from checks import TOL, rel_err
from sdpa_numba import attention_with_kvcache, cascade_attention
from sdpa_numba.reference import attention


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _make(rng, b, lq, hq, h, e, ev, p, s_max, dtype=np.float32):
    q = _rand(rng, (b, lq, hq, e), dtype)
    pk, pv = _rand(rng, (p, h, e), dtype), _rand(rng, (p, h, ev), dtype)
    kc, vc = _rand(rng, (b, s_max, h, e), dtype), _rand(rng, (b, s_max, h, ev), dtype)
    return q, pk, pv, kc, vc


def _paged(rng, kc, vc, page_size):
    """The contiguous caches' keys in shuffled pages (one spare page), and the table."""
    b, s_max = kc.shape[:2]
    per = -(-s_max // page_size)
    order = rng.permutation(b * per + 1)
    table = order[:b * per].reshape(b, per).astype(np.int32)

    def pages(c):
        x = np.full((b * per + 1, page_size, *c.shape[2:]), np.nan, c.dtype)
        pad = np.pad(c, ((0, 0), (0, per * page_size - s_max), (0, 0), (0, 0)))
        x[table.reshape(-1)] = pad.reshape(b * per, page_size, *c.shape[2:])
        return x

    return pages(kc), pages(vc), table


def _reference(q, pk, pv, ks, vs, causal):
    """Per request ``b``: the float64 reference over ``prefix + ks[b]`` (every prefix key
    visible; the suffix causal bottom-right in its own frame)."""
    outs, lses = [], []
    p, lq = len(pk), q.shape[1]
    for b in range(q.shape[0]):
        k = np.concatenate([pk, ks[b]]).astype(np.float64)
        v = np.concatenate([pv, vs[b]]).astype(np.float64)
        n = len(ks[b])
        t = np.arange(lq)[:, None]
        j = np.arange(p + n)[None, :]
        mask = (j < p) | (j - p <= n - lq + t) if causal else np.ones((lq, p + n), bool)
        o, lse = attention(q[b].astype(np.float64).transpose(1, 0, 2), k.transpose(1, 0, 2),
                           v.transpose(1, 0, 2), attn_mask=mask, enable_gqa=True)
        outs.append(o.transpose(1, 0, 2))
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


def _check(out, lse, ref_out, ref_lse, dtype):
    assert rel_err(out, ref_out) < TOL[dtype]
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(lse[~finite], ref_lse[~finite])
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5 if dtype is np.float32
                               else 1e-13, atol=1e-5 if dtype is np.float32 else 1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_against_the_concatenated_cache(rng, dtype, page_size, causal):
    # Odd sizes, GQA (Hq 6 over H 2), Ev != E, a chunk-crossing suffix, an empty one, one
    # shorter than Lq (causal tokens that see no suffix key still see the prefix).
    b, lq, hq, h, e, ev, p, s_max = 4, 3, 6, 2, 24, 40, 77, 700
    q, pk, pv, kc, vc = _make(rng, b, lq, hq, h, e, ev, p, s_max, dtype)
    lens = np.array([5, 0, 613, 1])
    ks = [kc[i, :lens[i]] for i in range(b)]
    vs = [vc[i, :lens[i]] for i in range(b)]
    table = None
    if page_size is not None:
        kc, vc, table = _paged(rng, kc, vc, page_size)
    out = np.full((b, lq, hq, ev), np.nan, dtype)
    res, lse = cascade_attention(q, pk, pv, kc, vc, lens, block_table=table, is_causal=causal,
                                 return_lse=True, out=out)
    assert res is out and lse.shape == (b, hq, lq) and lse.dtype == dtype
    _check(out, lse, *_reference(q, pk, pv, ks, vs, causal), dtype)
    # without return_lse, the output alone, the same bits
    again = cascade_attention(q, pk, pv, kc, vc, lens, block_table=table, is_causal=causal)
    assert again.tobytes() == out.tobytes()


@pytest.mark.parametrize("page_size", [None, 16])
def test_append_writes_the_new_keys_and_attends_them(rng, page_size):
    b, lq, hq, h, e, ev, p, s_max = 3, 2, 4, 1, 16, 16, 33, 90
    q, pk, pv, kc, vc = _make(rng, b, lq, hq, h, e, ev, p, s_max)
    lens = np.array([0, 41, 87])  # 87 + 2 = 89 <= 90: fits
    k_new, v_new = _rand(rng, (b, lq, h, e), np.float32), _rand(rng, (b, lq, h, ev),
                                                               np.float32)
    ks = [np.concatenate([kc[i, :lens[i]], k_new[i]]) for i in range(b)]
    vs = [np.concatenate([vc[i, :lens[i]], v_new[i]]) for i in range(b)]
    table = None
    if page_size is not None:
        kc, vc, table = _paged(rng, kc, vc, page_size)
    out, lse = cascade_attention(q, pk, pv, kc, vc, lens, k=k_new, v=v_new, block_table=table,
                                 return_lse=True)
    _check(out, lse, *_reference(q, pk, pv, ks, vs, True), np.float32)
    for i in range(b):  # written into the suffix cache, as attention_with_kvcache does
        for t in range(lq):
            j = lens[i] + t
            row = kc[i, j] if table is None else kc[table[i, j // page_size], j % page_size]
            assert row.tobytes() == k_new[i, t].tobytes()


def test_equals_attention_with_kvcache_over_the_whole_cache(rng):
    # Where every token sits at or after the suffix's start (n >= Lq), the same as one
    # attention_with_kvcache over the concatenated caches, up to rounding.
    b, lq, hq, h, e, ev, p, s_max = 5, 1, 8, 2, 32, 32, 129, 60
    q, pk, pv, kc, vc = _make(rng, b, lq, hq, h, e, ev, p, s_max)
    lens = np.array([1, 60, 17, 33, 2])
    out, lse = cascade_attention(q, pk, pv, kc, vc, lens, return_lse=True)
    whole_k = np.concatenate([np.broadcast_to(pk, (b, p, h, e)), kc], 1)
    whole_v = np.concatenate([np.broadcast_to(pv, (b, p, h, ev)), vc], 1)
    ref, ref_lse = attention_with_kvcache(q, whole_k, whole_v, lens + p, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_empty_prefix_and_empty_suffixes(rng):
    b, lq, hq, h, e, ev, s_max = 2, 1, 4, 2, 8, 8, 20
    q, pk, pv, kc, vc = _make(rng, b, lq, hq, h, e, ev, 0, s_max)
    lens = np.array([7, 0])
    out, lse = cascade_attention(q, pk, pv, kc, vc, lens, return_lse=True)
    ref, ref_lse = attention_with_kvcache(q, kc, vc, lens, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[1], 0)  # no key at all: zeros, lse -inf
    assert (lse[1] == -np.inf).all()
    np.testing.assert_allclose(lse[0], ref_lse[0], rtol=1e-6)
    # a prefix and no suffix anywhere: the prefix alone
    _, pk, pv, _, _ = _make(rng, b, lq, hq, h, e, ev, 11, s_max)
    out, lse = cascade_attention(q, pk, pv, kc, vc, 0, return_lse=True)
    _check(out, lse, *_reference(q, pk, pv, [kc[0, :0]] * b, [vc[0, :0]] * b, True),
           np.float32)


def test_batch_invariant(rng):
    # A request's bits do not depend on the rest of the batch nor its place in it.
    lq, hq, h, e, ev, p, s_max = 1, 4, 2, 16, 16, 300, 200
    q, pk, pv, kc, vc = _make(rng, 9, lq, hq, h, e, ev, p, s_max)
    lens = rng.integers(0, s_max, 9)
    alone = [cascade_attention(q[i:i + 1], pk, pv, kc[i:i + 1], vc[i:i + 1], lens[i:i + 1],
                               return_lse=True) for i in range(9)]
    together = cascade_attention(q, pk, pv, kc, vc, lens, return_lse=True)
    for i, (o, lse) in enumerate(alone):
        assert o[0].tobytes() == together[0][i].tobytes()
        assert lse[0].tobytes() == together[1][i].tobytes()


def _snapshot(*arrays):
    return [np.ascontiguousarray(a).tobytes() for a in arrays]


def test_refused_calls_name_the_argument_and_write_nothing(rng):
    b, lq, hq, h, e, ev, p, s_max = 2, 2, 4, 2, 8, 12, 5, 10
    q, pk, pv, kc, vc = _make(rng, b, lq, hq, h, e, ev, p, s_max)
    lens = np.array([3, 4])
    k_new, v_new = _rand(rng, (b, lq, h, e), np.float32), _rand(rng, (b, lq, h, ev),
                                                               np.float32)
    out = np.full((b, lq, hq, ev), 7.0, np.float32)
    arrays = (q, pk, pv, kc, vc, k_new, v_new, out)
    before = _snapshot(*arrays)

    def refused(exc, match, **change):
        args = dict(q=q, prefix_k=pk, prefix_v=pv, k_cache=kc, v_cache=vc, cache_seqlens=lens,
                    k=k_new, v=v_new, out=out)
        args.update(change)
        with pytest.raises(exc, match=match):
            cascade_attention(args.pop("q"), args.pop("prefix_k"), args.pop("prefix_v"),
                              args.pop("k_cache"), args.pop("v_cache"),
                              args.pop("cache_seqlens"), **args)
        assert _snapshot(*arrays) == before

    refused(ValueError, "prefix_k must have 3 dims", prefix_k=pk[None])
    refused(ValueError, r"prefix_k must have shape \(P, 2, 8\)", prefix_k=pk[:, :1])
    refused(ValueError, r"prefix_v must have shape \(P, 2, 12\)", prefix_v=pv[..., :8])
    refused(TypeError, "prefix_v dtype float64 differs from q dtype float32",
            prefix_v=pv.astype(np.float64))
    refused(TypeError, "prefix_k dtype int32 is not supported", prefix_k=pk.astype(np.int32))
    refused(ValueError, "prefix_k and prefix_v must hold as many", prefix_v=pv[:4])
    refused(TypeError, "return_lse must be a bool", return_lse=1)
    refused(ValueError, "out overlaps prefix_v",
            prefix_v=out.reshape(-1)[:p * h * ev].reshape(p, h, ev))
    refused(ValueError, "out must have shape", out=out[:1])
    refused(ValueError, "k and v must be given together", v=None)
    refused(ValueError, "beyond the cache", cache_seqlens=np.array([3, 9]))
    refused(TypeError, "scale must be a real number", scale="1")
    refused(ValueError, "k_cache must be writeable",
            k_cache=np.lib.stride_tricks.as_strided(kc, writeable=False))
    with pytest.raises(TypeError):
        cascade_attention(q, pk, pv, kc, vc, lens, window=(3, 0))  # no variants


def test_bfloat16_within_its_rounding(rng):
    # Each level is rounded to bfloat16 before the merge (a half unit, 2**-8 relative, of a
    # part's output, whose elements are at most max|v|), then the merged row once more.
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    b, lq, hq, h, e, ev, p, s_max = 3, 1, 4, 2, 16, 16, 45, 30
    q, pk, pv, kc, vc = _make(rng, b, lq, hq, h, e, ev, p, s_max, bf16)
    lens = np.array([0, 29, 7])
    out, lse = cascade_attention(q, pk, pv, kc, vc, lens, return_lse=True)
    assert out.dtype == bf16 and lse.dtype == np.float32
    ref, ref_lse = _reference(q, pk, pv, [kc[i, :lens[i]] for i in range(b)],
                              [vc[i, :lens[i]] for i in range(b)], True)
    err = np.abs(out.astype(np.float64) - ref)
    max_v = max(np.abs(pv.astype(np.float32)).max(), np.abs(vc.astype(np.float32)).max())
    assert (err <= 1.01 * 2.0 ** -8 * (np.abs(ref) + max_v)).all()
    assert rel_err(out, ref) < 4e-3
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
