"""Chunked local attention (``chunk=c``, Llama 4's ``attention_chunk``; issue 31): a query sees
only the keys of its own chunk of ``c`` positions, on top of causality, the window and the
alignment. Checked against the float64 reference and against the equivalent boolean mask,
forward and gradients, dense, varlen and KV cache; the refusal of bad values; and the
skipping of whole key blocks outside a row block's chunks (keys no query sees are NaN: a
kernel that visited their block would turn its rows NaN).

Compile cost: none of its own (the chunk is a run-time number of the plain recipe); the
float64 and float32 forwards, the float64 backward, the float64 varlen forward and backward
and the float64 decode kernel with the plain recipe, as other tests compile them, and the
float64 forward with a bool mask (the equivalent-mask comparison).
"""

import numpy as np
import pytest

from checks import check, rel_err
from kvcache_checks import logical, ref_sequence
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward
from sdpa_numba import varlen_attention, varlen_attention_backward
from sdpa_numba.score import recipe as R
from varlen_checks import cu, packed, reference_forward, reference_grads

GRAD_TOL = 1e-11


def chunk_mask(L, S, c, alignment="top_left"):
    """The boolean mask equivalent to ``chunk=c``: (L, S), True where the query's aligned
    position and the key fall into the same chunk of ``c``."""
    offset = S - L if alignment == "bottom_right" else 0
    pos = np.arange(L)[:, None] + offset
    return pos // c == np.arange(S)[None, :] // c


def qkv(rng, B, Hq, H, L, S, E=8, Ev=7, dtype=np.float64):
    return (rng.standard_normal((B, Hq, L, E)).astype(dtype),
            rng.standard_normal((B, H, S, E)).astype(dtype),
            rng.standard_normal((B, H, S, Ev)).astype(dtype))


# (B, Hq, H, L, S, keywords): odd sizes, c = 1, c past L + S, c not dividing L, causal,
# windows, GQA, bottom-right with L < S and L > S (rows at negative positions see no key).
CASES = {
    "c1": (1, 2, 2, 13, 13, dict(chunk=1)),
    "c7_dense": (2, 2, 2, 37, 45, dict(chunk=7)),
    "c7_causal_gqa": (1, 4, 2, 45, 45, dict(chunk=7, is_causal=True, enable_gqa=True)),
    "c_past_everything": (1, 2, 2, 29, 31, dict(chunk=1000, is_causal=True)),
    "c5_bottom_right": (1, 2, 1, 21, 53, dict(chunk=5, is_causal=True,
                                              alignment="bottom_right", enable_gqa=True)),
    "c6_bottom_right_l_past_s": (1, 2, 2, 40, 23, dict(chunk=6, alignment="bottom_right")),
    "c9_window": (1, 2, 2, 50, 50, dict(chunk=9, window=(4, 2))),
    "c11_window_causal": (1, 2, 2, 47, 61, dict(chunk=11, window=(6, None), is_causal=True)),
}


def _mask_kw(kw, L, S):
    """``kw`` with the chunk replaced by its equivalent bool mask."""
    kw = dict(kw)
    c = kw.pop("chunk")
    return dict(kw, attn_mask=chunk_mask(L, S, c, kw.get("alignment", "top_left")))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L, S", [(13, 29), (29, 13)])
def test_reference_chunk_is_the_equivalent_mask(rng, L, S, alignment):
    q, k, v = qkv(rng, 1, 2, 2, L, S)
    for c in (1, 4, 7, 100):
        for causal in (False, True):
            kw = dict(is_causal=causal, alignment=alignment)
            got = reference.attention(q, k, v, chunk=c, **kw)
            want = reference.attention(q, k, v, attn_mask=chunk_mask(L, S, c, alignment), **kw)
            for x, y in zip(got, want):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", CASES)
def test_forward_against_reference_and_mask(rng, name):
    B, Hq, H, L, S, kw = CASES[name]
    q, k, v = qkv(rng, B, Hq, H, L, S)
    out, lse = check(q, k, v, **kw)  # NaN-poisoned out, inputs unchanged, out and lse
    mo, ml = sdpa(q, k, v, return_lse=True, **_mask_kw(kw, L, S))
    assert rel_err(out, mo) < 1e-14
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ml))
    np.testing.assert_allclose(lse[np.isfinite(ml)], ml[np.isfinite(ml)], rtol=1e-13)


@pytest.mark.parametrize("c, causal", [(64, True), (100, True), (37, False)])
def test_forward_float32_across_blocks(rng, c, causal):
    # Several CPU tiles (64 x 64) and tasks: chunks aligned with the tiles, tiles a chunk
    # boundary cuts, and a causal chunk that cuts the band's tiles.
    q, k, v = qkv(rng, 1, 2, 2, 300, 300, E=16, Ev=16, dtype=np.float32)
    check(q, k, v, chunk=c, is_causal=causal)


def test_chunk_past_every_position_is_no_chunk_bitwise(rng):
    q, k, v = qkv(rng, 1, 2, 2, 70, 90)
    for kw in (dict(), dict(is_causal=True, window=(9, None))):
        a = sdpa(q, k, v, return_lse=True, **kw)
        b = sdpa(q, k, v, return_lse=True, chunk=10 ** 9, **kw)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


BACKWARD = ["c1", "c7_causal_gqa", "c5_bottom_right", "c6_bottom_right_l_past_s",
            "c9_window"]


@pytest.mark.parametrize("name", BACKWARD)
def test_backward_against_reference(rng, name):
    B, Hq, H, L, S, kw = CASES[name]
    q, k, v = qkv(rng, B, Hq, H, L, S)
    g = rng.standard_normal((B, Hq, L, 7))
    out, lse = sdpa(q, k, v, return_lse=True, **kw)
    dq, dk, dv = sdpa_backward(g, q, k, v, out, lse, **kw)
    rq, rk, rv = reference.attention_backward(g, q, k, v, **kw)[:3]
    for x, y in ((dq, rq), (dk, rk), (dv, rv)):
        assert rel_err(x, y) < GRAD_TOL, rel_err(x, y)
    # the equivalent mask gives the same gradients
    mq, mk, mv = reference.attention_backward(g, q, k, v, **_mask_kw(kw, L, S))[:3]
    for x, y in ((dq, mq), (dk, mk), (dv, mv)):
        assert rel_err(x, y) < GRAD_TOL


def test_backward_float64_across_blocks(rng):
    # Several key blocks per chunk and chunks that cut the backward's blocks.
    kw = dict(chunk=48, is_causal=True)
    q, k, v = qkv(rng, 1, 2, 2, 161, 161, E=5, Ev=6)
    g = rng.standard_normal((1, 2, 161, 6))
    out, lse = sdpa(q, k, v, return_lse=True, **kw)
    grads = sdpa_backward(g, q, k, v, out, lse, **kw)
    for x, y in zip(grads, reference.attention_backward(g, q, k, v, **kw)[:3]):
        assert rel_err(x, y) < GRAD_TOL


# --- whole blocks outside a chunk are not visited -------------------------------------------

@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_keys_outside_every_chunk_are_not_read(rng, alignment):
    # Queries at positions 0..63 (top-left; bottom-right: 960..1023) with chunks of 128 see
    # keys 0..127 (896..1023) only: the others are NaN, and a kernel that visited their
    # blocks (even masking every score) would multiply their NaN values by 0 into the rows'
    # sums.
    L, S, c = 64, 1024, 128
    q, k, v = qkv(rng, 1, 2, 2, L, S)
    seen = slice(0, c) if alignment == "top_left" else slice(S - c, S)
    unseen = slice(c, S) if alignment == "top_left" else slice(0, S - c)
    kp, vp = k.copy(), v.copy()
    kp[:, :, unseen] = np.nan
    vp[:, :, unseen] = np.nan
    kw = dict(chunk=c, is_causal=True, alignment=alignment)
    out, lse = sdpa(q, kp, vp, return_lse=True, **kw)
    ref, _ = reference.attention(q, k, v, **kw)
    assert rel_err(out, ref) < 1e-14
    g = rng.standard_normal(out.shape)
    dq, dk, dv = sdpa_backward(g, q, kp, vp, out, lse, **kw)
    rq, rk, rv = reference.attention_backward(g, q, k, v, **kw)[:3]
    assert rel_err(dq, rq) < GRAD_TOL
    assert rel_err(dk[:, :, seen], rk[:, :, seen]) < GRAD_TOL
    assert rel_err(dv[:, :, seen], rv[:, :, seen]) < GRAD_TOL
    assert (dk[:, :, unseen] == 0).all() and (dv[:, :, unseen] == 0).all()


def test_decode_reads_only_its_chunk(rng):
    # One new token at position 1000 of a cache of 1001 keys, chunks of 128: it reads keys
    # 896..1000; the others are NaN.
    B, H, E, c, n = 1, 2, 8, 128, 1001
    q = rng.standard_normal((B, 1, H, E))
    kc = rng.standard_normal((B, n, H, E))
    vc = rng.standard_normal((B, n, H, E))
    kp, vp = kc.copy(), vc.copy()
    kp[:, :n // c * c] = np.nan
    vp[:, :n // c * c] = np.nan
    out, lse = kvattn(q, kp, vp, np.array([n]), chunk=c, return_lse=True)
    ro, rl = ref_sequence(q[0], kc[0], vc[0], True, chunk=c)
    assert rel_err(out[0], ro) < 1e-14
    np.testing.assert_allclose(lse[0], rl, rtol=1e-13)


def test_seam_ranges_against_the_element_test():
    # key_range / query_range hold every key / row the element test (in_window) keeps, and
    # are exact for one row / one key; window_covers and in_one_chunk only where it keeps all.
    rng = np.random.default_rng(5)
    f = {name: getattr(R, name).py_func for name in ("in_window", "key_range", "query_range",
                                                      "window_covers", "in_one_chunk")}
    for _ in range(300):
        L, S = (int(x) for x in rng.integers(1, 40, 2))
        left, right = (R.NO_LIMIT if rng.random() < 0.3 else int(rng.integers(0, 12))
                       for _ in range(2))
        r = R.recipe(offset=int(rng.integers(-10, 10)), left=left, right=right,
                     chunk=int(rng.integers(1, 15)))
        keep = np.array([[f["in_window"](r, i, j) for j in range(S)] for i in range(L)])
        i0 = int(rng.integers(0, L))
        i1 = int(rng.integers(i0, L))
        jb, je = f["key_range"](r, i0, i1, S)
        seen = np.flatnonzero(keep[i0:i1 + 1].any(axis=0))
        assert all(jb <= j < je for j in seen)
        if i0 == i1:
            assert (jb, je) == ((seen[0], seen[-1] + 1) if seen.size else (0, 0))
        j0 = int(rng.integers(0, S))
        j1 = int(rng.integers(j0, S))
        ib, ie = f["query_range"](r, j0, j1, L)
        rows = np.flatnonzero(keep[:, j0:j1 + 1].any(axis=1))
        assert all(ib <= i < ie for i in rows)
        if j0 == j1:
            assert (ib, ie) == ((rows[0], rows[-1] + 1) if rows.size else (0, 0))
        if f["window_covers"](r, i0, i1, j0, j1):
            assert keep[i0:i1 + 1, j0:j1 + 1].all()
        if f["in_one_chunk"](r, i0, i1, j0, j1):
            c = r.chunk
            assert len({(i + r.offset) // c for i in (i0, i1)} | {j // c for j in (j0, j1)}) == 1


# --- varlen ----------------------------------------------------------------------------------

LQ = [3, 0, 1, 33, 17, 70, 0]
LK = [5, 4, 0, 20, 17, 90, 3]


@pytest.mark.parametrize("kw", [dict(chunk=6, is_causal=True),
                                dict(chunk=8, is_causal=True, alignment="bottom_right"),
                                dict(chunk=5, window=(3, 7))],
                         ids=["causal", "causal_bottom_right", "window"])
def test_varlen_forward_and_backward(rng, kw):
    q, k, v = packed(rng, LQ, LK, 4, 2, 9, 7)
    cq, ck = cu(LQ), cu(LK, np.int64)
    out = np.full((sum(LQ), 4, 7), np.nan)
    res, lse = varlen_attention(q, k, v, cq, ck, out=out, return_lse=True, **kw)
    ref_out, ref_lse = reference_forward(q, k, v, cq, ck, **kw)
    assert res is out and rel_err(res, ref_out) < 1e-13
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-12)
    g = rng.standard_normal(out.shape)
    grads = varlen_attention_backward(g, q, k, v, res, lse, cq, ck, **kw)
    for x, y in zip(grads[:3], reference_grads(g, q, k, v, cq, ck, **kw)[:3]):
        assert rel_err(x, y) < GRAD_TOL


# --- KV cache --------------------------------------------------------------------------------

def test_kvcache_paged_appends_step_by_step(rng):
    # A prefill of 13 tokens then decode steps of 1 and 3 tokens, appended into a paged cache
    # (pages of 5, shuffled); each step equals the dense causal chunked attention of its
    # tokens against the cache so far (positions are the cache's).
    B, Hq, H, E, c, S_max, page = 2, 4, 2, 6, 8, 40, 5
    per = S_max // page
    n_pages = B * per + 3
    table = rng.permutation(n_pages)[:B * per].reshape(B, per).astype(np.int32)
    kc = np.zeros((n_pages, page, H, E))
    vc = np.zeros((n_pages, page, H, E))
    n = np.array([0, 0])
    for lq in (13, 1, 3, 1, 1, 3):
        q = rng.standard_normal((B, lq, Hq, E))
        kn = rng.standard_normal((B, lq, H, E))
        vn = rng.standard_normal((B, lq, H, E))
        out = np.full((B, lq, Hq, E), np.nan)
        kvattn(q, kc, vc, n, k=kn, v=vn, block_table=table, chunk=c, out=out)
        n = n + lq
        for b in range(B):
            ro, _ = ref_sequence(q[b], logical(kc, table, b, n[b]),
                                 logical(vc, table, b, n[b]), True, chunk=c)
            assert rel_err(out[b], ro) < 1e-13


# --- bad values ------------------------------------------------------------------------------

BAD = [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError),
       ("8", TypeError), (np.float64(4), TypeError)]


@pytest.mark.parametrize("bad, exc", BAD, ids=[repr(b) for b, _ in BAD])
def test_bad_chunk_is_refused_naming_it_with_nothing_written(rng, bad, exc):
    q, k, v = qkv(rng, 1, 2, 2, 5, 6, E=4, Ev=4)
    out = np.full((1, 2, 5, 4), np.nan)
    with pytest.raises(exc, match="chunk"):
        sdpa(q, k, v, out=out, chunk=bad)
    assert np.isnan(out).all()
    g = np.ones_like(out)
    with pytest.raises(exc, match="chunk"):
        sdpa_backward(g, q, k, v, g, np.zeros((1, 2, 5)), chunk=bad)
    pq, pk, pv = (x[0].transpose(1, 0, 2).copy() for x in (q, k, v))
    vout = np.full((5, 2, 4), np.nan)
    with pytest.raises(exc, match="chunk"):
        varlen_attention(pq, pk, pv, np.array([0, 5]), np.array([0, 6]), out=vout, chunk=bad)
    assert np.isnan(vout).all()
    kc, vc = np.zeros((1, 9, 2, 4)), np.zeros((1, 9, 2, 4))
    kout = np.full((1, 1, 2, 4), np.nan)
    with pytest.raises(exc, match="chunk"):
        kvattn(rng.standard_normal((1, 1, 2, 4)), kc, vc, np.array([3]), k=np.ones((1, 1, 2, 4)),
               v=np.ones((1, 1, 2, 4)), out=kout, chunk=bad)
    assert np.isnan(kout).all() and not kc.any() and not vc.any()


def test_numpy_int_chunk_is_taken(rng):
    q, k, v = qkv(rng, 1, 2, 2, 9, 9)
    a = sdpa(q, k, v, chunk=np.int32(4))
    b = sdpa(q, k, v, chunk=4)
    np.testing.assert_array_equal(a, b)


def test_ring_attention_refuses_chunk():
    from sdpa_numba.distributed.call import _check_variants

    with pytest.raises(NotImplementedError, match="ring attention does not shard chunk"):
        _check_variants(None, 0.0, {"chunk": 4})
    assert _check_variants(None, 0.0, {"chunk": None}) == {}


# --- torch operators ---------------------------------------------------------------------------

def test_torch_operator_forward_backward_and_double_backward(rng):
    torch = pytest.importorskip("torch")
    import sdpa_numba.torch as st

    kw = dict(chunk=5, is_causal=True, alignment="bottom_right")
    q, k, v = (torch.tensor(x, requires_grad=True) for x in qkv(rng, 1, 2, 2, 9, 13, E=4,
                                                                   Ev=4))
    out = st.scaled_dot_product_attention(q, k, v, **kw)
    ref = reference.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), **kw)
    assert rel_err(out.detach().numpy(), ref[0]) < 1e-13
    g = torch.tensor(rng.standard_normal(out.shape))
    grads = torch.autograd.grad(out, (q, k, v), g)
    want = reference.attention_backward(g.numpy(), *(x.detach().numpy() for x in (q, k, v)),
                                        **kw)
    for x, y in zip(grads, want[:3]):
        assert rel_err(x.numpy(), y) < GRAD_TOL
    # the double backward forms the chunk's mask in torch operations
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: st.scaled_dot_product_attention(q, k, v, **kw), (q, k, v))
