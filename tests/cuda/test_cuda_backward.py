"""The CUDA backward through the public API, against the float64 reference
(sdpa_numba.reference.attention_backward).

Blocks are tiny (conftest.TINY: 4 query rows x 4 keys), so that the small, odd shapes here
cross several query blocks and key blocks, with ragged last blocks. ``out`` and ``lse`` come
from the reference (rounded to the storage and compute dtypes) unless a test says otherwise:
it saves the simulator a forward per case.
"""

import importlib

import numpy as np
import pytest

import sdpa_numba
from checks import check_backward
from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward
from sdpa_numba.gpu import Blocks, options
from sdpa_numba.gpu.arrays import broadcast_view
from sdpa_numba.gpu.reduce import broadcast_axes
from sdpa_cuda_testing import dev, permuted, randn, rel_err, torch_cuda


def forward(q, k, v, mask=None, *, on_device=False, **kw):
    """Host ``(out, lse)`` in the storage / compute dtypes: from the reference, or from the
    CUDA forward with ``on_device``."""
    if on_device:
        out, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v), dev(mask),
                                                           return_lse=True, **kw)
        return out.copy_to_host(), lse.copy_to_host()
    if kw.get("dropout_p", 0) > 0:
        out, lse = reference.attention_dropout(q, k, v, mask, **kw)
    else:
        out, lse = reference.attention(q, k, v, mask, **kw)
    cdt = np.float64 if q.dtype == np.float64 else np.float32
    return out.astype(q.dtype), lse.astype(cdt)


def device_grads(g, q, k, v, out, lse, mask=None, **kw):
    """The CUDA backward on device copies; host gradients."""
    grads = sdpa_backward(dev(g), dev(q), dev(k), dev(v), dev(out), dev(lse), dev(mask), **kw)
    return [x.copy_to_host() for x in grads]


def check(q, k, v, mask=None, *, on_device=False, tol=None, **kw):
    """Backward on the device vs the reference; returns the host gradients."""
    rng = np.random.default_rng(1)
    out, lse = forward(q, k, v, mask, on_device=on_device, **kw)
    g = randn(rng, out.shape, q.dtype)
    return check_backward(device_grads, g, q, k, v, out, lse, mask, tol, **kw)


CASES = {
    # name: (q shape, k shape, v shape, kwargs)
    "plain": ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 3), {}),
    "two_dim": ((5, 3), (17, 3), (17, 3), {}),
    "tiny": ((1, 1, 1, 3), (1, 1, 3, 3), (1, 1, 3, 1), {}),
    "one_key": ((3, 5, 2), (3, 1, 2), (3, 1, 5), {"scale": 0.3}),
    "head_dims_1_and_17": ((2, 6, 1), (2, 5, 1), (2, 5, 17), {}),
    "head_dims_17_and_1": ((2, 6, 17), (2, 5, 17), (2, 5, 1), {"scale": -0.7}),
    "causal_L_lt_S": ((1, 2, 5, 4), (1, 2, 11, 4), (1, 2, 11, 3), {"is_causal": True}),
    "causal_L_gt_S": ((1, 2, 11, 4), (1, 2, 5, 4), (1, 2, 5, 6), {"is_causal": True}),
    "gqa_causal": ((2, 4, 5, 3), (2, 2, 9, 3), (2, 2, 9, 2),
                   {"enable_gqa": True, "is_causal": True}),
    "broadcast_batch_heads": ((2, 1, 1, 5, 4), (1, 2, 1, 7, 4), (2, 1, 7, 2), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference(name):
    qs, ks, vs, kw = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v = (randn(rng, s, np.float64) for s in (qs, ks, vs))
    check(q, k, v, **kw)


def test_end_to_end_with_the_cuda_forward():
    """out and lse from the CUDA forward itself, GQA, causal, an additive mask."""
    rng = np.random.default_rng(2)
    q, k, v = randn(rng, (2, 4, 7, 3), np.float64), randn(rng, (2, 2, 6, 3), np.float64), \
        randn(rng, (2, 2, 6, 5), np.float64)
    mask = randn(rng, (4, 7, 6), np.float64)
    check(q, k, v, mask, on_device=True, enable_gqa=True, is_causal=True)


@pytest.mark.parametrize("mask_shape", [(7, 9), (1, 3, 1, 9), (2, 3, 7, 9)])
def test_bool_mask_and_fully_masked_rows(mask_shape):
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 3, 7, 4), np.float64), randn(rng, (2, 3, 9, 4), np.float64), \
        randn(rng, (2, 3, 9, 3), np.float64)
    keep = rng.random(mask_shape) > 0.3
    rows = mask_shape[-2] > 1
    if rows:
        keep[..., 1, :] = False  # row 1 sees no key
    dq, dk, dv = check(q, k, v, keep)
    if rows:
        assert (dq[..., 1, :] == 0).all()


def test_additive_mask_gradient_with_neg_inf():
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, (2, 2, 5, 4), np.float64), randn(rng, (2, 2, 9, 4), np.float64), \
        randn(rng, (2, 2, 9, 4), np.float64)
    full = randn(rng, (2, 2, 5, 9), np.float64)
    full[rng.random(full.shape) < 0.2] = -np.inf
    full[0, 1, 4] = -np.inf  # a fully masked row
    # the full mask; broadcast over batch and heads; over batch and rows
    for mask in (full, full[0, 0].copy(), full[0, :, :1].copy()):
        dq, dk, dv, dm = check(q, k, v, mask)
        assert dm.shape == mask.shape
    dq, dk, dv, dm = check(q, k, v, full, is_causal=True)
    assert (dm[np.isneginf(full)] == 0).all() and (np.triu(dm, 1) == 0).all()
    assert (dq[0, 1, 4] == 0).all()


@pytest.mark.parametrize("L, S", [(5, 11), (11, 5)])
def test_causal_with_masks(L, S):
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, s, np.float64) for s in ((2, L, 4), (2, S, 4), (2, S, 3)))
    keep = rng.random((L, S)) > 0.3
    keep[2] = False
    check(q, k, v, keep, is_causal=True)
    check(q, k, v, np.where(keep, 0.25, -np.inf), is_causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_lower_precision(dtype):
    rng = np.random.default_rng(6)
    q, k, v = randn(rng, (1, 2, 9, 8), dtype), randn(rng, (1, 1, 7, 8), dtype), \
        randn(rng, (1, 1, 7, 5), dtype)
    mask = randn(rng, (9, 7), dtype)
    check(q, k, v, mask, enable_gqa=True, is_causal=True)
    check(q[0, 0], k[0, 0], v[0, 0])  # 2-D: the (1, 1) batch and heads are summed away


def test_large_logits_are_stable():
    rng = np.random.default_rng(7)
    q, k, v = (30 * randn(rng, (1, 2, 6, 4), np.float64) for _ in range(3))
    check(q, k, v, scale=3.0, tol=1e-10)


@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "enable_gqa": True}])
def test_dropout_gradients_match_reference_with_the_same_mask(kw):
    rng = np.random.default_rng(8)
    q = randn(rng, (1, 2, 9, 4), np.float64)
    k, v = randn(rng, (1, 1, 11, 4), np.float64), randn(rng, (1, 1, 11, 3), np.float64)
    if not kw:
        k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    check(q, k, v, dropout_p=0.3, seed=2**63 + 99, **kw)


def test_dropout_end_to_end_and_across_launch_splits():
    """The device forward's mask is the one the backward regenerates, also when the batch
    dims cannot merge (one launch per leading index: the batch offset keeps the mask)."""
    rng = np.random.default_rng(9)
    qh = randn(rng, (3, 2, 1, 5, 4), np.float64)
    k, v = randn(rng, (2, 3, 1, 7, 4), np.float64), randn(rng, (2, 3, 1, 7, 3), np.float64)
    axes = (1, 0, 2, 3, 4)  # query seen as (2, 3, 1, 5, 4): its batch dims cannot merge
    dq_ = permuted(dev(qh), axes)
    kw = dict(dropout_p=0.4, seed=5)
    out, lse = sdpa_numba.scaled_dot_product_attention(dq_, dev(k), dev(v), return_lse=True,
                                                       **kw)
    g = randn(rng, out.shape, np.float64)
    got = sdpa_backward(dev(g), dq_, dev(k), dev(v), out, lse, **kw)
    want = reference.attention_backward(g, qh.transpose(axes), k, v, **kw)
    for a, b in zip(got, want):
        assert rel_err(a.copy_to_host(), b) <= 1e-12


def test_bitwise_reproducible():
    rng = np.random.default_rng(10)
    q, k, v = randn(rng, (1, 2, 9, 4), np.float32), randn(rng, (1, 1, 7, 4), np.float32), \
        randn(rng, (1, 1, 7, 3), np.float32)
    mask = randn(rng, (9, 7), np.float32)
    out, lse = forward(q, k, v, mask, enable_gqa=True)
    g = randn(rng, out.shape, np.float32)
    kw = dict(enable_gqa=True, is_causal=True, dropout_p=0.2, seed=3, mask_grad=True)
    a = device_grads(g, q, k, v, out, lse, mask, **kw)
    b = device_grads(g, q, k, v, out, lse, mask, **kw)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


def test_every_gradient_element_is_written(monkeypatch):
    """Gradient buffers (and D) poisoned with NaN: every element must be written."""
    # by name: the package's attribute `backward` is the launcher function
    cuda_backward = importlib.import_module("sdpa_numba.gpu.backward")
    launch_backward = importlib.import_module("sdpa_numba.gpu.launch_backward")
    shapes = []

    def poisoned(shape, dtype):
        shapes.append(tuple(shape))
        return dev(np.full(shape, np.nan, dtype))

    monkeypatch.setattr(launch_backward, "device_array", poisoned)
    monkeypatch.setattr(cuda_backward, "device_array", poisoned)
    rng = np.random.default_rng(11)
    q, k, v = randn(rng, (2, 2, 6, 3), np.float64), randn(rng, (2, 2, 9, 3), np.float64), \
        randn(rng, (2, 2, 9, 2), np.float64)
    mask = randn(rng, (2, 2, 6, 9), np.float64)
    check(q, k, v, mask, is_causal=True)  # mask gradient above the diagonal: zeros
    assert {(2, 2, 6), (2, 2, 6, 3), (2, 2, 9, 2), (2, 2, 6, 9)} <= set(shapes)  # D, dq, ...
    check(q[:, :, :1], k, v, mask[:, :, :1])  # L = 1: most key blocks see one row


def test_strided_and_broadcast_operands():
    """(B, L, H, E) tensors seen as (B, H, L, E), a transposed mask, and a grad_out broadcast
    with zero strides (as autograd passes for out.sum()), all read in place."""
    rng = np.random.default_rng(12)
    tq = (0, 2, 1, 3)
    qh, kh = randn(rng, (2, 5, 3, 4), np.float64), randn(rng, (2, 7, 3, 4), np.float64)
    vh = randn(rng, (2, 7, 3, 6), np.float64)
    mh = randn(rng, (7, 5), np.float64)  # (S, L)
    q, k, v, mask = qh.transpose(tq), kh.transpose(tq), vh[..., ::2].transpose(tq), mh.T
    out, lse = forward(q, k, v, mask)
    g = broadcast_view(dev(np.ones((1, 1, 1, 3))), out.shape)
    dvh = dev(vh)
    got = sdpa_backward(g, permuted(dev(qh), tq), permuted(dev(kh), tq),
                        permuted(dvh[..., ::2], tq), dev(out), dev(lse),
                        permuted(dev(mh), (1, 0)), mask_grad=True)
    want = reference.attention_backward(np.ones(out.shape), q, k, v, mask)
    for a, b in zip(got, want):
        assert rel_err(a.copy_to_host(), b) <= 1e-12
    assert np.array_equal(dvh.copy_to_host(), vh)  # inputs untouched


@pytest.mark.parametrize("blocks", [
    Blocks(block_m=3, block_n=2, threads=6, rows_per_thread=1),  # more threads than rows
    Blocks(block_m=8, block_n=2, threads=2, rows_per_thread=8),  # one row group
    Blocks(block_m=1, block_n=1, threads=1, rows_per_thread=1),
])
def test_other_blocks(monkeypatch, blocks):
    monkeypatch.setattr(options, "BLOCKS", blocks)
    rng = np.random.default_rng(13)
    q, k, v = randn(rng, (2, 2, 9, 5), np.float64), randn(rng, (2, 1, 7, 5), np.float64), \
        randn(rng, (2, 1, 7, 3), np.float64)
    mask = randn(rng, (9, 7), np.float64)
    check(q, k, v, mask, is_causal=True, enable_gqa=True, dropout_p=0.25, seed=4)


def test_empty_sizes():
    q, k, v = np.ones((1, 2, 0, 4)), np.ones((1, 2, 5, 4)), np.ones((1, 2, 5, 3))
    out, lse = forward(q, k, v)
    dq, dk, dv = device_grads(out, q, k, v, out, lse)
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
    q, k, v = np.ones((1, 2, 3, 4)), np.ones((1, 2, 0, 4)), np.ones((1, 2, 0, 3))
    out, lse = forward(q, k, v)
    dq, dk, dv = device_grads(np.ones_like(out), q, k, v, out, lse)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


def test_broadcast_axes():
    assert broadcast_axes((2, 3, 5, 4), (3, 5, 4)) == (0,)
    assert broadcast_axes((2, 3, 5, 4), (2, 1, 5, 4)) == (1,)
    assert broadcast_axes((2, 3, 5, 4), (1, 5, 1)) == (0, 1, 3)
    assert broadcast_axes((2, 3), (2, 3)) == ()


def test_result_kind_and_dtypes():
    rng = np.random.default_rng(14)
    q = randn(rng, (5, 4), np.float32)
    out, lse = forward(q, q, q)
    d = dev(q)
    grads = sdpa_backward(dev(out), d, d, d, dev(out), dev(lse))
    assert all(type(x) is type(d) and x.dtype == np.float32 and x.shape == (5, 4)
               for x in grads)


def test_bad_input_raises_before_any_kernel(monkeypatch):
    launch_backward = importlib.import_module("sdpa_numba.gpu.launch_backward")

    def no_kernels(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(launch_backward, "backward", no_kernels)
    x = np.zeros((2, 3, 5, 4))
    lse = np.zeros((2, 3, 5))
    d, dl = dev(x), dev(lse)
    with pytest.raises(TypeError, match="mix host and device"):
        sdpa_backward(d, d, d, x, d, dl)
    with pytest.raises(ValueError, match="lse"):
        sdpa_backward(d, d, d, d, d, dev(lse[..., :4]))
    with pytest.raises(ValueError, match="lse"):
        sdpa_backward(d, d, d, d, d, dev(lse.astype(np.float32)))
    with pytest.raises(ValueError, match="mask_grad"):
        sdpa_backward(d, d, d, d, d, dl, dev(x[0, 0, :, :1] > 0), mask_grad=True)
    with pytest.raises(ValueError, match="seed"):
        sdpa_backward(d, d, d, d, d, dl, dropout_p=0.1)
    with pytest.raises(ValueError, match="negative strides"):
        sdpa_backward(d, d[:, :, ::-1], d, d, d, dl)
    with pytest.raises(ValueError, match="key's last dim"):
        sdpa_backward(d, d, dev(x[..., :3]), d, d, dl)


@pytest.mark.skipif(torch_cuda() is None, reason="needs a GPU and torch with CUDA")
def test_torch_autograd_on_cuda_tensors():
    """sdpa_numba.torch on CUDA tensors: forward and backward on the CUDA kernels, gradients
    as torch's own SDPA gives them."""
    torch = torch_cuda()
    import sdpa_numba.torch as snt

    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float64, generator=g)

    q, k, v = randn(2, 4, 33, 16), randn(2, 2, 70, 16), randn(2, 2, 70, 8)
    mask = randn(4, 33, 70)
    grad = randn(2, 4, 33, 8)
    results = []
    for attention in (snt.scaled_dot_product_attention, F.scaled_dot_product_attention):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, mask)]
        out = attention(*leaves, enable_gqa=True, is_causal=True, scale=0.2)
        out.backward(grad)
        results.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*results):
        assert a.is_cuda
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
