"""Dropout: the counter-based mask (sdpa_numba.dropout), the forward and the backward.

Uses the float64 kernels without a mask (plus the float64 forward with dropout).
"""

import numpy as np
import pytest

from sdpa_numba import dropout, reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward
from dropout_known_answers import KNOWN_HASHES, known_keep_1234


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def rand(rng, *shape):
    return rng.standard_normal(shape)


def test_hash_matches_splitmix64():
    """The stream is SplitMix64's mix of (key + (n + 1) * gamma), in plain Python ints."""
    m = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    def step(key, n):
        return mix((key + (n + 1) * 0x9E3779B97F4A7C15) & m)

    seed, p = 2**63 + 12345, 0.37
    keep = dropout.keep_mask(seed, p, (2,), 3, 4, 5)
    thr = dropout.threshold(p)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 3, 4), (1, 0, 2, 1)]:
        bits = step(step(step(step(seed, b), h), i), j)
        assert keep[b, h, i, j] == ((bits >> 32) >= thr)


def test_forward_matches_reference_mask():
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 2, 3, 37, 16), rand(rng, 2, 3, 70, 16), rand(rng, 2, 3, 70, 8)
    out, lse = sdpa(q, k, v, dropout_p=0.3, seed=42, return_lse=True, is_causal=True)
    want, want_lse = reference.attention_dropout(q, k, v, dropout_p=0.3, seed=42,
                                                 is_causal=True)
    assert rel(out, want) <= 1e-12
    # lse is that of the softmax before dropout
    _, lse0 = sdpa(q, k, v, return_lse=True, is_causal=True)
    np.testing.assert_allclose(lse, lse0, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=40 * np.finfo(float).eps * 8)


def test_same_seed_same_bits_other_seed_differs():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 1, 2, 33, 8), rand(rng, 1, 2, 65, 8), rand(rng, 1, 2, 65, 8)
    a = sdpa(q, k, v, dropout_p=0.5, seed=7)
    b = sdpa(q, k, v, dropout_p=0.5, seed=7)
    c = sdpa(q, k, v, dropout_p=0.5, seed=8)
    d = sdpa(q, k, v, dropout_p=0.5)  # fresh seeds
    e = sdpa(q, k, v, dropout_p=0.5)
    assert a.tobytes() == b.tobytes()
    assert not np.array_equal(a, c) and not np.array_equal(d, e)


def test_keep_rate():
    """With V = identity, out = P * Z: the zeros are exactly the dropped entries."""
    rng = np.random.default_rng(2)
    p, S = 0.3, 256
    q, k = rand(rng, 2, 2, 64, 4), rand(rng, 2, 2, S, 4)
    v = np.broadcast_to(np.eye(S), (2, 2, S, S))
    out = sdpa(q, k, v, dropout_p=p, seed=11)
    kept = out != 0
    n = kept.size
    assert abs(kept.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_array_equal(kept, dropout.keep_mask(11, p, (2,), 2, 64, S))
    # kept probabilities are scaled by 1 / (1 - p)
    probs, _ = reference.attention(q, k, v)
    np.testing.assert_allclose(out[kept], probs[kept] / (1 - p), rtol=1e-12)


def test_mask_independent_of_launch_split():
    """Batch dims that no view merges run as several launches: same mask (flat batch index)."""
    rng = np.random.default_rng(3)
    q = rand(rng, 3, 2, 2, 9, 4).transpose(1, 0, 2, 3, 4)  # (2, 3, 2, 9, 4), unmergeable
    k, v = rand(rng, 2, 3, 2, 11, 4), rand(rng, 2, 3, 2, 11, 4)
    a = sdpa(q, k, v, dropout_p=0.4, seed=5)
    b = sdpa(np.ascontiguousarray(q), k, v, dropout_p=0.4, seed=5)
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=0)
    want, _ = reference.attention_dropout(q, k, v, dropout_p=0.4, seed=5)
    assert rel(a, want) <= 1e-12
    g = rand(rng, *a.shape)
    _, lse = sdpa(q, k, v, return_lse=True)
    got = sdpa_backward(g, q, k, v, a, lse, dropout_p=0.4, seed=5)
    ref = reference.attention_backward(g, q, k, v, dropout_p=0.4, seed=5)
    for x, y in zip(got, ref[:3]):
        assert rel(x, y) <= 1e-12


@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "enable_gqa": True}])
def test_backward_matches_reference(kw):
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 2, 4, 65, 16), rand(rng, 2, 2, 130, 16), rand(rng, 2, 2, 130, 8)
    if not kw:
        k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    out, lse = sdpa(q, k, v, dropout_p=0.25, seed=99, return_lse=True, **kw)
    g = rand(rng, *out.shape)
    got = sdpa_backward(g, q, k, v, out, lse, dropout_p=0.25, seed=99, **kw)
    want = reference.attention_backward(g, q, k, v, dropout_p=0.25, seed=99, **kw)
    for a, b in zip(got, want[:3]):
        assert rel(a, b) <= 1e-12


def test_backward_finite_differences():
    """Gradients of the seeded (hence deterministic) function match finite differences."""
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 1, 2, 21, 8), rand(rng, 1, 2, 30, 8), rand(rng, 1, 2, 30, 6)
    kw = dict(dropout_p=0.4, seed=2024, is_causal=True)
    out, lse = sdpa(q, k, v, return_lse=True, **kw)
    g = rand(rng, *out.shape)
    grads = sdpa_backward(g, q, k, v, out, lse, **kw)
    args = [q, k, v]
    for i, grad in enumerate(grads):
        d = rand(rng, *args[i].shape)
        eps = 1e-6
        plus, minus = list(args), list(args)
        plus[i] = args[i] + eps * d
        minus[i] = args[i] - eps * d
        fd = (np.sum(sdpa(*plus, **kw) * g) - np.sum(sdpa(*minus, **kw) * g)) / (2 * eps)
        assert abs(fd - np.sum(grad * d)) <= 1e-7 * max(1.0, abs(fd)), i


@pytest.mark.parametrize("p, err", [(1.0, ValueError), (-0.1, ValueError),
                                    (float("nan"), ValueError), (True, TypeError),
                                    ("0.1", TypeError)])
def test_bad_dropout_p(p, err):
    x = np.zeros((2, 4))
    with pytest.raises(err, match="dropout_p"):
        sdpa(x, x, x, dropout_p=p)


@pytest.mark.parametrize("seed, err", [(-1, ValueError), (2**64, ValueError),
                                       (1.5, TypeError), ("1", TypeError)])
def test_bad_seed(seed, err):
    x = np.zeros((2, 4))
    with pytest.raises(err, match="seed"):
        sdpa(x, x, x, dropout_p=0.1, seed=seed)


def test_known_answers_of_the_stream():
    from sdpa_numba.cpu.dropout import head_key, stream_step

    assert dropout.threshold(0.5) == 2**31 and dropout.threshold(0.1) == 429496729
    for (seed, b, h, i, j), want in KNOWN_HASHES.items():
        rk = stream_step(np.uint64(stream_step(np.uint64(head_key(np.uint64(seed), b, h)), i)),
                         j)
        assert int(rk) == want, (seed, b, h, i, j)
    np.testing.assert_array_equal(dropout.keep_mask(1234, 0.5, (2,), 2, 3, 70),
                                  known_keep_1234())


def test_known_answers_of_the_kernel():
    """The forward kernel (V = identity: out = P Z) drops exactly the known entries."""
    rng = np.random.default_rng(6)
    q, k = rand(rng, 2, 2, 3, 4), rand(rng, 2, 2, 70, 4)
    v = np.broadcast_to(np.eye(70), (2, 2, 70, 70))
    out = sdpa(q, k, v, dropout_p=0.5, seed=1234)
    np.testing.assert_array_equal(out != 0, known_keep_1234())


def _dropout_case(rng, dtype):
    """A float32/float16 problem with an additive mask (-inf included) and odd sizes."""
    q = rng.standard_normal((2, 3, 67, 24)).astype(dtype)
    k = rng.standard_normal((2, 3, 130, 24)).astype(dtype)
    v = rng.standard_normal((2, 3, 130, 9)).astype(dtype)
    mask = (rng.standard_normal((67, 130)) * 2).astype(dtype)
    mask[rng.random(mask.shape) < 0.2] = -np.inf
    mask[5] = -np.inf  # a fully masked row
    return q, k, v, mask


@pytest.mark.parametrize("dtype, causal", [(np.float32, True), (np.float16, False)])
def test_dropout_with_mask_in_float32_float16(dtype, causal):
    """CPU dropout with an additive mask, in float32 and float16 (compute float32): the
    output within the forward's tolerances of the float64 reference with the same mask,
    the lse that of the softmax before dropout."""
    from checks import EPS, TOL, check_f16, check_lse

    rng = np.random.default_rng(7)
    q, k, v, mask = _dropout_case(rng, dtype)
    out, lse = sdpa(q, k, v, mask, dropout_p=0.3, seed=77, is_causal=causal, return_lse=True)
    want, want_lse = reference.attention_dropout(q, k, v, mask, dropout_p=0.3, seed=77,
                                                 is_causal=causal)
    assert out.dtype == dtype and lse.dtype == np.float32
    # kept entries are scaled by 1 / (1 - p): errors relative to the output grow by that much
    assert rel(out.astype(np.float64), want) <= TOL[dtype] / 0.7
    if dtype is np.float16:
        check_f16(out, want, v / 0.7)
    check_lse(lse, want_lse, dtype)
    assert (out[:, :, 5] == 0).all() and np.isneginf(lse[:, :, 5]).all()
    assert EPS[dtype] == np.finfo(np.float32).eps


def test_dropout_bitwise_equal_across_thread_counts():
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs at least 2 threads to compare")
    rng = np.random.default_rng(8)
    q, k, v, mask = _dropout_case(rng, np.float32)
    before = numba.get_num_threads()
    runs = []
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            assert numba.get_num_threads() == threads
            runs.append(sdpa(q, k, v, mask, dropout_p=0.3, seed=77, is_causal=True,
                             return_lse=True))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_against_torch(p):
    """The kept fraction is 1 - p, and kept probabilities are scaled by 1 / (1 - p), as in
    torch's dropout (an independent reference: its own generator, same statistics)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    S = 256
    q, k = rand(rng, 1, 2, 64, 4), rand(rng, 1, 2, S, 4)
    v = np.broadcast_to(np.eye(S), (1, 2, S, S))
    ours = sdpa(q, k, v, dropout_p=p, seed=3)
    torch.manual_seed(3)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)), dropout_p=p).numpy()
    n = ours.size
    sigma = np.sqrt(p * (1 - p) / n)
    for out in (ours, theirs):
        assert abs((out != 0).mean() - (1 - p)) < 5 * sigma
    probs, _ = reference.attention(q, k, v)
    for out in (ours, theirs):
        kept = out != 0
        np.testing.assert_allclose(out[kept], probs[kept] / (1 - p), rtol=1e-12)
