"""attention_with_kvcache: contiguous and paged caches, in-place append, bottom-right causal,
GQA, split-KV, against per-sequence float64 references."""

import numba
import numpy as np
import pytest

import sdpa_numba.cpu.launch_decode as launch_decode
from checks import TOL
from kvcache_checks import VARIANTS, at_thread_counts, check_against_reference, paged_pair
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba.cpu.decode import BN, CHUNK


def make(rng, B, Lq, Hq, H, E, Ev, S, dtype=np.float64):
    q = rng.standard_normal((B, Lq, Hq, E)).astype(dtype)
    kc = rng.standard_normal((B, S, H, E)).astype(dtype)
    vc = rng.standard_normal((B, S, H, Ev)).astype(dtype)
    return q, kc, vc


@pytest.mark.parametrize("causal", [True, False])
def test_contiguous_cache_gqa_split_and_empty_sequences(rng, causal):
    # Sequence lengths: empty, one key, fewer keys than query tokens, and one split into
    # several chunks (merged by lse).
    q, kc, vc = make(rng, 4, 3, 6, 2, 9, 7, CHUNK + 300)
    seqlens = np.array([0, 1, 2, CHUNK + 251], np.int32)
    copies = [x.copy() for x in (q, kc, vc, seqlens)]
    out = np.full((4, 3, 6, 7), np.nan)
    res, lse = kvattn(q, kc, vc, seqlens, is_causal=causal, return_lse=True, out=out)
    assert res is out and lse.shape == (4, 6, 3) and lse.dtype == np.float64
    for x, c in zip((q, kc, vc, seqlens), copies):
        np.testing.assert_array_equal(x, c)  # nothing appended: nothing written
    check_against_reference(q, kc, vc, seqlens, out, lse, causal)
    np.testing.assert_array_equal(out[0], 0)
    assert np.all(lse[0] == -np.inf)


def test_append_then_attend_contiguous(rng):
    q, kc, vc = make(rng, 3, 4, 4, 4, 8, 5, 40)
    kn = rng.standard_normal((3, 4, 4, 8))
    vn = rng.standard_normal((3, 4, 4, 5))
    seqlens = np.array([0, 17, 36])
    before_k, before_v = kc.copy(), vc.copy()
    out, lse = kvattn(q, kc, vc, seqlens, k=kn, v=vn, return_lse=True, scale=0.3)
    expect_k, expect_v = before_k.copy(), before_v.copy()
    for b, n in enumerate(seqlens):
        expect_k[b, n:n + 4] = kn[b]
        expect_v[b, n:n + 4] = vn[b]
    np.testing.assert_array_equal(kc, expect_k)  # exactly the named slots changed
    np.testing.assert_array_equal(vc, expect_v)
    check_against_reference(q, kc, vc, seqlens + 4, out, lse, True, scale=0.3)


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_cache_matches_reference_and_contiguous(rng, page_size):
    q, kc, vc = make(rng, 3, 2, 4, 2, 6, 5, CHUNK + 40)
    seqlens = np.array([CHUNK + 33, 0, 23])
    pk, pv, table = paged_pair(rng, kc, vc, page_size)
    out, lse = kvattn(q, pk, pv, seqlens, block_table=table, return_lse=True)
    check_against_reference(q, kc, vc, seqlens, out, lse, True)
    out_c, lse_c = kvattn(q, kc, vc, seqlens, return_lse=True)
    np.testing.assert_array_equal(out, out_c)  # the same keys in the same order: bitwise
    np.testing.assert_array_equal(lse, lse_c)


@pytest.mark.parametrize("page_size", [1, 3])
def test_paged_append_crosses_page_boundaries(rng, page_size):
    B, H, E, Ev, new = 2, 2, 4, 3, 5
    n_pages = 20
    pk = rng.standard_normal((n_pages, page_size, H, E))
    pv = rng.standard_normal((n_pages, page_size, H, Ev))
    table = rng.permutation(n_pages)[:2 * 8].reshape(2, 8).astype(np.int32)
    table[1, 7:] = -1  # unused entries are not read
    seqlens = np.array([2 * page_size - 1, page_size + 1])  # appends start mid-page
    q = rng.standard_normal((B, 3, 4, E))
    kn = rng.standard_normal((B, new, H, E))
    vn = rng.standard_normal((B, new, H, Ev))
    before_k, before_v = pk.copy(), pv.copy()
    out, lse = kvattn(q, pk, pv, seqlens, k=kn, v=vn, block_table=table, return_lse=True)
    expect_k, expect_v = before_k.copy(), before_v.copy()
    for b in range(B):
        for t in range(new):
            j = seqlens[b] + t
            expect_k[table[b, j // page_size], j % page_size] = kn[b, t]
            expect_v[table[b, j // page_size], j % page_size] = vn[b, t]
    np.testing.assert_array_equal(pk, expect_k)
    np.testing.assert_array_equal(pv, expect_v)
    check_against_reference(q, pk, pv, seqlens + new, out, lse, True, table=table)


def test_shared_prefix_pages_are_read(rng):
    # Two sequences read the same prefix pages (a shared prompt), then pages of their own.
    ps, H, E = 4, 1, 5
    pk = rng.standard_normal((6, ps, H, E))
    pv = rng.standard_normal((6, ps, H, E))
    table = np.array([[0, 1, 2], [0, 1, 3]], np.int32)
    seqlens = np.array([10, 9])
    q = rng.standard_normal((2, 1, 2, E))
    out, lse = kvattn(q, pk, pv, seqlens, block_table=table, return_lse=True)
    check_against_reference(q, pk, pv, seqlens, out, lse, True, table=table)
    # Appending into a sequence's own page is allowed; into a shared one is not.
    kn = rng.standard_normal((2, 1, H, E))
    kvattn(q, pk, pv, seqlens, k=kn, v=kn, block_table=table)
    before = pk.copy()
    with pytest.raises(ValueError, match="page 1, which block_table lists more than once"):
        kvattn(q, pk, pv, np.array([7, 9]), k=kn, v=kn, block_table=table)
    np.testing.assert_array_equal(pk, before)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_narrow_dtypes(rng, dtype):
    q, kc, vc = make(rng, 2, 2, 4, 1, 16, 8, 70, dtype)
    seqlens = np.array([70, 31])
    out, lse = kvattn(q, kc, vc, seqlens, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    check_against_reference(q, kc, vc, seqlens, out, lse, True, tol=TOL[dtype])


def test_result_does_not_depend_on_threads(rng, monkeypatch):
    # Which kernel runs (serial below SERIAL_BYTES, parallel above) depends on the shape only,
    # and the parallel kernel's result does not depend on the thread count: bit for bit.
    q, kc, vc = make(rng, 2, 2, 4, 2, 8, 8, 3 * CHUNK + 10)
    seqlens = np.array([3 * CHUNK + 10, CHUNK - 1])
    serial = kvattn(q, kc, vc, seqlens, return_lse=True)
    monkeypatch.setattr(launch_decode, "SERIAL_BYTES", 0)
    results = at_thread_counts(lambda: kvattn(q, kc, vc, seqlens, return_lse=True))
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    # The serial and the parallel kernel share one body (_chunk, kept out of line), but each
    # compiled kernel carries its own machine code for it: compiled in one process they agree
    # bit for bit, while one loaded from Numba's cache (compiled by another process, say a
    # second pytest-xdist worker) may round differently in the last bit (reassociation).
    np.testing.assert_allclose(results[0][0], serial[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(results[0][1], serial[1], rtol=1e-13, atol=1e-15)


def test_bad_input_is_refused_before_anything_is_written(rng):
    q, kc, vc = make(rng, 2, 1, 4, 2, 4, 4, 8)
    kn = rng.standard_normal((2, 3, 2, 4))
    before = kc.copy(), vc.copy()
    sl = np.array([5, 4])

    def refused(exc, match, *args, **kw):
        with pytest.raises(exc, match=match):
            kvattn(*args, **kw)
        np.testing.assert_array_equal(kc, before[0])
        np.testing.assert_array_equal(vc, before[1])

    refused(ValueError, r"cache_seqlens\[0\] \+ Lq_new = 6 \+ 3 is beyond the cache's 8",
            q, kc, vc, np.array([6, 0]), k=kn, v=kn)
    refused(ValueError, r"cache_seqlens\[1\] = 9 is beyond", q, kc, vc, np.array([1, 9]))
    refused(ValueError, "cache_seqlens must be >= 0", q, kc, vc, np.array([-1, 0]))
    refused(TypeError, "cache_seqlens must be an integer array", q, kc, vc, sl * 1.0)
    refused(ValueError, r"cache_seqlens must have shape \(2,\)", q, kc, vc, np.array([1]))
    refused(ValueError, "k and v must be given together", q, kc, vc, sl, k=kn)
    refused(ValueError, "k and v must have shapes", q, kc, vc, sl, k=kn, v=kn[:, :2])
    refused(TypeError, "k dtype float32 differs", q, kc, vc, sl, k=kn.astype(np.float32),
            v=kn)
    refused(TypeError, "v_cache dtype float32 differs", q, kc, vc.astype(np.float32), sl)
    refused(ValueError, "multiple of the cache's heads", q[:, :, :3], kc, vc, sl)
    refused(ValueError, "k_cache's last dim must equal q's", q[..., :3], kc, vc, sl)
    refused(ValueError, "q must have 4 dims", q[0], kc, vc, sl)
    refused(ValueError, "contiguous k_cache must have q's batch size", q[:1], kc, vc,
            sl[:1])
    refused(ValueError, "k_cache's last dim must be contiguous", q[..., :2], kc[..., ::2],
            vc, sl)
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    pk = rng.standard_normal((6, 3, 2, 4))
    refused(ValueError, "block_table has entry 6", q, pk, pk, sl,
            block_table=np.array([[0, 6, 2], [3, 4, 5]], np.int32))
    refused(ValueError, "block_table has entry -1", q, pk, pk, sl,
            block_table=np.array([[0, 1, 2], [-1, 4, 5]], np.int32))
    refused(TypeError, "block_table must be an integer array", q, pk, pk, sl,
            block_table=table * 1.0)
    refused(ValueError, r"beyond the cache's 9 slots per sequence \(max_pages \* page_size\)",
            q, pk, pk, np.array([7, 0]), k=kn, v=kn, block_table=table)
    refused(ValueError, "alignment is 'bottom_right'", q, kc, vc, sl, alignment="top_left")
    refused(ValueError, "alignment must be", q, kc, vc, sl, alignment="middle")
    refused(NotImplementedError, "does not take a block_mask", q, kc, vc, sl,
            block_mask=object())
    refused(ValueError, "softcap must be finite and > 0", q, kc, vc, sl, softcap=-1.0)
    refused(ValueError, "window's left side must be >= 0", q, kc, vc, sl, window=(-1, 0))
    refused(ValueError, r"alibi_slopes of shape \(3\)", q, kc, vc, sl,
            alibi_slopes=np.ones(3))
    refused(ValueError, r"sinks of shape \(2, 4\)", q, kc, vc, sl, sinks=np.ones((2, 4)))
    refused(TypeError, "mask_mod must return a bool", q, kc, vc, sl, mask_mod=_not_a_mask)
    refused(ValueError, "mod_args are given without", q, kc, vc, sl, mod_args=(1.0,))
    with pytest.raises(TypeError, match="score_mod_grad"):
        kvattn(q, kc, vc, sl, score_mod_grad=_bias)  # no backward here: not a keyword
    refused(ValueError, "scale must be finite", q, kc, vc, sl, scale=np.inf)
    refused(ValueError, "out must have shape", q, kc, vc, sl, out=np.empty((2, 1, 4, 3)))
    refused(ValueError, "out overlaps q", q, kc, vc, sl, out=q)


@numba.njit
def _not_a_mask(b, h, i, j):
    return 1.0


@numba.njit
def _bias(s, b, h, i, j):
    return s


def test_an_int_cache_seqlens_applies_to_every_sequence(rng):
    q, kc, vc = make(rng, 2, 1, 2, 2, 4, 4, 8)
    np.testing.assert_array_equal(kvattn(q, kc, vc, 5), kvattn(q, kc, vc, np.array([5, 5])))


def test_a_nan_query_row_shows_in_that_row_only(rng):
    q, kc, vc = make(rng, 2, 2, 4, 2, 6, 5, CHUNK + 20)
    q[0, 1, 2, 3] = np.nan
    seqlens = np.array([CHUNK + 20, 9])
    out, lse = kvattn(q, kc, vc, seqlens, return_lse=True)
    assert np.all(np.isnan(out[0, 1, 2])) and np.isnan(lse[0, 2, 1])
    bad = np.zeros(out.shape, bool)
    bad[0, 1, 2] = True
    assert np.all(np.isfinite(out[~bad]))
    q[0, 1, 2, 3] = 0.0  # the other rows are those of the clean problem
    clean = kvattn(q, kc, vc, seqlens)
    np.testing.assert_array_equal(out[~bad], clean[~bad])


def test_empty_batch_and_no_query_tokens(rng):
    q, kc, vc = make(rng, 2, 0, 4, 2, 6, 5, 8)
    out, lse = kvattn(q, kc, vc, np.array([3, 8]), return_lse=True)
    assert out.shape == (2, 0, 4, 5) and lse.shape == (2, 4, 0)
    q, kc, vc = make(rng, 0, 1, 4, 2, 6, 5, 8)
    out = kvattn(q, kc, vc, np.zeros(0, np.int64))
    assert out.shape == (0, 1, 4, 5)


# --- cache_leftpad -----------------------------------------------------------------------------

def poison_before(cache, table, starts):
    """A copy of ``cache`` with NaN in the key rows ``j < starts[b]`` of each sequence ``b``
    (``table`` None: contiguous): attended, they would give NaN. (That they are not read at
    all is checked on the plan: a masked key's 0 * NaN in P V need not show in the compiled
    kernel.)"""
    c = cache.copy()
    for b, n in enumerate(starts):
        j = np.arange(n)
        if table is None:
            c[b, :n] = np.nan
        else:
            ps = c.shape[1]
            c[table[b, j // ps], j % ps] = np.nan
    return c


@pytest.mark.parametrize("page_size", [None, 16, 5])
def test_cache_leftpad_skips_the_padding(rng, page_size):
    # Padding: none, inside the first chunk, past a whole chunk (skipped chunks), all the keys
    # but the appended ones, and every key (zeros, lse -inf).
    B, Lq, Hq, H, E, Ev, new = 5, 3, 6, 2, 9, 7, 2
    q, kc, vc = make(rng, B, Lq, Hq, H, E, Ev, 2 * CHUNK + 40)
    seqlens = np.array([30, 40, 2 * CHUNK + 20, 17, 9])
    leftpad = np.array([0, 11, CHUNK + 33, 17, 11], np.int32)
    kn = rng.standard_normal((B, new, H, E))
    vn = rng.standard_normal((B, new, H, Ev))
    kc, vc, table = paged_pair(rng, kc, vc, page_size)
    kw = {} if table is None else {"block_table": table}
    pk, pv = poison_before(kc, table, leftpad), poison_before(vc, table, leftpad)
    out = np.full((B, Lq, Hq, Ev), np.nan)
    res, lse = kvattn(q, pk, pv, seqlens, k=kn, v=vn, cache_leftpad=leftpad, out=out,
                      return_lse=True, **kw)
    assert res is out
    # The reference reads the clean caches with the same appended rows.
    kvattn(q, kc, vc, seqlens, k=kn, v=vn, **kw)
    check_against_reference(q, kc, vc, seqlens + new, out, lse, True, table=table,
                            leftpad=leftpad)
    np.testing.assert_array_equal(out[4], 0)
    assert np.all(lse[4] == -np.inf)
    assert np.isfinite(out[:4]).all()


def test_cache_leftpad_not_causal_gqa_and_as_zero(rng):
    q, kc, vc = make(rng, 3, 2, 4, 1, 8, 8, 60)
    seqlens = np.array([60, 5, 33])
    leftpad = np.array([7, 5, 0], np.int64)
    out, lse = kvattn(q, kc, vc, seqlens, cache_leftpad=leftpad, is_causal=False,
                      return_lse=True)
    check_against_reference(q, kc, vc, seqlens, out, lse, False, leftpad=leftpad)
    zero = kvattn(q, kc, vc, seqlens, cache_leftpad=np.zeros(3, np.int32), return_lse=True)
    plain = kvattn(q, kc, vc, seqlens, return_lse=True)
    for a, b in zip(zero, plain):
        np.testing.assert_array_equal(a, b)


def test_bad_cache_leftpad_is_refused_before_anything_is_written(rng):
    q, kc, vc = make(rng, 2, 1, 4, 2, 4, 4, 8)
    kn = rng.standard_normal((2, 1, 2, 4))
    before = kc.copy()
    sl = np.array([5, 4])
    for bad, exc, match in (
            (np.array([0.0, 1.0]), TypeError, "cache_leftpad must be an integer array"),
            (np.array([0, 1, 2]), ValueError, r"cache_leftpad must have shape \(2,\)"),
            (np.array([-1, 0]), ValueError, r"cache_leftpad\[0\] = -1 must be in \[0, "),
            (np.array([0, 6]), ValueError,
             r"cache_leftpad\[1\] = 6 must be in \[0, cache_seqlens\[1\] \+ Lq_new\] = "
             r"\[0, 5\]")):
        with pytest.raises(exc, match=match):
            kvattn(q, kc, vc, sl, k=kn, v=kn, cache_leftpad=bad)
        np.testing.assert_array_equal(kc, before)


# --- variants ----------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [None, 16, 5, "head_major"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_against_the_reference(rng, variant, page_size):
    # Lq > 1, GQA, an append, left padding (one sequence padded entirely), a sequence of
    # several chunks, one shorter than the query tokens. "head_major": a contiguous cache
    # stored (B, H, S, E) and passed as its (B, S, H, E) view (transformers' layout), which
    # the kernel reads head by head.
    B, Lq, Hq, H, E, Ev, new = 4, 3, 4, 2, 6, 5, 2
    kw = VARIANTS[variant](rng, B, Hq)
    is_causal = kw.pop("is_causal", True)
    q, kc, vc = make(rng, B, Lq, Hq, H, E, Ev, CHUNK + 60)
    if page_size == "head_major":
        kc, vc = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                  for x in (kc, vc))
        table = None
    else:
        kc, vc, table = paged_pair(rng, kc, vc, page_size)
    seqlens = np.array([CHUNK + 41, 37, 0, 8])
    leftpad = np.array([5, 0, 2, 10])
    kn = rng.standard_normal((B, new, H, E))
    vn = rng.standard_normal((B, new, H, Ev))
    paged = {} if table is None else {"block_table": table}
    out = np.full((B, Lq, Hq, Ev), np.nan)
    res, lse = kvattn(q, kc, vc, seqlens, k=kn, v=vn, cache_leftpad=leftpad,
                      is_causal=is_causal, out=out, return_lse=True, **paged, **kw)
    assert res is out
    check_against_reference(q, kc, vc, seqlens + new, out, lse, is_causal, table=table,
                            leftpad=leftpad, **kw)
    if "sinks" not in kw:  # (a sink gives an empty row lse = sink)
        np.testing.assert_array_equal(out[3], 0)
        assert np.all(lse[3] == -np.inf)


@pytest.mark.parametrize("left", [0, 1, BN - 1, BN, 100])
def test_a_window_skips_the_keys_before_it_exactly(rng, left):
    # Over a cache of several chunks, a window attends only its own keys: NaN in every other
    # value row would show (that they are not read is checked on the plan, below). Its edges
    # are checked against the reference (keys i - left and
    # i - left - 1 of each token), for decode (Lq 1) and speculative decoding (Lq 4).
    n = 3 * CHUNK + 17
    q, kc, vc = make(rng, 2, 4, 2, 1, 8, 8, n)
    seqlens = np.array([n, 2 * CHUNK])
    poisoned_k, poisoned_v = kc.copy(), vc.copy()
    for b, m in enumerate(seqlens):
        first = m - 4 - left  # the first key token 0 sees
        poisoned_k[b, :first] = np.nan
        poisoned_v[b, :first] = np.nan
    for lq in (4, 1):
        qq = q[:, 4 - lq:]
        out, lse = kvattn(qq, poisoned_k, poisoned_v, seqlens, window=(left, 0),
                          return_lse=True)
        check_against_reference(qq, kc, vc, seqlens, out, lse, True, window=(left, 0))


def test_window_and_softcap_share_the_plain_compilation(rng):
    q, kc, vc = make(rng, 1, 1, 2, 2, 4, 4, 20)
    kvattn(q, kc, vc, 20)
    n = len(launch_decode._entries)
    kvattn(q, kc, vc, 20, window=(3, 0), softcap=2.0)
    assert len(launch_decode._entries) == n


def test_variants_on_float32_and_the_alibi_forms(rng):
    q, kc, vc = make(rng, 2, 2, 4, 4, 8, 8, 50, np.float32)
    seqlens = np.array([50, 21])
    slopes = np.abs(rng.standard_normal(4)).astype(np.float32)
    a = kvattn(q, kc, vc, seqlens, alibi_slopes=slopes, return_lse=True)
    b = kvattn(q, kc, vc, seqlens, alibi_slopes=np.tile(slopes, (2, 1)), return_lse=True)
    np.testing.assert_array_equal(a[0], b[0])
    check_against_reference(q, kc, vc, seqlens, *a, True, tol=TOL[np.float32],
                            alibi_slopes=slopes)


@pytest.mark.parametrize("is_causal", [True, False])
def test_the_plan_reads_only_the_window_and_past_the_padding(is_causal):
    # The keys the kernels read: the CPU kernel's own plan and the host's (the CUDA launch's
    # chunks), against the window's and the padding's bounds written out.
    import importlib

    from sdpa_numba.kvcache import key_bounds
    from sdpa_numba.score import recipe as R

    decode_module = importlib.import_module("sdpa_numba.cpu.decode")
    kv_lens = np.array([8192, 8192, 300, 3, 0, 40])
    leftpad = np.array([0, 8000, 10, 0, 0, 40])
    lq = 4
    for left, right in ((255, 0), (0, 2), (R.NO_LIMIT, R.NO_LIMIT), (7, R.NO_LIMIT)):
        r = R.recipe(left=left, right=right)
        right_c = min(right, 0) if is_causal else right
        lo = np.maximum(np.maximum(kv_lens - lq - left, leftpad), 0)
        hi = np.maximum(np.minimum(kv_lens - 1 + right_c + 1, kv_lens), lo)
        first, k_lo, k_hi = decode_module._plan(kv_lens, leftpad, r._replace(right=np.int64(
            right_c)), lq)
        h_lo, h_hi = key_bounds(r, is_causal, kv_lens, leftpad, lq)
        for got in ((k_lo, k_hi), (h_lo, h_hi)):
            np.testing.assert_array_equal(got[0], lo)
            np.testing.assert_array_equal(got[1], hi)
        np.testing.assert_array_equal(np.diff(first), np.maximum(1, -(-(hi - lo) // CHUNK)))
    # a decode step with a window of 256 over 8192 keys reads 256 of them, in one chunk
    r = R.recipe(left=255, right=0)
    first, k_lo, k_hi = decode_module._plan(kv_lens[:1], None, r, 1)
    assert (k_lo[0], k_hi[0], first[1]) == (8192 - 256, 8192, 1)


@pytest.mark.parametrize("page_size", [None, 5, 16])
@pytest.mark.parametrize("lq", [1, 2])
@pytest.mark.parametrize("Hq,Ev", [(10, 128), (6, 64)])
def test_float32_wide_values_in_registers(rng, page_size, lq, Hq, Ev, monkeypatch):
    # float32 with Ev a multiple of 64 takes P V through _llvm.rows_pv (4 rows at once, then
    # one by one: 5 or 10 rows per key/value head; 3 or 6 rows, and on the head-major view
    # with one pass of 64 elements), over partial blocks and key groups, a sequence split into
    # chunks, pages, and the head-major view; the parallel kernel gives the same bits on any
    # thread count and on pages as on the contiguous cache.
    B, H, E = 3, 2, 64
    q, kc, vc = make(rng, B, lq, Hq, H, E, Ev, CHUNK + 45, np.float32)
    seqlens = np.array([CHUNK + 45, 37, 1])
    causal = lq > 1
    pk, pv, table = paged_pair(rng, kc, vc, page_size)
    hk, hv = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
              for x in (kc, vc))  # (B, H, S, E) storage viewed as (B, S, H, E)
    out, lse = kvattn(q, hk, hv, seqlens, is_causal=causal, return_lse=True)
    check_against_reference(q, kc, vc, seqlens, out, lse, causal)
    monkeypatch.setattr(launch_decode, "SERIAL_BYTES", 0)
    n = numba.get_num_threads()
    results = []
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            results.append(kvattn(q, pk, pv, seqlens, block_table=table, is_causal=causal,
                                  return_lse=True))
            results.append(kvattn(q, kc, vc, seqlens, is_causal=causal, return_lse=True))
    finally:
        numba.set_num_threads(n)
    check_against_reference(q, kc, vc, seqlens, *results[0], causal)
    for o, s in results[1:]:
        np.testing.assert_array_equal(o, results[0][0])
        np.testing.assert_array_equal(s, results[0][1])


# --- writeable buffers -------------------------------------------------------------------------

def _snapshot(*arrays):
    return [None if x is None else x.copy() for x in arrays]


def _unchanged(arrays, snapshot):
    for x, c in zip(arrays, snapshot):
        if x is not None:
            np.testing.assert_array_equal(x, c)


def test_a_read_only_out_is_refused(rng):
    # Refused before the kernel runs, naming out: it used to be written all the same.
    q, kc, vc = make(rng, 2, 1, 4, 2, 4, 4, 8)
    out = np.full((2, 1, 4, 4), np.nan)
    out.flags.writeable = False
    inputs = (q, kc, vc, out)
    before = _snapshot(*inputs)
    with pytest.raises(ValueError, match="out must be writeable"):
        kvattn(q, kc, vc, np.array([5, 4]), out=out)
    _unchanged(inputs, before)


@pytest.mark.parametrize("read_only", ["k_cache", "v_cache"])
@pytest.mark.parametrize("page_size", [None, 3])
def test_an_append_into_a_read_only_cache_is_refused_before_anything_is_written(
        rng, read_only, page_size):
    # With v_cache read-only the append used to write k_cache's slots, then fail in NumPy's
    # "assignment destination is read-only"; with k_cache read-only, fail naming no argument.
    q, kc, vc = make(rng, 2, 2, 4, 2, 4, 3, 9)
    kc, vc, table = paged_pair(rng, kc, vc, page_size)
    kn = rng.standard_normal((2, 2, 2, 4))
    vn = rng.standard_normal((2, 2, 2, 3))
    seqlens = np.array([5, 2])
    leftpad = np.array([1, 0])
    out = np.full((2, 2, 4, 3), np.nan)
    {"k_cache": kc, "v_cache": vc}[read_only].flags.writeable = False
    kw = {} if table is None else {"block_table": table}
    inputs = (q, kc, vc, kn, vn, seqlens, leftpad, table, out)
    before = _snapshot(*inputs)
    with pytest.raises(ValueError, match=f"^{read_only} must be writeable"):
        kvattn(q, kc, vc, seqlens, k=kn, v=vn, cache_leftpad=leftpad, out=out, **kw)
    _unchanged(inputs, before)
    # Without an append a read-only cache is only read.
    kvattn(q, kc, vc, seqlens, cache_leftpad=leftpad, out=out, **kw)
