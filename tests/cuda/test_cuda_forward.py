"""The CUDA forward through the public API, against the float64 reference.

Shapes are small and odd, and the blocks tiny (conftest.TINY: 4 query rows x 4 keys), so that
every case crosses several query blocks and several key blocks, with ragged last blocks.
"""

import importlib

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import reference
from sdpa_numba.gpu import Blocks, options
from sdpa_numba.gpu.arrays import as_strided, broadcast_view
from sdpa_numba.gpu.forward import choose_blocks
from sdpa_cuda_testing import TOL, check, compare, dev, permuted, randn, rel_err, run

DTYPES = [np.float32, np.float64, np.float16]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [
    ((5, 3), (7, 3), (7, 4)),  # 2-D: one head
    ((3, 5, 8), (3, 7, 8), (3, 7, 6)),  # 3-D
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)),  # 4-D
    ((2, 1, 3, 5, 4), (1, 3, 1, 7, 4), (3, 1, 7, 5)),  # 5-D with broadcast batch and heads
], ids=["2d", "3d", "4d", "5d-broadcast"])
def test_shapes_and_dtypes(rng, dtype, shapes):
    q, k, v = (randn(rng, s, dtype) for s in shapes)
    check(q, k, v)


@pytest.mark.parametrize("e, ev", [(1, 1), (3, 17), (17, 3)])
def test_head_dims(rng, e, ev):
    q, k, v = randn(rng, (2, 9, e), np.float32), randn(rng, (2, 6, e), np.float32), \
        randn(rng, (2, 6, ev), np.float32)
    check(q, k, v)


def test_gqa(rng):
    q = randn(rng, (2, 6, 5, 8), np.float32)
    k = randn(rng, (2, 2, 7, 8), np.float32)
    v = randn(rng, (2, 2, 7, 3), np.float32)
    check(q, k, v, enable_gqa=True)
    check(q, k, v, enable_gqa=True, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(5, 7), (1, 3, 1, 7), (2, 1, 5, 7), (2, 3, 5, 7)])
def test_bool_mask(rng, dtype, mask_shape):
    q, k, v = (randn(rng, s, dtype) for s in ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)))
    mask = rng.random(mask_shape) > 0.4
    check(q, k, v, mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_mask_with_neg_inf(rng, dtype):
    q, k, v = (randn(rng, s, dtype) for s in ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)))
    mask = randn(rng, (3, 5, 7), dtype)
    mask[rng.random(mask.shape) > 0.7] = -np.inf
    check(q, k, v, mask)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows(rng, kind):
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 5, 4), (2, 9, 4), (2, 9, 3)))
    keep = rng.random((2, 5, 9)) > 0.3
    keep[0, 1] = False  # one row of one head sees nothing
    keep[1, 4] = False
    mask = keep if kind == "bool" else np.where(keep, 0.5, -np.inf).astype(np.float32)
    out, lse = check(q, k, v, mask)
    assert (out[0, 1] == 0).all() and (out[1, 4] == 0).all()
    assert lse[0, 1] == -np.inf and lse[1, 4] == -np.inf


@pytest.mark.parametrize("L, S", [(9, 9), (5, 11), (11, 5), (1, 7), (7, 1)])
def test_causal(rng, L, S):
    q, k, v = (randn(rng, s, np.float32) for s in ((2, L, 4), (2, S, 4), (2, S, 5)))
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("L, S", [(5, 11), (11, 5)])
def test_causal_with_mask(rng, L, S):
    q, k, v = (randn(rng, s, np.float32) for s in ((2, L, 4), (2, S, 4), (2, S, 5)))
    keep = rng.random((L, S)) > 0.3
    keep[2] = False
    check(q, k, v, keep, is_causal=True)
    check(q, k, v, np.where(keep, 0.25, -np.inf).astype(np.float32), is_causal=True)


@pytest.mark.parametrize("scale", [0.1, -0.7, 3.0])
def test_scale(rng, scale):
    q, k, v = (randn(rng, s, np.float64) for s in ((2, 5, 8), (2, 7, 8), (2, 7, 6)))
    check(q, k, v, scale=scale)


def test_large_logits_are_stable(rng):
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 5, 8), (2, 9, 8), (2, 9, 6)))
    out, lse = check(q, k, v, scale=1e4 / np.sqrt(8))
    assert np.isfinite(out).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, dtype):
    """(B, L, H, E) tensors seen as (B, H, L, E), every other column of V, a transposed mask:
    all read in place."""
    tq = (0, 2, 1, 3)
    qh, kh = randn(rng, (2, 5, 3, 8), dtype), randn(rng, (2, 7, 3, 8), dtype)
    vh = randn(rng, (2, 7, 3, 12), dtype)
    mh = rng.random((2, 7, 5)) > 0.3  # (B, S, L)
    dm = permuted(dev(mh), (0, 2, 1))  # (B, L, S)
    dm = as_strided(dm, (2, 1, 5, 7), (dm.strides[0], 0, dm.strides[1], dm.strides[2]))
    args = [permuted(dev(qh), tq), permuted(dev(kh), tq), permuted(dev(vh)[..., ::2], tq), dm]
    assert not args[0].is_c_contiguous()
    out, lse = sdpa_numba.scaled_dot_product_attention(*args, return_lse=True)
    compare(out.copy_to_host(), lse.copy_to_host(), qh.transpose(tq), kh.transpose(tq),
            vh[..., ::2].transpose(tq), mh.transpose(0, 2, 1)[:, None])


def test_unmergeable_batch_dims(rng):
    """Batch dims whose strides cannot merge: one launch per leading index."""
    qh = randn(rng, (3, 2, 2, 5, 4), np.float32)  # batch seen as (2, 3)
    k, v = randn(rng, (2, 3, 2, 7, 4), np.float32), randn(rng, (2, 3, 2, 7, 3), np.float32)
    axes = (1, 0, 2, 3, 4)
    out, lse = sdpa_numba.scaled_dot_product_attention(
        permuted(dev(qh), axes), dev(k), dev(v), return_lse=True)
    compare(out.copy_to_host(), lse.copy_to_host(), qh.transpose(axes), k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_return_lse_and_out(rng, dtype):
    q, k, v = (randn(rng, s, dtype) for s in ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)))
    out = dev(np.full((2, 3, 5, 6), np.nan, dtype))
    result = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v), out=out)
    assert result is out
    ref, _ = reference.attention(q, k, v)
    assert rel_err(out.copy_to_host(), ref) <= TOL[np.dtype(dtype)]
    result, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v), out=out,
                                                          return_lse=True)
    assert result is out and lse.shape == (2, 3, 5)
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)


def test_out_strided_view(rng):
    q, k, v = (randn(rng, s, np.float32) for s in ((3, 5, 4), (3, 7, 4), (3, 7, 6)))
    buf = dev(np.full((5, 3, 6), np.nan, np.float32))  # (L, H, Ev) seen as (H, L, Ev)
    out = permuted(buf, (1, 0, 2))
    sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v), out=out)
    ref, _ = reference.attention(q, k, v)
    assert rel_err(buf.copy_to_host().transpose(1, 0, 2), ref) <= 1e-5


def test_out_checks(rng):
    q, k, v = (dev(randn(rng, s, np.float32)) for s in ((3, 5, 4), (3, 7, 4), (3, 7, 4)))
    with pytest.raises(ValueError, match="overlaps query"):
        sdpa_numba.scaled_dot_product_attention(q, k, v, out=q)
    with pytest.raises(ValueError, match="zero strides"):
        broadcast = broadcast_view(dev(np.zeros((1, 5, 4), np.float32)), (3, 5, 4))
        sdpa_numba.scaled_dot_product_attention(q, k, v, out=broadcast)
    with pytest.raises(ValueError, match="out must have shape"):
        sdpa_numba.scaled_dot_product_attention(q, k, v, out=dev(np.zeros((3, 5, 3), np.float32)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_keys(rng, dtype):
    q, k, v = randn(rng, (2, 5, 4), dtype), randn(rng, (2, 0, 4), dtype), \
        randn(rng, (2, 0, 3), dtype)
    out, lse = run(q, k, v)
    assert out.shape == (2, 5, 3) and (out == 0).all()
    assert lse.shape == (2, 5) and np.isneginf(lse).all()


def test_no_queries(rng):
    q, k, v = randn(rng, (2, 0, 4), np.float32), randn(rng, (2, 3, 4), np.float32), \
        randn(rng, (2, 3, 3), np.float32)
    out, lse = run(q, k, v)
    assert out.shape == (2, 0, 3) and lse.shape == (2, 0)


def test_nan_stays_in_its_row(rng):
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 9, 4), (2, 7, 4), (2, 7, 3)))
    q[1, 6, 2] = np.nan
    out, lse = run(q, k, v)
    assert np.isnan(out[1, 6]).all() and np.isnan(lse[1, 6])
    rows = np.ones((2, 9), bool)
    rows[1, 6] = False
    ref, ref_lse = reference.attention(q, k, v)
    assert rel_err(out[rows], ref[rows]) <= 1e-5
    assert rel_err(lse[rows], ref_lse[rows]) <= 1e-5


def test_inputs_untouched(rng):
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 5, 4), (2, 7, 4), (2, 7, 3)))
    mask = rng.random((5, 7)) > 0.5
    d = [dev(x) for x in (q, k, v, mask)]
    sdpa_numba.scaled_dot_product_attention(*d, is_causal=True)
    for x, dx in zip((q, k, v, mask), d):
        assert np.array_equal(dx.copy_to_host(), x)


def test_bitwise_reproducible(rng):
    q, k, v = (dev(randn(rng, s, np.float32)) for s in ((2, 9, 4), (2, 7, 4), (2, 7, 3)))
    a = sdpa_numba.scaled_dot_product_attention(q, k, v).copy_to_host()
    b = sdpa_numba.scaled_dot_product_attention(q, k, v).copy_to_host()
    assert np.array_equal(a, b)


@pytest.mark.parametrize("blocks", [
    Blocks(block_m=3, block_n=2, threads=6, rows_per_thread=1),  # more threads than rows
    Blocks(block_m=8, block_n=2, threads=2, rows_per_thread=8),  # one row group
    Blocks(block_m=1, block_n=1, threads=1, rows_per_thread=1),
    Blocks(block_m=4, block_n=8, threads=8, rows_per_thread=4),  # 8 threads per row
])
def test_other_blocks(rng, monkeypatch, blocks):
    monkeypatch.setattr(options, "BLOCKS", blocks)
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 9, 5), (2, 11, 5), (2, 11, 7)))
    mask = rng.random((9, 11)) > 0.3
    check(q, k, v, mask, is_causal=True)


def test_default_blocks(rng, monkeypatch):
    """The launcher's own choice from the device's limits (one big block here)."""
    monkeypatch.setattr(options, "BLOCKS", None)
    q, k, v = (randn(rng, s, np.float32) for s in ((1, 5, 4), (1, 7, 4), (1, 7, 3)))
    check(q, k, v, is_causal=True)


def test_choose_blocks_fits_limits(monkeypatch):
    # sdpa_numba.gpu.forward is the function; the module is fetched by name.
    forward = importlib.import_module("sdpa_numba.gpu.forward")
    monkeypatch.setattr(forward, "device_limits", lambda: (48 * 1024, 1024))
    for itemsize in (4, 8):
        for e, ev in ((64, 64), (128, 128), (256, 256), (64, 17)):
            b = choose_blocks(itemsize, e, ev)
            assert b.shared_elements(e, ev) * itemsize <= 48 * 1024
    assert choose_blocks(4, 64, 64) == Blocks(64, 32, 256, 4)
    monkeypatch.setattr(forward, "device_limits", lambda: (48 * 1024, 64))
    assert choose_blocks(4, 64, 64).threads <= 64
    with pytest.raises(ValueError, match="too large"):
        choose_blocks(8, 100_000, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_kernel_arguments_are_launchable(dtype, mask_kind):
    """Numba launches only arrays, numbers, booleans and tuples of them (not None, which the
    simulator takes): the kernels' signatures must hold nothing else."""
    import numba

    forward = importlib.import_module("sdpa_numba.gpu.forward")
    backward = importlib.import_module("sdpa_numba.gpu.backward")
    scalars = (numba.boolean, numba.float64, numba.uint64, numba.int64)

    def launchable(t):
        if isinstance(t, numba.types.BaseTuple):
            return all(launchable(x) for x in t.types)
        return isinstance(t, numba.types.Array) or t in scalars

    for signature in (forward._signature, backward.dq_signature, backward.dkv_signature):
        sig, _ = signature(np.dtype(dtype), mask_kind)
        for t in sig.args:
            assert launchable(t), t


def test_blocks_validation():
    with pytest.raises(ValueError, match="inconsistent"):
        Blocks(block_m=4, block_n=3, threads=4, rows_per_thread=2)
    with pytest.raises(ValueError, match="positive"):
        Blocks(block_m=0, block_n=3, threads=4, rows_per_thread=2)


def test_mixing_host_and_device_is_a_type_error(rng):
    q = randn(rng, (5, 4), np.float32)
    with pytest.raises(TypeError, match="mix host and device"):
        sdpa_numba.scaled_dot_product_attention(dev(q), q, dev(q))
    with pytest.raises(TypeError, match="mix host and device"):
        sdpa_numba.scaled_dot_product_attention(dev(q), dev(q), dev(q), q > 0)


def test_device_validation_errors(rng):
    q = dev(randn(rng, (5, 4), np.float32))
    with pytest.raises(ValueError, match="key's last dim"):
        sdpa_numba.scaled_dot_product_attention(q, dev(np.zeros((5, 3), np.float32)), q)
    with pytest.raises(TypeError, match="attn_mask dtype"):
        sdpa_numba.scaled_dot_product_attention(q, q, q, dev(np.zeros((5, 5), np.int32)))


def test_negative_strides_are_refused(rng):
    q = dev(randn(rng, (5, 4), np.float32))
    with pytest.raises(ValueError, match="negative strides"):
        sdpa_numba.scaled_dot_product_attention(q[::-1], q, q)


def test_result_kind_is_numba_device_array(rng):
    q = dev(randn(rng, (5, 4), np.float32))
    out, lse = sdpa_numba.scaled_dot_product_attention(q, q, q, return_lse=True)
    assert type(out) is type(q) and type(lse) is type(q)
