"""bfloat16 storage on the CUDA kernels (int16 views; on the simulator, the Python bodies of
:mod:`sdpa_numba.gpu.storage` convert): conversions, forward and backward against float64.

Tiny blocks (conftest.TINY) so that the small odd shapes cross several query and key blocks.
Tolerances and references: see bf16_checks.
"""

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from bf16_checks import (BF16, check_forward, check_grads, check_rounding,  # noqa: E402
                         randn, special_float32)
from sdpa_cuda_testing import SIMULATED, dev, torch_cuda  # noqa: E402

import sdpa_numba  # noqa: E402
from sdpa_numba.gpu.storage import load, storage_view, store  # noqa: E402


@pytest.mark.skipif(not SIMULATED, reason="the simulator's conversions (Python bodies)")
def test_simulator_load_is_exact_for_every_pattern():
    bits = np.arange(-(1 << 15), 1 << 15, dtype=np.int32).astype(np.int16)
    got = np.array([load(b) for b in bits], np.float32)
    want = (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.skipif(not SIMULATED, reason="the simulator's conversions (Python bodies)")
def test_simulator_store_rounds_to_nearest_even():
    x = special_float32()
    x = np.concatenate([x[:20000], x[-(1 << 18) - 22:-(1 << 18)], x[-5000:]])  # + named ones
    like = np.empty(1, np.int16)
    got = np.array([store(v, like) for v in x], np.int16)
    check_rounding(x, got)


def test_storage_view_is_int16_without_a_copy():
    d = dev(np.arange(6, dtype=np.float32).astype(BF16))
    s = storage_view(d)
    assert s.dtype == np.int16 and s.shape == d.shape
    np.testing.assert_array_equal(s.copy_to_host(), d.copy_to_host().view(np.int16))
    f = dev(np.zeros(3, np.float16))
    assert storage_view(f) is f


CASES = {
    "odd": ((2, 2, 7, 5), (2, 2, 9, 5), (2, 2, 9, 3), {}),
    "causal_gqa": ((1, 4, 9, 4), (1, 2, 9, 4), (1, 2, 9, 3), {"is_causal": True,
                                                              "enable_gqa": True}),
    "two_dim": ((5, 3), (6, 3), (6, 2), {"scale": 0.3}),
    "dropout": ((1, 2, 6, 4), (1, 2, 7, 4), (1, 2, 7, 3), {"dropout_p": 0.3, "seed": 5}),
}


#: (case, mask kind) pairs: masks on the cases other than two_dim and dropout.
PAIRS = [(c, kind) for c in CASES for kind in ("none", "bool", "additive")
         if kind == "none" or c not in ("two_dim", "dropout")]


@pytest.mark.parametrize("case, kind", PAIRS)
def test_forward_and_backward(rng, case, kind):
    qs, ks, vs, kw = CASES[case]
    q, k, v = randn(rng, qs), randn(rng, ks), randn(rng, vs)
    mask = None
    if kind == "bool":
        mask = rng.random((qs[-2], ks[-2])) < 0.7
        mask[:, 0] = True
    elif kind == "additive":
        mask = randn(rng, (1, qs[-2], ks[-2]))
    out_d = dev(np.full(qs[:-1] + vs[-1:], np.nan, BF16))
    res, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v), dev(mask),
                                                       out=out_d, return_lse=True, **kw)
    assert res is out_d
    out, lse = out_d.copy_to_host(), lse.copy_to_host()
    check_forward(out, lse, q, k, v, mask, **kw)
    g = randn(rng, out.shape)
    grads = sdpa_numba.scaled_dot_product_attention_backward(
        dev(g), dev(q), dev(k), dev(v), dev(out), dev(lse), dev(mask),
        mask_grad=kind == "additive", **kw)
    check_grads([x.copy_to_host() for x in grads], g, q, k, v, out, mask, **kw)


def test_numba_level_launcher_takes_bfloat16(rng):
    from sdpa_numba.gpu import forward

    q, k, v = randn(rng, (1, 2, 5, 4)), randn(rng, (1, 2, 6, 4)), randn(rng, (1, 2, 6, 3))
    out = dev(np.zeros((1, 2, 5, 3), BF16))
    lse = dev(np.zeros((1, 2, 5), np.float32))
    forward(dev(q), dev(k), dev(v), None, False, 0.5, out, lse)
    check_forward(out.copy_to_host(), lse.copy_to_host(), q, k, v, scale=0.5)


@pytest.mark.skipif(torch_cuda() is None, reason="needs a GPU and torch with CUDA")
def test_torch_bfloat16_in_torch_bfloat16_out(rng):
    torch = torch_cuda()
    q, k, v = randn(rng, (2, 3, 9, 8)), randn(rng, (2, 3, 7, 8)), randn(rng, (2, 3, 7, 5))

    def put(x):
        return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)

    out, lse = sdpa_numba.scaled_dot_product_attention(put(q), put(k), put(v), is_causal=True,
                                                       return_lse=True)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    host = out.view(torch.int16).cpu().numpy().view(BF16)
    check_forward(host, lse.cpu().numpy(), q, k, v, is_causal=True)
