"""The CPU backward against the float64 reference (sdpa_numba.reference.attention_backward).

Compile cost: the backward compiles once per dtype and mask kind (bool or additive; no mask
shares the bool one); these tests use float64 with both, float32 and float16 (cached on disk
after the first run). Some cases take ``out``/``lse`` from the reference (rounded to the
storage / compute dtypes) to avoid compiling more forward specializations (float32, float16,
float64 with a bool mask).
"""

import zlib

import numba
import numpy as np
import pytest

import sdpa_numba
from checks import check_backward
from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (nb if nb > 0 else 1.0)


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def forward(q, k, v, mask=None, use_reference=False, **kw):
    """(out, lse) in the inputs' dtype / compute dtype: from our forward or the reference."""
    if use_reference:
        out, lse = reference.attention(q, k, v, mask, **kw)
        cdt = np.float64 if q.dtype == np.float64 else np.float32
        return out.astype(q.dtype), lse.astype(cdt)
    return sdpa(q, k, v, mask, return_lse=True, **kw)


def check(q, k, v, mask=None, *, tol=None, use_reference=False, grad_out=None, seed=1, **kw):
    """Backward vs reference; returns our gradients."""
    rng = np.random.default_rng(seed)
    out, lse = forward(q, k, v, mask, use_reference, **kw)
    g = rand(rng, out.shape, q.dtype) if grad_out is None else grad_out
    return check_backward(sdpa_backward, g, q, k, v, out, lse, mask, tol, **kw)


CASES = {
    # name: (q shape, k shape, v shape, kwargs)
    "plain": ((2, 3, 17, 16), (2, 3, 65, 16), (2, 3, 65, 8), {}),
    "causal_L_gt_S": ((1, 2, 127, 8), (1, 2, 65, 8), (1, 2, 65, 8), {"is_causal": True}),
    "causal_L_lt_S": ((1, 2, 17, 8), (1, 2, 200, 8), (1, 2, 200, 3), {"is_causal": True}),
    "gqa_causal": ((2, 4, 65, 16), (2, 2, 130, 16), (2, 2, 130, 5),
                   {"enable_gqa": True, "is_causal": True}),
    # causal boundaries of the blocking (BQ = 64 query rows, BK = 128 keys): the key count
    # of the last block is 2 past a query block's first row (the mask skip), and a query block
    # whose one row is the first of a key block (the block skip)
    "causal_boundary_66": ((1, 2, 66, 8), (1, 2, 66, 8), (1, 2, 66, 4), {"is_causal": True}),
    "causal_boundary_129": ((1, 2, 129, 8), (1, 2, 130, 8), (1, 2, 130, 5),
                            {"is_causal": True}),
    "tiny": ((1, 1, 1, 3), (1, 1, 3, 3), (1, 1, 3, 1), {}),
    "one_key": ((3, 127, 5), (3, 1, 5), (3, 1, 7), {"scale": 0.3}),
    "two_dim": ((65, 17), (129, 17), (129, 17), {"is_causal": True}),
    "broadcast_batch_heads": ((2, 1, 3, 17, 8), (1, 4, 1, 19, 8), (2, 4, 1, 19, 4), {}),
    # more keys than a task holds at once (CHUNK_BLOCKS), one key group per head
    "key_chunks": ((16, 1, 130, 4), (16, 1, 4200, 4), (16, 1, 4200, 3), {}),
    "key_chunks_causal": ((16, 1, 130, 4), (16, 1, 4200, 4), (16, 1, 4200, 3),
                          {"is_causal": True}),
    # one kv head: its keys split into 3 groups with partial dQs summed at the end
    "key_groups": ((1, 2, 1500, 8), (1, 1, 1500, 8), (1, 1, 1500, 8),
                   {"enable_gqa": True, "is_causal": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference(name):
    qs, ks, vs, kw = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # hash() is salted per process
    q, k, v = (rand(rng, s, np.float64) for s in (qs, ks, vs))
    check(q, k, v, **kw)


def test_bool_mask_broadcast_and_fully_masked_rows():
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, (2, 3, 70, 8), np.float64), rand(rng, (2, 3, 67, 8), np.float64), \
        rand(rng, (2, 3, 67, 6), np.float64)
    mask = rng.random((70, 67)) > 0.3  # broadcast over batch and heads
    mask[[0, 5, 69]] = False  # fully masked rows
    # out and lse from the reference: saves compiling the float64 bool-mask forward
    dq, dk, dv = check(q, k, v, mask, use_reference=True)
    assert (dq[:, :, [0, 5, 69]] == 0).all()
    check(q, k, v, mask, use_reference=True, is_causal=True)


def test_additive_mask_with_neg_inf_and_mask_grad():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (2, 3, 33, 8), np.float64), rand(rng, (2, 3, 129, 8), np.float64), \
        rand(rng, (2, 3, 129, 8), np.float64)
    full = rand(rng, (2, 3, 33, 129), np.float64)
    full[rng.random(full.shape) < 0.2] = -np.inf
    full[0, 1, 4] = -np.inf  # a fully masked row
    for mask in (full, full[:1, :, :1].copy(), full[0, 0].copy(), full[:, :1]):
        dq, dk, dv, dm = check(q, k, v, mask)
        assert dm.shape == mask.shape
    dq, dk, dv, dm = check(q, k, v, full, is_causal=True)
    assert (dm[np.isneginf(full)] == 0).all()
    assert (dq[0, 1, 4] == 0).all()
    # several key groups (1100 keys, one head): each zeroes and fills its columns
    q, k, v = rand(rng, (40, 8), np.float64), rand(rng, (1100, 8), np.float64), \
        rand(rng, (1100, 8), np.float64)
    mask = rand(rng, (40, 1100), np.float64)
    mask[:, ::7] = -np.inf
    check(q, k, v, mask, is_causal=True)
    check(q, k, v, mask)


def test_large_logits_are_stable():
    rng = np.random.default_rng(4)
    q, k, v = (rand(rng, (1, 2, 40, 8), np.float64, 30.0) for _ in range(3))
    check(q, k, v, scale=3.0, tol=1e-10)


def test_strided_inputs():
    rng = np.random.default_rng(5)
    q = rand(rng, (3, 37, 2, 16), np.float64).transpose(0, 2, 1, 3)  # (3, 2, 37, 16) strided
    k = rand(rng, (16, 3, 2, 50), np.float64).transpose(1, 2, 3, 0)  # (3, 2, 50, 16)
    v = rand(rng, (3, 2, 100, 8), np.float64)[:, :, ::2]
    mask = rand(rng, (50, 37), np.float64).T  # (37, 50) transposed view
    g = rand(rng, (3, 37, 2, 8), np.float64).transpose(0, 2, 1, 3)
    check(q, k, v, mask, grad_out=g, is_causal=True)


def test_float32():
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, (2, 4, 130, 64), np.float32), rand(rng, (2, 2, 127, 64), np.float32), \
        rand(rng, (2, 2, 127, 32), np.float32)
    check(q, k, v, enable_gqa=True, use_reference=True)
    check(q, k, v, enable_gqa=True, is_causal=True, use_reference=True)


def test_float16():
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (2, 2, 65, 32), np.float16), rand(rng, (2, 2, 129, 32), np.float16), \
        rand(rng, (2, 2, 129, 16), np.float16)
    check(q, k, v, use_reference=True)
    check(q[0, 0], k[0, 0], v[0, 0], use_reference=True, is_causal=True)


def test_finite_differences():
    """Directional derivatives of sum(out * g) against the analytic gradients."""
    rng = np.random.default_rng(8)
    q, k, v = rand(rng, (1, 2, 19, 8), np.float64), rand(rng, (1, 1, 23, 8), np.float64), \
        rand(rng, (1, 1, 23, 5), np.float64)
    mask = rand(rng, (19, 23), np.float64)
    kw = dict(is_causal=True, enable_gqa=True)
    out, lse = sdpa(q, k, v, mask, return_lse=True, **kw)
    g = rand(rng, out.shape, np.float64)
    grads = sdpa_backward(g, q, k, v, out, lse, mask, mask_grad=True, **kw)

    def loss(q, k, v, mask):
        return float(np.sum(sdpa(q, k, v, mask, **kw) * g))

    args = [q, k, v, mask]
    for i, grad in enumerate(grads):
        d = rand(rng, args[i].shape, np.float64)
        eps = 1e-6
        plus = list(args)
        minus = list(args)
        plus[i] = args[i] + eps * d
        minus[i] = args[i] - eps * d
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert abs(fd - np.sum(grad * d)) <= 1e-7 * max(1.0, abs(fd)), i


def test_deterministic_across_thread_counts():
    rng = np.random.default_rng(9)
    # one kv head: the keys are split into several groups, each with its own partial dQ
    q, k, v = rand(rng, (1, 2, 300, 32), np.float32), rand(rng, (1, 1, 1100, 32), np.float32), \
        rand(rng, (1, 1, 1100, 32), np.float32)
    out, lse = forward(q, k, v, use_reference=True, enable_gqa=True, is_causal=True)
    g = rand(rng, out.shape, np.float32)
    # 1 thread against all of them (not the current count, which an earlier test may have
    # left at 1: then the run was compared with itself)
    n = numba.config.NUMBA_NUM_THREADS
    if n < 2:
        pytest.skip("needs at least 2 threads to compare")
    before = numba.get_num_threads()
    try:
        runs = []
        for threads in (1, n):
            numba.set_num_threads(threads)
            assert numba.get_num_threads() == threads
            runs.append(sdpa_backward(g, q, k, v, out, lse, enable_gqa=True, is_causal=True))
    finally:
        numba.set_num_threads(before)
    again = sdpa_backward(g, q, k, v, out, lse, enable_gqa=True, is_causal=True)
    for a, b, c in zip(runs[0], runs[-1], again):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_empty_sizes():
    q = np.ones((1, 2, 0, 4))
    k = np.ones((1, 2, 5, 4))
    v = np.ones((1, 2, 5, 3))
    out, lse = sdpa(q, k, v, return_lse=True)
    dq, dk, dv = sdpa_backward(out, q, k, v, out, lse)
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
    q = np.ones((1, 2, 3, 4))
    k = np.ones((1, 2, 0, 4))
    v = np.ones((1, 2, 0, 3))
    out, lse = sdpa(q, k, v, return_lse=True)
    dq, dk, dv = sdpa_backward(np.ones_like(out), q, k, v, out, lse)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("L, S", [(0, 5), (3, 0), (0, 0)])
def test_reference_empty_sizes_with_gqa_and_sinks(L, S):
    # The reference's GQA group sum and sink gradient reshape must not need to infer a dim
    # of an empty array: zero rows give zero key/value/sink gradients, zero keys zero dq.
    rng = np.random.default_rng(L * 10 + S)
    q = rng.standard_normal((2, 4, L, 3))
    k = rng.standard_normal((2, 2, S, 3))
    v = rng.standard_normal((2, 2, S, 5))
    do = rng.standard_normal((2, 4, L, 5))
    dq, dk, dv, dmask, dsink = reference.attention_backward(
        do, q, k, v, enable_gqa=True, sinks=np.array([0.5, -1.0, 2.0, 0.0]))
    assert (dq.shape, dk.shape, dv.shape, dsink.shape) == (q.shape, k.shape, v.shape, (4,))
    assert dmask is None
    assert not dq.any() and not dk.any() and not dv.any() and not dsink.any()


def test_numba_entry_from_user_code():
    """sdpa_numba.cpu.backward called from a user's @njit function, on NaN-poisoned buffers
    (including the mask gradient, here of the scores: a zero additive mask's)."""
    from sdpa_numba.cpu import backward

    @numba.njit
    def user_step(q, k, v, g, out, lse, dq, dk, dv, dmask):
        backward(q, k, v, None, True, 0.25, g, out, lse, dq, dk, dv, None, dmask)
        return dq.sum() + dk.sum() + dv.sum() + dmask.sum()

    rng = np.random.default_rng(10)
    q, k, v = rand(rng, (2, 2, 70, 16), np.float64), rand(rng, (2, 1, 90, 16), np.float64), \
        rand(rng, (2, 1, 90, 8), np.float64)
    g = rand(rng, (2, 2, 70, 8), np.float64)
    kw = dict(is_causal=True, scale=0.25, enable_gqa=True)
    out, lse = sdpa(q, k, v, return_lse=True, **kw)
    dq, dk, dv = np.full(q.shape, np.nan), np.full(k.shape, np.nan), np.full(v.shape, np.nan)
    dmask = np.full((2, 2, 70, 90), np.nan)
    assert np.isfinite(user_step(q, k, v, g, out, lse, dq, dk, dv, dmask))
    want = reference.attention_backward(g, q, k, v, np.zeros((2, 2, 70, 90)), **kw)
    for a, b in zip((dq, dk, dv, dmask), want):
        assert rel(a, b) <= 1e-12


@pytest.mark.parametrize("bad, err, match", [
    (dict(lse=np.zeros((2, 3, 17), np.float32)), ValueError, "lse"),
    (dict(lse=np.zeros((2, 3, 16))), ValueError, "lse"),
    (dict(grad_out=np.zeros((2, 3, 17, 7))), ValueError, "grad_out"),
    (dict(out=np.zeros((2, 3, 17, 8), np.float32)), ValueError, "out"),
    (dict(mask_grad=True), ValueError, "mask_grad"),
    (dict(mask_grad=1), TypeError, "mask_grad"),
    (dict(dropout_p=0.1), ValueError, "seed"),
    (dict(dropout_p=1.0, seed=1), ValueError, "dropout_p"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(key=np.zeros((2, 3, 9, 5))), ValueError, "key"),
    (dict(grad_out=[[1.0]]), TypeError, "grad_out"),
])
def test_validation(bad, err, match):
    a = dict(grad_out=np.zeros((2, 3, 17, 8)), query=np.zeros((2, 3, 17, 4)),
             key=np.zeros((2, 3, 9, 4)), value=np.zeros((2, 3, 9, 8)),
             out=np.zeros((2, 3, 17, 8)), lse=np.zeros((2, 3, 17)))
    a.update(bad)
    with pytest.raises(err, match=match):
        sdpa_backward(**a)


def test_public_names():
    assert sdpa_numba.scaled_dot_product_attention_backward is sdpa_backward
    assert "scaled_dot_product_attention_backward" in sdpa_numba.__all__
