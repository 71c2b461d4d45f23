"""Dropout on the CUDA path: the device functions' keep decisions, the forward against the
reference with the same mask, and the CPU and the (simulated) GPU drawing the same mask."""

import numpy as np
import pytest
from numba import cuda

import sdpa_numba
from sdpa_numba import dropout, reference
from sdpa_numba.gpu.dropout import dropout_factor, row_key
from dropout_known_answers import known_keep_1234
from sdpa_cuda_testing import TOL, dev, permuted, randn, rel_err, run

SEED = 2**63 + 12345  # high bit set: the seed must travel as a uint64


@cuda.jit
def keep_grid(seed, threshold, heads, L, S, out):
    """out[b, h, i, j] = whether the device functions keep (b, h, i, j): one thread each."""
    t = cuda.grid(1)
    if t < out.size:
        j = t % S
        i = t // S % L
        h = t // (S * L) % heads
        b = t // (S * L * heads)
        out[b, h, i, j] = dropout_factor(row_key(seed, b, h, i), j, threshold, 1.0, 0.0) != 0


@pytest.mark.parametrize("p", [0.37, 0.9])
def test_device_functions_match_keep_mask(p):
    shape = (2, 3, 5, 7)
    out = cuda.to_device(np.zeros(shape, np.bool_))
    keep_grid[(out.size + 31) // 32, 32](np.uint64(SEED), np.uint64(dropout.threshold(p)),
                                          shape[1], shape[2], shape[3], out)
    want = dropout.keep_mask(SEED, p, shape[:1], *shape[1:])
    np.testing.assert_array_equal(out.copy_to_host(), want)
    assert 0 < want.sum() < want.size  # the comparison sees both decisions


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "enable_gqa": True}])
def test_forward_matches_reference_with_the_same_mask(dtype, kw):
    rng = np.random.default_rng(0)
    q = randn(rng, (2, 4, 9, 5), dtype)
    k, v = randn(rng, (2, 2, 11, 5), dtype), randn(rng, (2, 2, 11, 3), dtype)
    if not kw:
        k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    out, lse = run(q, k, v, dropout_p=0.3, seed=SEED, **kw)
    want, want_lse = reference.attention_dropout(q, k, v, dropout_p=0.3, seed=SEED, **kw)
    assert out.dtype == dtype
    assert rel_err(out, want) <= TOL[np.dtype(dtype)]
    # lse is that of the softmax before dropout
    _, lse0 = reference.attention(q, k, v, **kw)
    cdt = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    assert rel_err(lse, lse0) <= TOL[cdt] and rel_err(lse, want_lse) <= TOL[cdt]


def test_masks_and_fully_masked_rows():
    rng = np.random.default_rng(1)
    q, k, v = (randn(rng, s, np.float64) for s in ((2, 7, 4), (2, 9, 4), (2, 9, 3)))
    keep = rng.random((7, 9)) > 0.3
    keep[2] = False
    for mask in (keep, np.where(keep, 0.5, -np.inf)):
        out, lse = run(q, k, v, mask, dropout_p=0.5, seed=3, is_causal=True)
        want, _ = reference.attention_dropout(q, k, v, mask, dropout_p=0.5, seed=3,
                                              is_causal=True)
        assert rel_err(out, want) <= 1e-12
        assert (out[:, 2] == 0).all() and np.isneginf(lse[:, 2]).all()


def test_cpu_and_simulator_gpu_draw_the_same_mask():
    """With V = I, out = P Z (L x S): its zeros are exactly the dropped probabilities, on the
    CPU, on the device, and in the NumPy mask."""
    rng = np.random.default_rng(2)
    p, S = 0.4, 13
    q, k = randn(rng, (2, 3, 6, 4), np.float64), randn(rng, (2, 3, S, 4), np.float64)
    v = np.ascontiguousarray(np.broadcast_to(np.eye(S), (2, 3, S, S)))
    on_cpu = sdpa_numba.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=SEED)
    on_gpu, _ = run(q, k, v, dropout_p=p, seed=SEED)
    keep = dropout.keep_mask(SEED, p, (2,), 3, 6, S)
    np.testing.assert_array_equal(on_gpu != 0, keep)
    np.testing.assert_array_equal(on_cpu != 0, keep)
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-13, atol=0)


def test_same_seed_same_bits_other_seed_differs():
    rng = np.random.default_rng(3)
    q, k, v = (dev(randn(rng, s, np.float32)) for s in ((2, 9, 4), (2, 7, 4), (2, 7, 3)))

    def attend(seed):
        return sdpa_numba.scaled_dot_product_attention(q, k, v, dropout_p=0.5,
                                                       seed=seed).copy_to_host()

    a, b, c = attend(7), attend(7), attend(8)
    assert a.tobytes() == b.tobytes()
    assert not np.array_equal(a, c)
    fresh = sdpa_numba.scaled_dot_product_attention(q, k, v, dropout_p=0.5).copy_to_host()
    assert not np.array_equal(fresh, a)


def test_mask_independent_of_launch_split():
    """Batch dims that no view merges run as one launch per leading index: the kernels' batch
    index is still the flat one, so the mask is that of a contiguous batch."""
    rng = np.random.default_rng(4)
    qh = randn(rng, (3, 2, 2, 5, 4), np.float64)
    k, v = randn(rng, (2, 3, 2, 7, 4), np.float64), randn(rng, (2, 3, 2, 7, 3), np.float64)
    axes = (1, 0, 2, 3, 4)  # query seen as (2, 3, 2, 5, 4): its batch dims cannot merge
    split = sdpa_numba.scaled_dot_product_attention(
        permuted(dev(qh), axes), dev(k), dev(v), dropout_p=0.4, seed=5).copy_to_host()
    q = qh.transpose(axes)
    whole, _ = run(q, k, v, dropout_p=0.4, seed=5)
    np.testing.assert_array_equal(split, whole)
    want, _ = reference.attention_dropout(q, k, v, dropout_p=0.4, seed=5)
    assert rel_err(split, want) <= 1e-12


def test_poisoned_out_buffer_is_fully_written():
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 3, 7, 4), (2, 3, 9, 4), (2, 3, 9, 5)))
    out = dev(np.full((2, 3, 7, 5), np.nan, np.float32))
    result = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v), dropout_p=0.6,
                                                     seed=1, is_causal=True, out=out)
    assert result is out
    want, _ = reference.attention_dropout(q, k, v, dropout_p=0.6, seed=1, is_causal=True)
    assert rel_err(out.copy_to_host(), want) <= TOL[np.dtype(np.float32)]


@pytest.mark.parametrize("kw, err", [(dict(dropout_p=1.0), ValueError),
                                     (dict(dropout_p=0.1, seed=-1), ValueError),
                                     (dict(dropout_p=0.1, seed=1.5), TypeError)])
def test_bad_dropout_arguments_raise_before_any_kernel(monkeypatch, kw, err):
    import importlib

    launch = importlib.import_module("sdpa_numba.gpu.launch")

    def no_kernels(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(launch, "forward", no_kernels)
    x = dev(np.zeros((2, 5, 4), np.float32))
    with pytest.raises(err, match="dropout_p" if "seed" not in kw else "seed"):
        sdpa_numba.scaled_dot_product_attention(x, x, x, **kw)


# Known answers: tests/dropout_known_answers.py, shared with the CPU suite.


def test_known_answers_of_the_device_functions():
    shape = (2, 2, 3, 70)
    out = cuda.to_device(np.zeros(shape, np.bool_))
    keep_grid[(out.size + 31) // 32, 32](np.uint64(1234), np.uint64(2**31), shape[1],
                                          shape[2], shape[3], out)
    np.testing.assert_array_equal(out.copy_to_host(), known_keep_1234())


def test_known_answers_of_the_kernel():
    """The CUDA forward (V = identity: out = P Z) drops exactly the known entries."""
    rng = np.random.default_rng(6)
    q, k = randn(rng, (2, 2, 3, 4), np.float64), randn(rng, (2, 2, 70, 4), np.float64)
    v = np.ascontiguousarray(np.broadcast_to(np.eye(70), (2, 2, 70, 70)))
    out, _ = run(q, k, v, dropout_p=0.5, seed=1234)
    np.testing.assert_array_equal(out != 0, known_keep_1234())
