"""``torch.ops.sdpa_numba.attention_with_kvcache`` with the rotation and cache_batch_idx (the
schema's last, optional arguments): bitwise the NumPy-level API on the same bits, the caller's
caches appended, inputs unmodified, the schema checked by opcheck, and a call without them
(positional variants) unchanged."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_numba  # noqa: E402
import sdpa_numba.torch  # noqa: E402,F401

ops = torch.ops.sdpa_numba


def problem(seed, B=3, Lq=1, Hq=6, H=2, E=8, Ev=5, S=13, new=1, N=None):
    g = torch.Generator().manual_seed(seed)
    N = B if N is None else N

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)
    return r(B, Lq, Hq, E), r(N, S, H, E), r(N, S, H, Ev), r(B, new, H, E), r(B, new, H, Ev)


def tables(n, rd):
    ang = torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(rd // 2, dtype=torch.float64) / (rd // 2))
    return torch.cos(ang), torch.sin(ang)


@pytest.mark.parametrize("interleaved", [False, True])
def test_op_rotation_and_batch_idx_equal_numpy_api(interleaved):
    q, kc, vc, k, v = problem(3, Lq=2, new=2, N=5)
    lens = torch.tensor([2, 0, 7], dtype=torch.int32)
    idx = torch.tensor([3, 0, 4], dtype=torch.int32)
    cos, sin = tables(12, 6)
    saved = [t.clone() for t in (q, k, v, cos, sin, lens, idx)]
    kn, vn = kc.numpy().copy(), vc.numpy().copy()
    out, lse = ops.attention_with_kvcache(q, kc, vc, lens, k, v, scale=0.4, rotary_cos=cos,
                                          rotary_sin=sin, rotary_interleaved=interleaved,
                                          cache_batch_idx=idx)
    want, want_lse = sdpa_numba.attention_with_kvcache(
        q.numpy(), kn, vn, lens.numpy(), k=k.numpy(), v=v.numpy(), scale=0.4,
        rotary_cos=cos.numpy(), rotary_sin=sin.numpy(), rotary_interleaved=interleaved,
        cache_batch_idx=idx.numpy(), return_lse=True)
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    np.testing.assert_array_equal(kc.numpy(), kn)  # the caller's caches were appended to
    np.testing.assert_array_equal(vc.numpy(), vn)
    assert not torch.equal(kc[3, 2:4], k[0])  # rotated, not k as given
    for a, b in zip((q, k, v, cos, sin, lens, idx), saved):
        assert torch.equal(a, b)


def test_op_without_new_arguments_and_positional_variants_unchanged():
    """A call that passes the variants positionally (window, ...) and none of the new
    arguments still works, and equals the NumPy API."""
    q, kc, vc, k, v = problem(4)
    lens = torch.tensor([3, 5, 1], dtype=torch.int32)
    kn, vn = kc.numpy().copy(), vc.numpy().copy()
    out, _ = ops.attention_with_kvcache(q, kc, vc, lens, k, v, None, None, True, None, 4, 0)
    want = sdpa_numba.attention_with_kvcache(q.numpy(), kn, vn, lens.numpy(), k=k.numpy(),
                                             v=v.numpy(), window=(4, 0))
    np.testing.assert_array_equal(out.numpy(), want)


def test_op_refusals_name_the_argument():
    q, kc, vc, k, v = problem(5)
    lens = torch.tensor([3, 5, 1], dtype=torch.int32)
    cos, sin = tables(12, 6)
    before = kc.clone()
    with pytest.raises(ValueError, match="pass k and v"):
        ops.attention_with_kvcache(q, kc, vc, lens, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        ops.attention_with_kvcache(q, kc, vc, lens, k, v,
                                   cache_batch_idx=torch.tensor([0, 0, 1]))
    with pytest.raises(TypeError, match="cache_batch_idx"):
        ops.attention_with_kvcache(q, kc, vc, lens, k, v,
                                   cache_batch_idx=torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(kc, before)


def test_opcheck_with_rotation():
    q, kc, vc, k, v = problem(6)
    lens = torch.tensor([3, 5, 1], dtype=torch.int32)
    cos, sin = tables(12, 8)
    torch.library.opcheck(ops.attention_with_kvcache.default, (q, kc, vc, lens, k, v),
                          dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True,
                               cache_batch_idx=torch.tensor([2, 0, 1], dtype=torch.int32)),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("compiled", [False, True])
def test_public_wrapper_takes_the_rotation_and_batch_idx(compiled):
    """sdpa_numba.torch.attention_with_kvcache passes the four keywords on (eagerly and
    through the operator under torch.compile), bitwise the NumPy API; cache_batch_idx alone
    (no append) too."""
    from sdpa_numba.torch import attention_with_kvcache

    q, kc, vc, k, v = problem(5, Lq=2, new=2, N=4)
    lens = torch.tensor([1, 0, 6], dtype=torch.int32)
    idx = torch.tensor([2, 3, 0], dtype=torch.int64)
    cos, sin = tables(10, 8)
    kn, vn = kc.numpy().copy(), vc.numpy().copy()
    fn = attention_with_kvcache
    if compiled:
        fn = torch.compile(attention_with_kvcache, fullgraph=True, backend="eager")
    out = fn(q, kc, vc, lens, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
             rotary_interleaved=True, cache_batch_idx=idx)
    want = sdpa_numba.attention_with_kvcache(
        q.numpy(), kn, vn, lens.numpy(), k=k.numpy(), v=v.numpy(), rotary_cos=cos.numpy(),
        rotary_sin=sin.numpy(), rotary_interleaved=True, cache_batch_idx=idx.numpy())
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(kc.numpy(), kn)
    read = fn(q, kc, vc, lens + 2, cache_batch_idx=idx)
    np.testing.assert_array_equal(read.numpy(), sdpa_numba.attention_with_kvcache(
        q.numpy(), kn, vn, lens.numpy() + 2, cache_batch_idx=idx.numpy()))
    with pytest.raises(TypeError, match="rotary_cos"):
        attention_with_kvcache(q, kc, vc, lens, k=k, v=v, rotary_cos=cos.numpy(),
                               rotary_sin=sin)
